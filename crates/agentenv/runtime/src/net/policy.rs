//! A sandbox's egress policy (E2B's `allow_internet_access`, `allow_out`, `deny_out`) and the
//! nftables ruleset that enforces it inside the sandbox's network namespace.
//!
//! Order of a new connection: the isolation invariants drop first (host loopback, link-local metadata,
//! every sandbox address), then `allow_out` accepts, then `deny_out` drops, then it is accepted. A domain
//! is matched through the sandbox's resolver: the addresses it answers for an allowed (denied) name join
//! the `allow_dns` (`deny_dns`) set for the answer's TTL.

use std::fmt::Write;
use std::net::Ipv4Addr;

use super::slot::{PROXY_PORT, SANDBOX_NET, SlotAddrs, TAP, VETH};

pub use agentenv_vm::egress::{
    EgressError, EgressPolicy, MAX_RULES, NetLimits, PRIVATE, Target, cidr, mask,
};

fn nets(v: &[Target]) -> Vec<String> {
    v.iter()
        .filter(|t| matches!(t, Target::Net { .. }))
        .map(|t| String::from(t.clone()))
        .collect()
}

/// Whether CIDR `(net, len)` (masked) holds CIDR `(other, olen)`.
pub(crate) fn contains((net, len): (Ipv4Addr, u8), (other, olen): (Ipv4Addr, u8)) -> bool {
    olen >= len && mask(other, len) == net
}

/// `nets` less every range of `allowed`, as CIDRs (a net split in halves where an allowed range
/// lies inside it).
pub fn subtract(nets: &[(Ipv4Addr, u8)], allowed: &[(Ipv4Addr, u8)]) -> Vec<(Ipv4Addr, u8)> {
    let mut out = Vec::new();
    let mut todo: Vec<(Ipv4Addr, u8)> = nets.iter().map(|(a, l)| (mask(*a, *l), *l)).collect();
    while let Some(n) = todo.pop() {
        if allowed.iter().any(|a| contains(*a, n)) {
            continue;
        }
        if !allowed.iter().any(|a| contains(n, *a)) || n.1 == 32 {
            out.push(n);
            continue;
        }
        let half = 1u32 << (31 - u32::from(n.1));
        todo.push((n.0, n.1 + 1));
        todo.push((Ipv4Addr::from(u32::from(n.0) | half), n.1 + 1));
    }
    out.sort();
    out
}

pub use super::slot::TABLE;

/// The complete ruleset of a sandbox namespace, replacing any earlier one in one transaction.
/// `blocked` (private ranges and the host's LAN, less what the operator allows) is dropped before any
/// of the sandbox's own rules, so no `allow_out` opens it. With `proxy`, TCP to the gateway (the
/// sandbox domain) and to the addresses of names a transform rule names (ports 80 and 443) goes to
/// the egress proxy's listener; the proxy's own connections out meet the same egress chain.
pub fn ruleset(
    a: &SlotAddrs,
    p: &EgressPolicy,
    limits: NetLimits,
    blocked: &[(Ipv4Addr, u8)],
    proxy: bool,
) -> String {
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
    for name in ["allow_dns", "deny_dns", "transform_dns"] {
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
    let (gw, guest) = (a.gateway, a.guest);
    let (to_proxy, redirect) = match proxy {
        true => (
            format!("iifname \"{TAP}\" ip daddr {gw} tcp dport {PROXY_PORT} accept\n    "),
            format!(
                "  chain prerouting {{
    type nat hook prerouting priority dstnat; policy accept;
    iifname \"{TAP}\" ip saddr {guest} ip daddr {gw} meta l4proto tcp redirect to :{PROXY_PORT}
    iifname \"{TAP}\" ip saddr {guest} ip daddr @transform_dns tcp dport {{ 80, 443 }} redirect to :{PROXY_PORT}
  }}
"
            ),
        ),
        false => (String::new(), String::new()),
    };
    // The guest sends from its own address only (no forged sources), checked before anything else.
    let _ = write!(
        s,
        "  chain input {{
    type filter hook input priority 0; policy drop;
    iif lo accept
    iifname \"{TAP}\" ip saddr != {guest} counter name dropped drop
    ct state established,related accept
    iifname \"{TAP}\" ip daddr {gw} udp dport 53 accept
    {to_proxy}counter name dropped
  }}
{redirect}  chain output {{
    type filter hook output priority 0; policy accept;
    oifname \"{VETH}\" meta nfproto ipv4 jump egress
  }}
  chain forward {{
    type filter hook forward priority 0; policy drop;
    iifname \"{TAP}\" ip saddr != {guest} counter name dropped drop
    {rate_in}iifname \"{VETH}\" oifname \"{TAP}\" ct state established,related counter name rx accept
    iifname \"{TAP}\" oifname \"{VETH}\" meta nfproto ipv4 jump egress
    counter name dropped
  }}
  chain egress {{
    ip daddr {{ 0.0.0.0/8, 127.0.0.0/8, 169.254.0.0/16, 224.0.0.0/3, {SANDBOX_NET} }} counter name dropped drop
"
    );
    if !blocked.is_empty() {
        let b: Vec<String> = blocked.iter().map(|(a, l)| format!("{a}/{l}")).collect();
        let _ = writeln!(
            s,
            "    ip daddr {{ {} }} counter name dropped drop",
            b.join(", ")
        );
    }
    let _ = writeln!(
        s,
        "    {rate_out}ct state established,related counter name tx accept"
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
pub(crate) mod tests {
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

    /// The policy of `internet`, `allow` and `deny` (each parsed; panics on a bad one).
    pub(crate) fn policy(internet: bool, allow: &[&str], deny: &[&str]) -> EgressPolicy {
        let t = |v: &[&str]| v.iter().map(|s| Target::parse(s).unwrap()).collect();
        EgressPolicy::new(internet, t(allow), t(deny)).unwrap()
    }

    #[test]
    fn internet_off_denies_all_but_allow_and_allow_wins() {
        let p = policy(false, &["api.test"], &[]);
        assert!(p.internet_blocked());
        assert_eq!(p.name_verdict("api.test"), Some(true));
        assert_eq!(p.name_verdict("other.test"), None);
        let p = policy(true, &[], &["*.bad.test"]);
        assert!(!p.internet_blocked());
        assert_eq!(p.name_verdict("x.bad.test"), Some(false));
        let many: Vec<Target> = (0..=MAX_RULES as u32)
            .map(|i| Target::Net {
                addr: Ipv4Addr::from(0x0a00_0000 + i),
                prefix: 32,
            })
            .collect();
        assert_eq!(
            EgressPolicy::new(true, many, vec![]),
            Err(EgressError::TooManyRules { max: MAX_RULES })
        );
    }

    #[test]
    fn rulesets_keep_the_invariants_first_and_list_only_addresses_in_sets() {
        let a = SlotAddrs::of(3);
        let p = policy(true, &["1.2.3.0/24", "a.test"], &["5.6.7.8"]);
        let r = ruleset_open(
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
        let open = ruleset_open(&a, &EgressPolicy::default(), NetLimits::default());
        assert!(!open.contains("ct count") && !open.contains("limit rate"));
        // The proxy's redirects come from the guest only; its own connections meet `egress`.
        assert!(r.contains(&format!(
            "ip saddr {} ip daddr @transform_dns tcp dport {{ 80, 443 }} redirect to :{PROXY_PORT}",
            a.guest
        )));
        assert!(r.contains("oifname \"veth0\" meta nfproto ipv4 jump egress"));
    }

    fn ruleset_open(a: &SlotAddrs, p: &EgressPolicy, l: NetLimits) -> String {
        ruleset(a, p, l, &[], true)
    }

    #[test]
    fn private_ranges_less_the_operators_allowances() {
        let n = |s: &str| cidr(&Target::parse(s).unwrap()).unwrap();
        let private: Vec<_> = PRIVATE.iter().map(|s| n(s)).collect();
        assert_eq!(subtract(&private, &[]).len(), 4);
        // Allowing one /24 inside 192.168/16 leaves the rest of it blocked, in 8 pieces.
        let left = subtract(&[n("192.168.0.0/16")], &[n("192.168.253.0/24")]);
        assert_eq!(left.len(), 8);
        assert!(left.iter().all(|c| !contains(*c, n("192.168.253.7"))));
        assert!(left.iter().any(|c| contains(*c, n("192.168.252.1"))));
        assert!(left.iter().any(|c| contains(*c, n("192.168.0.1"))));
        // Allowing all of one range removes it; allowing a wider one removes what it covers.
        assert_eq!(subtract(&private, &[n("10.0.0.0/8")]).len(), 3);
        assert_eq!(subtract(&private, &[n("0.0.0.0/0")]), vec![]);
        let a = SlotAddrs::of(3);
        let r = ruleset(
            &a,
            &EgressPolicy::default(),
            NetLimits::default(),
            &left,
            false,
        );
        assert!(!r.contains("redirect"), "no proxy, no redirect");
        let drop = r
            .find("192.168.0.0/17")
            .expect("blocked ranges in the ruleset");
        assert!(
            drop < r.find("@allow").unwrap(),
            "blocked before the sandbox's own allow"
        );
    }
}
