//! The guest NIC's address, route and resolver, set from `/init` with plain ioctls (the guest image
//! needs no `ip` binary). Run again at every create, resume and fork, each with its own address.

use std::io;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use agentenv_envd::{GUEST_NIC, GuestNetwork};

const SIOCSIFFLAGS: libc::c_ulong = 0x8914;
const SIOCGIFFLAGS: libc::c_ulong = 0x8913;
const SIOCSIFADDR: libc::c_ulong = 0x8916;
const SIOCSIFNETMASK: libc::c_ulong = 0x891c;
const SIOCSIFHWADDR: libc::c_ulong = 0x8924;
const SIOCADDRT: libc::c_ulong = 0x890b;
const SIOCDELRT: libc::c_ulong = 0x890c;
const RTF_UP: u16 = 0x1;
const RTF_GATEWAY: u16 = 0x2;

#[repr(C)]
struct IfReq {
    name: [u8; 16],
    data: [u8; 24],
}

#[repr(C)]
struct RtEntry {
    pad1: libc::c_ulong,
    dst: libc::sockaddr,
    gateway: libc::sockaddr,
    genmask: libc::sockaddr,
    flags: libc::c_ushort,
    pad2: libc::c_short,
    pad3: libc::c_ulong,
    pad4: *mut libc::c_void,
    metric: libc::c_short,
    dev: *mut libc::c_char,
    mtu: libc::c_ulong,
    window: libc::c_ulong,
    irtt: libc::c_ushort,
}

fn sockaddr_in(ip: Ipv4Addr) -> libc::sockaddr {
    let sin = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: 0,
        sin_addr: libc::in_addr {
            s_addr: u32::from(ip).to_be(),
        },
        sin_zero: [0; 8],
    };
    // SAFETY: sockaddr_in and sockaddr have the same size; any bit pattern is a valid sockaddr.
    unsafe { std::mem::transmute(sin) }
}

fn ifreq(data: &[u8]) -> IfReq {
    ifreq_of(GUEST_NIC, data)
}

fn ifreq_of(name: &str, data: &[u8]) -> IfReq {
    let mut r = IfReq {
        name: [0; 16],
        data: [0; 24],
    };
    r.name[..name.len()].copy_from_slice(name.as_bytes());
    r.data[..data.len()].copy_from_slice(data);
    r
}

fn sockaddr_bytes(sa: &libc::sockaddr) -> [u8; 16] {
    // SAFETY: a sockaddr is 16 plain bytes.
    unsafe { std::mem::transmute_copy(sa) }
}

fn ioctl<T>(fd: &OwnedFd, req: libc::c_ulong, arg: &mut T, what: &str) -> io::Result<()> {
    // SAFETY: `arg` is a live, correctly laid out argument of `req`.
    if unsafe { libc::ioctl(fd.as_raw_fd(), req as _, arg as *mut T) } != 0 {
        let e = io::Error::last_os_error();
        return Err(io::Error::new(e.kind(), format!("{what}: {e}")));
    }
    Ok(())
}

/// Parses `02:ae:..` into 6 bytes.
pub fn parse_mac(s: &str) -> Option<[u8; 6]> {
    let parts: Vec<u8> = s
        .split(':')
        .map(|p| {
            (p.len() == 2)
                .then(|| u8::from_str_radix(p, 16).ok())
                .flatten()
        })
        .collect::<Option<_>>()?;
    parts.try_into().ok()
}

/// Checks what `/init` sent before anything changes.
pub fn validate(n: &GuestNetwork) -> Result<(), String> {
    if n.prefix_len == 0 || n.prefix_len > 30 {
        return Err(format!("prefixLen {} is not in 1..=30", n.prefix_len));
    }
    if parse_mac(&n.mac).is_none() {
        return Err(format!("mac {:?} is not six hex bytes", n.mac));
    }
    if n.dns.len() > 3 {
        return Err("at most 3 dns servers".into());
    }
    if let Some(pem) = &n.ca_pem
        && (pem.len() > MAX_CA_PEM || !pem.trim_start().starts_with("-----BEGIN CERTIFICATE-----"))
    {
        return Err("caPem is not one PEM certificate".into());
    }
    Ok(())
}

/// Largest CA certificate accepted, bytes.
const MAX_CA_PEM: usize = 16 * 1024;
/// Where the host's egress CA is kept (`update-ca-certificates` picks it up too).
const CA_FILE: &str = "/usr/local/share/ca-certificates/agentenv-egress.crt";
/// The distribution's bundle most TLS clients read (Debian's).
const BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";

/// `bundle` with `pem` in it and `old` (an earlier CA of ours) out; `None`: nothing to change.
fn bundle_with(bundle: &str, old: Option<&str>, pem: &str) -> Option<String> {
    let mut b = match old {
        Some(o) if !o.is_empty() && o != pem => bundle.replace(o, ""),
        _ => bundle.to_string(),
    };
    if b.contains(pem) && b.len() == bundle.len() {
        return None;
    }
    if !b.contains(pem) {
        if !b.is_empty() && !b.ends_with('\n') {
            b.push('\n');
        }
        b.push_str(pem);
    }
    Some(b)
}

/// Adds the host's egress CA to the trust store (a new one replaces the one before).
fn trust_ca(pem: &str) -> io::Result<()> {
    let old = std::fs::read_to_string(CA_FILE).ok();
    if old.as_deref() == Some(pem) {
        return Ok(());
    }
    if let Some(dir) = std::path::Path::new(CA_FILE).parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(CA_FILE, pem)?;
    let Ok(bundle) = std::fs::read_to_string(BUNDLE) else {
        return Ok(()); // no bundle in this image
    };
    if let Some(b) = bundle_with(&bundle, old.as_deref(), pem) {
        let tmp = format!("{BUNDLE}.agentenv");
        std::fs::write(&tmp, b)?;
        std::fs::rename(&tmp, BUNDLE)?;
    }
    Ok(())
}

fn socket() -> io::Result<OwnedFd> {
    // SAFETY: socket(2) with constant arguments; the fd is owned below.
    let raw = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `raw` is a fresh fd nobody else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(raw) })
}

/// Brings `name` up unless it is.
fn bring_up(fd: &OwnedFd, name: &str) -> io::Result<()> {
    let mut f = ifreq_of(name, &[]);
    ioctl(fd, SIOCGIFFLAGS, &mut f, "get flags")?;
    let flags = u16::from_ne_bytes([f.data[0], f.data[1]]);
    if flags & libc::IFF_UP as u16 != 0 {
        return Ok(());
    }
    let up = flags | libc::IFF_UP as u16;
    ioctl(
        fd,
        SIOCSIFFLAGS,
        &mut ifreq_of(name, &up.to_ne_bytes()),
        "bring up",
    )
}

/// At the agent's start in a VM (so it is part of every template's snapshot): `lo` and the NIC up,
/// IPv6 off on the NIC. Bringing a virtio NIC up costs about 200 ms under TCG; done here, the
/// per-sandbox [`configure`] only sets addresses. A machine without a NIC is fine.
pub fn prepare() -> io::Result<()> {
    let fd = socket()?;
    bring_up(&fd, "lo")?;
    if !std::path::Path::new("/sys/class/net")
        .join(GUEST_NIC)
        .exists()
    {
        return Ok(());
    }
    let _ = std::fs::write(
        format!("/proc/sys/net/ipv6/conf/{GUEST_NIC}/disable_ipv6"),
        "1",
    );
    bring_up(&fd, GUEST_NIC)
}

/// Sets MAC, address, netmask and the default route of [`GUEST_NIC`] (bringing it and `lo` up where
/// [`prepare`] did not) and writes `/etc/resolv.conf`.
pub fn configure(n: &GuestNetwork) -> io::Result<()> {
    let mac = parse_mac(&n.mac).ok_or_else(|| io::Error::other("bad mac"))?;
    let fd = socket()?;
    bring_up(&fd, "lo")?;
    let mut hw = [0u8; 16];
    hw[..2].copy_from_slice(&(libc::ARPHRD_ETHER).to_ne_bytes());
    hw[2..8].copy_from_slice(&mac);
    ioctl(&fd, SIOCSIFHWADDR, &mut ifreq(&hw), "set mac")?;
    let addr = sockaddr_bytes(&sockaddr_in(n.address));
    ioctl(&fd, SIOCSIFADDR, &mut ifreq(&addr), "set address")?;
    let mask = Ipv4Addr::from(u32::MAX << (32 - u32::from(n.prefix_len)));
    let mask = sockaddr_bytes(&sockaddr_in(mask));
    ioctl(&fd, SIOCSIFNETMASK, &mut ifreq(&mask), "set netmask")?;
    bring_up(&fd, GUEST_NIC)?;
    let mut dev = *b"eth0\0";
    let mut rt = RtEntry {
        pad1: 0,
        dst: sockaddr_in(Ipv4Addr::UNSPECIFIED),
        gateway: sockaddr_in(n.gateway),
        genmask: sockaddr_in(Ipv4Addr::UNSPECIFIED),
        flags: RTF_UP | RTF_GATEWAY,
        pad2: 0,
        pad3: 0,
        pad4: std::ptr::null_mut(),
        metric: 0,
        dev: dev.as_mut_ptr().cast(),
        mtu: 0,
        window: 0,
        irtt: 0,
    };
    // A default route of an earlier address (a snapshot's) goes first; none is fine.
    let mut old = RtEntry {
        gateway: sockaddr_in(Ipv4Addr::UNSPECIFIED),
        flags: RTF_UP,
        ..rt
    };
    while ioctl(&fd, SIOCDELRT, &mut old, "delete route").is_ok() {}
    ioctl(&fd, SIOCADDRT, &mut rt, "add default route")?;
    let resolv: String = n.dns.iter().map(|d| format!("nameserver {d}\n")).collect();
    std::fs::write("/etc/resolv.conf", resolv)?;
    match &n.ca_pem {
        Some(pem) => trust_ca(pem),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_egress_ca_joins_the_bundle_once_and_replaces_an_older_one() {
        let (a, b) = ("-----A-----\n", "-----B-----\n");
        let base = "-----ROOT1-----\n-----ROOT2-----";
        let with_a = bundle_with(base, None, a).unwrap();
        assert_eq!(with_a, format!("{base}\n{a}"));
        assert_eq!(bundle_with(&with_a, None, a), None);
        assert_eq!(bundle_with(&with_a, Some(a), a), None);
        let with_b = bundle_with(&with_a, Some(a), b).unwrap();
        assert!(with_b.contains(b) && !with_b.contains(a) && with_b.starts_with(base));
    }

    #[test]
    fn macs_and_settings_are_checked() {
        assert_eq!(
            parse_mac("02:ae:00:01:ff:10"),
            Some([2, 0xae, 0, 1, 0xff, 0x10])
        );
        for bad in [
            "02:ae:00:01:ff",
            "02:ae:00:01:ff:1",
            "zz:ae:00:01:ff:10",
            "",
        ] {
            assert_eq!(parse_mac(bad), None, "{bad}");
        }
        let mut n = GuestNetwork {
            address: Ipv4Addr::new(10, 200, 0, 2),
            prefix_len: 30,
            gateway: Ipv4Addr::new(10, 200, 0, 1),
            dns: vec![Ipv4Addr::new(10, 200, 0, 1)],
            mac: "02:ae:00:00:00:01".into(),
            ca_pem: None,
        };
        assert!(validate(&n).is_ok());
        n.ca_pem = Some("not a certificate".into());
        assert!(validate(&n).is_err());
        n.ca_pem = Some(format!(
            "-----BEGIN CERTIFICATE-----\n{}",
            "A".repeat(MAX_CA_PEM)
        ));
        assert!(validate(&n).is_err());
        n.ca_pem = None;
        n.prefix_len = 31;
        assert!(validate(&n).is_err());
        n.prefix_len = 30;
        n.mac = "nope".into();
        assert!(validate(&n).is_err());
    }
}
