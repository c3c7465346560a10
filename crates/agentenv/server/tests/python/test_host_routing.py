"""E2B's host routing: with `--sandbox-domain`, answers name the domain, so the SDK's `get_host(port)` is
`<port>-<sandbox id>.<domain>`, and a request for that host reaches that port of that sandbox with no header
of ours. User ports are public unless the create said `allowPublicTraffic: false` (as in E2B); envd's port
always needs the access token and keeps its host-only paths.

The wildcard DNS name a deployment gives `*.<domain>` is stood in for by resolving `*.sbx.test` to loopback
inside this process (`conftest.names_to_loopback`); through gateways: test_cluster.py."""

import json
import os
import secrets
import shutil
import tempfile
import time

import httpx
import pytest

from conftest import Server, names_to_loopback, sdk_env

DOMAIN_NAME = "sbx.test"


@pytest.fixture(scope="module")
def routed(server):
    state = tempfile.mkdtemp(prefix="agentenv-pytest-")
    srv = Server(os.environ["AGENTENV_BIN"], state)
    domain = f"{DOMAIN_NAME}:{srv.port}"
    srv.extra_args += ["--sandbox-domain", domain.upper()]
    srv.start()
    try:
        with sdk_env(srv), names_to_loopback(DOMAIN_NAME):
            yield srv, domain
    finally:
        srv.close()


def get_until_up(url, **kw):
    deadline = time.time() + 60
    while True:
        r = httpx.get(url, timeout=30, **kw)
        if r.status_code != 502 or time.time() > deadline:
            return r
        time.sleep(0.5)


def test_get_host_names_a_sandbox_port_that_answers_by_host_alone(routed):
    from e2b import Sandbox

    srv, domain = routed
    sbx = Sandbox.create("base", timeout=300)
    try:
        port = 8000 + secrets.randbelow(900)
        host = sbx.get_host(port)
        assert host == f"{port}-{sbx.sandbox_id}.{domain}"
        token = secrets.token_hex(8)
        sbx.files.write("/home/user/www/index.html", f"hello {token}")
        sbx.commands.run(f"cd /home/user/www && python3 -m http.server {port}", background=True)
        # Public by default: no token, no header of ours, only the host.
        r = get_until_up(f"http://{host}/index.html")
        assert r.status_code == 200 and r.text == f"hello {token}", r.text
        # Whatever sandbox headers a client adds, the host decides.
        r = httpx.get(f"http://{host}/index.html", timeout=30,
                      headers={"E2b-Sandbox-Id": "someone-else", "E2b-Sandbox-Port": "49983"})
        assert r.status_code == 200 and r.text == f"hello {token}"
        # A closed port of it is a 502 naming the port.
        closed = httpx.get(f"http://{port + 1}-{sbx.sandbox_id}.{domain}/", timeout=30)
        assert closed.status_code == 502 and "port is not open" in closed.json()["message"]
        # envd's port needs the access token, and its host-only paths stay closed.
        envd = f"http://49983-{sbx.sandbox_id}.{domain}"
        detail = httpx.get(f"{srv.url}/sandboxes/{sbx.sandbox_id}", headers={"X-API-KEY": srv.api_key}).json()
        assert detail["domain"] == domain
        assert httpx.get(f"{envd}/health", timeout=30).status_code == 401
        ok = httpx.get(f"{envd}/health", headers={"X-Access-Token": detail["envdAccessToken"]}, timeout=30)
        assert ok.status_code in (200, 204), ok.text
        init = httpx.post(f"{envd}/init", json={}, headers={"X-Access-Token": detail["envdAccessToken"]}, timeout=30)
        assert init.status_code == 403
        # A sandbox that does not exist, and the server's own API on its own host.
        gone = httpx.get(f"http://{port}-nosuchsandbox.{domain}/", timeout=30)
        assert gone.status_code == 502
        assert gone.json() == {"code": 502, "message": "The sandbox was not found", "sandboxId": "nosuchsandbox"}
        assert httpx.get(f"{srv.url}/sandboxes", headers={"X-API-KEY": srv.api_key}).status_code == 200
    finally:
        sbx.kill()


def test_a_sandbox_without_public_traffic_needs_its_traffic_token(routed):
    from e2b import Sandbox

    srv, domain = routed
    created = httpx.post(f"{srv.url}/sandboxes", headers={"X-API-KEY": srv.api_key}, timeout=300,
                         json={"templateID": "base", "timeout": 300, "network": {"allowPublicTraffic": False}})
    assert created.status_code == 201, created.text
    info = created.json()
    sbx = Sandbox.connect(info["sandboxID"])
    try:
        port = 8000 + secrets.randbelow(900)
        sbx.commands.run(f"cd /tmp && echo private > p.txt && python3 -m http.server {port}", background=True)
        url = f"http://{port}-{info['sandboxID']}.{domain}/p.txt"
        deadline = time.time() + 60
        while True:
            r = httpx.get(url, headers={"E2B-Traffic-Access-Token": info["trafficAccessToken"]}, timeout=30)
            if r.status_code == 200 or time.time() > deadline:
                break
            time.sleep(0.5)
        assert r.status_code == 200 and r.text == "private\n", r.text
        assert httpx.get(url, timeout=30).status_code == 403  # as E2B: a user port's token is missing
        wrong = httpx.get(url, headers={"E2B-Traffic-Access-Token": "nope"}, timeout=30)
        assert wrong.status_code == 403
    finally:
        sbx.kill()


def test_mask_request_host_sets_the_host_a_sandbox_port_sees(routed):
    """E2B's `network.maskRequestHost`: requests from outside reach the sandbox's user port with that
    `Host` (`${PORT}` is the port); without it the port sees `localhost:<port>`."""
    from e2b import Sandbox

    srv, domain = routed
    echo = ("import http.server\n"
            "class H(http.server.BaseHTTPRequestHandler):\n"
            "    def do_GET(self):\n"
            "        b = [l for l in str(self.headers).splitlines() if l.lower().startswith('host:')][0].encode()\n"
            "        self.send_response(200); self.send_header('Content-Length', str(len(b))); self.end_headers()\n"
            "        self.wfile.write(b)\n"
            "    def log_message(self, *a): pass\n"
            "import sys; http.server.HTTPServer(('', int(sys.argv[1])), H).serve_forever()\n")
    for mask in ["custom-host.example.com:${PORT}", None]:
        body = {"templateID": "base", "timeout": 300}
        if mask:
            body["network"] = {"maskRequestHost": mask}
        created = httpx.post(f"{srv.url}/sandboxes", headers={"X-API-KEY": srv.api_key}, timeout=300, json=body)
        assert created.status_code == 201, created.text
        sbx = Sandbox.connect(created.json()["sandboxID"])
        try:
            port = 8000 + secrets.randbelow(900)
            sbx.files.write("/tmp/echo.py", echo)
            sbx.commands.run(f"python3 /tmp/echo.py {port}", background=True)
            r = get_until_up(f"http://{sbx.get_host(port)}/")
            # As E2B's proxy sends it: `Host:`, title case.
            want = f"Host: custom-host.example.com:{port}" if mask else f"Host: localhost:{port}"
            assert (r.status_code, r.text) == (200, want)
            detail = httpx.get(f"{srv.url}/sandboxes/{sbx.sandbox_id}", headers={"X-API-KEY": srv.api_key}).json()
            assert (detail.get("network") or {}).get("maskRequestHost") == mask
        finally:
            sbx.kill()
    bad = httpx.post(f"{srv.url}/sandboxes", headers={"X-API-KEY": srv.api_key}, timeout=60,
                     json={"templateID": "base", "network": {"maskRequestHost": "a b\r\nX: y"}})
    assert bad.status_code == 400, bad.text


def test_a_sandbox_reaches_another_by_its_host_and_rules_set_headers(routed):
    """Guests resolve the sandbox domain to their gateway, where the egress proxy takes the request to
    the server's own router (HTTPS ends there under the server's egress CA, which every guest
    trusts). E2B's `network.rules` set headers on the way: what E2B's `test_firewall_transform` checks
    against the built-in `httpbin` template."""
    from e2b import CommandExitException, Sandbox

    srv, domain = routed
    if not (os.geteuid() == 0 and shutil.which("nft")):
        pytest.skip("guest networking needs root and nftables")
    httpbin = Sandbox.create("httpbin", timeout=300)
    sandboxes = [httpbin]
    try:
        host = httpbin.get_host(8080)
        name, value = "X-Test-Token", secrets.token_hex(8)
        rules = {host: [{"transform": {"headers": {name: value}}}]}
        try:
            sbx = Sandbox.create("base", timeout=300, network={"rules": rules})
        except TypeError:  # an SDK older than network rules (the 2.7 floor): through the API itself
            made = httpx.post(f"{srv.url}/sandboxes", headers={"X-API-KEY": srv.api_key}, timeout=120,
                              json={"templateID": "base", "timeout": 300, "network": {"rules": rules}})
            assert made.status_code == 201, made.text
            sbx = Sandbox.connect(made.json()["sandboxID"])
        sandboxes.append(sbx)
        sent = secrets.token_hex(4)
        for scheme in ["https", "http"]:
            r = sbx.commands.run(f"curl -sS --max-time 20 -H 'X-Test-Token: {sent}' -H 'X-Mine: {sent}' "
                                 f"{scheme}://{host}/headers", timeout=60)
            headers = json.loads(r.stdout)["headers"]
            assert headers.get(name) == [value], (scheme, headers)
            assert headers.get("X-Mine") == [sent], "the guest's other headers pass"
        # The rules are part of the sandbox's network, as the API shows it.
        detail = httpx.get(f"{srv.url}/sandboxes/{sbx.sandbox_id}", headers={"X-API-KEY": srv.api_key}).json()
        shown = detail["network"]["rules"]
        assert shown[host][0]["transform"]["headers"] == {name: value}, shown
        # Without rules the request passes as sent; with the internet off the domain is out of reach.
        plain = Sandbox.create("base", timeout=300)
        sandboxes.append(plain)
        r = plain.commands.run(f"curl -sS --max-time 20 -H 'X-Test-Token: {sent}' https://{host}/headers",
                               timeout=60)
        assert json.loads(r.stdout)["headers"].get(name) == [sent]
        closed = Sandbox.create("base", timeout=300, allow_internet_access=False)
        sandboxes.append(closed)
        with pytest.raises(CommandExitException) as e:
            closed.commands.run(f"curl -sS --max-time 10 https://{host}/headers", timeout=60)
        assert "resolve" in e.value.stderr, e.value.stderr
    finally:
        for s in sandboxes:
            s.kill()
