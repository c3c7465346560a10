"""agentenv's code-interpreter server: the HTTP API `e2b_code_interpreter` calls on port 49999, on Jupyter
kernels (`jupyter_client` + `ipykernel`).

- `POST /execute` {code, context_id, language, env_vars}: the cell's output as JSON lines (`stdout`, `stderr`,
  `result`, `error`, `number_of_executions`), streamed while it runs. A client that goes away interrupts it.
- `GET|POST /contexts`, `DELETE /contexts/{id}`, `POST /contexts/{id}/restart`: kernels with their own state.
- `GET /health`.

The default Python context's kernel is started before the port opens, so a template snapshot taken once the
port answers holds a warm kernel.
"""

import datetime
import json
import os
import queue
import select
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from jupyter_client.manager import KernelManager

PORT = int(os.environ.get("CODE_INTERPRETER_PORT", "49999"))
DEFAULT_CWD = "/home/user"
KERNEL_READY_S = 120
# MIME type -> Result field of the SDK.
FORMATS = {
    "text/plain": "text",
    "text/html": "html",
    "text/markdown": "markdown",
    "image/svg+xml": "svg",
    "image/png": "png",
    "image/jpeg": "jpeg",
    "application/pdf": "pdf",
    "text/latex": "latex",
    "application/json": "json",
    "application/javascript": "javascript",
}
LANGUAGES = {"python": "python3"}
MAX_BODY = 16 << 20


def now():
    return datetime.datetime.now(datetime.timezone.utc).isoformat()


class Context:
    def __init__(self, language, cwd):
        self.id = str(uuid.uuid4())
        self.language = language
        self.cwd = cwd
        self.lock = threading.Lock()
        self.km = KernelManager(kernel_name=LANGUAGES[language])
        self.km.start_kernel(cwd=cwd)
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=KERNEL_READY_S)

    def view(self):
        return {"id": self.id, "language": self.language, "cwd": self.cwd}

    def restart(self):
        with self.lock:
            self.kc.stop_channels()
            self.km.restart_kernel(now=True)
            self.kc = self.km.client()
            self.kc.start_channels()
            self.kc.wait_for_ready(timeout=KERNEL_READY_S)

    def shutdown(self):
        try:
            self.kc.stop_channels()
        finally:
            self.km.shutdown_kernel(now=True)

    def silent(self, code):
        """Runs `code` without output or history and waits for it."""
        msg_id = self.kc.execute(code, silent=True, store_history=False)
        while True:
            msg = self.kc.get_shell_msg(timeout=KERNEL_READY_S)
            if msg["parent_header"].get("msg_id") == msg_id:
                return

    def execute(self, code, env_vars, emit, gone):
        """Runs a cell, handing each output line to `emit`; `gone()` says the client left (interrupt)."""
        with self.lock:
            if env_vars:
                self.silent(
                    "import os as __k3_os\n"
                    f"__k3_saved = {{k: __k3_os.environ.get(k) for k in {list(env_vars)!r}}}\n"
                    f"__k3_os.environ.update({dict(env_vars)!r})\n"
                )
            try:
                self._run(code, emit, gone)
            finally:
                if env_vars:
                    self.silent(
                        "for __k, __v in __k3_saved.items():\n"
                        "    __k3_os.environ.pop(__k, None) if __v is None else __k3_os.environ.__setitem__(__k, __v)\n"
                        "del __k3_saved, __k, __v\n"
                    )

    def _interrupt(self, msg_id):
        """Interrupts cell `msg_id` and waits until the kernel is idle again, so the next cell is not
        queued behind it (and aborted with it)."""
        self.km.interrupt_kernel()
        deadline = time.monotonic() + KERNEL_READY_S
        while time.monotonic() < deadline:
            try:
                msg = self.kc.get_iopub_msg(timeout=1)
            except queue.Empty:
                continue
            if (msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "status"
                    and msg["content"]["execution_state"] == "idle"):
                return

    def _run(self, code, emit, gone):
        msg_id = self.kc.execute(code, store_history=True, allow_stdin=False, stop_on_error=False)
        while True:
            try:
                msg = self.kc.get_iopub_msg(timeout=0.2)
            except queue.Empty:
                if gone():
                    return self._interrupt(msg_id)
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, c = msg["msg_type"], msg["content"]
            if kind == "stream":
                emit({"type": "stdout" if c["name"] == "stdout" else "stderr", "text": c["text"], "timestamp": now()})
            elif kind in ("execute_result", "display_data"):
                result = {"type": "result", "is_main_result": kind == "execute_result"}
                extra = {}
                for mime, value in c.get("data", {}).items():
                    field = FORMATS.get(mime)
                    if field:
                        result[field] = value
                    else:
                        extra[mime] = value
                if extra:
                    result["extra"] = extra
                emit(result)
            elif kind == "error":
                emit({"type": "error", "name": c["ename"], "value": c["evalue"], "traceback": "\n".join(c["traceback"])})
            elif kind == "execute_input":
                emit({"type": "number_of_executions", "execution_count": c["execution_count"]})
            elif kind == "status" and c["execution_state"] == "idle":
                return
            if gone():
                return self._interrupt(msg_id)


class Contexts:
    def __init__(self):
        self.lock = threading.Lock()
        self.all = {}
        self.default = {}

    def create(self, language, cwd):
        if language not in LANGUAGES:
            raise ValueError(f"language {language!r} is not supported (supported: {', '.join(LANGUAGES)})")
        ctx = Context(language, cwd or DEFAULT_CWD)
        with self.lock:
            self.all[ctx.id] = ctx
        return ctx

    def get(self, context_id, language):
        if context_id:
            with self.lock:
                return self.all.get(context_id)
        language = language or "python"
        with self.lock:
            ctx = self.default.get(language)
        if ctx is None:
            ctx = self.create(language, DEFAULT_CWD)
            with self.lock:
                ctx = self.default.setdefault(language, ctx)
        return ctx

    def remove(self, context_id):
        with self.lock:
            ctx = self.all.pop(context_id, None)
            for lang, d in list(self.default.items()):
                if d is ctx:
                    del self.default[lang]
        if ctx:
            ctx.shutdown()
        return ctx is not None


CONTEXTS = Contexts()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):
        sys.stderr.write("code-interpreter: " + (fmt % args) + "\n")

    def body(self):
        n = int(self.headers.get("Content-Length") or 0)
        if n > MAX_BODY:
            raise ValueError("request body too large")
        raw = self.rfile.read(n) if n else b""
        return json.loads(raw) if raw.strip() else {}

    def send_json(self, status, value):
        data = json.dumps(value).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def fail(self, status, message):
        self.send_json(status, {"error": message})

    def do_GET(self):
        if self.path == "/health":
            return self.send_json(200, {"status": "ok"})
        if self.path == "/contexts":
            with CONTEXTS.lock:
                return self.send_json(200, [c.view() for c in CONTEXTS.all.values()])
        self.fail(404, f"no route {self.path}")

    def do_DELETE(self):
        parts = self.path.strip("/").split("/")
        if len(parts) == 2 and parts[0] == "contexts":
            if CONTEXTS.remove(parts[1]):
                self.send_response(204)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            return self.fail(404, f"context {parts[1]} not found")
        self.fail(404, f"no route {self.path}")

    def do_POST(self):
        try:
            req = self.body()
        except ValueError as e:
            return self.fail(400, str(e))
        parts = self.path.strip("/").split("/")
        if parts == ["execute"]:
            return self.execute(req)
        if parts == ["contexts"]:
            try:
                ctx = CONTEXTS.create(req.get("language") or "python", req.get("cwd"))
            except ValueError as e:
                return self.fail(400, str(e))
            return self.send_json(200, ctx.view())
        if len(parts) == 3 and parts[0] == "contexts" and parts[2] == "restart":
            with CONTEXTS.lock:
                ctx = CONTEXTS.all.get(parts[1])
            if ctx is None:
                return self.fail(404, f"context {parts[1]} not found")
            ctx.restart()
            return self.send_json(200, ctx.view())
        self.fail(404, f"no route {self.path}")

    def gone(self):
        """Whether the client closed its side."""
        try:
            r, _, _ = select.select([self.connection], [], [], 0)
            return bool(r) and self.connection.recv(1, 0x2) == b""  # MSG_PEEK
        except OSError:
            return True

    def execute(self, req):
        code = req.get("code")
        if not isinstance(code, str):
            return self.fail(400, "code is required")
        if req.get("language") and req.get("context_id"):
            return self.fail(400, "give context_id or language, not both")
        try:
            ctx = CONTEXTS.get(req.get("context_id"), req.get("language"))
        except ValueError as e:
            return self.fail(400, str(e))
        if ctx is None:
            return self.fail(404, f"context {req.get('context_id')} not found")
        self.send_response(200)
        self.send_header("Content-Type", "application/x-ndjson")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        broken = []

        def emit(line):
            if broken:
                return
            data = (json.dumps(line) + "\n").encode()
            try:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()
            except OSError:
                broken.append(True)

        ctx.execute(code, req.get("env_vars") or {}, emit, lambda: bool(broken) or self.gone())
        try:
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except OSError:
            pass


# Imported once in the default kernel before the port opens: the snapshot then holds them loaded.
WARM = "import numpy, matplotlib, matplotlib.pyplot, IPython.display"


def main():
    ctx = CONTEXTS.get(None, "python")  # a warm kernel before the port opens
    try:
        ctx.silent(WARM)
    except Exception as e:  # the server works without them
        print(f"code-interpreter: warm-up failed: {e}", file=sys.stderr, flush=True)
    server = ThreadingHTTPServer(("0.0.0.0", PORT), Handler)
    server.daemon_threads = True
    print(f"code-interpreter listening on {PORT}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
