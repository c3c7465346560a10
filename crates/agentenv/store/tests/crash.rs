//! kill -9 of a process in the middle of ingest or materialize leaves nothing half-written visible: every
//! chunk file verifies, every committed manifest restores, and a materialized file is old or new, whole.

mod common;

use std::io::BufRead;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use agentenv_store::testing::fill_random;
use agentenv_store::{ChunkStore, ManifestId, StoreConfig};
use common::{file_hash, seed, sparse_file};
use rand::{Rng, SeedableRng, rngs::StdRng};

const BIN: &str = env!("CARGO_BIN_EXE_agentenv-store");
const MIB: usize = 1 << 20;

/// Spawns the store binary; its stdout lines arrive on the channel.
fn spawn(args: &[&str]) -> (Child, mpsc::Receiver<String>) {
    let mut child = Command::new(BIN)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let out = child.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    (child, rx)
}

fn next_line(rx: &mpsc::Receiver<String>) -> String {
    rx.recv_timeout(Duration::from_secs(120))
        .expect("the child made no progress within 120 s")
}

/// Waits for a line starting with `start`, then kills the child with SIGKILL `delay` later; returns every
/// line seen.
fn kill9_after_line(
    child: &mut Child,
    rx: &mpsc::Receiver<String>,
    mut seen: Vec<String>,
    start: &str,
    delay: Duration,
) -> Vec<String> {
    loop {
        let l = next_line(rx);
        let hit = l.starts_with(start);
        seen.push(l);
        if hit {
            break;
        }
    }
    std::thread::sleep(delay);
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    while let Ok(l) = rx.recv_timeout(Duration::from_secs(5)) {
        seen.push(l);
    }
    seen
}

/// Times the gap between a line starting with `from` and the next starting with `to`.
fn time_between(
    rx: &mpsc::Receiver<String>,
    seen: &mut Vec<String>,
    from: &str,
    to: &str,
) -> Duration {
    let mut t0: Option<std::time::Instant> = None;
    loop {
        let l = next_line(rx);
        if let Some(t0) = t0
            && l.starts_with(to)
        {
            seen.push(l);
            return t0.elapsed();
        }
        if l.starts_with(from) {
            t0 = Some(std::time::Instant::now());
        }
        seen.push(l);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill9_mid_ingest_leaves_whole_chunks_and_restorable_manifests() {
    let s = seed("crash-ingest");
    let mut rng = StdRng::seed_from_u64(s);
    let dir = tempfile::tempdir().unwrap();
    let store_dir = dir.path().join("store");
    let file = dir.path().join("scratch.mem");
    let mut committed: Vec<(u64, ManifestId)> = Vec::new();
    for round in 0..3u64 {
        let base = s.wrapping_add(round * 1_000_000);
        let args = [
            "--dir",
            store_dir.to_str().unwrap(),
            "churn-ingest",
            file.to_str().unwrap(),
            "--mib",
            "16",
            "--seed",
            &base.to_string(),
        ];
        let (mut child, rx) = spawn(&args);
        // Time one whole ingest, then kill the next one at a random point inside it.
        let mut seen = Vec::new();
        let d = time_between(&rx, &mut seen, "ingesting", "committed");
        let at = d.mul_f64(rng.random_range(0.0..1.0));
        let lines = kill9_after_line(&mut child, &rx, seen, "ingesting", at);
        eprintln!("round {round}: killed {at:?} into an ingest that took {d:?} before");
        for l in lines.iter().filter(|l| l.starts_with("committed")) {
            let mut it = l.split_whitespace().skip(1);
            let k: u64 = it.next().unwrap().parse().unwrap();
            committed.push((base + k, ManifestId::from_hex(it.next().unwrap()).unwrap()));
        }
    }
    let store = ChunkStore::open(StoreConfig::local(&store_dir, 1 << 40))
        .await
        .unwrap();
    let rep = store.verify().await.unwrap();
    assert!(
        rep.corrupt.is_empty(),
        "half-written chunks visible: {:?}",
        rep.corrupt
    );
    assert!(
        rep.missing.is_empty(),
        "a manifest was written before its chunks: {:?}",
        rep.missing
    );
    let listed = store.list_manifests().await.unwrap();
    let mut want = vec![0u8; 16 * MIB];
    let out = dir.path().join("out.mem");
    for (seed_k, id) in &committed {
        assert!(listed.contains(id), "committed manifest {id} lost");
        let m = store.manifest(id).await.unwrap();
        store.materialize(&m, &out).await.unwrap();
        fill_random(&mut want, *seed_k);
        assert_eq!(
            std::fs::read(&out).unwrap(),
            want,
            "manifest {id} restores other bytes"
        );
    }
    // Manifests the child wrote but was killed before printing must restore too.
    for id in &listed {
        let m = store.manifest(id).await.unwrap();
        store.materialize(&m, &out).await.unwrap();
    }
    assert_eq!(std::fs::read_dir(store_dir.join("tmp")).unwrap().count(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill9_mid_materialize_leaves_the_old_file_whole() {
    let s = seed("crash-materialize");
    let mut rng = StdRng::seed_from_u64(s);
    let dir = tempfile::tempdir().unwrap();
    let store_dir = dir.path().join("store");
    let src = dir.path().join("src.img");
    sparse_file(
        &src,
        64 * MIB as u64,
        &[(0, 24 * MIB), (40 * MIB as u64, 8 * MIB)],
        s,
    );
    let dest = dir.path().join("dest.img");
    let id = {
        let store = ChunkStore::open(StoreConfig::local(&store_dir, 1 << 40))
            .await
            .unwrap();
        let (m, _) = store.ingest(&src).await.unwrap();
        store.materialize(&m, &dest).await.unwrap();
        m.id()
    };
    let want = file_hash(&src);
    for round in 0..3 {
        let args = [
            "--dir",
            store_dir.to_str().unwrap(),
            "churn-materialize",
            &id.to_hex(),
            dest.to_str().unwrap(),
        ];
        let (mut child, rx) = spawn(&args);
        // Time one whole materialize, then kill the next one at a random point inside it.
        let mut seen = Vec::new();
        let d = time_between(&rx, &mut seen, "materialized", "materialized");
        let at = d.mul_f64(rng.random_range(0.0..1.0));
        kill9_after_line(&mut child, &rx, seen, "materialized", at);
        eprintln!("round {round}: killed {at:?} into a materialize that took {d:?} before");
        assert_eq!(file_hash(&dest), want, "dest torn by a kill -9");
    }
    // The next materialize sweeps temp files of dead processes.
    let store = ChunkStore::open(StoreConfig::local(&store_dir, 1 << 40))
        .await
        .unwrap();
    store
        .materialize(&store.manifest(&id).await.unwrap(), &dest)
        .await
        .unwrap();
    let left: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .flatten()
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with(".dest.img.tmp.")
        })
        .collect();
    assert!(left.is_empty(), "temp files left: {left:?}");
    assert_eq!(file_hash(&dest), want);
}
