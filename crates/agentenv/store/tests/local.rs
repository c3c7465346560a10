//! Local-folder behaviour on fresh random inputs: incrementality, dedup, holes, bound, gc, corruption.

mod common;

use agentenv_store::{ChunkStore, Compression, StoreConfig, StoreError};
use common::{allocated, file_hash, overwrite, seed, sparse_file};
use rand::{Rng, SeedableRng, rngs::StdRng};

const MIB: u64 = 1 << 20;

async fn open(dir: &std::path::Path, max: u64) -> ChunkStore {
    ChunkStore::open(StoreConfig::local(dir.join("store"), max))
        .await
        .unwrap()
}

/// ~80 MB of data in random extents (4 KiB-aligned, 4 KiB..1 MiB long) of a 256 MiB file.
fn ram_like_extents(rng: &mut StdRng) -> Vec<(u64, usize)> {
    let mut ext = Vec::new();
    let mut total = 0usize;
    while total < 80_000_000 {
        let off = rng.random_range(0..(256 * MIB - MIB) / 4096) * 4096;
        let n = rng.random_range(1..=256usize) * 4096;
        ext.push((off, n));
        total += n;
    }
    ext
}

#[tokio::test]
async fn second_ingest_after_a_1mib_change_stores_about_1mib() {
    let s = seed("incremental");
    let mut rng = StdRng::seed_from_u64(s);
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("ram.mem");
    sparse_file(&f, 256 * MIB, &ram_like_extents(&mut rng), s);
    let before = file_hash(&f);
    let store = open(dir.path(), 1 << 40).await;
    let (m1, st1) = store.ingest(&f).await.unwrap();
    eprintln!("first ingest: {st1:?}");
    assert_eq!(st1.bytes_total, 256 * MIB);
    assert!(st1.bytes_data >= 48 * MIB && st1.bytes_new <= st1.bytes_data);
    assert!(st1.chunks_zero > 0, "holes must be skipped");

    let off = rng.random_range(0..255 * MIB);
    overwrite(&f, off, MIB as usize, s ^ 0xabc);
    let after = file_hash(&f);
    let (m2, st2) = store.ingest(&f).await.unwrap();
    eprintln!("second ingest after 1 MiB at {off}: {st2:?}");
    assert!(st2.bytes_new >= MIB, "changed bytes not stored: {st2:?}");
    assert!(
        st2.bytes_new <= MIB + 128 * 1024,
        "stored more than the change: {st2:?}"
    );
    assert!(st2.chunks_new <= 17);

    // Both versions restore, from one store.
    for (m, want) in [(&m1, before), (&m2, after)] {
        let out = dir.path().join("out.mem");
        let ms = store.materialize(m, &out).await.unwrap();
        assert_eq!(ms.bytes_fetched_remote, 0);
        assert_eq!(file_hash(&out), want);
        assert!(allocated(&out) < 200 * MIB, "holes were filled");
    }
}

#[tokio::test]
async fn identical_and_shifted_content_is_shared_across_files() {
    let s = seed("dedup");
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path(), 1 << 40).await;
    let (a, b, c) = (
        dir.path().join("a"),
        dir.path().join("b"),
        dir.path().join("c"),
    );
    sparse_file(&a, 16 * MIB, &[(0, 8 * MIB as usize)], s);
    std::fs::copy(&a, &b).unwrap();
    // c: a's data moved by 2 MiB (chunk-aligned) plus 1 MiB of its own.
    let data = std::fs::read(&a).unwrap();
    let mut cdata = vec![0u8; 16 * MIB as usize];
    cdata[2 * MIB as usize..10 * MIB as usize].copy_from_slice(&data[..8 * MIB as usize]);
    std::fs::write(&c, &cdata).unwrap();
    overwrite(&c, 12 * MIB, MIB as usize, s + 1);

    let (_, sa) = store.ingest(&a).await.unwrap();
    let (mb, sb) = store.ingest(&b).await.unwrap();
    let (mc, sc) = store.ingest(&c).await.unwrap();
    assert_eq!(sa.bytes_new, 8 * MIB);
    assert_eq!(
        (sb.bytes_new, sb.chunks_new),
        (0, 0),
        "an identical file stored again"
    );
    assert_eq!(sc.bytes_new, MIB, "{sc:?}");
    assert_eq!(
        store.local_stats().bytes,
        9 * MIB + store.local_stats().chunks as u64
    );
    for (m, p) in [(&mb, &b), (&mc, &c)] {
        let out = dir.path().join("out");
        store.materialize(m, &out).await.unwrap();
        assert_eq!(file_hash(&out), file_hash(p));
    }
}

#[tokio::test]
async fn holes_and_zero_chunks_are_not_stored_and_come_back_as_holes() {
    let s = seed("zeros");
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path(), 1 << 40).await;
    let f = dir.path().join("disk.img");
    // Odd length; data, explicit zeros (allocated, not a hole), a hole, a short tail.
    let len = 40 * MIB + 12345;
    sparse_file(&f, len, &[(0, 65536 * 3), (len - 5000, 5000)], s);
    let z = std::fs::OpenOptions::new().write(true).open(&f).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&z, &vec![0u8; 4 * MIB as usize], 8 * MIB).unwrap();
    drop(z);
    let (m, st) = store.ingest(&f).await.unwrap();
    assert_eq!(m.chunks.len(), 3 + 1, "{st:?}"); // the short last chunk holds the tail
    assert_eq!(st.bytes_new, 3 * 65536 + 12345, "{st:?}");
    assert_eq!(st.chunks_zero, m.n_chunks() - 4);
    let out = dir.path().join("out.img");
    store.materialize(&m, &out).await.unwrap();
    assert_eq!(file_hash(&out), file_hash(&f));
    assert!(
        allocated(&out) < 2 * MIB,
        "zeros written out: {}",
        allocated(&out)
    );
}

#[tokio::test]
async fn local_only_bound_evicts_only_what_no_manifest_references() {
    let s = seed("bound");
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path(), 4 * MIB).await;
    let files: Vec<_> = (0..3)
        .map(|k| {
            let p = dir.path().join(format!("f{k}"));
            sparse_file(&p, 3 * MIB, &[(0, 3 * MIB as usize)], s + k);
            p
        })
        .collect();
    let (ma, _) = store.ingest(&files[0]).await.unwrap();
    let (mb, _) = store.ingest(&files[1]).await.unwrap();
    // Over the bound, but both are referenced: the durable store keeps them.
    assert!(store.local_stats().bytes > 6 * MIB);
    store.delete_manifest(&ma.id()).await.unwrap();
    let (_, _) = store.ingest(&files[2]).await.unwrap();
    // a's chunks were evicted; b and c remain whole.
    let st = store.local_stats();
    assert!(st.bytes <= 6 * MIB + st.chunks as u64, "{st:?}");
    let rep = store.verify().await.unwrap();
    assert!(rep.missing.is_empty() && rep.corrupt.is_empty(), "{rep:?}");
    let out = dir.path().join("out");
    store.materialize(&mb, &out).await.unwrap();
    assert_eq!(file_hash(&out), file_hash(&files[1]));
    assert!(matches!(
        store.materialize(&ma, &out).await,
        Err(StoreError::MissingChunk { .. })
    ));
    assert_eq!(
        file_hash(&out),
        file_hash(&files[1]),
        "a failed materialize touched dest"
    );
}

#[tokio::test]
async fn gc_removes_only_unreferenced_chunks_and_pins_block_deletion() {
    let s = seed("gc");
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    sparse_file(&a, 8 * MIB, &[(0, 4 * MIB as usize)], s);
    std::fs::copy(&a, &b).unwrap();
    overwrite(&b, 6 * MIB, MIB as usize, s + 7); // b = a's 4 MiB + 1 MiB of its own
    let (ma, mb) = {
        let store = open(dir.path(), 1 << 40).await;
        let (ma, _) = store.ingest(&a).await.unwrap();
        let (mb, _) = store.ingest(&b).await.unwrap();
        store.pin(&ma.id(), "sbx-1").await.unwrap();
        (ma, mb)
    };
    // Pins survive a reopen.
    let store = open(dir.path(), 1 << 40).await;
    assert!(matches!(
        store.delete_manifest(&ma.id()).await,
        Err(StoreError::Pinned { .. })
    ));
    assert_eq!(store.gc().await.unwrap().local_chunks, 0);
    store.unpin(&ma.id(), "sbx-1").await.unwrap();
    store.delete_manifest(&mb.id()).await.unwrap();
    let g = store.gc().await.unwrap();
    assert_eq!((g.local_chunks, g.local_bytes), (16, 16 * 65537), "{g:?}");
    let out = dir.path().join("out");
    store.materialize(&ma, &out).await.unwrap();
    assert_eq!(file_hash(&out), file_hash(&a));
    assert!(store.verify().await.unwrap().corrupt.is_empty());
}

#[tokio::test]
async fn a_corrupt_chunk_is_an_error_never_served() {
    let s = seed("corrupt");
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path(), 1 << 40).await;
    let f = dir.path().join("f");
    sparse_file(&f, 4 * MIB, &[(0, 4 * MIB as usize)], s);
    let (m, _) = store.ingest(&f).await.unwrap();
    let victim = m.chunks[(s % m.chunks.len() as u64) as usize].1;
    let hex = victim.to_hex();
    let p = dir.path().join("store/chunks").join(&hex[..2]).join(&hex);
    let mut bytes = std::fs::read(&p).unwrap();
    let at = 1 + (s as usize % (bytes.len() - 1));
    bytes[at] ^= 0x01;
    std::fs::write(&p, &bytes).unwrap();
    let out = dir.path().join("out");
    let err = store.materialize(&m, &out).await.unwrap_err();
    assert!(
        matches!(err, StoreError::Corrupt { ref id, .. } if *id == hex),
        "{err}"
    );
    assert!(!out.exists(), "a half-written file is visible");
    let rep = store.verify().await.unwrap();
    assert_eq!(rep.corrupt, vec![victim]);
    assert!(matches!(
        store.chunk(&victim).await,
        Err(StoreError::Corrupt { .. })
    ));
}

#[tokio::test]
async fn metadata_round_trips_lists_by_prefix_and_refuses_bad_keys() {
    let dir = tempfile::tempdir().unwrap();
    let v: u64 = rand::random();
    {
        let store = open(dir.path(), MIB).await;
        store.put_meta("snapshots/a:1", b"x").await.unwrap_err();
        for k in ["snapshots/a", "snapshots/b", "templates/base"] {
            store.put_meta(k, &v.to_le_bytes()).await.unwrap();
        }
        store.put_meta("snapshots/b", b"new").await.unwrap();
        for bad in ["", "/x", "a//b", "a/../b", "manifests/x", "a%b"] {
            assert!(
                matches!(
                    store.put_meta(bad, b"x").await,
                    Err(StoreError::BadKey { .. })
                ),
                "{bad}"
            );
        }
    }
    let store = open(dir.path(), MIB).await;
    assert_eq!(
        store.list_meta("snapshots/").await.unwrap(),
        ["snapshots/a", "snapshots/b"]
    );
    assert_eq!(
        store.get_meta("snapshots/a").await.unwrap().unwrap(),
        v.to_le_bytes()
    );
    assert_eq!(
        store.get_meta("snapshots/b").await.unwrap().unwrap(),
        b"new"
    );
    store.delete_meta("snapshots/a").await.unwrap();
    assert_eq!(store.get_meta("snapshots/a").await.unwrap(), None);
    assert_eq!(
        store.list_meta("").await.unwrap(),
        ["snapshots/b", "templates/base"]
    );
}

#[tokio::test]
async fn zstd_chunks_round_trip_and_store_fewer_bytes_for_compressible_data() {
    let s = seed("zstd");
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = StoreConfig::local(dir.path().join("store"), 1 << 40);
    cfg.compression = Compression::Zstd { level: 1 };
    let store = ChunkStore::open(cfg).await.unwrap();
    let f = dir.path().join("f");
    // Half random, half text-like (low entropy) data.
    sparse_file(&f, 8 * MIB, &[(0, 4 * MIB as usize)], s);
    let text: Vec<u8> = (0..4 * MIB)
        .map(|i| b"agentenv "[(i % 9) as usize] ^ (i >> 16) as u8)
        .collect();
    std::os::unix::fs::FileExt::write_all_at(
        &std::fs::File::options().write(true).open(&f).unwrap(),
        &text,
        4 * MIB,
    )
    .unwrap();
    let (m, st) = store.ingest(&f).await.unwrap();
    assert_eq!(st.bytes_new, 8 * MIB);
    assert!(st.bytes_written < 5 * MIB, "{st:?}");
    let out = dir.path().join("out");
    store.materialize(&m, &out).await.unwrap();
    assert_eq!(file_hash(&out), file_hash(&f));
}

#[tokio::test]
async fn bad_config_and_a_second_opener_get_typed_errors() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = StoreConfig::local(dir.path().join("s"), MIB);
    cfg.chunk_size = 3000;
    assert!(matches!(
        ChunkStore::open(cfg).await,
        Err(StoreError::Config(_))
    ));
    let first = open(dir.path(), MIB).await;
    let mut second = StoreConfig::local(dir.path().join("store"), MIB);
    second.lock_wait = std::time::Duration::from_millis(100);
    assert!(matches!(
        ChunkStore::open(second.clone()).await,
        Err(StoreError::Io { .. })
    ));
    // An opener waits for a holder that lets go within its lock wait (a restart's old process).
    second.lock_wait = std::time::Duration::from_secs(10);
    let waiter = tokio::spawn(ChunkStore::open(second));
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert!(
        !waiter.is_finished(),
        "opened while the first holds the lock"
    );
    drop(first);
    waiter.await.unwrap().expect("opens once the first lets go");
}

/// Page-sized chunks for one file: scattered 4 KiB changes cost 4 KiB each (the store's 64 KiB chunks
/// cost a chunk each), both versions restore, and a bad size is a typed error.
#[tokio::test]
async fn page_chunks_store_scattered_page_changes_tightly() {
    let s = seed("page-chunks");
    let mut rng = StdRng::seed_from_u64(s);
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("ram.mem");
    sparse_file(&f, 64 * MIB, &[(0, 32 * MIB as usize)], s);
    let store = open(dir.path(), 1 << 40).await;
    let (m1, _) = store.ingest_chunked(&f, 4096).await.unwrap();
    assert_eq!(m1.chunk_size, 4096);
    store.ingest(&f).await.unwrap();
    let before = file_hash(&f);
    let pages: Vec<u64> = (0..64)
        .map(|_| rng.random_range(0..32 * MIB / 4096) * 4096)
        .collect();
    for (i, p) in pages.iter().enumerate() {
        overwrite(&f, *p, 4096, s ^ i as u64);
    }
    let distinct = pages
        .iter()
        .collect::<std::collections::BTreeSet<_>>()
        .len() as u64;
    let (m2, st_page) = store.ingest_chunked(&f, 4096).await.unwrap();
    assert_eq!(st_page.bytes_new, distinct * 4096, "{st_page:?}");
    let (_, st_big) = store.ingest(&f).await.unwrap();
    assert!(
        st_big.bytes_new >= 8 * st_page.bytes_new,
        "64 KiB chunks {st_big:?} vs pages {st_page:?}"
    );
    let after = file_hash(&f);
    for (m, want) in [(&m1, before), (&m2, after)] {
        let out = dir.path().join("out.mem");
        store.materialize(m, &out).await.unwrap();
        assert_eq!(file_hash(&out), want);
        std::fs::remove_file(&out).unwrap();
    }
    for bad in [0, 1000, 2048, 8 << 20] {
        assert!(
            matches!(
                store.ingest_chunked(&f, bad).await,
                Err(StoreError::Config(_))
            ),
            "{bad}"
        );
    }
}
