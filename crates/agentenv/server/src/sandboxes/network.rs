//! E2B's network options: `allow_internet_access`, `network.allowOut/denyOut/dnsServers` at create and
//! `PUT /sandboxes/{id}/network`, as the runtime's egress policy.

use super::{Caller, LifecycleError, Result, Sandboxes};
use crate::backend::ConnectError;
use crate::backend::{EgressPolicy, NetworkInfo};
use crate::model::{NetworkConfig, NetworkUpdate, SandboxMetric};

/// The policy of E2B's fields; a bad entry is a 400 naming it.
pub(crate) fn policy(
    internet: Option<bool>,
    allow_out: Option<&[String]>,
    deny_out: Option<&[String]>,
    dns_servers: Option<&[String]>,
) -> Result<EgressPolicy> {
    let mut allow: Vec<String> = allow_out.unwrap_or_default().to_vec();
    let deny = deny_out.unwrap_or_default();
    let mut p = EgressPolicy::from_e2b(internet.unwrap_or(true), &allow, deny)
        .map_err(|e| LifecycleError::Invalid(format!("network: {e}")))?;
    // As in E2B: with a domain in allowOut, the named resolvers are reachable too.
    let has_domain = p
        .allow_out
        .iter()
        .any(|t| matches!(t, agentenv_runtime::net::Target::Domain(_)));
    if has_domain && let Some(d) = dns_servers {
        if d.len() > 10 {
            return Err(LifecycleError::Invalid(
                "network: at most 10 dnsServers".into(),
            ));
        }
        for s in d {
            if s.parse::<std::net::Ipv4Addr>().is_err() {
                return Err(LifecycleError::Invalid(format!(
                    "network: dnsServers entry {s:?} is not an IPv4 address"
                )));
            }
        }
        allow.extend(d.iter().cloned());
        p = EgressPolicy::from_e2b(internet.unwrap_or(true), &allow, deny)
            .map_err(|e| LifecycleError::Invalid(format!("network: {e}")))?;
    }
    Ok(p)
}

/// The create request's policy.
pub(crate) fn create_policy(
    internet: Option<bool>,
    net: Option<&NetworkConfig>,
) -> Result<EgressPolicy> {
    policy(
        internet,
        net.and_then(|n| n.allow_out.as_deref()),
        net.and_then(|n| n.deny_out.as_deref()),
        net.and_then(|n| n.dns_servers.as_deref()),
    )
}

/// The API view of a sandbox's policy.
pub(crate) fn view(info: &NetworkInfo) -> NetworkConfig {
    let list =
        |v: &[agentenv_runtime::net::Target]| v.iter().map(|t| String::from(t.clone())).collect();
    NetworkConfig {
        allow_out: Some(list(&info.policy.allow_out)),
        deny_out: Some(list(&info.policy.deny_out)),
        ..Default::default()
    }
}

impl Sandboxes {
    /// Replaces sandbox `id`'s egress rules (running or paused), effective for new connections at once.
    pub async fn set_network(&self, caller: &Caller, id: &str, req: NetworkUpdate) -> Result<()> {
        self.get_as(caller, id)?;
        let p = policy(
            req.allow_internet_access,
            req.allow_out.as_deref(),
            req.deny_out.as_deref(),
            req.dns_servers.as_deref(),
        )?;
        let lock = self.op_lock(id);
        let _guard = lock.lock().await;
        self.backend.set_network(id, p).await?;
        Ok(())
    }

    /// The current resource sample of sandbox `id`; none while it is paused (as in E2B).
    pub async fn metrics(&self, caller: &Caller, id: &str) -> Result<Vec<SandboxMetric>> {
        self.get_as(caller, id)?;
        let s = match self.backend.sample(id).await {
            Ok(s) => s,
            Err(ConnectError::Paused(_)) => return Ok(vec![]),
            Err(ConnectError::NotFound(i)) => return Err(LifecycleError::SandboxNotFound(i)),
            Err(e) => return Err(LifecycleError::Runtime(e.to_string())),
        };
        let g = s.guest;
        Ok(vec![SandboxMetric {
            timestamp: super::rfc3339_ms(g.ts as i64 * 1000),
            timestamp_unix: g.ts as i64,
            cpu_count: g.cpu_count,
            cpu_used_pct: g.cpu_used_pct,
            mem_used: g.mem_used,
            mem_total: g.mem_total,
            mem_cache: 0,
            disk_used: g.disk_used,
            disk_total: g.disk_total,
            net_tx_bytes: s.net.map(|n| n.tx_bytes),
            net_rx_bytes: s.net.map(|n| n.rx_bytes),
            net_dropped_packets: s.net.map(|n| n.dropped_packets),
        }])
    }

    /// Sandbox `id`'s network as the API shows it.
    pub async fn network_view(&self, id: &str) -> Option<NetworkInfo> {
        self.backend.network(id).await
    }
}
