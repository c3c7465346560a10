"""Sandbox networking through the stock e2b SDK, against a test "internet": a network namespace with
an HTTP server on several addresses, a DNS server and a fake link-local metadata address. No test
touches a real outside address. Needs root, iproute2 and nftables (skips with the reason otherwise;
fails instead under K3_REQUIRE_KVM=1, as the QEMU tests do)."""

import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.request
import uuid

import pytest

from conftest import Server

WEB = "203.0.113.10"  # allowed.test, www.allowed.test
WEB2 = "203.0.113.11"  # denied.test
WEB3 = "203.0.113.12"  # other.test
DNS = "203.0.113.53"
METADATA = "169.254.169.254"

DNS_SERVER = r"""
import socket, struct, sys
ANS = {"allowed.test": "%s", "www.allowed.test": "%s", "denied.test": "%s", "other.test": "%s"}
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind((sys.argv[1], 53))
while True:
    q, a = s.recvfrom(512)
    try:
        i, labels = 12, []
        while q[i]:
            labels.append(q[i + 1:i + 1 + q[i]].decode()); i += 1 + q[i]
        name, qend = ".".join(labels).lower(), i + 5
        ip = ANS.get(name)
        r = q[:2] + struct.pack(">HHHHH", 0x8180 if ip else 0x8183, 1, 1 if ip else 0, 0, 0) + q[12:qend]
        if ip:
            r += b"\xc0\x0c" + struct.pack(">HHIH", 1, 1, 120, 4) + socket.inet_aton(ip)
        s.sendto(r, a)
    except Exception:
        pass
""" % (WEB, WEB, WEB2, WEB3)


def sh(*args, check=True):
    return subprocess.run(list(args), check=check, capture_output=True, text=True)


class Internet:
    """The test internet: namespace `k3inet-<r>`, reached from the host by veth `k3t<r>` (the uplink
    the server is given), routes to 203.0.113.0/24 and 169.254.169.254 through it."""

    def __init__(self):
        r = uuid.uuid4().hex[:6]
        self.ns, self.host_if, self.peer = f"k3inet-{r}", f"k3t{r}", f"k3p{r}"
        self.procs = []
        self.tmp = tempfile.mkdtemp(prefix="k3inet-")

    def up(self):
        n = self.ns
        sh("ip", "netns", "add", n)
        sh("ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.peer, "netns", n)
        sh("ip", "addr", "add", "198.18.0.1/30", "dev", self.host_if)
        sh("ip", "link", "set", self.host_if, "up")
        sh("ip", "-n", n, "addr", "add", "198.18.0.2/30", "dev", self.peer)
        sh("ip", "-n", n, "link", "set", self.peer, "up")
        sh("ip", "-n", n, "link", "set", "lo", "up")
        for a in (WEB, WEB2, WEB3, DNS, METADATA):
            sh("ip", "-n", n, "addr", "add", f"{a}/32", "dev", "lo")
        sh("ip", "-n", n, "route", "add", "default", "via", "198.18.0.1")
        sh("ip", "route", "replace", "203.0.113.0/24", "via", "198.18.0.2")
        sh("ip", "route", "replace", f"{METADATA}/32", "via", "198.18.0.2")
        www = os.path.join(self.tmp, "www")
        os.makedirs(www)
        with open(os.path.join(www, "index.html"), "w") as f:
            f.write("hello from the test internet\n")
        with open(os.path.join(www, "big.bin"), "wb") as f:
            f.write(os.urandom(8 << 20))
        dns = os.path.join(self.tmp, "dns.py")
        with open(dns, "w") as f:
            f.write(DNS_SERVER)
        self.procs.append(subprocess.Popen(
            ["ip", "netns", "exec", n, "python3", "-m", "http.server", "--bind", "0.0.0.0", "80"],
            cwd=www, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        self.procs.append(subprocess.Popen(["ip", "netns", "exec", n, "python3", dns, DNS],
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        # Both answer from the host before any sandbox exists (so a failing fetch means policy).
        deadline = time.monotonic() + 10
        while sh("curl", "-s", "-m", "1", f"http://{WEB}/", check=False).returncode != 0:
            assert time.monotonic() < deadline, "test internet HTTP server did not start"
            time.sleep(0.2)

    def down(self):
        for p in self.procs:
            p.kill()
        sh("ip", "route", "del", "203.0.113.0/24", check=False)
        sh("ip", "route", "del", f"{METADATA}/32", check=False)
        sh("ip", "netns", "del", self.ns, check=False)
        shutil.rmtree(self.tmp, ignore_errors=True)


def _skip_reason():
    if os.geteuid() != 0:
        return "needs root (network namespaces, nftables)"
    for tool in ("ip", "nft", "curl"):
        if shutil.which(tool) is None:
            return f"`{tool}` is missing (apt-get install iproute2 nftables curl)"
    if not os.path.exists("/dev/net/tun"):
        return "/dev/net/tun is missing"
    return None


@pytest.fixture(scope="module")
def net():
    why = _skip_reason()
    if why:
        if os.environ.get("K3_REQUIRE_KVM") == "1":
            pytest.fail(why)
        pytest.skip(why)
    inet = Internet()
    inet.up()
    binary = os.environ["AGENTENV_BIN"]
    state = tempfile.mkdtemp(prefix="agentenv-pytest-net-")
    srv = Server(binary, state, listen_host="0.0.0.0", extra_args=[
        "--network", "on", "--net-uplink", inet.host_if, "--net-dns", DNS,
        "--net-max-connections", "64"])
    srv.start()
    srv.inet = inet
    # SDK calls that take no connection options (e2b 2.7's beta_pause) read these.
    saved = {k: os.environ.get(k) for k in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY")}
    os.environ.update({"E2B_API_URL": f"http://127.0.0.1:{srv.port}",
                       "E2B_SANDBOX_URL": f"http://127.0.0.1:{srv.port}", "E2B_API_KEY": srv.api_key})
    yield srv
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    try:
        from e2b import Sandbox, SandboxQuery, SandboxState

        pager = Sandbox.list(query=SandboxQuery(state=[SandboxState.RUNNING, SandboxState.PAUSED]),
                             **conn(srv))
        while pager.has_next:
            for info in pager.next_items():
                Sandbox.kill(info.sandbox_id, **conn(srv))
    finally:
        srv.stop()
        inet.down()
        print(srv.log_tail(80))


def conn(srv):
    url = f"http://127.0.0.1:{srv.port}"
    return {"api_key": srv.api_key, "api_url": url, "sandbox_url": url}


def create(srv, **kw):
    from e2b import Sandbox

    return Sandbox.create("base", timeout=600, **conn(srv), **kw)


def fetch(sbx, url, timeout_s=4):
    """(exit code, body) of curl in the guest."""
    from e2b import CommandExitException

    try:
        r = sbx.commands.run(f"curl -s -m {timeout_s} {url}", timeout=timeout_s + 20)
        return r.exit_code, r.stdout
    except CommandExitException as e:
        return e.exit_code, e.stdout


def reaches(sbx, url):
    code, body = fetch(sbx, url)
    return code == 0


def guest_ip(sbx):
    """The guest's own 10.200.x.x addresses (`/32 host LOCAL` entries of the FIB)."""
    lines = sbx.commands.run("cat /proc/net/fib_trie", timeout=20).stdout.splitlines()
    ips = set()
    for prev, line in zip(lines, lines[1:]):
        if "/32 host LOCAL" in line and prev.strip().startswith("|--"):
            ip = prev.split()[-1]
            if ip.startswith("10.200."):
                ips.add(ip)
    return sorted(ips)


def host_ips():
    out = sh("ip", "-4", "-o", "addr").stdout
    return [l.split()[3].split("/")[0] for l in out.splitlines()]


def test_a_default_sandbox_reaches_the_internet_by_address_and_name(net):
    sbx = create(net)
    try:
        code, body = fetch(sbx, f"http://{WEB}/")
        assert code == 0 and "test internet" in body
        code, body = fetch(sbx, "http://allowed.test/")
        assert code == 0 and "test internet" in body, (code, body)
        # A whole download, byte-exact (checksummed on both sides).
        want = sh("sha256sum", os.path.join(net.inet.tmp, "www", "big.bin")).stdout.split()[0]
        got = sbx.commands.run(f"curl -s -m 60 http://{WEB}/big.bin | sha256sum", timeout=90).stdout.split()[0]
        assert got == want
        info = sbx.get_info()
        assert getattr(info, "allow_internet_access", None) is not False  # e2b >= 2.x shows it
        # The sandbox's metrics count its traffic (the SDK's call, then the raw counters).
        assert sbx.get_metrics()[0].cpu_count >= 1
        req = urllib.request.Request(f"http://127.0.0.1:{net.port}/sandboxes/{sbx.sandbox_id}/metrics",
                                     headers={"X-API-Key": net.api_key})
        with urllib.request.urlopen(req, timeout=30) as r:
            m = json.load(r)[0]
        assert m["netRxBytes"] > 8 << 20 and m["netTxBytes"] > 0, m
    finally:
        sbx.kill()


def test_allow_internet_access_false_blocks_all_egress(net):
    sbx = create(net, allow_internet_access=False)
    try:
        assert not reaches(sbx, f"http://{WEB}/")
        assert not reaches(sbx, "http://allowed.test/")
        # Not even names resolve: no DNS tunnel out.
        r = sbx.commands.run("getent hosts other.test || echo unresolved", timeout=30)
        assert "unresolved" in r.stdout and WEB3 not in r.stdout
    finally:
        sbx.kill()


def test_allow_and_deny_by_address(net):
    from e2b import ALL_TRAFFIC

    sbx = create(net, network={"deny_out": [WEB2]})
    try:
        assert reaches(sbx, f"http://{WEB}/") and not reaches(sbx, f"http://{WEB2}/")
    finally:
        sbx.kill()
    sbx = create(net, network={"allow_out": [f"{WEB}/32"], "deny_out": [ALL_TRAFFIC]})
    try:
        assert reaches(sbx, f"http://{WEB}/")
        assert not reaches(sbx, f"http://{WEB2}/") and not reaches(sbx, f"http://{WEB3}/")
    finally:
        sbx.kill()


def test_allow_and_deny_by_domain(net):
    from e2b import ALL_TRAFFIC

    sbx = create(net, network={"allow_out": ["allowed.test"], "deny_out": [ALL_TRAFFIC]})
    try:
        assert reaches(sbx, "http://allowed.test/")
        assert not reaches(sbx, "http://other.test/")
        assert not reaches(sbx, f"http://{WEB3}/")
    finally:
        sbx.kill()
    sbx = create(net, network={"allow_out": ["*.allowed.test"], "deny_out": [ALL_TRAFFIC]})
    try:
        assert reaches(sbx, "http://www.allowed.test/")
        assert not reaches(sbx, "http://other.test/")
    finally:
        sbx.kill()
    sbx = create(net, network={"deny_out": ["denied.test"]})
    try:
        assert not reaches(sbx, "http://denied.test/")
        assert reaches(sbx, "http://other.test/")
        # Its address is denied too once the name was asked for (a guest that knows it cannot go round).
        assert not reaches(sbx, f"http://{WEB2}/")
    finally:
        sbx.kill()


def test_update_network_takes_effect_without_a_restart(net):
    from e2b import ALL_TRAFFIC, Sandbox

    if not hasattr(Sandbox, "update_network"):
        pytest.skip("this e2b SDK has no update_network")

    sbx = create(net)
    try:
        assert reaches(sbx, f"http://{WEB}/")
        sbx.update_network({"deny_out": [ALL_TRAFFIC]})
        assert not reaches(sbx, f"http://{WEB}/")
        sbx.update_network({"allow_out": [WEB], "deny_out": [ALL_TRAFFIC]})
        assert reaches(sbx, f"http://{WEB}/") and not reaches(sbx, f"http://{WEB3}/")
        sbx.update_network({})
        assert reaches(sbx, f"http://{WEB3}/")
    finally:
        sbx.kill()


def test_bad_network_options_are_a_400(net):
    from e2b import SandboxException

    for bad in (["not a host!"], ["2001:db8::/32"], ["1.2.3.4/40"]):
        with pytest.raises(SandboxException) as e:
            create(net, network={"allow_out": bad})
        assert "400" in str(e.value) or "network" in str(e.value).lower(), e.value


def reached(sbx, urls, timeout_s=2):
    """The URLs of `urls` the guest gets an answer from (one guest command, tried in parallel)."""
    script = " ".join(
        f"(curl -s -o /dev/null -m {timeout_s} {u} && echo REACHED {u}) &" for u in urls) + " wait"
    out = sbx.commands.run(script, timeout=timeout_s + 30).stdout
    return [l.split()[1] for l in out.splitlines() if l.startswith("REACHED ")]


def assert_isolated(sbx, other_ip, srv):
    """The guest reaches neither the host (its API listens on every host address: the uplink, the
    sandbox's own gateway and host veth), the metadata address, nor `other_ip` (another sandbox
    serving on :8000)."""
    (ip,) = guest_ip(sbx)
    last = [int(x) for x in ip.split(".")]
    gateway = ".".join(map(str, last[:3] + [last[3] - 1]))
    host_veth = ".".join(map(str, last[:3] + [last[3] + 3]))
    hosts = [h for h in host_ips() if not h.startswith(("127.", "10.200."))] + [gateway, host_veth]
    urls = [f"http://{h}:{srv.port}/health" for h in hosts]
    urls += [f"http://{METADATA}/", f"http://{other_ip}:8000/"]
    assert reached(sbx, urls) == []


def test_isolation_holds_also_after_pause_resume_and_fork(net):
    from conftest import pause

    # The host API answers on every host address (it listens on 0.0.0.0), and the metadata address
    # answers from the host: only the sandbox's rules keep the guests out.
    assert sh("curl", "-s", "-m", "2", f"http://{METADATA}/", check=False).returncode == 0
    a, b = create(net), create(net)
    try:
        b.commands.run("cd /tmp && python3 -m http.server 8000 >/dev/null 2>&1", background=True)
        deadline = time.monotonic() + 30
        while not reaches(b, "http://127.0.0.1:8000/"):
            assert time.monotonic() < deadline, "server in sandbox b did not start"
            time.sleep(0.5)
        (ip_a,), (ip_b,) = guest_ip(a), guest_ip(b)
        assert ip_a != ip_b
        assert_isolated(a, ip_b, net)
        assert reaches(a, f"http://{WEB}/")

        from e2b import Sandbox

        pause(a)
        a = Sandbox.connect(a.sandbox_id, **conn(net))
        assert guest_ip(a) == [ip_a]
        assert_isolated(a, ip_b, net)
        assert reaches(a, f"http://{WEB}/")

        forks = a.fork(count=2, timeout=600) if hasattr(a, "fork") else []  # e2b < 2.x: no fork
        try:
            ips = {ip_a, ip_b}
            for f in forks:
                (ip_f,) = guest_ip(f)
                assert ip_f not in ips, f"fork reuses {ip_f}"
                ips.add(ip_f)
                assert reaches(f, f"http://{WEB}/")
                assert_isolated(f, ip_b, net)
        finally:
            for f in forks:
                f.kill()
    finally:
        a.kill()
        b.kill()


def test_connection_limit_holds_and_drops_are_counted(net):
    """The server runs with `--net-max-connections 64`: the guest gets 64 connections at once, no more."""
    sbx = create(net)
    try:
        code = (
            "import socket\n"
            "ok = []\n"
            "for i in range(80):\n"
            "    s = socket.socket(); s.settimeout(3)\n"
            "    try:\n"
            f"        s.connect(('{WEB}', 80)); ok.append(s)\n"
            "    except OSError:\n"
            "        pass\n"
            "print(len(ok))\n"
        )
        sbx.files.write("/tmp/conns.py", code)
        n = int(sbx.commands.run("python3 /tmp/conns.py", timeout=120).stdout.strip())
        assert n == 64, n
        # Once they close, new connections work again.
        assert reaches(sbx, f"http://{WEB}/")
        req = urllib.request.Request(f"http://127.0.0.1:{net.port}/sandboxes/{sbx.sandbox_id}/metrics",
                                     headers={"X-API-Key": net.api_key})
        with urllib.request.urlopen(req, timeout=30) as r:
            assert json.load(r)[0]["netDroppedPackets"] >= 16
    finally:
        sbx.kill()
