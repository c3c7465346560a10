//! The test internet never changes the host's view of a real destination: the package mirror keeps
//! answering while test internets come and go, and a crashed run leaves no namespace, route or rule.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use agentenv_runtime::net::NetError;
use agentenv_runtime::net::testnet::{self, TestInternet};

const METADATA: Ipv4Addr = Ipv4Addr::new(169, 254, 169, 254);

/// Why this host cannot run the test (`None`: it can); fails instead under `K3_REQUIRE_KVM=1`.
fn blocker() -> Option<String> {
    let why = k3_common::netcheck::sandbox_network_blocker()?;
    k3_common::require::skip_part(
        k3_common::require::Part::Network,
        "testnet",
        format!("test internets need sandbox networking: {why}"),
    );
    Some(why)
}

fn ip(args: &[&str]) -> String {
    agentenv_runtime::net::slot::run_tool("ip", args, "").unwrap_or_default()
}

/// A server on `port` of address `host` inside the internet, and one round trip to it from the host.
fn round_trip(inet: &TestInternet, host: u8, port: u16) {
    let addr = inet.addr(host);
    let l = inet
        .in_ns(move || {
            TcpListener::bind((addr, port)).map_err(|e| NetError::Tool {
                program: "bind".into(),
                detail: e.to_string(),
            })
        })
        .unwrap();
    let server = std::thread::spawn(move || {
        let (mut c, _) = l.accept().unwrap();
        c.write_all(b"hello").unwrap();
    });
    let mut c = TcpStream::connect_timeout(&(addr, port).into(), Duration::from_secs(5)).unwrap();
    let mut got = String::new();
    c.read_to_string(&mut got).unwrap();
    assert_eq!(got, "hello");
    server.join().unwrap();
}

#[test]
fn the_package_mirror_keeps_answering_while_test_internets_come_and_go() {
    if blocker().is_some() {
        return;
    }
    let release = format!(
        "{}/dists/bookworm/Release",
        agentenv_runtime::image::rootfs::mirror().trim_end_matches('/')
    );
    let probe = Command::new("curl")
        .args(["-sS", "-I", "-o", "/dev/null", "-m", "10", &release])
        .status();
    if !probe.is_ok_and(|s| s.success()) {
        // No mirror to shadow; the picker's own tests still run.
        k3_common::require::skip_part(
            k3_common::require::Part::Network,
            "the_package_mirror_keeps_answering_while_test_internets_come_and_go",
            format!("the package mirror {release} does not answer from here"),
        );
        return;
    }
    // Another process fetching from the mirror the whole time.
    let script = format!(
        "while :; do curl -sS -I -o /dev/null -m 5 -w '%{{http_code}}\\n' '{release}' || echo FAIL; sleep 0.05; done"
    );
    let mut fetcher = Command::new("sh")
        .args(["-c", &script])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let out = BufReader::new(fetcher.stdout.take().unwrap());
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for l in out.lines().map_while(Result::ok) {
            if tx.send(l).is_err() {
                break;
            }
        }
    });
    let first = rx.recv_timeout(Duration::from_secs(15)).unwrap();
    let mut results = vec![first];
    let mut picked = Vec::new();
    for round in 0..3 {
        let mut inet = TestInternet::up(&[10, 53]).unwrap();
        inet.route(&[]).unwrap();
        picked.push(inet.range());
        round_trip(&inet, 10, 9000 + round);
        // Fetches go on while the internet is routed.
        let until = Instant::now() + Duration::from_secs(2);
        while Instant::now() < until {
            results.extend(rx.recv_timeout(Duration::from_millis(500)).ok());
        }
    }
    let until = Instant::now() + Duration::from_secs(1);
    while Instant::now() < until {
        results.extend(rx.recv_timeout(Duration::from_millis(200)).ok());
    }
    let _ = fetcher.kill();
    let _ = fetcher.wait();
    assert!(results.len() >= 6, "too few fetches: {results:?}");
    assert!(
        results.iter().all(|r| r == "200"),
        "a mirror fetch failed while a test internet ({:?}) existed: {results:?}",
        picked.iter().map(|r| r.to_string()).collect::<Vec<_>>()
    );
    // Every round removed its routes.
    for r in picked {
        assert_eq!(
            ip(&["-4", "route", "show", &r.to_string()]).trim(),
            "",
            "{r}"
        );
    }
}

/// The child of [`a_crashed_run_leaves_no_namespace_route_or_rule`]: makes a routed internet, says
/// where, and waits to be killed.
#[test]
fn crashing_child() {
    if std::env::var("K3_TESTNET_CRASH_CHILD").is_err() {
        return;
    }
    let mut inet = TestInternet::up(&[10]).unwrap();
    inet.route(&[METADATA]).unwrap();
    println!("UP {} {}", inet.ns(), inet.range());
    std::io::stdout().flush().unwrap();
    std::thread::sleep(Duration::from_secs(120));
}

#[test]
fn a_crashed_run_leaves_no_namespace_route_or_rule() {
    if blocker().is_some() {
        return;
    }
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "crashing_child",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("K3_TESTNET_CRASH_CHILD", "1")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let up = loop {
        let l = lines
            .next()
            .expect("the child ended before its internet was up")
            .unwrap();
        // libtest prints the test's name on the same line first.
        if let Some((_, rest)) = l.split_once("UP ") {
            break rest.to_owned();
        }
    };
    let (ns, range) = up.split_once(' ').unwrap();
    assert!(
        ip(&["-4", "route", "show", range]).contains("via"),
        "{range} not routed"
    );
    assert!(ip(&["rule"]).contains(&format!("to {METADATA}")));
    child.kill().unwrap();
    child.wait().unwrap();
    // The next run sweeps what the dead one left.
    testnet::sweep_stale();
    assert!(
        !std::path::Path::new("/run/netns").join(ns).exists(),
        "{ns} left"
    );
    assert_eq!(ip(&["-4", "route", "show", range]).trim(), "", "route left");
    assert!(
        !ip(&["rule"]).contains(&format!("to {METADATA}")),
        "rule left"
    );
}
