//! GPU checks: planning kernel bit-exact with the CPU planner, dispatch/combine and their backward
//! (combine-backward, dispatch-backward, reduce_grad) exactly equal to the reference on random and
//! extreme routings with poisoned buffers, prefetch, barrier timeouts; on 2 GPUs also the NCCL
//! fallback and the baseline. They run as two processes (`moonep-launch -n 2 -- moonep-gpu-rank
//! selftest`): on two GPUs with peer access, and as two ranks sharing one GPU over CUDA IPC (no
//! NCCL). Skipped with a printed reason where the GPUs are missing; under `K3_REQUIRE_GPU=1` that
//! fails (`k3_common::require`). `MOONEP_BIN_DIR` overrides where the binaries are found.

use std::path::PathBuf;

use k3_common::Tier;
use k3_common::require::skip_or_fail;

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

/// Why no single GPU can run the checks, or None.
fn one_gpu_unavailable() -> Option<String> {
    if !moonep::gpu::driver::kernels_embedded() {
        return Some(moonep::gpu::GpuError::NoKernels.to_string());
    }
    match moonep::gpu::driver::device_count() {
        Err(e) => Some(e.to_string()),
        Ok(0) => Some("no CUDA device".into()),
        Ok(_) => None,
    }
}

#[test]
fn sm90_two_ranks_on_one_gpu_match_reference_forward_and_backward() {
    if let Some(reason) = one_gpu_unavailable() {
        skip_or_fail(Tier::Sm90, reason);
        return;
    }
    let rank_bin = bin_dir().join("moonep-gpu-rank");
    assert!(
        rank_bin.exists(),
        "{} missing (build the bins or set MOONEP_BIN_DIR)",
        rank_bin.display()
    );
    moonep::gpu::launch::launch_with_env(
        2,
        &rank_bin,
        &["selftest".to_string()],
        0,
        &[("MOONEP_DEVICE", "0")],
    )
    .unwrap_or_else(|e| panic!("GPU selftest (two ranks on GPU 0) failed: {e}"));
}

#[test]
fn nvlink_plan_dispatch_combine_prefetch_baseline_and_timeouts_match_reference() {
    if let Some(reason) = moonep::gpu::bench::unavailable_reason() {
        skip_or_fail(Tier::Nvlink, reason);
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
