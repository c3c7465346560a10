"""A sandbox killed under a streaming command: the client's connection ends with a reset, not a clean close
(E2B's proxy resets its HTTP/2 stream; over HTTP/1.1 a clean close after a cut chunked body reads as a
protocol error), so the SDK takes it for the transport failure it is, asks whether the sandbox is gone, and
says it was killed (E2B's `test_kill_sandbox_while_command_is_running`)."""

import pytest

from conftest import end_of_a_stream_whose_sandbox_is_killed


def test_the_connection_is_reset_when_the_sandbox_dies_under_a_command(server):
    from e2b import Sandbox

    sbx = Sandbox.create("base", timeout=300)
    assert end_of_a_stream_whose_sandbox_is_killed(server.url, server.api_key, sbx.sandbox_id) == "reset"


def test_the_sdk_says_the_sandbox_was_killed_under_its_command(server):
    import e2b.envd.rpc as rpc
    from e2b import Sandbox, TimeoutException

    if not hasattr(rpc, "handle_rpc_exception_with_health"):
        pytest.skip("this SDK does not probe a sandbox after a transport failure (added in 2.4x)")
    sbx = Sandbox.create("base", timeout=300)
    cmd = sbx.commands.run("sleep 60", background=True)
    sbx.kill()
    with pytest.raises(TimeoutException) as e:
        cmd.wait()
    assert "sandbox was killed or reached its end of life" in str(e.value)
