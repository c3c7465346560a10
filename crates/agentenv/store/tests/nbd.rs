//! The NBD export read by QEMU's own tools (qemu-img, qemu-io from Debian's qemu-utils).

mod common;

use std::path::Path;
use std::time::Duration;

use agentenv_store::nbd::NbdServer;
use agentenv_store::{ChunkStore, StoreConfig};
use common::{file_hash, qemu_tool, seed, sparse_file};

const MIB: u64 = 1 << 20;

/// Runs a tool with a deadline; `(success, stdout+stderr)`.
async fn run(tool: &Path, args: &[&str]) -> (bool, String) {
    let fut = tokio::process::Command::new(tool)
        .args(args)
        .kill_on_drop(true)
        .output();
    let o = tokio::time::timeout(Duration::from_secs(120), fut)
        .await
        .unwrap_or_else(|_| panic!("{} {args:?} ran past 120 s", tool.display()))
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    (o.status.success(), text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qemu_reads_through_nbd_equal_the_source_and_a_qcow2_overlay_stacks_on_it() {
    let (Some(img), Some(io)) = (qemu_tool("nbd", "qemu-img"), qemu_tool("nbd", "qemu-io")) else {
        return;
    };
    let s = seed("nbd");
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("disk.raw");
    let len = 48 * MIB + 3 * 512;
    sparse_file(
        &src,
        len,
        &[
            (0, 3 * MIB as usize),
            (9 * MIB + 777, 5 * MIB as usize),
            (len - 4096, 4096),
        ],
        s,
    );
    let store = ChunkStore::open(StoreConfig::local(dir.path().join("store"), 1 << 40))
        .await
        .unwrap();
    let (m, _) = store.ingest(&src).await.unwrap();
    let sock = dir.path().join("nbd.sock");
    let srv = NbdServer::serve(store.clone(), m, "disk", &sock)
        .await
        .unwrap();
    let uri = srv.uri();

    let out = dir.path().join("out.raw");
    let (ok, log) = run(
        &img,
        &[
            "convert",
            "-f",
            "raw",
            "-O",
            "raw",
            &uri,
            out.to_str().unwrap(),
        ],
    )
    .await;
    assert!(ok, "qemu-img convert: {log}");
    assert_eq!(file_hash(&out), file_hash(&src));
    let (ok, log) = run(
        &img,
        &[
            "compare",
            "-f",
            "raw",
            "-F",
            "raw",
            &uri,
            src.to_str().unwrap(),
        ],
    )
    .await;
    assert!(ok, "qemu-img compare: {log}");
    // A hole reads as zeros; a small unaligned read inside data matches (qemu-io checks the pattern).
    let (ok, log) = run(&io, &["-r", "-f", "raw", &uri, "-c", "read -P 0 20M 1M"]).await;
    assert!(ok && !log.contains("fail"), "qemu-io zero read: {log}");
    // Writes are refused: the export is read-only.
    let (ok, log) = run(&io, &["-f", "raw", &uri, "-c", "write -P 0x11 0 4k"]).await;
    assert!(
        !ok || log.contains("ermission") || log.contains("read-only") || log.contains("fail"),
        "write accepted: {log}"
    );

    // A qcow2 overlay backed by the export: writes land in the overlay, the rest comes through NBD.
    let ov = dir.path().join("ov.qcow2");
    let (ok, log) = run(
        &img,
        &[
            "create",
            "-q",
            "-f",
            "qcow2",
            "-F",
            "raw",
            "-b",
            &uri,
            ov.to_str().unwrap(),
        ],
    )
    .await;
    assert!(ok, "qemu-img create overlay: {log}");
    let (ok, log) = run(
        &io,
        &[
            "-f",
            "qcow2",
            ov.to_str().unwrap(),
            "-c",
            "write -P 0xab 1M 64k",
        ],
    )
    .await;
    assert!(ok && log.contains("wrote"), "qemu-io write overlay: {log}");
    let flat = dir.path().join("flat.raw");
    let (ok, log) = run(
        &img,
        &[
            "convert",
            "-O",
            "raw",
            ov.to_str().unwrap(),
            flat.to_str().unwrap(),
        ],
    )
    .await;
    assert!(ok, "qemu-img convert overlay: {log}");
    let mut want = std::fs::read(&src).unwrap();
    want[MIB as usize..MIB as usize + 65536].fill(0xab);
    assert!(
        std::fs::read(&flat).unwrap() == want,
        "overlay over NBD differs"
    );
    srv.shutdown().await;
    assert!(!sock.exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cold_node_serves_a_disk_larger_than_its_cache_from_the_bucket() {
    let Some(img) = qemu_tool("nbd-lazy", "qemu-img") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let Some(weed) = common::weed("nbd-lazy", dir.path()) else {
        return;
    };
    let s = seed("nbd-lazy");
    let bucket = format!("k3-nbd-{}", s % 1_000_000);
    let src = dir.path().join("disk.raw");
    sparse_file(
        &src,
        64 * MIB,
        &[(0, 20 * MIB as usize), (32 * MIB, 12 * MIB as usize)],
        s,
    );
    let m = {
        let a = ChunkStore::open(
            StoreConfig::local(dir.path().join("a"), 1 << 40).with_remote(weed.remote(&bucket)),
        )
        .await
        .unwrap();
        a.ingest(&src).await.unwrap().0
    };
    // Node B: empty cache bounded to 8 MiB, a 32 MiB image.
    let b = ChunkStore::open(
        StoreConfig::local(dir.path().join("b"), 8 * MIB).with_remote(weed.remote(&bucket)),
    )
    .await
    .unwrap();
    let m = b.manifest(&m.id()).await.unwrap();
    let sock = dir.path().join("lazy.sock");
    let srv = NbdServer::serve(b.clone(), m, "disk", &sock).await.unwrap();
    let out = dir.path().join("out.raw");
    let (ok, log) = run(
        &img,
        &[
            "convert",
            "-f",
            "raw",
            "-O",
            "raw",
            &srv.uri(),
            out.to_str().unwrap(),
        ],
    )
    .await;
    assert!(ok, "qemu-img convert: {log}");
    assert_eq!(file_hash(&out), file_hash(&src));
    let st = b.local_stats();
    eprintln!("cold node after reading 32 MiB of data: {st:?}");
    assert!(st.bytes <= 8 * MIB, "cache over its bound: {st:?}");
    assert!(st.chunks > 0, "nothing cached");
}

/// Minimal NBD client steps for protocol checks.
mod wire {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::UnixStream;

    pub const IHAVEOPT: u64 = 0x4948_4156_454F_5054;

    /// Handshake up to option haggling (fixed newstyle, no zeroes).
    pub async fn hello(s: &mut UnixStream) {
        assert_eq!(s.read_u64().await.unwrap(), 0x4e42_444d_4147_4943);
        assert_eq!(s.read_u64().await.unwrap(), IHAVEOPT);
        assert_eq!(s.read_u16().await.unwrap() & 1, 1);
        s.write_u32(3).await.unwrap();
    }

    /// Sends `NBD_OPT_GO` for `name`; returns the reply types up to the final one, and the export size.
    pub async fn go(s: &mut UnixStream, name: &str) -> (Vec<u32>, Option<u64>) {
        s.write_u64(IHAVEOPT).await.unwrap();
        s.write_u32(7).await.unwrap();
        s.write_u32(4 + name.len() as u32 + 2).await.unwrap();
        s.write_u32(name.len() as u32).await.unwrap();
        s.write_all(name.as_bytes()).await.unwrap();
        s.write_u16(0).await.unwrap();
        let (mut kinds, mut size) = (Vec::new(), None);
        loop {
            assert_eq!(s.read_u64().await.unwrap(), 0x0003_e889_0455_65a9);
            assert_eq!(s.read_u32().await.unwrap(), 7);
            let kind = s.read_u32().await.unwrap();
            let len = s.read_u32().await.unwrap();
            let mut d = vec![0u8; len as usize];
            s.read_exact(&mut d).await.unwrap();
            kinds.push(kind);
            if kind == 3 && d[..2] == [0, 0] {
                size = Some(u64::from_be_bytes(d[2..10].try_into().unwrap()));
            }
            if kind != 3 {
                return (kinds, size);
            }
        }
    }

    /// Sends one request; returns (error, data for a successful read).
    pub async fn request(
        s: &mut UnixStream,
        kind: u16,
        handle: u64,
        off: u64,
        len: u32,
    ) -> (u32, Vec<u8>) {
        s.write_u32(0x2560_9513).await.unwrap();
        s.write_u16(0).await.unwrap();
        s.write_u16(kind).await.unwrap();
        s.write_u64(handle).await.unwrap();
        s.write_u64(off).await.unwrap();
        s.write_u32(len).await.unwrap();
        if kind == 1 {
            s.write_all(&vec![0x5a; len as usize]).await.unwrap();
        }
        assert_eq!(s.read_u32().await.unwrap(), 0x6744_6698);
        let err = s.read_u32().await.unwrap();
        assert_eq!(s.read_u64().await.unwrap(), handle);
        let mut d = Vec::new();
        if err == 0 && kind == 0 {
            d.resize(len as usize, 0);
            s.read_exact(&mut d).await.unwrap();
        }
        (err, d)
    }
}

#[tokio::test]
async fn nbd_protocol_refuses_unknown_exports_writes_and_reads_past_the_end() {
    let s = seed("nbd-wire");
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("disk.raw");
    let len = 8 * MIB + 4096;
    sparse_file(&src, len, &[(4096, 3 * MIB as usize), (len - 100, 100)], s);
    let store = ChunkStore::open(StoreConfig::local(dir.path().join("store"), 1 << 40))
        .await
        .unwrap();
    let (m, _) = store.ingest(&src).await.unwrap();
    let sock = dir.path().join("w.sock");
    let _srv = NbdServer::serve(store, m, "disk", &sock).await.unwrap();
    let mut c = tokio::net::UnixStream::connect(&sock).await.unwrap();
    wire::hello(&mut c).await;
    let (kinds, _) = wire::go(&mut c, "nope").await;
    assert_eq!(kinds, [(1 << 31) + 6], "unknown export not refused");
    let (kinds, size) = wire::go(&mut c, "disk").await;
    assert_eq!((kinds.last().copied(), size), (Some(1), Some(len)));
    let want = std::fs::read(&src).unwrap();
    let off = 4000 + s % 60_000;
    let (err, d) = wire::request(&mut c, 0, 1, off, 200_000).await;
    assert_eq!(err, 0);
    assert!(
        d == want[off as usize..off as usize + 200_000],
        "read through NBD differs"
    );
    let (err, d) = wire::request(&mut c, 0, 2, len - 100, 100).await;
    assert_eq!((err, d.as_slice()), (0, &want[len as usize - 100..]));
    assert_eq!(
        wire::request(&mut c, 0, 3, len - 100, 101).await.0,
        22,
        "read past the end"
    );
    assert_eq!(
        wire::request(&mut c, 1, 4, 0, 4096).await.0,
        1,
        "write on a read-only export"
    );
    assert_eq!(wire::request(&mut c, 3, 5, 0, 0).await.0, 0, "flush");
    // Still serving after the refusals.
    let (err, d) = wire::request(&mut c, 0, 6, 0, 8192).await;
    assert_eq!((err, d.as_slice()), (0, &want[..8192]));
}
