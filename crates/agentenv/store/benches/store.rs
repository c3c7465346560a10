//! Chunk store figures: ingest / incremental ingest / materialize of a 256 MiB RAM-like sparse file per
//! chunk size, zstd on/off, a cold restore from a real S3 server (SeaweedFS on loopback, if present), and a
//! disk image read through the NBD export cold (from the bucket) and warm.
//!
//! `cargo bench -p agentenv-store --bench store`; `K3_BENCH_RAM=<file>` adds a real RAM file,
//! `K3_BENCH_DISK=<image>` reads that image through NBD, `K3_BENCH_QUICK=1` runs 1 repeat. Medians of the
//! repeats; ingest runs on one core (current-thread runtime, one blocking worker).

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use agentenv_store::testing::{Weed, fill_random};
use agentenv_store::{ChunkStore, Compression, StoreConfig};

const MIB: u64 = 1 << 20;

fn median(v: Vec<Duration>) -> Duration {
    let secs: Vec<f64> = v.iter().map(Duration::as_secs_f64).collect();
    Duration::from_secs_f64(k3_common::stats::median(&secs))
}

fn ms(d: Duration) -> String {
    format!("{:.1}", d.as_secs_f64() * 1e3)
}

fn cpu_s() -> f64 {
    // SAFETY: getrusage fills a zeroed struct.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// 256 MiB, ~80 MB of data in 4 KiB-aligned extents: half random pages, half low-entropy pages
/// (repeated words, like kernel and heap data), the rest holes.
fn ram_like(path: &Path, seed: u64) {
    let f = std::fs::File::create(path).unwrap();
    f.set_len(256 * MIB).unwrap();
    let mut x = seed | 1;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut total = 0u64;
    let mut buf = vec![0u8; 1 << 20];
    while total < 80_000_000 {
        let off = (next() % ((255 * MIB) / 4096)) * 4096;
        let n = ((next() % 256) as usize + 1) * 4096;
        let page = &mut buf[..n];
        if next() % 2 == 0 {
            fill_random(page, next());
        } else {
            let w = next().to_le_bytes();
            for (i, b) in page.iter_mut().enumerate() {
                *b = w[i % 8] ^ ((i / 64) as u8 & 3);
            }
        }
        f.write_all_at(page, off).unwrap();
        total += n as u64;
    }
}

/// Copies only the data extents (holes stay holes, also across filesystems).
fn sparse_copy(src: &Path, dst: &Path) {
    use std::os::fd::AsRawFd;
    let from = std::fs::File::open(src).unwrap();
    let to = std::fs::File::create(dst).unwrap();
    let len = from.metadata().unwrap().len();
    to.set_len(len).unwrap();
    let mut pos = 0i64;
    let mut buf = vec![0u8; 1 << 20];
    while (pos as u64) < len {
        // SAFETY: lseek on an owned fd.
        let data = unsafe { libc::lseek(from.as_raw_fd(), pos, libc::SEEK_DATA) };
        if data < 0 {
            break;
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(from.as_raw_fd(), data, libc::SEEK_HOLE) };
        let mut off = data as u64;
        while off < hole as u64 {
            let n = ((hole as u64 - off) as usize).min(buf.len());
            from.read_exact_at(&mut buf[..n], off).unwrap();
            to.write_all_at(&buf[..n], off).unwrap();
            off += n as u64;
        }
        pos = hole;
    }
}

fn scratch_dir() -> PathBuf {
    let shm = Path::new("/dev/shm");
    let base = if shm.is_dir() {
        shm.to_path_buf()
    } else {
        std::env::temp_dir()
    };
    let d = base.join(format!("k3-store-bench-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

async fn fresh(dir: &Path, chunk: usize, compression: Compression) -> ChunkStore {
    let _ = std::fs::remove_dir_all(dir);
    let mut cfg = StoreConfig::local(dir, 1 << 40);
    cfg.chunk_size = chunk;
    cfg.compression = compression;
    ChunkStore::open(cfg).await.unwrap()
}

struct Row {
    label: String,
    data_mb: f64,
    ingest: Duration,
    ingest_cpu_s: f64,
    incr_contig_new: u64,
    incr_pages_new: u64,
    incr_time: Duration,
    written_mb: f64,
    materialize: Duration,
    manifest_kb: f64,
}

async fn measure(
    input: &Path,
    work: &Path,
    chunk: usize,
    compression: Compression,
    reps: usize,
) -> Row {
    let store_dir = work.join("store");
    let copy = work.join("input.copy");
    let (mut ingest, mut cpu, mut incr, mut mat) = (vec![], 0.0, vec![], vec![]);
    let (mut contig, mut pages, mut written, mut data, mut mkb) = (0, 0, 0, 0, 0.0);
    for rep in 0..reps {
        sparse_copy(input, &copy);
        let store = fresh(&store_dir, chunk, compression).await;
        let c0 = cpu_s();
        let (m, st) = store.ingest(&copy).await.unwrap();
        cpu += cpu_s() - c0;
        ingest.push(st.elapsed);
        written = st.bytes_written;
        data = st.bytes_data;
        mkb = m.to_bytes().len() as f64 / 1024.0;
        // 1 MiB contiguous change.
        let f = std::fs::OpenOptions::new().write(true).open(&copy).unwrap();
        let mut buf = vec![0u8; MIB as usize];
        fill_random(&mut buf, rep as u64 + 11);
        f.write_all_at(&buf, 100 * MIB + 12345).unwrap();
        let (_, s2) = store.ingest(&copy).await.unwrap();
        contig = s2.bytes_new;
        incr.push(s2.elapsed);
        // 256 scattered 4 KiB pages (1 MiB total), like a guest dirtying memory.
        for k in 0..256u64 {
            let off = ((k * 7919 + rep as u64 * 13) % (256 * 256 - 1)) * 4096;
            f.write_all_at(&buf[..4096], off).unwrap();
        }
        let (m3, s3) = store.ingest(&copy).await.unwrap();
        pages = s3.bytes_new;
        let out = work.join("out.mem");
        let ms = store.materialize(&m3, &out).await.unwrap();
        mat.push(ms.elapsed);
        let _ = std::fs::remove_file(out);
    }
    let label = match compression {
        Compression::None => format!("{} KiB", chunk >> 10),
        Compression::Zstd { level } => format!("{} KiB zstd-{level}", chunk >> 10),
    };
    Row {
        label,
        data_mb: data as f64 / 1e6,
        ingest: median(ingest),
        ingest_cpu_s: cpu / reps as f64,
        incr_contig_new: contig,
        incr_pages_new: pages,
        incr_time: median(incr),
        written_mb: written as f64 / 1e6,
        materialize: median(mat),
        manifest_kb: mkb,
    }
}

/// Reads a disk image through the NBD export with `qemu-img convert`: from a cold node (every chunk
/// fetched from the bucket) and again warm (chunks local), plus the first 4 KiB block on another cold node.
async fn nbd_cold_warm(disk: &Path, work: &Path, weed: &Weed) -> String {
    use agentenv_store::nbd::NbdServer;
    let mut remote = weed.remote(&format!("k3-bench-{}", std::process::id()));
    remote.prefix = "nbd/".into();
    let open = |d: &str| {
        let _ = std::fs::remove_dir_all(work.join(d));
        ChunkStore::open(StoreConfig::local(work.join(d), 1 << 40).with_remote(remote.clone()))
    };
    let a = open("nbd-a").await.unwrap();
    let (m, st) = a.ingest(disk).await.unwrap();
    drop(a);
    let run = |args: Vec<String>| async move {
        let t0 = Instant::now();
        let o = tokio::process::Command::new(&args[0])
            .args(&args[1..])
            .output()
            .await
            .unwrap();
        assert!(
            o.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        t0.elapsed()
    };
    let out = work.join("nbd-out.raw");
    let mut times = Vec::new();
    for (k, d) in ["nbd-b", "nbd-c"].iter().enumerate() {
        let b = open(d).await.unwrap();
        let m = b.manifest(&m.id()).await.unwrap();
        let sock = work.join(format!("{d}.sock"));
        let srv = NbdServer::serve(b.clone(), m, "disk", &sock).await.unwrap();
        if k == 0 {
            for _ in 0..2 {
                let args = [
                    "qemu-img",
                    "convert",
                    "-f",
                    "raw",
                    "-O",
                    "raw",
                    &srv.uri(),
                    out.to_str().unwrap(),
                ];
                times.push(run(args.iter().map(|s| s.to_string()).collect()).await);
            }
        } else {
            let args = ["qemu-io", "-r", "-f", "raw", &srv.uri(), "-c", "read 0 4k"];
            times.push(run(args.iter().map(|s| s.to_string()).collect()).await);
        }
        srv.shutdown().await;
    }
    let _ = std::fs::remove_file(out);
    format!(
        "NBD export of {} ({:.0} MB data, {} MiB image): qemu-img convert cold from S3 {} ms, warm {} ms; \
         first 4 KiB block on a cold node (qemu-io, incl. its start-up) {} ms",
        disk.display(),
        st.bytes_data as f64 / 1e6,
        st.bytes_total >> 20,
        ms(times[0]),
        ms(times[1]),
        ms(times[2])
    )
}

async fn s3_restore(input: &Path, work: &Path, reps: usize) -> Option<String> {
    let weed = match Weed::start(work) {
        Ok(w) => w,
        Err(e) => return Some(format!("S3 restore: skipped ({e})")),
    };
    let disk = std::env::var_os("K3_BENCH_DISK").map_or_else(|| input.to_path_buf(), PathBuf::from);
    let nbd = nbd_cold_warm(&disk, work, &weed).await;
    let (mut up, mut down) = (vec![], vec![]);
    let (mut up_b, mut down_b) = (0, 0);
    for rep in 0..reps {
        // One bucket (each new bucket costs weed fresh volumes), a prefix per repeat.
        let mut remote = weed.remote(&format!("k3-bench-{}", std::process::id()));
        remote.prefix = format!("rep{rep}/");
        let a_dir = work.join("s3a");
        let b_dir = work.join("s3b");
        let _ = std::fs::remove_dir_all(&a_dir);
        let _ = std::fs::remove_dir_all(&b_dir);
        let a = ChunkStore::open(StoreConfig::local(&a_dir, 1 << 40).with_remote(remote.clone()))
            .await
            .unwrap();
        let (m, st) = a.ingest(input).await.unwrap();
        up.push(st.elapsed);
        up_b = st.bytes_uploaded;
        let b = ChunkStore::open(StoreConfig::local(&b_dir, 1 << 40).with_remote(remote.clone()))
            .await
            .unwrap();
        let t0 = Instant::now();
        let m = b.manifest(&m.id()).await.unwrap();
        let out = work.join("s3-out.mem");
        let r = b.materialize(&m, &out).await.unwrap();
        down.push(t0.elapsed());
        down_b = r.bytes_fetched_remote;
        b.settle().await;
        let _ = std::fs::remove_file(out);
    }
    let (u, d) = (median(up), median(down));
    Some(format!(
        "{nbd}\n\nS3 (SeaweedFS loopback, 64 KiB chunks, 16 in flight): ingest+upload {} ms ({:.1} MB, {:.0} MB/s); \
         cold restore on a second store {} ms ({:.1} MB fetched, {:.0} MB/s)",
        ms(u),
        up_b as f64 / 1e6,
        up_b as f64 / 1e6 / u.as_secs_f64(),
        ms(d),
        down_b as f64 / 1e6,
        down_b as f64 / 1e6 / d.as_secs_f64()
    ))
}

fn main() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .max_blocking_threads(1)
        .build()
        .unwrap();
    let reps = if std::env::var("K3_BENCH_QUICK").is_ok() {
        1
    } else {
        5
    };
    let work = scratch_dir();
    let input = work.join("ram-like.mem");
    ram_like(&input, 0x5eed);
    let mut inputs = vec![("synthetic RAM-like 256 MiB", input.clone())];
    if let Some(p) = std::env::var_os("K3_BENCH_RAM") {
        inputs.push(("K3_BENCH_RAM", PathBuf::from(p)));
    }
    rt.block_on(async {
        for (name, path) in &inputs {
            println!("\n### {name} ({})\n", path.display());
            println!("| chunk | data MB | ingest ms (cold) | CPU s | +1 MiB contiguous: new bytes | +256 x 4 KiB pages: new bytes | incremental ingest ms | stored MB | materialize ms | manifest KiB |");
            println!("|---|---|---|---|---|---|---|---|---|---|");
            let mut cases: Vec<(usize, Compression)> =
                [16usize, 64, 256, 1024].iter().map(|k| (k << 10, Compression::None)).collect();
            cases.push((64 << 10, Compression::Zstd { level: 1 }));
            cases.push((64 << 10, Compression::Zstd { level: 3 }));
            for (chunk, comp) in cases {
                let r = measure(path, &work, chunk, comp, reps).await;
                println!(
                    "| {} | {:.1} | {} | {:.2} | {} | {} | {} | {:.1} | {} | {:.0} |",
                    r.label, r.data_mb, ms(r.ingest), r.ingest_cpu_s, r.incr_contig_new, r.incr_pages_new,
                    ms(r.incr_time), r.written_mb, ms(r.materialize), r.manifest_kb
                );
            }
        }
        if let Some(line) = s3_restore(&input, &work, reps.min(3)).await {
            println!("\n{line}");
        }
    });
    let _ = std::fs::remove_dir_all(&work);
}
