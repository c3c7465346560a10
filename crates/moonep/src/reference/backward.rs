//! Backward ops of the reference cluster (docs/specs/moonep.md §3, "Adjoint relations").
//!
//! Dispatch `D` is a gather-copy and combine `C` a scatter-sum with `C = Dᵀ`, so:
//! - [`dispatch_backward`] is a combine of the slot gradients (plus the weight path gathered back
//!   to `[s,K]`);
//! - [`combine_backward`] is a dispatch of the token gradients with the same plan (no planning);
//! - [`super::reduce_grad`] sums replica weight gradients into their owners;
//! - [`moe_backward`] chains them for a whole layer, on the same fixed `S*K` shards.

use half::bf16;

use super::{
    ClusterPlan, ExpertBank, POISON, ReferenceError, ReplicaPools, VirtualCluster, check_len,
    combine, expert_backward_on_slots, gather_slots, prefetch, reduce_grad,
};

/// Gradients of dispatch's inputs.
#[derive(Debug, Clone, PartialEq)]
pub struct DispatchGrads {
    /// `[R][s_r*H]`: `dx[t] = bf16(Σ_k f32(grad_slot[dst(t,k)]))`, ascending k.
    pub dx: Vec<Vec<bf16>>,
    /// `[R][s_r*K]`: `dw[t,k] = grad_wts[dst(t,k)]` (when slot weight gradients are given).
    pub dw: Option<Vec<Vec<f32>>>,
}

/// Dispatch-backward: a combine of `grad_slots` (`[R][NvS*H]`) and, when given, a gather of
/// `grad_wts` (`[R][NvS]`). Reads only real rows, so padding and tail rows may hold anything.
pub fn dispatch_backward(
    plan: &ClusterPlan,
    grad_slots: &[Vec<bf16>],
    grad_wts: Option<&[Vec<f32>]>,
    hidden: usize,
) -> Result<DispatchGrads, ReferenceError> {
    let nvs = plan.global.shard_slots as usize;
    for (d, g) in grad_slots.iter().enumerate() {
        check_len(d, "grad_slots", g.len(), nvs * hidden)?;
    }
    if let Some(gw) = grad_wts {
        for (d, g) in gw.iter().enumerate() {
            check_len(d, "grad_wts", g.len(), nvs)?;
        }
    }
    Ok(DispatchGrads {
        dx: combine(plan, grad_slots, hidden),
        dw: grad_wts.map(|gw| gather_slots(plan, gw)),
    })
}

/// Combine-backward: a dispatch of `grad_out` (`[R][s_r*H]`) with the saved plan into a fresh
/// poisoned cluster. Real rows get their token's gradient, padding rows 0 (combine never reads
/// them), rows past the groups stay NaN. Slot weights are left as they are (poisoned).
pub fn combine_backward(
    plan: &ClusterPlan,
    grad_out: &[Vec<bf16>],
    hidden: usize,
) -> Result<VirtualCluster, ReferenceError> {
    let mut grads =
        VirtualCluster::new(plan.global.ranks, plan.global.shard_slots as usize, hidden);
    grads.dispatch(plan, grad_out, None)?;
    Ok(grads)
}

/// Gradients of one MoE layer `out = combine(w_slot · W_e dispatch(x))` for
/// `L = Σ_r Σ_t <grad_out[r][t], out[r][t]>`.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerGrads {
    /// `[R][s_r*H]`.
    pub dx: Vec<Vec<bf16>>,
    /// `[R][s_r*K]` router-weight gradients.
    pub dw: Vec<Vec<f32>>,
    /// `[E][H*H]` expert weight gradients on their owners, after `reduce_grad`.
    pub d_weights: Vec<Vec<f32>>,
    /// Reduce slots after `reduce_grad` (consumed slots are zero again).
    pub reduce: ReplicaPools,
}

/// The distributed backward of a layer: re-dispatch of `x` (the saved forward slots),
/// combine-backward of `grad_out`, expert backward on every rank's slots (home experts into the
/// owner's grad, replicas into reduce slots), dispatch-backward, then `reduce_grad`.
pub fn moe_backward(
    plan: &ClusterPlan,
    bank: &ExpertBank,
    x: &[Vec<bf16>],
    w: &[Vec<f32>],
    grad_out: &[Vec<bf16>],
) -> Result<LayerGrads, ReferenceError> {
    let (r_n, h) = (plan.global.ranks, bank.hidden);
    let epn = plan.global.experts_per_rank;
    let nvs = plan.global.shard_slots as usize;
    for (r, g) in grad_out.iter().enumerate() {
        check_len(
            r,
            "grad_out",
            g.len(),
            plan.global.tokens_per_rank[r] as usize * h,
        )?;
    }
    let mut fwd = VirtualCluster::new(r_n, nvs, h);
    fwd.dispatch(plan, x, Some(w))?;
    let grad_y = combine_backward(plan, grad_out, h)?;
    let mut pools = ReplicaPools::filled(r_n, epn, h, POISON);
    prefetch(plan, bank, &mut pools);
    let mut reduce = ReplicaPools::filled(r_n, epn, h, 0.0);
    let mut home: Vec<Vec<Vec<f32>>> = vec![vec![vec![0.0; h * h]; epn]; r_n];
    let mut dx_slots = vec![vec![bf16::from_f32(POISON); nvs * h]; r_n];
    let mut dw_slots = vec![vec![POISON; nvs]; r_n];
    for d in 0..r_n {
        expert_backward_on_slots(
            plan,
            bank,
            &pools,
            d,
            &fwd.shards[d],
            &grad_y.shards[d],
            &fwd.wts[d],
            &mut dx_slots[d],
            &mut dw_slots[d],
            &mut home[d],
            &mut reduce,
        );
    }
    let grads = dispatch_backward(plan, &dx_slots, Some(&dw_slots), h)?;
    reduce_grad(plan, &mut home, &mut reduce);
    Ok(LayerGrads {
        dx: grads.dx,
        dw: grads.dw.unwrap_or_default(),
        d_weights: home.into_iter().flatten().collect(),
        reduce,
    })
}

/// `L = Σ_t <g_t, Σ_k w_tk W_{e_tk} x_t>` in f64 with no rounding: the loss whose central
/// differences check the hand-written adjoints.
pub fn dense_loss_f64(
    weights: &[Vec<f64>],
    hidden: usize,
    x: &[f64],
    w: &[f64],
    topk: &[u32],
    top_k: usize,
    grad_out: &[f64],
) -> f64 {
    let h = hidden;
    let s = x.len() / h;
    let mut loss = 0.0;
    for t in 0..s {
        for k in 0..top_k {
            let i = t * top_k + k;
            let we = &weights[topk[i] as usize];
            for o in 0..h {
                let z: f64 = (0..h).map(|j| we[o * h + j] * x[t * h + j]).sum();
                loss += grad_out[t * h + o] * w[i] * z;
            }
        }
    }
    loss
}
