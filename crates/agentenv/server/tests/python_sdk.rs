//! Runs the Python SDK tests (`tests/python/`, pytest + the stock `e2b` SDK) against this
//! build's `agentenv` binary: one command for CI, `cargo test -p agentenv-server --test python_sdk`.

mod common;

use std::path::Path;
use std::process::Command;

#[test]
fn e2b_python_sdk_flows() {
    common::ensure_guest_binary();
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python");
    let status = Command::new(std::env::var("PYTHON").unwrap_or_else(|_| "python3".into()))
        .args(["-m", "pytest", "-x", "-v", "-p", "no:cacheprovider"])
        .arg(&dir)
        .env("AGENTENV_BIN", env!("CARGO_BIN_EXE_agentenv"))
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .status()
        .expect("running python3 -m pytest (pip install pytest e2b)");
    assert!(status.success(), "pytest failed: {status}");
}
