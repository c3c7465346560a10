//! Sandbox networking with the kernel's own parts: a network namespace per sandbox holding a tap (the
//! guest's NIC) and a veth pair to the host, routing and NAT to the host's uplink, and nftables rules
//! in the namespace for the egress policy and the isolation invariants. See [`slot`] for the layout.
//!
//! The host gets one table, `ip agentenv`: nothing from a sandbox veth reaches the host itself (its
//! API, its loopback, any of its addresses), no packet passes between two sandboxes, and sandbox
//! traffic leaving by another interface is masqueraded. IPv4 forwarding is enabled on the sandbox
//! veths and the uplink only, never globally.

pub mod dns;
pub mod intercept;
pub mod policy;
pub mod slot;
pub mod testnet;

use std::net::SocketAddr;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};

pub use policy::{EgressPolicy, NetLimits, Target};
pub use slot::SlotAddrs;

/// Wait before warm slots are made again after one was taken, and before a released one is
/// deleted: the `ip`/`nft` runs and the kernel's namespace teardown then do not compete with the
/// restore in flight (measured on 2 cores: they add tens of ms to a create when they overlap).
const REFILL_DELAY: std::time::Duration = std::time::Duration::from_millis(1500);

/// Reads of a sandbox's counters before [`Network::stats`] gives up.
const STATS_TRIES: u32 = 3;

/// Errors of sandbox networking.
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    /// The host cannot give sandboxes a network.
    #[error("networking is unavailable on this host: {0}")]
    Unavailable(String),
    /// Every slot number is taken.
    #[error("all {0} sandbox network slots are in use")]
    Exhausted(u32),
    /// `ip` or `nft` failed.
    #[error("{program}: {detail}")]
    Tool { program: String, detail: String },
    /// A system call or file failed.
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
}

impl NetError {
    pub(crate) fn io(what: &'static str, path: &Path, source: std::io::Error) -> NetError {
        NetError::Io {
            what,
            path: path.to_owned(),
            source,
        }
    }
}

/// Networking settings of a runtime.
#[derive(Debug, Clone, Default)]
pub struct NetConfig {
    /// Interface sandbox traffic leaves by; `None`: the interface of the host's default route.
    pub uplink: Option<String>,
    /// Resolvers the guests' queries go to; empty: the host's `/etc/resolv.conf`.
    pub dns_upstream: Vec<SocketAddr>,
    /// Limits of every sandbox.
    pub limits: NetLimits,
    /// Slots kept ready so a create does not wait for `ip`.
    pub warm: usize,
    /// Fail [`crate::Runtime::open`] when networking cannot start (else sandboxes get none).
    pub required: bool,
    /// Private ranges (CIDRs) sandboxes may reach; by default none of [`policy::PRIVATE`] nor the
    /// uplink's own networks.
    pub allow_private: Vec<String>,
    /// The egress proxy (transform rules, the sandbox domain); `None`: guests' TCP is only routed.
    pub egress: Option<Arc<agentenv_egress::Proxy>>,
}

/// A blocking task that did not finish (panicked or cancelled), as a [`NetError`].
fn joined(what: &str, e: tokio::task::JoinError) -> NetError {
    NetError::Tool {
        program: what.into(),
        detail: e.to_string(),
    }
}

/// The interface of the host's default route (`/proc/net/route`).
pub fn default_route_interface() -> Option<String> {
    let routes = std::fs::read_to_string("/proc/net/route").ok()?;
    routes.lines().skip(1).find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        (f.len() > 2 && f[1] == "00000000").then(|| f[0].to_owned())
    })
}

/// [`policy::PRIVATE`] and the networks on `uplink` (the host's LAN), less `allow` (CIDRs).
fn blocked_ranges(
    uplink: &str,
    allow: &[String],
) -> Result<Vec<(std::net::Ipv4Addr, u8)>, NetError> {
    let bad = |e: String| NetError::Unavailable(format!("--net-allow-private: {e}"));
    let allowed = allow
        .iter()
        .map(|s| {
            policy::Target::parse(s)
                .ok()
                .and_then(|t| policy::cidr(&t))
                .ok_or_else(|| bad(format!("{s:?} is not an IPv4 CIDR")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mut nets: Vec<_> = policy::PRIVATE
        .iter()
        .filter_map(|s| policy::Target::parse(s).ok().and_then(|t| policy::cidr(&t)))
        .collect();
    nets.extend(ipv4_nets(Some(uplink))?);
    Ok(policy::subtract(&nets, &allowed))
}

/// The IPv4 networks (masked CIDRs) of the host's addresses, of one interface or all.
pub(crate) fn ipv4_nets(dev: Option<&str>) -> Result<Vec<(std::net::Ipv4Addr, u8)>, NetError> {
    let mut args = vec!["-4", "-o", "addr", "show"];
    args.extend(dev.map(|d| ["dev", d]).into_iter().flatten());
    let out = slot::run_tool("ip", &args, "")?;
    Ok(out
        .lines()
        .filter_map(|l| l.split_whitespace().skip_while(|w| *w != "inet").nth(1))
        .filter_map(|c| policy::Target::parse(c).ok())
        .filter_map(|t| policy::cidr(&t))
        .collect())
}

fn host_rules() -> String {
    let p = slot::HOST_IF_PREFIX;
    format!(
        "table ip agentenv
flush table ip agentenv
table ip agentenv {{
  chain input {{ type filter hook input priority -5; policy accept; iifname \"{p}*\" drop; }}
  chain forward {{
    type filter hook forward priority -5; policy accept;
    iifname \"{p}*\" oifname \"{p}*\" drop
    oifname \"{p}*\" ct state established,related accept
    oifname \"{p}*\" drop
  }}
  chain postrouting {{
    type nat hook postrouting priority 100; policy accept;
    ip saddr {} oifname != \"{p}*\" masquerade
  }}
}}
",
        slot::SANDBOX_NET
    )
}

/// A sandbox's network: its slot, the tap QEMU gets, its policy and resolver.
pub struct Attachment {
    pub addrs: SlotAddrs,
    /// The tap, inherited by each QEMU of the sandbox (opened on first use: a QEMU of a previous run
    /// may hold it).
    tap: Mutex<Option<Arc<OwnedFd>>>,
    policy: Arc<RwLock<EgressPolicy>>,
    resolver: tokio::task::JoinHandle<()>,
    /// The egress proxy's accept loop.
    intercept: Option<tokio::task::JoinHandle<()>>,
    /// The CA the guest trusts (the egress proxy's), PEM.
    ca_pem: Option<String>,
    /// The slot's marker while this attachment holds it.
    marker: String,
}

impl Attachment {
    /// The guest's settings for `/init`.
    pub fn guest(&self) -> agentenv_envd::GuestNetwork {
        agentenv_envd::GuestNetwork {
            address: self.addrs.guest,
            prefix_len: 30,
            gateway: self.addrs.gateway,
            dns: vec![self.addrs.gateway],
            mac: self.addrs.mac(),
            ca_pem: self.ca_pem.clone(),
        }
    }
    /// The tap for the next QEMU.
    pub fn tap(&self) -> Result<Arc<OwnedFd>, NetError> {
        let mut t = self.tap.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(fd) = &*t {
            return Ok(fd.clone());
        }
        let fd = Arc::new(slot::open_tap(&self.addrs)?);
        *t = Some(fd.clone());
        Ok(fd)
    }
    /// The policy in force.
    pub fn policy(&self) -> EgressPolicy {
        self.policy
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

pub use agentenv_vm::NetStats;

/// A slot's marker: `<pid> <owner>`, the process managing the slot and the sandbox folder holding
/// it (`<state folder>/warm` for a warm one). Other processes delete a slot only once that process
/// is gone (and its sandbox folder too), and a deletion checks the marker under the host lock.
fn marker(owner: &str) -> String {
    format!("{} {owner}", std::process::id())
}

/// A marker's process (`None`: unreadable, or written by an older version) and owner.
fn parse_marker(m: &str) -> (Option<u32>, &str) {
    match m.split_once(' ') {
        Some((pid, owner)) if pid.parse::<u32>().is_ok() => (pid.parse().ok(), owner),
        _ => (None, m),
    }
}

/// Whether slot `index`'s marker names sandbox folder `owner`.
pub fn held_by(index: u32, owner: &Path) -> bool {
    slot::marker(index).is_some_and(|m| Path::new(parse_marker(&m).1) == owner)
}

/// Whether a slot marked `m` is left over, seen from process `me` of state folder `state`; `known`
/// (after recovery): the sandbox folders of this state folder that hold a slot rightly.
fn is_stale(m: &str, me: u32, state: &str, known: Option<&[String]>) -> bool {
    let (pid, owner) = parse_marker(m);
    if pid == Some(me) {
        return false;
    }
    let warm = owner.ends_with("/warm") || owner.contains("/warm/");
    let ours = owner.starts_with(&format!("{state}/"));
    let alive = pid.is_some_and(|p| Path::new("/proc").join(p.to_string()).exists());
    match (ours, warm) {
        // A previous run of this state folder (one runtime per folder at a time).
        (true, true) => true,
        (true, false) => {
            !Path::new(owner).exists() || known.is_some_and(|k| !k.iter().any(|o| o == owner))
        }
        // Another runtime's: only once it is gone.
        (false, true) => !alive,
        (false, false) => !alive && !Path::new(owner).exists(),
    }
}

/// Networking of one runtime.
pub struct Network {
    cfg: NetConfig,
    /// Private ranges and the uplink's networks, less `allow_private`: dropped for every sandbox.
    blocked: Vec<(std::net::Ipv4Addr, u8)>,
    upstream: Arc<dns::Upstream>,
    /// This runtime's state folder: the owners in its slot markers start with it.
    state: String,
    warm: Mutex<Vec<slot::Slot>>,
    filling: std::sync::atomic::AtomicBool,
    /// Released slots (and their markers) waiting for their deletion.
    dying: Mutex<Vec<(SlotAddrs, String)>>,
}

impl Network {
    /// Checks the host, installs the host table and enables forwarding on the uplink.
    pub fn start(cfg: NetConfig, state_dir: &Path) -> Result<Arc<Network>, NetError> {
        if let Some(why) = k3_common::netcheck::sandbox_network_blocker() {
            return Err(NetError::Unavailable(why));
        }
        let uplink = cfg
            .uplink
            .clone()
            .or_else(default_route_interface)
            .ok_or_else(|| {
                NetError::Unavailable("no uplink: the host has no default route".into())
            })?;
        let blocked = blocked_ranges(&uplink, &cfg.allow_private)?;
        slot::run_tool("nft", &["-f", "-"], &host_rules())?;
        let fwd = format!("/proc/sys/net/ipv4/conf/{uplink}/forwarding");
        std::fs::write(&fwd, "1").map_err(|e| NetError::io("write", Path::new(&fwd), e))?;
        let upstream = match cfg.dns_upstream.is_empty() {
            true => dns::host_resolvers(),
            false => cfg.dns_upstream.clone(),
        };
        tracing::info!(%uplink, upstream = ?upstream, "sandbox networking on");
        tracing::info!(blocked = blocked.len(), allowed = ?cfg.allow_private, "private ranges and the uplink's networks blocked for sandboxes");
        let net = Arc::new(Network {
            cfg,
            blocked,
            upstream: Arc::new(dns::Upstream::new(upstream)),
            state: state_dir.display().to_string(),
            warm: Mutex::new(Vec::new()),
            filling: Default::default(),
            dying: Mutex::new(Vec::new()),
        });
        let gone = net.remove_stale(None);
        if gone > 0 {
            tracing::info!(
                removed = gone,
                "removed sandbox networks of processes that are gone"
            );
        }
        Ok(net)
    }

    fn new_slot(&self) -> Result<slot::Slot, NetError> {
        let warm = self.warm_marker();
        let s = slot::create(&warm)?;
        let rules = policy::ruleset(
            &s.addrs,
            &EgressPolicy::default(),
            self.cfg.limits,
            &self.blocked,
            self.cfg.egress.is_some(),
        );
        if let Err(e) = slot::load_rules(&s.addrs, rules) {
            self.forget(s.addrs, &warm);
            return Err(e);
        }
        Ok(s)
    }

    /// Fills the warm pool up to its size, in the background, after [`REFILL_DELAY`] (so the
    /// `ip`/`nft` runs do not compete with the restore that just took a slot).
    pub fn refill(self: &Arc<Self>) {
        let me = self.clone();
        tokio::spawn(async move {
            tokio::time::sleep(REFILL_DELAY).await;
            let _ = tokio::task::spawn_blocking(move || me.fill()).await;
        });
    }

    fn fill(&self) {
        use std::sync::atomic::Ordering;
        if self.filling.swap(true, Ordering::AcqRel) {
            return;
        }
        while self.warm.lock().unwrap_or_else(|e| e.into_inner()).len() < self.cfg.warm {
            match self.new_slot() {
                Ok(s) => self.warm.lock().unwrap_or_else(|e| e.into_inner()).push(s),
                Err(e) => {
                    tracing::warn!(error = %e, "preparing a network slot failed");
                    break;
                }
            }
        }
        self.filling.store(false, Ordering::Release);
    }

    /// Gives sandbox `owner` (its folder) a slot with `policy` in force.
    pub async fn attach(
        self: &Arc<Self>,
        owner: &Path,
        policy: EgressPolicy,
    ) -> Result<Attachment, NetError> {
        let warm = self.warm.lock().unwrap_or_else(|e| e.into_inner()).pop();
        let me = self.clone();
        let mark = marker(&owner.display().to_string());
        let (p, m) = (policy.clone(), mark.clone());
        let (s, tap) = tokio::task::spawn_blocking(move || {
            let (policy, mark) = (p, m);
            let s = match warm {
                Some(s) => s,
                None => me.new_slot()?,
            };
            slot::set_marker(s.addrs.index, &mark);
            let done = (|| {
                if policy != EgressPolicy::default() {
                    slot::load_rules(
                        &s.addrs,
                        policy::ruleset(&s.addrs, &policy, me.cfg.limits, &me.blocked, me.proxy()),
                    )?;
                }
                slot::open_tap(&s.addrs)
            })();
            match done {
                Ok(tap) => Ok((s, tap)),
                Err(e) => {
                    me.forget(s.addrs, &mark);
                    Err(e)
                }
            }
        })
        .await
        .map_err(|e| joined("attach", e))??;
        self.refill();
        self.finish_attach(s, Some(tap), policy, mark)
    }

    fn finish_attach(
        &self,
        s: slot::Slot,
        tap: Option<OwnedFd>,
        policy: EgressPolicy,
        marker: String,
    ) -> Result<Attachment, NetError> {
        let policy = Arc::new(RwLock::new(policy));
        let egress = self.cfg.egress.clone();
        let local = egress
            .as_ref()
            .and_then(|p| p.local_domain())
            .map(Arc::from);
        let resolver = dns::serve(s.addrs, s.dns, policy.clone(), self.upstream.clone(), local)
            .map_err(|e| NetError::io("serve resolver", Path::new("udp/53"), e))?;
        let intercept = match &egress {
            Some(p) => Some(
                intercept::serve(s.addrs, s.proxy, policy.clone(), p.clone())
                    .map_err(|e| NetError::io("serve proxy", Path::new("tcp/proxy"), e))?,
            ),
            None => None,
        };
        Ok(Attachment {
            addrs: s.addrs,
            tap: Mutex::new(tap.map(Arc::new)),
            policy,
            resolver,
            intercept,
            ca_pem: egress.map(|p| p.ca().pem().to_owned()),
            marker,
        })
    }

    /// Takes over slot `index` of sandbox `owner` (its folder) of a previous run (its QEMU may
    /// still hold the tap).
    pub async fn adopt(
        self: &Arc<Self>,
        owner: &Path,
        index: u32,
        policy: EgressPolicy,
    ) -> Result<Attachment, NetError> {
        let a = SlotAddrs::of(index);
        let me = self.clone();
        let mark = marker(&owner.display().to_string());
        let (p, m) = (policy.clone(), mark.clone());
        let dns = tokio::task::spawn_blocking(move || {
            slot::set_marker(index, &m);
            let rules = policy::ruleset(&a, &p, me.cfg.limits, &me.blocked, me.proxy());
            slot::load_rules(&a, rules)?;
            slot::bind_sockets(&a)
        })
        .await
        .map_err(|e| joined("adopt", e))??;
        let s = slot::Slot {
            addrs: a,
            dns: dns.0,
            proxy: dns.1,
        };
        self.finish_attach(s, None, policy, mark)
    }

    /// Replaces the policy of a running attachment (new connections follow it at once).
    pub async fn update(&self, att: &Attachment, policy: EgressPolicy) -> Result<(), NetError> {
        let (a, limits, p) = (att.addrs, self.cfg.limits, policy.clone());
        let (blocked, proxy) = (self.blocked.clone(), self.proxy());
        tokio::task::spawn_blocking(move || {
            slot::load_rules(&a, policy::ruleset(&a, &p, limits, &blocked, proxy))
        })
        .await
        .map_err(|e| joined("update", e))??;
        *att.policy.write().unwrap_or_else(|e| e.into_inner()) = policy;
        Ok(())
    }

    /// Hands `att`'s slot to a new owner folder (a warm VM's slot taken by a sandbox).
    pub fn reown(&self, att: &mut Attachment, owner: &Path) {
        let mark = marker(&owner.display().to_string());
        slot::set_marker(att.addrs.index, &mark);
        att.marker = mark;
    }

    /// The counters of an attachment.
    /// A read that fails (the `nft` run, under load) is logged and tried again, [`STATS_TRIES`] times.
    pub async fn stats(&self, att: &Attachment) -> Result<NetStats, NetError> {
        let a = att.addrs;
        let mut tries = 0;
        let (tx_bytes, rx_bytes, dropped_packets) = loop {
            tries += 1;
            let r = tokio::task::spawn_blocking(move || slot::counters(&a))
                .await
                .map_err(|e| joined("stats", e))
                .and_then(|r| r);
            match r {
                Ok(c) => break c,
                Err(e) if tries < STATS_TRIES => {
                    tracing::warn!(netns = %a.netns(), error = %e, "reading the traffic counters failed; again");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
                Err(e) => return Err(e),
            }
        };
        Ok(NetStats {
            tx_bytes,
            rx_bytes,
            dropped_packets,
        })
    }

    /// Deletes slot `a` if it is still marked `mark` (its number may be another's by now).
    fn forget(&self, a: SlotAddrs, mark: &str) {
        slot::remove_if(a.index, |m| m == mark);
    }

    /// Ends an attachment: its namespace (tap, veth, rules) goes, in the background.
    pub fn release(self: &Arc<Self>, att: Attachment) {
        att.resolver.abort();
        if let Some(t) = &att.intercept {
            t.abort();
        }
        let (a, mark) = (att.addrs, att.marker.clone());
        self.dying
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((a, mark.clone()));
        drop(att);
        let me = self.clone();
        tokio::spawn(async move {
            tokio::time::sleep(REFILL_DELAY).await;
            let _ = tokio::task::spawn_blocking(move || {
                let mut d = me.dying.lock().unwrap_or_else(|e| e.into_inner());
                if let Some(i) = d.iter().position(|x| x.0 == a) {
                    d.swap_remove(i);
                    drop(d);
                    me.forget(a, &mark);
                }
            })
            .await;
        });
    }

    fn proxy(&self) -> bool {
        self.cfg.egress.is_some()
    }

    fn warm_marker(&self) -> String {
        marker(&format!("{}/warm", self.state))
    }

    /// Removes slots left by a crash (see [`is_stale`]); `known`, after recovery: the sandbox
    /// folders that hold a slot rightly. Returns how many went.
    pub fn remove_stale(&self, known: Option<&[String]>) -> usize {
        let me = std::process::id();
        slot::existing()
            .into_iter()
            .filter(|&index| {
                // No marker: being made right now.
                slot::remove_if(index, |m| is_stale(m, me, &self.state, known))
            })
            .count()
    }

    /// Deletes the warm slots and those released but not yet deleted (the runtime is closing).
    pub fn drain(&self) {
        let warm = self.warm_marker();
        for s in std::mem::take(&mut *self.warm.lock().unwrap_or_else(|e| e.into_inner())) {
            self.forget(s.addrs, &warm);
        }
        for (a, m) in std::mem::take(&mut *self.dying.lock().unwrap_or_else(|e| e.into_inner())) {
            self.forget(a, &m);
        }
    }
}

/// What a sandbox's `net.json` keeps: its slot and policy, to adopt after a restart.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct NetRecord {
    pub slot: u32,
    pub policy: EgressPolicy,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slot_is_stale_only_once_its_process_and_sandbox_are_gone() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state").display().to_string();
        let live_sbx = dir.path().join("state/sandboxes/a");
        std::fs::create_dir_all(&live_sbx).unwrap();
        let live_sbx = live_sbx.display().to_string();
        let gone_sbx = format!("{state}/sandboxes/gone");
        let other = dir.path().join("other").display().to_string();
        let me = std::process::id();
        let alive = 1; // init
        let dead = u32::MAX - 1;
        let m = |pid: u32, owner: &str| format!("{pid} {owner}");
        let stale = |mk: &str, known: Option<&[String]>| is_stale(mk, me, &state, known);
        // Mine now: never.
        assert!(!stale(&m(me, &format!("{state}/warm")), None));
        assert!(!stale(&m(me, &gone_sbx), None));
        // A previous run of this state folder: warm ones, and sandboxes gone or not known.
        assert!(stale(&m(dead, &format!("{state}/warm")), None));
        assert!(stale(&m(dead, &gone_sbx), None));
        assert!(!stale(&m(dead, &live_sbx), None));
        assert!(!stale(
            &m(dead, &live_sbx),
            Some(std::slice::from_ref(&live_sbx))
        ));
        assert!(stale(&m(dead, &live_sbx), Some(&[])));
        // Another runtime's, while it lives: never, even if the sandbox folder is gone already
        // (released, deletion pending).
        assert!(!stale(&m(alive, &format!("{other}/warm")), None));
        assert!(!stale(
            &m(alive, &format!("{other}/sandboxes/x")),
            Some(&[])
        ));
        // ... and once it is gone: warm ones, and sandboxes whose folder is gone.
        assert!(stale(&m(dead, &format!("{other}/warm")), None));
        assert!(stale(&m(dead, &format!("{other}/sandboxes/x")), None));
        let kept = dir.path().join("other/sandboxes/y");
        std::fs::create_dir_all(&kept).unwrap();
        assert!(!stale(&m(dead, &kept.display().to_string()), Some(&[])));
        // Markers of an older version (no process): by folder alone.
        assert!(stale(&format!("{other}/warm/123"), None));
        assert!(stale(&format!("{other}/sandboxes/x"), None));
    }

    #[test]
    fn markers_name_their_process_and_owner() {
        let m = marker("/s/sandboxes/a b");
        assert_eq!(
            parse_marker(&m),
            (Some(std::process::id()), "/s/sandboxes/a b")
        );
        assert_eq!(parse_marker("/old/path"), (None, "/old/path"));
    }
}
