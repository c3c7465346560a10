//! A sandbox's egress policy after create: replaced without a restart, read back, and its traffic
//! counted.

use super::{Caller, Result, Sandboxes};
use crate::backend::{EgressPolicy, NetworkInfo, Sample, VmError};

impl Sandboxes {
    /// Replaces sandbox `id`'s egress rules (running or paused), effective for new connections at once.
    pub async fn set_network(&self, caller: &Caller, id: &str, p: EgressPolicy) -> Result<()> {
        self.get_as(caller, id)?;
        let lock = self.op_lock(id);
        let _guard = lock.lock().await;
        self.backend.set_network(id, p).await?;
        Ok(())
    }

    /// The current resource sample of sandbox `id`; `None` while it is paused (as in E2B).
    pub async fn sample(&self, caller: &Caller, id: &str) -> Result<Option<Sample>> {
        self.get_as(caller, id)?;
        match self.backend.sample(id).await {
            Ok(s) => Ok(Some(s)),
            Err(VmError::Paused(_)) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Sandbox `id`'s network as the API shows it.
    pub async fn network_view(&self, id: &str) -> Option<NetworkInfo> {
        self.backend.network(id).await
    }
}
