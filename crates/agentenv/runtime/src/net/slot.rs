//! One network slot: a namespace `agentenv-<i>` with a persistent tap (the guest's wire) and a veth
//! pair to the host, a /29 of [`SANDBOX_NET`] of its own, and the guest resolver's socket.
//!
//! ```text
//! guest eth0 (.2) ── tap0 (.1, gateway + resolver) ─[netns agentenv-i, nftables]─ veth0 (.6) ── aenv<i>h (.5, host)
//! ```
//! Slots are numbered host-wide (every runtime on the host shares the numbers): a slot is free when
//! its namespace does not exist, and creating one happens under a host-wide lock.

use std::fs::File;
use std::io::Write;
use std::net::{Ipv4Addr, TcpListener, UdpSocket};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use super::NetError;

/// Name of the sandbox namespace's nftables table (`inet`).
pub const TABLE: &str = "sandbox";

/// Every sandbox address comes from here.
pub const SANDBOX_NET: &str = "10.200.0.0/16";
const NET_BASE: u32 = 0x0ac8_0000;
/// Slots in [`SANDBOX_NET`] (a /29 each).
pub const MAX_SLOTS: u32 = 8192;
/// The tap's name inside every namespace.
pub const TAP: &str = "tap0";
/// The namespace's end of its veth pair.
pub const VETH: &str = "veth0";
/// Prefix of every host-side veth (`aenv<i>h`), matched by the host's rules.
pub const HOST_IF_PREFIX: &str = "aenv";
const NETNS_DIR: &str = "/run/netns";
const HOST_LOCK: &str = "/run/agentenv-net.lock";
/// Deadline of each `ip`/`nft` run.
const TOOL_DEADLINE: Duration = Duration::from_secs(10);

/// Addresses of slot `index`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotAddrs {
    pub index: u32,
    /// Tap side in the namespace: the guest's gateway and resolver.
    pub gateway: Ipv4Addr,
    /// The guest's address (`/30` with the gateway).
    pub guest: Ipv4Addr,
    /// Host end of the veth pair.
    pub host: Ipv4Addr,
    /// Namespace end of the veth pair.
    pub ns: Ipv4Addr,
}

impl SlotAddrs {
    /// The addresses of slot `index` (< [`MAX_SLOTS`]).
    pub fn of(index: u32) -> SlotAddrs {
        let b = NET_BASE + index * 8;
        SlotAddrs {
            index,
            gateway: Ipv4Addr::from(b + 1),
            guest: Ipv4Addr::from(b + 2),
            host: Ipv4Addr::from(b + 5),
            ns: Ipv4Addr::from(b + 6),
        }
    }
    /// The guest's /30 (network address).
    pub fn guest_net(&self) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(self.gateway) - 1)
    }
    /// `agentenv-<i>`.
    pub fn netns(&self) -> String {
        format!("agentenv-{}", self.index)
    }
    /// `aenv<i>h`.
    pub fn host_if(&self) -> String {
        format!("{HOST_IF_PREFIX}{}h", self.index)
    }
    /// A locally administered MAC unique to the slot.
    pub fn mac(&self) -> String {
        let i = self.index.to_be_bytes();
        format!("02:ae:{:02x}:{:02x}:{:02x}:{:02x}", i[0], i[1], i[2], i[3])
    }
}

/// Runs `f` on a fresh thread inside the namespace `name` (children it spawns are in it too). The
/// calling thread never changes namespace.
pub fn in_netns<T: Send + 'static>(
    name: &str,
    f: impl FnOnce() -> Result<T, NetError> + Send + 'static,
) -> Result<T, NetError> {
    let path = Path::new(NETNS_DIR).join(name);
    let ns = File::open(&path).map_err(|e| NetError::io("open namespace", &path, e))?;
    std::thread::spawn(move || {
        // SAFETY: setns on an open namespace fd; it affects only this thread, which ends after `f`.
        if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
            return Err(NetError::io(
                "setns",
                &path,
                std::io::Error::last_os_error(),
            ));
        }
        f()
    })
    .join()
    .unwrap_or_else(|_| {
        Err(NetError::Tool {
            program: "netns thread".into(),
            detail: "panicked".into(),
        })
    })
}

/// Runs `program args` with `stdin`, within [`TOOL_DEADLINE`]; its stderr becomes the error.
pub fn run_tool(program: &str, args: &[&str], stdin: &str) -> Result<String, NetError> {
    let fail = |detail: String| NetError::Tool {
        program: format!("{program} {}", args.join(" ")),
        detail,
    };
    let mut child = Command::new(program)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| fail(e.to_string()))?;
    if let Some(mut i) = child.stdin.take() {
        i.write_all(stdin.as_bytes())
            .map_err(|e| fail(e.to_string()))?;
    }
    let deadline = std::time::Instant::now() + TOOL_DEADLINE;
    loop {
        match child.try_wait().map_err(|e| fail(e.to_string()))? {
            Some(_) => break,
            None if std::time::Instant::now() > deadline => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(fail(format!("no answer in {TOOL_DEADLINE:?}")));
            }
            None => std::thread::sleep(Duration::from_millis(1)),
        }
    }
    let out = child.wait_with_output().map_err(|e| fail(e.to_string()))?;
    if !out.status.success() {
        return Err(fail(String::from_utf8_lossy(&out.stderr).trim().to_owned()));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn write_sysctl(path: &str, value: &str) -> Result<(), NetError> {
    std::fs::write(path, value).map_err(|e| NetError::io("write", Path::new(path), e))
}

/// A slot made and owned by this process: the namespace exists until [`Slot::destroy`].
#[derive(Debug)]
pub struct Slot {
    pub addrs: SlotAddrs,
    /// The guest resolver's socket (`gateway:53` in the namespace).
    pub dns: UdpSocket,
    /// The egress proxy's listener (`gateway:`[`PROXY_PORT`] in the namespace).
    pub proxy: TcpListener,
}

/// Port of the egress proxy's listener on every gateway; the namespace's rules redirect to it.
pub const PROXY_PORT: u16 = 15001;

/// Where slot markers live: file `<index>` says who holds the slot (see `Network`).
const OWNERS_DIR: &str = "/run/agentenv-net";

/// The host-wide lock over slot numbers and markers; held while the returned lock lives.
fn host_lock() -> Result<k3_common::fsutil::FileLock, NetError> {
    std::fs::create_dir_all(OWNERS_DIR)
        .map_err(|e| NetError::io("create", Path::new(OWNERS_DIR), e))?;
    k3_common::fsutil::FileLock::lock(Path::new(HOST_LOCK))
        .map_err(|e| NetError::io("lock", Path::new(HOST_LOCK), e))
}

fn marker_path(index: u32) -> PathBuf {
    Path::new(OWNERS_DIR).join(index.to_string())
}

/// Slot `index`'s marker; `None`: it has none (yet).
pub fn marker(index: u32) -> Option<String> {
    std::fs::read_to_string(marker_path(index)).ok()
}

/// Replaces slot `index`'s marker (whole: a reader never sees a part).
pub fn set_marker(index: u32, marker: &str) {
    let (path, tmp) = (marker_path(index), marker_path(index).with_extension("new"));
    if std::fs::write(&tmp, marker)
        .and_then(|_| std::fs::rename(&tmp, &path))
        .is_err()
    {
        tracing::warn!(index, "writing a slot marker failed");
    }
}

/// Deletes slot `index` (namespace and marker) if its marker passes `stale`, checked under the
/// host lock: a slot number another process took meanwhile is left alone. Returns whether it went.
pub fn remove_if(index: u32, stale: impl FnOnce(&str) -> bool) -> bool {
    let Ok(_lock) = host_lock() else { return false };
    match marker(index) {
        Some(m) if stale(&m) => {
            destroy(&SlotAddrs::of(index));
            let _ = std::fs::remove_file(marker_path(index));
            true
        }
        _ => false,
    }
}

/// Takes the lowest free slot number host-wide, marks it with `marker` and builds its namespace.
pub fn create(marker: &str) -> Result<Slot, NetError> {
    let lock = host_lock()?;
    // Free: neither its namespace nor its host interface exists. An interface without a namespace
    // belongs to a namespace being torn down, or one a process elsewhere still holds open.
    let index = (0..MAX_SLOTS)
        .find(|i| {
            let a = SlotAddrs::of(*i);
            !Path::new(NETNS_DIR).join(a.netns()).exists()
                && !Path::new("/sys/class/net").join(a.host_if()).exists()
        })
        .ok_or(NetError::Exhausted(MAX_SLOTS))?;
    let a = SlotAddrs::of(index);
    let (ns, hif) = (a.netns(), a.host_if());
    set_marker(index, marker);
    let host = format!(
        "netns add {ns}\nlink add {hif} type veth peer name {VETH} netns {ns}\naddr add {}/30 dev {hif}\nlink set {hif} up\nroute add {}/30 via {} dev {hif}\n",
        a.host,
        a.guest_net(),
        a.ns
    );
    let host = run_tool("ip", &["-batch", "-"], &host);
    drop(lock);
    let result = host.and_then(|_| {
        write_sysctl(&format!("/proc/sys/net/ipv4/conf/{hif}/forwarding"), "1")?;
        let inside = format!(
            "link set lo up\naddr add {}/30 dev {VETH}\nlink set {VETH} up\nroute add default via {}\ntuntap add {TAP} mode tap\naddr add {}/30 dev {TAP}\nlink set {TAP} up\n",
            a.ns, a.host, a.gateway
        );
        run_tool("ip", &["-n", &ns, "-batch", "-"], &inside)?;
        let gw = a.gateway;
        in_netns(&ns, move || {
            write_sysctl("/proc/sys/net/ipv4/ip_forward", "1")?;
            let _ = std::fs::write("/proc/sys/net/ipv6/conf/all/disable_ipv6", "1");
            bind_here(gw)
        })
    });
    match result {
        Ok((dns, proxy)) => Ok(Slot {
            addrs: a,
            dns,
            proxy,
        }),
        Err(e) => {
            remove_if(index, |m| m == marker);
            Err(e)
        }
    }
}

/// The guest resolver's socket, `gw:53`, nonblocking; call inside the slot's namespace.
fn bind_here(gw: Ipv4Addr) -> Result<(UdpSocket, TcpListener), NetError> {
    let io = |what, e| NetError::io(what, Path::new("udp/53"), e);
    let dns = UdpSocket::bind((gw, 53)).map_err(|e| io("bind resolver", e))?;
    dns.set_nonblocking(true)
        .map_err(|e| io("nonblocking", e))?;
    let io = |what, e| NetError::io(what, Path::new("tcp/proxy"), e);
    let proxy = TcpListener::bind((gw, PROXY_PORT)).map_err(|e| io("bind proxy", e))?;
    proxy
        .set_nonblocking(true)
        .map_err(|e| io("nonblocking", e))?;
    Ok((dns, proxy))
}

/// The resolver's socket and the proxy's listener in slot `a`'s namespace (again, after a restart).
pub fn bind_sockets(a: &SlotAddrs) -> Result<(UdpSocket, TcpListener), NetError> {
    let gw = a.gateway;
    in_netns(&a.netns(), move || bind_here(gw))
}

/// A TCP socket of slot `a`'s namespace (its traffic meets the namespace's egress rules),
/// non-blocking, not yet connected.
pub fn tcp_socket(a: &SlotAddrs) -> Result<std::net::TcpStream, NetError> {
    in_netns(&a.netns(), || {
        // SAFETY: plain socket(2); the fd is owned at once.
        let fd = unsafe {
            libc::socket(
                libc::AF_INET,
                libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
                0,
            )
        };
        if fd < 0 {
            let e = std::io::Error::last_os_error();
            return Err(NetError::io("socket", Path::new("tcp"), e));
        }
        // SAFETY: `fd` is a fresh socket nobody else owns.
        Ok(std::net::TcpStream::from(unsafe {
            OwnedFd::from_raw_fd(fd)
        }))
    })
}

/// Whether slot `index`'s namespace exists on this host.
pub fn exists(index: u32) -> bool {
    Path::new(NETNS_DIR)
        .join(SlotAddrs::of(index).netns())
        .exists()
}

/// Deletes slot `a`'s namespace (its tap and veth pair go with it); a missing one is fine.
fn destroy(a: &SlotAddrs) {
    if let Err(e) = run_tool("ip", &["netns", "del", &a.netns()], "")
        && Path::new(NETNS_DIR).join(a.netns()).exists()
    {
        tracing::warn!(netns = %a.netns(), error = %e, "deleting a sandbox namespace failed");
    }
}

/// Loads `rules` (a whole `nft -f` script) into slot `a`'s namespace, atomically.
pub fn load_rules(a: &SlotAddrs, rules: String) -> Result<(), NetError> {
    in_netns(&a.netns(), move || {
        run_tool("nft", &["-f", "-"], &rules).map(|_| ())
    })
}

/// Opens the guest's end: the namespace's tap, as a file descriptor QEMU inherits.
pub fn open_tap(a: &SlotAddrs) -> Result<OwnedFd, NetError> {
    const TUNSETIFF: libc::c_ulong = 0x4004_54ca;
    const IFF_TAP: i16 = 0x0002;
    const IFF_NO_PI: i16 = 0x1000;
    const IFF_VNET_HDR: i16 = 0x4000;
    in_netns(&a.netns(), || {
        let tun = File::options()
            .read(true)
            .write(true)
            .open("/dev/net/tun")
            .map_err(|e| NetError::io("open", Path::new("/dev/net/tun"), e))?;
        let mut req = [0u8; 40];
        req[..TAP.len()].copy_from_slice(TAP.as_bytes());
        req[16..18].copy_from_slice(&(IFF_TAP | IFF_NO_PI | IFF_VNET_HDR).to_ne_bytes());
        // SAFETY: TUNSETIFF reads a struct ifreq (40 bytes) from a live buffer.
        if unsafe { libc::ioctl(tun.as_raw_fd(), TUNSETIFF as _, req.as_mut_ptr()) } != 0 {
            let e = std::io::Error::last_os_error();
            return Err(NetError::io("attach tap", Path::new(TAP), e));
        }
        // SAFETY: into_raw_fd hands over sole ownership.
        Ok(unsafe { OwnedFd::from_raw_fd(std::os::fd::IntoRawFd::into_raw_fd(tun)) })
    })
}

/// Byte and drop counters of slot `a` (`tx`: guest to outside).
pub fn counters(a: &SlotAddrs) -> Result<(u64, u64, u64), NetError> {
    let out = in_netns(&a.netns(), || {
        run_tool(
            "nft",
            &["-j", "list", "counters", "table", "inet", TABLE],
            "",
        )
    })?;
    let v: serde_json::Value = serde_json::from_str(&out).map_err(|e| NetError::Tool {
        program: "nft -j list counters".into(),
        detail: e.to_string(),
    })?;
    let mut c = std::collections::HashMap::new();
    for e in v["nftables"].as_array().into_iter().flatten() {
        let k = &e["counter"];
        if let Some(name) = k["name"].as_str() {
            c.insert(
                name.to_owned(),
                (
                    k["bytes"].as_u64().unwrap_or(0),
                    k["packets"].as_u64().unwrap_or(0),
                ),
            );
        }
    }
    let get = |n: &str| c.get(n).copied().unwrap_or((0, 0));
    Ok((get("tx").0, get("rx").0, get("dropped").1))
}

/// Namespaces `agentenv-<i>` on this host.
pub fn existing() -> Vec<u32> {
    std::fs::read_dir(NETNS_DIR)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            e.file_name()
                .to_str()?
                .strip_prefix("agentenv-")?
                .parse()
                .ok()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_have_disjoint_addresses_and_unique_names() {
        let mut seen = std::collections::HashSet::new();
        for i in [0, 1, 2, 1000, MAX_SLOTS - 1] {
            let a = SlotAddrs::of(i);
            for ip in [a.gateway, a.guest, a.host, a.ns] {
                assert!(seen.insert(ip), "{ip} twice");
                assert_eq!(ip.octets()[..2], [10, 200]);
            }
            assert!(a.host_if().len() <= 15, "IFNAMSIZ");
            assert_eq!(a.mac().len(), 17);
        }
        assert_eq!(SlotAddrs::of(1).guest, Ipv4Addr::new(10, 200, 0, 10));
        assert_ne!(SlotAddrs::of(1).mac(), SlotAddrs::of(2).mac());
    }
}
