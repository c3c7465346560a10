//! Volume mounts in the lifecycle over the fake backend, with a scripted guest on the channel: the
//! create attaches before it answers, a lost channel is attached again, bad asks are refused.

use std::sync::Arc;

use agentenv_envd::volume::{self, Request, Response};
use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};
use tokio::sync::mpsc;

use crate::fake::{FakeBackend, fake_tests::open};
use crate::sandboxes::*;

/// A guest agent that takes every attach (or refuses with `status`) and hands the test its end.
fn guest(
    fake: &FakeBackend,
    status: &'static str,
) -> mpsc::UnboundedReceiver<(String, DuplexStream)> {
    let (tx, rx) = mpsc::unbounded_channel();
    *fake.agent.lock().unwrap() = Some(Arc::new(move |_id: &str| {
        let (host, mut g) = tokio::io::duplex(1 << 20);
        let tx = tx.clone();
        tokio::spawn(async move {
            let mut head = vec![];
            while !head.ends_with(b"\r\n\r\n") {
                head.push(g.read_u8().await.unwrap());
            }
            let head = String::from_utf8(head).unwrap();
            assert!(head.starts_with("POST /volume HTTP/1.1\r\n"), "{head}");
            let mount = head
                .lines()
                .find_map(|l| l.strip_prefix("x-agentenv-mount: "))
                .unwrap()
                .to_string();
            g.write_all(format!("HTTP/1.1 {status}\r\n\r\n").as_bytes())
                .await
                .unwrap();
            let _ = tx.send((mount, g));
        });
        Box::new(host)
    }));
    rx
}

async fn ask(g: &mut DuplexStream, r: Request, data: &[u8]) -> (Response, Vec<u8>) {
    g.write_all(&volume::encode(&r, data)).await.unwrap();
    let mut w = [0u8; 4];
    g.read_exact(&mut w).await.unwrap();
    let mut body = vec![0; volume::frame_len(w).unwrap()];
    g.read_exact(&mut body).await.unwrap();
    let (resp, d) = volume::decode::<Response>(&body).unwrap();
    (resp, d.to_vec())
}

fn req(mounts: &[(&str, &str)]) -> CreateRequest {
    CreateRequest {
        template: "base".into(),
        volume_mounts: mounts
            .iter()
            .map(|(n, p)| (n.to_string(), p.to_string()))
            .collect(),
        ..Default::default()
    }
}

#[tokio::test]
async fn a_mount_is_attached_at_create_and_again_after_its_channel_is_lost() {
    let dir = tempfile::tempdir().unwrap();
    let fake = Arc::new(FakeBackend::default());
    let mut attached = guest(&fake, "101 Switching Protocols");
    let s = open(dir.path(), fake.clone()).await;
    let (vol, token) = s.volumes().create(Caller::Server.owner(), "data").unwrap();
    let rec = s
        .create(&Caller::Server, req(&[("data", "/mnt/data")]), None)
        .await
        .unwrap();
    assert_eq!(rec.volume_mounts[0].volume_id, vol.volume_id);
    let (path, mut g) = attached
        .try_recv()
        .expect("attached before the create answered");
    assert_eq!(path, "/mnt/data");
    let bytes: Vec<u8> = (0..5000).map(|_| rand::random()).collect();
    let create = Request::Create {
        path: "/f".into(),
        mode: 0o644,
        uid: 1000,
        gid: 1000,
        exclusive: true,
    };
    assert!(matches!(
        ask(&mut g, create, b"").await.0,
        Response::Attr(_)
    ));
    let write = Request::Write {
        path: "/f".into(),
        offset: 0,
    };
    assert_eq!(ask(&mut g, write, &bytes).await.0, Response::Written(5000));
    let content = s.volumes().content(&vol.volume_id, Some(&token)).unwrap();
    let mut got = vec![];
    std::io::Read::read_to_end(&mut content.read("/f").unwrap(), &mut got).unwrap();
    assert_eq!(got, bytes);

    // The channel dies (a resume that replaced QEMU, a fork, a restore): the tick attaches again.
    drop(g);
    let mut g = loop {
        s.keep_mounts();
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        if let Ok((_, g)) = attached.try_recv() {
            break g;
        }
    };
    let read = Request::Read {
        path: "/f".into(),
        offset: 4990,
        len: 100,
    };
    assert_eq!(
        ask(&mut g, read, b"").await,
        (Response::Data, bytes[4990..].to_vec())
    );
    // A live channel is not attached twice.
    s.keep_mounts();
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    assert!(attached.try_recv().is_err());

    // A sandbox from a memory snapshot holds the snapshot's mounts (its guest has them), and its
    // own at other paths.
    let snap = s
        .snapshot(&Caller::Server, &rec.sandbox_id, None, true)
        .await
        .unwrap();
    s.volumes().create(Caller::Server.owner(), "more").unwrap();
    let mut ask = req(&[("more", "/mnt/more")]);
    ask.template = snap.id.clone();
    let from_snap = s.create(&Caller::Server, ask, None).await.unwrap();
    let paths: Vec<&str> = from_snap
        .volume_mounts
        .iter()
        .map(|m| m.path.as_str())
        .collect();
    assert_eq!(paths, ["/mnt/more", "/mnt/data"]);
    let mut got: Vec<String> = (0..2).map(|_| attached.try_recv().unwrap().0).collect();
    got.sort();
    assert_eq!(got, ["/mnt/data", "/mnt/more"]);
}

#[tokio::test]
async fn bad_mounts_are_refused_and_a_refused_attach_leaves_no_sandbox() {
    let dir = tempfile::tempdir().unwrap();
    let fake = Arc::new(FakeBackend::default());
    let _refused = guest(&fake, "500 Internal Server Error");
    let s = open(dir.path(), fake.clone()).await;
    s.volumes().create("someone-else", "theirs").unwrap();
    s.volumes().create(Caller::Server.owner(), "data").unwrap();
    let fails =
        async |m: &[(&str, &str)]| s.create(&Caller::Server, req(m), None).await.unwrap_err();
    assert!(matches!(
        fails(&[("theirs", "/mnt/x")]).await,
        LifecycleError::VolumeNotFound(_)
    ));
    for bad in ["relative", "/", "/a/../b", "/a//b", "/a/"] {
        assert!(
            matches!(fails(&[("data", bad)]).await, LifecycleError::Invalid(_)),
            "{bad}"
        );
    }
    let twice = [("data", "/m"), ("data", "/m")];
    assert!(matches!(fails(&twice).await, LifecycleError::Invalid(_)));
    assert!(matches!(
        fails(&[("data", "/m")]).await,
        LifecycleError::Mount { .. }
    ));
    assert!(
        fake.vms.lock().unwrap().is_empty(),
        "the VM of a failed mount is killed"
    );
    assert!(s.list(&Caller::Server, &ListFilter::default()).is_empty());
}
