//! `--network`: the bench's own test internet (a namespace with a byte source and sink, reached by
//! a veth the server uses as its uplink) and the guest's throughput to it.

use std::io::{Read, Write};
use std::net::TcpListener;

use agentenv_runtime::net::NetError;
use agentenv_runtime::net::testnet::TestInternet;
use anyhow::bail;
use k3_common::report::Figure;
use k3_common::stats;

/// Last octet of the source (port 9000: sends the byte count it reads) and sink (9001: reads to EOF)
/// in the test internet's range.
const SERVER: u8 = 10;
const MIB: usize = 64;

/// The test internet with the byte source and sink, not yet routed from the host
/// ([`TestInternet::route`] once the default template is built).
pub fn up() -> anyhow::Result<TestInternet> {
    let inet = TestInternet::up(&[SERVER])?;
    let addr = inet.addr(SERVER);
    for (port, serve) in [(9000u16, source as fn(std::net::TcpStream)), (9001, sink)] {
        let l = inet.in_ns(move || {
            TcpListener::bind((addr, port)).map_err(|e| NetError::Tool {
                program: "bind".into(),
                detail: e.to_string(),
            })
        })?;
        std::thread::spawn(move || {
            for c in l.incoming().flatten() {
                std::thread::spawn(move || serve(c));
            }
        });
    }
    Ok(inet)
}

fn source(mut c: std::net::TcpStream) {
    let mut line = [0u8; 32];
    let n = c.read(&mut line).unwrap_or(0);
    let want: usize = String::from_utf8_lossy(&line[..n])
        .trim()
        .parse()
        .unwrap_or(0);
    let buf = vec![0x5au8; 1 << 16];
    let mut left = want.min(1 << 30);
    while left > 0 {
        let k = left.min(buf.len());
        if c.write_all(&buf[..k]).is_err() {
            return;
        }
        left -= k;
    }
}

fn sink(mut c: std::net::TcpStream) {
    let mut buf = vec![0u8; 1 << 16];
    let mut total = 0usize;
    while let Ok(n) = c.read(&mut buf) {
        if n == 0 {
            break;
        }
        total += n;
    }
    let _ = c.write_all(total.to_string().as_bytes());
}

/// Guest-side Python: three timed downloads and uploads of 64 MiB; prints `down MB/s` and `up MB/s`.
fn script(server: std::net::Ipv4Addr) -> String {
    format!(
        r#"python3 - <<'PY'
import socket, time
N = {MIB} << 20
for _ in range(3):
    s = socket.create_connection(("{server}", 9000)); s.sendall(b"%d\n" % N)
    t, got = time.monotonic(), 0
    while True:
        b = s.recv(1 << 16)
        if not b: break
        got += len(b)
    dt = time.monotonic() - t
    assert got == N, got
    print("down", N / dt / 1e6)
    s = socket.create_connection(("{server}", 9001)); chunk = b"z" * (1 << 16)
    t = time.monotonic()
    for _ in range(N >> 16): s.sendall(chunk)
    s.shutdown(socket.SHUT_WR); ack = s.recv(64)
    dt = time.monotonic() - t
    assert int(ack) == N, ack
    print("up", N / dt / 1e6)
PY"#
    )
}

/// Throughput figures of a sandbox (`id`, `token`) to the test internet.
pub async fn throughput(
    http: &super::Http,
    inet: &TestInternet,
    id: &str,
    token: &str,
) -> anyhow::Result<Vec<Figure>> {
    let out = http.run(id, token, &script(inet.addr(SERVER))).await?;
    let pick = |dir: &str| -> Vec<f64> {
        out.lines()
            .filter_map(|l| l.strip_prefix(dir)?.trim().parse().ok())
            .collect()
    };
    let (down, up) = (pick("down "), pick("up "));
    if down.len() != 3 || up.len() != 3 {
        bail!("throughput script printed {out:?}");
    }
    let fig = |name: &str, v: &[f64]| {
        Figure::new(
            name,
            stats::median(v),
            "MB/s",
            k3_common::report::Better::Higher,
        )
        .param("bytes", format!("{MIB} MiB"))
        .param("runs", v.len())
    };
    Ok(vec![
        fig(
            "guest download from the test internet (TCP, timed in the guest)",
            &down,
        ),
        fig(
            "guest upload to the test internet (TCP, timed in the guest)",
            &up,
        ),
    ])
}
