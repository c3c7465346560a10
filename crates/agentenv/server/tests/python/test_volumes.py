"""Volumes through the stock SDK's `Volume` (e2b >= 2.4x) against the real server: create, list, the
content API (files, folders, metadata) with the volume's token, per-key isolation, destroy."""

import os
import secrets
import subprocess

import pytest

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
