"""Named API keys through the stock `e2b` SDK: each key sees and controls only its own sandboxes and
snapshots, has its own quota, and a revoked key is refused at once (keys made by `agentenv keys` while the
server runs)."""

import secrets
import subprocess

import pytest
from e2b import AuthenticationException, NotFoundException, Sandbox


def _keys(server, *args):
    out = subprocess.run(
        [server.binary, "keys", "--state-dir", server.state_dir, *args],
        check=True, capture_output=True, text=True, timeout=30,
    )
    return out.stdout.strip()


def _new_key(server, *quota):
    name = f"t{secrets.token_hex(4)}"
    return name, _keys(server, "create", name, *quota)


def _ids(api_key):
    pager = Sandbox.list(api_key=api_key)
    out = []
    while pager.has_next:
        out.extend(s.sandbox_id for s in pager.next_items())
    return out


def test_a_key_sees_and_controls_only_its_own(server):
    (_, a), (b_name, b) = _new_key(server), _new_key(server)
    sbx = Sandbox.create("base", timeout=300, api_key=a)
    try:
        assert sbx.commands.run("echo mine").stdout == "mine\n"
        assert sbx.sandbox_id in _ids(a)
        assert sbx.sandbox_id not in _ids(b)
        assert sbx.sandbox_id not in _ids(server.api_key)
        with pytest.raises(NotFoundException):
            Sandbox.connect(sbx.sandbox_id, api_key=b)
        with pytest.raises(NotFoundException):
            Sandbox.get_info(sbx.sandbox_id, api_key=b)
        assert Sandbox.kill(sbx.sandbox_id, api_key=b) is False
        with pytest.raises(NotFoundException):
            Sandbox.set_timeout(sbx.sandbox_id, 30, api_key=b)
        if hasattr(Sandbox, "create_snapshot"):
            with pytest.raises(NotFoundException):
                Sandbox.create_snapshot(sbx.sandbox_id, api_key=b)
            with pytest.raises(NotFoundException):
                Sandbox.fork(sbx.sandbox_id, api_key=b)
            snap = sbx.create_snapshot(name="mine")
            assert snap.names == ["mine:default"]

            def listed(key):
                pager = Sandbox.list_snapshots(api_key=key)
                out = []
                while pager.has_next:
                    out.extend(x.snapshot_id for x in pager.next_items())
                return out

            assert snap.snapshot_id in listed(a)
            assert snap.snapshot_id not in listed(b)
            with pytest.raises(Exception):
                Sandbox.create("mine", timeout=30, api_key=b)
            assert Sandbox.delete_snapshot(snap.snapshot_id, api_key=b) is False
            assert Sandbox.delete_snapshot(snap.snapshot_id, api_key=a) is True
        # B tried everything; A's sandbox is untouched.
        assert sbx.is_running()
        assert sbx.commands.run("echo still").stdout == "still\n"
    finally:
        sbx.kill()
    _keys(server, "revoke", b_name)
    with pytest.raises(AuthenticationException):
        _ids(b)
    listing = _keys(server, "ls", "--json")
    assert a not in listing and b not in listing, "keys are never shown again"
    assert b_name in listing and b[:12] in listing


def _post(server, path, key, body):
    """(status, JSON body) of a raw POST to the server's API."""
    import json
    import urllib.error
    import urllib.request

    req = urllib.request.Request(f"{server.url}{path}", data=json.dumps(body).encode(), method="POST",
                                 headers={"X-API-Key": key, "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def test_no_key_can_take_over_the_base_template_or_an_unnamed_snapshot(server):
    """Security: a named key cannot rebuild the shared `base` (it used to answer 201 and give every
    tenant its machine), and starting from another key's unnamed snapshot id neither works nor moves
    the snapshot to another owner."""
    (_, a), (_, b) = _new_key(server), _new_key(server)
    status, body = _post(server, "/templates", b, {"templateID": "base", "memoryMB": 192})
    assert status == 403, body
    status, body = _post(server, "/templates", b, {"templateID": "bogus", "aliases": ["base"]})
    assert status == 403, body
    sbx = Sandbox.create("base", timeout=300, api_key=a)
    try:
        mem_kib = int(sbx.commands.run("awk '/MemTotal/ {print $2}' /proc/meminfo").stdout)
        assert mem_kib > 200 * 1024, f"base came up with {mem_kib} KiB"
        if not hasattr(sbx, "create_snapshot"):  # e2b < 2.x: no snapshots
            return
        snap = sbx.create_snapshot()
        with pytest.raises(Exception) as refused:
            Sandbox.create(snap.snapshot_id, timeout=60, api_key=b)
        assert "not found" in str(refused.value).lower(), refused.value
        pager = Sandbox.list_snapshots(api_key=a)
        mine = []
        while pager.has_next:
            mine.extend(x.snapshot_id for x in pager.next_items())
        assert snap.snapshot_id in mine, "the maker still owns its unnamed snapshot"
        other = Sandbox.create(snap.snapshot_id, timeout=300, api_key=a)
        other.kill()
    finally:
        sbx.kill()


def test_a_key_quota_holds_only_that_key(server):
    _, capped = _new_key(server, "--max-running", "1")
    first = Sandbox.create("base", timeout=120, api_key=capped)
    other = None
    try:
        with pytest.raises(Exception) as e:
            Sandbox.create("base", timeout=120, api_key=capped)
        assert "quota" in str(e.value).lower() or "429" in str(e.value)
        _, free = _new_key(server)
        other = Sandbox.create("base", timeout=120, api_key=free)
        assert other.commands.run("true").exit_code == 0
    finally:
        first.kill()
        if other:
            other.kill()
    # The freed place can be taken again.
    again = Sandbox.create("base", timeout=60, api_key=capped)
    again.kill()
