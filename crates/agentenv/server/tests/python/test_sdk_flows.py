"""docs/specs/e2b-compat.md §7: flows through the stock `e2b` SDK against a real agentenv server."""

import secrets
import time
from datetime import datetime, timezone

import httpx
import pytest
from conftest import pause
from e2b import (
    CommandExitException,
    NotFoundException,
    Sandbox,
    SandboxQuery,
    SandboxState,
)


def test_create_and_echo(server):
    token = secrets.token_hex(8)
    sbx = Sandbox.create("base", timeout=300, envs={"TOKEN": token}, metadata={"suite": "flows", "t": token})
    try:
        r = sbx.commands.run("echo hello")
        assert r.stdout == "hello\n" and r.exit_code == 0
        r = sbx.commands.run("echo $TOKEN")
        assert r.stdout.strip() == token
        info = sbx.get_info()
        assert info.sandbox_id == sbx.sandbox_id
        assert info.metadata == {"suite": "flows", "t": token}
        assert info.state == SandboxState.RUNNING
        assert sbx.is_running()
    finally:
        assert sbx.kill() is True


def test_exit_codes_env_cwd_user(sandbox):
    with pytest.raises(CommandExitException) as exc:
        sandbox.commands.run("echo oops >&2; exit 3")
    assert exc.value.exit_code == 3
    assert "oops" in exc.value.stderr
    val = secrets.token_hex(6)
    assert sandbox.commands.run("echo $V", envs={"V": val}).stdout.strip() == val
    assert sandbox.commands.run("pwd", cwd="/tmp").stdout.strip() == "/tmp"
    assert sandbox.commands.run("whoami", user="root").stdout.strip() == "root"
    assert sandbox.commands.run("whoami").stdout.strip() == "user"


def test_background_list_kill_connect_stdin(sandbox):
    h = sandbox.commands.run("sleep 600", background=True)
    pids = [p.pid for p in sandbox.commands.list()]
    assert h.pid in pids
    assert sandbox.commands.kill(h.pid) is True
    with pytest.raises(CommandExitException):
        h.wait()
    assert h.pid not in [p.pid for p in sandbox.commands.list()]
    assert sandbox.commands.kill(h.pid) is False

    word = secrets.token_hex(4)
    cat = sandbox.commands.run("head -c 8 > /tmp/stdin.txt; cat /tmp/stdin.txt", background=True, stdin=True)
    attached = sandbox.commands.connect(cat.pid)
    sandbox.commands.send_stdin(cat.pid, word)
    result = attached.wait()
    assert result.stdout == word
    cat.wait()


def test_a_command_past_its_timeout_raises_timeout_and_a_cut_connect_leaves_it_running(sandbox):
    """As envd: a command killed at its `timeout` ends its stream with `deadline_exceeded`, so the SDK
    raises TimeoutException (sync and async; the async SDK has no deadline of its own here); a
    `connect` cut at its own timeout leaves the process running."""
    import asyncio

    from e2b import AsyncSandbox, TimeoutException

    with pytest.raises(TimeoutException):
        sandbox.commands.run("sleep 30", timeout=2)

    async def run_async():
        a = await AsyncSandbox.connect(sandbox.sandbox_id)
        with pytest.raises(TimeoutException):
            await a.commands.run("sleep 30", timeout=2)

    asyncio.run(run_async())
    h = sandbox.commands.run("sleep 600", background=True)
    attached = sandbox.commands.connect(h.pid, timeout=2)
    with pytest.raises(TimeoutException):
        attached.wait()
    assert h.pid in [p.pid for p in sandbox.commands.list()], "the process outlives the cut connect"
    assert sandbox.commands.kill(h.pid) is True


def test_files(sandbox):
    name = f"/home/user/dir-{secrets.token_hex(4)}"
    text = secrets.token_hex(64)
    blob = secrets.token_bytes(300_000)
    assert sandbox.files.make_dir(name) is True
    assert sandbox.files.make_dir(name) is False
    sandbox.files.write(f"{name}/a.txt", text)
    sandbox.files.write(f"{name}/b.bin", blob)
    assert sandbox.files.read(f"{name}/a.txt") == text
    assert bytes(sandbox.files.read(f"{name}/b.bin", format="bytes")) == blob
    names = sorted(e.name for e in sandbox.files.list(name))
    assert names == ["a.txt", "b.bin"]
    assert sandbox.files.exists(f"{name}/a.txt")
    assert sandbox.files.get_info(f"{name}/b.bin").size == len(blob)
    sandbox.files.rename(f"{name}/a.txt", f"{name}/c.txt")
    assert not sandbox.files.exists(f"{name}/a.txt")
    assert sandbox.files.read(f"{name}/c.txt") == text
    sandbox.files.remove(name)
    assert not sandbox.files.exists(name)


def _sdk_writes_file_metadata():
    import inspect

    from e2b.sandbox_sync.filesystem.filesystem import Filesystem

    return "metadata" in inspect.signature(Filesystem.write).parameters


@pytest.mark.skipif(
    not _sdk_writes_file_metadata(),
    reason="this e2b SDK has no file metadata (envd 0.6.2; the SDK floor 2.7 predates it)",
)
def test_file_metadata_is_kept_listed_moved_and_replaced(sandbox):
    d = f"/home/user/meta-{secrets.token_hex(4)}"
    meta = {"owner": secrets.token_hex(6), "Stage": "draft one"}
    info = sandbox.files.write(f"{d}/a.txt", "x", metadata=meta)
    want = {"owner": meta["owner"], "stage": "draft one"}  # keys are lowercased
    assert info.metadata == want
    assert sandbox.files.get_info(f"{d}/a.txt").metadata == want
    listed = {e.name: e.metadata for e in sandbox.files.list(d)}
    assert listed == {"a.txt": want}
    sandbox.files.rename(f"{d}/a.txt", f"{d}/b.txt")
    assert sandbox.files.get_info(f"{d}/b.txt").metadata == want
    # An overwrite without metadata clears it; one set in the sandbox shows.
    sandbox.files.write(f"{d}/b.txt", "y")
    assert not sandbox.files.get_info(f"{d}/b.txt").metadata
    r = sandbox.commands.run(f"python3 -c \"import os; os.setxattr('{d}/b.txt', 'user.e2b.k', b'v')\"")
    assert r.exit_code == 0, r.stderr
    assert sandbox.files.get_info(f"{d}/b.txt").metadata == {"k": "v"}
    with pytest.raises(Exception):
        sandbox.files.write(f"{d}/c.txt", "z", metadata={"bad key": "v"})


def _sdk_watch_takes(param):
    import inspect

    from e2b.sandbox_sync.filesystem.filesystem import Filesystem

    return param in inspect.signature(Filesystem.watch_dir).parameters


@pytest.mark.skipif(
    not _sdk_watch_takes("include_entry"),
    reason="this e2b SDK has no entry info in watch events (envd 0.6.3; the SDK floor 2.7 predates it)",
)
def test_watch_events_carry_their_entry_only_when_asked(sandbox):
    from e2b import FileType, FilesystemEventType

    d = f"/home/user/watch-{secrets.token_hex(4)}"
    sandbox.files.make_dir(d)
    handle = sandbox.files.watch_dir(d, include_entry=True)
    sandbox.files.write(f"{d}/a.txt", "x" * 10)
    deadline = time.monotonic() + 30
    writes = []
    while not writes and time.monotonic() < deadline:
        writes = [e for e in handle.get_new_events() if e.type == FilesystemEventType.WRITE and e.name == "a.txt"]
        time.sleep(0.2)
    handle.stop()
    assert writes, "no WRITE event for a.txt"
    entry = writes[-1].entry
    assert entry is not None and entry.path == f"{d}/a.txt" and entry.type == FileType.FILE, entry
    # Without the flag, events carry no entry.
    handle = sandbox.files.watch_dir(d)
    sandbox.files.write(f"{d}/a.txt", "y")
    deadline = time.monotonic() + 30
    events = []
    while not events and time.monotonic() < deadline:
        events = handle.get_new_events()
        time.sleep(0.2)
    handle.stop()
    assert events and all(e.entry is None for e in events), events


def test_signed_file_urls_need_no_headers(sandbox):
    p = f"/home/user/signed-{secrets.token_hex(4)}.txt"
    text = secrets.token_hex(16)
    sandbox.files.write(p, text)
    url = sandbox.download_url(p, use_signature_expiration=60)
    assert "signature=" in url
    r = httpx.get(url)
    assert r.status_code == 200 and r.text == text, r.text
    assert httpx.get(url.replace("signature=v1_", "signature=v1_x")).status_code == 401
    name = p.rsplit("/", 1)[1]
    other = url.replace(name, name + "x")
    assert other != url
    assert httpx.get(other).status_code == 401, "another file"
    expired = httpx.get(sandbox.download_url(p, use_signature_expiration=-120))
    assert expired.status_code == 401
    assert expired.json() == {"code": 401, "message": "signature is already expired"}


def test_pause_resume_keeps_files_and_processes(server):
    sbx = Sandbox.create("base", timeout=600)
    try:
        content = secrets.token_hex(16)
        sbx.files.write("/tmp/keep.txt", content)
        h = sbx.commands.run("sleep 900", background=True)
        assert pause(sbx) in (True, None)
        assert Sandbox.get_info(sbx.sandbox_id).state == SandboxState.PAUSED
        assert pause(sbx) in (False, None)
        again = httpx.post(f"{server.url}/sandboxes/{sbx.sandbox_id}/pause", headers={"X-API-KEY": server.api_key})
        assert again.status_code == 409
        assert not sbx.is_running()

        resumed = Sandbox.connect(sbx.sandbox_id)
        assert resumed.sandbox_id == sbx.sandbox_id
        assert resumed.get_info().state == SandboxState.RUNNING
        assert resumed.files.read("/tmp/keep.txt") == content
        assert h.pid in [p.pid for p in resumed.commands.list()]
        # The old object still works (same access token across pause/resume).
        assert sbx.files.read("/tmp/keep.txt") == content
        assert sbx.commands.run("echo again").stdout == "again\n"
        # Connecting a running sandbox is fine too.
        assert Sandbox.connect(sbx.sandbox_id).is_running()
    finally:
        sbx.kill()


def test_a_pause_without_memory_keeps_files_and_cold_boots_on_connect(server):
    key = {"X-API-KEY": server.api_key}
    body = {"templateID": "base", "timeout": 3, "autoPause": True, "autoPauseMemory": False,
            "autoResume": {"enabled": True}}
    refused = httpx.post(f"{server.url}/v2/sandboxes", headers=key, json=body)
    assert refused.status_code == 400 and "autoPauseMemory" in refused.json()["message"], refused.text
    secret = secrets.token_hex(8)
    body = {**body, "autoResume": {"enabled": False}, "envVars": {"K3_SECRET": secret}}
    created = httpx.post(f"{server.url}/v2/sandboxes", headers=key, json=body)
    assert created.status_code == 201, created.text
    sid = created.json()["sandboxID"]
    envd = {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "49983",
            "X-Access-Token": created.json()["envdAccessToken"]}

    def envd_file(path, data=None):
        """A file through envd's /files (no connect: that would move the timeout)."""
        if data is None:
            r = httpx.get(f"{server.url}/files", params={"path": path}, headers=envd)
        else:
            r = httpx.post(f"{server.url}/files", params={"path": path}, content=data,
                           headers={**envd, "Content-Type": "application/octet-stream"})
        assert r.status_code == 200, r.text
        return r.text

    try:
        content = secrets.token_hex(16)
        envd_file("/home/user/keep.txt", content.encode())
        boots = [envd_file("/proc/sys/kernel/random/boot_id").strip()]
        assert len(boots[0]) == 36, boots
        deadline = time.monotonic() + 60
        while Sandbox.get_info(sid).state != SandboxState.PAUSED:
            assert time.monotonic() < deadline, "sandbox did not auto-pause within 60 s"
            time.sleep(0.5)
        # Traffic does not wake it: it has to boot, and only connect does that.
        r = httpx.get(f"{server.url}/files", params={"path": "/home/user/keep.txt"}, headers=envd)
        assert r.status_code >= 400, r.text
        assert Sandbox.get_info(sid).state == SandboxState.PAUSED
        for _ in range(2):
            back = Sandbox.connect(sid, timeout=600)
            assert back.files.read("/home/user/keep.txt") == content
            assert back.commands.run("echo $K3_SECRET").stdout == f"{secret}\n"
            boots.append(back.commands.run("cat /proc/sys/kernel/random/boot_id").stdout.strip())
            # Then paused by hand, without memory.
            r = httpx.post(f"{server.url}/sandboxes/{sid}/pause", headers=key, json={"memory": False})
            assert r.status_code == 204, r.text
            assert Sandbox.get_info(sid).state == SandboxState.PAUSED
        assert len(set(boots)) == 3, boots
    finally:
        Sandbox.kill(sid)


def test_set_timeout_moves_end_at(sandbox):
    before = sandbox.get_info().end_at
    sandbox.set_timeout(30)
    shortened = sandbox.get_info().end_at
    assert shortened < before
    sandbox.set_timeout(1200)
    extended = sandbox.get_info().end_at
    assert extended > before
    assert (extended - datetime.now(timezone.utc)).total_seconds() > 1000


def test_timeout_kills(server):
    sbx = Sandbox.create("base", timeout=2)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            Sandbox.get_info(sbx.sandbox_id)
        except NotFoundException:
            break
        time.sleep(0.5)
    else:
        pytest.fail("sandbox with timeout=2 still exists after 60 s")
    assert Sandbox.kill(sbx.sandbox_id) is False


def test_list_filters_and_paging(server):
    tag = secrets.token_hex(6)
    boxes = [Sandbox.create("base", timeout=300, metadata={"tag": tag, "i": str(i)}) for i in range(3)]
    try:
        pause(boxes[2])
        seen = []
        pager = Sandbox.list(query=SandboxQuery(metadata={"tag": tag}), limit=2)
        pages = 0
        while pager.has_next:
            seen.extend(i.sandbox_id for i in pager.next_items())
            pages += 1
        assert sorted(seen) == sorted(b.sandbox_id for b in boxes)
        assert seen == [b.sandbox_id for b in reversed(boxes)], "newest first, as E2B"
        assert pages == 2
        running = Sandbox.list(query=SandboxQuery(metadata={"tag": tag}, state=[SandboxState.RUNNING])).next_items()
        assert sorted(i.sandbox_id for i in running) == sorted(b.sandbox_id for b in boxes[:2])
        paused = Sandbox.list(query=SandboxQuery(metadata={"tag": tag, "i": "2"}, state=[SandboxState.PAUSED])).next_items()
        assert [i.sandbox_id for i in paused] == [boxes[2].sandbox_id]
    finally:
        for b in boxes:
            b.kill()


def test_kill_removes_everywhere(server):
    sbx = Sandbox.create("base", timeout=300, metadata={"kill": "me"})
    sid = sbx.sandbox_id
    assert sbx.kill() is True
    listed = Sandbox.list(query=SandboxQuery(metadata={"kill": "me"})).next_items()
    assert sid not in [i.sandbox_id for i in listed]
    with pytest.raises(NotFoundException):
        Sandbox.get_info(sid)
    assert Sandbox.kill(sid) is False
    assert not sbx.is_running()
    with pytest.raises(Exception) as exc:
        sbx.commands.run("echo unreachable")
    assert "not found" in str(exc.value).lower() or "not running" in str(exc.value).lower()


def test_auto_pause_on_timeout_and_auto_resume(server):
    key = {"X-API-KEY": server.api_key}
    body = {"templateID": "base", "timeout": 3, "autoPause": True, "autoResume": {"enabled": True}}
    created = httpx.post(f"{server.url}/v2/sandboxes", headers=key, json=body)
    assert created.status_code == 201, created.text
    sid, token = created.json()["sandboxID"], created.json()["envdAccessToken"]
    envd = {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "49983", "X-Access-Token": token}
    try:
        content = secrets.token_hex(8).encode()
        up = httpx.post(f"{server.url}/files", params={"path": "/tmp/auto.txt"}, content=content,
                        headers={**envd, "Content-Type": "application/octet-stream"})
        assert up.status_code == 200, up.text
        deadline = time.monotonic() + 60
        while Sandbox.get_info(sid).state != SandboxState.PAUSED:
            assert time.monotonic() < deadline, "sandbox did not auto-pause within 60 s"
            time.sleep(0.5)
        detail = httpx.get(f"{server.url}/sandboxes/{sid}", headers=key).json()
        assert detail["lifecycle"] == {"autoResume": True, "onTimeout": "pause"}
        # Data-plane traffic resumes it.
        down = httpx.get(f"{server.url}/files", params={"path": "/tmp/auto.txt"}, headers=envd)
        assert down.status_code == 200 and down.content == content
        assert Sandbox.get_info(sid).state == SandboxState.RUNNING
    finally:
        Sandbox.kill(sid)
