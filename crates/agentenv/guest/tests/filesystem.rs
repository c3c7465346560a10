//! filesystem.Filesystem over HTTP against the real `agentenv-guest serve`.

mod common;

use std::time::Duration;

use common::{Guest, token};
use http::StatusCode;
use serde_json::{Value, json};

#[tokio::test]
async fn stat_list_mkdir_move_remove() {
    let g = Guest::start(&[]).await;
    let root = g.dir.path().join(token());
    let content = common::random_bytes(rand::random_range(1..5000));
    let nested = root.join("a/b");
    let (st, v) = g
        .unary("/filesystem.Filesystem/MakeDir", json!({"path": nested}))
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["entry"]["type"], "FILE_TYPE_DIRECTORY");
    assert_eq!(v["entry"]["path"], nested.display().to_string());
    let (st, v) = g
        .unary("/filesystem.Filesystem/MakeDir", json!({"path": nested}))
        .await;
    assert_eq!(st, StatusCode::CONFLICT);
    assert_eq!(v["code"], "already_exists");

    let file = root.join("a/f.bin");
    std::fs::write(&file, &content).unwrap();
    std::os::unix::fs::symlink(&file, root.join("link")).unwrap();
    let (st, v) = g
        .unary("/filesystem.Filesystem/Stat", json!({"path": file}))
        .await;
    assert_eq!(st, StatusCode::OK);
    let e = &v["entry"];
    assert_eq!(e["name"], "f.bin");
    assert_eq!(e["type"], "FILE_TYPE_FILE");
    assert_eq!(e["size"], content.len().to_string());
    assert_eq!(e["permissions"].as_str().unwrap().len(), 10);
    assert!(e["modifiedTime"].as_str().unwrap().ends_with('Z'));
    assert_eq!(e["owner"], k3_owner());

    let (_, v) = g
        .unary(
            "/filesystem.Filesystem/Stat",
            json!({"path": root.join("link")}),
        )
        .await;
    assert_eq!(v["entry"]["isSymlink"], true);
    assert_eq!(
        v["entry"]["symlinkTarget"],
        std::fs::canonicalize(&file).unwrap().display().to_string()
    );

    let (_, v) = g
        .unary(
            "/filesystem.Filesystem/ListDir",
            json!({"path": root, "depth": 1}),
        )
        .await;
    assert_eq!(names(&v), vec!["a", "link"]);
    let (_, v) = g
        .unary(
            "/filesystem.Filesystem/ListDir",
            json!({"path": root, "depth": 3}),
        )
        .await;
    assert_eq!(names(&v), vec!["a", "b", "f.bin", "link"]);
    let (st, v) = g
        .unary("/filesystem.Filesystem/ListDir", json!({"path": file}))
        .await;
    assert_eq!(st, StatusCode::BAD_REQUEST);
    assert_eq!(v["code"], "invalid_argument");

    let dest = root.join("moved/g.bin");
    let (st, v) = g
        .unary(
            "/filesystem.Filesystem/Move",
            json!({"source": file, "destination": dest}),
        )
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["entry"]["path"], dest.display().to_string());
    assert_eq!(std::fs::read(&dest).unwrap(), content);
    assert!(!file.exists());

    let (st, _) = g
        .unary("/filesystem.Filesystem/Remove", json!({"path": root}))
        .await;
    assert_eq!(st, StatusCode::OK);
    assert!(!root.exists());
    let (st, v) = g
        .unary("/filesystem.Filesystem/Stat", json!({"path": root}))
        .await;
    assert_eq!(st, StatusCode::NOT_FOUND);
    assert_eq!(v["code"], "not_found");
    // Removing what is not there succeeds, as in E2B (its SDK suite's `test_remove_non_existing_file`).
    let (st, _) = g
        .unary("/filesystem.Filesystem/Remove", json!({"path": root}))
        .await;
    assert_eq!(st, StatusCode::OK);
}

fn k3_owner() -> String {
    // SAFETY: geteuid has no preconditions.
    agentenv_guest::users::user_name(unsafe { libc::geteuid() })
}

fn names(v: &Value) -> Vec<String> {
    let mut n: Vec<String> = v["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["name"].as_str().unwrap().to_string())
        .collect();
    n.sort();
    n
}

#[tokio::test]
async fn relative_paths_resolve_to_home() {
    let g = Guest::start(&[]).await;
    let (st, v) = g
        .unary("/filesystem.Filesystem/Stat", json!({"path": ""}))
        .await;
    assert_eq!(st, StatusCode::OK);
    let home = agentenv_guest::users::current().home;
    assert_eq!(v["entry"]["path"], home.display().to_string());
    assert_eq!(v["entry"]["type"], "FILE_TYPE_DIRECTORY");
}

/// A FUSE mount (`bindfs`) of a temporary folder, unmounted on drop.
struct FuseMount {
    _src: tempfile::TempDir,
    at: tempfile::TempDir,
}

impl FuseMount {
    /// `None` (after the skip is recorded) where bindfs or root is missing.
    fn new(test: &str) -> Option<FuseMount> {
        use k3_common::require::{Part, skip_part};
        let (src, at) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let out = std::process::Command::new("bindfs")
            .arg(src.path())
            .arg(at.path())
            .output();
        match out {
            Ok(o) if o.status.success() => Some(FuseMount { _src: src, at }),
            Ok(o) => {
                let why = String::from_utf8_lossy(&o.stderr).trim().to_string();
                skip_part(Part::Root, test, format!("bindfs (FUSE) failed: {why}"));
                None
            }
            Err(e) => {
                skip_part(
                    Part::Root,
                    test,
                    format!("no bindfs ({e}); ci/setup.sh installs it"),
                );
                None
            }
        }
    }
}

impl Drop for FuseMount {
    fn drop(&mut self) {
        let _ = std::process::Command::new("fusermount")
            .arg("-u")
            .arg(self.at.path())
            .status();
    }
}

#[tokio::test]
async fn a_watch_on_a_network_mount_needs_allow_network_mounts() {
    let Some(mount) = FuseMount::new("a_watch_on_a_network_mount_needs_allow_network_mounts")
    else {
        return;
    };
    let g = Guest::start(&[]).await;
    let dir = mount.at.path().to_path_buf();
    // Refused by default, streamed or polled, with a message that names the flag.
    let err = g
        .stream_error("/filesystem.Filesystem/WatchDir", json!({"path": dir}))
        .await;
    assert_eq!(err["code"], "failed_precondition", "{err}");
    let (st, v) = g
        .unary(
            "/filesystem.Filesystem/CreateWatcher",
            json!({"path": dir, "recursive": true}),
        )
        .await;
    assert_eq!(st, StatusCode::BAD_REQUEST, "{v}");
    assert_eq!(v["code"], "failed_precondition", "{v}");
    let msg = v["message"].as_str().unwrap();
    assert!(
        msg.contains("fuse") && msg.contains("allowNetworkMounts"),
        "{msg}"
    );
    // Allowed: events of changes made through the mount arrive.
    let mut s = g
        .stream(
            "/filesystem.Filesystem/WatchDir",
            json!({"path": dir, "allowNetworkMounts": true}),
            &[],
        )
        .await;
    assert_eq!(s.message().await, json!({"start": {}}));
    let name = format!("{}.txt", token());
    std::fs::write(dir.join(&name), b"x").unwrap();
    let m = s.message().await;
    assert_eq!(m["filesystem"]["name"], name.as_str(), "{m}");
    // A local folder needs no flag.
    let (st, v) = g
        .unary(
            "/filesystem.Filesystem/CreateWatcher",
            json!({"path": g.dir.path()}),
        )
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
}

#[tokio::test]
async fn watch_dir_streams_events() {
    let g = Guest::start(&[]).await;
    let dir = g.dir.path().join(token());
    std::fs::create_dir(&dir).unwrap();
    let mut s = g
        .stream(
            "/filesystem.Filesystem/WatchDir",
            json!({"path": dir, "includeEntry": true}),
            &[],
        )
        .await;
    assert_eq!(s.message().await, json!({"start": {}}));
    let name = format!("{}.txt", token());
    std::fs::write(dir.join(&name), b"x").unwrap();
    // The entry is attached while the file exists.
    let m = s.message().await;
    assert_eq!(m["filesystem"]["name"], name.as_str());
    assert_eq!(m["filesystem"]["type"], "EVENT_TYPE_CREATE");
    assert_eq!(
        m["filesystem"]["entry"]["path"],
        dir.join(&name).display().to_string()
    );
    std::fs::remove_file(dir.join(&name)).unwrap();
    let mut seen = Vec::new();
    while !seen.contains(&"EVENT_TYPE_REMOVE".to_string()) {
        let m = s.message().await;
        let ev = &m["filesystem"];
        assert_eq!(ev["name"], name.as_str());
        seen.push(ev["type"].as_str().unwrap().to_string());
    }
    assert!(seen.contains(&"EVENT_TYPE_WRITE".to_string()), "{seen:?}");

    // As connect-go ends a failed stream; connect-es (E2B's JS SDK) then raises FileNotFoundError.
    let err = g
        .stream_error(
            "/filesystem.Filesystem/WatchDir",
            json!({"path": dir.join("missing")}),
        )
        .await;
    assert_eq!(err["code"], "not_found", "{err}");
}

/// A change made before GetWatcherEvents is in its answer: E2B's suite writes and polls at once
/// (test_watch_directory_changes_with_entry_info). Run with the guest on one CPU
/// (`taskset -c 0 cargo test`) this catches an event held up behind the poll's own handler.
#[tokio::test]
async fn a_polled_watcher_has_a_change_made_before_the_poll() {
    let g = Guest::start(&[]).await;
    let dir = g.dir.path().join(token());
    std::fs::create_dir(&dir).unwrap();
    let (st, v) = g
        .unary(
            "/filesystem.Filesystem/CreateWatcher",
            json!({"path": dir, "includeEntry": true}),
        )
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    let id = v["watcherId"].as_str().unwrap().to_string();
    for i in 0..100 {
        let name = format!("{i}.txt");
        std::fs::write(dir.join(&name), b"x").unwrap();
        let (st, v) = g
            .unary(
                "/filesystem.Filesystem/GetWatcherEvents",
                json!({"watcherId": id}),
            )
            .await;
        assert_eq!(st, StatusCode::OK, "{v}");
        let events = v["events"].as_array().cloned().unwrap_or_default();
        assert!(
            events
                .iter()
                .any(|e| e["name"] == name.as_str() && e["type"] == "EVENT_TYPE_WRITE"),
            "write {i}: {events:?}"
        );
    }
}

#[tokio::test]
async fn polled_watcher_collects_events() {
    let g = Guest::start(&[]).await;
    let dir = g.dir.path().join(token());
    std::fs::create_dir_all(dir.join("sub")).unwrap();
    let (st, v) = g
        .unary(
            "/filesystem.Filesystem/CreateWatcher",
            json!({"path": dir, "recursive": true}),
        )
        .await;
    assert_eq!(st, StatusCode::OK);
    let id = v["watcherId"].as_str().unwrap().to_string();
    let name = format!("sub/{}", token());
    std::fs::write(dir.join(&name), b"y").unwrap();
    let mut events = Vec::new();
    for _ in 0..200 {
        let (st, v) = g
            .unary(
                "/filesystem.Filesystem/GetWatcherEvents",
                json!({"watcherId": id}),
            )
            .await;
        assert_eq!(st, StatusCode::OK);
        events.extend(v["events"].as_array().cloned().unwrap_or_default());
        if events
            .iter()
            .any(|e| e["name"] == name.as_str() && e["type"] == "EVENT_TYPE_CREATE")
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(
        events
            .iter()
            .any(|e| e["name"] == name.as_str() && e["type"] == "EVENT_TYPE_CREATE"),
        "{events:?}"
    );
    let (st, _) = g
        .unary(
            "/filesystem.Filesystem/RemoveWatcher",
            json!({"watcher_id": id}),
        )
        .await;
    assert_eq!(st, StatusCode::OK);
    let (st, v) = g
        .unary(
            "/filesystem.Filesystem/GetWatcherEvents",
            json!({"watcherId": id}),
        )
        .await;
    assert_eq!(st, StatusCode::NOT_FOUND);
    assert_eq!(v["code"], "not_found");
}

#[tokio::test]
async fn connect_calls_check_their_content_type() {
    use bytes::Bytes;
    use http::Request;
    use http_body_util::{BodyExt, Full};
    let g = Guest::start(&[]).await;
    let dir = g.dir.path().display().to_string();
    let unary = json!({"path": dir}).to_string();
    let cases: [(&str, &str, Bytes); 4] = [
        (
            "/filesystem.Filesystem/Stat",
            "text/plain",
            Bytes::from(unary.clone()),
        ),
        // The streaming envelope on a unary method.
        (
            "/filesystem.Filesystem/Stat",
            "application/connect+json",
            common::envelope(0, &json!({"path": dir})),
        ),
        (
            "/process.Process/List",
            "application/proto",
            Bytes::from_static(b"\x0a\x00"),
        ),
        // A unary content type on a streaming method.
        (
            "/process.Process/Start",
            "application/json",
            Bytes::from(json!({"process": {"cmd": "true"}}).to_string()),
        ),
    ];
    for (path, ctype, body) in cases {
        let req = Request::post(path)
            .header("content-type", ctype)
            .body(Full::new(body))
            .unwrap();
        let resp = g.send(req).await;
        assert_eq!(
            resp.status(),
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "{path} {ctype}"
        );
        assert!(resp.headers().contains_key("accept-post"));
        let bytes = resp.into_body().collect().await.unwrap().to_bytes();
        let v: Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(v["code"], "invalid_argument", "{v}");
    }
    // The right type with a charset parameter still works.
    let req = Request::post("/filesystem.Filesystem/Stat")
        .header("content-type", "application/json; charset=utf-8")
        .body(Full::new(Bytes::from(unary)))
        .unwrap();
    assert_eq!(g.send(req).await.status(), StatusCode::OK);
    // A method without fields still wants a JSON object: anything else is invalid_argument (400).
    for body in [&b"not json"[..], b"[1]", b"{\"x\""] {
        let req = Request::post("/process.Process/List")
            .header("content-type", "application/json")
            .body(Full::new(Bytes::copy_from_slice(body)))
            .unwrap();
        let resp = g.send(req).await;
        assert_eq!(resp.status(), StatusCode::BAD_REQUEST, "{body:?}");
        let bytes = resp.into_body().collect().await.unwrap().to_bytes();
        let v: Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(v["code"], "invalid_argument", "{v}");
    }
}
