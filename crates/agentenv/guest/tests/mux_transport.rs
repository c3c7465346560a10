//! The same protocol through mux sessions (`serve --listen mux-unix:`), as the host reaches
//! the guest over the virtio-serial port.

mod common;

use common::{Guest, bash, expect_start, token};
use http::StatusCode;
use serde_json::json;

#[tokio::test]
async fn concurrent_commands_over_mux_streams() {
    let g = std::sync::Arc::new(Guest::start_mux(&[]).await);
    let mut tasks = Vec::new();
    for _ in 0..16 {
        let g = g.clone();
        tasks.push(tokio::spawn(async move {
            let t = token();
            let mut s = g
                .stream("/process.Process/Start", bash(&format!("echo {t}")), &[])
                .await;
            expect_start(&mut s).await;
            let out = s.collect_process().await;
            assert_eq!(String::from_utf8(out.stdout).unwrap(), format!("{t}\n"));
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let (st, v) = g
        .unary("/filesystem.Filesystem/Stat", json!({"path": g.dir.path()}))
        .await;
    assert_eq!(st, StatusCode::OK);
    assert_eq!(v["entry"]["type"], "FILE_TYPE_DIRECTORY");
}

#[tokio::test]
async fn many_requests_on_one_session() {
    let g = Guest::start_mux(&[]).await;
    let sock = tokio::net::UnixStream::connect(&g.sock).await.unwrap();
    let session = agentenv_mux::Session::client(sock);
    for _ in 0..20 {
        let s = session.open().await.unwrap();
        let (mut sender, conn) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(s))
                .await
                .unwrap();
        tokio::spawn(conn);
        let req = http::Request::get("/health")
            .body(http_body_util::Empty::<bytes::Bytes>::new())
            .unwrap();
        assert_eq!(
            sender.send_request(req).await.unwrap().status(),
            StatusCode::NO_CONTENT
        );
    }
}
