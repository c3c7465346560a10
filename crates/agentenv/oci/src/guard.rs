//! Which addresses a pull or push may connect to. Loopback, private (RFC 1918, IPv6 ULA),
//! link-local (cloud metadata), CGNAT, multicast and unspecified addresses are refused unless the
//! operator allows their range ([`crate::RegistryOptions::allow`]). The check runs at connect time,
//! after name resolution, for every request of a transfer: the registry, its redirects and its token
//! realm, so neither a name that resolves inward nor a redirect reaches the host's own network.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ureq::unversioned::resolver::{DefaultResolver, ResolvedSocketAddrs, Resolver};
use ureq::unversioned::transport::NextTimeout;

/// An address range the operator allows (`10.0.0.0/8`, `127.0.0.1`, `fd00::/8`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AllowedNet {
    addr: IpAddr,
    prefix: u8,
}

impl AllowedNet {
    /// Parses a CIDR or a single address.
    pub fn parse(s: &str) -> Result<AllowedNet, String> {
        let s = s.trim();
        let (a, p) = s.split_once('/').unwrap_or((s, ""));
        let addr: IpAddr = a
            .parse()
            .map_err(|_| format!("{s:?}: not an IP address or CIDR"))?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let prefix = match p {
            "" => max,
            p => p
                .parse()
                .ok()
                .filter(|p| *p <= max)
                .ok_or_else(|| format!("{s:?}: prefix must be 0..={max}"))?,
        };
        Ok(AllowedNet { addr, prefix })
    }

    /// Whether `ip` lies in this range.
    pub fn contains(&self, ip: IpAddr) -> bool {
        let keep = |bits: u32, len: u32| -> u128 {
            match len {
                0 => 0,
                l => u128::MAX << (bits - l.min(bits)),
            }
        };
        match (self.addr, ip) {
            (IpAddr::V4(n), IpAddr::V4(a)) => {
                let m = keep(32, self.prefix.into()) as u32;
                u32::from(n) & m == u32::from(a) & m
            }
            (IpAddr::V6(n), IpAddr::V6(a)) => {
                let m = keep(128, self.prefix.into());
                u128::from(n) & m == u128::from(a) & m
            }
            _ => false,
        }
    }
}

/// Whether `ip` is one of the host's own or its networks' addresses (see the module docs).
pub fn is_internal(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(a) => internal_v4(a),
        IpAddr::V6(a) => match a.to_ipv4_mapped() {
            Some(v4) => internal_v4(v4),
            None => internal_v6(a),
        },
    }
}

fn internal_v4(a: Ipv4Addr) -> bool {
    let cgnat = a.octets()[0] == 100 && (a.octets()[1] & 0xc0) == 64;
    a.is_loopback()
        || a.is_private()
        || a.is_link_local()
        || a.is_unspecified()
        || a.is_broadcast()
        || a.is_multicast()
        || cgnat
        || a.octets()[0] == 0
}

fn internal_v6(a: Ipv6Addr) -> bool {
    let first = a.segments()[0];
    a.is_loopback()
        || a.is_unspecified()
        || a.is_multicast()
        || (first & 0xfe00) == 0xfc00 // unique local
        || (first & 0xffc0) == 0xfe80 // link-local
}

/// The default resolver, less the addresses [`is_internal`] refuses and `allow` does not cover.
#[derive(Debug)]
pub(crate) struct GuardedResolver {
    pub(crate) allow: Vec<AllowedNet>,
}

impl Resolver for GuardedResolver {
    fn resolve(
        &self,
        uri: &ureq::http::Uri,
        config: &ureq::config::Config,
        timeout: NextTimeout,
    ) -> Result<ResolvedSocketAddrs, ureq::Error> {
        let all = DefaultResolver::default().resolve(uri, config, timeout)?;
        let mut out = self.empty();
        let mut refused = None;
        for a in all.iter() {
            if !is_internal(a.ip()) || self.allow.iter().any(|n| n.contains(a.ip())) {
                out.push(*a);
            } else {
                refused = Some(a.ip());
            }
        }
        match (out.is_empty(), refused) {
            (true, Some(ip)) => Err(ureq::Error::Io(std::io::Error::new(
                std::io::ErrorKind::PermissionDenied,
                format!(
                    "{} is {ip}, an internal address (loopback, private, link-local or CGNAT); \
                     the operator may allow its range (--registry-allow)",
                    uri.host().unwrap_or("the host")
                ),
            ))),
            _ => Ok(out),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn internal_addresses_and_allowed_ranges() {
        for a in [
            "127.0.0.1",
            "10.1.2.3",
            "172.20.0.1",
            "192.168.1.1",
            "169.254.169.254",
            "100.100.100.200",
            "0.0.0.0",
            "224.0.0.1",
            "::1",
            "fd00::1",
            "fe80::1",
            "::ffff:127.0.0.1",
            "::ffff:169.254.169.254",
        ] {
            assert!(is_internal(a.parse().unwrap()), "{a}");
        }
        for a in ["203.0.113.80", "8.8.8.8", "100.128.0.1", "2001:db8::1"] {
            assert!(!is_internal(a.parse().unwrap()), "{a}");
        }
        let n = AllowedNet::parse("127.0.0.1").unwrap();
        assert!(n.contains("127.0.0.1".parse().unwrap()));
        assert!(!n.contains("127.0.0.2".parse().unwrap()));
        let n = AllowedNet::parse("10.0.0.0/8").unwrap();
        assert!(
            n.contains("10.9.9.9".parse().unwrap()) && !n.contains("11.0.0.1".parse().unwrap())
        );
        assert!(
            AllowedNet::parse("fd00::/8")
                .unwrap()
                .contains("fd12::1".parse().unwrap())
        );
        assert!(
            AllowedNet::parse("0.0.0.0/0")
                .unwrap()
                .contains("1.2.3.4".parse().unwrap())
        );
        assert!(AllowedNet::parse("10.0.0.0/33").is_err() && AllowedNet::parse("x").is_err());
    }
}
