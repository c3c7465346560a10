//! Can this host give agentenv sandboxes a network (namespaces, taps, nftables)? Used by the
//! runtime at start and by `cargo xtask doctor`.

use std::path::Path;
use std::process::{Command, Stdio};

/// Why sandboxes cannot get a network here, or `None` when they can (root, `/dev/net/tun`, and
/// iproute2's `ip` and `nft` run).
pub fn sandbox_network_blocker() -> Option<String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Some("not root (CAP_NET_ADMIN is needed)".into());
    }
    if !Path::new("/dev/net/tun").exists() {
        return Some("/dev/net/tun is missing".into());
    }
    for (tool, arg) in [("ip", "-V"), ("nft", "--version")] {
        let ok = Command::new(tool)
            .arg(arg)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            return Some(format!(
                "`{tool}` does not run: install iproute2 and nftables"
            ));
        }
    }
    None
}
