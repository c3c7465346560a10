//! [`EpBuffer`]: the collective dispatch/combine engine of one rank (spec §3, §5).
//!
//! Every call is collective: all ranks issue the same sequence on their stream. The buffer keeps
//! the latest plan on the device (dispatch plans, combine and prefetch reuse it). No host sync
//! happens on the NVLink path; the NCCL fallback copies the `[R,R]` count matrix to the host.

use super::driver::{Args, DevBuf, Device, read_ptr};
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
            barrier_timeout_ns: 10_000_000_000,
        }
    }
}

/// Kernel-side sizes (mirrors `struct Dims` in kernels/moonep.cu).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
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

/// Which transport moves rows between ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// Peer-mapped IPC buffers: zero-copy stores and pulls over NVLink.
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
        let args = Args::new()
            .arg(self.ctrl.ptr())
            .arg(self.ctrl.table.ptr)
            .arg(self.me as i64)
            .arg(self.ranks as i64)
            .arg(self.cfg.barrier_timeout_ns);
        // SAFETY: argument list matches moonep_barrier; ctrl chunks hold R+2 words on every rank.
        unsafe {
            dev.launch(
                "moonep_barrier",
                1,
                32 * self.ranks.div_ceil(32) as u32,
                0,
                args,
            )
        }
    }

    /// Barrier with an explicit timeout (tests use it to provoke a timeout).
    pub fn barrier_with_timeout(&self, dev: &Device, timeout_ns: u64) -> Result<(), GpuError> {
        let args = Args::new()
            .arg(self.ctrl.ptr())
            .arg(self.ctrl.table.ptr)
            .arg(self.me as i64)
            .arg(self.ranks as i64)
            .arg(timeout_ns);
        // SAFETY: as in `barrier`.
        unsafe {
            dev.launch(
                "moonep_barrier",
                1,
                32 * self.ranks.div_ceil(32) as u32,
                0,
                args,
            )
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

    /// Plans this call: all-gathers `tpe` (device `i32[E]`) over NCCL and runs the planning
    /// kernels on `topk` (device `i32[s*K]`). `total_tokens` is `Some(T)` in per-rank mode.
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
        rank.comm
            .all_gather(tpe, self.tpe_all.ptr, e, Dtype::I32, dev.stream)?;
        let n = s * self.cfg.top_k;
        let nblk = n.div_ceil(HIST_BLOCK);
        let st = self.status_ptr();
        let args = Args::new()
            .arg(topk)
            .arg(n as i64)
            .arg(e as i64)
            .arg(self.ord.ptr)
            .arg(self.hist.ptr)
            .arg(st);
        // SAFETY: matches moonep_plan_hist; ord/hist sized for S*K entries and ceil(S*K/256)*E.
        unsafe {
            dev.launch(
                "moonep_plan_hist",
                nblk as u32,
                HIST_BLOCK as u32,
                (HIST_BLOCK / 32 * e * 4) as u32,
                args,
            )?
        };
        let smem = (MAX_R + MAX_R * MAX_R + 2 * e) * 8;
        let args = Args::new()
            .arg(d)
            .arg(self.tpe_all.ptr)
            .arg(self.hist.ptr)
            .arg(nblk as i64)
            .arg(self.alloc.ptr)
            .arg(self.alloc_cum.ptr)
            .arg(self.src_off.ptr)
            .arg(self.grp_start.ptr)
            .arg(self.etc.ptr)
            .arg(self.counts.ptr)
            .arg(self.cu.ptr)
            .arg(self.zfill.ptr)
            .arg(st);
        // SAFETY: matches moonep_plan_global; every array sized in `new`.
        unsafe { dev.launch("moonep_plan_global", 1, 1024, smem as u32, args)? };
        let args = Args::new()
            .arg(d)
            .arg(topk)
            .arg(n as i64)
            .arg(self.ord.ptr)
            .arg(self.hist.ptr)
            .arg(self.alloc_cum.ptr)
            .arg(self.src_off.ptr)
            .arg(self.grp_start.ptr)
            .arg(self.dst.ptr)
            .arg(st);
        // SAFETY: matches moonep_plan_dst.
        unsafe { dev.launch("moonep_plan_dst", nblk as u32, HIST_BLOCK as u32, 0, args) }
    }

    /// Plans and dispatches: every entry's row of `x` (device bf16 `[s,H]`) lands in its final
    /// slot; `w` (device f32 `[s,K]`, 0 = none → 1.0) goes to the per-slot weights.
    pub fn dispatch(&mut self, rank: &Rank, t: &Tokens) -> Result<(), GpuError> {
        self.plan(rank, t.topk, t.tpe, t.s, t.total_tokens)?;
        match self.transport {
            Transport::Nvlink => self.dispatch_nvlink(&rank.dev, t.x, t.w),
            Transport::NcclFallback => self.dispatch_fallback(rank, t.x, t.w),
        }
    }

    fn warps_grid(&self) -> (u32, u32) {
        (self.cfg.num_blocks, 512)
    }

    fn dispatch_nvlink(&self, dev: &Device, x: u64, w: u64) -> Result<(), GpuError> {
        self.barrier(dev)?;
        let (g, b) = self.warps_grid();
        let args = Args::new()
            .arg(self.dims)
            .arg(x)
            .arg(w)
            .arg(self.dst.ptr)
            .arg(self.hidden.table.ptr)
            .arg(self.wts.table.ptr)
            .arg(self.dup.table.ptr)
            .arg(self.zfill.ptr)
            .arg(self.cfg.dedup as i32)
            .arg(self.status_ptr());
        // SAFETY: matches moonep_dispatch; tables hold R mapped shard pointers.
        unsafe { dev.launch("moonep_dispatch", g, b, 0, args)? };
        self.barrier(dev)?;
        if self.cfg.dedup {
            let args = Args::new()
                .arg(self.dims)
                .arg(self.hidden.ptr())
                .arg(self.dup.ptr())
                .arg(self.cu.ptr)
                .arg(self.status_ptr());
            // SAFETY: matches moonep_replicate; own shard and dup array of NvS rows.
            unsafe { dev.launch("moonep_replicate", dev.num_sms * 2, 512, 0, args)? };
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
        let args = Args::new()
            .arg(self.dims)
            .arg(self.dst.ptr)
            .arg(fb.cnt.ptr)
            .arg(st);
        // SAFETY: matches moonep_fb_count.
        unsafe { dev.launch("moonep_fb_count", 64, 256, 0, args)? };
        rank.comm
            .all_gather(fb.cnt.ptr, fb.cnt_all.ptr, r, Dtype::I32, dev.stream)?;
        dev.sync()?;
        fb.counts = read_ptr(fb.cnt_all.ptr, r * r)?;
        let (g, b) = (self.cfg.num_blocks, 512);
        let args = Args::new()
            .arg(self.dims)
            .arg(x)
            .arg(w)
            .arg(self.dst.ptr)
            .arg(fb.cnt.ptr)
            .arg(fb.fill.ptr)
            .arg(self.hidden.ptr())
            .arg(self.wts.ptr())
            .arg(fb.stage_send.ptr)
            .arg(fb.meta_send.ptr)
            .arg(fb.pos_of.ptr)
            .arg(st);
        // SAFETY: matches moonep_fb_pack; staging sized for S*K rows.
        unsafe { dev.launch("moonep_fb_pack", g, b, 0, args)? };
        let args = Args::new()
            .arg(self.dims)
            .arg(self.hidden.ptr())
            .arg(self.wts.ptr())
            .arg(self.zfill.ptr)
            .arg(st);
        // SAFETY: matches moonep_zero_pad.
        unsafe { dev.launch("moonep_zero_pad", g, b, 0, args)? };
        let row = self.cfg.hidden * 2;
        let c = &fb.counts;
        nccl::group_start()?;
        let (mut sb, mut rb) = (0usize, 0usize);
        for p in 0..r {
            if p == me {
                continue;
            }
            let (ns, nr) = (c[me * r + p] as usize, c[p * r + me] as usize);
            rank.comm.send(
                fb.stage_send.ptr + (sb * row) as u64,
                ns * row,
                Dtype::U8,
                p,
                dev.stream,
            )?;
            rank.comm.send(
                fb.meta_send.ptr + (sb * 8) as u64,
                ns * 8,
                Dtype::U8,
                p,
                dev.stream,
            )?;
            rank.comm.recv(
                fb.stage_recv.ptr + (rb * row) as u64,
                nr * row,
                Dtype::U8,
                p,
                dev.stream,
            )?;
            rank.comm.recv(
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
        let args = Args::new()
            .arg(self.dims)
            .arg(fb.stage_recv.ptr)
            .arg(fb.meta_recv.ptr)
            .arg(rb as i64)
            .arg(self.hidden.ptr())
            .arg(self.wts.ptr())
            .arg(st);
        // SAFETY: matches moonep_fb_unpack; rb rows received.
        unsafe { dev.launch("moonep_fb_unpack", g, b, 0, args) }
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
        let args = Args::new()
            .arg(self.dims)
            .arg(out)
            .arg(w_out)
            .arg(self.dst.ptr)
            .arg(self.hidden.table.ptr)
            .arg(self.wts.table.ptr)
            .arg(back)
            .arg(back_w)
            .arg(back_pos)
            .arg(st);
        // SAFETY: matches moonep_combine.
        unsafe { dev.launch("moonep_combine", g, b, 0, args) }
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
        let args = Args::new()
            .arg(self.dims)
            .arg(fb.meta_recv.ptr)
            .arg(nrecv as i64)
            .arg(self.hidden.ptr())
            .arg(self.wts.ptr())
            .arg(fb.stage_recv.ptr)
            .arg(fb.recv_w.ptr)
            .arg(st);
        // SAFETY: matches moonep_fb_gather.
        unsafe { dev.launch("moonep_fb_gather", self.cfg.num_blocks, 512, 0, args)? };
        let row = self.cfg.hidden * 2;
        nccl::group_start()?;
        let (mut sb, mut rb) = (0usize, 0usize);
        for p in 0..r {
            if p == me {
                continue;
            }
            let (back_n, mine_n) = (c[p * r + me] as usize, c[me * r + p] as usize);
            rank.comm.send(
                fb.stage_recv.ptr + (rb * row) as u64,
                back_n * row,
                Dtype::U8,
                p,
                dev.stream,
            )?;
            rank.comm.send(
                fb.recv_w.ptr + (rb * 4) as u64,
                back_n * 4,
                Dtype::U8,
                p,
                dev.stream,
            )?;
            rank.comm.recv(
                fb.back.ptr + (sb * row) as u64,
                mine_n * row,
                Dtype::U8,
                p,
                dev.stream,
            )?;
            rank.comm.recv(
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
        let args = Args::new()
            .arg(self.dims)
            .arg(self.etc.ptr)
            .arg(local_weights)
            .arg(pool.table.ptr)
            .arg(self.cfg.expert_bytes as i64)
            .arg(self.status_ptr());
        // SAFETY: matches moonep_prefetch; pool chunks hold epn experts on every rank.
        unsafe {
            dev.launch(
                "moonep_prefetch",
                (self.ranks * epn).min(1024) as u32,
                512,
                0,
                args,
            )?
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
