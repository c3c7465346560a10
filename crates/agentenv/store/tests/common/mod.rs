//! Shared helpers of the integration tests: seeds, sparse inputs, hashing, tool gates.
#![allow(dead_code)]

use std::io::Read;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};

use agentenv_store::testing::fill_random;

/// A fresh seed (or `$K3_SEED`), printed so a failure can be replayed.
pub fn seed(test: &str) -> u64 {
    let s = std::env::var("K3_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    eprintln!("{test}: seed {s} (K3_SEED={s} replays it)");
    s
}

/// Creates a sparse file of `len` bytes with random data at each `(offset, len)` extent.
pub fn sparse_file(path: &Path, len: u64, extents: &[(u64, usize)], seed: u64) {
    let f = std::fs::File::create(path).unwrap();
    f.set_len(len).unwrap();
    for (k, &(off, n)) in extents.iter().enumerate() {
        let mut buf = vec![0u8; n];
        fill_random(&mut buf, seed ^ (k as u64 + 1) << 20);
        f.write_all_at(&buf, off).unwrap();
    }
}

/// Random data at `off`, `n` bytes.
pub fn overwrite(path: &Path, off: u64, n: usize, seed: u64) {
    let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    let mut buf = vec![0u8; n];
    fill_random(&mut buf, seed);
    f.write_all_at(&buf, off).unwrap();
}

/// BLAKE3 of a whole file, and its length.
pub fn file_hash(path: &Path) -> (blake3::Hash, u64) {
    let mut f = std::fs::File::open(path).unwrap();
    let mut h = blake3::Hasher::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut n_total = 0u64;
    loop {
        let n = f.read(&mut buf).unwrap();
        if n == 0 {
            break;
        }
        n_total += n as u64;
        h.update(&buf[..n]);
    }
    (h.finalize(), n_total)
}

/// Bytes actually allocated on disk.
pub fn allocated(path: &Path) -> u64 {
    std::fs::metadata(path).unwrap().blocks() * 512
}

/// Whether an absent tool fails the test instead of skipping it (`K3_REQUIRE_S3=1` or CI).
pub fn required() -> bool {
    agentenv_store::testing::s3_required()
}

/// Starts SeaweedFS, or prints why not and returns `None` (panics instead when [`required`]).
pub fn weed(test: &str, parent: &Path) -> Option<agentenv_store::testing::Weed> {
    agentenv_store::testing::weed_or_skip(test, parent)
}

/// `qemu-img`/`qemu-io` path, or prints why not and returns `None` (panics instead when [`required`]).
pub fn qemu_tool(test: &str, name: &str) -> Option<PathBuf> {
    let found = k3_common::fsutil::which(name);
    if found.is_none() {
        let why = format!("{name} not on PATH (apt qemu-utils)");
        if required() {
            panic!("{test}: {why}");
        }
        k3_common::require::skip_part(k3_common::require::Part::Qemu, test, why);
    }
    found
}
