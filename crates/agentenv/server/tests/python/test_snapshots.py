"""Snapshots and forks through the stock `e2b` SDK (2.63+) against a real agentenv server."""

import secrets
import time

import httpx
import pytest
from e2b import NotFoundException, Sandbox, SandboxException

if not hasattr(Sandbox, "fork") or not hasattr(Sandbox, "create_snapshot"):
    pytest.skip("this e2b SDK predates snapshots and fork", allow_module_level=True)


def _names(paginator):
    out = []
    while paginator.has_next:
        out.extend(paginator.next_items())
    return out


def test_snapshot_restores_files_processes_and_keeps_source(server):
    token = secrets.token_hex(8)
    src = Sandbox.create("base", timeout=300)
    made = []
    try:
        src.files.write("/home/user/state.txt", token)
        src.commands.run(f"sh -c 'echo {token} > /dev/shm/ram.txt'")
        bg = src.commands.run("sleep 600", background=True)
        end_before = src.get_info().end_at
        name = f"snap-{token}"
        snap = src.create_snapshot(name=name)
        assert snap.snapshot_id and f"{name}:default" in snap.names
        # The source keeps running with its id and expiry.
        info = src.get_info()
        assert info.state.value == "running" and info.end_at == end_before
        src.files.write("/home/user/state.txt", "changed-after")

        for ref in (snap.snapshot_id, name):
            s = Sandbox.create(ref, timeout=120)
            made.append(s)
            assert s.sandbox_id != src.sandbox_id
            assert s.files.read("/home/user/state.txt") == token
            assert s.commands.run("cat /dev/shm/ram.txt").stdout.strip() == token
            pids = [p.pid for p in s.commands.list()]
            assert bg.pid in pids, "the background process survived the snapshot"
        # Each restored machine writes only its own disk.
        made[0].files.write("/home/user/state.txt", "first")
        assert made[1].files.read("/home/user/state.txt") == token
        assert src.files.read("/home/user/state.txt") == "changed-after"

        listed = _names(Sandbox.list_snapshots(sandbox_id=src.sandbox_id))
        assert snap.snapshot_id in [x.snapshot_id for x in listed]
    finally:
        for s in made:
            s.kill()
        src.kill()
    # A snapshot outlives its source.
    s = Sandbox.create(snap.snapshot_id, timeout=60)
    try:
        assert s.files.read("/home/user/state.txt") == token
    finally:
        s.kill()
    assert Sandbox.delete_snapshot(snap.snapshot_id) is True
    assert Sandbox.delete_snapshot(snap.snapshot_id) is False
    with pytest.raises(Exception):
        Sandbox.create(snap.snapshot_id, timeout=30)


def test_restored_machines_get_host_clock_and_distinct_entropy(server):
    src = Sandbox.create("base", timeout=300)
    forks = []
    try:
        snap = src.create_snapshot()
        time.sleep(3)
        for _ in range(2):
            forks.append(Sandbox.create(snap.snapshot_id, timeout=60))
        for s in forks:
            guest = float(s.commands.run("date +%s.%N").stdout)
            assert abs(guest - time.time()) < 2.0, "guest clock is the host's"
        draws = [s.commands.run("head -c 16 /dev/urandom | od -An -tx1").stdout for s in forks]
        assert draws[0] != draws[1]
        Sandbox.delete_snapshot(snap.snapshot_id)
    finally:
        for s in forks:
            s.kill()
        src.kill()


def test_filesystem_snapshot_cold_boots_with_the_disk(server):
    src = Sandbox.create("base", timeout=300)
    token = secrets.token_hex(8)
    try:
        src.files.write("/home/user/disk.txt", token)
        src.commands.run("sleep 600", background=True)
        snap = src.create_snapshot(mode="filesystem")
        s = Sandbox.create(snap.snapshot_id, timeout=120)
        try:
            assert s.files.read("/home/user/disk.txt") == token
            assert not any("sleep 600" in " ".join([p.cmd] + list(p.args)) for p in s.commands.list())
        finally:
            s.kill()
        Sandbox.delete_snapshot(snap.snapshot_id)
    finally:
        src.kill()


def test_fork_gives_independent_copies(server):
    src = Sandbox.create("base", timeout=300)
    token = secrets.token_hex(8)
    forks = []
    try:
        src.files.write("/home/user/f.txt", token)
        forks = src.fork(count=3, timeout=120)
        assert len(forks) == 3
        ids = {f.sandbox_id for f in forks}
        assert len(ids) == 3 and src.sandbox_id not in ids
        for i, f in enumerate(forks):
            assert f.files.read("/home/user/f.txt") == token
            f.files.write("/home/user/f.txt", f"fork{i}")
        for i, f in enumerate(forks):
            assert f.files.read("/home/user/f.txt") == f"fork{i}"
        assert src.files.read("/home/user/f.txt") == token
        assert src.is_running()
    finally:
        for f in forks:
            f.kill()
        src.kill()


def test_bad_snapshot_and_fork_input(server):
    with pytest.raises(NotFoundException):
        Sandbox.create_snapshot("i-do-not-exist")
    with pytest.raises(NotFoundException):
        Sandbox.fork("i-do-not-exist")
    src = Sandbox.create("base", timeout=120)
    try:
        with pytest.raises(SandboxException) as e:
            src.create_snapshot(name="bad name/with slash")
        assert "invalid snapshot name" in str(e.value)
    finally:
        src.kill()
    assert Sandbox.delete_snapshot("no-such-snapshot") is False


def _stored(server, snapshot_id, sandbox_id):
    """The chunk-store figures of one snapshot (agentenv fields of GET /snapshots), once ingested."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        r = httpx.get(f"{server.url}/snapshots", params={"sandboxID": sandbox_id},
                      headers={"X-API-KEY": server.api_key})
        r.raise_for_status()
        for s in r.json():
            if s["snapshotID"] == snapshot_id and "storedBytesNew" in s:
                return s["storedBytesNew"], s["storedBytesData"]
        time.sleep(0.2)
    raise AssertionError(f"snapshot {snapshot_id} was not stored as chunks within 60 s")


def test_snapshots_are_incremental_chunks(server):
    src = Sandbox.create("base", timeout=300)
    try:
        first = src.create_snapshot()
        new1, data1 = _stored(server, first.snapshot_id, src.sandbox_id)
        # Chunks are shared across sandboxes: earlier snapshots of the same template may already hold
        # most of this one's, so only its data size is bounded from below.
        assert data1 > 1 << 20 and data1 >= new1
        src.commands.run("head -c 1048576 /dev/urandom > /home/user/blob.bin && sync")
        second = src.create_snapshot()
        new2, data2 = _stored(server, second.snapshot_id, src.sandbox_id)
        # The guest wrote 1 MiB: the second snapshot stores that and the RAM the command changed, not a
        # full copy (measured ~13 % of the first; the target of 10 % is tracked in the bench).
        print(f"first snapshot: {new1} new of {data1} data bytes; second: {new2} new of {data2}")
        assert (1 << 20) <= new2 <= data1 // 5, (new1, data1, new2, data2)
        assert data2 >= data1
        s = Sandbox.create(second.snapshot_id, timeout=60)
        try:
            assert s.commands.run("stat -c %s /home/user/blob.bin").stdout.strip() == "1048576"
        finally:
            s.kill()
        for snap in (first, second):
            Sandbox.delete_snapshot(snap.snapshot_id)
    finally:
        src.kill()
