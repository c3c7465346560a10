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
