//! The guest's resolver: a UDP DNS forwarder on the slot's gateway. Answers for a name `allow_out`
//! (`deny_out`) lists put their IPv4 addresses into the namespace's `allow_dns` (`deny_dns`) set
//! before the guest sees them, so a domain rule holds for the addresses the guest connects to.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use tokio::net::UdpSocket;

use super::policy::{EgressPolicy, TABLE};
use super::slot::{self, SlotAddrs};

/// Largest DNS message handled.
const MAX_MSG: usize = 4096;
/// Deadline of one upstream query.
const UPSTREAM_DEADLINE: Duration = Duration::from_secs(3);
/// Shortest time an address learnt from an answer stays in a set.
const MIN_TTL_S: u32 = 60;
/// Longest.
const MAX_TTL_S: u32 = 3600;

/// A parsed response: the question's name and its IPv4 answers with TTLs.
#[derive(Debug, PartialEq, Eq)]
pub struct Answer {
    pub name: String,
    pub addrs: Vec<(Ipv4Addr, u32)>,
}

fn name_at(msg: &[u8], mut pos: usize) -> Option<(String, usize)> {
    let mut labels = Vec::new();
    let mut end = None;
    for _ in 0..128 {
        let len = *msg.get(pos)? as usize;
        match len {
            0 => {
                let name = labels.join(".").to_ascii_lowercase();
                return Some((name, end.unwrap_or(pos + 1)));
            }
            l if l & 0xc0 == 0xc0 => {
                let ptr = ((l & 0x3f) << 8) | *msg.get(pos + 1)? as usize;
                end.get_or_insert(pos + 2);
                pos = ptr;
            }
            l if l <= 63 => {
                let label = msg.get(pos + 1..pos + 1 + l)?;
                labels.push(String::from_utf8_lossy(label).into_owned());
                pos += 1 + l;
            }
            _ => return None,
        }
    }
    None
}

/// The question's name of a query or response.
pub fn question(msg: &[u8]) -> Option<String> {
    (msg.len() >= 12 && u16::from_be_bytes([msg[4], msg[5]]) >= 1).then_some(())?;
    name_at(msg, 12).map(|(n, _)| n)
}

/// Parses a response's question and A records; `None` for a malformed message.
pub fn parse_response(msg: &[u8]) -> Option<Answer> {
    if msg.len() < 12 {
        return None;
    }
    let qd = u16::from_be_bytes([msg[4], msg[5]]);
    let an = u16::from_be_bytes([msg[6], msg[7]]);
    let mut pos = 12;
    let mut name = String::new();
    for i in 0..qd {
        let (n, p) = name_at(msg, pos)?;
        if i == 0 {
            name = n;
        }
        pos = p + 4;
    }
    let mut addrs = Vec::new();
    for _ in 0..an {
        let (_, p) = name_at(msg, pos)?;
        let h = msg.get(p..p + 10)?;
        let ty = u16::from_be_bytes([h[0], h[1]]);
        let ttl = u32::from_be_bytes([h[4], h[5], h[6], h[7]]);
        let len = u16::from_be_bytes([h[8], h[9]]) as usize;
        let data = msg.get(p + 10..p + 10 + len)?;
        if ty == 1 && len == 4 {
            addrs.push((Ipv4Addr::new(data[0], data[1], data[2], data[3]), ttl));
        }
        pos = p + 10 + len;
    }
    Some(Answer { name, addrs })
}

const SERVFAIL: u8 = 2;
const REFUSED: u8 = 5;

/// An answer to `query` with no records and response code `rcode` (same id and question).
fn empty_answer(query: &[u8], rcode: u8) -> Vec<u8> {
    let mut r = query.to_vec();
    if r.len() >= 12 {
        r[2] = 0x80 | (query[2] & 0x01); // QR, keep RD
        r[3] = 0x80 | rcode; // RA
        r[6..12].fill(0);
    }
    r
}

/// What the resolver does with a query for `name` under `policy`.
#[derive(Debug, PartialEq, Eq)]
pub enum Handling {
    /// Ask upstream and pass the answer on.
    Forward,
    /// Ask upstream (so the addresses join `deny_dns`) but answer REFUSED.
    ForwardAndRefuse,
    /// Answer REFUSED without asking: with all egress blocked, only names `allow_out` covers resolve
    /// (no DNS tunnel out of a sandbox without internet).
    Refuse,
}

/// The handling of a query for `name`.
pub fn handling(policy: &EgressPolicy, name: &str) -> Handling {
    match policy.name_verdict(name) {
        Some(true) => Handling::Forward,
        Some(false) => Handling::ForwardAndRefuse,
        None if policy.internet_blocked() => Handling::Refuse,
        None => Handling::Forward,
    }
}

async fn ask_upstream(query: &[u8], upstream: &[SocketAddr]) -> Option<Vec<u8>> {
    for up in upstream {
        let Ok(sock) = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0)).await else {
            continue;
        };
        if sock.send_to(query, up).await.is_err() {
            continue;
        }
        let mut buf = vec![0u8; MAX_MSG];
        let got = tokio::time::timeout(UPSTREAM_DEADLINE, async {
            loop {
                let (n, from) = sock.recv_from(&mut buf).await.ok()?;
                if from == *up && n >= 2 && buf[..2] == query[..2] {
                    return Some(n);
                }
            }
        })
        .await;
        if let Ok(Some(n)) = got {
            buf.truncate(n);
            return Some(buf);
        }
    }
    None
}

/// Puts the addresses of `answer` into the set its name's verdict picks (none without a verdict).
fn learn(a: SlotAddrs, policy: &EgressPolicy, answer: &Answer) {
    let Some(allow) = policy.name_verdict(&answer.name) else {
        return;
    };
    if answer.addrs.is_empty() {
        return;
    }
    let set = if allow { "allow_dns" } else { "deny_dns" };
    let elems: Vec<String> = answer
        .addrs
        .iter()
        .map(|(ip, ttl)| format!("{ip} timeout {}s", ttl.clamp(&MIN_TTL_S, &MAX_TTL_S)))
        .collect();
    let script = format!(
        "add element inet {TABLE} {set} {{ {} }}\n",
        elems.join(", ")
    );
    let ns = a.netns();
    if let Err(e) = slot::in_netns(&ns, move || {
        slot::run_tool("nft", &["-f", "-"], &script).map(|_| ())
    }) {
        tracing::warn!(netns = %ns, error = %e, "recording a resolved address failed");
    }
}

/// Serves the guest's queries on `sock` until it is dropped (the slot is released).
pub fn serve(
    a: SlotAddrs,
    sock: std::net::UdpSocket,
    policy: Arc<RwLock<EgressPolicy>>,
    upstream: Arc<Vec<SocketAddr>>,
) -> Result<tokio::task::JoinHandle<()>, std::io::Error> {
    let sock = Arc::new(UdpSocket::from_std(sock)?);
    Ok(tokio::spawn(async move {
        let mut buf = vec![0u8; MAX_MSG];
        loop {
            let Ok((n, from)) = sock.recv_from(&mut buf).await else {
                return;
            };
            let query = buf[..n].to_vec();
            let Some(name) = question(&query) else {
                continue;
            };
            let (sock, policy, upstream) = (sock.clone(), policy.clone(), upstream.clone());
            tokio::spawn(async move {
                let p = policy.read().unwrap_or_else(|e| e.into_inner()).clone();
                let how = handling(&p, &name);
                let reply = match how {
                    Handling::Refuse => empty_answer(&query, REFUSED),
                    _ => match ask_upstream(&query, &upstream).await {
                        Some(r) => {
                            if let Some(ans) = parse_response(&r) {
                                let _ =
                                    tokio::task::spawn_blocking(move || learn(a, &p, &ans)).await;
                            }
                            match how {
                                Handling::ForwardAndRefuse => empty_answer(&query, REFUSED),
                                _ => r,
                            }
                        }
                        None => empty_answer(&query, SERVFAIL),
                    },
                };
                let _ = sock.send_to(&reply, from).await;
            });
        }
    }))
}

/// The host's resolvers (`/etc/resolv.conf`, IPv4 only), port 53.
pub fn host_resolvers() -> Vec<SocketAddr> {
    std::fs::read_to_string("/etc/resolv.conf")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().strip_prefix("nameserver"))
        .filter_map(|s| s.trim().parse::<Ipv4Addr>().ok())
        .filter(|ip| !ip.is_loopback())
        .map(|ip| SocketAddr::from((ip, 53)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A response for `name` with the given A records, a CNAME first, names compressed.
    fn response(name: &str, addrs: &[[u8; 4]]) -> Vec<u8> {
        let mut m = vec![
            0x12,
            0x34,
            0x81,
            0x80,
            0,
            1,
            0,
            (addrs.len() + 1) as u8,
            0,
            0,
            0,
            0,
        ];
        for l in name.split('.') {
            m.push(l.len() as u8);
            m.extend_from_slice(l.as_bytes());
        }
        m.extend_from_slice(&[0, 0, 1, 0, 1]);
        // CNAME answer pointing at the question (offset 12).
        m.extend_from_slice(&[0xc0, 12, 0, 5, 0, 1, 0, 0, 0, 30, 0, 2, 0xc0, 12]);
        for a in addrs {
            m.extend_from_slice(&[0xc0, 12, 0, 1, 0, 1, 0, 0, 1, 44, 0, 4]);
            m.extend_from_slice(a);
        }
        m
    }

    #[test]
    fn responses_parse_with_compression_and_garbage_is_refused() {
        let r = response("Api.Example.test", &[[1, 2, 3, 4], [5, 6, 7, 8]]);
        let a = parse_response(&r).unwrap();
        assert_eq!(a.name, "api.example.test");
        assert_eq!(
            a.addrs,
            vec![
                (Ipv4Addr::new(1, 2, 3, 4), 300),
                (Ipv4Addr::new(5, 6, 7, 8), 300)
            ]
        );
        assert_eq!(question(&r).as_deref(), Some("api.example.test"));
        for cut in 0..r.len() - 1 {
            let _ = parse_response(&r[..cut]); // never panics
        }
        assert!(parse_response(&r[..r.len() - 1]).is_none());
        // A pointer loop ends.
        let mut evil = r.clone();
        evil[12] = 0xc0;
        evil[13] = 12;
        assert!(question(&evil).is_none());
        let f = empty_answer(&r, SERVFAIL);
        assert_eq!((f[0], f[1], f[3] & 0x0f), (0x12, 0x34, 2));
    }

    #[test]
    fn without_internet_only_allowed_names_resolve() {
        let p = |i, a: &[&str], d: &[&str]| {
            let v = |x: &[&str]| x.iter().map(|s| s.to_string()).collect::<Vec<_>>();
            EgressPolicy::from_e2b(i, &v(a), &v(d)).unwrap()
        };
        let closed = p(false, &["ok.test"], &[]);
        assert_eq!(handling(&closed, "ok.test"), Handling::Forward);
        assert_eq!(handling(&closed, "exfil.evil.test"), Handling::Refuse);
        let open = p(true, &[], &["*.bad.test"]);
        assert_eq!(handling(&open, "x.bad.test"), Handling::ForwardAndRefuse);
        assert_eq!(handling(&open, "fine.test"), Handling::Forward);
    }
}
