//! Session behaviour over in-memory duplex pipes.

use agentenv_mux::frame::{Frame, Kind, MAX_PAYLOAD};
use agentenv_mux::{INITIAL_WINDOW, MuxError, Session};
use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};

fn pair() -> (Session, Session) {
    let (a, b) = tokio::io::duplex(64 * 1024);
    (Session::client(a), Session::server(b))
}

fn random_bytes(n: usize) -> Vec<u8> {
    (0..n).map(|_| rand::random()).collect()
}

/// Echo server: every accepted stream echoes until EOF, then closes.
fn spawn_echo(server: Session) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        while let Some(mut s) = server.accept().await {
            tokio::spawn(async move {
                let mut buf = vec![0u8; 8192];
                loop {
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => {
                            if s.write_all(&buf[..n]).await.is_err() {
                                return;
                            }
                        }
                    }
                }
                let _ = s.shutdown().await;
            });
        }
    })
}

#[tokio::test]
async fn many_concurrent_streams_echo() {
    let (client, server) = pair();
    let _echo = spawn_echo(server);
    let client = std::sync::Arc::new(client);
    let mut tasks = Vec::new();
    for _ in 0..64 {
        let client = client.clone();
        tasks.push(tokio::spawn(async move {
            let data = random_bytes(rand::random_range(1..300_000));
            let s = client.open().await.unwrap();
            let (mut rd, mut wr) = tokio::io::split(s);
            let sent = data.clone();
            let w = tokio::spawn(async move {
                wr.write_all(&sent).await.unwrap();
                wr.shutdown().await.unwrap();
                wr
            });
            let mut got = Vec::new();
            rd.read_to_end(&mut got).await.unwrap();
            let _wr = w.await.unwrap();
            assert_eq!(got, data);
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
}

#[tokio::test]
async fn slow_reader_does_not_block_other_streams() {
    let (client, server) = pair();
    let server = std::sync::Arc::new(server);
    // Stream 1: the server never reads it; the client writes more than a window.
    let mut stalled = client.open().await.unwrap();
    let _held = server.accept().await.unwrap();
    let big = random_bytes(INITIAL_WINDOW as usize * 2);
    let writer = tokio::spawn(async move {
        let r = stalled.write_all(&big).await;
        (r, stalled)
    });
    // Stream 2 still works end to end while stream 1 is stuck on credit.
    let mut live = client.open().await.unwrap();
    let mut live_srv = server.accept().await.unwrap();
    let msg = random_bytes(100_000);
    live.write_all(&msg).await.unwrap();
    live.shutdown().await.unwrap();
    let mut got = Vec::new();
    live_srv.read_to_end(&mut got).await.unwrap();
    assert_eq!(got, msg);
    assert!(
        !writer.is_finished(),
        "writer must be blocked on flow-control credit"
    );
    // Reading stream 1 releases credit and the writer completes.
    let mut held = _held;
    let mut buf = vec![0u8; INITIAL_WINDOW as usize * 2];
    held.read_exact(&mut buf).await.unwrap();
    let (r, _s) = writer.await.unwrap();
    r.unwrap();
}

#[tokio::test]
async fn fin_is_half_close_and_rst_aborts() {
    let (client, server) = pair();
    let mut c = client.open().await.unwrap();
    let mut s = server.accept().await.unwrap();
    c.write_all(b"ping").await.unwrap();
    c.shutdown().await.unwrap();
    let mut got = Vec::new();
    s.read_to_end(&mut got).await.unwrap();
    assert_eq!(got, b"ping");
    // The other direction is still open after the client's FIN.
    s.write_all(b"pong").await.unwrap();
    let mut buf = [0u8; 4];
    c.read_exact(&mut buf).await.unwrap();
    assert_eq!(&buf, b"pong");
    // Dropping without a clean close resets the peer.
    drop(s);
    let mut rest = Vec::new();
    let err = c.read_to_end(&mut rest).await.unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::ConnectionReset);
}

#[tokio::test]
async fn new_hello_resets_the_session() {
    let (mut raw, srv_io) = tokio::io::duplex(256 * 1024);
    let srv = Session::server(srv_io);
    let first: u64 = rand::random();
    let mut out = Vec::new();
    Frame::hello(first).encode_into(&mut out);
    Frame::empty(1, Kind::Open).encode_into(&mut out);
    raw.write_all(&out).await.unwrap();
    let mut s1 = srv.accept().await.unwrap();
    assert_eq!(srv.stream_count(), 1);
    assert_eq!(srv.nonce(), first);
    // The same nonce again (a client retry) keeps the session.
    let mut out = Vec::new();
    Frame::hello(first).encode_into(&mut out);
    Frame::empty(3, Kind::Open).encode_into(&mut out);
    raw.write_all(&out).await.unwrap();
    let _s3 = srv.accept().await.unwrap();
    assert_eq!(srv.stream_count(), 2);
    // A new nonce (host reconnected after a restore) drops every old stream.
    let mut out = Vec::new();
    Frame::hello(first.wrapping_add(1)).encode_into(&mut out);
    raw.write_all(&out).await.unwrap();
    let err = s1.read(&mut [0u8; 4]).await.unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::ConnectionReset);
    assert_eq!(srv.nonce(), first.wrapping_add(1));
    assert_eq!(srv.stream_count(), 0);
}

#[tokio::test]
async fn reconnecting_client_gets_a_fresh_session() {
    let (client_io, server_io) = tokio::io::duplex(64 * 1024);
    let server = Session::server(server_io);
    let _echo = spawn_echo(server);
    let client = Session::client(client_io);
    let mut s = client.open().await.unwrap();
    s.write_all(b"abc").await.unwrap();
    let mut buf = [0u8; 3];
    s.read_exact(&mut buf).await.unwrap();
    assert_eq!(&buf, b"abc");
}

#[tokio::test]
async fn garbage_after_hello_closes_the_session_with_an_error() {
    for garbage in [oversized_header(), random_kind_header()] {
        let (mut raw, srv_io) = tokio::io::duplex(1024);
        let srv = Session::server(srv_io);
        let mut out = Vec::new();
        Frame::hello(rand::random()).encode_into(&mut out);
        out.extend_from_slice(&garbage);
        raw.write_all(&out).await.unwrap();
        assert!(srv.accept().await.is_none());
        let reason = srv.closed().await;
        assert!(reason.contains("protocol violation"), "{reason}");
    }
}

fn oversized_header() -> Vec<u8> {
    let mut h = Vec::new();
    h.extend_from_slice(&1u32.to_be_bytes());
    h.push(Kind::Data as u8);
    h.extend_from_slice(&((MAX_PAYLOAD as u32) + 1).to_be_bytes());
    h
}

fn random_kind_header() -> Vec<u8> {
    let mut h = Vec::new();
    h.extend_from_slice(&rand::random::<u32>().to_be_bytes());
    h.push(rand::random_range(7..=255u8));
    h.extend_from_slice(&4u32.to_be_bytes());
    h
}

#[tokio::test]
async fn client_sees_garbage_as_error() {
    let (client_io, mut raw): (DuplexStream, DuplexStream) = tokio::io::duplex(256 * 1024);
    let client = Session::client(client_io);
    // Read the client's preamble + HELLO, answer with the HELLO ack, then garbage.
    let nonce = agentenv_mux::frame::hunt_hello(&mut tokio::io::BufReader::new(&mut raw))
        .await
        .unwrap()
        .unwrap();
    let mut out = Vec::new();
    Frame::hello(nonce).encode_into(&mut out);
    out.extend_from_slice(&oversized_header());
    raw.write_all(&out).await.unwrap();
    let reason = client.closed().await;
    assert!(reason.contains("exceeds"), "{reason}");
    assert!(matches!(client.open().await, Err(MuxError::Closed(_))));
}

#[tokio::test]
async fn window_overrun_resets_only_that_stream() {
    let (mut raw, srv_io) = tokio::io::duplex(1 << 20);
    let srv = Session::server(srv_io);
    let mut out = Vec::new();
    Frame::hello(1).encode_into(&mut out);
    Frame::empty(1, Kind::Open).encode_into(&mut out);
    Frame::empty(3, Kind::Open).encode_into(&mut out);
    raw.write_all(&out).await.unwrap();
    let mut s1 = srv.accept().await.unwrap();
    let mut s3 = srv.accept().await.unwrap();
    let mut out = Vec::new();
    for _ in 0..(INITIAL_WINDOW as usize / MAX_PAYLOAD + 1) {
        Frame {
            stream_id: 1,
            kind: Kind::Data,
            payload: vec![1u8; MAX_PAYLOAD],
        }
        .encode_into(&mut out);
    }
    Frame {
        stream_id: 3,
        kind: Kind::Data,
        payload: b"ok".to_vec(),
    }
    .encode_into(&mut out);
    Frame::empty(3, Kind::Fin).encode_into(&mut out);
    raw.write_all(&out).await.unwrap();
    let mut got = Vec::new();
    s3.read_to_end(&mut got).await.unwrap();
    assert_eq!(got, b"ok");
    let mut sink = Vec::new();
    assert!(s1.read_to_end(&mut sink).await.is_err());
    assert!(srv.close_reason().is_none());
}

#[tokio::test]
async fn server_skips_a_dirty_channel_before_hello() {
    let (mut raw, srv_io) = tokio::io::duplex(1 << 20);
    let srv = Session::server(srv_io);
    let mut out = random_bytes(5000);
    Frame::hello(42).encode_into(&mut out);
    Frame::empty(5, Kind::Open).encode_into(&mut out);
    Frame {
        stream_id: 5,
        kind: Kind::Data,
        payload: b"hi".to_vec(),
    }
    .encode_into(&mut out);
    raw.write_all(&out).await.unwrap();
    let mut s = srv.accept().await.unwrap();
    let mut buf = [0u8; 2];
    s.read_exact(&mut buf).await.unwrap();
    assert_eq!(&buf, b"hi");
    assert_eq!(srv.nonce(), 42);
}

#[tokio::test]
async fn client_learns_that_the_server_restarted() {
    let (client_io, mut raw) = tokio::io::duplex(256 * 1024);
    let client = Session::client(client_io);
    let nonce = agentenv_mux::frame::hunt_hello(&mut tokio::io::BufReader::new(&mut raw))
        .await
        .unwrap()
        .unwrap();
    let mut out = Vec::new();
    Frame::hello(0).encode_into(&mut out); // a stale restart notice before the ack is ignored
    Frame::hello(nonce).encode_into(&mut out);
    raw.write_all(&out).await.unwrap();
    let s = client.open().await.unwrap();
    // A fresh server session announces itself; the client's old streams are gone.
    let mut out = Vec::new();
    Frame::hello(0).encode_into(&mut out);
    raw.write_all(&out).await.unwrap();
    assert!(client.closed().await.contains("restarted"));
    let mut s = s;
    assert!(s.read(&mut [0u8; 1]).await.is_err());
}

#[tokio::test]
async fn data_and_fin_before_a_reset_stay_readable() {
    // The HTTP server pattern: write the response, shut down, drop, while the client never
    // half-closed its side (so the drop sends RST right after FIN).
    let (client, server) = pair();
    let mut c = client.open().await.unwrap();
    let mut s = server.accept().await.unwrap();
    c.write_all(b"request").await.unwrap();
    let mut req = [0u8; 7];
    s.read_exact(&mut req).await.unwrap();
    let data = random_bytes(rand::random_range(1..INITIAL_WINDOW as usize));
    s.write_all(&data).await.unwrap();
    s.shutdown().await.unwrap();
    drop(s);
    let mut got = Vec::new();
    c.read_to_end(&mut got).await.unwrap();
    assert_eq!(got, data);
}

#[tokio::test]
async fn zeros_after_hello_make_the_server_hunt_again_in_place() {
    let (mut raw, srv_io) = tokio::io::duplex(1 << 20);
    let srv = Session::server(srv_io);
    let mut out = Vec::new();
    Frame::hello(1).encode_into(&mut out);
    out.extend_from_slice(&vec![0u8; MAX_PAYLOAD + 9]);
    Frame::hello(2).encode_into(&mut out);
    Frame::empty(7, Kind::Open).encode_into(&mut out);
    Frame {
        stream_id: 7,
        kind: Kind::Data,
        payload: b"new".to_vec(),
    }
    .encode_into(&mut out);
    raw.write_all(&out).await.unwrap();
    let mut s = srv.accept().await.expect("the session survives a restart");
    let mut buf = [0u8; 3];
    s.read_exact(&mut buf).await.unwrap();
    assert_eq!(&buf, b"new");
    assert_eq!(srv.nonce(), 2);
}

/// A server restored half-way through a frame: its old session read a DATA header and part of the
/// payload from a host that is gone. A new client's first HELLO is swallowed as payload; its retry
/// completes the frame and the session comes up.
#[tokio::test]
async fn client_recovers_a_server_restored_mid_frame() {
    for _ in 0..8 {
        let (mut raw, srv_io) = tokio::io::duplex(1 << 20);
        let srv = Session::server(srv_io);
        let len = rand::random_range(64..MAX_PAYLOAD);
        let mut out = Vec::new();
        Frame::hello(1).encode_into(&mut out);
        Frame::empty(3, Kind::Open).encode_into(&mut out);
        Frame {
            stream_id: 3,
            kind: Kind::Data,
            payload: random_bytes(len),
        }
        .encode_into(&mut out);
        out.truncate(out.len() - rand::random_range(40..len));
        raw.write_all(&out).await.unwrap();
        let _old = srv.accept().await.unwrap();
        let echo = spawn_echo(srv);
        let client = Session::client(raw);
        let mut s = tokio::time::timeout(std::time::Duration::from_secs(10), client.open())
            .await
            .expect("the handshake recovers")
            .unwrap();
        let data = random_bytes(1000);
        s.write_all(&data).await.unwrap();
        let mut got = vec![0u8; data.len()];
        s.read_exact(&mut got).await.unwrap();
        assert_eq!(got, data);
        echo.abort();
    }
}

/// A server at a frame boundary (an idle channel) answers the first HELLO: the handshake needs no
/// retry, so no 64 KiB of zeros cross a slow channel. Time is paused, so a retry would advance it.
#[tokio::test(start_paused = true)]
async fn clean_channel_needs_no_retry() {
    let (mut raw, srv_io) = tokio::io::duplex(1 << 20);
    let srv = Session::server(srv_io);
    let mut out = Vec::new();
    Frame::hello(1).encode_into(&mut out);
    Frame::empty(3, Kind::Open).encode_into(&mut out);
    raw.write_all(&out).await.unwrap();
    let _old = srv.accept().await.unwrap();
    let echo = spawn_echo(srv);
    let t0 = tokio::time::Instant::now();
    let client = Session::client(raw);
    let mut s = client.open().await.unwrap();
    assert!(
        t0.elapsed() < std::time::Duration::from_millis(100),
        "{:?}",
        t0.elapsed()
    );
    s.write_all(b"x").await.unwrap();
    let mut b = [0u8; 1];
    s.read_exact(&mut b).await.unwrap();
    assert_eq!(&b, b"x");
    echo.abort();
}
