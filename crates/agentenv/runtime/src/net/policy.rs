//! A sandbox's egress policy (E2B's `allow_internet_access`, `allow_out`, `deny_out`) and the
//! nftables ruleset that enforces it inside the sandbox's network namespace.
//!
//! Order of a new connection: the isolation invariants drop first (host loopback, link-local metadata,
//! every sandbox address), then `allow_out` accepts, then `deny_out` drops, then it is accepted. A domain
//! is matched through the sandbox's resolver: the addresses it answers for an allowed (denied) name join
//! the `allow_dns` (`deny_dns`) set for the answer's TTL.

use std::fmt::Write;
use std::net::Ipv4Addr;

use serde::{Deserialize, Serialize};

use super::slot::{SANDBOX_NET, SlotAddrs, TAP, VETH};

/// Most entries of `allow_out` plus `deny_out`.
pub const MAX_RULES: usize = 256;
/// `0.0.0.0/0`, E2B's `ALL_TRAFFIC`.
pub const ALL_TRAFFIC: &str = "0.0.0.0/0";

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
    pub fn parse(s: &str) -> Result<Target, String> {
        let s = s.trim();
        if let Some((a, p)) = s.split_once('/') {
            let addr: Ipv4Addr = a.parse().map_err(|_| format!("{s:?}: not an IPv4 CIDR"))?;
            let prefix: u8 = p
                .parse()
                .ok()
                .filter(|p| *p <= 32)
                .ok_or_else(|| format!("{s:?}: prefix must be 0..=32"))?;
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
            return Err(format!(
                "{s:?}: IPv6 is not supported (sandboxes have IPv4 only)"
            ));
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
            return Err(format!("{s:?}: not an IPv4 address, CIDR or host name"));
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
    type Error = String;
    fn try_from(s: String) -> Result<Target, String> {
        Target::parse(&s)
    }
}

fn mask(addr: Ipv4Addr, prefix: u8) -> Ipv4Addr {
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
    /// From E2B's fields; a bad entry or too many fail with the reason.
    pub fn from_e2b(
        allow_internet_access: bool,
        allow_out: &[String],
        deny_out: &[String],
    ) -> Result<EgressPolicy, String> {
        if allow_out.len() + deny_out.len() > MAX_RULES {
            return Err(format!(
                "at most {MAX_RULES} allow_out and deny_out entries"
            ));
        }
        let parse = |v: &[String]| {
            v.iter()
                .map(|s| Target::parse(s))
                .collect::<Result<Vec<_>, _>>()
        };
        let mut p = EgressPolicy {
            allow_out: parse(allow_out)?,
            deny_out: parse(deny_out)?,
        };
        let all = Target::parse(ALL_TRAFFIC)?;
        if !allow_internet_access && !p.deny_out.contains(&all) {
            p.deny_out.push(all);
        }
        Ok(p)
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

fn nets(v: &[Target]) -> Vec<String> {
    v.iter()
        .filter(|t| matches!(t, Target::Net { .. }))
        .map(|t| String::from(t.clone()))
        .collect()
}

/// Name of the sandbox namespace's nftables table (`inet`).
pub const TABLE: &str = "sandbox";

/// The complete ruleset of a sandbox namespace, replacing any earlier one in one transaction.
pub fn ruleset(a: &SlotAddrs, p: &EgressPolicy, limits: NetLimits) -> String {
    let mut s = String::new();
    let set = |s: &mut String, name: &str, elems: &[String]| {
        let _ = write!(
            s,
            "  set {name} {{ type ipv4_addr; flags interval; auto-merge;"
        );
        if !elems.is_empty() {
            let _ = write!(s, " elements = {{ {} }};", elems.join(", "));
        }
        s.push_str(" }\n");
    };
    let _ = writeln!(
        s,
        "table inet {TABLE}\ndelete table inet {TABLE}\ntable inet {TABLE} {{"
    );
    set(&mut s, "allow", &nets(&p.allow_out));
    set(&mut s, "deny", &nets(&p.deny_out));
    for name in ["allow_dns", "deny_dns"] {
        let _ = writeln!(
            s,
            "  set {name} {{ type ipv4_addr; flags timeout; size 65536; }}"
        );
    }
    s.push_str("  counter tx { }\n  counter rx { }\n  counter dropped { }\n");
    // Each direction's policer is a rule of its own, matched like the rule after it.
    let rate = |m: &str| match limits.bandwidth_bytes_per_s {
        0 => String::new(),
        b => format!(
            "{m}limit rate over {} kbytes/second burst {} kbytes counter name dropped drop\n    ",
            b.div_ceil(1024),
            (b / 1024).max(64)
        ),
    };
    let rate_in = rate(&format!("iifname \"{VETH}\" oifname \"{TAP}\" "));
    let rate_out = rate("");
    let gw = a.gateway;
    let _ = write!(
        s,
        "  chain input {{
    type filter hook input priority 0; policy drop;
    iif lo accept
    ct state established,related accept
    iifname \"{TAP}\" ip daddr {gw} udp dport 53 accept
    counter name dropped
  }}
  chain forward {{
    type filter hook forward priority 0; policy drop;
    {rate_in}iifname \"{VETH}\" oifname \"{TAP}\" ct state established,related counter name rx accept
    iifname \"{TAP}\" oifname \"{VETH}\" meta nfproto ipv4 jump egress
    counter name dropped
  }}
  chain egress {{
    ip daddr {{ 0.0.0.0/8, 127.0.0.0/8, 169.254.0.0/16, 224.0.0.0/3, {SANDBOX_NET} }} counter name dropped drop
    {rate_out}ct state established,related counter name tx accept
"
    );
    if limits.max_connections > 0 {
        let _ = writeln!(
            s,
            "    ct state new ct count over {} counter name dropped reject",
            limits.max_connections
        );
    }
    s.push_str(
        "    ip daddr @allow counter name tx accept
    ip daddr @allow_dns counter name tx accept
    ip daddr @deny counter name dropped reject
    ip daddr @deny_dns counter name dropped reject
    counter name tx accept
  }
}
",
    );
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_parse_normalise_and_reject_garbage() {
        let t = |s: &str| String::from(Target::parse(s).unwrap());
        assert_eq!(t("10.1.2.3/8"), "10.0.0.0/8");
        assert_eq!(t("1.1.1.1"), "1.1.1.1");
        assert_eq!(t("1.1.1.1/32"), "1.1.1.1");
        assert_eq!(t("0.0.0.0/0"), "0.0.0.0/0");
        assert_eq!(t("API.Example.com."), "api.example.com");
        assert_eq!(t("*.example.com"), "*.example.com");
        for bad in [
            "",
            "1.2.3.4/33",
            "::1",
            "2001:db8::/32",
            "a..b",
            "-a.com",
            "a b",
            "*.",
            "1.2.3.4/x",
            "x;drop",
            "}",
            "\"q\"",
        ] {
            assert!(Target::parse(bad).is_err(), "{bad:?} parsed");
        }
        let long = format!("{}.com", "a".repeat(64));
        assert!(Target::parse(&long).is_err());
    }

    #[test]
    fn wildcards_match_subdomains_only() {
        let w = Target::parse("*.example.com").unwrap();
        assert!(w.matches_name("a.example.com") && w.matches_name("a.b.example.com"));
        assert!(!w.matches_name("example.com") && !w.matches_name("badexample.com"));
        let e = Target::parse("example.com").unwrap();
        assert!(e.matches_name("example.com") && !e.matches_name("a.example.com"));
    }

    #[test]
    fn e2b_fields_map_to_a_policy_and_allow_wins() {
        let p = EgressPolicy::from_e2b(false, &["api.test".into()], &[]).unwrap();
        assert!(p.internet_blocked());
        assert_eq!(p.name_verdict("api.test"), Some(true));
        assert_eq!(p.name_verdict("other.test"), None);
        let p = EgressPolicy::from_e2b(true, &[], &["*.bad.test".into()]).unwrap();
        assert!(!p.internet_blocked());
        assert_eq!(p.name_verdict("x.bad.test"), Some(false));
        let many: Vec<String> = (0..=MAX_RULES)
            .map(|i| format!("10.0.{}.{}", i / 256, i % 256))
            .collect();
        assert!(EgressPolicy::from_e2b(true, &many, &[]).is_err());
        assert!(EgressPolicy::from_e2b(true, &["bad name!".into()], &[]).is_err());
    }

    #[test]
    fn rulesets_keep_the_invariants_first_and_list_only_addresses_in_sets() {
        let a = SlotAddrs::of(3);
        let p = EgressPolicy::from_e2b(
            true,
            &["1.2.3.0/24".into(), "a.test".into()],
            &["5.6.7.8".into()],
        )
        .unwrap();
        let r = ruleset(
            &a,
            &p,
            NetLimits {
                max_connections: 64,
                bandwidth_bytes_per_s: 1 << 20,
            },
        );
        let inv = r.find("169.254.0.0/16").unwrap();
        assert!(inv < r.find("@allow counter").unwrap());
        assert!(r.contains(
            "set allow { type ipv4_addr; flags interval; auto-merge; elements = { 1.2.3.0/24 }; }"
        ));
        assert!(r.contains("elements = { 5.6.7.8 }"));
        assert!(!r.contains("a.test"));
        assert!(r.contains("ct count over 64") && r.contains("limit rate over 1024 kbytes/second"));
        // No rule of the forward chain accepts without matching both interfaces.
        let fwd = &r[r.find("chain forward").unwrap()..r.find("chain egress").unwrap()];
        for rule in fwd.lines().filter(|l| l.contains("accept")) {
            assert!(
                rule.contains("iifname") && rule.contains("oifname"),
                "{rule}"
            );
        }
        assert!(r.contains(&format!("ip daddr {} udp dport 53", a.gateway)));
        let open = ruleset(&a, &EgressPolicy::default(), NetLimits::default());
        assert!(!open.contains("ct count") && !open.contains("limit rate"));
    }
}
