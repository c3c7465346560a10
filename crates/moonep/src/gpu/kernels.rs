//! One typed launcher per kernel of `kernels/*.cu`: a struct whose fields are the kernel's
//! parameters in declaration order (device pointers as `u64`, 0 = null), plus `launch`. Callers
//! fill fields by name, so an argument can be neither dropped nor swapped with its neighbour.

use super::GpuError;
use super::driver::{Args, Device};

/// Shared sizes of one call (mirrors `struct Dims` in kernels/common.cuh; repr(C), all i64).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dims {
    pub r: i64,
    pub me: i64,
    pub e: i64,
    pub epn: i64,
    pub k: i64,
    pub s: i64,
    pub p: i64,
    pub t: i64,
    pub nvs: i64,
    pub nvs_s: i64,
    pub h: i64,
    pub cap_s: i64,
    pub uniform: i64,
}

/// Launch geometry: 1-D grid of `blocks` × `threads`, `smem` bytes of dynamic shared memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grid {
    pub blocks: u32,
    pub threads: u32,
    pub smem: u32,
}

impl Grid {
    /// `blocks` × `threads` without dynamic shared memory.
    pub fn new(blocks: u32, threads: u32) -> Grid {
        Grid {
            blocks,
            threads,
            smem: 0,
        }
    }

    /// The same geometry with `bytes` of dynamic shared memory.
    pub fn smem(self, bytes: usize) -> Grid {
        Grid {
            smem: bytes as u32,
            ..self
        }
    }
}

macro_rules! kernels {
    ($(
        $(#[$doc:meta])*
        $name:ident = $symbol:literal { $($field:ident: $ty:ty),* $(,)? }
    )*) => {
        /// `(symbol, parameter count)` of every launcher, checked against the sources in a test.
        pub const LAUNCHERS: &[(&str, usize)] =
            &[$(($symbol, [$(stringify!($field)),*].len())),*];
        $(
        $(#[$doc])*
        #[derive(Debug, Clone, Copy)]
        pub struct $name { $(pub $field: $ty),* }

        impl $name {
            /// The `extern "C"` symbol in the cubin.
            pub const SYMBOL: &'static str = $symbol;

            /// Launches the kernel on `dev`'s stream.
            ///
            /// # Safety
            /// Every pointer field must be valid (on this device, or peer-mapped) for what the
            /// kernel does with it, and sized for the `Dims` it is given.
            pub unsafe fn launch(&self, dev: &Device, grid: Grid) -> Result<(), GpuError> {
                let args = Args::new()$(.arg(self.$field))*;
                // SAFETY: the field list is the kernel's parameter list (same order and types);
                // pointer validity is the caller's contract.
                unsafe { dev.launch($symbol, grid.blocks, grid.threads, grid.smem, args) }
            }
        }
    )*};
}

kernels! {
    /// Device barrier over all ranks (barrier.cu). One block of >= R threads.
    Barrier = "moonep_barrier" {
        ctrl: u64, peer_ctrl: u64, me: i64, ranks: i64, timeout_ns: u64,
    }
    /// Stage-D ordinals and block histograms (layout.cu). Smem: `HIST_BLOCK/32 * E` ints.
    PlanHist = "moonep_plan_hist" {
        topk: u64, n: i64, experts: i64, ord: u64, hist: u64, status: u64,
    }
    /// Stages A–C and the block prefix of stage D, one block of 1024 threads (layout.cu).
    PlanGlobal = "moonep_plan_global" {
        dims: Dims, tpe: u64, hist: u64, nblk: i64, alloc: u64, alloc_cum: u64, src_off: u64,
        grp_start: u64, etc: u64, counts: u64, cu: u64, zfill: u64, status: u64,
    }
    /// Stage D: `dst[i] = d*NvS + loff` (layout.cu).
    PlanDst = "moonep_plan_dst" {
        dims: Dims, topk: u64, n: i64, ord: u64, hist: u64, alloc_cum: u64, src_off: u64,
        grp_start: u64, dst: u64, status: u64,
    }
    /// IPC all-gather of `tpe` into every rank's table at element offset `base` (layout.cu).
    TpePush = "moonep_tpe_push" {
        dims: Dims, tpe: u64, peer_tpe: u64, base: i64,
    }
    /// Rows into their slots on every rank (dispatch.cu); `write_wts` 0 keeps slot weights.
    Dispatch = "moonep_dispatch" {
        dims: Dims, x: u64, w: u64, dst: u64, peer_hidden: u64, peer_wts: u64, peer_dup: u64,
        zfill: u64, dedup: i32, write_wts: i32, status: u64,
    }
    /// Dedup rows copied from their leader row after the exit barrier (dispatch.cu).
    Replicate = "moonep_replicate" {
        dims: Dims, hidden: u64, dup: u64, cu: u64, status: u64,
    }
    /// The K-sum pulled from slot rows, optional weight gather (combine.cu).
    Combine = "moonep_combine" {
        dims: Dims, out: u64, w_out: u64, dst: u64, peer_hidden: u64, peer_wts: u64, back: u64,
        back_w: u64, back_pos: u64, status: u64,
    }
    /// Home ranks push replica weights into prefetch slots (weights.cu).
    Prefetch = "moonep_prefetch" {
        dims: Dims, etc: u64, local_w: u64, peer_pool: u64, wbytes: i64, status: u64,
    }
    /// Replica gradients summed into the owner's grad (weights.cu). Smem: R ints.
    ReduceGrad = "moonep_reduce_grad" {
        dims: Dims, etc: u64, home_grad: u64, peer_reduce: u64, elems: i64, status: u64,
    }
    /// Zeroes this rank's consumed reduce slots (weights.cu).
    ZeroConsumed = "moonep_zero_consumed" {
        dims: Dims, etc: u64, own_reduce: u64, elems: i64, status: u64,
    }
    /// Fallback: entries per destination (fallback.cu).
    FbCount = "moonep_fb_count" {
        dims: Dims, dst: u64, cnt: u64, status: u64,
    }
    /// Fallback: local rows to the own shard, remote rows to staging (fallback.cu).
    FbPack = "moonep_fb_pack" {
        dims: Dims, x: u64, w: u64, dst: u64, cnt: u64, fill: u64, own_hidden: u64,
        own_wts: u64, stage: u64, meta: u64, pos_of: u64, status: u64,
    }
    /// Fallback: received rows into their slots (fallback.cu).
    FbUnpack = "moonep_fb_unpack" {
        dims: Dims, stage: u64, meta: u64, nrows: i64, own_hidden: u64, own_wts: u64,
        status: u64,
    }
    /// Fallback combine, owner side: gather the requested slot rows (fallback.cu).
    FbGather = "moonep_fb_gather" {
        dims: Dims, meta: u64, nrows: i64, own_hidden: u64, own_wts: u64, out_rows: u64,
        out_w: u64, status: u64,
    }
    /// Fallback: zero this rank's padding rows (fallback.cu).
    ZeroPad = "moonep_zero_pad" {
        dims: Dims, own_hidden: u64, own_wts: u64, zfill: u64, status: u64,
    }
    /// Baseline layout pass, one block of 1024 threads (baseline.cu).
    BaseLayout = "moonep_base_layout" {
        dims: Dims, tpe: u64, hist: u64, nblk: i64, e_base: u64, src_major: u64, exp_major: u64,
    }
    /// Baseline permute-1 (baseline.cu).
    BasePermute1 = "moonep_base_permute1" {
        dims: Dims, x: u64, w: u64, topk: u64, ord: u64, hist: u64, e_base: u64, send: u64,
        send_w: u64, pos_of: u64,
    }
    /// Baseline permute-2 (`reverse` 0) or unpermute-2 (`reverse` 1) (baseline.cu).
    BasePermute2 = "moonep_base_permute2" {
        dims: Dims, src_major: u64, exp_major: u64, nrows: i64, from: u64, to: u64, from_w: u64,
        to_w: u64, reverse: i32,
    }
    /// Baseline unpermute-1 with the K-sum (baseline.cu).
    BaseUnpermute1 = "moonep_base_unpermute1" {
        dims: Dims, back: u64, pos_of: u64, out: u64,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every launcher's symbol is defined in the kernel sources with as many parameters as the
    /// launcher has fields.
    #[test]
    fn launchers_match_the_kernel_sources() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/kernels");
        let mut src = String::new();
        for entry in std::fs::read_dir(dir).unwrap() {
            let p = entry.unwrap().path();
            if p.extension().is_some_and(|x| x == "cu") {
                src += &std::fs::read_to_string(p).unwrap();
            }
        }
        let arity = |symbol: &str| -> usize {
            let at = src
                .find(&format!("{symbol}("))
                .unwrap_or_else(|| panic!("{symbol} not in kernels/"));
            let open = at + symbol.len();
            let close = open + src[open..].find(')').unwrap();
            src[open + 1..close].split(',').count()
        };
        assert_eq!(
            LAUNCHERS.len(),
            src.matches("extern \"C\" __global__").count(),
            "a kernel without a launcher"
        );
        for &(symbol, n) in LAUNCHERS {
            assert_eq!(arity(symbol), n, "{symbol}");
        }
    }
}
