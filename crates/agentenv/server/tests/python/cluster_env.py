"""The cluster the tests of `test_cluster.py` drive: etcd with mutual TLS and auth, a real S3 server
(SeaweedFS `weed`), three nodes and two gateways on loopback, and the helpers that talk to them."""

import base64
import json
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request

import pytest

from pki import GATEWAY_NAME, Pki
from conftest import Server, http_json

TTL_S = 3  # node lease TTL: a killed node leaves the cluster this long after its last refresh
WAIT_S = 120  # longest wait for any state change below
SANDBOX_DOMAIN = "sbx.test"  # nodes and gateways route `<port>-<id>.sbx.test` (resolved to loopback here)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _weed_ports(n: int):
    """Free ports whose +10000 (weed's gRPC port for each) is free too, held until all are picked."""
    held, ports = [], []
    while len(ports) < n:
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        p = s.getsockname()[1]
        held.append(s)
        if 1024 <= p < 55000:
            g = socket.socket()
            try:
                g.bind(("127.0.0.1", p + 10000))
            except OSError:
                g.close()
                continue
            held.append(g)
            ports.append(p)
    for s in held:
        s.close()
    return ports


def _require_or_skip(what: str):
    if os.environ.get("K3_REQUIRE_CLUSTER") == "1":
        pytest.fail(f"cluster test needs {what} (K3_REQUIRE_CLUSTER=1)")
    pytest.skip(f"cluster test: {what}")


def _which(name: str, env: str):
    if os.environ.get(env):
        return os.environ[env] if os.access(os.environ[env], os.X_OK) else None
    path = shutil.which(name)
    if not path:
        venv = os.environ.get("VIRTUAL_ENV") or os.path.dirname(os.path.dirname(os.path.abspath(os.sys.executable)))
        cand = os.path.join(venv, "bin", name)
        path = cand if os.path.exists(cand) else None
    return path


def _wait(what: str, probe, timeout: float = WAIT_S):
    """Polls `probe` until it returns a true value (returned), at most `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            v = probe()
            if v:
                return v
        except Exception as e:  # noqa: BLE001 - the probe's failure is what we wait out
            last = e
        time.sleep(0.2)
    raise AssertionError(f"{what}: not within {timeout} s (last error: {last!r})")


def _create(template):
    """`Sandbox.create` without internet (the nodes run `--network off`: the cluster needs no host
    networking; SDK 2.7 asks for the internet unless told not to)."""
    from e2b import Sandbox

    return Sandbox.create(template, timeout=300, allow_internet_access=False)


class Proc:
    """A helper process with a log file."""

    def __init__(self, cmd, log_path, env=None):
        self.cmd, self.log_path, self.env = cmd, log_path, env
        self.proc = None

    def start(self):
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env)

    def kill9(self):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# The cluster's CA while one runs: nodes serve HTTPS with certificates it signed.
_TRUST = {"ctx": None}


def _http(method, url, key=None, body=None, headers=None, timeout=60):
    """[`http_json`], an https:// URL checked against the cluster's CA."""
    ctx = _TRUST["ctx"] if url.startswith("https://") else None
    return http_json(method, url, key, body, headers, timeout, ctx)


class Cluster:
    def __init__(self, binary, root, etcd_bin, weed_bin):
        self.root = root
        self.binary = binary
        self.key = "e2b_" + secrets.token_hex(20)
        self.bucket = f"k3-cluster-{secrets.token_hex(4)}"
        # etcd over mutual TLS; /health on a plain metrics port
        self.pki = Pki(f"{root}/pki")
        etcd_cert, etcd_key = self.pki.issue("etcd")
        self.etcd_port, peer, self.etcd_metrics = _free_port(), _free_port(), _free_port()
        self.etcd_url = f"https://127.0.0.1:{self.etcd_port}"
        self.etcd = Proc([
            etcd_bin, f"--data-dir={root}/etcd", "--name=k3",
            f"--listen-client-urls={self.etcd_url}", f"--advertise-client-urls={self.etcd_url}",
            f"--listen-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-cluster=k3=http://127.0.0.1:{peer}",
            f"--listen-metrics-urls=http://127.0.0.1:{self.etcd_metrics}",
            f"--cert-file={etcd_cert}", f"--key-file={etcd_key}", f"--trusted-ca-file={self.pki.ca}",
            "--client-cert-auth",
        ], f"{root}/etcd.log")
        self.inspector = "pw-" + secrets.token_hex(8)
        # S3 (the same flags as agentenv_store::testing::Weed)
        ports = _weed_ports(4)
        weed_dir = f"{root}/weed"
        os.makedirs(weed_dir)
        with open(f"{weed_dir}/s3.json", "w") as f:
            json.dump({"identities": [{"name": "k3", "credentials": [{"accessKey": "k3access", "secretKey": "k3secret"}],
                                       "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}, f)
        self.s3_url = f"http://127.0.0.1:{ports[3]}"
        self.weed = Proc([
            weed_bin, "-logtostderr", "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={weed_dir}",
            f"-master.port={ports[0]}", f"-volume.port={ports[1]}", f"-filer.port={ports[2]}",
            "-s3", f"-s3.port={ports[3]}", "-s3.port.iceberg=0", "-s3.port.lance=0",
            # Volume slots from the free disk space: the default 8 run out (each growth takes 7) once the
            # nodes publish templates and hand sandboxes off, and every PUT then answers 500.
            "-master.volumeSizeLimitMB=256", "-volume.max=0", f"-s3.config={weed_dir}/s3.json",
            f"-filer.localSocket={weed_dir}/filer.sock", f"-s3.localSocket={weed_dir}/s3.sock",
        ], f"{weed_dir}/weed.log")
        os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"] = "k3access", "k3secret"
        self.nodes = []
        # Nodes serve HTTPS with their etcd certificate (named by their id); gateways check it. Gateways
        # show nodes a certificate naming gateway.agentenv.internal and assert each request's tenant, so
        # nodes hold no key of the operator's: each has its own API key, and they share the bucket key.
        _TRUST["ctx"] = ssl.create_default_context(cafile=self.pki.ca)
        self.bucket_key = secrets.token_hex(32)
        gw_cert, gw_key = self.pki.issue(GATEWAY_NAME)
        for i in range(3):
            state = self._state_dir(f"node{i}", node=True)
            n = Server(binary, state, tls_ca=self.pki.ca)
            etcd_flags = self.pki.flags(f"node{i}")
            n.extra_args = [
                "--join", self.etcd_url, "--advertise", n.url, "--join-ttl-s", str(TTL_S),
                "--s3-endpoint", self.s3_url, "--s3-bucket", self.bucket, "--network", "off",
                "--node-id", f"node{i}", *etcd_flags,
                "--tls-cert", etcd_flags[3], "--tls-key", etcd_flags[5], "--gateway-ca", self.pki.ca,
                "--sandbox-domain", SANDBOX_DOMAIN,
            ]
            self.nodes.append(n)
        self.gateways = []
        for i in range(2):
            port = _free_port()
            g = Proc([binary, "gateway", "--etcd", self.etcd_url, "--listen", f"127.0.0.1:{port}",
                      "--state-dir", self._state_dir(f"gw{i}"), *self.pki.flags(f"gw{i}"),
                      "--node-ca", self.pki.ca, "--client-cert", gw_cert, "--client-key", gw_key,
                      "--sandbox-domain", SANDBOX_DOMAIN],
                     f"{root}/gw{i}.log")
            g.url = f"http://127.0.0.1:{port}"
            g.state = os.path.join(root, f"gw{i}")
            self.gateways.append(g)

    def _state_dir(self, name, node=False):
        """A state folder: a gateway's holds the operator's key, a node's the cluster's bucket key."""
        d = os.path.join(self.root, name)
        os.makedirs(os.path.join(d, "server"), mode=0o700)
        name, secret = ("bucket_key", self.bucket_key) if node else ("api_key", self.key)
        fd = os.open(os.path.join(d, "server", name), os.O_WRONLY | os.O_CREAT, 0o600)
        os.write(fd, (secret + "\n").encode())
        os.close(fd)
        return d

    def wait_s3(self):
        def up():
            try:
                urllib.request.urlopen(self.s3_url, timeout=2)
            except urllib.error.HTTPError:
                return True  # any HTTP answer (403 to anonymous) means it serves
            return True
        _wait("weed S3 answers", up, 60)

    def etcd_json(self, path, body, token=None):
        """One call of etcd's JSON gateway: (status, body). Its certificate has no common name (the
        gateway refuses one once auth is on); the user is the token's."""
        ctx = ssl.create_default_context(cafile=self.pki.ca)
        ctx.load_cert_chain(*self.pki.issue("json-client", "/O=k3-test"))
        return http_json("POST", f"{self.etcd_url}{path}", body=body,
                         headers={"Authorization": token} if token else None, timeout=30, context=ctx)

    def start(self):
        self.etcd.start()
        self.weed.start()
        _wait("etcd is healthy",
              lambda: _http("GET", f"http://127.0.0.1:{self.etcd_metrics}/health")[1].get("health") == "true", 30)
        # A read-only user with a password for the tests' look into etcd (its JSON gateway ignores
        # certificate names), made before auth is on; then the cluster's users and roles, as root.
        for path, body in [("/v3/auth/role/add", {"name": "inspector"}),
                           ("/v3/auth/role/grant", {"name": "inspector", "perm": {
                               "permType": "READ", "key": base64.b64encode(b"/agentenv/v1/").decode(),
                               "range_end": base64.b64encode(b"/agentenv/v10").decode()}}),
                           ("/v3/auth/user/add", {"name": "inspector", "password": self.inspector}),
                           ("/v3/auth/user/grant", {"user": "inspector", "role": "inspector"})]:
            status, answer = self.etcd_json(path, body)
            assert status == 200, (path, answer)
        subprocess.run([self.binary, "etcd-auth", "--etcd", self.etcd_url, *self.pki.flags("root"),
                        "--node", "node0", "--node", "node1", "--node", "node2",
                        "--gateway", "gw0", "--gateway", "gw1"], check=True, timeout=60)
        self.wait_s3()
        for n in self.nodes:
            n.start()
        for g in self.gateways:
            g.start()
        for g in self.gateways:
            _wait("gateway answers", lambda: _http("GET", f"{g.url}/health")[0] == 204, 30)
        self.wait_nodes()

    def live_nodes(self, gw=None):
        status, nodes = _http("GET", f"{(gw or self.gateways[0]).url}/cluster/nodes", self.key)
        assert status == 200, nodes
        return {n["url"] for n in nodes}

    def wait_nodes(self):
        """Until every running gateway (each has its own view) lists exactly the running nodes: a count
        alone can match while a killed node is still listed and a live one re-registers."""
        gws = [g for g in self.gateways if g.proc and g.proc.poll() is None]
        want = {n.url for n in self.nodes if n.proc and n.proc.poll() is None}
        _wait(f"the gateways list {sorted(want)}", lambda: all(self.live_nodes(g) == want for g in gws))

    def node_of(self, sandbox_id):
        """The node (Server) whose own API has the sandbox."""
        found = [n for n in self.nodes if n.proc and n.proc.poll() is None
                 and _http("GET", f"{n.url}/sandboxes/{sandbox_id}", n.api_key)[0] == 200]
        assert len(found) == 1, f"{sandbox_id} is on {len(found)} nodes"
        return found[0]

    def listed(self, gw, query="state=running,paused"):
        status, body = _http("GET", f"{gw.url}/v2/sandboxes?{query}", self.key)
        assert status == 200, body
        return {x["sandboxID"] for x in body}

    def named_key(self, name):
        """A tenant key made with `agentenv keys create` and copied to every node and gateway (the key
        files are the cluster's one key store, kept in sync by the operator)."""
        first = self.gateways[0].state
        out = subprocess.run([self.binary, "keys", "--state-dir", first, "create", name],
                             check=True, capture_output=True, text=True).stdout.strip()
        src = os.path.join(first, "server", "keys.json")
        for d in [g.state for g in self.gateways[1:]] + [n.state_dir for n in self.nodes]:
            shutil.copy2(src, os.path.join(d, "server", "keys.json"))
        return out.splitlines()[-1]

    def fork(self, gw, sandbox_id, count):
        """`POST /sandboxes/{id}/fork` (the SDK has `fork` only from 2.63): the new ids."""
        status, body = _http("POST", f"{gw.url}/sandboxes/{sandbox_id}/fork", self.key,
                             {"count": count, "timeout": 300}, timeout=300)
        assert status == 201, body
        return [f["sandbox"]["sandboxID"] for f in body]

    def use(self, gw):
        os.environ["E2B_API_URL"] = os.environ["E2B_SANDBOX_URL"] = gw.url
        os.environ["E2B_API_KEY"] = self.key

    def stop(self):
        # Nodes killed by a test come back once, so their sandboxes are recovered and killed too.
        for n in self.nodes:
            if n.proc is None or n.proc.poll() is not None:
                try:
                    n.start()
                except Exception as e:  # noqa: BLE001
                    print(f"restarting {n.url} for cleanup failed: {e}")
        for n in self.nodes:
            status, listed = _http("GET", f"{n.url}/v2/sandboxes?state=running,paused&limit=1000", n.api_key)
            for s in listed if status == 200 else []:
                _http("DELETE", f"{n.url}/sandboxes/{s['sandboxID']}", n.api_key)
            n.stop()
        # SeaweedFS takes ~25 s to stop on SIGTERM; its data goes with the cluster's folder.
        self.weed.kill9()
        for p in self.gateways + [self.etcd]:
            p.stop()
