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
    #[error("rules[{domain:?}]: {why}")]
    BadRule { domain: String, why: String },
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
    /// E2B's `rules`: headers set on HTTP(S) requests to a domain (the egress proxy's transforms).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rules: Vec<HeaderRule>,
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
            rules: Vec::new(),
        })
    }

    /// This policy with `rules`; more than [`MAX_HEADER_RULES`] are refused.
    pub fn with_rules(mut self, rules: Vec<HeaderRule>) -> Result<EgressPolicy, EgressError> {
        if rules.len() > MAX_HEADER_RULES {
            return Err(EgressError::TooManyRules {
                max: MAX_HEADER_RULES,
            });
        }
        self.rules = rules;
        Ok(self)
    }

    /// Whether a connection to host `name` may go out: an `allow_out` name, else not a `deny_out`
    /// one and the internet on (for names whose address the policy cannot see, such as the
    /// sandbox domain, which the host serves itself).
    pub fn name_allowed(&self, name: &str) -> bool {
        self.name_verdict(name)
            .unwrap_or_else(|| !self.internet_blocked())
    }

    /// The headers the rules set on a request to `name` on `port`, in rule order.
    pub fn headers_for(&self, name: &str, port: u16) -> Vec<(&str, &str)> {
        self.rules
            .iter()
            .filter(|r| r.port.is_none_or(|p| p == port) && r.domain.matches_name(name))
            .flat_map(|r| r.headers.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .collect()
    }

    /// Whether any rule names `name` (on any port).
    pub fn has_rule_for(&self, name: &str) -> bool {
        self.rules.iter().any(|r| r.domain.matches_name(name))
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

/// Whether host `name` is `domain` or under it (both lower case, no port).
pub fn in_domain(name: &str, domain: &str) -> bool {
    name == domain
        || name
            .strip_suffix(domain)
            .is_some_and(|head| head.len() > 1 && head.ends_with('.'))
}

/// Most entries of `rules`.
pub const MAX_HEADER_RULES: usize = 64;
/// Most headers one rule sets.
pub const MAX_RULE_HEADERS: usize = 32;
/// Longest header value a rule sets, bytes.
pub const MAX_HEADER_VALUE: usize = 8192;

/// One entry of E2B's `network.rules`: headers set (replacing any the guest sent) on every HTTP or
/// HTTPS request to `domain` (a host name or `*.suffix`, optionally `:port`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeaderRule {
    pub domain: Target,
    /// Only requests to this port; `None`: any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<u16>,
    pub headers: Vec<(String, String)>,
}

impl HeaderRule {
    /// Parses `key` (`host`, `*.suffix`, `host:port`) and checks the headers: names are HTTP
    /// tokens, values printable without line breaks.
    pub fn new(key: &str, headers: Vec<(String, String)>) -> Result<HeaderRule, EgressError> {
        let bad = |why: String| EgressError::BadRule {
            domain: key.to_string(),
            why,
        };
        let (host, port) = match key.rsplit_once(':') {
            Some((h, p)) if !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()) => {
                let p: u16 = p.parse().map_err(|_| bad("port out of range".into()))?;
                (h, Some(p))
            }
            _ => (key, None),
        };
        let domain = Target::parse(host).map_err(|e| bad(e.to_string()))?;
        if !matches!(domain, Target::Domain(_)) {
            return Err(bad("keys are host names, not addresses".into()));
        }
        if headers.len() > MAX_RULE_HEADERS {
            return Err(bad(format!("at most {MAX_RULE_HEADERS} headers")));
        }
        for (k, v) in &headers {
            let token = |b: u8| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b);
            if k.is_empty() || k.len() > 256 || !k.bytes().all(token) {
                return Err(bad(format!("{k:?} is not a header name")));
            }
            if v.len() > MAX_HEADER_VALUE
                || !v.bytes().all(|b| b == b'\t' || (b >= 0x20 && b != 0x7f))
            {
                return Err(bad(format!("the value of {k} is not a header value")));
            }
        }
        Ok(HeaderRule {
            domain,
            port,
            headers,
        })
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

#[cfg(test)]
mod tests {
    use super::*;

    fn h(k: &str, v: &str) -> Vec<(String, String)> {
        vec![(k.to_string(), v.to_string())]
    }

    #[test]
    fn header_rules_parse_match_and_refuse_bad_input() {
        let r = HeaderRule::new("API.example.test:8443", h("X-Token", "a b")).unwrap();
        assert_eq!(r.port, Some(8443));
        let w = HeaderRule::new("*.svc.test", h("Authorization", "Bearer t")).unwrap();
        let p = EgressPolicy::default().with_rules(vec![r, w]).unwrap();
        assert_eq!(
            p.headers_for("api.example.test", 8443),
            vec![("X-Token", "a b")]
        );
        assert!(p.headers_for("api.example.test", 443).is_empty());
        assert_eq!(p.headers_for("a.svc.test", 80).len(), 1);
        assert!(p.headers_for("svc.test", 80).is_empty());
        assert!(p.has_rule_for("api.example.test") && !p.has_rule_for("other.test"));
        assert!(in_domain("8080-a.sbx.test", "sbx.test") && in_domain("sbx.test", "sbx.test"));
        assert!(!in_domain("xsbx.test", "sbx.test") && !in_domain(".sbx.test", "sbx.test"));
        for (key, headers) in [
            ("1.2.3.4", h("A", "b")),
            ("a.test:99999", h("A", "b")),
            ("bad name", h("A", "b")),
            ("a.test", h("Bad Name", "b")),
            ("a.test", h("A", "line\r\nInjected: yes")),
            ("a.test", h("A", &"v".repeat(MAX_HEADER_VALUE + 1))),
        ] {
            assert!(HeaderRule::new(key, headers).is_err(), "{key}");
        }
        let many = (0..=MAX_HEADER_RULES)
            .map(|i| HeaderRule::new(&format!("h{i}.test"), vec![]).unwrap())
            .collect();
        assert!(EgressPolicy::default().with_rules(many).is_err());
    }

    #[test]
    fn names_the_policy_cannot_resolve_follow_the_internet_switch() {
        let d = |s: &str| Target::parse(s).unwrap();
        let open = EgressPolicy::new(true, vec![], vec![d("*.bad.test")]).unwrap();
        assert!(open.name_allowed("x.sbx.test") && !open.name_allowed("a.bad.test"));
        let closed = EgressPolicy::new(false, vec![d("*.sbx.test")], vec![]).unwrap();
        assert!(closed.name_allowed("x.sbx.test") && !closed.name_allowed("x.other.test"));
        // An old record without rules still reads.
        let old: EgressPolicy = serde_json::from_str(r#"{"allow_out":[],"deny_out":[]}"#).unwrap();
        assert!(old.rules.is_empty());
    }
}
