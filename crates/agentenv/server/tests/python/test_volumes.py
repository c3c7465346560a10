"""Volumes through the stock SDK's `Volume` (e2b >= 2.4x) against the real server: create, list, the
content API (files, folders, metadata) with the volume's token, per-key isolation, destroy, and
volumes mounted into sandboxes (`Sandbox.create(volume_mounts=...)`), across a pause and a fork."""

import os
import secrets
import subprocess

import pytest

from conftest import pause

e2b = pytest.importorskip("e2b")
if not hasattr(e2b, "Volume"):
    pytest.skip(f"e2b {e2b.__version__ if hasattr(e2b, '__version__') else '?'} has no Volume",
                allow_module_level=True)


@pytest.fixture
def volume_env(server):
    os.environ["E2B_VOLUME_API_URL"] = server.url
    yield server
    os.environ.pop("E2B_VOLUME_API_URL", None)


def test_a_volume_keeps_files_for_its_key_alone(volume_env):
    name = f"vol-{secrets.token_hex(4)}"
    vol = e2b.Volume.create(name)
    try:
        assert name in [v.name for v in e2b.Volume.list()]
        body = secrets.token_bytes(secrets.randbelow(200_000) + 1)
        vol.make_dir("/data/nested", force=True)
        stat = vol.write_file("/data/blob.bin", body)
        assert (stat.path, stat.size, stat.type.value) == ("/data/blob.bin", len(body), "file")
        assert vol.read_file("/data/blob.bin", format="bytes") == body
        with pytest.raises(e2b.VolumeException):
            vol.write_file("/data/blob.bin", b"again")  # exists; force overwrites
        vol.write_file("/data/blob.bin", b"again", force=True)
        assert vol.read_file("/data/blob.bin") == "again"
        assert sorted(e.path for e in vol.list("/data")) == ["/data/blob.bin", "/data/nested"]
        vol.update_metadata("/data/blob.bin", mode=0o600)
        assert vol.get_info("/data/blob.bin").mode == 0o600
        with pytest.raises(e2b.VolumePathNotFoundException):
            vol.read_file("/data/missing")
        vol.remove("/data")
        assert not vol.exists("/data/blob.bin")

        # Another key neither sees nor opens it; the same name is its own there.
        out = subprocess.run([volume_env.binary, "keys", "--state-dir", volume_env.state_dir, "create",
                              f"team-{secrets.token_hex(3)}"], check=True, capture_output=True, text=True)
        other = out.stdout.strip().splitlines()[-1]
        assert vol.volume_id not in [v.volume_id for v in e2b.Volume.list(api_key=other)]
        with pytest.raises(e2b.NotFoundException):
            e2b.Volume.connect(vol.volume_id, api_key=other)
        theirs = e2b.Volume.create(name, api_key=other)
        assert theirs.volume_id != vol.volume_id
        assert e2b.Volume.destroy(theirs.volume_id, api_key=other)
    finally:
        assert e2b.Volume.destroy(vol.volume_id)
    assert not e2b.Volume.destroy(vol.volume_id)


def test_a_mounted_volume_is_shared_by_sandboxes_and_the_content_api(volume_env):
    from e2b import Sandbox

    vol = e2b.Volume.create(f"mnt-{secrets.token_hex(4)}")
    boxes = []
    try:
        seed = secrets.token_hex(16)
        vol.write_file("/seed.txt", seed)
        sbx = Sandbox.create("base", timeout=600, volume_mounts={"/mnt/data": vol})
        boxes.append(sbx)
        assert [(m["name"], m["path"]) for m in sbx.get_info().volume_mounts] == [(vol.name, "/mnt/data")]
        assert sbx.commands.run("cat /mnt/data/seed.txt").stdout == seed
        # Written in the sandbox (the SDK's files API, a shell as `user`): read through the API.
        body = secrets.token_bytes(secrets.randbelow(400_000) + 200_000)
        sbx.files.write("/mnt/data/deep/blob.bin", body)
        assert vol.read_file("/deep/blob.bin", format="bytes") == body
        sbx.commands.run("echo -n hi > /mnt/data/deep/u.txt && mv /mnt/data/deep /mnt/data/moved "
                         "&& ln -s moved/u.txt /mnt/data/link && chmod 640 /mnt/data/moved/u.txt")
        info = vol.get_info("/moved/u.txt")
        assert (info.uid, info.mode) == (1000, 0o640)
        assert sbx.commands.run("cat /mnt/data/link").stdout == "hi"
        assert sbx.commands.run("sha256sum < /mnt/data/moved/blob.bin").stdout.split()[0] == \
            __import__("hashlib").sha256(body).hexdigest()
        # A symlink the guest made is never followed by the server.
        sbx.commands.run("ln -s /etc /mnt/data/etc")
        with pytest.raises(e2b.VolumePathNotFoundException):
            vol.read_file("/etc/passwd")

        # Across a pause and a resume, and into a fork, the mount stays.
        assert pause(sbx) is not False
        sbx = Sandbox.connect(sbx.sandbox_id)
        vol.write_file("/after-pause.txt", "p")
        assert sbx.commands.run("cat /mnt/data/after-pause.txt").stdout == "p"
        if hasattr(sbx, "fork"):
            (fork,) = sbx.fork(count=1)
            assert not isinstance(fork, Exception), fork
            boxes.append(fork)
            fork.commands.run("echo -n f > /mnt/data/from-fork.txt")
            assert vol.read_file("/from-fork.txt") == "f"
        # A second sandbox sees the same files.
        other = Sandbox.create("base", timeout=600, volume_mounts={"/data": vol.name})
        boxes.append(other)
        assert other.commands.run("cat /data/moved/u.txt").stdout == "hi"
        other.commands.run("rm -r /data/moved")
        assert not vol.exists("/moved")
    finally:
        for b in boxes:
            try:
                b.kill()
            except Exception:
                pass
        assert e2b.Volume.destroy(vol.volume_id)


def test_common_tools_work_on_a_mounted_volume(volume_env):
    """git, tar, Python's mmap and sqlite3, and a large sequential write, as a user would run them."""
    from e2b import Sandbox

    vol = e2b.Volume.create(f"tools-{secrets.token_hex(4)}")
    sbx = None
    try:
        sbx = Sandbox.create("base", timeout=600, volume_mounts={"/work": vol})
        run = lambda cmd: sbx.commands.run(cmd, timeout=300).stdout  # noqa: E731
        run("cd /work && git init -q repo && cd repo && git config user.email a@b && git config user.name a "
            "&& echo one > f && git add f && git commit -qm one && echo two >> f && git commit -qam two")
        assert run("cd /work/repo && git log --format=%s").split() == ["two", "one"]
        assert run("cd /work/repo && git fsck --strict 2>&1; echo rc=$?").strip().endswith("rc=0")
        run("mkdir -p /tmp/src/a/b && head -c 300000 /dev/urandom > /tmp/src/a/b/r.bin "
            "&& ln -s b/r.bin /tmp/src/a/l && tar -C /tmp -cf /tmp/src.tar src && tar -C /work -xf /tmp/src.tar")
        assert run("cmp /tmp/src/a/b/r.bin /work/src/a/b/r.bin && readlink /work/src/a/l") == "b/r.bin\n"
        code = ("import mmap, sqlite3\n"
                "with open('/work/m.bin', 'w+b') as f:\n"
                "    f.truncate(1 << 20)\n"
                "    m = mmap.mmap(f.fileno(), 0)\n"
                "    m[4096:4101] = b'hello'\n"
                "    m.flush()\n"
                "    m.close()\n"
                "db = sqlite3.connect('/work/t.db')\n"
                "db.execute('create table t (x)')\n"
                "db.executemany('insert into t values (?)', [(i,) for i in range(1000)])\n"
                "db.commit()\n"
                "print(db.execute('select sum(x) from t').fetchone()[0])\n")
        sbx.files.write("/tmp/t.py", code)
        assert run("python3 /tmp/t.py").strip() == str(sum(range(1000)))
        assert vol.read_file("/m.bin", format="bytes")[4096:4101] == b"hello"
        run("dd if=/dev/zero of=/work/big bs=1M count=24 status=none && sync")
        assert vol.get_info("/big").size == 24 << 20
        assert "/work" in run("df -P /work | tail -1")
    finally:
        if sbx:
            sbx.kill()
        assert e2b.Volume.destroy(vol.volume_id)
