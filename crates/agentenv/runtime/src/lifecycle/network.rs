//! The runtime's side of sandbox networking: a sandbox holds its network slot from create to kill
//! (`net.json` in its folder), gets its address through `/init` and keeps it across pause and resume.

use std::path::PathBuf;

use crate::error::{ConnectError, CreateError, NetworkError};
use crate::lifecycle::sandbox::Live;
use crate::net::{EgressPolicy, NetRecord, NetStats};
use crate::{Inner, Runtime};

const NET_RECORD: &str = "net.json";

pub use agentenv_vm::{NetworkInfo, Sample};

impl Inner {
    fn net_record_path(&self, id: &str) -> PathBuf {
        self.sandbox_dir(id).join(NET_RECORD)
    }

    /// Writes sandbox `id`'s `net.json` (atomically).
    pub(crate) fn write_net_record(
        &self,
        id: &str,
        rec: &NetRecord,
    ) -> Result<(), (PathBuf, std::io::Error)> {
        let path = self.net_record_path(id);
        let text = serde_json::to_vec(rec).map_err(|e| (path.clone(), e.into()))?;
        k3_common::fsutil::write_atomic(&path, &text).map_err(|e| (path, e))
    }
}

/// True when `p` lets anything out (so the sandbox needs a network at all).
fn wants_network(p: &EgressPolicy) -> bool {
    !p.internet_blocked() || !p.allow_out.is_empty()
}

impl Runtime {
    /// A resource sample of running sandbox `id`: the guest's CPU, memory and disk, and its traffic.
    pub async fn sample(&self, id: &str) -> Result<Sample, ConnectError> {
        let stream = self.open_agent_stream(id).await?;
        let (status, body) =
            crate::agent::request_on(stream, "GET", agentenv_envd::paths::METRICS, None).await?;
        let guest = (status == 200)
            .then(|| serde_json::from_str(&body).ok())
            .flatten()
            .ok_or_else(|| {
                ConnectError::Agent(crate::agent::AgentError::Http {
                    what: "GET /metrics".into(),
                    detail: format!(
                        "HTTP {status}: {}",
                        body.chars().take(200).collect::<String>()
                    ),
                })
            })?;
        Ok(Sample {
            guest,
            net: self.net_stats(id).await,
        })
    }

    /// Why sandboxes get no network here, or `None` when they do.
    pub fn networking_off(&self) -> Option<&str> {
        self.inner
            .net
            .is_none()
            .then_some(self.inner.net_off.as_str())
    }

    pub(crate) async fn attach_net(
        &self,
        live: &mut Live,
        nic: bool,
        policy: EgressPolicy,
    ) -> Result<(), CreateError> {
        let inner = &self.inner;
        let id = live.record.id.clone();
        let net = match (&inner.net, nic) {
            (Some(n), true) => n,
            _ if !wants_network(&policy) => return Ok(()),
            (None, _) => return Err(CreateError::NetworkUnavailable(inner.net_off.clone())),
            (Some(_), false) => {
                return Err(CreateError::NetworkUnavailable(format!(
                    "template {} was built without a NIC (rebuild it)",
                    live.record.template_id
                )));
            }
        };
        let att = net.attach(&inner.sandbox_dir(&id), policy.clone()).await?;
        let slot = att.addrs.index;
        live.net = Some(att);
        inner
            .write_net_record(&id, &NetRecord { slot, policy })
            .map_err(|(path, source)| CreateError::Io {
                what: "write",
                path,
                source,
            })
    }

    pub(crate) fn release_net(&self, live: &mut Live) {
        if let (Some(att), Some(net)) = (live.net.take(), &self.inner.net) {
            net.release(att);
        }
    }

    /// Replaces sandbox `id`'s egress policy; new connections follow it at once, no restart.
    pub async fn set_network(&self, id: &str, policy: EgressPolicy) -> Result<(), NetworkError> {
        let slot = self
            .slot(id)
            .ok_or_else(|| NetworkError::NotFound(id.into()))?;
        let live = slot.live.lock().await;
        if live.gone {
            return Err(NetworkError::NotFound(id.into()));
        }
        let (Some(net), Some(att)) = (&self.inner.net, &live.net) else {
            return Err(NetworkError::Unavailable {
                id: id.into(),
                why: match &self.inner.net {
                    None => self.inner.net_off.clone(),
                    Some(_) => "it was created without network access".into(),
                },
            });
        };
        net.update(att, policy.clone()).await?;
        let rec = NetRecord {
            slot: att.addrs.index,
            policy,
        };
        if let Err((path, e)) = self.inner.write_net_record(id, &rec) {
            tracing::warn!(sandbox = %id, path = %path.display(), error = %e, "net.json not updated");
        }
        Ok(())
    }

    /// Sandbox `id`'s address and policy; `None` when unknown or without a network.
    pub async fn network(&self, id: &str) -> Option<NetworkInfo> {
        let slot = self.slot(id)?;
        let live = slot.live.lock().await;
        live.net.as_ref().map(|a| NetworkInfo {
            address: a.addrs.guest,
            policy: a.policy(),
        })
    }

    /// Sandbox `id`'s traffic counters; `None` when unknown, without a network or unreadable.
    pub async fn net_stats(&self, id: &str) -> Option<NetStats> {
        let slot = self.slot(id)?;
        let net = self.inner.net.as_ref()?;
        let live = slot.live.lock().await;
        match net.stats(live.net.as_ref()?).await {
            Ok(s) => Some(s),
            Err(e) => {
                tracing::warn!(sandbox = %id, error = %e, "no traffic counters");
                None
            }
        }
    }

    /// Re-takes the network of a sandbox kept by recovery (its slot, or a new one when the host lost
    /// it); a failure leaves it without a network and is logged.
    pub(crate) async fn recover_net(&self, live: &mut Live) {
        let (Some(net), id) = (&self.inner.net, live.record.id.clone()) else {
            return;
        };
        let Ok(text) = std::fs::read(self.inner.net_record_path(&id)) else {
            return;
        };
        let Ok(rec) = serde_json::from_slice::<NetRecord>(&text) else {
            tracing::warn!(sandbox = %id, "unreadable net.json: the sandbox keeps no network");
            return;
        };
        let dir = self.inner.sandbox_dir(&id);
        let att = if crate::net::slot::exists(rec.slot) && crate::net::held_by(rec.slot, &dir) {
            net.adopt(&dir, rec.slot, rec.policy.clone()).await
        } else {
            net.attach(&dir, rec.policy.clone()).await
        };
        match att {
            Ok(a) => live.net = Some(a),
            Err(e) => tracing::warn!(sandbox = %id, error = %e, "sandbox network not recovered"),
        }
    }

    /// [`Runtime::close`] without waiting (for a caller that cannot await, such as a `Drop`): warm VMs
    /// and kept paused QEMUs get SIGKILL; sandboxes keep running.
    pub fn close_now(&self) {
        for w in self.inner.warm.drain() {
            crate::lifecycle::warm::discard(w, self.inner.net.as_ref());
        }
        for slot in self.inner.slots() {
            if let Ok(mut live) = slot.live.try_lock()
                && let Some(k) = live.kept.take()
            {
                k.kill_now();
            }
        }
        if let Some(net) = &self.inner.net {
            net.drain();
        }
    }

    /// Kills the warm VMs and deletes the warm network slots (the process is stopping; sandboxes keep
    /// theirs).
    pub async fn close(&self) {
        for w in self.inner.warm.drain() {
            self.discard_warm(w).await;
        }
        // A warm VM being made holds the pool's permit until it has been discarded.
        self.inner.warm.settled().await;
        for slot in self.inner.slots() {
            let kept = slot.live.lock().await.kept.take();
            if let Some(k) = kept {
                k.end().await;
            }
        }
        if let Some(net) = &self.inner.net {
            net.drain();
        }
        // Chunks fetched by imports enter the cache in the background; they hold the store's folder lock.
        self.inner.store.settle().await;
    }

    /// Deletes network slots of this state folder that no known sandbox holds (left by a crash).
    pub(crate) fn remove_stale_nets(&self) {
        let Some(net) = &self.inner.net else { return };
        let known: Vec<String> = self
            .inner
            .sandboxes
            .ids()
            .iter()
            .map(|id| self.inner.sandbox_dir(id).display().to_string())
            .collect();
        let n = net.remove_stale(Some(&known));
        if n > 0 {
            tracing::info!(
                removed = n,
                "removed sandbox networks left by a previous run"
            );
        }
    }
}
