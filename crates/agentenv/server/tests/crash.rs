//! Crash consistency: the real server process is SIGKILLed at each step of create, pause, resume,
//! snapshot, fork and kill (crash points, `K3_CRASH_AT`, debug builds), then restarted; a QEMU is
//! SIGKILLed mid-pause, mid-snapshot and after a fork's capture (`K3_KILL_VM_AT`). Afterwards
//! every sandbox is running and answers commands, or paused, or gone; no QEMU is left that no running
//! sandbox owns; nothing half-written is listed; and a snapshot taken before all this still restores.

mod common;

use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::Api;
use hyper::{Method, StatusCode};
use serde_json::{Value, json};

struct Server {
    child: Child,
    api: Api,
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Starts `agentenv serve` on `dir`, dying at `crash_at` when it is given.
async fn start(dir: &Path, crash_at: Option<&str>) -> Server {
    start_with(dir, crash_at, None).await
}

/// [`start`], killing the VM at `kill_vm_at` (`K3_KILL_VM_AT`) when it is given.
async fn start_with(dir: &Path, crash_at: Option<&str>, kill_vm_at: Option<&str>) -> Server {
    let port = free_port();
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("server.log"))
        .unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_agentenv"));
    cmd.args(["serve", "--listen", &format!("127.0.0.1:{port}")])
        .arg("--state-dir")
        .arg(dir)
        .args([
            "--accel",
            &std::env::var("AGENTENV_ACCEL").unwrap_or_else(|_| "auto".into()),
        ])
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .stdin(Stdio::null());
    match crash_at {
        Some(p) => cmd.env(k3_common::crash::CRASH_AT, p),
        None => cmd.env_remove(k3_common::crash::CRASH_AT),
    };
    match kill_vm_at {
        Some(p) => cmd.env(k3_common::crash::KILL_VM_AT, p),
        None => cmd.env_remove(k3_common::crash::KILL_VM_AT),
    };
    let mut child = cmd.spawn().expect("spawning agentenv");
    let base = format!("http://127.0.0.1:{port}");
    let deadline = Instant::now() + Duration::from_secs(900);
    loop {
        assert!(
            child.try_wait().unwrap().is_none(),
            "agentenv exited early:\n{}",
            log_tail(dir)
        );
        let probe = Api::new(base.clone(), String::new());
        if let Ok(r) = probe.try_call(Method::GET, "/health", None).await
            && r.status == StatusCode::NO_CONTENT
        {
            break;
        }
        assert!(Instant::now() < deadline, "not ready:\n{}", log_tail(dir));
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let key = std::fs::read_to_string(dir.join("server/api_key")).unwrap();
    Server {
        child,
        api: Api::new(base, key.trim().to_string()),
    }
}

fn log_tail(dir: &Path) -> String {
    let text = std::fs::read_to_string(dir.join("server.log")).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(40)..].join("\n")
}

impl Server {
    /// The request that reaches the crash point: the server must die without answering.
    async fn crash_on(mut self, method: Method, path: &str, body: Option<Value>, point: &str) {
        let r = self.api.try_call(method, path, body).await;
        let status = tokio::task::spawn_blocking(move || self.child.wait().unwrap())
            .await
            .unwrap();
        assert_eq!(
            status.signal(),
            Some(libc::SIGKILL),
            "{point}: {:?}",
            r.as_ref().map(|r| r.status)
        );
        assert!(r.is_err(), "{point}: answered {:?}", r.map(|r| r.status));
    }

    fn stop(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// A graceful stop (SIGTERM): the server closes its runtime, so warm VMs and kept paused QEMUs
    /// exit; sandboxes keep running.
    async fn close(mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        for _ in 0..300 {
            if self.child.try_wait().ok().flatten().is_some() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("the server did not stop within 30 s of SIGTERM");
    }
}

/// Checks the invariants after a restart; returns the sandboxes by state.
async fn check_consistent(api: &Api, dir: &Path, point: &str) -> (Vec<Value>, Vec<Value>) {
    let list = api.call(Method::GET, "/v2/sandboxes", None).await.json();
    let list = list.as_array().cloned().unwrap_or_default();
    let (running, paused): (Vec<Value>, Vec<Value>) =
        list.into_iter().partition(|s| s["state"] == "running");
    for s in &running {
        let id = s["sandboxID"].as_str().unwrap();
        let token = api
            .call(Method::GET, &format!("/sandboxes/{id}"), None)
            .await
            .json()["envdAccessToken"]
            .as_str()
            .unwrap()
            .to_string();
        let (out, code) = api.run(id, &token, "echo ok").await.unwrap_or_else(|e| {
            panic!(
                "{point}: running sandbox {id} does not answer: {e}\n{}",
                log_tail(dir)
            )
        });
        assert_eq!((out.as_str(), code), ("ok\n", 0), "{point}: {id}");
    }
    for s in &paused {
        assert_eq!(s["state"], "paused", "{point}: {s}");
    }
    // One QEMU per running sandbox, none for paused or gone ones (orphans are SIGKILLed at start).
    let mut qemus = common::sandbox_qemu_pids_under(dir);
    for _ in 0..50 {
        if qemus.len() == running.len() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        qemus = common::sandbox_qemu_pids_under(dir);
    }
    assert_eq!(
        qemus.len(),
        running.len(),
        "{point}: QEMU pids {qemus:?} for running {running:?}"
    );
    // Nothing half-written is listed: only the snapshot names this test gave and finished.
    let snaps = api.call(Method::GET, "/snapshots", None).await.json();
    for s in snaps.as_array().unwrap() {
        let names: Vec<&str> = s["names"]
            .as_array()
            .map(|a| a.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        assert!(
            names.iter().all(|n| n.starts_with("keep")),
            "{point}: listed {s}"
        );
    }
    (running, paused)
}

/// A crash point, the request that reaches it, and the state of the sandbox after the restart.
type Step = (
    &'static str,
    Method,
    String,
    Option<Value>,
    Option<&'static str>,
);

fn sandbox_path(id: &str, op: &str) -> String {
    format!("/sandboxes/{id}/{op}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_at_every_step_leaves_a_consistent_state() {
    let Some(dir) = debug_build_state_dir("crash points") else {
        return;
    };
    let dir = dir.path();
    let s = start(dir, None).await;
    let (a, secret) = sandbox_with_keep_snapshot(&s.api).await;
    s.stop();

    // (crash point, request, what sandbox A is afterwards: running, paused, or gone)
    let steps: Vec<Step> = vec![
        (
            "server:create:after-vm",
            Method::POST,
            "/v2/sandboxes".into(),
            Some(json!({"templateID": "base"})),
            Some("running"),
        ),
        (
            "server:pause:after-vm",
            Method::POST,
            sandbox_path(&a, "pause"),
            None,
            Some("paused"),
        ),
        (
            "server:resume:after-vm",
            Method::POST,
            sandbox_path(&a, "connect"),
            Some(json!({"timeout": 300})),
            Some("running"),
        ),
        (
            "runtime:pause:after-save",
            Method::POST,
            sandbox_path(&a, "pause"),
            None,
            Some("running"),
        ),
        (
            "runtime:pause:before-record",
            Method::POST,
            sandbox_path(&a, "pause"),
            None,
            Some("running"),
        ),
        (
            "runtime:snapshot:during-capture",
            Method::POST,
            sandbox_path(&a, "snapshots"),
            Some(json!({"name": "half1"})),
            Some("running"),
        ),
        (
            "runtime:snapshot:before-rename",
            Method::POST,
            sandbox_path(&a, "snapshots"),
            Some(json!({"name": "half2"})),
            Some("running"),
        ),
        (
            "runtime:fork:after-capture",
            Method::POST,
            sandbox_path(&a, "fork"),
            Some(json!({"count": 2})),
            Some("running"),
        ),
        (
            "server:kill:after-vm",
            Method::DELETE,
            format!("/sandboxes/{a}"),
            None,
            None,
        ),
    ];
    for (point, method, path, body, after) in steps {
        let s = start(dir, Some(point)).await;
        if point == "server:resume:after-vm" {
            let r = s
                .api
                .call(Method::POST, &sandbox_path(&a, "pause"), None)
                .await;
            assert_eq!(
                r.status,
                StatusCode::NO_CONTENT,
                "{point}: pause {:?}",
                r.json()
            );
        }
        s.crash_on(method, &path, body, point).await;
        let s = start(dir, None).await;
        let (running, paused) = check_consistent(&s.api, dir, point).await;
        let state_of_a = running
            .iter()
            .map(|v| (v, "running"))
            .chain(paused.iter().map(|v| (v, "paused")))
            .find(|(v, _)| v["sandboxID"] == a.as_str())
            .map(|(_, st)| st);
        assert_eq!(state_of_a, after, "{point}: sandbox {a}\n{}", log_tail(dir));
        // A sandbox the crashed create left behind is gone (it never got a record).
        assert_eq!(
            running.len() + paused.len(),
            usize::from(after.is_some()),
            "{point}: {running:?} {paused:?}"
        );
        if after == Some("paused") {
            let r = resume(&s.api, &a).await;
            assert_eq!(
                r.status,
                StatusCode::CREATED,
                "{point}: resume {:?}",
                r.json()
            );
        }
        s.stop();
    }

    // The snapshot taken before every crash still restores, with the file written before it.
    let s = start(dir, None).await;
    let (id, token) = create(&s.api, "keep").await;
    let (out, _) = s.api.run(&id, &token, "cat /home/user/keep").await.unwrap();
    assert_eq!(out.trim(), secret);
    s.api
        .call(Method::DELETE, &format!("/sandboxes/{id}"), None)
        .await;
    s.close().await;
    assert!(
        common::qemu_pids_under(dir).is_empty(),
        "QEMU left after the test"
    );
}

/// `POST /sandboxes/{id}/connect`: resumes a paused sandbox.
async fn resume(api: &Api, id: &str) -> common::Resp {
    api.call(
        Method::POST,
        &sandbox_path(id, "connect"),
        Some(json!({"timeout": 300})),
    )
    .await
}

/// `GET /sandboxes/{id}`'s status once it is `want`, or the last one after 5 s.
async fn status_within_5s(api: &Api, id: &str, want: StatusCode) -> StatusCode {
    let mut status = api
        .call(Method::GET, &format!("/sandboxes/{id}"), None)
        .await
        .status;
    for _ in 0..50 {
        if status == want {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        status = api
            .call(Method::GET, &format!("/sandboxes/{id}"), None)
            .await
            .status;
    }
    status
}

/// Creates a sandbox from `template`; returns its id and access token.
async fn create(api: &Api, template: &str) -> (String, String) {
    let r = api
        .call(
            Method::POST,
            "/v2/sandboxes",
            Some(json!({"templateID": template})),
        )
        .await;
    assert_eq!(r.status, StatusCode::CREATED, "{:?}", r.json());
    let v = r.json();
    (
        v["sandboxID"].as_str().unwrap().to_string(),
        v["envdAccessToken"].as_str().unwrap().to_string(),
    )
}

/// A sandbox from the template with a secret in `/home/user/keep`, snapshotted as `keep`; returns its id
/// and the secret.
async fn sandbox_with_keep_snapshot(api: &Api) -> (String, String) {
    let (a, token) = create(api, "base").await;
    let secret = format!("{:x}", rand::random::<u64>());
    api.run(
        &a,
        &token,
        &format!("echo {secret} > /home/user/keep; sync"),
    )
    .await
    .unwrap();
    let keep = api
        .call(
            Method::POST,
            &sandbox_path(&a, "snapshots"),
            Some(json!({"name": "keep"})),
        )
        .await;
    assert_eq!(keep.status, StatusCode::CREATED, "{:?}", keep.json());
    (a, secret)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qemu_kill_9_mid_snapshot_and_fork_leaves_a_consistent_state() {
    let Some(dir) = debug_build_state_dir("VM kill points") else {
        return;
    };
    let dir = dir.path();
    let s = start(dir, None).await;
    let (a, secret) = sandbox_with_keep_snapshot(&s.api).await;
    s.stop();

    // QEMU dies while its snapshot is captured: the snapshot fails, nothing of it is listed, the
    // sandbox is gone (never listed running without a VM), and no QEMU is left.
    let s = start_with(dir, None, Some("runtime:snapshot:during-capture")).await;
    let r = s
        .api
        .call(
            Method::POST,
            &sandbox_path(&a, "snapshots"),
            Some(json!({"name": "half"})),
        )
        .await;
    assert!(r.status.is_server_error(), "{:?}", r.json());
    assert!(r.json()["message"].as_str().is_some_and(|m| !m.is_empty()));
    let gone = s
        .api
        .call(Method::GET, &format!("/sandboxes/{a}"), None)
        .await;
    assert_eq!(gone.status, StatusCode::NOT_FOUND, "{:?}", gone.json());
    check_consistent(&s.api, dir, "QEMU killed mid-snapshot").await;

    // QEMU of the source dies right after a fork's capture: the forks run from the capture; the
    // source is gone.
    s.stop();
    let s = start_with(dir, None, Some("runtime:fork:after-capture")).await;
    let (b, token_b) = create(&s.api, "keep").await;
    let (out, _) = s
        .api
        .run(&b, &token_b, "cat /home/user/keep")
        .await
        .unwrap();
    assert_eq!(out.trim(), secret);
    let r = s
        .api
        .call(
            Method::POST,
            &sandbox_path(&b, "fork"),
            Some(json!({"count": 2})),
        )
        .await;
    assert_eq!(r.status, StatusCode::CREATED, "{:?}", r.json());
    let forks: Vec<Value> = r.json().as_array().cloned().unwrap();
    assert_eq!(forks.len(), 2);
    for f in &forks {
        let sb = &f["sandbox"];
        let (id, tok) = (
            sb["sandboxID"].as_str().unwrap(),
            sb["envdAccessToken"].as_str().unwrap(),
        );
        let (out, _) = s.api.run(id, tok, "cat /home/user/keep").await.unwrap();
        assert_eq!(out.trim(), secret, "fork {id}");
    }
    // The reaper notices the dead source within a few ticks.
    assert_eq!(
        status_within_5s(&s.api, &b, StatusCode::NOT_FOUND).await,
        StatusCode::NOT_FOUND,
        "the killed source is gone"
    );
    let (running, _) = check_consistent(&s.api, dir, "QEMU killed after a fork's capture").await;
    assert_eq!(running.len(), 2, "{running:?}");

    // After a restart the same holds, and the first snapshot still restores.
    s.stop();
    let s = start(dir, None).await;
    let (running, _) = check_consistent(&s.api, dir, "restart").await;
    for r in &running {
        let id = r["sandboxID"].as_str().unwrap();
        s.api
            .call(Method::DELETE, &format!("/sandboxes/{id}"), None)
            .await;
    }
    let (c, token_c) = create(&s.api, "keep").await;
    let (out, _) = s
        .api
        .run(&c, &token_c, "cat /home/user/keep")
        .await
        .unwrap();
    assert_eq!(out.trim(), secret);
    s.api
        .call(Method::DELETE, &format!("/sandboxes/{c}"), None)
        .await;
    s.close().await;
    assert!(
        common::qemu_pids_under(dir).is_empty(),
        "QEMU left after the test"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qemu_kill_9_mid_pause_leaves_a_consistent_state() {
    let Some(dir) = debug_build_state_dir("VM kill points") else {
        return;
    };
    let dir = dir.path();
    // QEMU dies once the device state is saved: the pause commits (the RAM file and the state are the
    // paused sandbox), and the resume restores them, memory included.
    let s = start_with(dir, None, Some("runtime:pause:after-save")).await;
    let (a, token) = create(&s.api, "base").await;
    let secret = format!("{:x}", rand::random::<u64>());
    let (_, code) = s
        .api
        .run(&a, &token, &format!("echo {secret} > /dev/shm/mem"))
        .await
        .unwrap();
    assert_eq!(code, 0);
    let r = s
        .api
        .call(Method::POST, &sandbox_path(&a, "pause"), None)
        .await;
    assert!(r.status.is_success(), "{:?}", r.json());
    let (_, paused) = check_consistent(&s.api, dir, "QEMU killed after its state was saved").await;
    assert_eq!(paused.len(), 1, "{paused:?}");
    let r = resume(&s.api, &a).await;
    assert!(r.status.is_success(), "{:?}", r.json());
    let (out, _) = s.api.run(&a, &token, "cat /dev/shm/mem").await.unwrap();
    assert_eq!(out.trim(), secret, "memory after the resume");

    // QEMU dies right after it stopped: the pause fails with a message, and the sandbox is soon gone.
    s.stop();
    let s = start_with(dir, None, Some("runtime:pause:after-stop")).await;
    let (b, _) = create(&s.api, "base").await;
    let r = s
        .api
        .call(Method::POST, &sandbox_path(&b, "pause"), None)
        .await;
    assert!(r.status.is_server_error(), "{:?}", r.json());
    assert!(r.json()["message"].as_str().is_some_and(|m| !m.is_empty()));
    assert_eq!(
        status_within_5s(&s.api, &b, StatusCode::NOT_FOUND).await,
        StatusCode::NOT_FOUND,
        "the killed sandbox is gone"
    );
    let (running, _) = check_consistent(&s.api, dir, "QEMU killed mid-pause").await;
    assert_eq!(running.len(), 1, "{running:?}");
    s.api
        .call(Method::DELETE, &format!("/sandboxes/{a}"), None)
        .await;
    s.close().await;
    assert!(
        common::qemu_pids_under(dir).is_empty(),
        "QEMU left after the test"
    );
}

/// A kill -9 of the server while it builds a template leaves that build's QEMU running in the cache's
/// `.partial` folder; the next start kills it and removes the folder.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_during_a_template_build_leaves_no_qemu() {
    let Some(dir) = debug_build_state_dir("crash points") else {
        return;
    };
    let dir = dir.path();
    let point = "runtime:template:after-boot";
    // The default template first (its build passes the same point).
    start(dir, None).await.stop();
    let s = start(dir, Some(point)).await;
    // Its own size: a key no other test builds at the same time.
    let mem = 202 + 2 * (rand::random::<u32>() % 26);
    let body = json!({"templateID": format!("crashy-{mem}"), "memoryMB": mem});
    s.crash_on(Method::POST, "/templates", Some(body), point)
        .await;
    let cache = k3_common::fsutil::cache_dir().join("agentenv/templates");
    let orphans = || {
        common::qemu_pids_under(&cache)
            .into_iter()
            .filter(|pid| {
                std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| {
                    let c = String::from_utf8_lossy(&c);
                    c.contains(".partial/") && c.contains(&format!("{mem}M"))
                })
            })
            .count()
    };
    assert!(
        orphans() >= 1,
        "the crashed build's QEMU should outlive its server"
    );
    let s = start(dir, None).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while orphans() > 0 {
        assert!(
            Instant::now() < deadline,
            "the build's QEMU outlived the next start"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    s.close().await;
}

/// A state folder with the guest binary built, or `None` (said) in a release build, where the
/// crash points (`what`) do not exist.
fn debug_build_state_dir(what: &str) -> Option<tempfile::TempDir> {
    if !cfg!(debug_assertions) {
        eprintln!("skipped: {what} exist in debug builds only");
        return None;
    }
    common::ensure_guest_binary();
    Some(common::state_dir())
}
