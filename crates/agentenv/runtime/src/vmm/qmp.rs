//! A small async QMP (QEMU Machine Protocol) client over a unix socket, with file-descriptor passing.

use std::os::fd::{AsRawFd, RawFd};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Interest};
use tokio::net::UnixStream;

/// Errors of the QMP client.
#[derive(Debug, thiserror::Error)]
pub enum QmpError {
    /// The socket could not be reached before the deadline.
    #[error("QMP socket {path} not reachable: {source}")]
    Connect {
        path: PathBuf,
        source: std::io::Error,
    },
    /// Reading or writing the socket failed.
    #[error("QMP i/o on {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    /// QEMU closed the connection.
    #[error("QMP connection {path} closed by QEMU")]
    Closed { path: PathBuf },
    /// QEMU answered with an error object.
    #[error("QMP command {command} failed: {class}: {desc}")]
    Command {
        command: String,
        class: String,
        desc: String,
    },
    /// A line was not valid QMP JSON.
    #[error("QMP protocol error on {path}: {detail}")]
    Protocol { path: PathBuf, detail: String },
    /// QEMU did not answer (or a migration did not finish) within the deadline.
    #[error("QMP {command} on {path} missed its {secs:.0} s deadline")]
    Timeout {
        path: PathBuf,
        command: String,
        secs: f64,
    },
}

/// Longest wait for the answer to one QMP command: QEMU answers in milliseconds unless wedged.
pub const COMMAND_DEADLINE: Duration = Duration::from_secs(30);

/// One QMP connection in command mode (capabilities negotiated).
pub struct QmpClient {
    path: PathBuf,
    stream: BufReader<UnixStream>,
}

/// Longest QMP message read (QEMU's answers here are a few KiB).
const MAX_LINE: u64 = 1 << 20;

impl QmpClient {
    /// Connects to `path`, retrying until `timeout`, then negotiates capabilities.
    pub async fn connect(path: &Path, timeout: Duration) -> Result<QmpClient, QmpError> {
        let deadline = tokio::time::Instant::now() + timeout;
        let stream = loop {
            match UnixStream::connect(path).await {
                Ok(s) => break s,
                Err(e) if tokio::time::Instant::now() >= deadline => {
                    return Err(QmpError::Connect {
                        path: path.to_owned(),
                        source: e,
                    });
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(2)).await,
            }
        };
        let mut client = QmpClient {
            path: path.to_owned(),
            stream: BufReader::new(stream),
        };
        let greeting = client.read_message().await?;
        if greeting.get("QMP").is_none() {
            return Err(client.protocol(format!("expected greeting, got {greeting}")));
        }
        client.execute("qmp_capabilities", None).await?;
        Ok(client)
    }

    /// Runs `command` with optional `arguments` and returns its `return` value.
    pub async fn execute(
        &mut self,
        command: &str,
        arguments: Option<Value>,
    ) -> Result<Value, QmpError> {
        let line = Self::encode(command, arguments);
        let path = self.path.clone();
        let call = async {
            self.stream
                .get_mut()
                .write_all(line.as_bytes())
                .await
                .map_err(|e| self.io(e))?;
            self.read_return(command).await
        };
        tokio::time::timeout(COMMAND_DEADLINE, call)
            .await
            .map_err(|_| timeout(path, command, COMMAND_DEADLINE))?
    }

    /// Runs `command` while passing `fd` with SCM_RIGHTS (for `getfd`).
    pub async fn execute_with_fd(
        &mut self,
        command: &str,
        arguments: Option<Value>,
        fd: RawFd,
    ) -> Result<Value, QmpError> {
        let path = self.path.clone();
        tokio::time::timeout(
            COMMAND_DEADLINE,
            self.execute_with_fd_now(command, arguments, fd),
        )
        .await
        .map_err(|_| timeout(path, command, COMMAND_DEADLINE))?
    }

    async fn execute_with_fd_now(
        &mut self,
        command: &str,
        arguments: Option<Value>,
        fd: RawFd,
    ) -> Result<Value, QmpError> {
        let line = Self::encode(command, arguments);
        let sock = self.stream.get_ref();
        loop {
            sock.writable().await.map_err(|e| self.io(e))?;
            match sock.try_io(Interest::WRITABLE, || {
                send_with_fd(sock.as_raw_fd(), line.as_bytes(), fd)
            }) {
                Ok(n) if n == line.len() => break,
                Ok(n) => {
                    let rest = line.as_bytes()[n..].to_vec();
                    self.stream
                        .get_mut()
                        .write_all(&rest)
                        .await
                        .map_err(|e| self.io(e))?;
                    break;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(self.io(e)),
            }
        }
        self.read_return(command).await
    }

    /// Polls `query-migrate` until it leaves the active states or `deadline` passes (then the
    /// migration is cancelled); returns the final status.
    pub async fn wait_migration(&mut self, deadline: Duration) -> Result<String, QmpError> {
        let end = tokio::time::Instant::now() + deadline;
        loop {
            if tokio::time::Instant::now() >= end {
                let _ = self.execute("migrate_cancel", None).await;
                return Err(timeout(self.path.clone(), "migrate", deadline));
            }
            let r = self.execute("query-migrate", None).await?;
            let status = r
                .get("status")
                .and_then(Value::as_str)
                .unwrap_or("none")
                .to_owned();
            match status.as_str() {
                "completed" => return Ok(status),
                "failed" | "cancelled" => {
                    let desc = r
                        .get("error-desc")
                        .and_then(Value::as_str)
                        .unwrap_or("no detail");
                    return Err(QmpError::Command {
                        command: "migrate".into(),
                        class: status.clone(),
                        desc: desc.to_owned(),
                    });
                }
                _ => tokio::time::sleep(Duration::from_micros(300)).await,
            }
        }
    }

    /// Returns the run state from `query-status` (e.g. "running", "paused", "inmigrate").
    pub async fn run_state(&mut self) -> Result<String, QmpError> {
        let r = self.execute("query-status", None).await?;
        Ok(r.get("status")
            .and_then(Value::as_str)
            .unwrap_or("unknown")
            .to_owned())
    }

    fn encode(command: &str, arguments: Option<Value>) -> String {
        let mut msg = json!({ "execute": command });
        if let Some(a) = arguments {
            msg["arguments"] = a;
        }
        let mut line = msg.to_string();
        line.push('\n');
        line
    }

    async fn read_return(&mut self, command: &str) -> Result<Value, QmpError> {
        loop {
            let msg = self.read_message().await?;
            if let Some(r) = msg.get("return") {
                return Ok(r.clone());
            }
            if let Some(e) = msg.get("error") {
                let class = e
                    .get("class")
                    .and_then(Value::as_str)
                    .unwrap_or("?")
                    .to_owned();
                let desc = e
                    .get("desc")
                    .and_then(Value::as_str)
                    .unwrap_or("?")
                    .to_owned();
                return Err(QmpError::Command {
                    command: command.to_owned(),
                    class,
                    desc,
                });
            }
            // Events ({"event": ..}) are skipped.
        }
    }

    async fn read_message(&mut self) -> Result<Value, QmpError> {
        use tokio::io::AsyncReadExt;
        let mut line = String::new();
        let n = (&mut self.stream)
            .take(MAX_LINE)
            .read_line(&mut line)
            .await
            .map_err(|e| self.io(e))?;
        if n == 0 {
            return Err(QmpError::Closed {
                path: self.path.clone(),
            });
        }
        if !line.ends_with('\n') && n as u64 >= MAX_LINE {
            return Err(self.protocol(format!("a message longer than {MAX_LINE} bytes")));
        }
        serde_json::from_str(&line).map_err(|e| {
            let head: String = line.chars().take(200).collect();
            self.protocol(format!("{e}: {head}"))
        })
    }

    fn io(&self, source: std::io::Error) -> QmpError {
        QmpError::Io {
            path: self.path.clone(),
            source,
        }
    }

    fn protocol(&self, detail: String) -> QmpError {
        QmpError::Protocol {
            path: self.path.clone(),
            detail,
        }
    }
}

fn timeout(path: PathBuf, command: &str, limit: Duration) -> QmpError {
    QmpError::Timeout {
        path,
        command: command.to_owned(),
        secs: limit.as_secs_f64(),
    }
}

/// `sendmsg` of `data` with one SCM_RIGHTS file descriptor.
fn send_with_fd(sock: RawFd, data: &[u8], fd: RawFd) -> std::io::Result<usize> {
    let mut iov = libc::iovec {
        iov_base: data.as_ptr() as *mut libc::c_void,
        iov_len: data.len(),
    };
    // SAFETY: CMSG_SPACE is a pure size computation.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) } as usize;
    let mut cbuf = vec![0u8; space];
    // SAFETY: msghdr is plain data; every pointer set below outlives the sendmsg call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: msg_control points at `space` bytes, enough for one header carrying one fd.
    unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(cmsg).cast::<RawFd>(), fd);
    }
    // SAFETY: sock is a connected unix socket owned by the caller; msg is fully initialised.
    let n = unsafe { libc::sendmsg(sock, &msg, libc::MSG_NOSIGNAL) };
    if n < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    /// A QEMU that greets with an endless line: the client fails at the bound instead of growing.
    #[tokio::test]
    async fn an_endless_message_is_refused_at_the_bound() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("qmp.sock");
        let listener = tokio::net::UnixListener::bind(&path).unwrap();
        let server = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let chunk = vec![b'x'; 64 << 10];
            // Far past the bound, never a newline; stops when the client hangs up.
            for _ in 0..(4 * MAX_LINE as usize / chunk.len()) {
                if s.write_all(&chunk).await.is_err() {
                    break;
                }
            }
        });
        let e = QmpClient::connect(&path, Duration::from_secs(5))
            .await
            .err()
            .expect("an endless greeting is refused");
        assert!(
            matches!(&e, QmpError::Protocol { detail, .. } if detail.contains("longer than")),
            "{e}"
        );
        server.abort();
    }
}
