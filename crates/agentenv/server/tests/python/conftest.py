"""Starts a real `agentenv` server on loopback (real runtime, real TCG guests) for the SDK tests.

Environment:
  AGENTENV_BIN        path of the `agentenv` binary (set by `cargo test --test python_sdk`)
  AGENTENV_GUEST_BIN  path of the `agentenv-guest` binary put into the template (optional)
  AGENTENV_ACCEL      auto | kvm | tcg (default auto: KVM only where a probe guest boots)
"""

import os
import socket
import subprocess
import tempfile
import time
import urllib.request

import pytest

MAX_UPLOAD = 8 * 1024 * 1024
READY_TIMEOUT_S = 900  # the first start builds the default template


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One agentenv process on a fixed port and state folder; restartable."""

    def __init__(self, binary: str, state_dir: str, extra_args=(), listen_host: str = "127.0.0.1"):
        self.binary = binary
        self.extra_args = list(extra_args)
        self.listen_host = listen_host
        self.state_dir = state_dir
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = None
        self.log_path = os.path.join(state_dir, "server.log")

    def start(self):
        cmd = [
            self.binary, "serve",
            "--listen", f"{self.listen_host}:{self.port}",
            "--state-dir", self.state_dir,
            "--accel", os.environ.get("AGENTENV_ACCEL", "auto"),
            "--max-upload-bytes", str(MAX_UPLOAD),
            *self.extra_args,
        ]
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"agentenv exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 204:
                        break
            except OSError:
                time.sleep(0.3)
        else:
            raise RuntimeError(f"agentenv not ready after {READY_TIMEOUT_S} s:\n{self.log_tail()}")
        with open(os.path.join(self.state_dir, "server", "api_key")) as f:
            self.api_key = f.read().strip()

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def restart(self):
        self.stop()
        self.start()

    def log_tail(self, n: int = 60) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return b"\n".join(f.read().splitlines()[-n:]).decode(errors="replace")
        except OSError:
            return "(no log)"


@pytest.fixture(scope="session")
def server():
    binary = os.environ.get("AGENTENV_BIN")
    if not binary:
        pytest.fail("AGENTENV_BIN is not set: run through `cargo test -p agentenv-server --test python_sdk`")
    state = tempfile.mkdtemp(prefix="agentenv-pytest-")
    srv = Server(binary, state)
    srv.start()
    os.environ["E2B_API_URL"] = srv.url
    os.environ["E2B_SANDBOX_URL"] = srv.url
    os.environ["E2B_API_KEY"] = srv.api_key
    os.environ.pop("E2B_DEBUG", None)
    yield srv
    # Kill every sandbox left over, then the server.
    try:
        from e2b import Sandbox, SandboxQuery, SandboxState

        pager = Sandbox.list(query=SandboxQuery(state=[SandboxState.RUNNING, SandboxState.PAUSED]))
        while pager.has_next:
            for info in pager.next_items():
                Sandbox.kill(info.sandbox_id)
    finally:
        srv.stop()
        print(srv.log_tail(200))


@pytest.fixture
def sandbox(server):
    from e2b import Sandbox

    sbx = Sandbox.create("base", timeout=600)
    yield sbx
    try:
        sbx.kill()
    except Exception:
        pass


def pause(sbx):
    """`sbx.pause()` (SDK >= 2.15: True, or False if already paused); `beta_pause()` before (None)."""
    if hasattr(sbx, "pause"):
        return sbx.pause()
    sbx.beta_pause()
    return None
