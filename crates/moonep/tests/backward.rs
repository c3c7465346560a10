//! Backward ops of the reference cluster: combine-backward and dispatch-backward are the adjoints
//! of combine and dispatch (exact in f64 on dyadic data), `reduce_grad` sums every replica slot
//! into its owner, and a whole layer's gradients match central differences of the f64 loss.
#![allow(clippy::needless_range_loop)]

mod common;

use common::{H, Shape, plan_for, shape};
use half::bf16;
use moonep::reference::{
    ClusterPlan, ExpertBank, POISON, ReplicaPools, VirtualCluster, combine, combine_backward,
    dense_loss_f64, dispatch_backward, dyadic_router_weights, dyadic_tokens, moe_backward,
    random_router_weights, random_tokens, reduce_grad,
};
use moonep::router::{Placement, Skew};
use proptest::prelude::*;
use rand::{Rng, SeedableRng, rngs::StdRng};

fn per_rank<T>(s: &Shape, f: impl Fn(usize, usize) -> Vec<T>) -> Vec<Vec<T>> {
    s.tokens
        .iter()
        .enumerate()
        .map(|(r, &n)| f(r, n as usize))
        .collect()
}

fn dot(a: &[bf16], b: &[bf16]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x.to_f64() * y.to_f64()).sum()
}

/// Slot gradients: dyadic on every rank's used rows, NaN past them.
fn slot_grads(plan: &ClusterPlan, seed: u64) -> (Vec<Vec<bf16>>, Vec<Vec<f32>>) {
    let nvs = plan.global.shard_slots as usize;
    let mut gy = Vec::new();
    let mut gw = Vec::new();
    for d in 0..plan.global.ranks {
        let used = plan.global.layouts[d].used_rows() as usize;
        let mut y = dyadic_tokens(nvs * H, seed + d as u64);
        y[used * H..].fill(bf16::from_f32(POISON));
        let mut w: Vec<f32> = dyadic_tokens(nvs, seed ^ 0x55 ^ d as u64)
            .iter()
            .map(|v| v.to_f32())
            .collect();
        w[used..].fill(POISON);
        gy.push(y);
        gw.push(w);
    }
    (gy, gw)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    /// <C y, g> == <y, Cᵀ g> over the used rows; Cᵀ g has zero padding rows and a NaN tail.
    #[test]
    fn combine_backward_is_the_adjoint_of_combine(s in shape()) {
        let (_, _, plan) = plan_for(&s);
        let (y, _) = slot_grads(&plan, s.seed);
        let g = per_rank(&s, |r, n| dyadic_tokens(n * H, s.seed ^ (r as u64) << 20));
        let cy = combine(&plan, &y, H);
        let ct = combine_backward(&plan, &g, H).unwrap();
        let mut rhs = 0.0;
        for d in 0..s.ranks {
            let layout = &plan.global.layouts[d];
            let used = layout.used_rows() as usize;
            prop_assert!(ct.shards[d][used * H..].iter().all(|v| v.is_nan()), "tail of rank {}", d);
            for &(start, n) in &layout.zero_fill {
                let rows = start as usize * H..(start + n) as usize * H;
                prop_assert!(ct.shards[d][rows].iter().all(|v| v.to_f32() == 0.0));
            }
            rhs += dot(&y[d][..used * H], &ct.shards[d][..used * H]);
        }
        let lhs: f64 = (0..s.ranks).map(|r| dot(&cy[r], &g[r])).sum();
        prop_assert!(lhs.is_finite());
        prop_assert_eq!(lhs, rhs);
    }

    /// <D(x, w), (gy, gw)> == <x, dx> + <w, dw>, and dispatch-backward never reads a tail row.
    #[test]
    fn dispatch_backward_is_the_adjoint_of_dispatch(s in shape()) {
        let (_, _, plan) = plan_for(&s);
        let x = per_rank(&s, |r, n| dyadic_tokens(n * H, s.seed + 31 * r as u64));
        let w = per_rank(&s, |r, n| dyadic_router_weights(n * s.top_k, s.seed ^ 7 ^ r as u64));
        let mut fwd = VirtualCluster::new(s.ranks, plan.global.shard_slots as usize, H);
        fwd.dispatch(&plan, &x, Some(&w)).unwrap();
        let (gy, gw) = slot_grads(&plan, !s.seed);
        let grads = dispatch_backward(&plan, &gy, Some(&gw), H).unwrap();
        let dw = grads.dw.as_ref().unwrap();
        let mut lhs = 0.0;
        for d in 0..s.ranks {
            let used = plan.global.layouts[d].used_rows() as usize;
            lhs += dot(&fwd.shards[d][..used * H], &gy[d][..used * H]);
            lhs += (0..used).map(|j| f64::from(fwd.wts[d][j]) * f64::from(gw[d][j])).sum::<f64>();
        }
        let mut rhs = 0.0;
        for r in 0..s.ranks {
            prop_assert!(grads.dx[r].iter().all(|v| !v.is_nan()));
            rhs += dot(&x[r], &grads.dx[r]);
            rhs += w[r].iter().zip(&dw[r]).map(|(a, b)| f64::from(*a) * f64::from(*b)).sum::<f64>();
        }
        prop_assert!(lhs.is_finite());
        prop_assert_eq!(lhs, rhs);
    }

    /// Every consumed reduce slot lands in its owner's grad (and only there) and is zero after;
    /// unused slots keep their poison.
    #[test]
    fn reduce_grad_sums_every_replica_into_its_owner(s in shape()) {
        let (_, _, plan) = plan_for(&s);
        let (r_n, epn) = (s.ranks, s.epn);
        let mut reduce = ReplicaPools::filled(r_n, epn, H, POISON);
        let etc = |d: usize| plan.global.layouts[d].experts_to_copy.clone();
        for d in 0..r_n {
            for (b, &e) in etc(d).iter().enumerate() {
                if e >= 0 {
                    reduce.slots[d][b] = dyadic_tokens(H * H, s.seed ^ (d * 64 + b) as u64)
                        .iter().map(|v| v.to_f32()).collect();
                }
            }
        }
        let mut home: Vec<Vec<Vec<f32>>> = (0..r_n)
            .map(|d| (0..epn).map(|g| dyadic_tokens(H * H, !s.seed ^ (d * 64 + g) as u64)
                .iter().map(|v| v.to_f32()).collect()).collect())
            .collect();
        let mut want = home.clone();
        for d in 0..r_n {
            for (b, &e) in etc(d).iter().enumerate() {
                if e >= 0 {
                    let (h, g) = (e as usize / epn, e as usize % epn);
                    for (a, v) in want[h][g].iter_mut().zip(&reduce.slots[d][b]) {
                        *a += v;
                    }
                }
            }
        }
        reduce_grad(&plan, &mut home, &mut reduce);
        prop_assert_eq!(&home, &want);
        for d in 0..r_n {
            for (b, &e) in etc(d).iter().enumerate() {
                let slot = &reduce.slots[d][b];
                if e >= 0 {
                    prop_assert!(slot.iter().all(|&v| v == 0.0), "slot {} of rank {}", b, d);
                } else {
                    prop_assert!(slot.iter().all(|v| v.is_nan()), "unused slot {} of rank {}", b, d);
                }
            }
        }
    }
}

/// Layer inputs widened to f64 (bf16 and f32 values are exact there).
struct Widened {
    weights: Vec<Vec<f64>>,
    x: Vec<Vec<f64>>,
    w: Vec<Vec<f64>>,
    g: Vec<Vec<f64>>,
}

fn total_loss(v: &Widened, topk: &[Vec<u32>], k: usize) -> f64 {
    (0..v.x.len())
        .map(|r| dense_loss_f64(&v.weights, H, &v.x[r], &v.w[r], &topk[r], k, &v.g[r]))
        .sum()
}

/// Central difference of the loss in one coordinate (the loss is linear in each argument, so
/// the step size only sets the rounding error).
fn central(
    v: &mut Widened,
    topk: &[Vec<u32>],
    k: usize,
    at: impl Fn(&mut Widened) -> &mut f64,
) -> f64 {
    let eps = 1e-3;
    let x0 = *at(v);
    *at(v) = x0 + eps;
    let up = total_loss(v, topk, k);
    *at(v) = x0 - eps;
    let down = total_loss(v, topk, k);
    *at(v) = x0;
    (up - down) / (2.0 * eps)
}

/// `got` vs finite differences `fd`: within 1% of the value plus `of_scale` of the mean magnitude.
fn close(what: &str, got: &[(f64, f64)], of_scale: f64) -> Result<(), TestCaseError> {
    let scale = got.iter().map(|(_, fd)| fd.abs()).sum::<f64>() / got.len().max(1) as f64;
    for (i, &(g, fd)) in got.iter().enumerate() {
        prop_assert!(
            (g - fd).abs() <= 1e-2 * fd.abs() + of_scale * scale + 1e-9,
            "{} sample {}: backward {} vs finite difference {}",
            what,
            i,
            g,
            fd
        );
    }
    Ok(())
}

fn check_finite_differences(s: &Shape) -> Result<(), TestCaseError> {
    let (_, topk, plan) = plan_for(s);
    let (r_n, k) = (s.ranks, s.top_k);
    let e_n = r_n * s.epn;
    let bank = ExpertBank::random(e_n, H, s.seed);
    let x = per_rank(s, |r, n| random_tokens(n, H, s.seed ^ (r as u64) << 4));
    let w = per_rank(s, |r, n| random_router_weights(n * k, s.seed + r as u64));
    let g = per_rank(s, |r, n| random_tokens(n, H, !s.seed - r as u64));
    let got = moe_backward(&plan, &bank, &x, &w, &g).unwrap();
    let widen = |v: &Vec<Vec<bf16>>| -> Vec<Vec<f64>> {
        v.iter()
            .map(|r| r.iter().map(|b| b.to_f64()).collect())
            .collect()
    };
    let mut v = Widened {
        weights: bank
            .weights
            .iter()
            .map(|m| m.iter().map(|&a| f64::from(a)).collect())
            .collect(),
        x: widen(&x),
        w: w.iter()
            .map(|r| r.iter().map(|&a| f64::from(a)).collect())
            .collect(),
        g: widen(&g),
    };
    let mut rng = StdRng::seed_from_u64(s.seed);
    let (mut dx, mut dw, mut dwe) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..16 {
        let r = rng.random_range(0..r_n);
        let j = rng.random_range(0..x[r].len());
        dx.push((
            got.dx[r][j].to_f64(),
            central(&mut v, &topk, k, |v| &mut v.x[r][j]),
        ));
        let i = rng.random_range(0..w[r].len());
        dw.push((
            f64::from(got.dw[r][i]),
            central(&mut v, &topk, k, |v| &mut v.w[r][i]),
        ));
    }
    // dW of experts that received entries (where replicas come into play), plus a random one.
    let used: Vec<usize> = (0..e_n)
        .filter(|&e| plan.global.expert_tokens[e] > 0)
        .collect();
    for n in 0..8 {
        let e = if n < 7 {
            used[rng.random_range(0..used.len())]
        } else {
            rng.random_range(0..e_n)
        };
        let j = rng.random_range(0..H * H);
        dwe.push((
            f64::from(got.d_weights[e][j]),
            central(&mut v, &topk, k, |v| &mut v.weights[e][j]),
        ));
    }
    // dx sums K bf16-rounded expert terms (each off by up to 2^-9 of its size) that can cancel, so
    // its error scales with the terms, not with the sum: allow K * 2^-7 of the mean magnitude. A
    // missing, doubled or misweighted expert is off by a whole term.
    close("dx", &dx, 1e-2_f64.max(k as f64 / 128.0))?;
    close("dw", &dw, 1e-2)?;
    close("dW", &dwe, 1e-2)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// The distributed layer backward (through replicas and reduce_grad) matches central
    /// differences of the f64 loss on random, non-dyadic data.
    #[test]
    fn layer_gradients_match_finite_differences(s in shape()) {
        check_finite_differences(&s)?;
    }
}

#[test]
fn layer_gradients_match_finite_differences_under_a_hot_home_group() {
    let s = Shape {
        ranks: 4,
        epn: 4,
        top_k: 4,
        tokens: vec![24; 4],
        padding: 8,
        skew: Skew::HotHomeGroup,
        placement: Placement::Clustered,
        seed: 9,
    };
    let plan = plan_for(&s).2;
    assert!(
        (1..4).all(|d| plan.global.replicas_on(d) > 0),
        "the case must exercise replicas"
    );
    check_finite_differences(&s).unwrap();
}

#[test]
fn a_wrong_adjoint_fails_the_finite_difference_check() {
    // Sanity of the check itself: a sign flip in one dx sample must be caught.
    let got = [(1.0, 1.0), (-0.5, 0.5), (0.25, 0.25)];
    assert!(close("dx", &got, 8.0 / 128.0).is_err());
}

#[test]
fn backward_ops_reject_wrong_shapes() {
    let s = Shape {
        ranks: 2,
        epn: 2,
        top_k: 2,
        tokens: vec![4, 4],
        padding: 1,
        skew: Skew::Uniform,
        placement: Placement::Random,
        seed: 3,
    };
    let plan = plan_for(&s).2;
    let short = vec![vec![bf16::ZERO; 3]; 2];
    assert!(combine_backward(&plan, &short, H).is_err());
    assert!(dispatch_backward(&plan, &short, None, H).is_err());
}
