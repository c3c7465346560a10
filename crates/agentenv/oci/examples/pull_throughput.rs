//! Pull throughput of a ~100 MiB image from a real `docker-registry` on loopback.
//!
//! `cargo run --release -p agentenv-oci --example pull_throughput -- [MiB] [runs]`
//!
//! Per run, into fresh folders: `pull` (download + verify + apply), `download` (the same blobs GET
//! into a sink: the HTTP baseline, measured in the same run) and `apply` (pull with every blob
//! already in `blob_dir`). Prints medians and MiB/s of layer blob bytes.

use std::io::Read;
use std::time::Instant;

use agentenv_oci::testing::{LayerBuilder, TestImage, TestRegistry};
use agentenv_oci::{Compression, PullOptions, pull, resolve};
use k3_common::stats::median;
use rand::Rng;

/// CPU seconds (user + system) of this process so far.
fn cpu() -> f64 {
    // SAFETY: getrusage fills the struct it is given.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    tv(u.ru_utime) + tv(u.ru_stime)
}

/// CPU seconds of waited-for children so far.
fn cpu_children() -> f64 {
    // SAFETY: getrusage fills the struct it is given.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &mut u) };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    tv(u.ru_utime) + tv(u.ru_stime)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let mib: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(100);
    let runs: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(5);
    // Share of each file that is random bytes (the rest is text that gzip squeezes ~100x).
    let random_pct: usize = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(100);
    let reg = TestRegistry::start().unwrap_or_else(|e| panic!("{e}"));

    // 4 gzip layers of 128 KiB files, `random_pct` % random bytes, the rest text.
    let n_layers = 4;
    let file = 128 << 10;
    let files_per_layer = (mib << 20) / n_layers / file;
    let text: Vec<u8> = b"the quick brown fox jumps over the lazy dog 0123456789\n"
        .iter()
        .copied()
        .cycle()
        .take(file - file * random_pct / 100)
        .collect();
    let mut rng = rand::rng();
    let mut img = TestImage::new(Default::default());
    for l in 0..n_layers {
        let mut b = LayerBuilder::new().dir(&format!("l{l}"), 0o755);
        for f in 0..files_per_layer {
            let mut data = vec![0u8; file * random_pct / 100];
            rng.fill(&mut data[..]);
            data.extend_from_slice(&text);
            b = b.file(&format!("l{l}/f{f}"), &data, 0o644);
        }
        img = img.layer(&b.tar(), Compression::Gzip);
    }
    let image = reg.image("bench/big:v1");
    img.push(&image, &reg.options())
        .unwrap_or_else(|e| panic!("push: {e}"));
    let blob_bytes: u64 = img.layers.iter().map(|l| l.blob.bytes.len() as u64).sum();
    let content = (n_layers * files_per_layer * file) as u64;

    let opts = PullOptions {
        registry: reg.options(),
        ..PullOptions::default()
    };
    let work = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let (mut t_pull, mut t_dl, mut t_apply) = (vec![], vec![], vec![]);
    let (mut c_pull, mut c_dl, mut c_apply) = (vec![], vec![], vec![]);
    let (mut t_tar, mut c_tar) = (vec![], vec![]);
    let agent: ureq::Agent = ureq::Agent::config_builder().proxy(None).build().into();
    for run in 0..runs {
        let dest = work.path().join(format!("pull{run}"));
        let (t, c) = (Instant::now(), cpu());
        pull(&image, &dest, &opts, &mut |_| {}).unwrap_or_else(|e| panic!("pull: {e}"));
        t_pull.push(t.elapsed().as_secs_f64());
        c_pull.push(cpu() - c);

        let (t, c) = (Instant::now(), cpu());
        let r = resolve(&image, &opts).unwrap_or_else(|e| panic!("resolve: {e}"));
        let mut buf = vec![0u8; 256 << 10];
        for l in &r.manifest.layers {
            let url = format!("http://{}/v2/bench/big/blobs/{}", reg.addr, l.digest);
            let mut body = agent
                .get(&url)
                .call()
                .unwrap_or_else(|e| panic!("{e}"))
                .into_body()
                .into_reader();
            while body.read(&mut buf).unwrap_or_else(|e| panic!("{e}")) > 0 {}
        }
        t_dl.push(t.elapsed().as_secs_f64());
        c_dl.push(cpu() - c);

        let cached = PullOptions {
            blob_dir: Some(work.path().join("blobs")),
            ..opts.clone()
        };
        if run == 0 {
            pull(&image, &work.path().join("warm"), &cached, &mut |_| {})
                .unwrap_or_else(|e| panic!("{e}"));
        }
        let (t, c) = (Instant::now(), cpu());
        let got = pull(
            &image,
            &work.path().join(format!("apply{run}")),
            &cached,
            &mut |_| {},
        )
        .unwrap_or_else(|e| panic!("{e}"));
        t_apply.push(t.elapsed().as_secs_f64());
        c_apply.push(cpu() - c);
        assert_eq!(got.downloaded_bytes, 0);
        // Baseline: GNU tar + gzip extracting the same cached blobs.
        let tar_dir = work.path().join(format!("tar{run}"));
        std::fs::create_dir_all(&tar_dir).unwrap_or_else(|e| panic!("{e}"));
        let (t, c) = (Instant::now(), cpu_children());
        for l in &got.layers {
            let blob = work.path().join("blobs/sha256").join(l.digest.hex());
            let st = std::process::Command::new("tar")
                .arg("-xzf")
                .arg(&blob)
                .arg("-C")
                .arg(&tar_dir)
                .status()
                .unwrap_or_else(|e| panic!("tar: {e}"));
            assert!(st.success());
        }
        t_tar.push(t.elapsed().as_secs_f64());
        c_tar.push(cpu_children() - c);
        for d in ["pull", "apply", "tar"] {
            let _ = std::fs::remove_dir_all(work.path().join(format!("{d}{run}")));
        }
    }
    let mb = blob_bytes as f64 / (1 << 20) as f64;
    let (p, d, a) = (median(&t_pull), median(&t_dl), median(&t_apply));
    let (cp, cd, ca) = (median(&c_pull), median(&c_dl), median(&c_apply));
    println!(
        "image: {n_layers} gzip layers, {} files ({random_pct}% random), content {:.1} MiB, blobs {mb:.1} MiB; {runs} runs, medians",
        n_layers * files_per_layer,
        content as f64 / (1 << 20) as f64
    );
    println!(
        "pull (download+verify+apply): {p:.3} s  {:.1} MiB/s  cpu {cp:.3} s",
        mb / p
    );
    println!(
        "download only (GET to sink):  {d:.3} s  {:.1} MiB/s  cpu {cd:.3} s",
        mb / d
    );
    println!(
        "apply only (blobs cached):    {a:.3} s  {:.1} MiB/s  cpu {ca:.3} s",
        mb / a
    );
    let (tt, ct) = (median(&t_tar), median(&c_tar));
    println!(
        "tar -xzf (GNU tar, baseline): {tt:.3} s  {:.1} MiB/s  cpu {ct:.3} s",
        mb / tt
    );
    println!(
        "pull / download-only: {:.2}x; apply-only / tar -xzf: {:.2}x",
        p / d,
        a / tt
    );
}
