//! E2B's network options (`allow_internet_access`, `network.allowOut/denyOut/dnsServers` at create,
//! `PUT /sandboxes/{id}/network`) as the runtime's egress policy, and back.

use agentenv_vm::{EgressError, EgressPolicy, NetworkInfo, Target};

use crate::error::ApiError;
use crate::model::{NetworkConfig, NetworkUpdate};

/// The policy of E2B's fields; a bad entry is a 400 naming it.
pub fn policy(
    internet: Option<bool>,
    allow_out: Option<&[String]>,
    deny_out: Option<&[String]>,
    dns_servers: Option<&[String]>,
) -> Result<EgressPolicy, ApiError> {
    let bad = |e: EgressError| ApiError::bad_request(format!("network: {e}"));
    let targets = |v: &[String]| {
        v.iter()
            .map(|s| Target::parse(s).map_err(bad))
            .collect::<Result<Vec<_>, _>>()
    };
    let mut allow = targets(allow_out.unwrap_or_default())?;
    let deny = targets(deny_out.unwrap_or_default())?;
    // As in E2B: with a domain in allowOut, the named resolvers are reachable too.
    let has_domain = allow.iter().any(|t| matches!(t, Target::Domain(_)));
    if has_domain && let Some(d) = dns_servers {
        if d.len() > 10 {
            return Err(ApiError::bad_request("network: at most 10 dnsServers"));
        }
        for s in d {
            let Ok(addr) = s.parse::<std::net::Ipv4Addr>() else {
                return Err(ApiError::bad_request(format!(
                    "network: dnsServers entry {s:?} is not an IPv4 address"
                )));
            };
            allow.push(Target::Net { addr, prefix: 32 });
        }
    }
    EgressPolicy::new(internet.unwrap_or(true), allow, deny).map_err(bad)
}

/// The create request's policy.
pub fn create_policy(
    internet: Option<bool>,
    net: Option<&NetworkConfig>,
) -> Result<EgressPolicy, ApiError> {
    policy(
        internet,
        net.and_then(|n| n.allow_out.as_deref()),
        net.and_then(|n| n.deny_out.as_deref()),
        net.and_then(|n| n.dns_servers.as_deref()),
    )
}

/// The API view of a sandbox's policy.
pub fn view(info: &NetworkInfo) -> NetworkConfig {
    let list = |v: &[Target]| v.iter().map(|t| String::from(t.clone())).collect();
    NetworkConfig {
        allow_out: Some(list(&info.policy.allow_out)),
        deny_out: Some(list(&info.policy.deny_out)),
        ..Default::default()
    }
}

/// `PUT /sandboxes/{id}/network`'s policy.
pub fn update_policy(req: &NetworkUpdate) -> Result<EgressPolicy, ApiError> {
    policy(
        req.allow_internet_access,
        req.allow_out.as_deref(),
        req.deny_out.as_deref(),
        req.dns_servers.as_deref(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(x: &[&str]) -> Vec<String> {
        x.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn e2b_fields_map_to_a_policy_and_bad_entries_are_400s() {
        let p = policy(Some(false), Some(&v(&["api.test"])), None, None).unwrap();
        assert!(p.internet_blocked());
        assert_eq!(p.name_verdict("api.test"), Some(true));
        let p = policy(None, None, Some(&v(&["*.bad.test"])), None).unwrap();
        assert!(
            !p.internet_blocked(),
            "internet is on by default, as in E2B"
        );
        assert_eq!(p.name_verdict("x.bad.test"), Some(false));
        // The named resolvers join allowOut only beside a domain.
        let p = policy(None, Some(&v(&["a.test"])), None, Some(&v(&["9.9.9.9"]))).unwrap();
        assert!(p.allow_out.contains(&Target::parse("9.9.9.9").unwrap()));
        let p = policy(None, Some(&v(&["1.2.3.4"])), None, Some(&v(&["9.9.9.9"]))).unwrap();
        assert_eq!(p.allow_out.len(), 1);
        let many: Vec<String> = (0..=agentenv_vm::egress::MAX_RULES)
            .map(|i| format!("10.0.{}.{}", i / 256, i % 256))
            .collect();
        for (allow, dns) in [
            (many, vec![]),
            (v(&["bad name!"]), vec![]),
            (v(&["a.test"]), v(&["not-an-ip"])),
        ] {
            let e = policy(None, Some(&allow), None, Some(&dns)).unwrap_err();
            assert_eq!(
                e.status,
                axum::http::StatusCode::BAD_REQUEST,
                "{allow:?} {dns:?}"
            );
        }
    }
}
