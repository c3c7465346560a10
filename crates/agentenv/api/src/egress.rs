//! E2B's network options (`allow_internet_access`, `network.allowOut/denyOut/dnsServers/rules` at
//! create, `PUT /sandboxes/{id}/network`) as the runtime's egress policy, and back.

use agentenv_vm::{EgressError, EgressPolicy, HeaderRule, NetworkInfo, Target};

use crate::error::ApiError;
use crate::model::{NetworkConfig, NetworkRule, NetworkRules, NetworkTransform, NetworkUpdate};

/// E2B's `rules` as header rules (a domain's transforms merged, later ones winning).
fn header_rules(rules: Option<&NetworkRules>) -> Result<Vec<HeaderRule>, EgressError> {
    rules
        .into_iter()
        .flatten()
        .map(|(domain, list)| {
            let mut headers: Vec<(String, String)> = Vec::new();
            let set = list
                .iter()
                .filter_map(|r| r.transform.as_ref()?.headers.as_ref())
                .flatten();
            for (k, v) in set {
                headers.retain(|(old, _)| !old.eq_ignore_ascii_case(k));
                headers.push((k.clone(), v.clone()));
            }
            HeaderRule::new(domain, headers)
        })
        .collect()
}

/// The API view of header rules.
fn rules_view(rules: &[HeaderRule]) -> NetworkRules {
    rules
        .iter()
        .map(|r| {
            let mut key = String::from(r.domain.clone());
            if let Some(p) = r.port {
                key = format!("{key}:{p}");
            }
            let headers = r.headers.iter().cloned().collect();
            let rule = NetworkRule {
                transform: Some(NetworkTransform {
                    headers: Some(headers),
                }),
            };
            (key, vec![rule])
        })
        .collect()
}

/// The policy of E2B's fields; a bad entry is a 400 naming it.
pub fn policy(
    internet: Option<bool>,
    allow_out: Option<&[String]>,
    deny_out: Option<&[String]>,
    dns_servers: Option<&[String]>,
    rules: Option<&NetworkRules>,
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
    EgressPolicy::new(internet.unwrap_or(true), allow, deny)
        .and_then(|p| p.with_rules(header_rules(rules)?))
        .map_err(bad)
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
        net.and_then(|n| n.rules.as_ref()),
    )
}

/// The API view of a sandbox's policy.
pub fn view(info: &NetworkInfo) -> NetworkConfig {
    let list = |v: &[Target]| v.iter().map(|t| String::from(t.clone())).collect();
    NetworkConfig {
        allow_out: Some(list(&info.policy.allow_out)),
        deny_out: Some(list(&info.policy.deny_out)),
        rules: (!info.policy.rules.is_empty()).then(|| rules_view(&info.policy.rules)),
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
        req.rules.as_ref(),
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
        let p = policy(Some(false), Some(&v(&["api.test"])), None, None, None).unwrap();
        assert!(p.internet_blocked());
        assert_eq!(p.name_verdict("api.test"), Some(true));
        let p = policy(None, None, Some(&v(&["*.bad.test"])), None, None).unwrap();
        assert!(
            !p.internet_blocked(),
            "internet is on by default, as in E2B"
        );
        assert_eq!(p.name_verdict("x.bad.test"), Some(false));
        // The named resolvers join allowOut only beside a domain.
        let p = policy(
            None,
            Some(&v(&["a.test"])),
            None,
            Some(&v(&["9.9.9.9"])),
            None,
        )
        .unwrap();
        assert!(p.allow_out.contains(&Target::parse("9.9.9.9").unwrap()));
        let p = policy(
            None,
            Some(&v(&["1.2.3.4"])),
            None,
            Some(&v(&["9.9.9.9"])),
            None,
        )
        .unwrap();
        assert_eq!(p.allow_out.len(), 1);
        let many: Vec<String> = (0..=agentenv_vm::egress::MAX_RULES)
            .map(|i| format!("10.0.{}.{}", i / 256, i % 256))
            .collect();
        for (allow, dns) in [
            (many, vec![]),
            (v(&["bad name!"]), vec![]),
            (v(&["a.test"]), v(&["not-an-ip"])),
        ] {
            let e = policy(None, Some(&allow), None, Some(&dns), None).unwrap_err();
            assert_eq!(
                e.status,
                axum::http::StatusCode::BAD_REQUEST,
                "{allow:?} {dns:?}"
            );
        }
    }

    #[test]
    fn e2b_rules_become_header_rules_and_back_and_bad_ones_are_400s() {
        let rules: NetworkRules = serde_json::from_str(
            r#"{"api.test:8443": [{"transform": {"headers": {"X-A": "1", "X-B": "2"}}},
                                   {"transform": {"headers": {"x-a": "3"}}}],
                "*.svc.test": [{}]}"#,
        )
        .unwrap();
        let p = policy(None, None, None, None, Some(&rules)).unwrap();
        assert_eq!(
            p.headers_for("api.test", 8443),
            vec![("X-B", "2"), ("x-a", "3")]
        );
        assert!(p.has_rule_for("a.svc.test"));
        let info = NetworkInfo {
            address: std::net::Ipv4Addr::LOCALHOST,
            policy: p,
        };
        let back = view(&info).rules.unwrap();
        assert_eq!(back.len(), 2);
        let h = back["api.test:8443"][0].transform.as_ref().unwrap();
        assert_eq!(h.headers.as_ref().unwrap()["X-B"], "2");
        for bad in [
            r#"{"1.2.3.4": [{"transform": {"headers": {"A": "b"}}}]}"#,
            r#"{"a.test": [{"transform": {"headers": {"A": "b\r\nX: y"}}}]}"#,
            r#"{"a b": []}"#,
        ] {
            let r: NetworkRules = serde_json::from_str(bad).unwrap();
            let e = policy(None, None, None, None, Some(&r)).unwrap_err();
            assert_eq!(e.status, axum::http::StatusCode::BAD_REQUEST, "{bad}");
        }
    }
}
