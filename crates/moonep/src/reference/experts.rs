//! Reference experts on the slot layout, replica weight prefetch and `reduce_grad`.
//!
//! An expert is one `H×H` f32 matrix `W_e` (a stand-in for gate/up/down: enough to make any
//! misrouted token change the answer). On a slot, `y = bf16(w_slot · W_e x_slot)`.

use half::bf16;
use rand::{Rng, SeedableRng, rngs::StdRng};

use super::ClusterPlan;

/// The weights of every expert, `[E][H*H]` row-major (`W[o*H + i]`).
#[derive(Debug, Clone, PartialEq)]
pub struct ExpertBank {
    pub hidden: usize,
    pub weights: Vec<Vec<f32>>,
}

impl ExpertBank {
    /// Random weights in `[-1, 1)` scaled by `1/sqrt(H)`, distinct per expert.
    pub fn random(experts: usize, hidden: usize, seed: u64) -> Self {
        let mut rng = StdRng::seed_from_u64(seed);
        let scale = 1.0 / (hidden as f32).sqrt();
        let weights = (0..experts)
            .map(|_| {
                (0..hidden * hidden)
                    .map(|_| rng.random_range(-1.0f32..1.0) * scale)
                    .collect()
            })
            .collect();
        ExpertBank { hidden, weights }
    }

    /// Small dyadic weights (`k/4`, `|k| <= 2`): sums of products stay exact in f32, so
    /// gradients reduced in any order compare exactly.
    pub fn dyadic(experts: usize, hidden: usize, seed: u64) -> Self {
        let mut rng = StdRng::seed_from_u64(seed);
        let weights = (0..experts)
            .map(|_| {
                (0..hidden * hidden)
                    .map(|_| rng.random_range(-2i32..=2) as f32 / 4.0)
                    .collect()
            })
            .collect();
        ExpertBank { hidden, weights }
    }

    /// Identity experts (`W_e = I`).
    pub fn identity(experts: usize, hidden: usize) -> Self {
        let eye: Vec<f32> = (0..hidden * hidden)
            .map(|j| if j / hidden == j % hidden { 1.0 } else { 0.0 })
            .collect();
        ExpertBank {
            hidden,
            weights: vec![eye; experts],
        }
    }
}

/// Prefetch slots `[R][epn][H*H]`: replica weights (forward) or reduce slots (backward).
#[derive(Debug, Clone, PartialEq)]
pub struct ReplicaPools {
    pub slots: Vec<Vec<Vec<f32>>>,
}

impl ReplicaPools {
    /// Pools filled with `value` (NaN for weight pools, 0 for reduce slots).
    pub fn filled(ranks: usize, experts_per_rank: usize, hidden: usize, value: f32) -> Self {
        ReplicaPools {
            slots: vec![vec![vec![value; hidden * hidden]; experts_per_rank]; ranks],
        }
    }
}

/// Weight prefetch: the home rank of `e` pushes `W_e` into slot `b` of every rank `d` with
/// `experts_to_copy[d][b] = e`. Unused slots stay as they were (poisoned).
pub fn prefetch(plan: &ClusterPlan, bank: &ExpertBank, pools: &mut ReplicaPools) {
    for (d, layout) in plan.global.layouts.iter().enumerate() {
        for (b, &e) in layout.experts_to_copy.iter().enumerate() {
            if e >= 0 {
                pools.slots[d][b].copy_from_slice(&bank.weights[e as usize]);
            }
        }
    }
}

/// The weights serving group `g` of rank `d`: home experts from the bank, replicas from `pools`.
fn group_weights<'a>(
    plan: &ClusterPlan,
    bank: &'a ExpertBank,
    pools: &'a ReplicaPools,
    d: usize,
    g: usize,
) -> &'a [f32] {
    let epn = plan.global.experts_per_rank;
    if g < epn {
        &bank.weights[d * epn + g]
    } else {
        &pools.slots[d][g - epn]
    }
}

/// `W x` accumulated in f32 over ascending input index.
pub(crate) fn matvec(w: &[f32], x: impl Fn(usize) -> f32, h: usize, out: &mut [f32]) {
    for (o, acc) in out.iter_mut().enumerate() {
        *acc = (0..h).map(|i| w[o * h + i] * x(i)).fold(0.0, |a, b| a + b);
    }
}

/// `Wᵀ g` accumulated in f32 over ascending output index.
pub(crate) fn matvec_t(w: &[f32], g: impl Fn(usize) -> f32, h: usize, out: &mut [f32]) {
    for (i, acc) in out.iter_mut().enumerate() {
        *acc = (0..h).map(|o| w[o * h + i] * g(o)).fold(0.0, |a, b| a + b);
    }
}

/// Expert forward on rank `d`'s slot layout, in place: every row of every group (padding rows
/// included, reading only inside `cu_seqlens`) becomes `bf16(w_slot · W x_slot)`.
pub fn expert_forward_on_slots(
    plan: &ClusterPlan,
    bank: &ExpertBank,
    pools: &ReplicaPools,
    d: usize,
    shard: &mut [bf16],
    wts: &[f32],
) {
    let h = bank.hidden;
    let layout = &plan.global.layouts[d];
    let mut z = vec![0f32; h];
    for g in 0..layout.cu_seqlens.len() {
        let w = group_weights(plan, bank, pools, d, g);
        for row in layout.group_start(g) as usize..layout.cu_seqlens[g] as usize {
            let x = &shard[row * h..(row + 1) * h];
            matvec(w, |i| x[i].to_f32(), h, &mut z);
            for (o, v) in shard[row * h..(row + 1) * h].iter_mut().enumerate() {
                *v = bf16::from_f32(wts[row] * z[o]);
            }
        }
    }
}

/// Expert backward on rank `d`'s slot layout. Inputs: the dispatched `x` and `grad_y` shards and
/// per-slot weights. Writes `dx = bf16(w · Wᵀ gy)` into `dx` rows and `dw = <gy, W x>` into
/// `dw` rows (only rows inside groups), and accumulates `dW += w · gy xᵀ` into `home_grads[g]`
/// (home groups) or `reduce.slots[d][b]` (replicas).
#[allow(clippy::too_many_arguments)]
pub fn expert_backward_on_slots(
    plan: &ClusterPlan,
    bank: &ExpertBank,
    pools: &ReplicaPools,
    d: usize,
    x: &[bf16],
    grad_y: &[bf16],
    wts: &[f32],
    dx: &mut [bf16],
    dw: &mut [f32],
    home_grads: &mut [Vec<f32>],
    reduce: &mut ReplicaPools,
) {
    let h = bank.hidden;
    let epn = plan.global.experts_per_rank;
    let layout = &plan.global.layouts[d];
    let mut z = vec![0f32; h];
    let mut t = vec![0f32; h];
    for g in 0..layout.cu_seqlens.len() {
        let w = group_weights(plan, bank, pools, d, g);
        for row in layout.group_start(g) as usize..layout.cu_seqlens[g] as usize {
            let xr = &x[row * h..(row + 1) * h];
            let gy = &grad_y[row * h..(row + 1) * h];
            matvec(w, |i| xr[i].to_f32(), h, &mut z);
            matvec_t(w, |o| gy[o].to_f32(), h, &mut t);
            for (v, ti) in dx[row * h..(row + 1) * h].iter_mut().zip(&t) {
                *v = bf16::from_f32(wts[row] * ti);
            }
            dw[row] = (0..h)
                .map(|o| gy[o].to_f32() * z[o])
                .fold(0.0, |a, b| a + b);
            let grad = if g < epn {
                &mut home_grads[g]
            } else {
                &mut reduce.slots[d][g - epn]
            };
            for o in 0..h {
                let go = wts[row] * gy[o].to_f32();
                for i in 0..h {
                    grad[o * h + i] += go * xr[i].to_f32();
                }
            }
        }
    }
}

/// `reduce_grad`: the home rank of every expert adds each replica's reduce slot (ranks in
/// ascending order) into its own grad; then every rank zeroes the slots it consumed. Unused
/// slots are left untouched. `home_grads` is `[R][epn][H*H]`.
pub fn reduce_grad(
    plan: &ClusterPlan,
    home_grads: &mut [Vec<Vec<f32>>],
    reduce: &mut ReplicaPools,
) {
    let epn = plan.global.experts_per_rank;
    for (d, layout) in plan.global.layouts.iter().enumerate() {
        for (b, &e) in layout.experts_to_copy.iter().enumerate() {
            if e >= 0 {
                let e = e as usize;
                let (home, g) = (e / epn, e % epn);
                for (acc, v) in home_grads[home][g].iter_mut().zip(&reduce.slots[d][b]) {
                    *acc += v;
                }
            }
        }
    }
    // Mid barrier, then every rank zeroes its consumed slots.
    for (d, layout) in plan.global.layouts.iter().enumerate() {
        for (b, &e) in layout.experts_to_copy.iter().enumerate() {
            if e >= 0 {
                reduce.slots[d][b].fill(0.0);
            }
        }
    }
}
