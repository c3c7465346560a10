"""Starts a real `agentenv` server on loopback (real runtime, real TCG guests) for the SDK tests.

Environment:
  AGENTENV_BIN        path of the `agentenv` binary (set by `cargo test --test python_sdk`)
  AGENTENV_GUEST_BIN  path of the `agentenv-guest` binary put into the template (optional)
  AGENTENV_ACCEL      auto | kvm | tcg (default auto: KVM only where a probe guest boots)
"""

import contextlib
import json
import os
import shutil
import socket
import ssl
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request

import pytest

MAX_UPLOAD = 8 * 1024 * 1024
READY_TIMEOUT_S = 900  # the first start builds the default template

# The floor run (`cargo xtask test` again with the oldest supported e2b) leaves out the files whose calls do not
# depend on the SDK's version: the cluster's (its gateways pass the same calls on) and the default template's tools.
if os.environ.get("K3_E2B_FLOOR") == "1":
    collect_ignore = ["test_cluster.py", "test_default_template.py"]

CODE_INTERPRETER_FILE = "test_code_interpreter.py"


def pytest_collection_modifyitems(config, items):
    """The code interpreter's tests run last, on a server of their own that starts with the session and builds their
    template (minutes under TCG) while the other files run (`code_interpreter_server`)."""
    last = [i for i in items if i.path.name == CODE_INTERPRETER_FILE]
    if last:
        items[:] = [i for i in items if i.path.name != CODE_INTERPRETER_FILE] + last


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(method, url, key=None, body=None, headers=None, timeout=60, context=None):
    """(status, parsed JSON or None; an error body that is not JSON as text) of one request; `body` is sent as
    JSON, `context` checks an https:// server."""
    h = dict(headers or {})
    if key:
        h["X-API-Key"] = key
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        h["Content-Type"] = "application/json"
    req = urllib.request.Request(url, data=data, method=method, headers=h)
    try:
        with urllib.request.urlopen(req, timeout=timeout, context=context) as r:
            raw = r.read()
            return r.status, (json.loads(raw) if raw else None)
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, json.loads(raw)
        except ValueError:
            return e.code, raw.decode(errors="replace")


class Server:
    """One agentenv process on a fixed port and state folder; restartable."""

    def __init__(self, binary: str, state_dir: str, extra_args=(), listen_host: str = "127.0.0.1",
                 tls_ca=None):
        """`tls_ca`: the server is started with `--tls-cert`/`--tls-key` (in `extra_args`) and its
        certificate is checked against this CA."""
        self.binary = binary
        self.extra_args = list(extra_args)
        self.listen_host = listen_host
        self.state_dir = state_dir
        self.port = _free_port()
        self.ssl = ssl.create_default_context(cafile=tls_ca) if tls_ca else None
        self.url = f"{'https' if tls_ca else 'http'}://127.0.0.1:{self.port}"
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
                with urllib.request.urlopen(f"{self.url}/health", timeout=2, context=self.ssl) as r:
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

    def request(self, method: str, path: str, body=None, timeout: float = 60):
        """`method path` with the server's key; (status, parsed JSON body or None)."""
        return http_json(method, f"{self.url}{path}", self.api_key, body, timeout=timeout, context=self.ssl)

    def close(self):
        """Kills every sandbox left over, stops the server and removes its state folder (a template's images,
        GiBs: CI's disk is small)."""
        try:
            status, listed = self.request("GET", "/v2/sandboxes?state=running,paused&limit=1000")
            for s in listed if status == 200 else []:
                self.request("DELETE", f"/sandboxes/{s['sandboxID']}")
        finally:
            self.stop()
            print(self.log_tail(200))
            shutil.rmtree(self.state_dir, ignore_errors=True)

    def log_tail(self, n: int = 60) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return b"\n".join(f.read().splitlines()[-n:]).decode(errors="replace")
        except OSError:
            return "(no log)"


SDK_ENV = ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY")


@contextlib.contextmanager
def env_restored(*names):
    """Gives this process's environment variables `names` back as they were when it exits."""
    saved = {k: os.environ.get(k) for k in names}
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def sdk_env(srv):
    """The SDK's calls without connection options go to `srv` while in effect."""
    with env_restored(*SDK_ENV):
        os.environ.update(E2B_API_URL=srv.url, E2B_SANDBOX_URL=srv.url, E2B_API_KEY=srv.api_key)
        yield srv


def _binary():
    binary = os.environ.get("AGENTENV_BIN")
    if not binary:
        pytest.fail("AGENTENV_BIN is not set: run through `cargo test -p agentenv-server --test python_sdk`")
    return binary


@pytest.fixture(scope="session")
def server():
    srv = Server(_binary(), tempfile.mkdtemp(prefix="agentenv-pytest-"))
    srv.start()
    os.environ["E2B_API_URL"] = srv.url
    os.environ["E2B_SANDBOX_URL"] = srv.url
    os.environ["E2B_API_KEY"] = srv.api_key
    os.environ.pop("E2B_DEBUG", None)
    yield srv
    srv.close()


@pytest.fixture(scope="session")
def code_interpreter_server():
    """The code interpreter's server: its first create of `code-interpreter-v1` (answered 503 while it runs) starts
    the template's build, out of reach of other tests' fuzzing, restarts and kills."""
    try:  # the build's pip install needs PyPI
        socket.create_connection(("pypi.org", 443), timeout=10).close()
    except OSError as e:
        pytest.skip(f"PyPI is unreachable from this host ({e}): code-interpreter-v1 cannot be built")
    srv = Server(_binary(), tempfile.mkdtemp(prefix="agentenv-pytest-ci-"))
    srv.start()

    def start_build():
        try:
            srv.request("POST", "/sandboxes", {"templateID": "code-interpreter-v1", "timeout": 60}, timeout=120)
        except OSError as e:  # the module's first create starts it then
            print(f"starting the code interpreter's build: {e}")

    threading.Thread(target=start_build, daemon=True).start()
    yield srv
    srv.close()


@pytest.fixture(scope="session", autouse=True)
def _code_interpreter_early(request):
    """Starts `code_interpreter_server` with the session when the code interpreter's tests are selected."""
    if any(i.path.name == CODE_INTERPRETER_FILE for i in request.session.items):
        try:
            request.getfixturevalue("code_interpreter_server")
        except pytest.skip.Exception:
            pass  # its tests skip with the reason


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


# A guest server that answers `Upgrade: k3-echo` with 101 and then echoes every byte upper-cased: the
# HTTP upgrade a WebSocket makes, without a WebSocket library in the guest.
UPGRADE_ECHO = r'''
import socket, threading
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", PORT))
s.listen()
def serve(c):
    head = b""
    while b"\r\n\r\n" not in head:
        d = c.recv(4096)
        if not d:
            return
        head += d
    if b"upgrade: k3-echo" not in head.lower():
        c.sendall(b"HTTP/1.1 426 Upgrade Required\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        c.close()
        return
    c.sendall(b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: k3-echo\r\n\r\n")
    rest = head.split(b"\r\n\r\n", 1)[1]
    if rest:
        c.sendall(rest.upper())
    while True:
        d = c.recv(65536)
        if not d:
            break
        c.sendall(d.upper())
    c.close()
while True:
    c, _ = s.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
'''


def start_upgrade_echo(sbx, port):
    """Starts UPGRADE_ECHO on `port` in sandbox `sbx` (in the background)."""
    sbx.files.write("/tmp/upgrade_echo.py", UPGRADE_ECHO.replace("PORT", str(port)))
    sbx.commands.run("python3 /tmp/upgrade_echo.py", background=True)


def upgrade_roundtrip(url, headers, payload, timeout=30):
    """Opens `Upgrade: k3-echo` at `url` (http://host:port) with `headers`, sends `payload` after the 101
    and returns (status line, what came back: len(payload) bytes at most)."""
    host, port = url.removeprefix("http://").rstrip("/").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        lines = ["GET /echo HTTP/1.1", f"Host: {host}", "Connection: Upgrade", "Upgrade: k3-echo"]
        lines += [f"{k}: {v}" for k, v in headers.items()]
        s.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        head = b""
        while b"\r\n\r\n" not in head:
            d = s.recv(4096)
            if not d:
                break
            head += d
        status, _, rest = head.partition(b"\r\n")
        body = head.split(b"\r\n\r\n", 1)[1] if b"\r\n\r\n" in head else b""
        if not status.startswith(b"HTTP/1.1 101"):
            return status.decode(errors="replace"), body
        s.sendall(payload)
        got = body
        while len(got) < len(payload):
            d = s.recv(65536)
            if not d:
                break
            got += d
        return status.decode(errors="replace"), got


def end_of_a_stream_whose_sandbox_is_killed(base_url: str, api_key: str, sandbox_id: str) -> str:
    """Starts `sleep 60` in the sandbox over a raw HTTP/1.1 Connect stream (envd's `process.Process/Start`)
    through `base_url`, kills the sandbox once the start event arrived, and says how the stream ended:
    "reset" (a TCP reset, as E2B's proxy resets its stream) or "clean close"."""
    import json
    import struct
    from urllib.parse import urlparse

    import httpx

    key = {"X-API-KEY": api_key}
    token = httpx.get(f"{base_url}/sandboxes/{sandbox_id}", headers=key).json()["envdAccessToken"]
    msg = json.dumps({"process": {"cmd": "/bin/sleep", "args": ["60"]}}).encode()
    body = struct.pack(">BI", 0, len(msg)) + msg
    u = urlparse(base_url)
    s = socket.create_connection((u.hostname, u.port), timeout=60)
    s.sendall(
        (f"POST /process.Process/Start HTTP/1.1\r\nHost: {u.netloc}\r\n"
         "Content-Type: application/connect+json\r\nConnect-Protocol-Version: 1\r\n"
         f"E2b-Sandbox-Id: {sandbox_id}\r\nX-Access-Token: {token}\r\n"
         f"Content-Length: {len(body)}\r\n\r\n").encode() + body)
    got = b""
    while b'"start"' not in got:
        chunk = s.recv(65536)
        assert chunk, f"closed before the start event: {got!r}"
        got += chunk
    assert got.startswith(b"HTTP/1.1 200"), got
    assert httpx.delete(f"{base_url}/sandboxes/{sandbox_id}", headers=key).status_code == 204
    deadline = time.time() + 60
    try:
        while time.time() < deadline:
            try:
                if not s.recv(65536):
                    return "clean close"
            except ConnectionResetError:
                return "reset"
        return "still open"
    finally:
        s.close()


class names_to_loopback:
    """Resolves every name under `domain` to 127.0.0.1 in this process while in effect: the stand-in for the
    wildcard DNS name (`*.<domain>`) a deployment gives its sandbox domain."""

    def __init__(self, domain: str):
        self.suffix = "." + domain
        self.real = socket.getaddrinfo

    def __enter__(self):
        def resolve(host, *args, **kwargs):
            if isinstance(host, str) and host.endswith(self.suffix):
                host = "127.0.0.1"
            return self.real(host, *args, **kwargs)

        socket.getaddrinfo = resolve
        return self

    def __exit__(self, *exc):
        socket.getaddrinfo = self.real
