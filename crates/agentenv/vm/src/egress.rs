//! A sandbox's egress policy (internet on or off, targets always allowed, targets denied), and what
//! its network looks like and counts. The E2B fields that express it are mapped in `agentenv-api`.

use std::net::Ipv4Addr;

use serde::{Deserialize, Serialize};

/// Most entries of `allow_out` plus `deny_out`.
pub const MAX_RULES: usize = 256;

/// Why a target or a policy is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EgressError {
    #[error("{entry:?}: {why}")]
    BadTarget { entry: String, why: &'static str },
    #[error("at most {max} allow_out and deny_out entries")]
    TooManyRules { max: usize },
}

/// One `allow_out`/`deny_out` entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(into = "String", try_from = "String")]
pub enum Target {
    /// An address or CIDR block.
    Net { addr: Ipv4Addr, prefix: u8 },
    /// A host name, or `*.suffix` for every name under it.
    Domain(String),
}

impl Target {
    /// Parses `1.2.3.4`, `10.0.0.0/8` or a host name (`*.example.com` for its subdomains).
    pub fn parse(s: &str) -> Result<Target, EgressError> {
        let s = s.trim();
        let bad = |why| EgressError::BadTarget {
            entry: s.to_string(),
            why,
        };
        if let Some((a, p)) = s.split_once('/') {
            let addr: Ipv4Addr = a.parse().map_err(|_| bad("not an IPv4 CIDR"))?;
            let prefix: u8 = p
                .parse()
                .ok()
                .filter(|p| *p <= 32)
                .ok_or_else(|| bad("prefix must be 0..=32"))?;
            let masked = mask(addr, prefix);
            return Ok(Target::Net {
                addr: masked,
                prefix,
            });
        }
        if let Ok(addr) = s.parse::<Ipv4Addr>() {
            return Ok(Target::Net { addr, prefix: 32 });
        }
        if s.contains(':') {
            return Err(bad("IPv6 is not supported (sandboxes have IPv4 only)"));
        }
        let name = s.trim_end_matches('.').to_ascii_lowercase();
        let labels = name.strip_prefix("*.").unwrap_or(&name);
        let ok = !labels.is_empty()
            && name.len() <= 253
            && labels.split('.').all(|l| {
                !l.is_empty()
                    && l.len() <= 63
                    && !l.starts_with('-')
                    && !l.ends_with('-')
                    && l.bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
            });
        if !ok {
            return Err(bad("not an IPv4 address, CIDR or host name"));
        }
        Ok(Target::Domain(name))
    }

    /// True when the domain target covers `name` (lower case, no trailing dot).
    pub fn matches_name(&self, name: &str) -> bool {
        match self {
            Target::Domain(d) => match d.strip_prefix("*.") {
                Some(suffix) => name.len() > suffix.len() && name.ends_with(&format!(".{suffix}")),
                None => name == d,
            },
            Target::Net { .. } => false,
        }
    }
}

impl From<Target> for String {
    fn from(t: Target) -> String {
        match t {
            Target::Net { addr, prefix: 32 } => addr.to_string(),
            Target::Net { addr, prefix } => format!("{addr}/{prefix}"),
            Target::Domain(d) => d,
        }
    }
}

impl TryFrom<String> for Target {
    type Error = EgressError;
    fn try_from(s: String) -> Result<Target, EgressError> {
        Target::parse(&s)
    }
}

/// `addr` with the bits past `prefix` cleared.
pub fn mask(addr: Ipv4Addr, prefix: u8) -> Ipv4Addr {
    let m = if prefix == 0 {
        0
    } else {
        u32::MAX << (32 - u32::from(prefix))
    };
    Ipv4Addr::from(u32::from(addr) & m)
}

/// Per-sandbox limits (0 = none).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetLimits {
    /// Concurrent connections the guest may open.
    pub max_connections: u32,
    /// Bytes per second each way; packets above it are dropped.
    pub bandwidth_bytes_per_s: u64,
}

/// What a sandbox may reach; the default is internet on, as in E2B.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EgressPolicy {
    /// `allow_out`: reachable even where `deny_out` matches.
    pub allow_out: Vec<Target>,
    /// `deny_out`; `allow_internet_access=false` is `deny_out = [0.0.0.0/0]`.
    pub deny_out: Vec<Target>,
}

impl EgressPolicy {
    /// `allow_out` reachable always; `deny_out` closed unless allowed; with `internet` off,
    /// everything else closed too. More than [`MAX_RULES`] targets are refused.
    pub fn new(
        internet: bool,
        allow_out: Vec<Target>,
        mut deny_out: Vec<Target>,
    ) -> Result<EgressPolicy, EgressError> {
        if allow_out.len() + deny_out.len() > MAX_RULES {
            return Err(EgressError::TooManyRules { max: MAX_RULES });
        }
        let all = Target::Net {
            addr: Ipv4Addr::UNSPECIFIED,
            prefix: 0,
        };
        if !internet && !deny_out.contains(&all) {
            deny_out.push(all);
        }
        Ok(EgressPolicy {
            allow_out,
            deny_out,
        })
    }

    /// True when no egress is possible except `allow_out` (deny covers everything).
    pub fn internet_blocked(&self) -> bool {
        self.deny_out
            .iter()
            .any(|t| matches!(t, Target::Net { prefix: 0, .. }))
    }

    /// The verdict for an answer of the resolver: `Some(true)` allow, `Some(false)` deny, `None` no
    /// domain rule names it.
    pub fn name_verdict(&self, name: &str) -> Option<bool> {
        if self.allow_out.iter().any(|t| t.matches_name(name)) {
            return Some(true);
        }
        self.deny_out
            .iter()
            .any(|t| t.matches_name(name))
            .then_some(false)
    }
}

/// Ranges no sandbox reaches unless the operator allows them (`NetConfig::allow_private`): RFC 1918
/// private networks and CGNAT. The uplink's own networks (the host's LAN) join them at start.
pub const PRIVATE: [&str; 4] = [
    "10.0.0.0/8",
    "172.16.0.0/12",
    "192.168.0.0/16",
    "100.64.0.0/10",
];

/// A CIDR as (network, prefix); `None` for a name.
pub fn cidr(t: &Target) -> Option<(Ipv4Addr, u8)> {
    match t {
        Target::Net { addr, prefix } => Some((*addr, *prefix)),
        Target::Domain(_) => None,
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

/// What a sandbox's network looks like, for the API.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetworkInfo {
    /// The guest's address.
    pub address: std::net::Ipv4Addr,
    /// The policy in force.
    pub policy: EgressPolicy,
}

/// One resource sample of a running sandbox.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// What the guest agent reports.
    pub guest: agentenv_envd::GuestMetrics,
    /// Its network's counters (`None` without a network).
    pub net: Option<NetStats>,
}
