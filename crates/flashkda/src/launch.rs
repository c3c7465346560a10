//! Loads the embedded sm_90a cubins and launches the forward on the caller's stream. The only
//! module that launches kernels.

use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaFunction, CudaStream, DeviceRepr, LaunchConfig, PushKernelArg,
};

use crate::error::{DriverContext, FlashKdaError};
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
}

// SAFETY: plain-old-data, layout identical to the C struct (checked by a test on its size).
unsafe impl DeviceRepr for KernelParams {}

/// How many blocks share one (sequence, head): each owns a slice of the 128 value rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ValueSplit {
    /// The measured best (currently always `Two`).
    #[default]
    Auto,
    /// Four blocks of 2 warps (32 value rows each).
    Four,
    /// Two blocks of 4 warps (64 value rows each).
    Two,
}

/// Which kernel runs the chunk loop.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KernelSchedule {
    /// The measured best: currently `Pipelined`.
    #[default]
    Auto,
    /// `kda_fwd.cu`: prep then state work per chunk, four barriers per chunk.
    Sequential,
    /// `kda_fwd_pipelined.cu`: prep of chunk c+1 overlapped with the state work of chunk c,
    /// two barriers per chunk (always two 4-warp blocks per chain; `value_split` is ignored).
    Pipelined,
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

/// The loaded kernels of one device.
#[derive(Debug)]
pub struct KdaKernels {
    ctx: Arc<CudaContext>,
    two_warps: CudaFunction,
    four_warps: CudaFunction,
    pipelined: CudaFunction,
    sm_count: usize,
}

/// Dynamic shared memory of `kda_fwd_pipe_w4` (`PIPE_SMEM_BYTES` in the .cu, checked there).
const PIPE_SMEM_BYTES: u32 = 65344;

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
    let split = match opts.value_split {
        ValueSplit::Auto => kernels.auto_split(chains),
        s => s,
    };
    let schedule = match opts.schedule {
        // H200, 2026-11-29: pipelined 0.6-2.7 % faster on five anchor shapes, 0.8 % slower on H=64 fixed
        KernelSchedule::Auto => KernelSchedule::Pipelined,
        s => s,
    };
    let (func, slices, threads, smem) = match (schedule, split) {
        (KernelSchedule::Pipelined, _) => (&kernels.pipelined, 2u32, 128u32, PIPE_SMEM_BYTES),
        (_, ValueSplit::Four) => (&kernels.two_warps, 4, 64, 0),
        _ => (&kernels.four_warps, 2, 128, 0),
    };
    let params = KernelParams {
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
        // 11 pointers, 2 int64, 3 int32, 2 float = 124 bytes, padded to 8.
        assert_eq!(std::mem::size_of::<super::KernelParams>(), 128);
        assert_eq!(std::mem::align_of::<super::KernelParams>(), 8);
    }
}
