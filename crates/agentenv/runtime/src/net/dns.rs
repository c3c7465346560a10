//! The guest's resolver: a UDP DNS forwarder on the slot's gateway. Answers for a name `allow_out`
//! (`deny_out`) lists put their IPv4 addresses into the namespace's `allow_dns` (`deny_dns`) set
//! before the guest sees them, so a domain rule holds for the addresses the guest connects to.

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use tokio::net::UdpSocket;
use tokio::sync::{OnceCell, Semaphore, oneshot};

use super::policy::{EgressPolicy, TABLE};
use super::slot::{self, SlotAddrs};

/// Largest DNS message handled.
const MAX_MSG: usize = 4096;
/// Deadline of one upstream query.
const UPSTREAM_DEADLINE: Duration = Duration::from_secs(3);
/// When an unanswered upstream query is sent again (once).
const RESEND_AFTER: Duration = Duration::from_secs(1);
/// Shortest time an address learnt from an answer stays in a set.
const MIN_TTL_S: u32 = 60;
/// Longest.
const MAX_TTL_S: u32 = 3600;
/// Queries of one sandbox in flight at once; more are answered SERVFAIL at once.
pub const MAX_IN_FLIGHT: usize = 32;
/// Queries per second one sandbox may send, with bursts of twice as many; more are dropped.
pub const QUERY_RATE: f64 = 200.0;
/// Host sockets of the shared upstream pool (every sandbox's queries go out through these).
const POOL_SOCKETS: usize = 4;
/// Queries in flight upstream for the whole host; more are answered SERVFAIL.
const MAX_PENDING: usize = 4096;

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

/// The answer to `query` for a name of the sandbox domain: `addr` for an A question, no records
/// for another type; authoritative, TTL 60 s.
fn local_answer(query: &[u8], addr: Ipv4Addr) -> Option<Vec<u8>> {
    let (_, end) = name_at(query, 12)?;
    let q = query.get(..end + 4)?;
    let a_question = q[end..end + 4] == [0, 1, 0, 1];
    let mut r = q.to_vec();
    r[2] = 0x84 | (query[2] & 0x01); // QR, AA, keep RD
    r[3] = 0x80; // RA
    r[4..12].copy_from_slice(&[0, 1, 0, a_question as u8, 0, 0, 0, 0]);
    if a_question {
        r.extend_from_slice(&[0xc0, 12, 0, 1, 0, 1, 0, 0, 0, 60, 0, 4]);
        r.extend_from_slice(&addr.octets());
    }
    Some(r)
}

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

/// The upstream resolvers and the host's few sockets to them, shared by every sandbox: a query goes
/// out under a fresh random id (restored in the answer), and only an answer from the server asked,
/// with that id, completes it.
pub struct Upstream {
    servers: Vec<SocketAddr>,
    socks: OnceCell<Vec<Arc<UdpSocket>>>,
    pending: Arc<Mutex<HashMap<(usize, u16), Pending>>>,
    next: AtomicUsize,
}

struct Pending {
    server: SocketAddr,
    reply: oneshot::Sender<Vec<u8>>,
}

impl Upstream {
    pub fn new(servers: Vec<SocketAddr>) -> Upstream {
        Upstream {
            servers,
            socks: OnceCell::new(),
            pending: Arc::new(Mutex::new(HashMap::new())),
            next: AtomicUsize::new(0),
        }
    }

    /// Queries in flight upstream now.
    pub fn in_flight(&self) -> usize {
        self.pending.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    async fn sockets(&self) -> Option<&Vec<Arc<UdpSocket>>> {
        self.socks
            .get_or_try_init(|| async {
                let mut socks = Vec::with_capacity(POOL_SOCKETS);
                for i in 0..POOL_SOCKETS {
                    let s = Arc::new(UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0)).await?);
                    tokio::spawn(read_answers(i, s.clone(), self.pending.clone()));
                    socks.push(s);
                }
                Ok::<_, std::io::Error>(socks)
            })
            .await
            .map_err(|e| tracing::warn!(error = %e, "the resolver's upstream sockets"))
            .ok()
    }

    /// The answer to `query` from the first server that gives one in time.
    pub async fn ask(&self, query: &[u8]) -> Option<Vec<u8>> {
        if query.len() < 12 {
            return None;
        }
        let socks = self.sockets().await?;
        for server in &self.servers {
            let i = self.next.fetch_add(1, Ordering::Relaxed) % socks.len();
            let (tx, rx) = oneshot::channel();
            let id = {
                let mut p = self.pending.lock().unwrap_or_else(|e| e.into_inner());
                if p.len() >= MAX_PENDING {
                    return None;
                }
                let id = (0..8)
                    .map(|_| rand_id())
                    .find(|id| !p.contains_key(&(i, *id)))?;
                p.insert(
                    (i, id),
                    Pending {
                        server: *server,
                        reply: tx,
                    },
                );
                id
            };
            let mut q = query.to_vec();
            q[..2].copy_from_slice(&id.to_be_bytes());
            let got = ask_once(&socks[i], &q, *server, rx).await;
            if let Some(mut r) = got {
                r[..2].copy_from_slice(&query[..2]);
                return Some(r);
            }
            self.pending
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&(i, id));
        }
        None
    }
}

/// Sends `q` to `server` and waits for its answer on `rx`: UDP may drop a datagram on a busy host,
/// so an unanswered query is sent once more after [`RESEND_AFTER`], all within [`UPSTREAM_DEADLINE`].
async fn ask_once(
    sock: &UdpSocket,
    q: &[u8],
    server: SocketAddr,
    mut rx: oneshot::Receiver<Vec<u8>>,
) -> Option<Vec<u8>> {
    let deadline = tokio::time::Instant::now() + UPSTREAM_DEADLINE;
    let mut sent = sock.send_to(q, server).await.is_ok();
    if let Ok(r) = tokio::time::timeout(RESEND_AFTER, &mut rx).await {
        return r.ok();
    }
    sent |= sock.send_to(q, server).await.is_ok();
    if !sent {
        return None;
    }
    tokio::time::timeout_at(deadline, rx).await.ok()?.ok()
}

fn rand_id() -> u16 {
    let mut b = [0u8; 2];
    // SAFETY: getrandom writes at most `b.len()` bytes into `b`.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    if n != 2 {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        return (t as u16) ^ ((t >> 16) as u16);
    }
    u16::from_be_bytes(b)
}

/// Hands answers arriving on socket `i` of the pool to the queries waiting for them.
async fn read_answers(
    i: usize,
    sock: Arc<UdpSocket>,
    pending: Arc<Mutex<HashMap<(usize, u16), Pending>>>,
) {
    let mut buf = vec![0u8; MAX_MSG];
    loop {
        let Ok((n, from)) = sock.recv_from(&mut buf).await else {
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        if n < 12 {
            continue;
        }
        let id = u16::from_be_bytes([buf[0], buf[1]]);
        let mut p = pending.lock().unwrap_or_else(|e| e.into_inner());
        // Only the server asked may answer (others' datagrams leave the query waiting).
        if p.get(&(i, id)).is_some_and(|w| w.server == from)
            && let Some(w) = p.remove(&(i, id))
        {
            let _ = w.reply.send(buf[..n].to_vec());
        }
    }
}

/// A token bucket of one sandbox's queries.
struct RateLimit {
    tokens: f64,
    last: Instant,
}

impl RateLimit {
    fn take(&mut self) -> bool {
        let now = Instant::now();
        let burst = 2.0 * QUERY_RATE;
        self.tokens =
            (self.tokens + now.duration_since(self.last).as_secs_f64() * QUERY_RATE).min(burst);
        self.last = now;
        if self.tokens < 1.0 {
            return false;
        }
        self.tokens -= 1.0;
        true
    }
}

/// Puts the addresses of `answer` into the set its name's verdict picks (none without a verdict).
fn learn(a: SlotAddrs, policy: &EgressPolicy, answer: &Answer) {
    let mut sets = Vec::new();
    match policy.name_verdict(&answer.name) {
        Some(true) => sets.push("allow_dns"),
        Some(false) => sets.push("deny_dns"),
        None => {}
    }
    if policy.has_rule_for(&answer.name) {
        sets.push("transform_dns");
    }
    if answer.addrs.is_empty() || sets.is_empty() {
        return;
    }
    let elems: Vec<String> = answer
        .addrs
        .iter()
        .map(|(ip, ttl)| format!("{ip} timeout {}s", ttl.clamp(&MIN_TTL_S, &MAX_TTL_S)))
        .collect();
    let script: String = sets
        .iter()
        .map(|set| {
            format!(
                "add element inet {TABLE} {set} {{ {} }}\n",
                elems.join(", ")
            )
        })
        .collect();
    let ns = a.netns();
    if let Err(e) = slot::in_netns(&ns, move || {
        slot::run_tool("nft", &["-f", "-"], &script).map(|_| ())
    }) {
        tracing::warn!(netns = %ns, error = %e, "recording a resolved address failed");
    }
}

/// Serves the guest's queries on `sock` until it is dropped (the slot is released): at most
/// [`QUERY_RATE`] a second (more are dropped) and [`MAX_IN_FLIGHT`] at once (more answer SERVFAIL),
/// through the host's shared [`Upstream`].
/// Names under `local` (the sandbox domain) are answered with the gateway, without asking upstream.
pub fn serve(
    a: SlotAddrs,
    sock: std::net::UdpSocket,
    policy: Arc<RwLock<EgressPolicy>>,
    upstream: Arc<Upstream>,
    local: Option<Arc<str>>,
) -> Result<tokio::task::JoinHandle<()>, std::io::Error> {
    let sock = Arc::new(UdpSocket::from_std(sock)?);
    let in_flight = Arc::new(Semaphore::new(MAX_IN_FLIGHT));
    let mut rate = RateLimit {
        tokens: 2.0 * QUERY_RATE,
        last: Instant::now(),
    };
    Ok(tokio::spawn(async move {
        let mut buf = vec![0u8; MAX_MSG];
        loop {
            let Ok((n, from)) = sock.recv_from(&mut buf).await else {
                return;
            };
            if !rate.take() {
                continue;
            }
            let query = buf[..n].to_vec();
            let Some(name) = question(&query) else {
                continue;
            };
            let Ok(permit) = in_flight.clone().try_acquire_owned() else {
                let _ = sock.send_to(&empty_answer(&query, SERVFAIL), from).await;
                continue;
            };
            let (sock, policy, upstream) = (sock.clone(), policy.clone(), upstream.clone());
            let local = local.clone();
            tokio::spawn(async move {
                let _permit = permit;
                let p = policy.read().unwrap_or_else(|e| e.into_inner()).clone();
                if local.is_some_and(|d| agentenv_vm::egress::in_domain(&name, &d)) {
                    let reply = match p.name_allowed(&name) {
                        true => local_answer(&query, a.gateway),
                        false => None,
                    };
                    let reply = reply.unwrap_or_else(|| empty_answer(&query, REFUSED));
                    let _ = sock.send_to(&reply, from).await;
                    return;
                }
                let how = handling(&p, &name);
                let reply = match how {
                    Handling::Refuse => empty_answer(&query, REFUSED),
                    _ => match upstream.ask(&query).await {
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
        let p = crate::net::policy::tests::policy;
        let closed = p(false, &["ok.test"], &[]);
        assert_eq!(handling(&closed, "ok.test"), Handling::Forward);
        assert_eq!(handling(&closed, "exfil.evil.test"), Handling::Refuse);
        let open = p(true, &[], &["*.bad.test"]);
        assert_eq!(handling(&open, "x.bad.test"), Handling::ForwardAndRefuse);
        assert_eq!(handling(&open, "fine.test"), Handling::Forward);
    }

    #[test]
    fn sandbox_domain_names_answer_with_the_gateway() {
        let gw = Ipv4Addr::new(10, 200, 7, 1);
        let q = query(0x4242, "8080-abc.Sbx.test");
        let r = local_answer(&q, gw).unwrap();
        assert_eq!(&r[..2], &[0x42, 0x42]);
        let a = parse_response(&r).unwrap();
        assert_eq!(a.name, "8080-abc.sbx.test");
        assert_eq!(a.addrs, vec![(gw, 60)]);
        let mut aaaa = q.clone();
        let n = aaaa.len();
        aaaa[n - 3] = 28;
        assert!(
            parse_response(&local_answer(&aaaa, gw).unwrap())
                .unwrap()
                .addrs
                .is_empty()
        );
        for cut in 0..q.len() {
            assert!(local_answer(&q[..cut], gw).is_none(), "{cut}");
        }
    }

    /// A loopback "upstream" that answers each query with its id and question after `delay`, plus
    /// a spoofed answer from another socket first.
    async fn upstream_server(delay: Duration) -> (SocketAddr, Arc<UdpSocket>) {
        let s = Arc::new(UdpSocket::bind("127.0.0.1:0").await.unwrap());
        let spoofer = Arc::new(UdpSocket::bind("127.0.0.1:0").await.unwrap());
        let addr = s.local_addr().unwrap();
        let srv = s.clone();
        tokio::spawn(async move {
            let mut buf = vec![0u8; MAX_MSG];
            loop {
                let (n, from) = srv.recv_from(&mut buf).await.unwrap();
                let mut r = buf[..n].to_vec();
                r[2] |= 0x80;
                let (srv, spoofer) = (srv.clone(), spoofer.clone());
                tokio::spawn(async move {
                    let mut fake = r.clone();
                    fake.push(0xee);
                    let _ = spoofer.send_to(&fake, from).await;
                    tokio::time::sleep(delay).await;
                    let _ = srv.send_to(&r, from).await;
                });
            }
        });
        (addr, s)
    }

    fn query(id: u16, name: &str) -> Vec<u8> {
        let mut m = id.to_be_bytes().to_vec();
        m.extend_from_slice(&[1, 0, 0, 1, 0, 0, 0, 0, 0, 0]);
        for l in name.split('.') {
            m.push(l.len() as u8);
            m.extend_from_slice(l.as_bytes());
        }
        m.extend_from_slice(&[0, 0, 1, 0, 1]);
        m
    }

    /// Whether this is the process that should run test `name`: tests that count the process's
    /// descriptors run alone in a child (the test binary again, that test only), so no other test's
    /// descriptors are counted. In the parent it runs the child, asserts it passed and returns false.
    fn alone(name: &str) -> bool {
        const CHILD: &str = "K3_DNS_FD_CHILD";
        if std::env::var(CHILD).is_ok_and(|v| v == name) {
            return true;
        }
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                &format!("net::dns::tests::{name}"),
                "--test-threads=1",
            ])
            .env(CHILD, name)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && text.contains("1 passed"),
            "{name} in its own process:\n{text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        false
    }

    fn open_fds() -> usize {
        std::fs::read_dir("/proc/self/fd").unwrap().count()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_shared_upstream_matches_answers_to_queries_and_ignores_spoofs() {
        if !alone("the_shared_upstream_matches_answers_to_queries_and_ignores_spoofs") {
            return;
        }
        let (addr, _srv) = upstream_server(Duration::from_millis(20)).await;
        let up = Arc::new(Upstream::new(vec![addr]));
        let fds = open_fds();
        let mut tasks = Vec::new();
        for i in 0..300u16 {
            let up = up.clone();
            tasks.push(tokio::spawn(async move {
                let q = query(i, &format!("n{i}.test"));
                (q.clone(), up.ask(&q).await)
            }));
        }
        for t in tasks {
            let (q, r) = t.await.unwrap();
            let r = r.expect("an answer");
            assert_eq!(&r[..2], &q[..2], "the guest's id comes back");
            assert_eq!(r.len(), q.len(), "the spoofed (longer) answer was ignored");
            assert_eq!(question(&r), question(&q));
        }
        assert_eq!(up.in_flight(), 0);
        assert!(
            open_fds() <= fds + POOL_SOCKETS + 2,
            "{} fds after, {fds} before",
            open_fds()
        );
    }

    #[tokio::test]
    async fn a_dropped_query_is_sent_again_within_the_deadline() {
        // An upstream that drops the first datagram of every query id.
        let srv = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let addr = srv.local_addr().unwrap();
        let seen = Arc::new(Mutex::new(std::collections::HashSet::new()));
        let counted = seen.clone();
        tokio::spawn(async move {
            let mut buf = vec![0u8; MAX_MSG];
            loop {
                let (n, from) = srv.recv_from(&mut buf).await.unwrap();
                if counted.lock().unwrap().insert([buf[0], buf[1]]) {
                    continue;
                }
                buf[2] |= 0x80;
                let _ = srv.send_to(&buf[..n], from).await;
            }
        });
        let up = Upstream::new(vec![addr]);
        let id = rand_id();
        let q = query(id, "again.test");
        let t = Instant::now();
        let r = up.ask(&q).await.expect("the resent query is answered");
        assert_eq!(&r[..2], &id.to_be_bytes());
        assert_eq!(question(&r), question(&q));
        assert!(
            t.elapsed() >= RESEND_AFTER,
            "answered only after the resend"
        );
        assert_eq!(
            seen.lock().unwrap().len(),
            1,
            "the resend keeps its upstream id"
        );
        assert_eq!(up.in_flight(), 0);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_query_flood_is_rate_limited_and_bounded_in_flight() {
        if !alone("a_query_flood_is_rate_limited_and_bounded_in_flight") {
            return;
        }
        // An upstream that answers late: queries pile up in flight.
        let (addr, _srv) = upstream_server(Duration::from_secs(2)).await;
        let up = Arc::new(Upstream::new(vec![addr]));
        let guest_side = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        guest_side.set_nonblocking(true).unwrap();
        let resolver = guest_side.local_addr().unwrap();
        let policy = Arc::new(RwLock::new(EgressPolicy::default()));
        let task = serve(SlotAddrs::of(0), guest_side, policy, up.clone(), None).unwrap();
        let guest = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let fds = open_fds();
        let sent = 5000u16;
        for i in 0..sent {
            guest
                .send_to(&query(i, &format!("r{i}.flood.test")), resolver)
                .await
                .unwrap();
        }
        let mut servfail_now = 0;
        let mut answered = 0;
        let mut buf = vec![0u8; MAX_MSG];
        let deadline = Instant::now() + Duration::from_secs(6);
        while let Some(left) = deadline.checked_duration_since(Instant::now()) {
            match tokio::time::timeout(left, guest.recv_from(&mut buf)).await {
                Ok(Ok((n, _))) if n >= 4 && buf[3] & 0x0f == SERVFAIL => servfail_now += 1,
                Ok(Ok(_)) => answered += 1,
                _ => break,
            }
        }
        task.abort();
        // At most a burst (plus what the rate refills meanwhile) is handled; the rest is dropped.
        let handled = servfail_now + answered;
        assert!(
            handled <= (2.0 * QUERY_RATE) as usize + 50,
            "{handled} handled of {sent}"
        );
        assert!(answered <= MAX_IN_FLIGHT, "{answered} in flight at once");
        assert!(servfail_now > 0);
        assert!(
            open_fds() <= fds + POOL_SOCKETS + 2,
            "{} fds after, {fds} before",
            open_fds()
        );
    }
}
