//! CUDA-graph tests of the Rust API: `fwd` captured (global capture mode, the strictest) on a
//! stream no call used before, replayed on fresh inputs copied into the captured buffers over
//! NaN-poisoned outputs, and compared bitwise with the eager call on those inputs. Skipped, with
//! the reason printed, where no Hopper GPU is; `K3_REQUIRE_GPU=1` makes a skip a failure.

mod common;
use common::{gpu, log_line, seed};
use std::sync::Arc;

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use flashkda::harness::{DeviceProblem, StateIo};
use flashkda::reference::KdaProblem;
use flashkda::{FwdOptions, KdaKernels, Operands, Workspace, fwd, validate};

struct GraphCase {
    name: &'static str,
    /// Sequences of the captured call and of the fresh inputs (same count and total: the
    /// offsets differ, so a cu_seqlens read at capture time would show).
    lens_captured: Vec<usize>,
    lens_fresh: Vec<usize>,
    batched: bool,
    heads: usize,
    state: StateIo,
    caller_workspace: bool,
    opts: FwdOptions,
}

fn bits(x: &[f64]) -> Vec<u64> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// Out and final state of `dev` after the stream ran; no element may be left NaN.
fn read_written(dev: &DeviceProblem, what: &str) -> (Vec<f64>, Vec<f64>) {
    let (out, st) = dev.read().unwrap_or_else(|e| panic!("{what}: {e}"));
    let bad = out.iter().chain(&st).filter(|x| !x.is_finite()).count();
    assert_eq!(bad, 0, "{what}: {bad} elements not written or non-finite");
    (out, st)
}

/// Captures `fwd(args)` on `cap` (arguments taken before the capture begins) and instantiates it.
fn capture(
    kernels: &KdaKernels,
    cap: &Arc<CudaStream>,
    dev: &DeviceProblem,
    opts: &FwdOptions,
) -> cudarc::driver::CudaGraph {
    let args = dev.args();
    cap.synchronize().expect("sync before capture");
    cap.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL)
        .expect("begin capture");
    let r = fwd(kernels, cap, &args, opts);
    let graph = cap.end_capture(CUgraphInstantiate_flags(0));
    r.expect("fwd inside the capture");
    graph
        .expect("capture stayed valid")
        .expect("a graph was captured")
}

fn graph_case(gpu: &(KdaKernels, Arc<CudaStream>), c: &GraphCase) {
    let (kernels, stream) = gpu;
    let s = seed();
    let fresh_p = KdaProblem::random(&c.lens_fresh, c.heads, c.state.initial, s);
    let captured_p = KdaProblem::random(&c.lens_captured, c.heads, c.state.initial, s ^ 0x5eed);
    // eager on the fresh inputs, on its own stream and pooled workspace
    let mut eager = DeviceProblem::upload(stream, &fresh_p, c.state, c.batched).expect("upload");
    eager.poison().expect("poison");
    fwd(kernels, stream, &eager.args(), &c.opts).expect("eager fwd");
    stream.synchronize().expect("eager run");
    let (eo, es) = read_written(&eager, c.name);

    // the capture stream has never run a call: its pooled workspace is allocated while capturing
    let cap = kernels.context().new_stream().expect("stream");
    let mut dev = DeviceProblem::upload(&cap, &captured_p, c.state, c.batched).expect("upload");
    let plan = validate(&dev.args()).expect("valid");
    let call = kernels.call_plan(&plan, &c.opts).expect("plan");
    let ws_buf: Option<CudaSlice<u8>> = c.caller_workspace.then(|| {
        cap.alloc_zeros(call.workspace.total_bytes.max(1))
            .expect("ws")
    });
    let mut opts = c.opts;
    if let Some(b) = &ws_buf {
        let (ptr, _sync) = b.device_ptr(&cap);
        opts.workspace = Some(Workspace {
            ptr,
            bytes: b.len(),
        });
    }
    dev.poison().expect("poison");
    let graph = capture(kernels, &cap, &dev, &opts);
    cap.synchronize().expect("capture");
    // capturing ran nothing
    let (out0, _) = dev.read().expect("read");
    assert!(
        out0.iter().all(|x| x.is_nan()),
        "{}: the capture wrote outputs",
        c.name
    );
    for replay in 0..2 {
        dev.copy_inputs_from(&eager).expect("fresh inputs");
        dev.poison().expect("poison");
        graph.launch().expect("replay");
        cap.synchronize().expect("replay ran");
        let (go, gs) = read_written(&dev, c.name);
        let same_out = bits(&go) == bits(&eo);
        let same_state = bits(&gs) == bits(&es);
        log_line(&format!(
            "{{\"test\":\"graph\",\"case\":\"{}\",\"H\":{},\"state\":\"{}\",\"caller_workspace\":{},\"schedule\":\"{:?}\",\"operands\":\"{:?}\",\"overlap\":{},\"segments\":{},\"replay\":{replay},\"seed\":{s},\"out_bitwise_equal\":{same_out},\"state_bitwise_equal\":{same_state}}}",
            c.name,
            c.heads,
            c.state.label(),
            c.caller_workspace,
            call.schedule,
            call.operands,
            call.overlap,
            call.segments.segs_per_seq,
        ));
        assert!(
            same_out && same_state,
            "{} (replay {replay}, seed {s}): graph replay differs from the eager call (out {same_out}, state {same_state})",
            c.name
        );
    }
    // eager calls on the capture stream afterwards share its pooled workspace in stream order
    dev.poison().expect("poison");
    fwd(kernels, &cap, &dev.args(), &opts).expect("eager on the capture stream");
    cap.synchronize().expect("eager run");
    let (o2, _) = read_written(&dev, c.name);
    assert_eq!(bits(&o2), bits(&eo), "{}: eager after the graph", c.name);
    drop(graph);
}

const VARLEN6: [usize; 6] = [1300, 547, 2048, 963, 271, 3063];
const VARLEN6_FRESH: [usize; 6] = [2048, 1300, 271, 3063, 963, 547];

fn cases() -> Vec<GraphCase> {
    let d = FwdOptions::default;
    vec![
        // the shape of issue 11's report: H=64 varlen6, fp32 state in and out, default options
        GraphCase {
            name: "H=64 varlen6 fp32 state",
            lens_captured: VARLEN6.to_vec(),
            lens_fresh: VARLEN6_FRESH.to_vec(),
            batched: false,
            heads: 64,
            state: StateIo::both(true),
            caller_workspace: false,
            opts: d(),
        },
        GraphCase {
            name: "H=8 varlen4 bf16 state, caller workspace",
            lens_captured: vec![100, 37, 16, 300],
            lens_fresh: vec![300, 16, 100, 37],
            batched: false,
            heads: 8,
            state: StateIo::both(false),
            caller_workspace: true,
            opts: d(),
        },
        // long single sequence: split into segments (transition pass, scan, output pass)
        GraphCase {
            name: "B=1 T=16384 H=4 segmented",
            lens_captured: vec![16384],
            lens_fresh: vec![16384],
            batched: false,
            heads: 4,
            state: StateIo::both(false),
            caller_workspace: false,
            opts: d(),
        },
        GraphCase {
            name: "B=2 T=1024 H=8 split operands",
            lens_captured: vec![1024, 1024],
            lens_fresh: vec![1024, 1024],
            batched: true,
            heads: 8,
            state: StateIo::NONE,
            caller_workspace: false,
            opts: FwdOptions {
                operands: Operands::Split,
                ..d()
            },
        },
        // the prep beside the state pass on a side stream, forked and joined inside the capture
        GraphCase {
            name: "B=2 T=1024 H=8 overlapped",
            lens_captured: vec![1024, 1024],
            lens_fresh: vec![1024, 1024],
            batched: true,
            heads: 8,
            state: StateIo::both(true),
            caller_workspace: false,
            opts: FwdOptions {
                operands: Operands::Split,
                overlap: Some(true),
                ..d()
            },
        },
    ]
}

#[test]
fn graph_replay_on_fresh_inputs_equals_eager_bitwise() {
    let Some(gpu) = gpu() else { return };
    for c in cases() {
        graph_case(&gpu, &c);
    }
}

/// The opt-in chunk-64 forward (`KernelSchedule::Chunk64`) captured and replayed like the others;
/// its own test so the device script can run it apart (`chunk64_graph`) while it is unverified.
#[test]
fn chunk64_graph_replay_equals_eager_bitwise() {
    let Some(gpu) = gpu() else { return };
    let c64 = FwdOptions {
        schedule: flashkda::KernelSchedule::Chunk64,
        ..FwdOptions::default()
    };
    for c in [
        GraphCase {
            name: "chunk64 H=8 varlen4 fp32 state",
            lens_captured: vec![100, 37, 64, 300],
            lens_fresh: vec![300, 64, 100, 37],
            batched: false,
            heads: 8,
            state: StateIo::both(true),
            caller_workspace: false,
            opts: c64,
        },
        GraphCase {
            name: "chunk64 B=2 T=1024 H=4 bf16 state, caller workspace",
            lens_captured: vec![1024, 1024],
            lens_fresh: vec![1024, 1024],
            batched: true,
            heads: 4,
            state: StateIo::both(false),
            caller_workspace: true,
            opts: c64,
        },
    ] {
        graph_case(&gpu, &c);
    }
}

/// The first use of the kernels may fall inside a caller's capture: loading them there neither
/// fails nor invalidates the capture, and the graph replays like the eager call.
#[test]
fn kernels_loaded_inside_a_capture() {
    let Some((first, stream)) = gpu() else { return };
    let ctx = first.context().clone();
    drop(first);
    let p = KdaProblem::random(&[200, 77], 4, true, seed());
    let state = StateIo::both(true);
    let cap = ctx.new_stream().expect("stream");
    let mut dev = DeviceProblem::upload(&cap, &p, state, false).expect("upload");
    dev.poison().expect("poison");
    let args = dev.args();
    cap.synchronize().expect("sync");
    cap.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL)
        .expect("begin capture");
    let kernels = KdaKernels::load(&ctx);
    let r = kernels
        .as_ref()
        .map_err(|e| e.to_string())
        .and_then(|k| fwd(k, &cap, &args, &FwdOptions::default()).map_err(|e| e.to_string()));
    let graph = cap.end_capture(CUgraphInstantiate_flags(0));
    let kernels = kernels.expect("load inside the capture");
    r.expect("fwd inside the capture");
    let graph = graph.expect("capture stayed valid").expect("graph");
    graph.launch().expect("replay");
    cap.synchronize().expect("replay ran");
    let (go, gs) = read_written(&dev, "loaded inside a capture");
    let mut eager = DeviceProblem::upload(&stream, &p, state, false).expect("upload");
    eager.poison().expect("poison");
    fwd(&kernels, &stream, &eager.args(), &FwdOptions::default()).expect("eager");
    stream.synchronize().expect("eager run");
    let (eo, es) = read_written(&eager, "eager");
    assert!(
        bits(&go) == bits(&eo) && bits(&gs) == bits(&es),
        "replay of the graph captured with the load differs from eager"
    );
    log_line(
        "{\"test\":\"graph\",\"case\":\"kernels loaded inside a capture\",\"bitwise_equal\":true}",
    );
}
