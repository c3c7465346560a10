//! GPU checks on 2 GPUs with peer access: planning kernel bit-exact with the CPU planner,
//! dispatch/combine (NVLink and NCCL fallback) exactly equal to the reference on random and
//! extreme routings with poisoned buffers, baseline, prefetch, barrier timeouts. They run as two
//! processes (`moonep-launch -n 2 -- moonep-gpu-rank selftest`); skipped with a printed reason
//! where the machine has no such GPUs. `MOONEP_BIN_DIR` overrides where the binaries are found.

use std::path::PathBuf;

fn bin_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("MOONEP_BIN_DIR") {
        return PathBuf::from(d);
    }
    let built = PathBuf::from(env!("CARGO_BIN_EXE_moonep-gpu-rank"));
    if built.exists() {
        return built.parent().expect("bin dir").to_path_buf();
    }
    let exe = std::env::current_exe().expect("test exe");
    exe.parent()
        .and_then(|p| p.parent())
        .expect("target dir")
        .to_path_buf()
}

#[test]
fn gpu_plan_dispatch_combine_prefetch_baseline_and_timeouts_match_reference() {
    if let Some(reason) = moonep::gpu::bench::unavailable_reason() {
        eprintln!("skipping GPU checks: {reason}");
        return;
    }
    let dir = bin_dir();
    let rank_bin = dir.join("moonep-gpu-rank");
    assert!(
        rank_bin.exists(),
        "{} missing (build the bins or set MOONEP_BIN_DIR)",
        rank_bin.display()
    );
    moonep::gpu::launch::launch(2, &rank_bin, &["selftest".to_string()], 0)
        .unwrap_or_else(|e| panic!("GPU selftest failed: {e}"));
}

#[test]
fn nvlink_report_without_gpus_says_why() {
    // Where the tier cannot run, the reason names what is missing; where it can, there is none.
    match moonep::gpu::bench::unavailable_reason() {
        Some(reason) => assert!(
            reason.contains("nvcc")
                || reason.contains("driver")
                || reason.contains("device")
                || reason.contains("peer"),
            "unexpected reason: {reason}"
        ),
        None => assert!(moonep::gpu::driver::device_count().unwrap() >= 2),
    }
}
