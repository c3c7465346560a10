//! What the GPU test binaries share: the device (or the reason to skip), a fresh seed, the log,
//! one forward call checked against a reference.

use std::io::Write;
use std::sync::Arc;

use cudarc::driver::CudaStream;
use flashkda::harness::{DeviceProblem, StateIo};
use flashkda::reference::KdaOutput;
use flashkda::reference::metrics::rel_frobenius;
use flashkda::{FlashKdaError, FwdOptions, KdaKernels, fwd, open_device};

/// Skips through the workspace's one gate (counted by `cargo xtask test`); `K3_REQUIRE_GPU=1` (GPU
/// runners, device runs) turns the skip into a failure.
#[track_caller]
fn skip(why: String) -> Option<(KdaKernels, Arc<CudaStream>)> {
    let test = std::thread::current()
        .name()
        .unwrap_or("flashkda GPU test")
        .to_string();
    k3_common::require::skip_part(k3_common::require::Part::Gpu, &test, why);
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

/// The variants `FLASHKDA_TEST_KERNELS` (comma list of names) picks from `all`, or all of them
/// when unset; a list that picks none (`what`: the kind of variant) panics.
#[allow(dead_code, reason = "the forward tests' (gpu.rs, gpu_d64.rs)")]
pub fn picked_variants<V>(
    all: impl IntoIterator<Item = V>,
    name: impl Fn(&V) -> &str,
    what: &str,
) -> Vec<V> {
    let only = std::env::var("FLASHKDA_TEST_KERNELS").unwrap_or_default();
    let picked: Vec<_> = all
        .into_iter()
        .filter(|v| only.is_empty() || only.split(',').any(|o| o.trim() == name(v)))
        .collect();
    assert!(
        !picked.is_empty(),
        "FLASHKDA_TEST_KERNELS={only:?} names no {what}"
    );
    picked
}

/// One forward call read back: output and final state, their non-finite (unwritten) element
/// counts, relative Frobenius errors against the reference (`rel_state` 0 without a final state).
#[allow(dead_code, reason = "the forward tests' (gpu.rs, gpu_d64.rs)")]
pub struct FwdRun {
    pub out: Vec<f64>,
    pub state: Vec<f64>,
    pub nonfinite_out: usize,
    pub nonfinite_state: usize,
    pub rel_out: f64,
    pub rel_state: f64,
}

#[allow(dead_code, reason = "the forward tests' (gpu.rs, gpu_d64.rs)")]
impl FwdRun {
    /// Asserts every element written (finite) and both errors within `bar`.
    pub fn assert_written_within(&self, bar: f64, name: &str) {
        let (nan_out, nan_st) = (self.nonfinite_out, self.nonfinite_state);
        let (eo, es) = (self.rel_out, self.rel_state);
        assert_eq!(
            nan_out, 0,
            "{name}: {nan_out} output elements not written (still NaN) or non-finite"
        );
        assert_eq!(
            nan_st, 0,
            "{name}: {nan_st} state elements not written or non-finite"
        );
        assert!(eo <= bar, "{name}: out rel error {eo:e} > {bar:e}");
        assert!(es <= bar, "{name}: final_state rel error {es:e} > {bar:e}");
    }
}

/// Runs `fwd` on `dev` with `opts`, waits for the stream and compares with `reference`; a failed
/// call, kernel or read-back panics with `name`.
#[allow(dead_code, reason = "the forward tests' (gpu.rs, gpu_d64.rs)")]
pub fn run_fwd(
    (kernels, stream): &(KdaKernels, Arc<CudaStream>),
    dev: &DeviceProblem,
    opts: &FwdOptions,
    state: StateIo,
    reference: &KdaOutput,
    name: &str,
) -> FwdRun {
    fwd(kernels, stream, &dev.args(), opts).unwrap_or_else(|e| panic!("{name}: fwd failed: {e}"));
    stream
        .synchronize()
        .unwrap_or_else(|e| panic!("{name}: kernel failed: {e}"));
    let (out, st) = dev.read().unwrap_or_else(|e| panic!("{name}: {e}"));
    FwdRun {
        nonfinite_out: out.iter().filter(|x| !x.is_finite()).count(),
        nonfinite_state: st.iter().filter(|x| !x.is_finite()).count(),
        rel_out: rel_frobenius(&out, &reference.out),
        rel_state: if state.final_ {
            rel_frobenius(&st, &reference.final_state)
        } else {
            0.0
        },
        out,
        state: st,
    }
}
