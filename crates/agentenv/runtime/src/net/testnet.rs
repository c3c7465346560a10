//! The test internet of agentenv's bench and network tests: a namespace holding servers on a /24,
//! reached through a veth that sandbox traffic leaves by (the server's `--net-uplink`).
//!
//! It never changes the host's view of a real destination: its range is picked at run time from
//! documentation and benchmarking ranges that no host address, route, resolver or resolver answer for
//! the package mirrors uses; link-local extras (a fake metadata address) are routed for sandbox
//! traffic only. Everything hangs off the veth, so deleting the namespace removes every route, and
//! [`TestInternet::up`] first removes the namespaces of processes that are gone (a crashed run).

use std::net::{Ipv4Addr, ToSocketAddrs};
use std::path::Path;
use std::time::Duration;

use super::slot::{self, run_tool};
use super::{NetError, policy};

/// Namespaces of test internets are `<NS_PREFIX><pid>-<n>`.
const NS_PREFIX: &str = "k3inet-";
/// Priority of the rules that route sandbox-only extras.
const RULE_PREF: u32 = 4242;
/// Serializes pickers of this host (a picked range is claimed by the veth address added under it).
const LOCK: &str = "/run/k3-testnet.lock";
/// Deadline for the resolver answers of the mirrors.
const RESOLVE_DEADLINE: Duration = Duration::from_secs(5);
/// Host names whose addresses the test internet must never shadow, besides the configured mirrors.
const MIRRORS: &[&str] = &[
    "deb.debian.org",
    "security.debian.org",
    "pypi.org",
    "files.pythonhosted.org",
    "index.crates.io",
    "static.crates.io",
    "static.rust-lang.org",
    "registry.npmjs.org",
    "github.com",
];

/// A `/24` of the test internet: `a.b.c.0/24`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Range([u8; 3]);

impl Range {
    /// Address `a.b.c.host`.
    pub fn addr(&self, host: u8) -> Ipv4Addr {
        let [a, b, c] = self.0;
        Ipv4Addr::new(a, b, c, host)
    }
    /// `a.b.c`, for scripts that append the last octet.
    pub fn prefix(&self) -> String {
        let [a, b, c] = self.0;
        format!("{a}.{b}.{c}")
    }
    fn overlaps(&self, net: Ipv4Addr, len: u8) -> bool {
        let me = (self.addr(0), 24);
        policy::contains(me, (net, len)) || policy::contains((policy::mask(net, len), len), me)
    }
}

impl std::fmt::Display for Range {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/24", self.addr(0))
    }
}

/// Candidate ranges, in order: TEST-NET-2, TEST-NET-3, TEST-NET-1, then the benchmarking /15.
pub fn candidates() -> impl Iterator<Item = Range> {
    [[198, 51, 100], [203, 0, 113], [192, 0, 2]]
        .into_iter()
        .chain((18..=19u8).flat_map(|b| (0..=255u8).map(move |c| [198, b, c])))
        .map(Range)
}

/// What the host uses: networks of its addresses and routes (not the default route), its resolvers
/// and what they answer for the package mirrors.
#[derive(Debug, Default, Clone)]
pub struct HostView {
    pub used: Vec<(Ipv4Addr, u8, String)>,
}

impl HostView {
    /// Reads this host's view (addresses, routes of every table, resolvers, mirror answers).
    pub fn read() -> HostView {
        let mut v = HostView::default();
        for (a, len) in super::ipv4_nets(None).unwrap_or_default() {
            v.used.push((a, len, format!("address {a}/{len}")));
        }
        if let Ok(out) = run_tool("ip", &["-4", "route", "show", "table", "all"], "") {
            for l in out.lines() {
                let mut t = l.split_whitespace();
                let mut dest = t.next().unwrap_or("");
                if matches!(
                    dest,
                    "local"
                        | "broadcast"
                        | "unicast"
                        | "unreachable"
                        | "blackhole"
                        | "prohibit"
                        | "throw"
                        | "multicast"
                        | "anycast"
                        | "nat"
                ) {
                    dest = t.next().unwrap_or("");
                }
                if let Some((a, len)) = parse_net(dest).filter(|(_, len)| *len > 0) {
                    v.used.push((a, len, format!("route {l}")));
                }
            }
        }
        for r in super::dns::host_resolvers() {
            let std::net::IpAddr::V4(a) = r.ip() else {
                continue;
            };
            v.used.push((a, 32, format!("resolver {a}")));
        }
        for (name, a) in resolve_all(&mirror_hosts()) {
            v.used.push((a, 32, format!("{name} resolves to {a}")));
        }
        v
    }

    /// The first candidate nothing here overlaps.
    pub fn pick(&self) -> Option<Range> {
        candidates().find(|r| self.used.iter().all(|(a, len, _)| !r.overlaps(*a, *len)))
    }
}

fn parse_net(s: &str) -> Option<(Ipv4Addr, u8)> {
    policy::Target::parse(s).ok().and_then(|t| policy::cidr(&t))
}

/// The mirrors of this host: [`MIRRORS`], apt's sources, pip's index and agentenv's Debian mirror.
fn mirror_hosts() -> Vec<String> {
    let mut hosts: Vec<String> = MIRRORS.iter().map(|s| s.to_string()).collect();
    let mut texts = vec![crate::config::mirror()];
    texts.extend(std::env::var("PIP_INDEX_URL").ok());
    let mut files = vec!["/etc/apt/sources.list".into(), "/etc/pip.conf".into()];
    if let Ok(d) = std::fs::read_dir("/etc/apt/sources.list.d") {
        files.extend(d.flatten().map(|e| e.path()));
    }
    for f in files {
        texts.extend(std::fs::read_to_string(f).ok());
    }
    for t in texts {
        for url in t.split_whitespace() {
            let Some(rest) = url
                .strip_prefix("http://")
                .or_else(|| url.strip_prefix("https://"))
            else {
                continue;
            };
            let host = rest.split(['/', ':']).next().unwrap_or("");
            if !host.is_empty() && !hosts.iter().any(|h| h == host) {
                hosts.push(host.to_owned());
            }
        }
    }
    hosts
}

/// IPv4 answers for `names`, each resolved on its own thread; what is late is left out.
fn resolve_all(names: &[String]) -> Vec<(String, Ipv4Addr)> {
    let (tx, rx) = std::sync::mpsc::channel();
    for n in names {
        let (tx, n) = (tx.clone(), n.clone());
        std::thread::spawn(move || {
            let addrs: Vec<Ipv4Addr> = (n.as_str(), 80)
                .to_socket_addrs()
                .map(|it| {
                    it.filter_map(|a| match a.ip() {
                        std::net::IpAddr::V4(v) => Some(v),
                        _ => None,
                    })
                    .collect()
                })
                .unwrap_or_default();
            let _ = tx.send((n, addrs));
        });
    }
    drop(tx);
    let deadline = std::time::Instant::now() + RESOLVE_DEADLINE;
    let mut out = Vec::new();
    while let Some(left) = deadline.checked_duration_since(std::time::Instant::now()) {
        match rx.recv_timeout(left) {
            Ok((n, addrs)) => out.extend(addrs.into_iter().map(|a| (n.clone(), a))),
            Err(_) => break,
        }
    }
    out
}

/// A running test internet; removed (namespace, veth, routes, rules) on drop.
pub struct TestInternet {
    ns: String,
    uplink: String,
    range: Range,
    /// Table of the sandbox-only routes, once [`TestInternet::route`] made it.
    table: Option<u32>,
}

impl TestInternet {
    /// Picks a free range and makes the namespace with `hosts` (last octets) on its loopback and a
    /// veth to the host. The host routes nothing to it until [`TestInternet::route`].
    pub fn up(hosts: &[u8]) -> Result<TestInternet, NetError> {
        let removed = sweep_stale();
        if removed > 0 {
            tracing::info!(removed, "removed test internets of processes that are gone");
        }
        // Held while a range is picked and claimed (by the veth address added under it).
        let _lock = k3_common::fsutil::FileLock::lock(Path::new(LOCK))
            .map_err(|e| NetError::io("lock", Path::new(LOCK), e))?;
        let view = HostView::read();
        let range = view.pick().ok_or_else(|| {
            NetError::Unavailable(
                "every test-internet candidate range is in use on this host".into(),
            )
        })?;
        static SEQ: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (ns, uplink, peer) = names(std::process::id(), n);
        let me = TestInternet {
            ns: ns.clone(),
            uplink: uplink.clone(),
            range,
            table: None,
        };
        let (host_end, ns_end) = (range.addr(249), range.addr(250));
        let host = format!(
            "netns add {ns}\nlink add {uplink} type veth peer name {peer} netns {ns}\naddr add {host_end}/30 dev {uplink}\nlink set {uplink} up\n"
        );
        let mut inside = format!(
            "addr add {ns_end}/30 dev {peer}\nlink set {peer} up\nlink set lo up\nroute add default via {host_end}\n"
        );
        for h in hosts {
            inside += &format!("addr add {}/32 dev lo\n", range.addr(*h));
        }
        run_tool("ip", &["-batch", "-"], &host)?;
        run_tool("ip", &["-n", &ns, "-batch", "-"], &inside)?;
        tracing::info!(%range, %ns, %uplink, "test internet up (picked a range the host does not use)");
        Ok(me)
    }

    /// Routes the range from the host through the veth, and `sandbox_only` addresses for traffic from
    /// sandboxes only (a rule on their source), so the host itself still reaches the real ones.
    pub fn route(&mut self, sandbox_only: &[Ipv4Addr]) -> Result<(), NetError> {
        let via = self.range.addr(250);
        let (range, dev) = (self.range.to_string(), self.uplink.clone());
        run_tool(
            "ip",
            &[
                "route",
                "replace",
                &range,
                "via",
                &via.to_string(),
                "dev",
                &dev,
            ],
            "",
        )?;
        if sandbox_only.is_empty() {
            return Ok(());
        }
        let table = table_of(std::process::id());
        self.table = Some(table);
        let t = table.to_string();
        for a in sandbox_only {
            let dst = format!("{a}/32");
            run_tool(
                "ip",
                &[
                    "route",
                    "replace",
                    &dst,
                    "via",
                    &via.to_string(),
                    "dev",
                    &dev,
                    "table",
                    &t,
                ],
                "",
            )?;
            run_tool(
                "ip",
                &[
                    "rule",
                    "add",
                    "pref",
                    &RULE_PREF.to_string(),
                    "from",
                    slot::SANDBOX_NET,
                    "to",
                    &dst,
                    "lookup",
                    &t,
                ],
                "",
            )?;
        }
        Ok(())
    }

    /// The picked range.
    pub fn range(&self) -> Range {
        self.range
    }
    /// Address `host` (last octet) of the range.
    pub fn addr(&self, host: u8) -> Ipv4Addr {
        self.range.addr(host)
    }
    /// The namespace's end of the veth: an address on the uplink's own network (the "LAN").
    pub fn link_peer(&self) -> Ipv4Addr {
        self.range.addr(250)
    }
    /// The namespace's name.
    pub fn ns(&self) -> &str {
        &self.ns
    }
    /// The host end of the veth: the server's `--net-uplink`.
    pub fn uplink(&self) -> &str {
        &self.uplink
    }
    /// Runs `f` on a thread inside the namespace (to bind its servers).
    pub fn in_ns<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> Result<T, NetError> + Send + 'static,
    ) -> Result<T, NetError> {
        slot::in_netns(&self.ns, f)
    }
}

impl Drop for TestInternet {
    fn drop(&mut self) {
        if let Some(t) = self.table {
            remove_rules(|table| table == t);
        }
        remove(&self.ns, &self.uplink);
    }
}

/// The namespace, host veth end and namespace veth end of test internet `n` of process `pid`.
fn names(pid: u32, n: u32) -> (String, String, String) {
    let tag = format!("{:x}{n}", pid % 0xfffff);
    (
        format!("{NS_PREFIX}{pid}-{n}"),
        format!("k3u{tag}"),
        format!("k3v{tag}"),
    )
}

/// The routing table of process `pid`'s sandbox-only routes.
fn table_of(pid: u32) -> u32 {
    20_000 + pid % 40_000
}

/// Deletes the host's veth end first (synchronous: its routes go with it; a namespace is torn down
/// asynchronously), then the namespace.
fn remove(ns: &str, uplink: &str) -> bool {
    let _ = run_tool("ip", &["link", "del", uplink], "");
    run_tool("ip", &["netns", "del", ns], "").is_ok()
}

/// Deletes the rules of [`RULE_PREF`] whose table `pick` selects.
fn remove_rules(pick: impl Fn(u32) -> bool) {
    let Ok(out) = run_tool(
        "ip",
        &["-4", "rule", "show", "pref", &RULE_PREF.to_string()],
        "",
    ) else {
        return;
    };
    for l in out.lines() {
        let table = l
            .split_whitespace()
            .skip_while(|w| *w != "lookup")
            .nth(1)
            .and_then(|t| t.parse::<u32>().ok());
        if let Some(t) = table.filter(|t| pick(*t)) {
            let (p, t) = (RULE_PREF.to_string(), t.to_string());
            let _ = run_tool("ip", &["rule", "del", "pref", &p, "lookup", &t], "");
        }
    }
}

/// Removes the test internets of processes that are gone, and rules left without routes. Returns how
/// many namespaces it removed.
pub fn sweep_stale() -> usize {
    let mut removed = 0;
    for e in std::fs::read_dir("/run/netns")
        .into_iter()
        .flatten()
        .flatten()
    {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some((pid, n)) = name
            .strip_prefix(NS_PREFIX)
            .and_then(|r| r.split_once('-'))
            .and_then(|(p, n)| Some((p.parse::<u32>().ok()?, n.parse::<u32>().ok()?)))
        else {
            continue;
        };
        if Path::new(&format!("/proc/{pid}")).exists() {
            continue;
        }
        let (ns, uplink, _) = names(pid, n);
        if remove(&ns, &uplink) {
            removed += 1;
        }
    }
    remove_rules(|t| {
        run_tool("ip", &["-4", "route", "show", "table", &t.to_string()], "")
            .is_ok_and(|r| r.trim().is_empty())
    });
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(used: &[(&str, u8)]) -> HostView {
        HostView {
            used: used
                .iter()
                .map(|(a, l)| (a.parse().unwrap(), *l, String::new()))
                .collect(),
        }
    }

    #[test]
    fn the_pick_skips_every_range_the_host_uses() {
        // A mirror answering from TEST-NET-3 and the host's own address in TEST-NET-1 (this box).
        let v = view(&[
            ("203.0.113.80", 32),
            ("192.0.2.2", 24),
            ("10.255.255.53", 32),
        ]);
        assert_eq!(v.pick().unwrap().prefix(), "198.51.100");
        let v = view(&[("198.51.100.0", 24), ("203.0.113.7", 32), ("192.0.2.0", 25)]);
        assert_eq!(v.pick().unwrap().prefix(), "198.18.0");
        // A wide route covers many candidates at once.
        let v = view(&[
            ("198.51.100.1", 32),
            ("203.0.0.0", 8),
            ("192.0.0.0", 8),
            ("198.18.0.0", 15),
        ]);
        assert_eq!(v.pick(), None);
        assert_eq!(view(&[]).pick().unwrap().to_string(), "198.51.100.0/24");
    }

    #[test]
    fn parse_net_reads_prefixes_and_hosts() {
        assert_eq!(
            parse_net("10.0.0.0/8"),
            Some(("10.0.0.0".parse().unwrap(), 8))
        );
        assert_eq!(parse_net("1.2.3.4"), Some(("1.2.3.4".parse().unwrap(), 32)));
        assert_eq!(parse_net("default"), None);
    }
}
