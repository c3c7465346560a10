//! `--network`: the bench's own test internet (a namespace with a byte source and sink, reached by
//! a veth the server uses as its uplink) and the guest's throughput to it.

use std::io::{Read, Write};
use std::net::TcpListener;

use anyhow::bail;
use k3_common::report::Figure;
use k3_common::stats;

/// Address of the source (port 9000: sends the byte count it reads) and sink (9001: reads to EOF).
pub const SERVER: &str = "203.0.113.10";
const MIB: usize = 64;

fn ip(args: &[&str]) -> anyhow::Result<()> {
    agentenv_runtime::net::slot::run_tool("ip", args, "")?;
    Ok(())
}

/// The test internet; removed on drop.
pub struct Internet {
    ns: String,
    /// The host end of its veth: the server's `--net-uplink`.
    pub uplink: String,
}

impl Internet {
    pub fn up() -> anyhow::Result<Internet> {
        let tag = std::process::id() % 100_000;
        let (ns, uplink, peer) = (
            format!("k3bench-{tag}"),
            format!("k3b{tag}"),
            format!("k3c{tag}"),
        );
        let me = Internet {
            ns: ns.clone(),
            uplink: uplink.clone(),
        };
        ip(&["netns", "add", &ns])?;
        ip(&[
            "link", "add", &uplink, "type", "veth", "peer", "name", &peer, "netns", &ns,
        ])?;
        ip(&["addr", "add", "198.18.0.1/30", "dev", &uplink])?;
        ip(&["link", "set", &uplink, "up"])?;
        ip(&["-n", &ns, "addr", "add", "198.18.0.2/30", "dev", &peer])?;
        ip(&["-n", &ns, "link", "set", &peer, "up"])?;
        ip(&["-n", &ns, "link", "set", "lo", "up"])?;
        ip(&[
            "-n",
            &ns,
            "addr",
            "add",
            &format!("{SERVER}/32"),
            "dev",
            "lo",
        ])?;
        ip(&["-n", &ns, "route", "add", "default", "via", "198.18.0.1"])?;
        ip(&["route", "replace", "203.0.113.0/24", "via", "198.18.0.2"])?;
        for (port, serve) in [(9000u16, source as fn(std::net::TcpStream)), (9001, sink)] {
            let l = agentenv_runtime::net::slot::in_netns(&ns, move || {
                TcpListener::bind((SERVER, port)).map_err(|e| {
                    agentenv_runtime::net::NetError::Tool {
                        program: "bind".into(),
                        detail: e.to_string(),
                    }
                })
            })?;
            std::thread::spawn(move || {
                for c in l.incoming().flatten() {
                    std::thread::spawn(move || serve(c));
                }
            });
        }
        Ok(me)
    }
}

impl Drop for Internet {
    fn drop(&mut self) {
        let _ = ip(&["route", "del", "203.0.113.0/24"]);
        let _ = ip(&["netns", "del", &self.ns]);
    }
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
fn script() -> String {
    format!(
        r#"python3 - <<'PY'
import socket, time
N = {MIB} << 20
for _ in range(3):
    s = socket.create_connection(("{SERVER}", 9000)); s.sendall(b"%d\n" % N)
    t, got = time.monotonic(), 0
    while True:
        b = s.recv(1 << 16)
        if not b: break
        got += len(b)
    dt = time.monotonic() - t
    assert got == N, got
    print("down", N / dt / 1e6)
    s = socket.create_connection(("{SERVER}", 9001)); chunk = b"z" * (1 << 16)
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
pub async fn throughput(http: &super::Http, id: &str, token: &str) -> anyhow::Result<Vec<Figure>> {
    let out = http.run(id, token, &script()).await?;
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
