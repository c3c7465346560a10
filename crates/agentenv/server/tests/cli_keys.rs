//! `agentenv keys` writes into the state folder it is given, wherever on the command line.

use std::process::Command;

fn agentenv(home: &std::path::Path, args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_agentenv"))
        .args(args)
        .env("HOME", home)
        .env_remove("AGENTENV_STATE_DIR")
        .output()
        .unwrap()
}

#[test]
fn keys_honour_a_state_dir_given_before_the_subcommand() {
    let t = tempfile::tempdir().unwrap();
    let (home, a, b) = (
        t.path().join("home"),
        t.path().join("a"),
        t.path().join("b"),
    );
    let (a_s, b_s) = (a.to_str().unwrap(), b.to_str().unwrap());
    for (args, dir) in [
        (vec!["--state-dir", a_s, "keys", "create", "before"], &a),
        (vec!["keys", "--state-dir", b_s, "create", "after"], &b),
    ] {
        let out = agentenv(&home, &args);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let keys = std::fs::read_to_string(dir.join("server/keys.json")).unwrap();
        assert!(keys.contains(args[4]), "{keys}");
    }
    assert!(
        !home.join(".local/state/agentenv").exists(),
        "nothing goes to the default folder"
    );
    let out = agentenv(
        &home,
        &["--state-dir", a_s, "keys", "--state-dir", b_s, "ls"],
    );
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("two state folders"));
}

#[test]
fn a_new_key_has_limits_unless_told_otherwise() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join("s");
    let d = dir.to_str().unwrap();
    for args in [
        vec!["keys", "--state-dir", d, "create", "plain"],
        vec![
            "keys",
            "--state-dir",
            d,
            "create",
            "open",
            "--max-running",
            "0",
            "--max-paused",
            "0",
            "--max-memory-mb",
            "0",
            "--max-snapshots",
            "0",
            "--max-snapshot-gb",
            "0",
        ],
    ] {
        let out = agentenv(t.path(), &args);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let out = agentenv(t.path(), &["keys", "--state-dir", d, "ls", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let quota = |name: &str| {
        v.as_array()
            .unwrap()
            .iter()
            .find(|k| k["name"] == name)
            .unwrap_or_else(|| panic!("{name} in {v}"))["quota"]
            .clone()
    };
    assert_eq!(
        quota("plain"),
        serde_json::json!({"max_running": 20, "max_paused": 100, "max_memory_mb": 16384,
            "max_snapshots": 100, "max_snapshot_gb": 50})
    );
    assert_eq!(
        quota("open"),
        serde_json::json!({"max_running": null, "max_paused": null, "max_memory_mb": null,
            "max_snapshots": null, "max_snapshot_gb": null})
    );
    let out = agentenv(t.path(), &["keys", "--state-dir", d, "ls"]);
    let table = String::from_utf8_lossy(&out.stdout);
    let row = table.lines().find(|l| l.starts_with("plain ")).unwrap();
    assert!(row.ends_with("  100       50"), "{table}");
}
