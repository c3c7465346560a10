//! Directory watches (inotify through `notify`): a stream per WatchDir call, and polled
//! watchers for CreateWatcher / GetWatcherEvents / RemoveWatcher.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use notify::event::{EventKind, ModifyKind, RenameMode};
use notify::{RecommendedWatcher, RecursiveMode, Watcher};
use serde_json::Value;
use tokio::sync::mpsc;

use crate::envd::{self, Code, EventType, RpcError};
use crate::fs;

/// Most events a polled watcher buffers between two GetWatcherEvents calls.
const MAX_BUFFERED_EVENTS: usize = 10_000;

/// A live inotify watch; events arrive as `FilesystemEvent` JSON on `rx`.
pub struct DirWatch {
    _watcher: RecommendedWatcher,
    /// Events as `filesystem.FilesystemEvent` JSON.
    pub rx: mpsc::UnboundedReceiver<Value>,
}

/// Network filesystems by `statfs` magic (NFS, SMB, CIFS, SMB2, FUSE): inotify misses changes made
/// elsewhere on them, so a watch there needs `allowNetworkMounts` (envd 0.6.4).
const NETWORK_FS: [(i64, &str); 5] = [
    (0x6969, "nfs"),
    (0x517B, "smb"),
    (0xFF53_4D42, "cifs"),
    (0xFE53_4D42, "smb2"),
    (0x6573_5546, "fuse"),
];

/// The network filesystem `dir` is on, if it is on one.
fn network_fs(dir: &Path) -> Option<&'static str> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: a NUL-terminated path and a zeroed statfs the call fills.
    if unsafe { libc::statfs(path.as_ptr(), &mut st) } != 0 {
        return None;
    }
    #[allow(clippy::unnecessary_cast)]
    let magic = st.f_type as i64;
    NETWORK_FS
        .iter()
        .find(|(m, _)| *m == magic)
        .map(|(_, n)| *n)
}

/// Starts watching `dir` as `req` asks (its `path` is already resolved to `dir`).
pub fn watch_dir(dir: &Path, req: &envd::WatchRequest) -> Result<DirWatch, RpcError> {
    let meta = std::fs::metadata(dir)
        .map_err(|e| RpcError::from_io(&e, &format!("watch '{}'", dir.display())))?;
    if !meta.is_dir() {
        return Err(RpcError::new(
            Code::InvalidArgument,
            format!("'{}' is not a directory", dir.display()),
        ));
    }
    if !req.allow_network_mounts
        && let Some(fs) = network_fs(dir)
    {
        return Err(RpcError::new(
            Code::FailedPrecondition,
            format!(
                "'{}' is on a network filesystem ({fs}): watching it needs allowNetworkMounts",
                dir.display()
            ),
        ));
    }
    let (recursive, include_entry) = (req.recursive, req.include_entry);
    let (tx, rx) = mpsc::unbounded_channel();
    let root: PathBuf = dir.to_path_buf();
    let mut watcher = notify::recommended_watcher(move |res: notify::Result<notify::Event>| {
        let Ok(ev) = res else { return };
        for (path, ty) in classify(&ev) {
            let name = path
                .strip_prefix(&root)
                .unwrap_or(&path)
                .display()
                .to_string();
            let entry = if include_entry {
                fs::entry_info(&path).ok()
            } else {
                None
            };
            let _ = tx.send(envd::fs_event(&name, ty, entry.as_ref()));
        }
    })
    .map_err(|e| RpcError::new(Code::Internal, format!("inotify: {e}")))?;
    let mode = if recursive {
        RecursiveMode::Recursive
    } else {
        RecursiveMode::NonRecursive
    };
    watcher
        .watch(dir, mode)
        .map_err(|e| RpcError::new(Code::Internal, format!("watch '{}': {e}", dir.display())))?;
    Ok(DirWatch {
        _watcher: watcher,
        rx,
    })
}

/// Maps a notify event to envd event types (fsnotify semantics: a rename reports RENAME for
/// the old name and CREATE for the new one).
fn classify(ev: &notify::Event) -> Vec<(PathBuf, EventType)> {
    let one = |ty| ev.paths.iter().map(|p| (p.clone(), ty)).collect();
    match ev.kind {
        EventKind::Create(_) => one(EventType::Create),
        EventKind::Remove(_) => one(EventType::Remove),
        EventKind::Modify(ModifyKind::Metadata(_)) => one(EventType::Chmod),
        EventKind::Modify(ModifyKind::Name(RenameMode::To)) => one(EventType::Create),
        EventKind::Modify(ModifyKind::Name(RenameMode::Both)) => {
            let mut v = Vec::new();
            if let Some(from) = ev.paths.first() {
                v.push((from.clone(), EventType::Rename));
            }
            if let Some(to) = ev.paths.get(1) {
                v.push((to.clone(), EventType::Create));
            }
            v
        }
        EventKind::Modify(ModifyKind::Name(_)) => one(EventType::Rename),
        EventKind::Modify(_) => one(EventType::Write),
        EventKind::Access(_) | EventKind::Any | EventKind::Other => Vec::new(),
    }
}

struct Polled {
    events: Arc<Mutex<Vec<Value>>>,
    task: tokio::task::JoinHandle<()>,
}

/// Watchers created by CreateWatcher, polled by GetWatcherEvents.
#[derive(Default)]
pub struct Watchers {
    map: Mutex<HashMap<String, Polled>>,
}

impl Watchers {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Polled>> {
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// CreateWatcher: returns the new watcher id.
    pub fn create(&self, dir: &Path, req: &envd::WatchRequest) -> Result<String, RpcError> {
        let w = watch_dir(dir, req)?;
        let events = Arc::new(Mutex::new(Vec::new()));
        let sink = events.clone();
        let task = tokio::spawn(async move {
            let mut w = w; // owns the inotify watch for the task's life
            while let Some(ev) = w.rx.recv().await {
                let mut v = sink.lock().unwrap_or_else(|e| e.into_inner());
                if v.len() < MAX_BUFFERED_EVENTS {
                    v.push(ev);
                }
            }
        });
        let id = format!("{:032x}", rand::random::<u128>());
        self.lock().insert(id.clone(), Polled { events, task });
        Ok(id)
    }

    /// GetWatcherEvents: events since the previous call.
    pub fn take_events(&self, id: &str) -> Result<Vec<Value>, RpcError> {
        let map = self.lock();
        let w = map
            .get(id)
            .ok_or_else(|| RpcError::new(Code::NotFound, format!("watcher '{id}' not found")))?;
        Ok(std::mem::take(
            &mut *w.events.lock().unwrap_or_else(|e| e.into_inner()),
        ))
    }

    /// RemoveWatcher.
    pub fn remove(&self, id: &str) -> Result<(), RpcError> {
        let w = self
            .lock()
            .remove(id)
            .ok_or_else(|| RpcError::new(Code::NotFound, format!("watcher '{id}' not found")))?;
        w.task.abort();
        Ok(())
    }
}
