//! CPU reference cluster (docs/specs/moonep.md §4.1): R virtual ranks in one process.
//!
//! Dispatch, combine, weight prefetch and `reduce_grad` follow docs/specs/moonep.md §3 as plain
//! loops. Every shard starts poisoned (NaN) and only real rows and padding rows (zero-filled) are
//! written, so a consumer reading past `cu_seqlens` sees NaN. The backward ops (dispatch-backward,
//! combine-backward, the layer backward) live in `backward.rs`. The GPU tests compare their output
//! to this module exactly.

mod backward;
mod data;
mod experts;
mod oracle;

pub use backward::{
    DispatchGrads, LayerGrads, combine_backward, dense_loss_f64, dispatch_backward, moe_backward,
};
pub use data::{dyadic_router_weights, dyadic_tokens, random_router_weights, random_tokens};
pub use experts::{
    ExpertBank, ReplicaPools, expert_backward_on_slots, expert_forward_on_slots, prefetch,
    reduce_grad,
};
pub use oracle::{DenseGrads, dense_backward, dense_forward};

use half::bf16;

use crate::plan::{GlobalPlan, PlanConfig, PlanError, plan_entries, plan_global, unpack_slot};

/// Poison written into every undefined row.
pub const POISON: f32 = f32::NAN;

/// Errors of the reference cluster.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ReferenceError {
    #[error(transparent)]
    Plan(#[from] PlanError),
    #[error("rank {rank}: {what} has {got} elements, expected {expected}")]
    Shape {
        rank: usize,
        what: &'static str,
        got: usize,
        expected: usize,
    },
}

/// A full plan: stages A–C once (identical on every rank) plus stage D of every rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterPlan {
    pub cfg: PlanConfig,
    pub global: GlobalPlan,
    /// `[R][s_r*K]` packed destination slots.
    pub dst: Vec<Vec<i64>>,
}

impl ClusterPlan {
    /// Plans every rank from the gathered `tpe` and per-rank flat `topk`.
    pub fn new(cfg: &PlanConfig, tpe: &[u32], topk: &[Vec<u32>]) -> Result<Self, PlanError> {
        let global = plan_global(cfg, tpe)?;
        let dst = topk
            .iter()
            .enumerate()
            .map(|(r, row)| plan_entries(cfg, &global, r, row))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(ClusterPlan {
            cfg: *cfg,
            global,
            dst,
        })
    }

    /// `(rank, row)` of entry `i` of source rank `r`.
    pub fn slot(&self, rank: usize, entry: usize) -> (usize, usize) {
        let (d, row) = unpack_slot(self.dst[rank][entry], self.global.shard_slots);
        (d, row as usize)
    }
}

/// R virtual ranks: hidden shards `[R][NvS*H]` (bf16) and per-slot weights `[R][NvS]` (f32).
#[derive(Debug, Clone)]
pub struct VirtualCluster {
    pub ranks: usize,
    pub hidden: usize,
    pub shard_slots: usize,
    pub shards: Vec<Vec<bf16>>,
    pub wts: Vec<Vec<f32>>,
}

impl VirtualCluster {
    /// A cluster whose shards are entirely poisoned.
    pub fn new(ranks: usize, shard_slots: usize, hidden: usize) -> Self {
        VirtualCluster {
            ranks,
            hidden,
            shard_slots,
            shards: vec![vec![bf16::from_f32(POISON); shard_slots * hidden]; ranks],
            wts: vec![vec![POISON; shard_slots]; ranks],
        }
    }

    /// Re-poisons every row (NaN).
    pub fn poison(&mut self) {
        for s in &mut self.shards {
            s.fill(bf16::from_f32(POISON));
        }
        for w in &mut self.wts {
            w.fill(POISON);
        }
    }

    /// Dispatch: copies `x[r][t]` into slot `dst[r][t*K+k]` of its destination shard and
    /// `w[r][t*K+k]` into the per-slot weight (when given), then zero-fills every rank's
    /// padding rows. Rows past `cu_seqlens[last]` are left as they were (poisoned).
    pub fn dispatch(
        &mut self,
        plan: &ClusterPlan,
        x: &[Vec<bf16>],
        w: Option<&[Vec<f32>]>,
    ) -> Result<(), ReferenceError> {
        let h = self.hidden;
        let k = plan.cfg.top_k as usize;
        for (r, xr) in x.iter().enumerate() {
            let s = plan.global.tokens_per_rank[r] as usize;
            check_len(r, "x", xr.len(), s * h)?;
            if let Some(w) = w {
                check_len(r, "w", w[r].len(), s * k)?;
            }
            for (i, _) in plan.dst[r].iter().enumerate() {
                let t = i / k;
                let (d, row) = plan.slot(r, i);
                self.shards[d][row * h..(row + 1) * h].copy_from_slice(&xr[t * h..(t + 1) * h]);
                if let Some(w) = w {
                    self.wts[d][row] = w[r][i];
                }
            }
        }
        for d in 0..self.ranks {
            for &(start, n) in &plan.global.layouts[d].zero_fill {
                let (start, n) = (start as usize, n as usize);
                self.shards[d][start * h..(start + n) * h].fill(bf16::ZERO);
                self.wts[d][start..start + n].fill(0.0);
            }
        }
        Ok(())
    }
}

/// The whole distributed forward on a fresh poisoned cluster: dispatch, weight prefetch, expert
/// compute in place on every rank's slot layout, combine. Returns the cluster (slot outputs) and
/// `out[r]` (`[s_r*H]`).
pub fn moe_forward(
    plan: &ClusterPlan,
    bank: &ExpertBank,
    x: &[Vec<bf16>],
    w: &[Vec<f32>],
) -> Result<(VirtualCluster, Vec<Vec<bf16>>), ReferenceError> {
    let (r_n, h) = (plan.global.ranks, bank.hidden);
    let mut cluster = VirtualCluster::new(r_n, plan.global.shard_slots as usize, h);
    cluster.dispatch(plan, x, Some(w))?;
    let mut pools = ReplicaPools::filled(r_n, plan.global.experts_per_rank, h, POISON);
    prefetch(plan, bank, &mut pools);
    for d in 0..r_n {
        expert_forward_on_slots(
            plan,
            bank,
            &pools,
            d,
            &mut cluster.shards[d],
            &cluster.wts[d],
        );
    }
    let out = combine(plan, &cluster.shards, h);
    Ok((cluster, out))
}

/// Combine: `out[r][t] = Σ_k y[d(i)][loff(i)]`, accumulated in f32 in ascending k and rounded to
/// bf16 once. `y` is the slot layout `[R][NvS*H]`.
pub fn combine(plan: &ClusterPlan, y: &[Vec<bf16>], hidden: usize) -> Vec<Vec<bf16>> {
    let k = plan.cfg.top_k as usize;
    (0..plan.dst.len())
        .map(|r| {
            let s = plan.global.tokens_per_rank[r] as usize;
            let mut out = vec![bf16::ZERO; s * hidden];
            let mut acc = vec![0f32; hidden];
            for t in 0..s {
                acc.fill(0.0);
                for kk in 0..k {
                    let (d, row) = plan.slot(r, t * k + kk);
                    for (a, v) in acc.iter_mut().zip(&y[d][row * hidden..(row + 1) * hidden]) {
                        *a += v.to_f32();
                    }
                }
                for (o, a) in out[t * hidden..(t + 1) * hidden].iter_mut().zip(&acc) {
                    *o = bf16::from_f32(*a);
                }
            }
            out
        })
        .collect()
}

/// Gathers a per-slot f32 array `[R][NvS]` back to `[R][s_r*K]` (router-weight gradients).
pub fn gather_slots(plan: &ClusterPlan, per_slot: &[Vec<f32>]) -> Vec<Vec<f32>> {
    (0..plan.dst.len())
        .map(|r| {
            (0..plan.dst[r].len())
                .map(|i| {
                    let (d, row) = plan.slot(r, i);
                    per_slot[d][row]
                })
                .collect()
        })
        .collect()
}

fn check_len(
    rank: usize,
    what: &'static str,
    got: usize,
    expected: usize,
) -> Result<(), ReferenceError> {
    if got == expected {
        Ok(())
    } else {
        Err(ReferenceError::Shape {
            rank,
            what,
            got,
            expected,
        })
    }
}
