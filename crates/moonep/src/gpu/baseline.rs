//! Megatron-style "alltoall" dispatcher, the baseline a user would otherwise pick
//! (docs/specs/moonep.md §5): count exchange (`ncclAllGather` + device→host copy, one sync per
//! call) → permute-1 (stable sort of entries by expert = by destination) → all-to-all-v as grouped
//! `ncclSend`/`ncclRecv` (rows and probs) → permute-2 (`[src][local expert]` →
//! `[local expert][src]`); combine reverses it and sums the K copies in f32 (ascending k, one bf16
//! rounding), like moonep's combine.

use super::GpuError;
use super::driver::{DevBuf, read_ptr};
use super::ep::{EpConfig, Tokens};
use super::kernels::{
    BaseLayout, BasePermute1, BasePermute2, BaseUnpermute1, Dims, Grid, PlanHist,
};
use super::nccl::{self, Dtype};
use super::rank::Rank;

const HIST_BLOCK: usize = 256;

/// Baseline buffers of one rank. The receive side is pre-allocated for `R*S*K` rows.
pub struct Baseline {
    cfg: EpConfig,
    me: usize,
    ranks: usize,
    tpe_all: DevBuf,
    status: DevBuf,
    ord: DevBuf,
    hist: DevBuf,
    e_base: DevBuf,
    src_major: DevBuf,
    exp_major: DevBuf,
    pos_of: DevBuf,
    send: DevBuf,
    send_w: DevBuf,
    recv: DevBuf,
    recv_w: DevBuf,
    /// Expert-major rows after permute-2 (`[local expert][src]`): the grouped-GEMM input.
    pub perm: DevBuf,
    pub perm_w: DevBuf,
    tpe_host: Vec<i32>,
    dims: Dims,
    /// Blocks for the local permute kernels (4 per SM: they use the whole GPU, as torch does).
    grid: u32,
}

impl Baseline {
    /// Allocates the baseline's buffers (not collective).
    pub fn new(rank: &Rank, cfg: EpConfig) -> Result<Baseline, GpuError> {
        let (me, r) = (rank.env.rank, rank.env.world);
        let dev = &rank.dev;
        let (e, n) = (cfg.experts, cfg.capacity_s * cfg.top_k);
        let epn = e / r;
        let row = cfg.hidden * 2;
        let max_recv = r * n;
        Ok(Baseline {
            cfg,
            me,
            ranks: r,
            tpe_all: dev.alloc(r * e * 4)?,
            status: dev.alloc(4)?,
            ord: dev.alloc(n * 4)?,
            hist: dev.alloc(n.div_ceil(HIST_BLOCK) * e * 4)?,
            e_base: dev.alloc(e * 4)?,
            src_major: dev.alloc((r * epn + 1) * 4)?,
            exp_major: dev.alloc(r * epn * 4)?,
            pos_of: dev.alloc(n * 4)?,
            send: dev.alloc(n * row)?,
            send_w: dev.alloc(n * 4)?,
            recv: dev.alloc(max_recv * row)?,
            recv_w: dev.alloc(max_recv * 4)?,
            perm: dev.alloc(max_recv * row)?,
            perm_w: dev.alloc(max_recv * 4)?,
            tpe_host: vec![0; r * e],
            grid: dev.num_sms * 4,
            dims: Dims {
                r: r as i64,
                me: me as i64,
                e: e as i64,
                epn: epn as i64,
                k: cfg.top_k as i64,
                s: 1,
                p: 1,
                t: r as i64,
                nvs: 1,
                nvs_s: 1,
                h: cfg.hidden as i64,
                cap_s: cfg.capacity_s as i64,
                uniform: 1,
            },
        })
    }

    /// Rows this rank received in the latest dispatch (`Σ_p Σ_{e∈me} tpe[p][e]`).
    pub fn received_rows(&self) -> usize {
        let (r, e) = (self.ranks, self.cfg.experts);
        let epn = e / r;
        (0..r)
            .map(|p| {
                (0..epn)
                    .map(|le| self.tpe_host[p * e + self.me * epn + le] as usize)
                    .sum::<usize>()
            })
            .sum()
    }

    fn splits(&self) -> (Vec<usize>, Vec<usize>) {
        let (r, e) = (self.ranks, self.cfg.experts);
        let epn = e / r;
        let t = &self.tpe_host;
        let send = (0..r)
            .map(|p| {
                (0..epn)
                    .map(|le| t[self.me * e + p * epn + le] as usize)
                    .sum()
            })
            .collect();
        let recv = (0..r)
            .map(|p| {
                (0..epn)
                    .map(|le| t[p * e + self.me * epn + le] as usize)
                    .sum()
            })
            .collect();
        (send, recv)
    }

    /// Dispatch of `t` (uniform mode; `total_tokens` is ignored).
    /// Result in [`Baseline::perm`] (expert-major).
    pub fn dispatch(&mut self, rank: &Rank, t: &Tokens) -> Result<(), GpuError> {
        let Tokens {
            x, w, topk, tpe, s, ..
        } = *t;
        let dev = &rank.dev;
        let (r, e) = (self.ranks, self.cfg.experts);
        self.dims.s = s as i64;
        let d = self.dims;
        let n = s * self.cfg.top_k;
        let nblk = n.div_ceil(HIST_BLOCK);
        rank.comm()?
            .all_gather(tpe, self.tpe_all.ptr, e, Dtype::I32, dev.stream)?;
        let (local, warps) = (Grid::new(1, 1024), Grid::new(self.grid, 512));
        // SAFETY (all launches below): every buffer was sized in `new` for S*K entries, R*S*K
        // received rows and R*E counts.
        unsafe {
            PlanHist {
                topk,
                n: n as i64,
                experts: e as i64,
                ord: self.ord.ptr,
                hist: self.hist.ptr,
                status: self.status.ptr,
            }
            .launch(
                dev,
                Grid::new(nblk as u32, HIST_BLOCK as u32).smem(HIST_BLOCK / 32 * e * 4),
            )?;
            BaseLayout {
                dims: d,
                tpe: self.tpe_all.ptr,
                hist: self.hist.ptr,
                nblk: nblk as i64,
                e_base: self.e_base.ptr,
                src_major: self.src_major.ptr,
                exp_major: self.exp_major.ptr,
            }
            .launch(dev, local)?;
        }
        // The data-dependent split sizes go to the host (the per-call sync the baseline pays).
        dev.sync()?;
        self.tpe_host = read_ptr(self.tpe_all.ptr, r * e)?;
        // SAFETY: as above.
        unsafe {
            BasePermute1 {
                dims: d,
                x,
                w,
                topk,
                ord: self.ord.ptr,
                hist: self.hist.ptr,
                e_base: self.e_base.ptr,
                send: self.send.ptr,
                send_w: self.send_w.ptr,
                pos_of: self.pos_of.ptr,
            }
            .launch(dev, warps)?
        };
        let (sends, recvs) = self.splits();
        self.exchange(
            rank,
            (self.send.ptr, self.send_w.ptr),
            &sends,
            (self.recv.ptr, self.recv_w.ptr),
            &recvs,
        )?;
        let rows = self.received_rows();
        // SAFETY: as above.
        unsafe {
            BasePermute2 {
                dims: d,
                src_major: self.src_major.ptr,
                exp_major: self.exp_major.ptr,
                nrows: rows as i64,
                from: self.recv.ptr,
                to: self.perm.ptr,
                from_w: self.recv_w.ptr,
                to_w: self.perm_w.ptr,
                reverse: 0,
            }
            .launch(dev, warps)
        }
    }

    /// Combine of the expert outputs in [`Baseline::perm`] into `out` bf16 `[s,H]`.
    pub fn combine(&mut self, rank: &Rank, out: u64) -> Result<(), GpuError> {
        let dev = &rank.dev;
        let d = self.dims;
        let rows = self.received_rows();
        let warps = Grid::new(self.grid, 512);
        // SAFETY: buffers sized in `new`; reverse permute without weights.
        unsafe {
            BasePermute2 {
                dims: d,
                src_major: self.src_major.ptr,
                exp_major: self.exp_major.ptr,
                nrows: rows as i64,
                from: self.perm.ptr,
                to: self.recv.ptr,
                from_w: 0,
                to_w: 0,
                reverse: 1,
            }
            .launch(dev, warps)?
        };
        let (sends, recvs) = self.splits();
        self.exchange_rows(rank, self.recv.ptr, &recvs, self.send.ptr, &sends)?;
        // SAFETY: as above.
        unsafe {
            BaseUnpermute1 {
                dims: d,
                back: self.send.ptr,
                pos_of: self.pos_of.ptr,
                out,
            }
            .launch(dev, warps)
        }
    }

    fn exchange(
        &self,
        rank: &Rank,
        from: (u64, u64),
        sends: &[usize],
        to: (u64, u64),
        recvs: &[usize],
    ) -> Result<(), GpuError> {
        self.exchange_rows(rank, from.0, sends, to.0, recvs)?;
        self.exchange_bytes(rank, from.1, sends, to.1, recvs, 4)
    }

    fn exchange_rows(
        &self,
        rank: &Rank,
        from: u64,
        sends: &[usize],
        to: u64,
        recvs: &[usize],
    ) -> Result<(), GpuError> {
        self.exchange_bytes(rank, from, sends, to, recvs, self.cfg.hidden * 2)
    }

    /// All-to-all-v of `unit`-byte items: chunk `p` of `from` (offsets by `sends`) goes to rank
    /// `p`, landing in chunk `me` of its `to` (offsets by its `recvs`).
    fn exchange_bytes(
        &self,
        rank: &Rank,
        from: u64,
        sends: &[usize],
        to: u64,
        recvs: &[usize],
        unit: usize,
    ) -> Result<(), GpuError> {
        let dev = &rank.dev;
        let (mut so, mut ro) = (0usize, 0usize);
        nccl::group_start()?;
        for p in 0..self.ranks {
            let (a, b) = ((from + (so * unit) as u64), (to + (ro * unit) as u64));
            if p == self.me {
                dev.copy_d2d(b, a, sends[p] * unit)?;
            } else {
                let comm = rank.comm()?;
                comm.send(a, sends[p] * unit, Dtype::U8, p, dev.stream)?;
                comm.recv(b, recvs[p] * unit, Dtype::U8, p, dev.stream)?;
            }
            so += sends[p];
            ro += recvs[p];
        }
        nccl::group_end()
    }
}
