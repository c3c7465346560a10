//! Sandbox network slots are host-wide: two runtimes on one host (two servers, or a test server
//! next to a long-lived one) share slot numbers, and neither may delete a slot the other still
//! manages, not even one released whose deletion is pending.

use std::path::{Path, PathBuf};
use std::time::Duration;

use agentenv_runtime::net::{EgressPolicy, NetConfig, Network, slot};

/// Why this host cannot run the test (`None`: it can); fails instead under `K3_REQUIRE_KVM=1`.
fn blocker() -> Option<String> {
    let why = k3_common::netcheck::sandbox_network_blocker().or_else(|| {
        agentenv_runtime::net::default_route_interface()
            .is_none()
            .then(|| "no default route".to_string())
    })?;
    k3_common::require::skip_part(
        k3_common::require::Part::Network,
        "net_slots",
        format!("sandbox networking unavailable: {why}"),
    );
    Some(why)
}

fn cfg() -> NetConfig {
    NetConfig {
        warm: 0,
        ..Default::default()
    }
}

fn sandbox(state: &Path, id: &str) -> PathBuf {
    let d = state.join("sandboxes").join(id);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runtime_never_deletes_a_slot_another_live_runtime_manages() {
    if blocker().is_some() {
        return;
    }
    let (a_state, b_state) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let a = Network::start(cfg(), a_state.path()).unwrap();
    let a_sbx = sandbox(a_state.path(), "x");
    let att = a.attach(&a_sbx, EgressPolicy::default()).await.unwrap();
    let a_index = att.addrs.index;
    // A's sandbox is killed: its folder goes at once, its slot after a delay.
    std::fs::remove_dir_all(&a_sbx).unwrap();
    a.release(att);

    // A slot whose runtime died with its sandbox folder gone is left over.
    let dead = u32::MAX - 1;
    let orphan = slot::create(&format!(
        "{dead} {}/sandboxes/gone",
        b_state.path().display()
    ))
    .unwrap()
    .addrs
    .index;

    // B starts meanwhile and takes a slot of its own.
    let b = Network::start(cfg(), b_state.path()).unwrap();
    assert!(slot::exists(a_index), "B deleted A's slot in deletion");
    assert!(!slot::exists(orphan), "B kept a slot of a dead runtime");
    let b_sbx = sandbox(b_state.path(), "y");
    let b_att = b.attach(&b_sbx, EgressPolicy::default()).await.unwrap();
    let b_index = b_att.addrs.index;
    assert_ne!(a_index, b_index);
    assert!(agentenv_runtime::net::held_by(b_index, &b_sbx));

    // A's pending deletion takes its own slot only.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert!(!slot::exists(a_index), "A's released slot stayed");
    assert!(slot::exists(b_index), "A's deletion took B's slot");
    assert!(b.stats(&b_att).await.is_ok());
    assert!(b.remove_stale(Some(&[b_sbx.display().to_string()])) == 0);
    assert!(slot::exists(b_index));

    b.release(b_att);
    b.drain();
    a.drain();
    assert!(!slot::exists(b_index));
}
