"""Bad input never crashes the server: documented status codes with the `{code, message}` body."""

import json
import os
import secrets

import httpx
import pytest
from e2b import AuthenticationException, NotFoundException, Sandbox

from conftest import MAX_UPLOAD


def _assert_error(resp: httpx.Response, status: int):
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    body = resp.json()
    assert body["code"] == status and isinstance(body["message"], str) and body["message"]


def test_wrong_or_missing_key(server):
    bad = "e2b_" + secrets.token_hex(20)
    with pytest.raises(AuthenticationException):
        Sandbox.create("base", api_key=bad)
    _assert_error(httpx.get(f"{server.url}/v2/sandboxes"), 401)
    _assert_error(httpx.get(f"{server.url}/v2/sandboxes", headers={"X-API-KEY": bad}), 401)
    _assert_error(httpx.get(f"{server.url}/metrics"), 401)
    # The server's own health check needs no key.
    assert httpx.get(f"{server.url}/health").status_code == 204


def test_unknown_sandbox_and_template(server):
    key = {"X-API-KEY": server.api_key}
    ghost = "".join(secrets.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(20))
    with pytest.raises(NotFoundException):
        Sandbox.get_info(ghost)
    assert Sandbox.kill(ghost) is False
    with pytest.raises(NotFoundException):
        Sandbox.connect(ghost)
    for method, path in [("GET", f"/sandboxes/{ghost}"), ("DELETE", f"/sandboxes/{ghost}"),
                         ("POST", f"/sandboxes/{ghost}/pause"), ("POST", f"/v2/sandboxes/{ghost}/connect")]:
        _assert_error(httpx.request(method, f"{server.url}{path}", headers=key), 404)
    _assert_error(httpx.post(f"{server.url}/v2/sandboxes", headers=key, json={"templateID": f"nope-{ghost}"}), 404)
    # envd traffic for an unknown sandbox: proxy error, "was not found".
    r = httpx.get(f"{server.url}/health", headers={"E2b-Sandbox-Id": ghost, "E2b-Sandbox-Port": "49983"})
    _assert_error(r, 502)
    assert "was not found" in r.json()["message"]


def test_malformed_bodies(server):
    key = {"X-API-KEY": server.api_key, "Content-Type": "application/json"}
    for body in [b"{not json", b"[]", b'{"templateID": 5}', b'{"templateID": "base", "timeout": "soon"}']:
        _assert_error(httpx.post(f"{server.url}/v2/sandboxes", headers=key, content=body), 400)
    _assert_error(httpx.post(f"{server.url}/v2/sandboxes", headers=key, content=b"{}"), 400)
    _assert_error(httpx.post(f"{server.url}/v2/sandboxes", headers=key, json={"templateID": "base", "timeout": 10**9}), 400)
    _assert_error(httpx.get(f"{server.url}/v2/sandboxes?state=exploded", headers=key), 400)
    _assert_error(httpx.get(f"{server.url}/v2/sandboxes?limit=-1", headers=key), 400)
    _assert_error(httpx.post(f"{server.url}/v2/sandboxes", headers=key, content=b"x" * (2 << 20)), 413)
    _assert_error(httpx.get(f"{server.url}/no/such/route", headers=key), 404)


def test_envd_token_and_upload_limit(sandbox, server):
    envd = {"E2b-Sandbox-Id": sandbox.sandbox_id, "E2b-Sandbox-Port": "49983"}
    _assert_error(httpx.get(f"{server.url}/health", headers=envd), 401)
    _assert_error(httpx.get(f"{server.url}/health", headers={**envd, "X-Access-Token": "wrong"}), 401)
    detail = httpx.get(f"{server.url}/sandboxes/{sandbox.sandbox_id}", headers={"X-API-KEY": server.api_key}).json()
    token = detail["envdAccessToken"]
    ok = httpx.get(f"{server.url}/health", headers={**envd, "X-Access-Token": token})
    assert ok.is_success
    # Token-only routing (SDK 2.7-2.25 connect objects send no id header).
    assert httpx.get(f"{server.url}/health", headers={"X-Access-Token": token}).is_success
    # A user port nothing listens on.
    r = httpx.get(f"{server.url}/", headers={**envd, "E2b-Sandbox-Port": "8080", "X-Access-Token": token})
    _assert_error(r, 502)
    assert "port is not open" in r.json()["message"]
    # envd's host-only routes are refused on the data plane, also to token holders.
    for path in ("/init", "/sync", "/exec"):
        r = httpx.post(f"{server.url}{path}", json={"envVars": {"X": "1"}}, headers={**envd, "X-Access-Token": token})
        _assert_error(r, 403)
    assert sandbox.commands.run("echo ${X:-unset}").stdout == "unset\n"
    big = os.urandom(MAX_UPLOAD + 1)
    r = httpx.post(f"{server.url}/files", params={"path": "/tmp/big.bin"}, content=big,
                   headers={**envd, "X-Access-Token": token, "Content-Type": "application/octet-stream"})
    _assert_error(r, 413)
    # Still healthy afterwards.
    assert sandbox.commands.run("echo alive").stdout == "alive\n"


def test_metrics_and_openapi(server):
    key = {"X-API-KEY": server.api_key}
    m = httpx.get(f"{server.url}/metrics", headers=key)
    assert m.status_code == 200
    assert "agentenv_http_requests_total" in m.text and "agentenv_sandboxes" in m.text
    doc = httpx.get(f"{server.url}/openapi.json", headers=key).json()
    assert "/v2/sandboxes" in doc["paths"]
    here = os.path.join(os.path.dirname(__file__), "..", "..", "openapi.json")
    with open(here) as f:
        assert json.load(f) == doc
