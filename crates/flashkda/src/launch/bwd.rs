//! The backward launch (`kernels/kda_bwd.cu`): `kda_bwd_rows` (checkpointed forward, then the
//! token backward of every value row) and `kda_bwd_finish` (input gradients from the row sums).

use cudarc::driver::{
    CudaFunction, CudaModule, CudaStream, DeviceRepr, LaunchConfig, PushKernelArg,
};
use std::sync::Arc;

use super::{KdaKernels, Workspace, begin_call, workspace_ptr};
use crate::error::{DriverContext, FlashKdaError};
use crate::reference::HEAD_DIM;
use crate::validate::{BwdArgs, BwdPlan, StateDType, validate_bwd};

/// Tokens per state checkpoint of the backward (`CK` in the .cu): 16 (no recomputed sub-chunk
/// starts) while the checkpoints take at most [`BWD_CHECKPOINT_LIMIT`] bytes, 64 above.
/// `FLASHKDA_BWD_CK=16|64` overrides (measurement only).
pub fn bwd_checkpoint_tokens(plan: &BwdPlan) -> usize {
    match std::env::var("FLASHKDA_BWD_CK").as_deref() {
        Ok("16") => return 16,
        Ok("64") => return 64,
        _ => {}
    }
    if checkpoint_bytes(plan, 16) <= BWD_CHECKPOINT_LIMIT {
        16
    } else {
        64
    }
}

/// Workspace bound of the 16-token checkpoints.
pub const BWD_CHECKPOINT_LIMIT: usize = 4 << 30;

fn checkpoint_bytes(plan: &BwdPlan, ck: usize) -> usize {
    let p = &plan.fwd;
    let slots = p.batch * p.seq_len / ck + p.num_seqs + 1;
    slots * p.heads * HEAD_DIM * HEAD_DIM * 4
}
/// Value rows per `kda_bwd_rows` block (`ROWS`).
const ROWS: usize = 16;
/// Floats of row sums per (token, head) (`ACC_W`).
const ACC_W: usize = 3 * HEAD_DIM + 4;
/// Tokens per `kda_bwd_finish` block (`FIN_TOK`).
const FIN_TOK: usize = 64;
/// Dynamic shared memory of `kda_bwd_rows_*` (`sizeof(BwdSmem)`) for `sub`-token sub-chunks.
const fn rows_smem_bytes(sub: usize) -> u32 {
    ((3 * sub * HEAD_DIM + sub + 2 * sub * ROWS + 2 * ROWS * ACC_W) * 4) as u32
}

/// Tokens per sub-chunk of the backward (`SUB`: `kda_bwd.cu` 16, `kda_bwd_s8.cu` 8);
/// `FLASHKDA_BWD_SUB=8|16` overrides (measurement only).
pub fn bwd_sub_chunk_tokens() -> usize {
    match std::env::var("FLASHKDA_BWD_SUB").as_deref() {
        Ok("8") => 8,
        Ok("16") => 16,
        _ => 16,
    }
}

/// Mirror of `struct KdaBwdParams` in `kernels/kda_bwd.cu` (the one definition of the kernels'
/// argument list; passed by value).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct BwdKernelParams {
    q: u64,
    k: u64,
    v: u64,
    g: u64,
    beta: u64,
    a_log: u64,
    dt_bias: u64,
    h0: u64,
    cu_seqlens: u64,
    dout: u64,
    dht: u64,
    dq: u64,
    dk: u64,
    dv: u64,
    dg: u64,
    dbeta: u64,
    da_log: u64,
    ddt_bias: u64,
    dh0: u64,
    ckpt: u64,
    acc: u64,
    seq_len: i64,
    total_tokens: i64,
    num_heads: i32,
    qk_heads: i32,
    num_seqs: i32,
    state_fp32: i32,
    dh0_fp32: i32,
    scale: f32,
    lower_bound: f32,
    pad: i32,
}

// SAFETY: plain-old-data, layout identical to the C struct (size checked by a test).
unsafe impl DeviceRepr for BwdKernelParams {}

/// The backward kernels of one device.
#[derive(Debug)]
pub(super) struct BwdKernels {
    /// `kda_bwd_rows_c16`, `kda_bwd_rows_c64` of `kda_bwd.cu` (16-token sub-chunks) and of
    /// `kda_bwd_s8.cu` (8).
    rows: [[CudaFunction; 2]; 2],
    finish: CudaFunction,
}

impl BwdKernels {
    pub(super) fn load(
        module: &Arc<CudaModule>,
        s8: &Arc<CudaModule>,
    ) -> Result<Self, FlashKdaError> {
        let load = |m: &Arc<CudaModule>, name: &str, sub: usize| {
            let f = m.load_function(name).during("loading kda_bwd_rows_*")?;
            f.set_attribute(
                cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                rows_smem_bytes(sub) as i32,
            )
            .during("allowing kda_bwd_rows's dynamic shared memory")?;
            Ok::<_, FlashKdaError>(f)
        };
        let rows = [
            [
                load(module, "kda_bwd_rows_c16", 16)?,
                load(module, "kda_bwd_rows_c64", 16)?,
            ],
            [
                load(s8, "kda_bwd_rows_c16", 8)?,
                load(s8, "kda_bwd_rows_c64", 8)?,
            ],
        ];
        let finish = module
            .load_function("kda_bwd_finish")
            .during("loading kda_bwd_finish")?;
        Ok(BwdKernels { rows, finish })
    }
}

/// Options of a backward call.
#[derive(Debug, Clone, Copy)]
pub struct BwdOptions {
    /// Copy `cu_seqlens` to the host and check it (one small sync); skipped while capturing.
    pub check_cu_seqlens: bool,
    /// The caller's workspace (size: [`bwd_workspace_bytes`]); `None` takes the stream's pooled one.
    pub workspace: Option<Workspace>,
}

impl Default for BwdOptions {
    fn default() -> Self {
        BwdOptions {
            check_cu_seqlens: true,
            workspace: None,
        }
    }
}

/// Offsets of the backward workspace: row checkpoints, then the per-(token, head) row sums.
fn layout(plan: &BwdPlan) -> (usize, usize) {
    let p = &plan.fwd;
    let total = p.batch * p.seq_len;
    let ckpt = checkpoint_bytes(plan, bwd_checkpoint_tokens(plan));
    let acc_off = ckpt.next_multiple_of(256);
    (acc_off, acc_off + total * p.heads * ACC_W * 4)
}

/// Workspace bytes of a validated backward call: fp32 checkpoints of the state every 16 tokens
/// (4 KiB per token and head; every 64 tokens, 1 KiB, above [`BWD_CHECKPOINT_LIMIT`]) and the row
/// sums (1552 bytes per token and head). Nothing is saved
/// by the forward for the backward beyond its inputs.
pub fn bwd_workspace_bytes(plan: &BwdPlan) -> usize {
    layout(plan).1
}

/// Validates `args` and enqueues the backward on `stream`: writes dq, dk, dv, dg, dbeta, dA_log,
/// ddt_bias and (when given) dinitial_state. Device pointers must stay valid until the stream has
/// run the call.
pub fn bwd(
    kernels: &KdaKernels,
    stream: &CudaStream,
    args: &BwdArgs,
    opts: &BwdOptions,
) -> Result<BwdPlan, FlashKdaError> {
    let plan = validate_bwd(args)?;
    bwd_validated(kernels, stream, args, &plan, opts)?;
    Ok(plan)
}

/// [`bwd`] for arguments [`validate_bwd`] already accepted as `plan`.
pub fn bwd_validated(
    kernels: &KdaKernels,
    stream: &CudaStream,
    args: &BwdArgs,
    plan: &BwdPlan,
    opts: &BwdOptions,
) -> Result<(), FlashKdaError> {
    let fp = &plan.fwd;
    let capturing = begin_call(
        kernels,
        stream,
        fp,
        args.cu_seqlens.as_ref(),
        opts.check_cu_seqlens,
    )?;
    let total = fp.batch * fp.seq_len;
    let s = stream.cu_stream();
    // dA_log and ddt_bias are sums over tokens (atomics): zero them first
    // SAFETY: both were validated as contiguous fp32 tensors of these sizes on this device.
    unsafe {
        cudarc::driver::result::memset_d8_async(args.da_log.ptr, 0, fp.heads * 4, s)
            .during("zeroing dA_log")?;
        cudarc::driver::result::memset_d8_async(args.ddt_bias.ptr, 0, fp.heads * HEAD_DIM * 4, s)
            .during("zeroing ddt_bias")?;
    }
    let chains = fp.num_seqs * fp.heads;
    if total == 0 && chains == 0 {
        return Ok(());
    }
    let (acc_off, need) = layout(plan);
    let ws = workspace_ptr(kernels, stream, opts.workspace, need, capturing)?;
    let acc = ws + acc_off as u64;
    // SAFETY: the row sums lie inside the workspace.
    unsafe { cudarc::driver::result::memset_d8_async(acc, 0, total * fp.heads * ACC_W * 4, s) }
        .during("zeroing the row sums")?;
    let params = BwdKernelParams {
        q: args.q.ptr,
        k: args.k.ptr,
        v: args.v.ptr,
        g: args.g.ptr,
        beta: args.beta.ptr,
        a_log: args.a_log.ptr,
        dt_bias: args.dt_bias.ptr,
        h0: args.initial_state.as_ref().map_or(0, |t| t.ptr),
        cu_seqlens: args.cu_seqlens.as_ref().map_or(0, |t| t.ptr),
        dout: args.dout.ptr,
        dht: args.dfinal_state.as_ref().map_or(0, |t| t.ptr),
        dq: args.dq.ptr,
        dk: args.dk.ptr,
        dv: args.dv.ptr,
        dg: args.dg.ptr,
        dbeta: args.dbeta.ptr,
        da_log: args.da_log.ptr,
        ddt_bias: args.ddt_bias.ptr,
        dh0: args.dinitial_state.as_ref().map_or(0, |t| t.ptr),
        ckpt: ws,
        acc,
        seq_len: fp.seq_len as i64,
        total_tokens: total as i64,
        num_heads: fp.heads as i32,
        qk_heads: fp.qk_heads as i32,
        num_seqs: fp.num_seqs as i32,
        state_fp32: i32::from(fp.state == Some(StateDType::F32)),
        dh0_fp32: i32::from(plan.dinitial_state == Some(StateDType::F32)),
        scale: args.scale,
        lower_bound: args.lower_bound,
        pad: 0,
    };
    let bk = &kernels.bwd;
    if chains > 0 {
        let sub = bwd_sub_chunk_tokens();
        let cfg = LaunchConfig {
            grid_dim: (chains as u32, (HEAD_DIM / ROWS) as u32, 1),
            block_dim: ((ROWS * 32) as u32, 1, 1),
            shared_mem_bytes: rows_smem_bytes(sub),
        };
        let rows = &bk.rows[usize::from(sub == 8)][usize::from(bwd_checkpoint_tokens(plan) == 64)];
        let mut launch = stream.launch_builder(rows);
        launch.arg(&params);
        // SAFETY: reads the validated inputs; writes dv, dinitial_state and the workspace.
        unsafe { launch.launch(cfg) }.during("launching kda_bwd_rows")?;
    }
    if total > 0 {
        let cfg = LaunchConfig {
            grid_dim: (total.div_ceil(FIN_TOK) as u32, fp.qk_heads as u32, 1),
            block_dim: (HEAD_DIM as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut launch = stream.launch_builder(&bk.finish);
        launch.arg(&params);
        // SAFETY: reads the row sums and inputs; writes dq, dk, dg, dbeta, dA_log, ddt_bias.
        unsafe { launch.launch(cfg) }.during("launching kda_bwd_finish")?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn params_layout_matches_the_c_struct() {
        // 21 pointers, 2 int64, 5 int32, 2 float, 1 int32 pad = 168 + 16 + 32 = 216 bytes
        assert_eq!(std::mem::size_of::<super::BwdKernelParams>(), 216);
        assert_eq!(std::mem::align_of::<super::BwdKernelParams>(), 8);
        assert_eq!(super::rows_smem_bytes(16), 76352);
        assert_eq!(super::rows_smem_bytes(8), 63008);
        assert_eq!(super::ACC_W % 4, 0);
    }
}
