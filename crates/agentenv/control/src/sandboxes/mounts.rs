//! Volumes mounted into sandboxes. Each mount is a channel (`agentenv_envd::volume`) that the
//! lifecycle keeps attached while its sandbox runs: attached before a create answers, and again by
//! the reaper's tick once anything replaced the VM's agent session (a resume that restarted QEMU, a
//! fork, a restore, a restart of the server). The guest keeps its mount and waits for the next
//! channel meanwhile.

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::*;
use crate::store::VolumeMount;
use crate::volumes::{Volumes, channel};
use agentenv_envd::volume;

/// Most mounts of one sandbox.
pub const MAX_MOUNTS: usize = 8;
/// Longest wait for the guest agent to take a channel (mounting included).
const ATTACH_DEADLINE: Duration = Duration::from_secs(10);
/// Longest answer head to an attach.
const MAX_HEAD: usize = 4096;

/// Live channels by (sandbox, guest path).
pub(super) type Channels = Arc<Mutex<HashSet<(String, String)>>>;

/// A mount path: absolute, normal (no `.`, `..` or empty components), not `/`.
fn check_path(path: &str) -> Result<()> {
    let normal = path.len() <= 1024
        && path.starts_with('/')
        && path[1..]
            .split('/')
            .all(|c| !matches!(c, "" | "." | "..") && !c.contains('\0'));
    if normal {
        Ok(())
    } else {
        Err(LifecycleError::Invalid(format!(
            "volume mount path {path:?} must be absolute and normal, and not /"
        )))
    }
}

impl Sandboxes {
    /// `owner`'s volumes for a create's (name, path) pairs, then those a snapshot's guest holds
    /// (`held`) at other paths whose volumes still are the owner's.
    pub(super) fn resolve_mounts(
        &self,
        owner: &str,
        asks: &[(String, String)],
        held: &[VolumeMount],
    ) -> Result<Vec<VolumeMount>> {
        if asks.len() > MAX_MOUNTS {
            return Err(LifecycleError::Invalid(format!(
                "at most {MAX_MOUNTS} volume mounts per sandbox"
            )));
        }
        let mut out: Vec<VolumeMount> = vec![];
        for (name, path) in asks {
            check_path(path)?;
            if out.iter().any(|m| m.path == *path) {
                return Err(LifecycleError::Invalid(format!(
                    "two volumes mounted at {path}"
                )));
            }
            let vol = self
                .volumes
                .by_name(owner, name)
                .map_err(|_| LifecycleError::VolumeNotFound(name.clone()))?;
            out.push(VolumeMount {
                volume_id: vol.volume_id,
                name: vol.name,
                path: path.clone(),
            });
        }
        for m in held {
            if out.iter().all(|o| o.path != m.path) && self.volumes.get(owner, &m.volume_id).is_ok()
            {
                out.push(m.clone());
            }
        }
        Ok(out)
    }

    /// Attaches every mount of sandbox `id` now.
    pub(super) async fn attach_mounts(&self, id: &str, mounts: &[VolumeMount]) -> Result<()> {
        for m in mounts {
            let key = (id.to_string(), m.path.clone());
            self.channels.lock().expect("channels").insert(key.clone());
            attach(
                self.backend.clone(),
                self.volumes.clone(),
                self.channels.clone(),
                key,
                m.volume_id.clone(),
            )
            .await
            .map_err(|detail| LifecycleError::Mount {
                id: id.into(),
                path: m.path.clone(),
                detail,
            })?;
        }
        Ok(())
    }

    /// Starts a channel for each mount of a running sandbox that has none (the reaper's tick).
    pub(crate) fn keep_mounts(&self) {
        let due: Vec<((String, String), String)> = {
            let records = self.records.lock().expect("records");
            let mut live = self.channels.lock().expect("channels");
            let mut due = vec![];
            for r in records.values() {
                if r.state != SandboxState::Running {
                    continue;
                }
                for m in &r.volume_mounts {
                    let key = (r.sandbox_id.clone(), m.path.clone());
                    if live.insert(key.clone()) {
                        due.push((key, m.volume_id.clone()));
                    }
                }
            }
            due
        };
        for (key, volume_id) in due {
            let (backend, volumes, channels) = (
                self.backend.clone(),
                self.volumes.clone(),
                self.channels.clone(),
            );
            tokio::spawn(async move {
                if let Err(e) = attach(backend, volumes, channels, key.clone(), volume_id).await {
                    tracing::debug!(sandbox = %key.0, path = %key.1, error = %e, "volume channel not attached yet");
                }
            });
        }
    }
}

/// Opens the channel `key` names (registered in `channels` by the caller) and serves it in a task
/// of its own, which unregisters it at its end; unregisters it at once on failure.
async fn attach(
    backend: Arc<dyn VmBackend>,
    volumes: Arc<Volumes>,
    channels: Channels,
    key: (String, String),
    volume_id: String,
) -> std::result::Result<(), String> {
    let drop_key = |channels: &Channels, key: &(String, String)| {
        channels.lock().expect("channels").remove(key);
    };
    // With a bucket, files this node lacks come from there first (not bound by the attach deadline).
    if let Err(e) = volumes.restore(&volume_id).await {
        drop_key(&channels, &key);
        return Err(e.to_string());
    }
    let opened = async {
        let dir = volumes.mount_dir(&volume_id).map_err(|e| e.to_string())?;
        let mut s = backend
            .open_agent_stream(&key.0)
            .await
            .map_err(|e| e.to_string())?;
        s.write_all(volume::attach_request(&key.1).as_bytes())
            .await
            .map_err(|e| e.to_string())?;
        let head = read_head(&mut s).await?;
        if !head.starts_with("HTTP/1.1 101") {
            return Err(format!(
                "the guest refused the mount: {}",
                head.lines().next().unwrap_or_default()
            ));
        }
        Ok((dir, s))
    };
    let (dir, stream) = match tokio::time::timeout(ATTACH_DEADLINE, opened).await {
        Ok(Ok(v)) => v,
        Ok(Err(e)) => {
            drop_key(&channels, &key);
            return Err(e);
        }
        Err(_) => {
            drop_key(&channels, &key);
            return Err(format!("no answer within {ATTACH_DEADLINE:?}"));
        }
    };
    tokio::spawn(async move {
        match channel::serve(dir, stream).await {
            // The VM stopped or went: the next attach (if it runs again) replaces the channel.
            Ok(()) | Err(channel::ChannelError::Io(_)) => {}
            Err(e) => {
                tracing::warn!(sandbox = %key.0, path = %key.1, error = %e, "a guest broke its volume channel");
            }
        }
        drop_key(&channels, &key);
    });
    Ok(())
}

/// The answer head (up to its blank line), byte by byte so nothing after it is taken.
async fn read_head(s: &mut crate::backend::AgentStream) -> std::result::Result<String, String> {
    let mut head = Vec::with_capacity(256);
    while !head.ends_with(b"\r\n\r\n") {
        if head.len() >= MAX_HEAD {
            return Err("the guest's answer head is too long".into());
        }
        let b = s.read_u8().await.map_err(|e| e.to_string())?;
        head.push(b);
    }
    Ok(String::from_utf8_lossy(&head).into_owned())
}
