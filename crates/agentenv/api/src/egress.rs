//! E2B's network options (`allow_internet_access`, `network.allowOut/denyOut/dnsServers` at create,
//! `PUT /sandboxes/{id}/network`) as the runtime's egress policy, and back.

use agentenv_vm::{EgressPolicy, NetworkInfo, Target};

use crate::error::ApiError;
use crate::model::{NetworkConfig, NetworkUpdate};

/// The policy of E2B's fields; a bad entry is a 400 naming it.
pub fn policy(
    internet: Option<bool>,
    allow_out: Option<&[String]>,
    deny_out: Option<&[String]>,
    dns_servers: Option<&[String]>,
) -> Result<EgressPolicy, ApiError> {
    let mut allow: Vec<String> = allow_out.unwrap_or_default().to_vec();
    let deny = deny_out.unwrap_or_default();
    let mut p = EgressPolicy::from_e2b(internet.unwrap_or(true), &allow, deny)
        .map_err(|e| ApiError::bad_request(format!("network: {e}")))?;
    // As in E2B: with a domain in allowOut, the named resolvers are reachable too.
    let has_domain = p.allow_out.iter().any(|t| matches!(t, Target::Domain(_)));
    if has_domain && let Some(d) = dns_servers {
        if d.len() > 10 {
            return Err(ApiError::bad_request("network: at most 10 dnsServers"));
        }
        for s in d {
            if s.parse::<std::net::Ipv4Addr>().is_err() {
                return Err(ApiError::bad_request(format!(
                    "network: dnsServers entry {s:?} is not an IPv4 address"
                )));
            }
        }
        allow.extend(d.iter().cloned());
        p = EgressPolicy::from_e2b(internet.unwrap_or(true), &allow, deny)
            .map_err(|e| ApiError::bad_request(format!("network: {e}")))?;
    }
    Ok(p)
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
