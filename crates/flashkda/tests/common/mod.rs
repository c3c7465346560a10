//! What the GPU test binaries share: the device (or the reason to skip), a fresh seed, the log.

use std::io::Write;
use std::sync::Arc;

use cudarc::driver::CudaStream;
use flashkda::{FlashKdaError, KdaKernels, open_device};

/// `K3_REQUIRE_GPU=1` (GPU runners, device runs) turns a skip into a failure.
fn skip(why: String) -> Option<(KdaKernels, Arc<CudaStream>)> {
    if std::env::var("K3_REQUIRE_GPU").is_ok_and(|v| v == "1") {
        panic!("K3_REQUIRE_GPU=1 but {why}");
    }
    println!("SKIPPED: {why}");
    None
}

/// The kernels on device 0 and a stream, or `None` (with the reason printed) without an sm_90 GPU.
pub fn gpu() -> Option<(KdaKernels, Arc<CudaStream>)> {
    let ctx = match open_device(0) {
        Ok(c) => c,
        Err(e) => return skip(format!("no CUDA device ({e})")),
    };
    match KdaKernels::load(&ctx) {
        Ok(k) => Some((k, ctx.new_stream().expect("stream"))),
        Err(FlashKdaError::Arch { major, minor, .. }) => {
            skip(format!("GPU is sm_{major}{minor}, kernels need sm_90"))
        }
        Err(e) => panic!("a CUDA device is present but the kernels cannot be loaded: {e}"),
    }
}

/// A fresh seed per case (printed with every failure).
pub fn seed() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
}

/// Prints `line` and appends it to `$FLASHKDA_GPU_LOG` when set.
pub fn log_line(line: &str) {
    println!("{line}");
    if let Ok(path) = std::env::var("FLASHKDA_GPU_LOG") {
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .expect("log file");
        writeln!(f, "{line}").expect("write log");
    }
}
