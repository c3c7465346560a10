//! Process table: spawn (pipes or PTY), fan out output to any number of watchers, stdin,
//! signals, resize. A process's lifetime is independent of the streams that watch it.

use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::process::ChildStdin;
use tokio::sync::mpsc;

use crate::envd::{Code, ProcessConfig, ProcessSelector, PtySize, RpcError, Stream};
use crate::users::{self, User};

/// Largest output chunk sent in one data event.
const CHUNK: usize = 32 * 1024;
/// Output chunks queued per watcher before the process's output reader waits for it.
const WATCHER_QUEUE: usize = 64;
/// How long to wait for output pipes after the process exited (grandchildren may hold them).
const DRAIN_GRACE: Duration = Duration::from_millis(500);

/// What a watcher of a process receives after the start event.
#[derive(Debug, Clone)]
pub enum ProcEvent {
    /// Output bytes.
    Data(Stream, bytes::Bytes),
    /// The process ended.
    End {
        /// Exit status (−1 when killed by a signal).
        exit_code: i32,
        /// True when it exited normally.
        exited: bool,
        /// Go-style status text (`exit status 3`, `signal: killed`).
        status: String,
        /// Killed at its deadline (`SpawnSpec::timeout`).
        timed_out: bool,
    },
}

enum Input {
    Pipe(ChildStdin),
    Pty(Arc<File>),
}

/// One running process.
pub struct Proc {
    /// Process id (also its process-group id: every process runs in its own session).
    pub pid: u32,
    /// The config it was started with.
    pub config: ProcessConfig,
    /// Optional tag.
    pub tag: Option<String>,
    watchers: Mutex<Option<Vec<mpsc::Sender<ProcEvent>>>>,
    /// Output chunks delivered so far, and deliveries in progress (for [`drain`]).
    delivered: AtomicU64,
    delivering: AtomicUsize,
    input: tokio::sync::Mutex<Option<Input>>,
    pty_master: Option<Arc<File>>,
}

impl Proc {
    fn senders(&self) -> Vec<mpsc::Sender<ProcEvent>> {
        let w = self.watchers.lock().unwrap_or_else(|e| e.into_inner());
        w.as_ref().map(|v| v.to_vec()).unwrap_or_default()
    }

    fn forget(&self, dead: &[mpsc::Sender<ProcEvent>]) {
        if dead.is_empty() {
            return;
        }
        if let Some(list) = self
            .watchers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_mut()
        {
            list.retain(|t| !dead.iter().any(|d| d.same_channel(t)));
        }
    }

    /// Delivers `ev` to every watcher, waiting while one is full (lossless backpressure up to
    /// the HTTP connection); watchers whose stream is gone are dropped.
    async fn emit(&self, ev: ProcEvent) {
        self.delivering.fetch_add(1, Ordering::SeqCst);
        let mut dead = Vec::new();
        for tx in self.senders() {
            if tx.send(ev.clone()).await.is_err() {
                dead.push(tx);
            }
        }
        self.forget(&dead);
        self.delivered.fetch_add(1, Ordering::SeqCst);
        self.delivering.fetch_sub(1, Ordering::SeqCst);
    }

    /// [`Proc::emit`] from a blocking thread (the PTY reader).
    fn emit_blocking(&self, ev: ProcEvent) {
        self.delivering.fetch_add(1, Ordering::SeqCst);
        let mut dead = Vec::new();
        for tx in self.senders() {
            if tx.blocking_send(ev.clone()).is_err() {
                dead.push(tx);
            }
        }
        self.forget(&dead);
        self.delivered.fetch_add(1, Ordering::SeqCst);
        self.delivering.fetch_sub(1, Ordering::SeqCst);
    }

    /// Adds a watcher; `None` once the process has ended.
    pub fn subscribe(&self) -> Option<mpsc::Receiver<ProcEvent>> {
        let mut w = self.watchers.lock().unwrap_or_else(|e| e.into_inner());
        let (tx, rx) = mpsc::channel(WATCHER_QUEUE);
        w.as_mut()?.push(tx);
        Some(rx)
    }

    /// Writes to stdin or the PTY.
    pub async fn write_input(&self, data: Vec<u8>) -> Result<(), RpcError> {
        let mut guard = self.input.lock().await;
        match guard.as_mut() {
            None => Err(RpcError::new(
                Code::FailedPrecondition,
                format!("stdin of process {} is closed", self.pid),
            )),
            Some(Input::Pipe(p)) => p
                .write_all(&data)
                .await
                .map_err(|e| RpcError::new(Code::Internal, format!("writing stdin: {e}"))),
            Some(Input::Pty(f)) => {
                let f = f.clone();
                tokio::task::spawn_blocking(move || (&*f).write_all(&data))
                    .await
                    .map_err(|e| RpcError::new(Code::Internal, e.to_string()))?
                    .map_err(|e| RpcError::new(Code::Internal, format!("writing pty: {e}")))
            }
        }
    }

    /// Closes stdin (EOF). For a PTY this sends ^D.
    pub async fn close_input(&self) -> Result<(), RpcError> {
        let mut guard = self.input.lock().await;
        if matches!(guard.as_ref(), Some(Input::Pty(_))) {
            drop(guard);
            return self.write_input(vec![0x04]).await;
        }
        guard.take();
        Ok(())
    }

    /// Resizes the PTY.
    pub fn resize(&self, size: PtySize) -> Result<(), RpcError> {
        let Some(master) = &self.pty_master else {
            return Err(RpcError::new(
                Code::FailedPrecondition,
                format!("process {} has no pty", self.pid),
            ));
        };
        set_winsize(master.as_raw_fd(), size)
            .map_err(|e| RpcError::new(Code::Internal, format!("resize: {e}")))
    }

    /// Sends `sig` to the process group (so `bash -c` children get it too).
    pub fn signal(&self, sig: i32) -> Result<(), RpcError> {
        // SAFETY: kill has no memory preconditions.
        let rc = unsafe { libc::kill(-(self.pid as i32), sig) };
        if rc == 0 {
            return Ok(());
        }
        // SAFETY: as above.
        if unsafe { libc::kill(self.pid as i32, sig) } == 0 {
            return Ok(());
        }
        Err(RpcError::new(
            Code::NotFound,
            format!("process {} is not running", self.pid),
        ))
    }
}

/// Everything needed to start a process.
pub struct SpawnSpec {
    /// What to run.
    pub config: ProcessConfig,
    /// Tag for selectors.
    pub tag: Option<String>,
    /// PTY size, when the process runs under a terminal.
    pub pty: Option<PtySize>,
    /// Keep a stdin pipe.
    pub stdin: bool,
    /// Run as this user.
    pub user: User,
    /// Base environment (sandbox env vars); `config.envs` overrides it.
    pub base_env: HashMap<String, String>,
    /// Default working directory when `config.cwd` is absent (else the user's home).
    pub default_cwd: Option<PathBuf>,
    /// Kill the process after this long (Connect-Timeout-Ms of Start).
    pub timeout: Option<Duration>,
}

/// All running processes.
#[derive(Default)]
pub struct ProcessTable {
    procs: Mutex<HashMap<u32, Arc<Proc>>>,
}

impl ProcessTable {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u32, Arc<Proc>>> {
        self.procs.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Running processes.
    pub fn list(&self) -> Vec<Arc<Proc>> {
        let mut v: Vec<_> = self.lock().values().cloned().collect();
        v.sort_by_key(|p| p.pid);
        v
    }

    /// Finds a running process by pid or tag.
    pub fn find(&self, sel: &ProcessSelector) -> Result<Arc<Proc>, RpcError> {
        let t = self.lock();
        let found = match (&sel.pid, &sel.tag) {
            (Some(pid), _) => t.get(pid).cloned(),
            (None, Some(tag)) => t
                .values()
                .find(|p| p.tag.as_deref() == Some(tag.as_str()))
                .cloned(),
            (None, None) => {
                return Err(RpcError::new(
                    Code::InvalidArgument,
                    "process selector is empty",
                ));
            }
        };
        found.ok_or_else(|| {
            RpcError::new(
                Code::NotFound,
                format!("process {} not found", describe(sel)),
            )
        })
    }

    /// Starts a process; returns it with a watcher subscribed before any output is read.
    pub fn spawn(
        self: &Arc<Self>,
        spec: SpawnSpec,
    ) -> Result<(Arc<Proc>, mpsc::Receiver<ProcEvent>), RpcError> {
        let cwd = resolve_cwd(&spec)?;
        let mut cmd = tokio::process::Command::new(&spec.config.cmd);
        cmd.args(&spec.config.args)
            .current_dir(&cwd)
            .env_clear()
            .envs(build_env(&spec))
            .kill_on_drop(false);
        let pty = match spec.pty {
            Some(size) => Some(
                open_pty(size)
                    .map_err(|e| RpcError::new(Code::Internal, format!("openpty: {e}")))?,
            ),
            None => None,
        };
        if let Some((_, slave)) = &pty {
            let io = |f: &OwnedFd| f.try_clone().map(Stdio::from);
            let err = |e: std::io::Error| RpcError::new(Code::Internal, format!("pty fd: {e}"));
            cmd.stdin(io(slave).map_err(err)?)
                .stdout(io(slave).map_err(err)?)
                .stderr(io(slave).map_err(err)?);
        } else {
            cmd.stdin(if spec.stdin {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        }
        let switch_user = current_uid() == 0 && spec.user.uid != 0;
        if current_uid() != 0 && current_uid() != spec.user.uid {
            return Err(RpcError::new(
                Code::PermissionDenied,
                format!("agent is not root and cannot run as {}", spec.user.name),
            ));
        }
        let (uid, gid, groups, with_tty) = (
            spec.user.uid,
            spec.user.gid,
            users::group_list(&spec.user),
            pty.is_some(),
        );
        // SAFETY: the closure only makes async-signal-safe syscalls (setsid, ioctl, setgroups, setgid, setuid).
        unsafe {
            cmd.pre_exec(move || {
                if libc::setsid() < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if with_tty && libc::ioctl(0, libc::TIOCSCTTY, 0) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if switch_user
                    && (libc::setgroups(groups.len(), groups.as_ptr()) < 0
                        || libc::setgid(gid) < 0
                        || libc::setuid(uid) < 0)
                {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut procs = self.lock();
        let mut child = cmd.spawn().map_err(|e| {
            let code = if e.kind() == std::io::ErrorKind::NotFound {
                Code::NotFound
            } else {
                Code::Internal
            };
            RpcError::new(code, format!("starting {}: {e}", spec.config.cmd))
        })?;
        drop(cmd); // closes our copies of the PTY slave
        let pid = child
            .id()
            .ok_or_else(|| RpcError::new(Code::Internal, "child has no pid"))?;
        let (tx, rx) = mpsc::channel(WATCHER_QUEUE);
        let (input, pty_master, readers) = match pty {
            Some((master, _slave)) => {
                let master = Arc::new(File::from(master));
                let reader = master
                    .try_clone()
                    .map_err(|e| RpcError::new(Code::Internal, e.to_string()))?;
                (
                    Some(Input::Pty(master.clone())),
                    Some(master),
                    Readers::Pty(reader),
                )
            }
            None => (
                child.stdin.take().map(Input::Pipe),
                None,
                Readers::Pipes(child.stdout.take(), child.stderr.take()),
            ),
        };
        let proc = Arc::new(Proc {
            pid,
            config: spec.config.clone(),
            tag: spec.tag.clone(),
            watchers: Mutex::new(Some(vec![tx])),
            delivered: AtomicU64::new(0),
            delivering: AtomicUsize::new(0),
            input: tokio::sync::Mutex::new(input),
            pty_master,
        });
        procs.insert(pid, proc.clone());
        drop(procs);
        tracing::debug!(pid, cmd = %spec.config.cmd, "process started");
        let table = self.clone();
        let p = proc.clone();
        tokio::spawn(async move {
            let outputs = readers.spawn(p.clone());
            let deadline = spec.timeout;
            let mut timed_out = false;
            let status = match deadline {
                Some(d) => match tokio::time::timeout(d, child.wait()).await {
                    Ok(s) => s,
                    Err(_) => {
                        timed_out = true;
                        let _ = p.signal(libc::SIGKILL);
                        child.wait().await
                    }
                },
                None => child.wait().await,
            };
            drain(&p, outputs).await;
            table.lock().remove(&pid);
            let (exit_code, exited, status) = match status {
                Ok(s) => describe_status(s),
                Err(e) => (-1, false, format!("wait failed: {e}")),
            };
            tracing::debug!(pid, %status, "process ended");
            // Taken first: a watcher arriving now gets `not_found` instead of missing the end.
            let last = p.watchers.lock().unwrap_or_else(|e| e.into_inner()).take();
            let end = ProcEvent::End {
                exit_code,
                exited,
                status,
                timed_out,
            };
            for tx in last.unwrap_or_default() {
                let _ = tx.send(end.clone()).await;
            }
        });
        Ok((proc, rx))
    }
}

enum Readers {
    Pipes(
        Option<tokio::process::ChildStdout>,
        Option<tokio::process::ChildStderr>,
    ),
    Pty(File),
}

impl Readers {
    fn spawn(self, p: Arc<Proc>) -> Vec<tokio::task::JoinHandle<()>> {
        match self {
            Readers::Pipes(out, err) => {
                let mut hs = Vec::new();
                if let Some(o) = out {
                    hs.push(tokio::spawn(pump(o, Stream::Stdout, p.clone())));
                }
                if let Some(e) = err {
                    hs.push(tokio::spawn(pump(e, Stream::Stderr, p)));
                }
                hs
            }
            Readers::Pty(mut f) => vec![tokio::task::spawn_blocking(move || {
                let mut buf = vec![0u8; CHUNK];
                // EIO once every slave fd is closed.
                while let Ok(n) = f.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    p.emit_blocking(ProcEvent::Data(
                        Stream::Pty,
                        bytes::Bytes::copy_from_slice(&buf[..n]),
                    ));
                }
            })],
        }
    }
}

/// Waits for the output readers after the process exited. Gives up only once output has been
/// idle for [`DRAIN_GRACE`] with nothing being delivered (a grandchild holding the pipe open);
/// a slow client that is still receiving keeps it waiting, so no output is lost.
async fn drain(p: &Proc, outputs: Vec<tokio::task::JoinHandle<()>>) {
    let all = async {
        for h in outputs {
            let _ = h.await;
        }
    };
    tokio::pin!(all);
    loop {
        let before = p.delivered.load(Ordering::SeqCst);
        tokio::select! {
            _ = &mut all => return,
            _ = tokio::time::sleep(DRAIN_GRACE) => {
                let idle = p.delivered.load(Ordering::SeqCst) == before;
                if idle && p.delivering.load(Ordering::SeqCst) == 0 {
                    return;
                }
            }
        }
    }
}

async fn pump<R: tokio::io::AsyncRead + Unpin>(mut r: R, stream: Stream, p: Arc<Proc>) {
    let mut buf = vec![0u8; CHUNK];
    while let Ok(n) = r.read(&mut buf).await {
        if n == 0 {
            break;
        }
        p.emit(ProcEvent::Data(
            stream,
            bytes::Bytes::copy_from_slice(&buf[..n]),
        ))
        .await;
    }
}

fn describe(sel: &ProcessSelector) -> String {
    match (&sel.pid, &sel.tag) {
        (Some(pid), _) => format!("with pid {pid}"),
        (None, Some(tag)) => format!("with tag {tag}"),
        _ => String::new(),
    }
}

fn describe_status(s: std::process::ExitStatus) -> (i32, bool, String) {
    if let Some(code) = s.code() {
        return (code, true, format!("exit status {code}"));
    }
    let sig = s.signal().unwrap_or(0);
    let name = match sig {
        libc::SIGKILL => "killed".to_string(),
        libc::SIGTERM => "terminated".to_string(),
        libc::SIGINT => "interrupt".to_string(),
        libc::SIGHUP => "hangup".to_string(),
        other => other.to_string(),
    };
    (-1, false, format!("signal: {name}"))
}

fn resolve_cwd(spec: &SpawnSpec) -> Result<PathBuf, RpcError> {
    let home = &spec.user.home;
    let cwd = match &spec.config.cwd {
        Some(c) if !c.is_empty() => {
            let p = Path::new(c);
            if p.is_absolute() {
                p.to_path_buf()
            } else {
                home.join(p)
            }
        }
        _ => match &spec.default_cwd {
            Some(d) => d.clone(),
            None if home.is_dir() => home.clone(),
            None => PathBuf::from("/"),
        },
    };
    if !cwd.is_dir() {
        return Err(RpcError::new(
            Code::InvalidArgument,
            format!("cwd '{}' does not exist", cwd.display()),
        ));
    }
    Ok(cwd)
}

fn build_env(spec: &SpawnSpec) -> HashMap<String, String> {
    let u = &spec.user;
    let mut env: HashMap<String, String> = [
        (
            "PATH",
            "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        ),
        ("LANG", "C.UTF-8"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    env.insert("HOME".into(), u.home.display().to_string());
    env.insert("USER".into(), u.name.clone());
    env.insert("LOGNAME".into(), u.name.clone());
    env.insert(
        "SHELL".into(),
        if u.shell.is_empty() {
            "/bin/sh".into()
        } else {
            u.shell.clone()
        },
    );
    if spec.pty.is_some() {
        env.insert("TERM".into(), "xterm-256color".into());
    }
    env.extend(spec.base_env.iter().map(|(k, v)| (k.clone(), v.clone())));
    env.extend(spec.config.envs.iter().map(|(k, v)| (k.clone(), v.clone())));
    env
}

fn current_uid() -> u32 {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() }
}

fn open_pty(size: PtySize) -> std::io::Result<(OwnedFd, OwnedFd)> {
    let mut master = -1;
    let mut slave = -1;
    let ws = winsize(size);
    // SAFETY: openpty writes two fds; name/termios pointers may be null; `ws` outlives the call.
    let rc = unsafe {
        libc::openpty(
            &mut master,
            &mut slave,
            std::ptr::null_mut(),
            std::ptr::null(),
            &ws,
        )
    };
    if rc < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: openpty succeeded, so both fds are open and owned by us.
    let (m, s) = unsafe { (OwnedFd::from_raw_fd(master), OwnedFd::from_raw_fd(slave)) };
    // Neither end may leak into other children; dup2 onto 0/1/2 clears the flag in the child.
    for fd in [m.as_raw_fd(), s.as_raw_fd()] {
        // SAFETY: fcntl on an fd we own.
        unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) };
    }
    Ok((m, s))
}

fn winsize(size: PtySize) -> libc::winsize {
    libc::winsize {
        ws_row: size.rows.clamp(1, u16::MAX as u32) as u16,
        ws_col: size.cols.clamp(1, u16::MAX as u32) as u16,
        ws_xpixel: 0,
        ws_ypixel: 0,
    }
}

fn set_winsize(fd: i32, size: PtySize) -> std::io::Result<()> {
    let ws = winsize(size);
    // SAFETY: TIOCSWINSZ reads a winsize from a valid pointer.
    if unsafe { libc::ioctl(fd, libc::TIOCSWINSZ, &ws) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}
