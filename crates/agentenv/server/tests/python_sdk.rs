//! Runs the Python SDK tests (`tests/python/`, pytest + the stock `e2b` SDK) against this
//! build's `agentenv` binary: one command for CI, `cargo test -p agentenv-server --test python_sdk`.
//!
//! Two runs: every file but `test_network.py` first (their servers build the default template,
//! which fetches from the package mirror), then the test internet (a range the host does not use,
//! [`TestInternet`]) and `test_network.py` against it.

mod common;

use std::path::Path;
use std::process::Command;

use agentenv_runtime::net::testnet::TestInternet;

/// Last octets of the test internet's web servers and resolver (`test_network.py` reads them).
const HOSTS: [u8; 4] = [10, 11, 12, 53];
/// A fake cloud metadata address and a private one, routed into the test internet for sandbox
/// traffic only (`test_network.py` serves both there).
const METADATA: std::net::Ipv4Addr = std::net::Ipv4Addr::new(169, 254, 169, 254);
const PRIVATE: std::net::Ipv4Addr = std::net::Ipv4Addr::new(192, 168, 253, 1);

/// Runs pytest on `args`; `K3_PYTEST_K` (a pytest `-k` expression) picks tests while you work.
fn pytest(args: &[String], env: &[(&str, String)]) {
    let pick: Vec<String> = std::env::var("K3_PYTEST_K")
        .ok()
        .filter(|k| !k.is_empty())
        .map(|k| vec!["-k".into(), k])
        .unwrap_or_default();
    let status = Command::new(std::env::var("PYTHON").unwrap_or_else(|_| "python3".into()))
        .args(["-m", "pytest", "-x", "-v", "-rfE", "-p", "no:cacheprovider"])
        // The slowest tests, at the end of the log: where CI's time goes.
        .arg("--durations=25")
        .args(&pick)
        .args(args)
        .env("AGENTENV_BIN", env!("CARGO_BIN_EXE_agentenv"))
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .envs(env.iter().map(|(k, v)| (k, v)))
        .status()
        .expect("running python3 -m pytest (pip install pytest e2b)");
    // Exit code 5: nothing collected, which a `-k` pick may leave for one of the two runs.
    let none_picked = !pick.is_empty() && status.code() == Some(5);
    assert!(
        status.success() || none_picked,
        "pytest {args:?} failed: {status}"
    );
}

#[test]
fn e2b_python_sdk_flows() {
    common::ensure_guest_binary();
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python");
    let network = dir.join("test_network.py").display().to_string();
    pytest(
        &[format!("--ignore={network}"), dir.display().to_string()],
        &[],
    );
    // Without root or nftables `test_network.py` skips (or fails under K3_REQUIRE_KVM) by itself.
    let inet = match k3_common::netcheck::sandbox_network_blocker() {
        None => {
            let mut i = TestInternet::up(&HOSTS).expect("the test internet");
            i.route(&[METADATA, PRIVATE])
                .expect("routing the test internet");
            Some(i)
        }
        Some(_) => None,
    };
    let env: Vec<(&str, String)> = inet
        .iter()
        .flat_map(|i| {
            [
                ("K3_TESTNET_NS", i.ns().to_owned()),
                ("K3_TESTNET_UPLINK", i.uplink().to_owned()),
                ("K3_TESTNET_PREFIX", i.range().prefix()),
                ("K3_TESTNET_LINK_PEER", i.link_peer().to_string()),
                ("K3_TESTNET_PRIVATE", PRIVATE.to_string()),
            ]
        })
        .collect();
    pytest(&[network], &env);
}
