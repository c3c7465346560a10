"""agentenv's code-interpreter server: the HTTP API `e2b_code_interpreter` calls on port 49999, on Jupyter
kernels (`jupyter_client`; `ipykernel` for Python, `bash_kernel` for bash, Deno's own kernel for JavaScript
and TypeScript, IRkernel for R), and Java on JShell (`K3JShell.java`, a JVM per context).

- `POST /execute` {code, context_id, language, env_vars}: the cell's output as JSON lines (`stdout`, `stderr`,
  `result`, `error`, `number_of_executions`), streamed while it runs. A client that goes away interrupts it.
  Results read as E2B's do: a quoted `text/plain` loses its quotes, a pandas DataFrame comes with `data`
  (its columns) and a matplotlib figure with `chart` (the `e2b_charts` package's description of it).
- `GET|POST /contexts`, `DELETE /contexts/{id}`, `POST /contexts/{id}/restart`: kernels with their own state.
- `GET /health`.

The agentenv server embeds this file and builds `code-interpreter-v1` with it (control's `builtin.rs`).
The default Python and JavaScript contexts' kernels are started before the port opens, so a template snapshot
taken once the port answers holds warm kernels.
"""

import datetime
import json
import os
import queue
import select
import subprocess
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from jupyter_client.manager import KernelManager

PORT = int(os.environ.get("CODE_INTERPRETER_PORT", "49999"))
DEFAULT_CWD = os.environ.get("CODE_INTERPRETER_CWD", "/home/user")
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
    "e2b/data": "data",
    "e2b/chart": "chart",
}
# Language -> kernel name; E2B's short names map onto them.
LANGUAGES = {"python": "python3", "bash": "bash", "javascript": "deno", "typescript": "deno", "r": "ir", "java": None}
ALIASES = {"js": "javascript", "ts": "typescript", "sh": "bash"}
# Deno publishes a cell's result from a promise it does not wait for, under whichever request came last, so
# the result can trail the cell's idle status. A silent fence cell after it takes one more turn of Deno's
# event loop; what either cell publishes until the fence is idle belongs to the cell.
TRAILING_RESULTS = {"javascript", "typescript"}
FENCE = "await new Promise((r) => setTimeout(r, 0))"
# Java: K3JShell's classes beside this file, in a JVM sized for a small guest (C1 only, serial GC, a heap
# that gives memory back: ~80 MiB resident once warm, not ~115).
JAVA = os.environ.get("CODE_INTERPRETER_JAVA", "java")
JAVA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "java")
JAVA_OPTS = ["-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1", "-Xss512k", "-Xmn8m", "-XX:ReservedCodeCacheSize=32m",
             "-XX:MinHeapFreeRatio=10", "-XX:MaxHeapFreeRatio=20", "-XX:-UsePerfData", "-Djava.awt.headless=true"]
# What a cell whose kernel died gets (a new kernel takes over).
DEAD_KERNEL = {"type": "error", "name": "DeadKernelError",
               "value": "the kernel died; a new one was started (its state is gone)", "traceback": ""}
# Environment variables given at create, as envd keeps them (read once per context).
ENVS_FILE = os.environ.get("CODE_INTERPRETER_ENVS_FILE", "/run/agentenv/envs.json")
# Run in every Python kernel: E2B's `data` (a DataFrame's columns) and `chart` (a matplotlib figure's
# description) result formats, plain tracebacks, PIL images shown when saved.
PYTHON_SETUP = """
def __k3_setup():
    import sys
    from IPython import get_ipython
    from IPython.core.formatters import BaseFormatter
    from traitlets import ObjectName, Unicode

    class DataFormatter(BaseFormatter):
        format_type = Unicode("e2b/data")
        print_method = ObjectName("_repr_e2b_data_")
        _return_type = (dict, str)

        def __call__(self, obj):
            pd = sys.modules.get("pandas")
            if pd is None or not isinstance(obj, pd.DataFrame):
                return super().__call__(obj)
            cols = obj.to_dict(orient="list")
            return {k: [v.isoformat() if isinstance(v, pd.Timestamp) else v for v in vs] for k, vs in cols.items()}

    class ChartFormatter(BaseFormatter):
        format_type = Unicode("e2b/chart")
        print_method = ObjectName("_repr_e2b_chart_")
        _return_type = (dict, str)

        def __call__(self, obj):
            mpl = sys.modules.get("matplotlib.figure")
            if mpl is None or not isinstance(obj, mpl.Figure):
                return super().__call__(obj)
            try:
                from e2b_charts import chart_figure_to_dict
                return chart_figure_to_dict(obj)
            except Exception:
                return {}

    ip = get_ipython()
    ip.run_line_magic("colors", "nocolor")  # plain tracebacks, as E2B's kernels give them
    f = ip.display_formatter
    f.formatters["e2b/data"] = DataFormatter(parent=f)
    f.formatters["e2b/chart"] = ChartFormatter(parent=f)
    try:  # an image saved to a file is shown too, as in E2B
        from IPython.display import display
        from PIL import Image

        save = Image.Image.save

        def save_and_show(self, fp, format=None, **params):
            if isinstance(fp, str):
                display(self)
            return save(self, fp, format, **params)

        Image.Image.save = save_and_show
    except ImportError:
        pass

__k3_setup()
del __k3_setup
"""
MAX_BODY = 16 << 20


def now():
    return datetime.datetime.now(datetime.timezone.utc).isoformat()


def shell_quote(v):
    return "'" + v.replace("'", "'\\''") + "'"


def java_string(v):
    """A Java string literal of `v` (octal escapes: javac reads `\\u` escapes before it reads literals)."""
    out = []
    for c in v:
        if c in '"\\':
            out.append("\\" + c)
        elif ord(c) < 0x20 or c == "\x7f":
            out.append("\\%03o" % ord(c))
        else:
            out.append(c)
    return '"' + "".join(out) + '"'


def set_env_code(language, envs):
    """Code that sets (value a str) or removes (None) variables in a kernel of `language` (Java: system
    properties, as E2B's Java kernel keeps them)."""
    if language == "python":
        return f"import os as __k3_os\n[__k3_os.environ.pop(__k, None) if __v is None else __k3_os.environ.__setitem__(__k, __v) for __k, __v in {envs!r}.items()]\ndel __k3_os\n"
    if language == "r":
        return "".join(f"Sys.unsetenv({json.dumps(k)})\n" if v is None else
                       f"Sys.setenv({json.dumps(k)} = {json.dumps(v)})\n" for k, v in envs.items())
    if language in ("javascript", "typescript"):  # process.env is Deno's environment
        return "".join(f"delete process.env[{json.dumps(k)}];" if v is None else
                       f"process.env[{json.dumps(k)}] = {json.dumps(v)};" for k, v in envs.items()) + "void 0;"
    if language == "java":
        return "".join(f"System.clearProperty({java_string(k)});" if v is None else
                       f"System.setProperty({java_string(k)}, {java_string(v)});" for k, v in envs.items())
    return "\n".join(f"unset {k}" if v is None else f"export {k}={shell_quote(v)}" for k, v in envs.items())


def create_envs():
    """The sandbox's environment variables given at create (envd writes them on each start)."""
    try:
        with open(ENVS_FILE) as f:
            envs = json.load(f)
        return {k: str(v) for k, v in envs.items() if isinstance(k, str) and k.isidentifier()}
    except (OSError, ValueError, AttributeError):
        return {}


class Context:
    def __init__(self, language, cwd):
        self.id = str(uuid.uuid4())
        self.language = language
        self.cwd = cwd
        self.lock = threading.Lock()
        self.km = self.kc = None
        self.globals = None  # create-time envs, once set in the kernel
        self._start()

    def _start(self):
        # A fresh manager each time: shutting a kernel down ends its manager's ZMQ context.
        self.km = KernelManager(kernel_name=LANGUAGES[self.language])
        self.km.start_kernel(cwd=self.cwd)
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=KERNEL_READY_S)
        if self.language == "python":
            self.silent(PYTHON_SETUP)

    def view(self):
        return {"id": self.id, "language": self.language, "cwd": self.cwd}

    def restart(self):
        with self.lock:
            self._restart()

    def _restart(self):
        self.shutdown()
        self.globals = None
        self._start()

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
        """Runs a cell, handing each output line to `emit`; `gone()` says the client left (interrupt).
        `env_vars` apply to this cell only; then the create-time value (or none) is back."""
        with self.lock:
            if self.globals is None:
                self.globals = create_envs()
                if self.globals:
                    self.silent(set_env_code(self.language, self.globals))
            if env_vars:
                self.silent(set_env_code(self.language, {k: str(v) for k, v in env_vars.items()}))
            try:
                self._run(code, emit, gone)
            finally:
                if env_vars:
                    self.silent(set_env_code(self.language, {k: self.globals.get(k) for k in env_vars}))

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
        ours, until = {msg_id}, msg_id
        while True:
            try:
                msg = self.kc.get_iopub_msg(timeout=0.2)
            except queue.Empty:
                if gone():
                    return self._interrupt(until)
                if not self.km.is_alive():  # e.g. os._exit() or the OOM killer: a new kernel takes over
                    emit(DEAD_KERNEL)
                    return self._restart()
                continue
            parent = msg["parent_header"].get("msg_id")
            if parent not in ours:
                continue
            kind, c = msg["msg_type"], msg["content"]
            if kind == "stream":
                emit({"type": "stdout" if c["name"] == "stdout" else "stderr", "text": c["text"], "timestamp": now()})
            elif kind in ("execute_result", "display_data"):
                emit(result_line(c.get("data", {}), kind == "execute_result"))
            elif kind == "error":
                emit({"type": "error", "name": c["ename"], "value": c["evalue"], "traceback": "\n".join(c["traceback"])})
            elif kind == "execute_input" and parent == msg_id:
                emit({"type": "number_of_executions", "execution_count": c["execution_count"]})
            elif kind == "status" and c["execution_state"] == "idle" and parent == until:
                if until != msg_id or self.language not in TRAILING_RESULTS:
                    return
                until = self.kc.execute(FENCE, silent=True, store_history=False, allow_stdin=False)
                ours.add(until)
            if gone():
                return self._interrupt(until)


class JavaContext(Context):
    """A Java context: JShell in a JVM of its own (`K3JShell.java`), spoken to over its stdin and stdout."""

    def _start(self):
        self.proc = subprocess.Popen([JAVA, *JAVA_OPTS, "-cp", JAVA_DIR, "K3JShell"], cwd=self.cwd,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
        self.replies = queue.Queue()
        self.reader = threading.Thread(target=self._read, args=(self.proc.stdout, self.replies), daemon=True)
        self.reader.start()
        self.count = 0
        if self._reply(KERNEL_READY_S) != {"type": "ready"}:
            self.shutdown()
            raise RuntimeError("the Java kernel did not start")

    @staticmethod
    def _read(out, replies):
        for line in out:
            try:
                replies.put(json.loads(line))
            except ValueError:
                break

    def _reply(self, timeout):
        """The JVM's next reply, or None after `timeout` or once the JVM is gone and all it wrote is read."""
        deadline = time.monotonic() + timeout
        while not self._dead():
            try:
                return self.replies.get(timeout=max(0.0, min(0.2, deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() >= deadline:
                    return None
        return None

    def _dead(self):
        """The JVM closed its stdout (the reader has queued all of it) and every reply was taken."""
        return not self.reader.is_alive() and self.replies.empty()

    def _send(self, line, code=b""):
        try:
            self.proc.stdin.write(line + code)
            self.proc.stdin.flush()
        except OSError:
            pass  # the JVM is gone: its reader says so

    def _exec(self, code, silent):
        data = code.encode()
        self._send(b"EXEC %d %d\n" % (int(silent), len(data)), data)

    def shutdown(self):
        self.proc.kill()
        self.proc.wait()

    def silent(self, code):
        self._exec(code, True)
        deadline = time.monotonic() + KERNEL_READY_S
        while time.monotonic() < deadline:
            msg = self._reply(deadline - time.monotonic())
            if msg is None or msg["type"] == "done":
                return

    def _interrupt(self, msg_id=None):
        self._send(b"STOP\n")
        deadline = time.monotonic() + KERNEL_READY_S
        while time.monotonic() < deadline:
            msg = self._reply(1)
            if msg is None and self._dead():
                return self._restart()
            if msg is not None and msg["type"] == "done":
                return

    def _run(self, code, emit, gone):
        self._exec(code, False)
        self.count += 1
        emit({"type": "number_of_executions", "execution_count": self.count})
        while True:
            try:
                msg = self.replies.get(timeout=0.2)
            except queue.Empty:
                if gone():
                    return self._interrupt()
                if self._dead():  # e.g. System.exit() or the OOM killer: a new JVM takes over
                    emit(DEAD_KERNEL)
                    return self._restart()
                continue
            kind = msg["type"]
            if kind in ("stdout", "stderr"):
                emit({"type": kind, "text": msg["text"], "timestamp": now()})
            elif kind == "result":
                emit({"type": "result", "is_main_result": True, "text": msg["text"]})
            elif kind == "error":  # already in the server's shape
                emit(msg)
            elif kind == "done":
                return
            if gone():
                return self._interrupt()


def result_line(data, is_main):
    """A `result` line from a Jupyter MIME bundle, as E2B's server writes it."""
    result = {"type": "result", "is_main_result": is_main}
    extra = {}
    for mime, value in data.items():
        field = FORMATS.get(mime)
        if field is None:
            extra[mime] = value
        elif field == "text" and len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            result[field] = value[1:-1]  # a str's repr: E2B gives the string
        elif field in ("data", "chart") and not value:
            continue
        else:
            result[field] = value
    if extra:
        result["extra"] = extra
    return result


def normalize_language(language):
    language = (language or "python").strip().lower()
    return ALIASES.get(language, language)


class Contexts:
    def __init__(self):
        self.lock = threading.Lock()
        self.all = {}
        self.default = {}

    def create(self, language, cwd):
        language = normalize_language(language)
        if language not in LANGUAGES:
            raise ValueError(f"language {language!r} is not supported (supported: {', '.join(LANGUAGES)})")
        ctx = (JavaContext if language == "java" else Context)(language, cwd or DEFAULT_CWD)
        with self.lock:
            self.all[ctx.id] = ctx
        return ctx

    def get(self, context_id, language):
        if context_id:
            with self.lock:
                return self.all.get(context_id)
        language = normalize_language(language)
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
            except Exception as e:  # e.g. a cwd the kernel cannot start in
                return self.fail(500, f"starting the kernel failed: {e}")
            return self.send_json(200, ctx.view())
        if len(parts) == 3 and parts[0] == "contexts" and parts[2] == "restart":
            with CONTEXTS.lock:
                ctx = CONTEXTS.all.get(parts[1])
            if ctx is None:
                return self.fail(404, f"context {parts[1]} not found")
            try:
                ctx.restart()
            except Exception as e:
                return self.fail(500, f"restarting the kernel failed: {e}")
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
        except Exception as e:  # the language's default kernel did not start
            return self.fail(500, f"starting the kernel failed: {e}")
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
    ctx = CONTEXTS.get(None, "python")  # warm kernels before the port opens
    try:
        ctx.silent(WARM)
        CONTEXTS.get(None, "javascript")
    except Exception as e:  # the server works without them
        print(f"code-interpreter: warm-up failed: {e}", file=sys.stderr, flush=True)
    server = ThreadingHTTPServer(("0.0.0.0", PORT), Handler)
    server.daemon_threads = True
    print(f"code-interpreter listening on {PORT}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
