//! Reference cluster (docs/specs/moonep.md §4.1) against the dense MoE oracle, plus the
//! dispatch/combine adjoint identity, the identity round trip, gradients through replicas and
//! poisoning.
#![allow(clippy::needless_range_loop)]

use half::bf16;
use moonep::reference::{
    ClusterPlan, ExpertBank, POISON, VirtualCluster, combine, dense_backward, dense_forward,
    dyadic_router_weights, dyadic_tokens, moe_backward, moe_forward, random_router_weights,
    random_tokens,
};
use moonep::router::{Placement, Skew};
use proptest::prelude::*;

mod common;

use common::{H, Shape, bits, plan_for, shape};

/// Rows past the last group stay poisoned; padding rows are zero.
fn assert_poison_and_padding(plan: &ClusterPlan, cluster: &VirtualCluster) {
    for d in 0..cluster.ranks {
        let layout = &plan.global.layouts[d];
        let used = layout.used_rows() as usize;
        assert!(
            cluster.shards[d][used * H..].iter().all(|v| v.is_nan()),
            "tail of rank {d}"
        );
        assert!(cluster.wts[d][used..].iter().all(|v| v.is_nan()));
        for &(start, n) in &layout.zero_fill {
            let rows = start as usize..(start + n) as usize;
            assert!(
                cluster.shards[d][rows.start * H..rows.end * H]
                    .iter()
                    .all(|v| v.to_f32() == 0.0)
            );
            assert!(cluster.wts[d][rows].iter().all(|&v| v == 0.0));
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    /// Distributed forward (dispatch, prefetch, experts on slots, combine) equals the dense
    /// oracle bit for bit; every expert is a different random matrix, so a misrouted token or a
    /// wrong replica weight changes the answer.
    #[test]
    fn forward_matches_dense_oracle(s in shape()) {
        let (_, topk, plan) = plan_for(&s);
        let bank = ExpertBank::random(s.ranks * s.epn, H, s.seed);
        let x: Vec<Vec<bf16>> = s.tokens.iter().enumerate()
            .map(|(r, &n)| random_tokens(n as usize, H, s.seed ^ r as u64)).collect();
        let w: Vec<Vec<f32>> = s.tokens.iter().enumerate()
            .map(|(r, &n)| random_router_weights(n as usize * s.top_k, s.seed + r as u64)).collect();
        let mut dispatched = VirtualCluster::new(s.ranks, plan.global.shard_slots as usize, H);
        dispatched.dispatch(&plan, &x, Some(&w)).unwrap();
        assert_poison_and_padding(&plan, &dispatched);
        let (_, out) = moe_forward(&plan, &bank, &x, &w).unwrap();
        for r in 0..s.ranks {
            let want = dense_forward(&bank, &x[r], &w[r], &topk[r], s.top_k);
            prop_assert_eq!(bits(&out[r]), bits(&want), "rank {}", r);
        }
    }

    /// combine(dispatch(x)) == K·x with identity experts (no expert compute at all).
    #[test]
    fn combine_of_dispatch_is_k_times_x(s in shape()) {
        let (_, _, plan) = plan_for(&s);
        let x: Vec<Vec<bf16>> = s.tokens.iter().enumerate()
            .map(|(r, &n)| random_tokens(n as usize, H, s.seed ^ (r as u64) << 8)).collect();
        let mut cluster = VirtualCluster::new(s.ranks, plan.global.shard_slots as usize, H);
        cluster.dispatch(&plan, &x, None).unwrap();
        let out = combine(&plan, &cluster.shards, H);
        for r in 0..s.ranks {
            let want: Vec<bf16> = x[r].iter().map(|v| bf16::from_f32(s.top_k as f32 * v.to_f32())).collect();
            prop_assert_eq!(bits(&out[r]), bits(&want));
        }
    }

    /// <D x, y> == <x, C y>, exact in f64 on dyadic data (C = Dᵀ over the real and padding rows).
    #[test]
    fn dispatch_and_combine_are_adjoint(s in shape()) {
        let (_, _, plan) = plan_for(&s);
        let x: Vec<Vec<bf16>> = s.tokens.iter().enumerate()
            .map(|(r, &n)| dyadic_tokens(n as usize * H, s.seed + 17 * r as u64)).collect();
        let mut cluster = VirtualCluster::new(s.ranks, plan.global.shard_slots as usize, H);
        cluster.dispatch(&plan, &x, None).unwrap();
        let mut y: Vec<Vec<bf16>> = (0..s.ranks)
            .map(|d| dyadic_tokens(plan.global.shard_slots as usize * H, s.seed + 1000 + d as u64)).collect();
        let mut lhs = 0f64;
        for d in 0..s.ranks {
            let used = plan.global.layouts[d].used_rows() as usize * H;
            // Past the groups y is undefined: poison it, combine must never read there.
            y[d][used..].fill(bf16::from_f32(POISON));
            lhs += (0..used).map(|j| cluster.shards[d][j].to_f64() * y[d][j].to_f64()).sum::<f64>();
        }
        let cy = combine(&plan, &y, H);
        let rhs: f64 = (0..s.ranks)
            .map(|r| x[r].iter().zip(&cy[r]).map(|(a, b)| a.to_f64() * b.to_f64()).sum::<f64>())
            .sum();
        prop_assert!(rhs.is_finite());
        prop_assert_eq!(lhs, rhs);
    }

    /// Backward through replicas: dX, dw and dW (after prefetch + reduce_grad) equal the dense
    /// oracle's hand-written adjoints exactly (dyadic data keeps every sum exact).
    #[test]
    fn gradients_through_replicas_match_oracle(s in shape()) {
        check_gradients(&s)?;
    }
}

fn check_gradients(s: &Shape) -> Result<(), TestCaseError> {
    let (_, topk, plan) = plan_for(s);
    let (r_n, epn, k) = (s.ranks, s.epn, s.top_k);
    let e_n = r_n * epn;
    let bank = ExpertBank::dyadic(e_n, H, s.seed);
    let x: Vec<Vec<bf16>> = s
        .tokens
        .iter()
        .enumerate()
        .map(|(r, &n)| dyadic_tokens(n as usize * H, s.seed + r as u64))
        .collect();
    let g: Vec<Vec<bf16>> = s
        .tokens
        .iter()
        .enumerate()
        .map(|(r, &n)| dyadic_tokens(n as usize * H, !s.seed - r as u64))
        .collect();
    let w: Vec<Vec<f32>> = s
        .tokens
        .iter()
        .enumerate()
        .map(|(r, &n)| dyadic_router_weights(n as usize * k, s.seed ^ r as u64))
        .collect();

    let got = moe_backward(&plan, &bank, &x, &w, &g).unwrap();
    let (dx, dw, reduce) = (&got.dx, &got.dw, &got.reduce);
    let mut d_weights = vec![vec![0f32; H * H]; e_n];
    for r in 0..r_n {
        let want = dense_backward(&bank, &x[r], &w[r], &topk[r], k, &g[r], &mut d_weights);
        prop_assert_eq!(bits(&dx[r]), bits(&want.dx), "dx rank {}", r);
        prop_assert_eq!(&dw[r], &want.dw, "dw rank {}", r);
    }
    for e in 0..e_n {
        prop_assert_eq!(&got.d_weights[e], &d_weights[e], "dW expert {}", e);
    }
    for d in 0..r_n {
        for (b, &e) in plan.global.layouts[d].experts_to_copy.iter().enumerate() {
            if e >= 0 {
                prop_assert!(
                    reduce.slots[d][b].iter().all(|&v| v == 0.0),
                    "slot {} of rank {} not zeroed",
                    b,
                    d
                );
            }
        }
    }
    Ok(())
}

fn hot_shape(skew: Skew) -> Shape {
    Shape {
        ranks: 4,
        epn: 4,
        top_k: 4,
        tokens: vec![24; 4],
        padding: 8,
        skew,
        placement: Placement::Clustered,
        seed: 42,
    }
}

#[test]
fn gradients_with_many_replicas() {
    let s = hot_shape(Skew::HotHomeGroup);
    let (_, _, plan) = plan_for(&s);
    assert!(
        (1..4).all(|d| plan.global.replicas_on(d) > 0),
        "the case must exercise replicas"
    );
    check_gradients(&s).unwrap();
}

#[test]
fn misrouted_entry_changes_the_answer() {
    let s = hot_shape(Skew::Zipf { maxvio: 1.0 });
    let (_, topk, mut plan) = plan_for(&s);
    let bank = ExpertBank::random(16, H, 1);
    let x: Vec<Vec<bf16>> = (0..4).map(|r| random_tokens(24, H, r)).collect();
    let w: Vec<Vec<f32>> = (0..4).map(|r| random_router_weights(96, r)).collect();
    let i = topk[0].iter().position(|&e| e != topk[0][0]).unwrap();
    plan.dst[0].swap(0, i);
    let (_, out) = moe_forward(&plan, &bank, &x, &w).unwrap();
    let want = dense_forward(&bank, &x[0], &w[0], &topk[0], 4);
    assert_ne!(bits(&out[0]), bits(&want));
}

#[test]
fn reading_past_cu_seqlens_yields_poison() {
    let s = hot_shape(Skew::Uniform);
    let (_, _, mut plan) = plan_for(&s);
    let x: Vec<Vec<bf16>> = (0..4).map(|r| random_tokens(24, H, r)).collect();
    let used = u64::from(plan.global.layouts[1].used_rows());
    plan.dst[0][0] = moonep::plan::pack_slot(1, used, plan.global.shard_slots);
    let mut cluster = VirtualCluster::new(4, plan.global.shard_slots as usize, H);
    let clean = plan_for(&s).2;
    cluster.dispatch(&clean, &x, None).unwrap();
    let out = combine(&plan, &cluster.shards, H);
    assert!(
        out[0][..H].iter().all(|v| v.is_nan()),
        "token 0 read a poisoned tail row"
    );
    assert!(out[0][H..].iter().all(|v| !v.is_nan()));
}
