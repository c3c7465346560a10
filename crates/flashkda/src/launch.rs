//! Loads the embedded sm_90a cubins and launches the forward on the caller's stream. The only
//! module that launches kernels.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::{
    CudaContext, CudaFunction, CudaStream, DeviceRepr, LaunchConfig, PushKernelArg,
};

use crate::error::{DriverContext, FlashKdaError};
use crate::reference::CHUNK;
use crate::validate::{FwdArgs, FwdPlan, StateDType, check_cu_seqlens, validate};

mod built {
    include!(concat!(env!("OUT_DIR"), "/kernels.rs"));
}

/// True when build.rs compiled the kernels (nvcc was found).
pub fn kernels_built() -> bool {
    !built::CUBINS.is_empty()
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
    CudaContext::new(ordinal).during("opening the CUDA device")
}

/// Mirror of `struct KdaParams` in `kernels/kda_fwd.cu` (passed by value).
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
}

// SAFETY: plain-old-data, layout identical to the C struct (checked by a test on its size).
unsafe impl DeviceRepr for KernelParams {}

/// How many blocks share one (sequence, head): each owns a slice of the 128 value rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ValueSplit {
    /// `Two` (the measured best on the H200 for every schedule and anchor shape).
    #[default]
    Auto,
    /// Four blocks of 2 warps (32 value rows each).
    Four,
    /// Two blocks of 4 warps (64 value rows each).
    Two,
    /// Eight one-warp blocks (16 value rows each); `Workspace` schedule only (the others use `Four`).
    Eight,
}

/// Which kernel runs the chunk loop.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KernelSchedule {
    /// `Workspace` (unless its workspace would exceed [`WORKSPACE_AUTO_LIMIT`] or the stream is
    /// being captured into a CUDA graph: then `Pipelined`).
    #[default]
    Auto,
    /// `kda_fwd.cu`: prep then state work per chunk, four barriers per chunk.
    Sequential,
    /// `kda_fwd_pipelined.cu`: prep of chunk c+1 overlapped with the state work of chunk c,
    /// two barriers per chunk (always two 4-warp blocks per chain; `value_split` is ignored).
    Pipelined,
    /// `kda_fwd_ws.cu`: a parallel prep kernel over all (chunk, head) writes the state-independent
    /// tensors to a device workspace (13888 bytes per 16 tokens and head, owned by
    /// [`KdaKernels`]); the sequential pass only does the state matmuls, 2, 4 or 8 blocks per chain.
    Workspace,
}

/// Launch options.
#[derive(Debug, Clone, Copy)]
pub struct FwdOptions {
    pub value_split: ValueSplit,
    pub schedule: KernelSchedule,
    /// Copy `cu_seqlens` to the host and check it (one small sync). Turn off only while
    /// capturing a CUDA graph; the kernel clamps bad offsets either way, never reading out of bounds.
    pub check_cu_seqlens: bool,
}

impl Default for FwdOptions {
    fn default() -> Self {
        FwdOptions {
            value_split: ValueSplit::Auto,
            schedule: KernelSchedule::Auto,
            check_cu_seqlens: true,
        }
    }
}

/// One device allocation, freed on drop.
#[derive(Debug)]
struct Workspace {
    ctx: Arc<CudaContext>,
    ptr: cudarc::driver::sys::CUdeviceptr,
    bytes: usize,
}

impl Workspace {
    fn new(ctx: &Arc<CudaContext>, bytes: usize) -> Result<Self, FlashKdaError> {
        ctx.bind_to_thread().during("binding the context")?;
        // SAFETY: a plain allocation on the bound context.
        let ptr = unsafe { cudarc::driver::result::malloc_sync(bytes) }
            .during("allocating the workspace")?;
        Ok(Workspace {
            ctx: ctx.clone(),
            ptr,
            bytes,
        })
    }
}

impl Drop for Workspace {
    fn drop(&mut self) {
        // cuMemFree waits for work still using the allocation; errors cannot be reported here.
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: `ptr` came from malloc_sync on this context and is freed once.
            let _ = unsafe { cudarc::driver::result::free_sync(self.ptr) };
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
    prep: CudaFunction,
    /// `kda_state_w{1,2,4}`: 1, 2 and 4 warps per block.
    state: [CudaFunction; 3],
    /// Workspaces of the `Workspace` schedule, one per stream (so calls on different streams
    /// never share one), grown on demand; plain device allocations (no events: graph-capturable).
    workspaces: Mutex<HashMap<usize, Workspace>>,
    sm_count: usize,
}

/// Dynamic shared memory of `kda_fwd_pipe_w4` (`PIPE_SMEM_BYTES` in the .cu, checked there).
const PIPE_SMEM_BYTES: u32 = 65344;
/// Dynamic shared memory of `kda_state_w{1,2,4}` (`STATE_SMEM` in kda_fwd_ws.cu, checked there).
const STATE_SMEM_BYTES: [u32; 3] = [29584, 61216, 66848];
/// Bytes of one workspace record (one 16-token chunk slot of one head).
pub const WORKSPACE_RECORD_BYTES: usize = 13888;
/// `Auto` uses the workspace schedule only while its workspace stays below this size.
pub const WORKSPACE_AUTO_LIMIT: usize = 4 << 30;

impl KdaKernels {
    /// Loads the cubins into `ctx` (the device's primary context, shared with torch).
    pub fn load(ctx: &Arc<CudaContext>) -> Result<Self, FlashKdaError> {
        let cubin = |stem: &str| {
            built::CUBINS
                .iter()
                .find(|(s, _)| *s == stem)
                .map(|(_, c)| c.to_vec())
                .ok_or(FlashKdaError::KernelsNotBuilt(not_built_reason()))
        };
        let (seq_cubin, pipe_cubin) = (cubin("kda_fwd")?, cubin("kda_fwd_pipelined")?);
        let ws_cubin = cubin("kda_fwd_ws")?;
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
        let pipelined = module
            .load_function("kda_fwd_pipe_w4")
            .during("loading kda_fwd_pipe_w4")?;
        pipelined
            .set_attribute(
                cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                PIPE_SMEM_BYTES as i32,
            )
            .during("allowing 64 KiB of dynamic shared memory")?;
        let module = ctx
            .load_module(cudarc::nvrtc::Ptx::from_binary(ws_cubin))
            .during("loading the kda_fwd_ws cubin")?;
        let prep = module
            .load_function("kda_prep")
            .during("loading kda_prep")?;
        let load_state = |name: &str, bytes: u32| -> Result<CudaFunction, FlashKdaError> {
            let f = module.load_function(name).during("loading kda_state_w*")?;
            f.set_attribute(
                cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                bytes as i32,
            )
            .during("allowing the state pass's dynamic shared memory")?;
            Ok(f)
        };
        let state = [
            load_state("kda_state_w1", STATE_SMEM_BYTES[0])?,
            load_state("kda_state_w2", STATE_SMEM_BYTES[1])?,
            load_state("kda_state_w4", STATE_SMEM_BYTES[2])?,
        ];
        let sm_count = ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
            .during("reading the SM count")? as usize;
        Ok(KdaKernels {
            ctx: ctx.clone(),
            two_warps,
            four_warps,
            pipelined,
            prep,
            state,
            workspaces: Mutex::new(HashMap::new()),
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

    /// The split `Auto` picks for `chains` = sequences x heads. Measured on the H200
    /// (2026-11-29): two 4-warp blocks per chain beat four 2-warp blocks on every anchor shape
    /// (the per-block key-side prep is shared by more warps), so `Auto` is `Two`.
    pub fn auto_split(&self, _chains: usize) -> ValueSplit {
        ValueSplit::Two
    }

    /// The schedule `Auto` picks for a call whose `Workspace` schedule needs `workspace_bytes`.
    /// H200, run 3 (2026-11-29): with two blocks per chain the workspace schedule is 1.34-1.80x
    /// faster than `Pipelined` on all six anchor shapes; `Pipelined` (no workspace) is kept for
    /// huge problems.
    pub fn auto_schedule(&self, workspace_bytes: usize) -> KernelSchedule {
        if workspace_bytes <= WORKSPACE_AUTO_LIMIT {
            KernelSchedule::Workspace
        } else {
            KernelSchedule::Pipelined
        }
    }

    /// The value split `Auto` picks for the workspace schedule. H200, run 3 (2026-11-29): two
    /// 4-warp blocks per chain were fastest on five anchor shapes and within 0.1 % of four
    /// 2-warp blocks on H=64 fixed (1.1077 vs 1.1067 ms); eight 1-warp blocks never won.
    pub fn auto_workspace_split(&self, _chains: usize) -> ValueSplit {
        ValueSplit::Two
    }
}

/// Chunk slots of the workspace: `batch * ceil(seq_len / 16)` without `cu_seqlens`, else
/// `T / 16 + N` (sequence `n` starts at slot `cu[n] / 16 + n`; see kda_fwd_ws.cu).
pub fn workspace_slots(plan: &FwdPlan) -> usize {
    if plan.varlen {
        plan.seq_len / CHUNK + plan.num_seqs
    } else {
        plan.batch * plan.seq_len.div_ceil(CHUNK)
    }
}

/// Validates `args`, checks `cu_seqlens` (unless disabled) and enqueues the forward on `stream`.
/// Device pointers in `args` must stay valid until the stream has run the kernel.
pub fn fwd(
    kernels: &KdaKernels,
    stream: &CudaStream,
    args: &FwdArgs,
    opts: &FwdOptions,
) -> Result<FwdPlan, FlashKdaError> {
    let plan = validate(args)?;
    if plan.ordinal != kernels.ctx.ordinal() {
        return Err(FlashKdaError::Device {
            tensor: "q",
            expected: kernels.ctx.ordinal(),
            found: format!("cuda:{}", plan.ordinal),
        });
    }
    let total = plan.batch * plan.seq_len;
    if let (Some(cu), true) = (&args.cu_seqlens, opts.check_cu_seqlens) {
        let mut host = vec![0i64; plan.num_seqs + 1];
        kernels.ctx.bind_to_thread().during("binding the context")?;
        // SAFETY: `cu` was validated as num_seqs + 1 contiguous int64 on this device.
        unsafe { cudarc::driver::result::memcpy_dtoh_async(&mut host, cu.ptr, stream.cu_stream()) }
            .during("copying cu_seqlens to the host")?;
        stream.synchronize().during("waiting for cu_seqlens")?;
        check_cu_seqlens(&host, total)?;
    }
    let chains = plan.num_seqs * plan.heads;
    if chains == 0 {
        return Ok(plan);
    }
    let slots = workspace_slots(&plan);
    let ws_bytes = slots * plan.heads * WORKSPACE_RECORD_BYTES;
    kernels.ctx.bind_to_thread().during("binding the context")?;
    // SAFETY: queries the capture status of the caller's live stream.
    let capturing = unsafe { cudarc::driver::result::stream::is_capturing(stream.cu_stream()) }
        .during("querying the stream's capture status")?
        != cudarc::driver::sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    let schedule = match opts.schedule {
        // graphs bake in pointers: a workspace grown (reallocated) later would dangle
        KernelSchedule::Auto if capturing => KernelSchedule::Pipelined,
        // see `auto_schedule` for the measurement behind it
        KernelSchedule::Auto => kernels.auto_schedule(ws_bytes),
        KernelSchedule::Workspace if capturing => return Err(FlashKdaError::NotCapturable),
        s => s,
    };
    let split = match (opts.value_split, schedule) {
        (ValueSplit::Auto, KernelSchedule::Workspace) => kernels.auto_workspace_split(chains),
        (ValueSplit::Auto, _) => kernels.auto_split(chains),
        (s, _) => s,
    };
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
    };
    if schedule == KernelSchedule::Workspace {
        if slots > i32::MAX as usize {
            return Err(FlashKdaError::TooLarge(format!(
                "{slots} chunk slots exceed the prep kernel's grid"
            )));
        }
        let (index, slices) = match split {
            ValueSplit::Eight => (0, 8u32),
            ValueSplit::Four => (1, 4),
            _ => (2, 2),
        };
        let need = ws_bytes.max(1);
        let mut map = kernels.workspaces.lock().unwrap_or_else(|p| p.into_inner());
        let key = stream.cu_stream() as usize;
        if map.get(&key).is_some_and(|w| w.bytes < need) {
            // the old one may still be read by this stream's previous call
            stream
                .synchronize()
                .during("waiting before growing the workspace")?;
            map.remove(&key);
        }
        let ws = match map.entry(key) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                e.insert(Workspace::new(&kernels.ctx, need)?)
            }
        };
        params.ws = ws.ptr;
        if slots > 0 {
            let cfg = LaunchConfig {
                grid_dim: (slots as u32, plan.heads as u32, 1),
                block_dim: (128, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut launch = stream.launch_builder(&kernels.prep);
            launch.arg(&params);
            // SAFETY: reads the validated inputs, writes records [0, slots * heads) of the workspace.
            unsafe { launch.launch(cfg) }.during("launching kda_prep")?;
        }
        let cfg = LaunchConfig {
            grid_dim: (chains as u32 * slices, 1, 1),
            block_dim: (256 / slices, 1, 1),
            shared_mem_bytes: STATE_SMEM_BYTES[index],
        };
        let mut launch = stream.launch_builder(&kernels.state[index]);
        launch.arg(&params);
        // SAFETY: reads the records written above and the validated tensors.
        unsafe { launch.launch(cfg) }.during("launching kda_state")?;
        return Ok(plan);
    }
    let (func, slices, threads, smem) = match (schedule, split) {
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
    Ok(plan)
}

#[cfg(test)]
mod tests {
    #[test]
    fn params_layout_matches_the_c_struct() {
        // 11 pointers, 2 int64, 3 int32, 2 float = 124 bytes, padded to 128, then the ws pointer.
        assert_eq!(std::mem::size_of::<super::KernelParams>(), 136);
        assert_eq!(std::mem::align_of::<super::KernelParams>(), 8);
    }
}
