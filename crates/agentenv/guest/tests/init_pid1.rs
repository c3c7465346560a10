//! `agentenv-guest init` as PID 1 of fresh pid/mount/uts namespaces, reached through the mux
//! on a PTY (a character device, like the VM's virtio-serial port).

mod common;

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::Command;
use std::time::Duration;

use bytes::Bytes;
use common::{EnvelopeReader, bash, expect_start, send_on, token};
use http::StatusCode;
use http_body_util::Full;

struct Pid1(std::process::Child);

impl Drop for Pid1 {
    fn drop(&mut self) {
        // `unshare --kill-child` takes the namespace's PID 1 (and so every process in it) down.
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn skip_reason() -> Option<&'static str> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Some("needs root for pid/mount/uts namespaces");
    }
    let ok = Command::new("unshare")
        .args(["--pid", "--fork", "--mount", "--uts", "true"])
        .status();
    if !ok.is_ok_and(|s| s.success()) {
        return Some("unshare of pid/mount/uts namespaces is not permitted here");
    }
    None
}

fn raw_pty() -> (OwnedFd, OwnedFd) {
    let (mut m, mut s) = (-1, -1);
    // SAFETY: openpty writes two fds; the optional pointers are null.
    let rc = unsafe {
        libc::openpty(
            &mut m,
            &mut s,
            std::ptr::null_mut(),
            std::ptr::null(),
            std::ptr::null(),
        )
    };
    assert_eq!(rc, 0, "openpty");
    // SAFETY: openpty returned two open descriptors we now own.
    let (m, s) = unsafe { (OwnedFd::from_raw_fd(m), OwnedFd::from_raw_fd(s)) };
    // SAFETY: termios is plain data, filled by tcgetattr before use.
    unsafe {
        let mut t: libc::termios = std::mem::zeroed();
        assert_eq!(libc::tcgetattr(s.as_raw_fd(), &mut t), 0);
        libc::cfmakeraw(&mut t);
        assert_eq!(libc::tcsetattr(s.as_raw_fd(), libc::TCSANOW, &t), 0);
    }
    (m, s)
}

#[tokio::test]
async fn pid1_serves_envd_over_the_mux_and_reaps_orphans() {
    if let Some(why) = skip_reason() {
        k3_common::require::skip_part(
            k3_common::require::Part::Root,
            "pid1_serves_envd_over_the_mux_and_reaps_orphans",
            why,
        );
        return;
    }
    tokio::time::timeout(Duration::from_secs(180), pid1_session())
        .await
        .expect("the PID-1 agent did not answer within 180 s");
}

async fn pid1_session() {
    let (master, slave) = raw_pty();
    let hostname = format!("k3-{}", token());
    let slave_fd = slave.as_raw_fd();
    let mut cmd = Command::new("unshare");
    cmd.args([
        "--pid",
        "--fork",
        "--kill-child",
        "--mount",
        "--uts",
        "--propagation",
        "private",
    ])
    .arg(env!("CARGO_BIN_EXE_agentenv-guest"))
    .args([
        "init",
        "--port",
        "/proc/self/fd/3",
        "--hostname",
        &hostname,
        "--default-user",
        "root",
    ])
    .env("RUST_LOG", "warn");
    // SAFETY: dup2 is async-signal-safe; fd 3 becomes the PTY slave (without CLOEXEC).
    unsafe {
        cmd.pre_exec(move || {
            if libc::dup2(slave_fd, 3) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let _pid1 = Pid1(cmd.spawn().expect("spawning unshare"));
    drop(slave);

    let port = agentenv_guest::port::PortIo::from_fd(master).unwrap();
    let session = agentenv_mux::Session::client(port);
    let get = |path: &'static str| {
        http::Request::get(path)
            .body(Full::new(Bytes::new()))
            .unwrap()
    };
    let resp = send_on(session.open().await.unwrap(), get("/health")).await;
    assert_eq!(resp.status(), StatusCode::NO_CONTENT);

    let run = |script: String| {
        let body = common::envelope(0, &bash(&script));
        http::Request::post("/process.Process/Start")
            .header("content-type", "application/connect+json")
            .body(Full::new(body))
            .unwrap()
    };
    let resp = send_on(
        session.open().await.unwrap(),
        run("hostname; cat /proc/1/comm".into()),
    )
    .await;
    let mut r = EnvelopeReader::new(resp.into_body());
    expect_start(&mut r).await;
    let out = String::from_utf8(r.collect_process().await.stdout).unwrap();
    assert_eq!(out, format!("{hostname}\nagentenv-guest\n"));

    // An orphan is re-parented to PID 1 and must be reaped there (no zombie stays).
    let resp = send_on(
        session.open().await.unwrap(),
        run("(sleep 0.2 &) ; echo $$".into()),
    )
    .await;
    let mut r = EnvelopeReader::new(resp.into_body());
    expect_start(&mut r).await;
    r.collect_process().await;
    let zombies = "cat /proc/[0-9]*/stat 2>/dev/null | awk '$3 == \"Z\"' | wc -l; cat /proc/[0-9]*/comm 2>/dev/null | grep -cx sleep || true";
    let mut last = String::new();
    for _ in 0..100 {
        let resp = send_on(session.open().await.unwrap(), run(zombies.into())).await;
        let mut r = EnvelopeReader::new(resp.into_body());
        expect_start(&mut r).await;
        last = String::from_utf8(r.collect_process().await.stdout).unwrap();
        if last == "0\n0\n" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(last, "0\n0\n", "zombie or orphan left behind");
}
