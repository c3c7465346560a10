"""An HTTP echo server for the `httpbin` template, in the shape of go-httpbin's answers (header
values as lists, header names in Go's canonical form): /headers, /get, /anything, /post, /put,
/patch, /delete, /ip, /user-agent, /status/<code>, /bytes/<n>, /delay/<s>. Standard library only."""

import json
import os
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

MAX_BODY = 16 << 20


def canonical(name):
    return "-".join(p[:1].upper() + p[1:].lower() for p in name.split("-"))


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "agentenv-httpbin"

    def log_message(self, fmt, *args):
        pass

    def headers_lists(self):
        out = {}
        for k, v in self.headers.items():
            out.setdefault(canonical(k), []).append(v)
        return out

    def body(self):
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(min(n, MAX_BODY)) if n > 0 else b""

    def send(self, code, obj=None, raw=None, ctype="application/json; charset=utf-8"):
        data = raw if raw is not None else (json.dumps(obj, indent=2) + "\n").encode()
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def echo(self, with_body):
        url = urlsplit(self.path)
        args = {k: v for k, v in parse_qs(url.query, keep_blank_values=True).items()}
        host = self.headers.get("Host", "localhost")
        out = {
            "args": args,
            "headers": self.headers_lists(),
            "method": self.command,
            "origin": self.client_address[0],
            "url": f"http://{host}{self.path}",
        }
        if with_body:
            raw = self.body()
            text = raw.decode("utf-8", "replace")
            out["data"] = text
            out["files"] = {}
            out["form"] = {}
            try:
                out["json"] = json.loads(text) if text else None
            except ValueError:
                out["json"] = None
            ctype = self.headers.get("Content-Type", "")
            if ctype.startswith("application/x-www-form-urlencoded"):
                out["form"] = parse_qs(text, keep_blank_values=True)
        return out

    def route(self):
        path = urlsplit(self.path).path.rstrip("/") or "/"
        parts = path.strip("/").split("/")
        has_body = self.command in ("POST", "PUT", "PATCH", "DELETE")
        if path == "/headers":
            return self.send(200, {"headers": self.headers_lists()})
        if path == "/ip":
            return self.send(200, {"origin": self.client_address[0]})
        if path == "/user-agent":
            return self.send(200, {"user-agent": self.headers.get("User-Agent", "")})
        if parts[0] == "anything" or path in ("/get", "/post", "/put", "/patch", "/delete"):
            want = path.strip("/").upper()
            if parts[0] != "anything" and want != self.command:
                return self.send(405, {"error": "method not allowed"})
            return self.send(200, self.echo(has_body))
        if parts[0] == "status" and len(parts) == 2 and parts[1].isdigit():
            code = int(parts[1])
            return self.send(code if 100 <= code < 600 else 400, raw=b"", ctype="text/plain")
        if parts[0] == "bytes" and len(parts) == 2 and parts[1].isdigit():
            return self.send(200, raw=os.urandom(min(int(parts[1]), 100 * 1024)), ctype="application/octet-stream")
        if parts[0] == "delay" and len(parts) == 2 and parts[1].isdigit():
            time.sleep(min(int(parts[1]), 10))
            return self.send(200, self.echo(has_body))
        if path == "/":
            return self.send(200, raw=b"agentenv httpbin\n", ctype="text/plain")
        return self.send(404, {"error": "not found"})

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = route


if __name__ == "__main__":
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 8080
    ThreadingHTTPServer(("0.0.0.0", port), Handler).serve_forever()
