"""Sandbox networking through the stock e2b SDK, against a test "internet": a network namespace with
an HTTP server on several addresses, a DNS server and a fake link-local metadata address. No test
touches a real outside address. Needs root, iproute2 and nftables (skips with the reason otherwise;
fails instead under K3_REQUIRE_KVM=1, as the QEMU tests do).

The namespace, its veth and routes are made by the Rust harness (`tests/python_sdk.rs`, which picks a
range the host does not use) and named by K3_TESTNET_NS, K3_TESTNET_UPLINK and K3_TESTNET_PREFIX;
this file starts the servers inside it."""

import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.request

import pytest

from conftest import Server, sdk_env

PREFIX = os.environ.get("K3_TESTNET_PREFIX", "")
WEB = f"{PREFIX}.10"  # allowed.test, www.allowed.test
WEB2 = f"{PREFIX}.11"  # denied.test
WEB3 = f"{PREFIX}.12"  # other.test
DNS = f"{PREFIX}.53"
METADATA = "169.254.169.254"  # routed into the namespace for sandbox traffic only
PRIVATE = os.environ.get("K3_TESTNET_PRIVATE", "")  # a private address, routed likewise
LINK_PEER = os.environ.get("K3_TESTNET_LINK_PEER", "")  # the namespace on the uplink's own network

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
        if name.endswith(".flood.test"):  # never answered: each query waits out its deadline
            continue
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
    """The servers of the harness's test internet: namespace K3_TESTNET_NS, reached from the host by
    veth K3_TESTNET_UPLINK (the uplink the server is given); the host routes its range through it, and
    the metadata address for sandbox traffic only."""

    def __init__(self):
        self.ns, self.host_if = os.environ["K3_TESTNET_NS"], os.environ["K3_TESTNET_UPLINK"]
        self.procs = []
        self.tmp = tempfile.mkdtemp(prefix="k3inet-")

    def up(self):
        n = self.ns
        for a in (METADATA, PRIVATE):
            sh("ip", "-n", n, "addr", "add", f"{a}/32", "dev", "lo")
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
        for a in (METADATA, PRIVATE):
            sh("ip", "-n", self.ns, "addr", "del", f"{a}/32", "dev", "lo", check=False)
        shutil.rmtree(self.tmp, ignore_errors=True)


def _skip_reason():
    if os.geteuid() != 0:
        return "needs root (network namespaces, nftables)"
    for tool in ("ip", "nft", "curl"):
        if shutil.which(tool) is None:
            return f"`{tool}` is missing (apt-get install iproute2 nftables curl)"
    if not os.path.exists("/dev/net/tun"):
        return "/dev/net/tun is missing"
    if not os.environ.get("K3_TESTNET_NS"):
        return "no test internet: run through `cargo test -p agentenv-server --test python_sdk`"
    return None


@pytest.fixture(scope="module")
def net():
    why = _skip_reason()
    if why:
        if os.environ.get("K3_REQUIRE_KVM") == "1":
            pytest.fail(why)
        if os.environ.get("K3_SKIP_LOG"):  # counted by `cargo xtask test`, as k3_common::require does
            with open(os.environ["K3_SKIP_LOG"], "a") as f:
                f.write(f"network\ttest_network.py\tskip network: test_network.py: {why}\n")
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
    with sdk_env(srv):
        yield srv
    try:
        srv.close()
    finally:
        inet.down()


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
    # is routed into the test internet for sandbox sources, where it answers: only the sandbox's
    # rules keep the guests out.
    assert sh("ip", "netns", "exec", net.inet.ns, "curl", "-s", "-m", "2", f"http://{METADATA}/",
              check=False).returncode == 0
    rules = sh("ip", "rule").stdout
    assert f"to {METADATA}" in rules, rules
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


DNS_FLOOD = r"""
import os, random, socket, string, sys, time
ns = [l.split()[1] for l in open("/etc/resolv.conf") if l.startswith("nameserver")][0]
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setblocking(False)
n = int(sys.argv[1])
for i in range(n):
    name = "".join(random.choices(string.ascii_lowercase, k=12)) + ".flood.test"
    q = os.urandom(2) + b"\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00"
    q += b"".join(bytes([len(l)]) + l.encode() for l in name.split(".")) + b"\x00\x00\x01\x00\x01"
    try:
        s.sendto(q, (ns, 53))
    except BlockingIOError:
        time.sleep(0.001)
print("sent", n)
"""


def test_a_dns_flood_from_a_guest_leaves_the_server_and_other_sandboxes_alone(net):
    """Security: 20,000 queries for random names from one guest. The server's descriptors stay
    bounded (one shared upstream socket pool, a per-sandbox rate and in-flight limit), its API answers,
    and another sandbox still resolves names."""
    a, b = create(net), create(net)
    pid = net.proc.pid

    def fds():
        return len(os.listdir(f"/proc/{pid}/fd"))

    try:
        a.files.write("/tmp/flood.py", DNS_FLOOD)
        before = fds()
        flood = a.commands.run("python3 /tmp/flood.py 20000", background=True)
        peak, until = before, time.monotonic() + 10
        resolved = []
        while time.monotonic() < until:  # while the flood runs
            peak = max(peak, fds())
            assert urllib.request.urlopen(f"http://127.0.0.1:{net.port}/health", timeout=5).status == 204
            r = b.commands.run("getent hosts allowed.test || true", timeout=30)
            resolved.append(WEB in r.stdout)
            peak = max(peak, fds())
        assert "sent 20000" in flood.wait().stdout
        peak = max(peak, fds())
        assert peak - before < 200, f"server descriptors grew from {before} to {peak}"
        assert resolved and all(resolved), resolved
    finally:
        a.kill()
        b.kill()


def test_private_ranges_and_the_lan_are_closed_unless_the_operator_opens_one(net):
    """Security: a default sandbox reaches the internet but no private address and nothing on the
    uplink's own network, whatever its allow_out says; `--net-allow-private CIDR` opens that range
    only (a second server with it)."""
    sbx = create(net, network={"allow_out": [f"{PRIVATE}/32", f"{LINK_PEER}/32"]})
    try:
        assert reaches(sbx, f"http://{WEB}/")
        assert reached(sbx, [f"http://{PRIVATE}/", f"http://{LINK_PEER}/"]) == []
    finally:
        sbx.kill()
    state = tempfile.mkdtemp(prefix="agentenv-pytest-private-")
    srv = Server(os.environ["AGENTENV_BIN"], state, listen_host="0.0.0.0", extra_args=[
        "--network", "on", "--net-uplink", net.inet.host_if, "--net-dns", DNS,
        "--net-allow-private", f"{PRIVATE.rsplit('.', 1)[0]}.0/24"])
    srv.start()
    try:
        from e2b import Sandbox

        url = f"http://127.0.0.1:{srv.port}"
        s2 = Sandbox.create("base", timeout=300, api_key=srv.api_key, api_url=url, sandbox_url=url)
        try:
            assert reached(s2, [f"http://{PRIVATE}/", f"http://{LINK_PEER}/"]) == [f"http://{PRIVATE}/"]
        finally:
            s2.kill()
    finally:
        srv.stop()
        shutil.rmtree(state, ignore_errors=True)


UDP_LOG = r"""
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind((sys.argv[1], 5353))
with open(sys.argv[2], "a", buffering=1) as f:
    while True:
        data, (src, _) = s.recvfrom(512)
        f.write(f"{src} {data.decode(errors='replace')}\n")
"""

SPOOF = r"""
import socket, struct, sys
dst, forged, tag = sys.argv[1], sys.argv[2], sys.argv[3].encode()
def csum(b):
    b += b"\0" * (len(b) % 2)
    s = sum(struct.unpack(f"!{len(b)//2}H", b)); s = (s >> 16) + (s & 0xffff); s += s >> 16
    return ~s & 0xffff
udp = struct.pack("!HHHH", 40000, 5353, 8 + len(tag), 0) + tag
ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), 1, 0, 64, 17, 0,
                 socket.inet_aton(forged), socket.inet_aton(dst))
ip = ip[:10] + struct.pack("!H", csum(ip)) + ip[12:]
s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
for _ in range(5):
    s.sendto(ip + udp, (dst, 0))
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for _ in range(5):
    u.sendto(b"honest", (dst, 5353))
print("sent")
"""


def test_a_guest_cannot_send_with_a_forged_source_address(net):
    """Security: packets a guest sends with a source other than its own address are dropped in its
    namespace (the control: its honest datagrams arrive)."""
    log = os.path.join(net.inet.tmp, "udp.log")
    listener = subprocess.Popen(["ip", "netns", "exec", net.inet.ns, "python3", "-c", UDP_LOG, WEB, log],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    sbx = create(net)
    try:
        time.sleep(0.5)
        sbx.files.write("/tmp/spoof.py", SPOOF)
        forged = f"{PREFIX}.77"  # an address of the test internet's range, outside every sandbox
        out = sbx.commands.run(f"python3 /tmp/spoof.py {WEB} {forged} forged", user="root", timeout=60)
        assert "sent" in out.stdout
        def logged():
            return open(log).read() if os.path.exists(log) else ""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and "honest" not in logged():
            time.sleep(0.2)
        time.sleep(0.5)  # the forged ones were sent first; give stragglers a moment
        lines = logged().splitlines()
        assert any(l.endswith("honest") for l in lines), lines
        assert not any("forged" in l for l in lines), lines
    finally:
        sbx.kill()
        listener.kill()
