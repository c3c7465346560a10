"""A server in the sandbox is reachable through the data plane on its port (`E2b-Sandbox-Port`), as the SDK's
`get_sandbox_url` and the code interpreter address it (by host, `get_host`: test_host_routing.py); a closed port
is a 502 naming it."""

import secrets
import time

import httpx

from conftest import start_upgrade_echo, upgrade_roundtrip


def test_a_guest_port_is_reachable_through_the_data_plane(server, sandbox):
    token = secrets.token_hex(6)
    sandbox.files.write("/home/user/www/index.html", f"hello {token}")
    sandbox.files.write("/home/user/www/sub/data.bin", bytes(range(256)) * 4096)
    sandbox.commands.run("cd /home/user/www && python3 -m http.server 8765", background=True)
    detail = httpx.get(f"{server.url}/sandboxes/{sandbox.sandbox_id}", headers={"X-API-KEY": server.api_key}).json()
    headers = {"E2b-Sandbox-Id": sandbox.sandbox_id, "E2b-Sandbox-Port": "8765",
               "X-Access-Token": detail["envdAccessToken"]}
    deadline = time.time() + 60
    while True:
        r = httpx.get(f"{server.url}/index.html", headers=headers, timeout=30)
        if r.status_code == 200 or time.time() > deadline:
            break
        time.sleep(0.5)
    assert r.status_code == 200, r.text
    assert r.text == f"hello {token}"
    # A second request, with a 1 MiB binary answer, and a folder listing.
    big = httpx.get(f"{server.url}/sub/data.bin", headers=headers, timeout=30)
    assert big.status_code == 200 and big.content == bytes(range(256)) * 4096
    listing = httpx.get(f"{server.url}/sub/", headers=headers, timeout=30)
    assert listing.status_code == 200 and "data.bin" in listing.text
    # Another port: closed.
    closed = httpx.get(f"{server.url}/", headers={**headers, "E2b-Sandbox-Port": "8766"}, timeout=30)
    assert closed.status_code == 502 and "port is not open" in closed.json()["message"]
    bad = httpx.get(f"{server.url}/", headers={**headers, "E2b-Sandbox-Port": "99999"}, timeout=30)
    assert bad.status_code == 400
    # User ports are public unless the create said `allowPublicTraffic: false`, as in E2B (a private one:
    # test_host_routing.py): no token, or a wrong one, still reaches them.
    public = {"E2b-Sandbox-Id": sandbox.sandbox_id, "E2b-Sandbox-Port": "8765", "X-Access-Token": "nope"}
    r = httpx.get(f"{server.url}/index.html", headers=public, timeout=30)
    assert r.status_code == 200 and r.text == f"hello {token}"
    # The traffic token of the create answer opens user ports (as the code interpreter sends it), not envd.
    traffic = sandbox.traffic_access_token
    assert traffic and traffic != detail["envdAccessToken"]
    only_traffic = {"E2b-Sandbox-Id": sandbox.sandbox_id, "E2b-Sandbox-Port": "8765", "E2B-Traffic-Access-Token": traffic}
    r = httpx.get(f"{server.url}/index.html", headers=only_traffic, timeout=30)
    assert r.status_code == 200 and r.text == f"hello {token}"
    envd = {**only_traffic, "E2b-Sandbox-Port": "49983"}
    assert httpx.get(f"{server.url}/health", headers=envd, timeout=30).status_code == 401


def test_an_http_upgrade_reaches_a_guest_port(server, sandbox):
    """A WebSocket-style upgrade to a user port: 101, then bytes both ways through the data plane."""
    start_upgrade_echo(sandbox, 8770)
    detail = httpx.get(f"{server.url}/sandboxes/{sandbox.sandbox_id}", headers={"X-API-KEY": server.api_key}).json()
    headers = {"E2b-Sandbox-Id": sandbox.sandbox_id, "E2b-Sandbox-Port": "8770",
               "X-Access-Token": detail["envdAccessToken"]}
    payload = secrets.token_hex(70_000).encode()  # 140 KB: several reads each way
    deadline = time.time() + 60
    while True:
        status, got = upgrade_roundtrip(server.url, headers, payload)
        if "101" in status or time.time() > deadline:
            break
        time.sleep(0.5)
    assert status.startswith("HTTP/1.1 101"), status
    assert got == payload.upper()
    # envd's port takes no upgrade: the request goes on as plain HTTP, without the upgrade.
    status, _ = upgrade_roundtrip(server.url, {**headers, "E2b-Sandbox-Port": "49983"}, b"x")
    assert not status.startswith("HTTP/1.1 101"), status
    # envd's port without the sandbox's token: refused before any upgrade.
    status, _ = upgrade_roundtrip(server.url, {**headers, "E2b-Sandbox-Port": "49983", "X-Access-Token": "nope"}, b"x")
    assert status.startswith("HTTP/1.1 401"), status
