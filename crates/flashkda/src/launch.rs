//! Loads the embedded sm_90a cubins and launches the forward on the caller's stream. The only
//! module that launches kernels.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaStream, DeviceRepr, LaunchConfig, PushKernelArg,
};

use crate::error::{DriverContext, FlashKdaError};
use crate::head_dim::check_head_dim_enabled;
use crate::reference::HEAD_DIM;
use crate::schedule::{ScheduleRequest, call_plan};
use crate::validate::{FwdArgs, FwdPlan, StateDType, check_cu_seqlens, validate};

pub use crate::schedule::{
    CallPlan, KernelSchedule, Operands, SPLIT_RECORD_BYTES, SPLIT_RECORD_BYTES_D64, ValueSplit,
    WORKSPACE_AUTO_LIMIT, WORKSPACE_RECORD_BYTES, WORKSPACE_RECORD_BYTES_D64,
};

mod pool;
pub use pool::is_capturing;
use pool::{RelaxedCapture, SideStream, WorkspacePool, side_stream, workspace_ptr};

mod ws;
use ws::{WorkspaceKernels, launch_workspace_schedule};

mod c64;
use c64::{Chunk64Kernels, launch_chunk64};

mod bwd;
pub use bwd::{
    BwdLayout, BwdOptions, PassSchedule, bwd, bwd_layout, bwd_pass_warps, bwd_validated,
    bwd_workspace_bytes, pass_schedule,
};

mod built {
    include!(concat!(env!("OUT_DIR"), "/kernels.rs"));
}

/// True when build.rs compiled the kernels (nvcc was found).
pub fn kernels_built() -> bool {
    !built::CUBINS.is_empty()
}

/// `name` from `module`, allowed `smem` bytes of dynamic shared memory (0: the default); `what` names the
/// step in a driver error.
fn load_kernel(
    module: &Arc<CudaModule>,
    name: &str,
    smem: u32,
    what: &'static str,
) -> Result<CudaFunction, FlashKdaError> {
    let f = module.load_function(name).during(what)?;
    if smem > 0 {
        f.set_attribute(
            cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            smem as i32,
        )
        .during(what)?;
    }
    Ok(f)
}

/// The embedded sm_90a cubin of `kernels/<stem>.cu` (for GPU tests that launch one of its kernels
/// directly, e.g. `kda_c64_wgmma_selftest`), if it was built.
pub fn embedded_cubin(stem: &str) -> Option<&'static [u8]> {
    built::CUBINS
        .iter()
        .find(|(s, _)| *s == stem)
        .map(|(_, c)| *c)
}

#[cfg(flashkda_kernels)]
fn not_built_reason() -> &'static str {
    "no cubin embedded"
}

#[cfg(not(flashkda_kernels))]
fn not_built_reason() -> &'static str {
    built::NOT_BUILT
}

/// The primary context of CUDA device `ordinal` (shared with torch and other libraries), or
/// [`FlashKdaError::NoDriver`] where no driver is installed (instead of cudarc's panic).
pub fn open_device(ordinal: usize) -> Result<Arc<CudaContext>, FlashKdaError> {
    // SAFETY: only probes whether libcuda can be dlopened.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(FlashKdaError::NoDriver);
    }
    let _relaxed = RelaxedCapture::enter();
    CudaContext::new(ordinal).during("opening the CUDA device")
}

/// Loads `f` now rather than at its first launch (lazy loading), which may fall inside a capture.
fn load_now(f: &CudaFunction) -> Result<(), FlashKdaError> {
    // SAFETY: `f` is a live function of a loaded module.
    unsafe { cudarc::driver::sys::cuFuncLoad(f.cu_function()) }
        .result()
        .during("loading a kernel")
}

/// Mirror of `struct KdaParams` in `kernels/kda_common.cuh` (passed by value).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct KernelParams {
    q: u64,
    k: u64,
    v: u64,
    g: u64,
    beta: u64,
    a_log: u64,
    dt_bias: u64,
    out: u64,
    h0: u64,
    ht: u64,
    cu_seqlens: u64,
    seq_len: i64,
    total_tokens: i64,
    num_heads: i32,
    num_seqs: i32,
    state_fp32: i32,
    scale: f32,
    lower_bound: f32,
    ws: u64,
    seg_chunks: i32,
    segs_per_seq: i32,
    qk_heads: i32,
    pad: i32,
    flags: u64,
}

// SAFETY: plain-old-data, layout identical to the C struct (checked by a test on its size).
unsafe impl DeviceRepr for KernelParams {}

/// A caller-owned device buffer for a call's workspace (size: [`workspace_bytes`]). It must stay
/// allocated until the stream has run the call (for a captured graph: as long as the graph).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Workspace {
    pub ptr: u64,
    pub bytes: usize,
}

/// Launch options.
#[derive(Debug, Clone, Copy)]
pub struct FwdOptions {
    pub value_split: ValueSplit,
    pub schedule: KernelSchedule,
    /// bf16 or split (hi + lo) tensor-core operands on the workspace schedule.
    pub operands: Operands,
    /// Prep and state pass at once where safe (`None`: the measured default).
    pub overlap: Option<bool>,
    /// Copy `cu_seqlens` to the host and check it (one small sync). Skipped automatically while
    /// the stream is being captured into a CUDA graph; the kernels clamp bad offsets either way,
    /// never reading out of bounds.
    pub check_cu_seqlens: bool,
    /// Context parallelism: `None` = [`crate::plan_segments`], `Some(0)` = off, `Some(c)` =
    /// segments of `c` chunks (fixed-length calls of the `Workspace` schedule only).
    pub segment_chunks: Option<usize>,
    /// The caller's workspace; `None` takes the stream's pooled one from [`KdaKernels`] (a graph
    /// captured with it shares it with every call on its capture stream: replay it in stream
    /// order with them, or pass a workspace of its own).
    pub workspace: Option<Workspace>,
}

impl FwdOptions {
    /// The fields the schedule depends on.
    pub fn schedule_request(&self) -> ScheduleRequest {
        ScheduleRequest {
            schedule: self.schedule,
            value_split: self.value_split,
            operands: self.operands,
            overlap: self.overlap,
            segment_chunks: self.segment_chunks,
        }
    }
}

impl Default for FwdOptions {
    fn default() -> Self {
        FwdOptions {
            value_split: ValueSplit::Auto,
            schedule: KernelSchedule::Auto,
            operands: Operands::Auto,
            overlap: None,
            check_cu_seqlens: true,
            segment_chunks: None,
            workspace: None,
        }
    }
}

/// The loaded kernels of one device.
#[derive(Debug)]
pub struct KdaKernels {
    ctx: Arc<CudaContext>,
    two_warps: CudaFunction,
    four_warps: CudaFunction,
    pipelined: CudaFunction,
    /// `kda_fwd_ws.cu` (bf16 operands).
    ws_bf16: WorkspaceKernels,
    /// `kda_fwd_ws_split.cu` (split operands).
    ws_split: WorkspaceKernels,
    /// `kda_fwd_ws_d64.cu`, `kda_fwd_ws_split_d64.cu`: the same at head dim 64.
    ws64_bf16: WorkspaceKernels,
    ws64_split: WorkspaceKernels,
    /// `kda_fwd_c64.cu` (opt-in `KernelSchedule::Chunk64`, slower than the default): a failure to
    /// load them fails only the calls that ask for them, never the default kernels.
    c64: Result<Chunk64Kernels, String>,
    /// `kda_bwd_chunk.cu`.
    bwd: bwd::BwdKernels,
    /// Pooled workspaces, one per stream (so calls on different streams never share one).
    workspaces: Mutex<WorkspacePool>,
    /// Highest-priority side streams of the overlapped state pass, one per caller stream, kept
    /// (never destroyed while a capture may hold them) until the kernels are dropped.
    side_streams: Mutex<HashMap<usize, SideStream>>,
    sm_count: usize,
}

/// Dynamic shared memory of `kda_fwd_pipe_w4` (`PIPE_SMEM_BYTES` in the .cu, checked there).
const PIPE_SMEM_BYTES: u32 = 65344;
impl KdaKernels {
    /// Loads the cubins into `ctx` (the device's primary context, shared with torch), every
    /// forward kernel at once. Safe to call inside a stream capture (relaxed mode meanwhile).
    pub fn load(ctx: &Arc<CudaContext>) -> Result<Self, FlashKdaError> {
        let _relaxed = RelaxedCapture::enter();
        let cubin = |stem: &str| {
            built::CUBINS
                .iter()
                .find(|(s, _)| *s == stem)
                .map(|(_, c)| c.to_vec())
                .ok_or(FlashKdaError::KernelsNotBuilt(not_built_reason()))
        };
        let (seq_cubin, pipe_cubin) = (cubin("kda_fwd")?, cubin("kda_fwd_pipelined")?);
        let ws_cubins = [
            (Operands::Bf16, HEAD_DIM),
            (Operands::Split, HEAD_DIM),
            (Operands::Bf16, 64),
            (Operands::Split, 64),
        ]
        .map(|(o, d)| cubin(ws::cubin_stem(o, d)).map(|c| (c, o, d)));
        let [ws_a, ws_b, ws_c, ws_d] = ws_cubins;
        let ws_cubins = [ws_a?, ws_b?, ws_c?, ws_d?];
        let bwd_cubin = cubin("kda_bwd_chunk")?;
        let c64_cubin = cubin("kda_fwd_c64")?;
        let (major, minor) = ctx
            .compute_capability()
            .during("reading compute capability")?;
        if (major, minor) != (9, 0) {
            return Err(FlashKdaError::Arch {
                ordinal: ctx.ordinal(),
                major,
                minor,
            });
        }
        let module = ctx
            .load_module(cudarc::nvrtc::Ptx::from_binary(seq_cubin))
            .during("loading the kda_fwd cubin")?;
        let two_warps = module
            .load_function("kda_fwd_w2")
            .during("loading kda_fwd_w2")?;
        let four_warps = module
            .load_function("kda_fwd_w4")
            .during("loading kda_fwd_w4")?;
        let module = ctx
            .load_module(cudarc::nvrtc::Ptx::from_binary(pipe_cubin))
            .during("loading the kda_fwd_pipelined cubin")?;
        let pipelined = load_kernel(
            &module,
            "kda_fwd_pipe_w4",
            PIPE_SMEM_BYTES,
            "loading kda_fwd_pipe_w4",
        )?;
        let [ws_bf16, ws_split, ws64_bf16, ws64_split] =
            ws_cubins.map(|(c, o, d)| WorkspaceKernels::load(ctx, c, o, d));
        let (ws_bf16, ws_split, ws64_bf16, ws64_split) =
            (ws_bf16?, ws_split?, ws64_bf16?, ws64_split?);
        let module = ctx
            .load_module(cudarc::nvrtc::Ptx::from_binary(bwd_cubin))
            .during("loading the kda_bwd_chunk cubin")?;
        let bwd = bwd::BwdKernels::load(&module)?;
        let c64 = Chunk64Kernels::load(ctx, c64_cubin)
            .and_then(|k| {
                k.functions().into_iter().try_for_each(load_now)?;
                Ok(k)
            })
            .map_err(|e| e.to_string());
        let sm_count = ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
            .during("reading the SM count")? as usize;
        for ws in [&ws_bf16, &ws_split, &ws64_bf16, &ws64_split] {
            for f in ws.functions() {
                load_now(f)?;
            }
        }
        for f in [&two_warps, &four_warps, &pipelined] {
            load_now(f)?;
        }
        Ok(KdaKernels {
            ctx: ctx.clone(),
            two_warps,
            four_warps,
            pipelined,
            ws_bf16,
            ws_split,
            ws64_bf16,
            ws64_split,
            c64,
            bwd,
            workspaces: Mutex::new(WorkspacePool::default()),
            side_streams: Mutex::new(HashMap::new()),
            sm_count,
        })
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Streaming multiprocessors of the device.
    pub fn sm_count(&self) -> usize {
        self.sm_count
    }

    /// [`call_plan`] of a validated call on this device (no device access), or
    /// [`FlashKdaError::HeadDimUnverified`] for a head dim no GPU run has verified
    /// ([`crate::head_dim`]).
    pub fn call_plan(&self, plan: &FwdPlan, opts: &FwdOptions) -> Result<CallPlan, FlashKdaError> {
        check_head_dim_enabled(plan.head_dim)?;
        call_plan(plan, &opts.schedule_request(), self.sm_count)
    }

    /// The workspace kernels for resolved `operands` (`Bf16` or `Split`) at `head_dim`.
    fn workspace_kernels(&self, operands: Operands, head_dim: usize) -> &WorkspaceKernels {
        match (operands, head_dim == HEAD_DIM) {
            (Operands::Split, true) => &self.ws_split,
            (_, true) => &self.ws_bf16,
            (Operands::Split, false) => &self.ws64_split,
            (_, false) => &self.ws64_bf16,
        }
    }
}

/// Workspace bytes a call with `args` and `opts` needs (0 for schedules without one).
pub fn workspace_bytes(
    kernels: &KdaKernels,
    args: &FwdArgs,
    opts: &FwdOptions,
) -> Result<usize, FlashKdaError> {
    let plan = validate(args)?;
    Ok(kernels.call_plan(&plan, opts)?.workspace.total_bytes)
}

/// Validates `args`, checks `cu_seqlens` (unless disabled or capturing) and enqueues the forward
/// on `stream`. Device pointers in `args` (and the workspace) must stay valid until the stream
/// has run the call.
pub fn fwd(
    kernels: &KdaKernels,
    stream: &CudaStream,
    args: &FwdArgs,
    opts: &FwdOptions,
) -> Result<FwdPlan, FlashKdaError> {
    let plan = validate(args)?;
    fwd_validated(kernels, stream, args, &plan, opts)?;
    Ok(plan)
}

/// [`fwd`] for arguments [`validate`] already accepted as `plan` (validated once per call).
pub fn fwd_validated(
    kernels: &KdaKernels,
    stream: &CudaStream,
    args: &FwdArgs,
    plan: &FwdPlan,
    opts: &FwdOptions,
) -> Result<CallPlan, FlashKdaError> {
    let call = kernels.call_plan(plan, opts)?;
    fwd_planned(kernels, stream, args, plan, &call, opts)?;
    Ok(call)
}

/// Enqueues the call `plan` (from [`validate`]) as `call` (from [`KdaKernels::call_plan`]):
/// neither is recomputed here.
pub fn fwd_planned(
    kernels: &KdaKernels,
    stream: &CudaStream,
    args: &FwdArgs,
    plan: &FwdPlan,
    call: &CallPlan,
    opts: &FwdOptions,
) -> Result<(), FlashKdaError> {
    check_head_dim_enabled(plan.head_dim)?;
    if plan.head_dim != HEAD_DIM && call.schedule != KernelSchedule::Workspace {
        // (Chunk64 at head dim 64 never gets here: call_plan refuses it)
        return Err(FlashKdaError::HeadDimSchedule {
            head_dim: plan.head_dim,
            what: format!("the {:?} schedule", call.schedule),
        });
    }
    let capturing = begin_call(
        kernels,
        stream,
        plan,
        args.cu_seqlens.as_ref(),
        opts.check_cu_seqlens,
    )?;
    let total = plan.batch * plan.seq_len;
    let chains = plan.num_seqs * plan.heads;
    if chains == 0 {
        return Ok(());
    }
    let mut params = KernelParams {
        q: args.q.ptr,
        k: args.k.ptr,
        v: args.v.ptr,
        g: args.g.ptr,
        beta: args.beta.ptr,
        a_log: args.a_log.ptr,
        dt_bias: args.dt_bias.ptr,
        out: args.out.ptr,
        h0: args.initial_state.as_ref().map_or(0, |t| t.ptr),
        ht: args.final_state.as_ref().map_or(0, |t| t.ptr),
        cu_seqlens: args.cu_seqlens.as_ref().map_or(0, |t| t.ptr),
        seq_len: plan.seq_len as i64,
        total_tokens: total as i64,
        num_heads: plan.heads as i32,
        num_seqs: plan.num_seqs as i32,
        state_fp32: i32::from(plan.state == Some(StateDType::F32)),
        scale: args.scale,
        lower_bound: args.lower_bound,
        ws: 0,
        seg_chunks: 0,
        segs_per_seq: 1,
        qk_heads: plan.qk_heads as i32,
        pad: 0,
        flags: 0,
    };
    if call.schedule == KernelSchedule::Workspace {
        let need = call.workspace.total_bytes.max(1);
        params.ws = workspace_ptr(kernels, stream, opts.workspace, need, capturing)?;
        return launch_workspace_schedule(kernels, stream, plan, call, params);
    }
    if call.schedule == KernelSchedule::Chunk64 {
        let need = call.workspace.total_bytes.max(1);
        params.ws = workspace_ptr(kernels, stream, opts.workspace, need, capturing)?;
        let c64 = kernels.c64.as_ref().map_err(|e| {
            FlashKdaError::Chunk64Unsupported(format!(
                "this device: its kernels did not load ({e})"
            ))
        })?;
        return launch_chunk64(c64, stream, plan, params);
    }
    let (func, slices, threads, smem) = match (call.schedule, call.split) {
        (KernelSchedule::Pipelined, _) => (&kernels.pipelined, 2u32, 128u32, PIPE_SMEM_BYTES),
        (_, ValueSplit::Four | ValueSplit::Eight) => (&kernels.two_warps, 4, 64, 0),
        _ => (&kernels.four_warps, 2, 128, 0),
    };
    let cfg = LaunchConfig {
        grid_dim: (chains as u32 * slices, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: smem,
    };
    let mut launch = stream.launch_builder(func);
    launch.arg(&params);
    // SAFETY: the kernel reads/writes only the validated tensors described by `params`.
    unsafe { launch.launch(cfg) }.during("launching kda_fwd")?;
    Ok(())
}

/// The start of every call (forward and backward): checks the device, binds the context and,
/// outside a stream capture and when `check` is set, checks `cu_seqlens` on the host. Returns
/// whether the stream is capturing.
fn begin_call(
    kernels: &KdaKernels,
    stream: &CudaStream,
    plan: &FwdPlan,
    cu_seqlens: Option<&crate::validate::TensorView>,
    check: bool,
) -> Result<bool, FlashKdaError> {
    if plan.ordinal != kernels.ctx.ordinal() {
        return Err(FlashKdaError::Device {
            tensor: "q",
            expected: kernels.ctx.ordinal(),
            found: format!("cuda:{}", plan.ordinal),
        });
    }
    kernels.ctx.bind_to_thread().during("binding the context")?;
    let capturing = is_capturing(stream)?;
    if let (Some(cu), true, false) = (cu_seqlens, check, capturing) {
        let mut host = vec![0i64; plan.num_seqs + 1];
        // SAFETY: `cu` was validated as num_seqs + 1 contiguous int64 on this device.
        unsafe { cudarc::driver::result::memcpy_dtoh_async(&mut host, cu.ptr, stream.cu_stream()) }
            .during("copying cu_seqlens to the host")?;
        stream.synchronize().during("waiting for cu_seqlens")?;
        check_cu_seqlens(&host, plan.batch * plan.seq_len)?;
    }
    Ok(capturing)
}

#[cfg(test)]
mod tests {
    #[test]
    fn params_layout_matches_the_c_struct() {
        // 11 pointers, 2 int64, 3 int32, 2 float = 124 bytes, padded to 128, the ws pointer, 4 int32,
        // the flags pointer.
        assert_eq!(std::mem::size_of::<super::KernelParams>(), 160);
        assert_eq!(std::mem::size_of::<super::ws::ScanParams>(), 48);
        assert_eq!(std::mem::align_of::<super::KernelParams>(), 8);
    }
}
