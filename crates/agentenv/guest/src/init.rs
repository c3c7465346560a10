//! PID 1 inside the VM: mount the pseudo filesystems, set the hostname, run the agent as a
//! child (restarting it if it dies) and reap every orphan. Also the port side of the agent:
//! find the virtio-serial port by name and serve mux sessions on it, re-opening it on EOF.

use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use crate::Agent;

/// Name of the virtio-serial port the host talks to.
pub const PORT_NAME: &str = "agentenv.0";

/// Mounts proc, sys, devtmpfs, devpts, /dev/shm, /tmp and /run; already-mounted ones are kept.
pub fn mount_pseudo_filesystems() {
    let mounts: [(&str, &str, &str, libc::c_ulong, &str); 7] = [
        (
            "proc",
            "/proc",
            "proc",
            libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
            "",
        ),
        (
            "sysfs",
            "/sys",
            "sysfs",
            libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
            "",
        ),
        ("devtmpfs", "/dev", "devtmpfs", libc::MS_NOSUID, "mode=0755"),
        (
            "devpts",
            "/dev/pts",
            "devpts",
            libc::MS_NOSUID | libc::MS_NOEXEC,
            "gid=5,mode=620,ptmxmode=666",
        ),
        (
            "tmpfs",
            "/dev/shm",
            "tmpfs",
            libc::MS_NOSUID | libc::MS_NODEV,
            "mode=1777",
        ),
        (
            "tmpfs",
            "/tmp",
            "tmpfs",
            libc::MS_NOSUID | libc::MS_NODEV,
            "mode=1777",
        ),
        (
            "tmpfs",
            "/run",
            "tmpfs",
            libc::MS_NOSUID | libc::MS_NODEV,
            "mode=0755",
        ),
    ];
    for (src, target, fstype, flags, data) in mounts {
        let _ = std::fs::create_dir_all(target);
        if let Err(e) = mount(src, target, fstype, flags, data)
            && e.raw_os_error() != Some(libc::EBUSY)
        {
            eprintln!("agentenv-guest init: mount {target}: {e}");
        }
    }
    // /dev/ptmx must point at the devpts instance for openpty.
    if !Path::new("/dev/ptmx").exists() {
        let _ = std::os::unix::fs::symlink("pts/ptmx", "/dev/ptmx");
    }
}

fn mount(
    src: &str,
    target: &str,
    fstype: &str,
    flags: libc::c_ulong,
    data: &str,
) -> std::io::Result<()> {
    let c = |s: &str| {
        CString::new(s).map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))
    };
    let (src, target, fstype, data) = (c(src)?, c(target)?, c(fstype)?, c(data)?);
    // SAFETY: all pointers are valid NUL-terminated strings for the duration of the call.
    let rc = unsafe {
        libc::mount(
            src.as_ptr(),
            target.as_ptr(),
            fstype.as_ptr(),
            flags,
            data.as_ptr().cast(),
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Name, uid/gid and home of the sandbox's default account.
pub const DEFAULT_USER: (&str, u32, &str) = ("user", 1000, "/home/user");

/// Creates the default account (`user`, uid/gid 1000, home `/home/user`, bash) when the
/// rootfs lacks it, and its home directory.
pub fn ensure_default_user() -> std::io::Result<()> {
    use std::io::Write;
    let (name, id, home) = DEFAULT_USER;
    if crate::users::lookup(name).is_none() {
        let append = |file: &str, line: String| -> std::io::Result<()> {
            if !Path::new(file).exists() {
                return Ok(());
            }
            std::fs::OpenOptions::new()
                .append(true)
                .open(file)?
                .write_all(line.as_bytes())
        };
        append(
            "/etc/passwd",
            format!("{name}:x:{id}:{id}::{home}:/bin/bash\n"),
        )?;
        append("/etc/group", format!("{name}:x:{id}:\n"))?;
        append("/etc/shadow", format!("{name}:*:19000:0:99999:7:::\n"))?;
    }
    if !Path::new(home).exists() {
        std::fs::create_dir_all(home)?;
        std::os::unix::fs::chown(home, Some(id), Some(id))?;
    }
    Ok(())
}

/// Sets the hostname.
pub fn set_hostname(name: &str) -> std::io::Result<()> {
    // SAFETY: sethostname reads `len` bytes from a valid pointer.
    if unsafe { libc::sethostname(name.as_ptr().cast(), name.len()) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Runs `agent_cmd` as a child forever (restarting it when it exits) while reaping every
/// zombie. Never returns. Single-threaded: call before any runtime starts.
pub fn supervise(agent_cmd: &[String]) -> ! {
    let mut child: Option<u32> = None;
    loop {
        if child.is_none() {
            match std::process::Command::new(&agent_cmd[0])
                .args(&agent_cmd[1..])
                .spawn()
            {
                Ok(c) => child = Some(c.id()),
                Err(e) => {
                    eprintln!("agentenv-guest init: starting the agent failed: {e}");
                    std::thread::sleep(Duration::from_secs(1));
                    continue;
                }
            }
        }
        let mut status = 0;
        // SAFETY: waitpid writes the status into a valid int.
        let pid = unsafe { libc::waitpid(-1, &mut status, 0) };
        if pid > 0 && Some(pid as u32) == child {
            eprintln!("agentenv-guest init: agent exited (status {status}); restarting");
            child = None;
            std::thread::sleep(Duration::from_millis(200));
        } else if pid < 0 {
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// Finds the character device of the virtio-serial port `name`: `/dev/virtio-ports/<name>`
/// when udev made it, else by scanning `/sys/class/virtio-ports/*/name` (no udev in the VM).
pub fn find_port(name: &str) -> Option<PathBuf> {
    let by_link = Path::new("/dev/virtio-ports").join(name);
    if by_link.exists() {
        return Some(by_link);
    }
    let dir = std::fs::read_dir("/sys/class/virtio-ports").ok()?;
    for e in dir.flatten() {
        let n = std::fs::read_to_string(e.path().join("name")).unwrap_or_default();
        if n.trim() == name {
            let dev = Path::new("/dev").join(e.file_name());
            if dev.exists() {
                return Some(dev);
            }
        }
    }
    None
}

/// Serves mux sessions on the port forever: one HTTP/1.1 connection per accepted stream; on
/// EOF or a protocol error the port is re-opened and a fresh session waits for a HELLO.
pub async fn serve_port(agent: Arc<Agent>, port: &str) -> ! {
    loop {
        let path = if port.starts_with('/') {
            Some(PathBuf::from(port))
        } else {
            find_port(port)
        };
        let Some(path) = path else {
            tracing::warn!(port, "virtio port not found; retrying");
            tokio::time::sleep(Duration::from_millis(200)).await;
            continue;
        };
        let io = match crate::port::PortIo::open(&path) {
            Ok(io) => io,
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "opening the port failed; retrying");
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
        };
        let reason = serve_mux(agent.clone(), io).await;
        // EOF repeats while no host is connected: keep that quiet.
        tracing::debug!(%reason, "mux session ended; re-opening the port");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Runs one mux server session on `io`, serving HTTP on every stream; returns why it ended.
pub async fn serve_mux<IO>(agent: Arc<Agent>, io: IO) -> String
where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + 'static,
{
    let session = agentenv_mux::Session::server(io);
    while let Some(stream) = session.accept().await {
        let agent = agent.clone();
        tokio::spawn(async move {
            if let Err(e) = agent.serve_connection(stream).await {
                tracing::debug!(error = %e, "connection ended with an error");
            }
        });
    }
    session.closed().await
}
