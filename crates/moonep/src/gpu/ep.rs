//! [`EpBuffer`]: the collective dispatch/combine engine of one rank (docs/specs/moonep.md §3, §5).
//!
//! Every call is collective: all ranks issue the same sequence on their stream. The buffer keeps
//! the latest plan on the device (dispatch plans; combine, prefetch and the backward reuse it).
//! No host sync and no NCCL happen on the IPC path (`tpe` is all-gathered through the peer-mapped
//! tables), so it also runs with several ranks on one GPU; the NCCL fallback copies the `[R,R]`
//! count matrix to the host.
//!
//! Backward (docs/specs/moonep.md §3): [`EpBuffer::combine_backward`] is a dispatch of the token
//! gradients with the saved plan, [`EpBuffer::dispatch_backward`] a combine of the slot gradients,
//! and [`EpBuffer::reduce_grad`] sums replica weight gradients into their owners.

mod backward;

use super::driver::{DevBuf, Device, read_ptr};
pub use super::kernels::Dims;
use super::kernels::{
    Barrier, Combine, Dispatch, FbCount, FbGather, FbPack, FbUnpack, Grid, PlanDst, PlanGlobal,
    PlanHist, Prefetch, Replicate, TpePush, ZeroPad,
};
use super::nccl::{self, Dtype};
use super::rank::Rank;
use super::symm::{SymmBuf, peer_access_all};
use super::{GpuError, status};
use crate::plan::{PlanConfig, TokenMode};

const HIST_BLOCK: usize = 256;
const MAX_R: usize = 32;

/// Static configuration of an [`EpBuffer`].
#[derive(Debug, Clone, Copy)]
pub struct EpConfig {
    pub experts: usize,
    pub top_k: usize,
    /// Capacity S (max tokens per rank per call).
    pub capacity_s: usize,
    /// Hidden size H (multiple of 8: rows move as 16-byte vectors).
    pub hidden: usize,
    /// Token padding P.
    pub padding: usize,
    /// Blocks for the comm kernels (spec default 24–32 SMs).
    pub num_blocks: u32,
    /// Send each token once per remote rank and replicate on the receiver (exact).
    pub dedup: bool,
    /// Use the NCCL send/recv fallback even where peer access exists.
    pub force_fallback: bool,
    /// Bytes of one expert's weights for `prefetch` (0: no prefetch pool).
    pub expert_bytes: usize,
    /// f32 elements of one expert's weight gradient for `reduce_grad` (0: no reduce slots).
    pub grad_elems: usize,
    /// Device barrier timeout.
    pub barrier_timeout_ns: u64,
}

impl EpConfig {
    /// DSv3-like defaults for `experts`, `top_k`, `capacity_s`, `hidden`.
    pub fn new(experts: usize, top_k: usize, capacity_s: usize, hidden: usize) -> EpConfig {
        EpConfig {
            experts,
            top_k,
            capacity_s,
            hidden,
            padding: 128,
            num_blocks: 32,
            dedup: true,
            force_fallback: false,
            expert_bytes: 0,
            grad_elems: 0,
            barrier_timeout_ns: 10_000_000_000,
        }
    }
}

/// Which transport moves rows between ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// Peer-mapped IPC buffers: zero-copy stores and pulls over NVLink (or within one GPU when
    /// ranks share it).
    Nvlink,
    /// `ncclSend`/`ncclRecv` through staging buffers (no peer access).
    NcclFallback,
}

/// One call's inputs (device pointers): `x` bf16 `[s,H]`, `w` f32 `[s,K]` (0 = none → 1.0),
/// `topk` i32 `[s*K]`, `tpe` i32 `[E]`; `total_tokens` is `Some(T)` in per-rank mode.
#[derive(Debug, Clone, Copy)]
pub struct Tokens {
    pub x: u64,
    pub w: u64,
    pub topk: u64,
    pub tpe: u64,
    pub s: usize,
    pub total_tokens: Option<u64>,
}

/// The plan arrays read back from the device (for tests).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DevicePlan {
    pub alloc: Vec<i32>,
    pub alloc_cum: Vec<i32>,
    pub experts_to_copy: Vec<i32>,
    pub counts: Vec<i32>,
    pub cu_seqlens: Vec<i32>,
    pub zero_fill: Vec<i32>,
    pub dst: Vec<i64>,
}

struct Fallback {
    stage_send: DevBuf,
    meta_send: DevBuf,
    stage_recv: DevBuf,
    meta_recv: DevBuf,
    back: DevBuf,
    back_w: DevBuf,
    recv_w: DevBuf,
    pos_of: DevBuf,
    cnt: DevBuf,
    fill: DevBuf,
    cnt_all: DevBuf,
    /// Host copy of `cnt_all` from the latest dispatch.
    counts: Vec<i32>,
}

/// One rank's symmetric buffers, plan scratch and (optionally) fallback staging.
pub struct EpBuffer {
    pub cfg: EpConfig,
    pub me: usize,
    pub ranks: usize,
    pub transport: Transport,
    pub hidden: SymmBuf,
    pub wts: SymmBuf,
    dup: SymmBuf,
    ctrl: SymmBuf,
    pub pool: Option<SymmBuf>,
    /// Reduce slots `[epn][grad_elems]` f32 (replica weight gradients), when configured.
    pub reduce: Option<SymmBuf>,
    /// IPC path: two `[R][E]` i32 tpe tables, alternating per plan call.
    tpe_sym: Option<SymmBuf>,
    plan_calls: u64,
    tpe_all: DevBuf,
    ord: DevBuf,
    hist: DevBuf,
    alloc: DevBuf,
    alloc_cum: DevBuf,
    src_off: DevBuf,
    grp_start: DevBuf,
    etc: DevBuf,
    counts: DevBuf,
    cu: DevBuf,
    zfill: DevBuf,
    dst: DevBuf,
    fb: Option<Fallback>,
    dims: Dims,
}

fn ctrl_words(r: usize) -> usize {
    r + 2
}

impl EpBuffer {
    /// Collective constructor. Checks peer access and picks the transport.
    pub fn new(rank: &mut Rank, cfg: EpConfig) -> Result<EpBuffer, GpuError> {
        let (me, r) = (rank.env.rank, rank.env.world);
        if r > MAX_R
            || !cfg.experts.is_multiple_of(r)
            || !cfg.hidden.is_multiple_of(8)
            || cfg.top_k == 0
            || cfg.top_k > 32
        {
            return Err(GpuError::Invalid(format!(
                "need R <= {MAX_R}, E % R == 0, H % 8 == 0, 1 <= K <= 32 (R={r}, E={}, H={}, K={})",
                cfg.experts, cfg.hidden, cfg.top_k
            )));
        }
        let pc = plan_config(&cfg, r, 1, None);
        pc.validate()?;
        let nvs = pc.shard_slots() as usize;
        let peer = peer_access_all(&rank.dev, &mut rank.store)?;
        let transport = if peer && !cfg.force_fallback {
            Transport::Nvlink
        } else {
            Transport::NcclFallback
        };
        let map = transport == Transport::Nvlink;
        let dev = &rank.dev;
        let st = &mut rank.store;
        let hidden = SymmBuf::new(dev, st, me, nvs * cfg.hidden * 2, map)?;
        let wts = SymmBuf::new(dev, st, me, nvs * 4, map)?;
        let dup = SymmBuf::new(dev, st, me, nvs * 4, map)?;
        let ctrl = SymmBuf::new(dev, st, me, ctrl_words(r) * 8, map)?;
        let epn = cfg.experts / r;
        let pool = if cfg.expert_bytes > 0 {
            Some(SymmBuf::new(dev, st, me, epn * cfg.expert_bytes, map)?)
        } else {
            None
        };
        let reduce = if cfg.grad_elems > 0 {
            let b = SymmBuf::new(dev, st, me, epn * cfg.grad_elems * 4, map)?;
            dev.memset_u32(b.ptr(), 0, epn * cfg.grad_elems)?;
            Some(b)
        } else {
            None
        };
        let tpe_sym = if map {
            Some(SymmBuf::new(dev, st, me, 2 * r * cfg.experts * 4, true)?)
        } else {
            None
        };
        dev.memset_u32(dup.ptr(), u32::MAX, nvs)?;
        dev.memset_u8(ctrl.ptr(), 0, ctrl_words(r) * 8)?;
        let n = cfg.capacity_s * cfg.top_k;
        let nblk = n.div_ceil(HIST_BLOCK);
        let e = cfg.experts;
        let fb = if transport == Transport::NcclFallback {
            Some(Fallback {
                stage_send: dev.alloc(n * cfg.hidden * 2)?,
                meta_send: dev.alloc(n * 8)?,
                stage_recv: dev.alloc(n * cfg.hidden * 2)?,
                meta_recv: dev.alloc(n * 8)?,
                back: dev.alloc(n * cfg.hidden * 2)?,
                back_w: dev.alloc(n * 4)?,
                recv_w: dev.alloc(n * 4)?,
                pos_of: dev.alloc(n * 4)?,
                cnt: dev.alloc(r * 4)?,
                fill: dev.alloc(r * 4)?,
                cnt_all: dev.alloc(r * r * 4)?,
                counts: vec![0; r * r],
            })
        } else {
            None
        };
        let buf = EpBuffer {
            cfg,
            me,
            ranks: r,
            transport,
            hidden,
            wts,
            dup,
            ctrl,
            pool,
            reduce,
            tpe_sym,
            plan_calls: 0,
            tpe_all: dev.alloc(r * e * 4)?,
            ord: dev.alloc(n * 4)?,
            hist: dev.alloc(nblk * e * 4)?,
            alloc: dev.alloc(e * r * 4)?,
            alloc_cum: dev.alloc(e * r * 4)?,
            src_off: dev.alloc(e * 4)?,
            grp_start: dev.alloc(r * e * 4)?,
            etc: dev.alloc(r * epn * 4)?,
            counts: dev.alloc(2 * epn * 4)?,
            cu: dev.alloc(2 * epn * 4)?,
            zfill: dev.alloc(4 * epn * 4)?,
            dst: dev.alloc(n * 8)?,
            fb,
            dims: dims_of(&cfg, r, me, 1, None),
        };
        dev.sync()?;
        rank.store.barrier()?;
        Ok(buf)
    }

    /// Slots per shard, `NvS`.
    pub fn shard_slots(&self) -> usize {
        self.dims.nvs as usize
    }

    /// Rows valid after the latest plan, `nvs_s`.
    pub fn step_slots(&self) -> usize {
        self.dims.nvs_s as usize
    }

    /// Device pointer of the packed `dst[s*K]` of the latest plan.
    pub fn dst_ptr(&self) -> u64 {
        self.dst.ptr
    }

    /// Device pointer of `cu_seqlens[2*epn]` of the latest plan.
    pub fn cu_seqlens_ptr(&self) -> u64 {
        self.cu.ptr
    }

    /// Device barrier over all ranks (NVLink transport only; a no-op on the fallback, where NCCL
    /// calls order the ranks).
    pub fn barrier(&self, dev: &Device) -> Result<(), GpuError> {
        if self.transport != Transport::Nvlink {
            return Ok(());
        }
        self.barrier_with_timeout(dev, self.cfg.barrier_timeout_ns)
    }

    /// Barrier with an explicit timeout (tests use it to provoke a timeout).
    pub fn barrier_with_timeout(&self, dev: &Device, timeout_ns: u64) -> Result<(), GpuError> {
        let threads = 32 * self.ranks.div_ceil(32) as u32;
        // SAFETY: ctrl chunks hold R+2 words on every rank; the table holds R mapped pointers.
        unsafe {
            Barrier {
                ctrl: self.ctrl.ptr(),
                peer_ctrl: self.ctrl.table.ptr,
                me: self.me as i64,
                ranks: self.ranks as i64,
                timeout_ns,
            }
            .launch(dev, Grid::new(1, threads))
        }
    }

    fn status_ptr(&self) -> u64 {
        self.ctrl.ptr() + (self.ranks as u64 + 1) * 8
    }

    /// Waits for the stream and turns a non-zero device status word into an error.
    pub fn check(&self, dev: &Device) -> Result<(), GpuError> {
        dev.sync()?;
        let st: Vec<u32> = read_ptr(self.status_ptr(), 1)?;
        if st[0] != status::OK {
            return Err(GpuError::DeviceStatus {
                rank: self.me,
                code: st[0],
            });
        }
        Ok(())
    }

    /// Collective: clears barrier flags, epoch and status on every rank (after an error).
    pub fn reset_control(&self, rank: &mut Rank) -> Result<(), GpuError> {
        rank.dev.sync()?;
        rank.store.barrier()?;
        rank.dev
            .memset_u8(self.ctrl.ptr(), 0, ctrl_words(self.ranks) * 8)?;
        rank.dev
            .memset_u32(self.dup.ptr(), u32::MAX, self.shard_slots())?;
        rank.dev.sync()?;
        rank.store.barrier()?;
        Ok(())
    }

    /// Plans this call: all-gathers `tpe` (device `i32[E]`; through the IPC tables and a barrier,
    /// or NCCL on the fallback) and runs the planning kernels on `topk` (device `i32[s*K]`).
    /// `total_tokens` is `Some(T)` in per-rank mode.
    pub fn plan(
        &mut self,
        rank: &Rank,
        topk: u64,
        tpe: u64,
        s: usize,
        total_tokens: Option<u64>,
    ) -> Result<(), GpuError> {
        if s == 0 || s > self.cfg.capacity_s {
            return Err(GpuError::Invalid(format!(
                "s={s} outside 1..={}",
                self.cfg.capacity_s
            )));
        }
        let dev = &rank.dev;
        self.dims = dims_of(&self.cfg, self.ranks, self.me, s, total_tokens);
        let d = self.dims;
        let e = self.cfg.experts;
        let tpe_all = match &self.tpe_sym {
            Some(table) => {
                // Alternating tables: a peer may still read the previous call's table until it
                // reaches the barrier below.
                let base = (self.plan_calls % 2) as usize * self.ranks * e;
                self.plan_calls += 1;
                // SAFETY: every rank's table holds 2*R*E i32; tpe holds E i32.
                unsafe {
                    TpePush {
                        dims: d,
                        tpe,
                        peer_tpe: table.table.ptr,
                        base: base as i64,
                    }
                    .launch(dev, Grid::new(self.ranks as u32, 256))?
                };
                self.barrier(dev)?;
                table.ptr() + (base * 4) as u64
            }
            None => {
                rank.comm()?
                    .all_gather(tpe, self.tpe_all.ptr, e, Dtype::I32, dev.stream)?;
                self.tpe_all.ptr
            }
        };
        let n = s * self.cfg.top_k;
        let nblk = n.div_ceil(HIST_BLOCK);
        let status = self.status_ptr();
        let smem = (MAX_R + MAX_R * MAX_R + 2 * e) * 8;
        // SAFETY: ord/hist are sized for S*K entries and ceil(S*K/256)*E counts, every plan array
        // in `new`; topk holds s*K ids.
        unsafe {
            PlanHist {
                topk,
                n: n as i64,
                experts: e as i64,
                ord: self.ord.ptr,
                hist: self.hist.ptr,
                status,
            }
            .launch(
                dev,
                Grid::new(nblk as u32, HIST_BLOCK as u32).smem(HIST_BLOCK / 32 * e * 4),
            )?;
            PlanGlobal {
                dims: d,
                tpe: tpe_all,
                hist: self.hist.ptr,
                nblk: nblk as i64,
                alloc: self.alloc.ptr,
                alloc_cum: self.alloc_cum.ptr,
                src_off: self.src_off.ptr,
                grp_start: self.grp_start.ptr,
                etc: self.etc.ptr,
                counts: self.counts.ptr,
                cu: self.cu.ptr,
                zfill: self.zfill.ptr,
                status,
            }
            .launch(dev, Grid::new(1, 1024).smem(smem))?;
            PlanDst {
                dims: d,
                topk,
                n: n as i64,
                ord: self.ord.ptr,
                hist: self.hist.ptr,
                alloc_cum: self.alloc_cum.ptr,
                src_off: self.src_off.ptr,
                grp_start: self.grp_start.ptr,
                dst: self.dst.ptr,
                status,
            }
            .launch(dev, Grid::new(nblk as u32, HIST_BLOCK as u32))
        }
    }

    /// Plans and dispatches: every entry's row of `x` (device bf16 `[s,H]`) lands in its final
    /// slot; `w` (device f32 `[s,K]`, 0 = none → 1.0) goes to the per-slot weights.
    pub fn dispatch(&mut self, rank: &Rank, t: &Tokens) -> Result<(), GpuError> {
        self.plan(rank, t.topk, t.tpe, t.s, t.total_tokens)?;
        match self.transport {
            // The planning barrier already separates this call from the previous readers.
            Transport::Nvlink => self.dispatch_nvlink(&rank.dev, t.x, t.w, true, false),
            Transport::NcclFallback => self.dispatch_fallback(rank, t.x, t.w),
        }
    }

    fn warps_grid(&self) -> (u32, u32) {
        (self.cfg.num_blocks, 512)
    }

    fn dispatch_nvlink(
        &self,
        dev: &Device,
        x: u64,
        w: u64,
        write_wts: bool,
        entry_barrier: bool,
    ) -> Result<(), GpuError> {
        if entry_barrier {
            self.barrier(dev)?;
        }
        let (g, b) = self.warps_grid();
        let status = self.status_ptr();
        // SAFETY: x holds s rows of H bf16, w s*K f32 (or 0); the tables hold R mapped shards.
        unsafe {
            Dispatch {
                dims: self.dims,
                x,
                w,
                dst: self.dst.ptr,
                peer_hidden: self.hidden.table.ptr,
                peer_wts: self.wts.table.ptr,
                peer_dup: self.dup.table.ptr,
                zfill: self.zfill.ptr,
                dedup: self.cfg.dedup as i32,
                write_wts: write_wts as i32,
                status,
            }
            .launch(dev, Grid::new(g, b))?
        };
        self.barrier(dev)?;
        if self.cfg.dedup {
            // SAFETY: own shard and dup array of NvS rows.
            unsafe {
                Replicate {
                    dims: self.dims,
                    hidden: self.hidden.ptr(),
                    dup: self.dup.ptr(),
                    cu: self.cu.ptr,
                    status,
                }
                .launch(dev, Grid::new(dev.num_sms * 2, 512))?
            };
        }
        Ok(())
    }

    fn dispatch_fallback(&mut self, rank: &Rank, x: u64, w: u64) -> Result<(), GpuError> {
        let dev = &rank.dev;
        let (r, me) = (self.ranks, self.me);
        let fb = self
            .fb
            .as_mut()
            .ok_or_else(|| GpuError::Invalid("fallback buffers missing".into()))?;
        let st = self.ctrl.ptr() + (r as u64 + 1) * 8;
        dev.memset_u32(fb.cnt.ptr, 0, r)?;
        dev.memset_u32(fb.fill.ptr, 0, r)?;
        // SAFETY: dst holds s*K slots, cnt R ints.
        unsafe {
            FbCount {
                dims: self.dims,
                dst: self.dst.ptr,
                cnt: fb.cnt.ptr,
                status: st,
            }
            .launch(dev, Grid::new(64, 256))?
        };
        rank.comm()?
            .all_gather(fb.cnt.ptr, fb.cnt_all.ptr, r, Dtype::I32, dev.stream)?;
        dev.sync()?;
        fb.counts = read_ptr(fb.cnt_all.ptr, r * r)?;
        let (g, b) = (self.cfg.num_blocks, 512);
        // SAFETY: staging sized for S*K rows; own shard NvS rows.
        unsafe {
            FbPack {
                dims: self.dims,
                x,
                w,
                dst: self.dst.ptr,
                cnt: fb.cnt.ptr,
                fill: fb.fill.ptr,
                own_hidden: self.hidden.ptr(),
                own_wts: self.wts.ptr(),
                stage: fb.stage_send.ptr,
                meta: fb.meta_send.ptr,
                pos_of: fb.pos_of.ptr,
                status: st,
            }
            .launch(dev, Grid::new(g, b))?;
            ZeroPad {
                dims: self.dims,
                own_hidden: self.hidden.ptr(),
                own_wts: self.wts.ptr(),
                zfill: self.zfill.ptr,
                status: st,
            }
            .launch(dev, Grid::new(g, b))?;
        }
        let comm = rank.comm()?;
        let row = self.cfg.hidden * 2;
        let c = &fb.counts;
        nccl::group_start()?;
        let (mut sb, mut rb) = (0usize, 0usize);
        for p in 0..r {
            if p == me {
                continue;
            }
            let (ns, nr) = (c[me * r + p] as usize, c[p * r + me] as usize);
            comm.send(
                fb.stage_send.ptr + (sb * row) as u64,
                ns * row,
                Dtype::U8,
                p,
                dev.stream,
            )?;
            comm.send(
                fb.meta_send.ptr + (sb * 8) as u64,
                ns * 8,
                Dtype::U8,
                p,
                dev.stream,
            )?;
            comm.recv(
                fb.stage_recv.ptr + (rb * row) as u64,
                nr * row,
                Dtype::U8,
                p,
                dev.stream,
            )?;
            comm.recv(
                fb.meta_recv.ptr + (rb * 8) as u64,
                nr * 8,
                Dtype::U8,
                p,
                dev.stream,
            )?;
            sb += ns;
            rb += nr;
        }
        nccl::group_end()?;
        // SAFETY: rb rows received into staging sized for S*K rows.
        unsafe {
            FbUnpack {
                dims: self.dims,
                stage: fb.stage_recv.ptr,
                meta: fb.meta_recv.ptr,
                nrows: rb as i64,
                own_hidden: self.hidden.ptr(),
                own_wts: self.wts.ptr(),
                status: st,
            }
            .launch(dev, Grid::new(g, b))
        }
    }

    /// Combine: `out[t] = Σ_k y[dst(t,k)]` (f32 in ascending k, one bf16 rounding) from the slot
    /// layout in the shards; `w_out` (device f32 `[s,K]`, 0 = skip) gathers the per-slot weights.
    pub fn combine(&mut self, rank: &Rank, out: u64, w_out: u64) -> Result<(), GpuError> {
        let dev = &rank.dev;
        let (g, b) = self.warps_grid();
        let st = self.status_ptr();
        let (back, back_w, back_pos) = match self.transport {
            Transport::Nvlink => {
                self.barrier(dev)?;
                (0u64, 0u64, 0u64)
            }
            Transport::NcclFallback => self.combine_fallback_exchange(rank)?,
        };
        // SAFETY: out holds s rows, w_out s*K f32 (or 0); tables hold R mapped shards.
        unsafe {
            Combine {
                dims: self.dims,
                out,
                w_out,
                dst: self.dst.ptr,
                peer_hidden: self.hidden.table.ptr,
                peer_wts: self.wts.table.ptr,
                back,
                back_w,
                back_pos,
                status: st,
            }
            .launch(dev, Grid::new(g, b))
        }
    }

    fn combine_fallback_exchange(&mut self, rank: &Rank) -> Result<(u64, u64, u64), GpuError> {
        let dev = &rank.dev;
        let (r, me) = (self.ranks, self.me);
        let st = self.status_ptr();
        let fb = self
            .fb
            .as_ref()
            .ok_or_else(|| GpuError::Invalid("fallback buffers missing".into()))?;
        let c = &fb.counts;
        let nrecv: usize = (0..r)
            .filter(|&p| p != me)
            .map(|p| c[p * r + me] as usize)
            .sum();
        // SAFETY: nrecv rows of meta received in dispatch; staging sized for S*K rows.
        unsafe {
            FbGather {
                dims: self.dims,
                meta: fb.meta_recv.ptr,
                nrows: nrecv as i64,
                own_hidden: self.hidden.ptr(),
                own_wts: self.wts.ptr(),
                out_rows: fb.stage_recv.ptr,
                out_w: fb.recv_w.ptr,
                status: st,
            }
            .launch(dev, Grid::new(self.cfg.num_blocks, 512))?
        };
        let comm = rank.comm()?;
        let row = self.cfg.hidden * 2;
        nccl::group_start()?;
        let (mut sb, mut rb) = (0usize, 0usize);
        for p in 0..r {
            if p == me {
                continue;
            }
            let (back_n, mine_n) = (c[p * r + me] as usize, c[me * r + p] as usize);
            comm.send(
                fb.stage_recv.ptr + (rb * row) as u64,
                back_n * row,
                Dtype::U8,
                p,
                dev.stream,
            )?;
            comm.send(
                fb.recv_w.ptr + (rb * 4) as u64,
                back_n * 4,
                Dtype::U8,
                p,
                dev.stream,
            )?;
            comm.recv(
                fb.back.ptr + (sb * row) as u64,
                mine_n * row,
                Dtype::U8,
                p,
                dev.stream,
            )?;
            comm.recv(
                fb.back_w.ptr + (sb * 4) as u64,
                mine_n * 4,
                Dtype::U8,
                p,
                dev.stream,
            )?;
            rb += back_n;
            sb += mine_n;
        }
        nccl::group_end()?;
        Ok((fb.back.ptr, fb.back_w.ptr, fb.pos_of.ptr))
    }

    /// Prefetch: the home rank of every replicated expert pushes its weights (`local_weights`:
    /// device `[epn][expert_bytes]`) into prefetch slot `b` of every rank holding it.
    pub fn prefetch(&self, dev: &Device, local_weights: u64) -> Result<(), GpuError> {
        let pool = self
            .pool
            .as_ref()
            .ok_or_else(|| GpuError::Invalid("EpConfig::expert_bytes is 0".into()))?;
        if self.transport != Transport::Nvlink || !self.cfg.expert_bytes.is_multiple_of(16) {
            return Err(GpuError::Invalid(
                "prefetch needs peer access and expert_bytes % 16 == 0".into(),
            ));
        }
        self.barrier(dev)?;
        let epn = self.cfg.experts / self.ranks;
        // SAFETY: pool chunks hold epn experts on every rank, local_weights epn experts.
        unsafe {
            Prefetch {
                dims: self.dims,
                etc: self.etc.ptr,
                local_w: local_weights,
                peer_pool: pool.table.ptr,
                wbytes: self.cfg.expert_bytes as i64,
                status: self.status_ptr(),
            }
            .launch(dev, Grid::new((self.ranks * epn).min(1024) as u32, 512))?
        };
        self.barrier(dev)
    }

    /// Reads the latest plan back (syncs).
    pub fn read_plan(&self, dev: &Device) -> Result<DevicePlan, GpuError> {
        dev.sync()?;
        let (r, e) = (self.ranks, self.cfg.experts);
        let epn = e / r;
        let n = (self.dims.s * self.dims.k) as usize;
        Ok(DevicePlan {
            alloc: read_ptr(self.alloc.ptr, e * r)?,
            alloc_cum: read_ptr(self.alloc_cum.ptr, e * r)?,
            experts_to_copy: read_ptr(self.etc.ptr, r * epn)?,
            counts: read_ptr(self.counts.ptr, 2 * epn)?,
            cu_seqlens: read_ptr(self.cu.ptr, 2 * epn)?,
            zero_fill: read_ptr(self.zfill.ptr, 4 * epn)?,
            dst: read_ptr(self.dst.ptr, n)?,
        })
    }
}

/// The CPU planner's config for this buffer and call.
pub fn plan_config(
    cfg: &EpConfig,
    ranks: usize,
    s: usize,
    total_tokens: Option<u64>,
) -> PlanConfig {
    PlanConfig {
        ranks: ranks as u32,
        experts: cfg.experts as u32,
        top_k: cfg.top_k as u32,
        capacity_s: cfg.capacity_s as u32,
        padding: cfg.padding as u32,
        mode: match total_tokens {
            None => TokenMode::Uniform { s: s as u32 },
            Some(t) => TokenMode::PerRank { total_tokens: t },
        },
    }
}

fn dims_of(cfg: &EpConfig, r: usize, me: usize, s: usize, total_tokens: Option<u64>) -> Dims {
    let pc = plan_config(cfg, r, s, total_tokens);
    Dims {
        r: r as i64,
        me: me as i64,
        e: cfg.experts as i64,
        epn: (cfg.experts / r) as i64,
        k: cfg.top_k as i64,
        s: s as i64,
        p: cfg.padding as i64,
        t: pc.total_tokens() as i64,
        nvs: pc.shard_slots() as i64,
        nvs_s: pc.step_slots() as i64,
        h: cfg.hidden as i64,
        cap_s: cfg.capacity_s as i64,
        uniform: total_tokens.is_none() as i64,
    }
}
