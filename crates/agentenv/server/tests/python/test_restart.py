"""A server restart keeps paused sandboxes paused and re-attaches running ones."""

import secrets

from conftest import pause
from e2b import Sandbox, SandboxState


def test_restart_keeps_running_and_paused(server):
    running = Sandbox.create("base", timeout=600)
    paused = Sandbox.create("base", timeout=600)
    try:
        a, b = secrets.token_hex(8), secrets.token_hex(8)
        running.files.write("/tmp/a.txt", a)
        paused.files.write("/tmp/b.txt", b)
        h = paused.commands.run("sleep 900", background=True)
        assert pause(paused) in (True, None)

        server.restart()

        assert Sandbox.get_info(running.sandbox_id).state == SandboxState.RUNNING
        assert running.files.read("/tmp/a.txt") == a
        assert running.commands.run("echo up").stdout == "up\n"
        assert Sandbox.get_info(paused.sandbox_id).state == SandboxState.PAUSED
        back = Sandbox.connect(paused.sandbox_id)
        assert back.files.read("/tmp/b.txt") == b
        assert h.pid in [p.pid for p in back.commands.list()]
    finally:
        running.kill()
        paused.kill()
