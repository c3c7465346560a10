//! Directory watches (inotify through `notify`): a stream per WatchDir call, and polled
//! watchers for CreateWatcher / GetWatcherEvents / RemoveWatcher.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use notify::event::{EventKind, ModifyKind, RenameMode};
use notify::{RecommendedWatcher, RecursiveMode, Watcher};
use serde_json::Value;
use tokio::sync::mpsc;

use crate::envd::{self, Code, EventType, RpcError};
use crate::fs;

/// Most events a polled watcher buffers between two GetWatcherEvents calls.
const MAX_BUFFERED_EVENTS: usize = 10_000;
/// Longest a GetWatcherEvents call waits for its barrier (see [`Barrier`]).
const BARRIER_WAIT: Duration = Duration::from_secs(2);

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
    let (tx, rx) = mpsc::unbounded_channel();
    let watcher = watch(dir, req, None, move |ev| {
        let _ = tx.send(ev);
    })?;
    Ok(DirWatch {
        _watcher: watcher,
        rx,
    })
}

/// Watches `dir`, handing each event to `sink` on notify's thread (the events of `barrier`'s
/// folder to the barrier).
fn watch(
    dir: &Path,
    req: &envd::WatchRequest,
    barrier: Option<Arc<Barrier>>,
    sink: impl Fn(Value) + Send + 'static,
) -> Result<RecommendedWatcher, RpcError> {
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
    let root: PathBuf = dir.to_path_buf();
    let barrier_dir = barrier.as_ref().map(|b| b.dir.clone());
    let mut watcher = notify::recommended_watcher(move |res: notify::Result<notify::Event>| {
        let Ok(ev) = res else { return };
        if let Some(b) = &barrier
            && b.reached(&ev)
        {
            return;
        }
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
            sink(envd::fs_event(&name, ty, entry.as_ref()));
        }
    })
    .map_err(|e| RpcError::new(Code::Internal, format!("inotify: {e}")))?;
    let mode = if recursive {
        RecursiveMode::Recursive
    } else {
        RecursiveMode::NonRecursive
    };
    let watch_err =
        |d: &Path, e| RpcError::new(Code::Internal, format!("watch '{}': {e}", d.display()));
    watcher.watch(dir, mode).map_err(|e| watch_err(dir, e))?;
    if let Some(d) = &barrier_dir {
        watcher
            .watch(d, RecursiveMode::NonRecursive)
            .map_err(|e| watch_err(d, e))?;
    }
    Ok(watcher)
}

/// Puts a poll after every change made before it. inotify keeps one queue per watcher, in order,
/// and notify's thread reads it on its own time (under TCG, often after a poll that came right
/// after a write). So a polled watcher also watches a private folder, and a poll creates file `n`
/// there and waits until notify's thread has read that event: every earlier event is then in the
/// buffer.
struct Barrier {
    dir: PathBuf,
    next: Mutex<u64>,
    seen: Mutex<u64>,
    cv: Condvar,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Barrier {
    fn new() -> std::io::Result<Barrier> {
        let base = Path::new("/run/agentenv/watch");
        let base = match std::fs::create_dir_all(base) {
            Ok(()) => base.to_path_buf(),
            Err(_) => std::env::temp_dir(),
        };
        let dir = base.join(format!(".agentenv-watch-{:016x}", rand::random::<u64>()));
        std::fs::create_dir(&dir)?;
        Ok(Barrier {
            dir,
            next: Mutex::new(0),
            seen: Mutex::new(0),
            cv: Condvar::new(),
        })
    }

    /// Whether `ev` is one of the barrier's own (then it is counted, not reported).
    fn reached(&self, ev: &notify::Event) -> bool {
        let Some(p) = ev.paths.first().filter(|p| p.parent() == Some(&*self.dir)) else {
            return false;
        };
        if let Some(n) = p.file_name().and_then(|n| n.to_str()?.parse::<u64>().ok()) {
            let mut seen = lock(&self.seen);
            *seen = (*seen).max(n);
            self.cv.notify_all();
        }
        true
    }

    /// Waits, at most [`BARRIER_WAIT`], until the events queued before this call are read.
    fn pass(&self) {
        let n = {
            let mut next = lock(&self.next);
            *next += 1;
            *next
        };
        let file = self.dir.join(n.to_string());
        if std::fs::File::create(&file).is_err() {
            return;
        }
        let seen = lock(&self.seen);
        drop(self.cv.wait_timeout_while(seen, BARRIER_WAIT, |s| *s < n));
        let _ = std::fs::remove_file(&file);
    }
}

impl Drop for Barrier {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
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

/// Events are buffered by notify's thread itself, with no task between that could be queued behind
/// the poll's own handler.
struct Polled {
    events: Arc<Mutex<Vec<Value>>>,
    barrier: Arc<Barrier>,
    _watcher: RecommendedWatcher,
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
        let events = Arc::new(Mutex::new(Vec::new()));
        let sink = events.clone();
        let barrier = Arc::new(Barrier::new().map_err(|e| RpcError::from_io(&e, "watch barrier"))?);
        let watcher = watch(dir, req, Some(barrier.clone()), move |ev| {
            let mut v = sink.lock().unwrap_or_else(|e| e.into_inner());
            if v.len() < MAX_BUFFERED_EVENTS {
                v.push(ev);
            }
        })?;
        let id = format!("{:032x}", rand::random::<u128>());
        let polled = Polled {
            events,
            barrier,
            _watcher: watcher,
        };
        self.lock().insert(id.clone(), polled);
        Ok(id)
    }

    /// GetWatcherEvents: events since the previous call.
    pub fn take_events(&self, id: &str) -> Result<Vec<Value>, RpcError> {
        let (events, barrier) = self
            .lock()
            .get(id)
            .map(|w| (w.events.clone(), w.barrier.clone()))
            .ok_or_else(|| RpcError::new(Code::NotFound, format!("watcher '{id}' not found")))?;
        barrier.pass();
        Ok(std::mem::take(&mut *lock(&events)))
    }

    /// RemoveWatcher.
    pub fn remove(&self, id: &str) -> Result<(), RpcError> {
        // Dropping the watcher ends its inotify watch.
        self.lock()
            .remove(id)
            .map(drop)
            .ok_or_else(|| RpcError::new(Code::NotFound, format!("watcher '{id}' not found")))
    }
}
