//! Sandbox networking with the kernel's own parts: a network namespace per sandbox holding a tap (the
//! guest's NIC) and a veth pair to the host, routing and NAT to the host's uplink, and nftables rules
//! in the namespace for the egress policy and the isolation invariants. See [`slot`] for the layout.
//!
//! The host gets one table, `ip agentenv`: nothing from a sandbox veth reaches the host itself (its
//! API, its loopback, any of its addresses), no packet passes between two sandboxes, and sandbox
//! traffic leaving by another interface is masqueraded. IPv4 forwarding is enabled on the sandbox
//! veths and the uplink only, never globally.

pub mod dns;
pub mod policy;
pub mod slot;

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

/// Where owner markers of slots live (`<index>` holds the owner's path).
const OWNERS_DIR: &str = "/run/agentenv-net";

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

/// Byte and drop counts of a sandbox's network.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NetStats {
    /// Guest to outside.
    pub tx_bytes: u64,
    /// Outside to guest.
    pub rx_bytes: u64,
    /// Packets dropped by policy, invariants or limits.
    pub dropped_packets: u64,
}

/// Networking of one runtime.
pub struct Network {
    cfg: NetConfig,
    upstream: Arc<Vec<SocketAddr>>,
    /// This runtime's state folder: slot markers start with it.
    owner: String,
    warm: Mutex<Vec<slot::Slot>>,
    filling: std::sync::atomic::AtomicBool,
    /// Released slots waiting for their deletion.
    dying: Mutex<Vec<SlotAddrs>>,
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
        slot::run_tool("nft", &["-f", "-"], &host_rules())?;
        let fwd = format!("/proc/sys/net/ipv4/conf/{uplink}/forwarding");
        std::fs::write(&fwd, "1").map_err(|e| NetError::io("write", Path::new(&fwd), e))?;
        std::fs::create_dir_all(OWNERS_DIR)
            .map_err(|e| NetError::io("create", Path::new(OWNERS_DIR), e))?;
        let upstream = match cfg.dns_upstream.is_empty() {
            true => dns::host_resolvers(),
            false => cfg.dns_upstream.clone(),
        };
        tracing::info!(%uplink, upstream = ?upstream, "sandbox networking on");
        let net = Arc::new(Network {
            cfg,
            upstream: Arc::new(upstream),
            owner: state_dir.display().to_string(),
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

    fn mark(&self, index: u32, owner: &str) {
        let _ = std::fs::write(Path::new(OWNERS_DIR).join(index.to_string()), owner);
    }

    fn new_slot(&self) -> Result<slot::Slot, NetError> {
        let s = slot::create()?;
        self.mark(s.addrs.index, &self.warm_marker());
        slot::load_rules(
            &s.addrs,
            policy::ruleset(&s.addrs, &EgressPolicy::default(), self.cfg.limits),
        )?;
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
        let owner = owner.display().to_string();
        let p = policy.clone();
        let (s, tap) = tokio::task::spawn_blocking(move || {
            let policy = p;
            let s = match warm {
                Some(s) => s,
                None => me.new_slot()?,
            };
            me.mark(s.addrs.index, &owner);
            let done = (|| {
                if policy != EgressPolicy::default() {
                    slot::load_rules(&s.addrs, policy::ruleset(&s.addrs, &policy, me.cfg.limits))?;
                }
                slot::open_tap(&s.addrs)
            })();
            match done {
                Ok(tap) => Ok((s, tap)),
                Err(e) => {
                    me.forget(s.addrs);
                    Err(e)
                }
            }
        })
        .await
        .map_err(|e| joined("attach", e))??;
        self.refill();
        self.finish_attach(s, Some(tap), policy)
    }

    fn finish_attach(
        &self,
        s: slot::Slot,
        tap: Option<OwnedFd>,
        policy: EgressPolicy,
    ) -> Result<Attachment, NetError> {
        let policy = Arc::new(RwLock::new(policy));
        let resolver = dns::serve(s.addrs, s.dns, policy.clone(), self.upstream.clone())
            .map_err(|e| NetError::io("serve resolver", Path::new("udp/53"), e))?;
        Ok(Attachment {
            addrs: s.addrs,
            tap: Mutex::new(tap.map(Arc::new)),
            policy,
            resolver,
        })
    }

    /// Takes over slot `index` of a sandbox of a previous run (its QEMU may still hold the tap).
    pub async fn adopt(
        self: &Arc<Self>,
        index: u32,
        policy: EgressPolicy,
    ) -> Result<Attachment, NetError> {
        let a = SlotAddrs::of(index);
        let me = self.clone();
        let p = policy.clone();
        let dns = tokio::task::spawn_blocking(move || {
            slot::load_rules(&a, policy::ruleset(&a, &p, me.cfg.limits))?;
            slot::bind_resolver(&a)
        })
        .await
        .map_err(|e| joined("adopt", e))??;
        self.finish_attach(slot::Slot { addrs: a, dns }, None, policy)
    }

    /// Replaces the policy of a running attachment (new connections follow it at once).
    pub async fn update(&self, att: &Attachment, policy: EgressPolicy) -> Result<(), NetError> {
        let (a, limits, p) = (att.addrs, self.cfg.limits, policy.clone());
        tokio::task::spawn_blocking(move || slot::load_rules(&a, policy::ruleset(&a, &p, limits)))
            .await
            .map_err(|e| joined("update", e))??;
        *att.policy.write().unwrap_or_else(|e| e.into_inner()) = policy;
        Ok(())
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

    fn forget(&self, a: SlotAddrs) {
        slot::destroy(&a);
        let _ = std::fs::remove_file(Path::new(OWNERS_DIR).join(a.index.to_string()));
    }

    /// Ends an attachment: its namespace (tap, veth, rules) goes, in the background.
    pub fn release(self: &Arc<Self>, att: Attachment) {
        att.resolver.abort();
        let a = att.addrs;
        self.dying.lock().unwrap_or_else(|e| e.into_inner()).push(a);
        drop(att);
        let me = self.clone();
        tokio::spawn(async move {
            tokio::time::sleep(REFILL_DELAY).await;
            let _ = tokio::task::spawn_blocking(move || {
                let mut d = me.dying.lock().unwrap_or_else(|e| e.into_inner());
                if let Some(i) = d.iter().position(|x| *x == a) {
                    d.swap_remove(i);
                    drop(d);
                    me.forget(a);
                }
            })
            .await;
        });
    }

    fn warm_marker(&self) -> String {
        format!("{}/warm/{}", self.owner, std::process::id())
    }

    /// Removes slots left by a crash: warm ones of a dead process, ones of sandbox folders that are
    /// gone, and, with `known` (after recovery), ones of this state folder no known sandbox holds.
    /// Returns how many went.
    pub fn remove_stale(&self, known: Option<&[String]>) -> usize {
        let (prefix, warm) = (format!("{}/", self.owner), self.warm_marker());
        let mut n = 0;
        for index in slot::existing() {
            let Ok(marker) = std::fs::read_to_string(Path::new(OWNERS_DIR).join(index.to_string()))
            else {
                continue; // being made right now
            };
            let stale = match marker.rsplit_once("/warm/") {
                Some((_, pid)) => {
                    marker != warm
                        && (!Path::new("/proc").join(pid).exists() || marker.starts_with(&prefix))
                }
                None => {
                    !Path::new(&marker).exists()
                        || known
                            .is_some_and(|k| marker.starts_with(&prefix) && !k.contains(&marker))
                }
            };
            if stale {
                self.forget(SlotAddrs::of(index));
                n += 1;
            }
        }
        n
    }

    /// Deletes the warm slots and those released but not yet deleted (the runtime is closing).
    pub fn drain(&self) {
        for s in std::mem::take(&mut *self.warm.lock().unwrap_or_else(|e| e.into_inner())) {
            self.forget(s.addrs);
        }
        for a in std::mem::take(&mut *self.dying.lock().unwrap_or_else(|e| e.into_inner())) {
            self.forget(a);
        }
    }
}

/// What a sandbox's `net.json` keeps: its slot and policy, to adopt after a restart.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct NetRecord {
    pub slot: u32,
    pub policy: EgressPolicy,
}
