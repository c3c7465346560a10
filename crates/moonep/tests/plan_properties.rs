//! Property tests of the planner: invariants I1–I14 of docs/specs/moonep.md §2.3 over random shapes
//! and skews.

use moonep::plan::{
    PlanConfig, PlanError, TokenMode, plan_entries, plan_global, verify_entries, verify_global,
};
use moonep::router::{Placement, Routing, Skew, WorkloadSpec, generate, sample_lognormal};
use proptest::prelude::*;
use rand::{Rng, SeedableRng, rngs::StdRng};

/// One random case: shape, token counts and routing.
#[derive(Debug, Clone)]
struct Case {
    ranks: usize,
    epn: usize,
    top_k: usize,
    tokens: Vec<u32>,
    padding: u32,
    skew: u8,
    placement: u8,
    seed: u64,
}

fn case() -> impl Strategy<Value = Case> {
    (
        1usize..=16,
        1usize..=8,
        1usize..=8,
        1u32..=64,
        prop_oneof![Just(1u32), Just(8), Just(128)],
    )
        .prop_flat_map(|(ranks, epn, k, s, padding)| {
            let top_k = k.min(ranks * epn);
            let tokens = prop_oneof![
                Just(vec![s; ranks]),
                proptest::collection::vec(1u32..=64, ranks..=ranks),
            ];
            (
                Just((ranks, epn, top_k, padding)),
                tokens,
                0u8..13,
                0u8..3,
                any::<u64>(),
            )
        })
        .prop_map(
            |((ranks, epn, top_k, padding), tokens, skew, placement, seed)| Case {
                ranks,
                epn,
                top_k,
                tokens,
                padding,
                skew,
                placement,
                seed,
            },
        )
}

/// Routing and per-rank topk for a case; kinds 0–9 use the exact generator, 10 the lognormal
/// sampler, 11 random topk with duplicates and a hot expert, 12 one hot expert in every slot.
fn routing(c: &Case) -> (Routing, Vec<Vec<u32>>) {
    let experts = c.ranks * c.epn;
    let placement =
        [Placement::Clustered, Placement::Random, Placement::Spread][c.placement as usize];
    let skew = match c.skew {
        0 => Skew::Uniform,
        1 => Skew::Zipf {
            maxvio: (c.seed % 8) as f64 * 0.5,
        },
        2 => Skew::Lognormal {
            sigma: (c.seed % 10) as f64 * 0.2,
        },
        3 => Skew::SingleHotExpert,
        4 => Skew::HotHomeGroup,
        5 => Skew::HotSourceRank,
        6 => Skew::HalfExpertsEmpty,
        7 => Skew::IntraGroupSkew,
        8 => Skew::RankShare {
            share: 0.5 + (c.seed % 10) as f64 * 0.05,
        },
        _ => Skew::Zipf { maxvio: 100.0 },
    };
    let spec = WorkloadSpec {
        experts,
        top_k: c.top_k,
        tokens: c.tokens.clone(),
        skew,
        placement,
        seed: c.seed,
    };
    match c.skew {
        10 => sample_lognormal(&spec, 1.0),
        11 | 12 => {
            let mut rng = StdRng::seed_from_u64(c.seed);
            let topk: Vec<Vec<u32>> = c
                .tokens
                .iter()
                .map(|&s| {
                    (0..s as usize * c.top_k)
                        .map(|_| {
                            if c.skew == 12 || rng.random_bool(0.5) {
                                (c.seed % experts as u64) as u32
                            } else {
                                rng.random_range(0..experts as u32)
                            }
                        })
                        .collect()
                })
                .collect();
            (Routing::from_topk(experts, c.top_k, &topk), topk)
        }
        _ => {
            let r = generate(&spec).expect("valid spec");
            let topk = (0..c.ranks).map(|rank| r.topk(rank, c.seed)).collect();
            (r, topk)
        }
    }
}

fn check_case(c: &Case) -> Result<(), TestCaseError> {
    let (r, topk) = routing(c);
    let capacity = *c.tokens.iter().max().unwrap();
    let cfg = r.plan_config(capacity, c.padding);
    let plan = plan_global(&cfg, &r.tpe).map_err(|e| TestCaseError::fail(e.to_string()))?;
    verify_global(&cfg, &r.tpe, &plan).map_err(|e| TestCaseError::fail(e.to_string()))?;
    let dst: Vec<Vec<i64>> = topk
        .iter()
        .enumerate()
        .map(|(rank, row)| plan_entries(&cfg, &plan, rank, row))
        .collect::<Result<_, _>>()
        .map_err(|e| TestCaseError::fail(e.to_string()))?;
    verify_entries(&plan, &topk, &dst).map_err(|e| TestCaseError::fail(e.to_string()))?;
    // I13: same input, same plan, whichever rank runs it and however often.
    prop_assert_eq!(&plan_global(&cfg, &r.tpe).unwrap(), &plan);
    prop_assert_eq!(&plan_entries(&cfg, &plan, 0, &topk[0]).unwrap(), &dst[0]);
    // I5: replicas per rank <= epn follows from single donor; rounds (I11) checked in verify.
    for d in 0..c.ranks {
        prop_assert!(plan.replicas_on(d) <= c.epn);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1024, ..ProptestConfig::default() })]

    #[test]
    fn plan_invariants_hold(c in case()) {
        check_case(&c)?;
    }

    #[test]
    fn contract_violations_are_rejected(c in case(), bump in 0usize..1000) {
        let (r, topk) = routing(&c);
        let capacity = *c.tokens.iter().max().unwrap();
        let cfg = r.plan_config(capacity, c.padding);
        let e_n = r.experts;
        // Σ tpe != s*K on one rank.
        let mut tpe = r.tpe.clone();
        let j = bump % tpe.len();
        tpe[j] += 1;
        prop_assert!(plan_global(&cfg, &tpe).is_err());
        // Mismatched s in uniform mode.
        let wrong_s = PlanConfig { mode: TokenMode::Uniform { s: c.tokens[0] + 1 }, capacity_s: capacity + 1, ..cfg };
        prop_assert!(plan_global(&wrong_s, &r.tpe).is_err());
        // Mismatched T in per-rank mode.
        let t: u64 = c.tokens.iter().map(|&s| u64::from(s)).sum();
        let wrong_t = PlanConfig { mode: TokenMode::PerRank { total_tokens: t + 1 }, capacity_s: capacity + 1, ..cfg };
        let rejected = matches!(plan_global(&wrong_t, &r.tpe), Err(PlanError::TotalMismatch { .. }));
        prop_assert!(rejected);
        // topk whose histogram disagrees with tpe.
        let plan = plan_global(&cfg, &r.tpe).unwrap();
        if e_n > 1 {
            let mut bad = topk[0].clone();
            let j = bump % bad.len();
            bad[j] = (bad[j] + 1) % e_n as u32;
            let rejected = matches!(plan_entries(&cfg, &plan, 0, &bad), Err(PlanError::TopkHistogram { .. }));
            prop_assert!(rejected);
        }
        let mut short = topk[0].clone();
        short.pop();
        prop_assert!(plan_entries(&cfg, &plan, 0, &short).is_err());
    }
}

/// Builds the case for one named edge case.
fn edge(ranks: usize, epn: usize, top_k: usize, s: u32, padding: u32, skew: u8, seed: u64) -> Case {
    Case {
        ranks,
        epn,
        top_k,
        tokens: vec![s; ranks],
        padding,
        skew,
        placement: 0,
        seed,
    }
}

#[test]
fn edge_cases() {
    let cases = [
        ("R=1 no-op", edge(1, 8, 4, 17, 8, 3, 1)),
        ("K=1", edge(8, 4, 1, 33, 8, 1, 2)),
        ("epn=1", edge(16, 1, 1, 5, 128, 4, 3)),
        ("s=1", edge(8, 2, 4, 1, 8, 9, 4)),
        ("all tokens on one expert", edge(4, 4, 1, 64, 128, 12, 5)),
        ("one home group hot", edge(8, 4, 4, 64, 8, 4, 6)),
        ("one source rank hot", edge(8, 4, 4, 64, 8, 5, 7)),
        ("half the experts empty", edge(8, 4, 4, 64, 1, 6, 8)),
        (
            "intra-group skew, balanced groups",
            edge(8, 8, 8, 64, 8, 7, 9),
        ),
        ("duplicate experts in a token", edge(4, 2, 8, 16, 8, 11, 10)),
    ];
    for (name, c) in &cases {
        check_case(c).unwrap_or_else(|e| panic!("{name}: {e}"));
    }
}

#[test]
fn r1_and_balanced_groups_do_not_migrate() {
    for c in [
        edge(1, 8, 4, 17, 8, 3, 1),
        edge(8, 8, 8, 64, 8, 7, 9),
        edge(8, 4, 2, 32, 8, 0, 3),
    ] {
        let (r, _) = routing(&c);
        let plan = plan_global(&r.plan_config(64, c.padding), &r.tpe).unwrap();
        assert!(plan.rounds.is_empty(), "{c:?}");
        assert_eq!(plan.migrated_tokens(), 0, "{c:?}");
    }
}

#[test]
fn hot_group_uses_every_other_rank_and_at_most_r_minus_1_rounds() {
    let c = edge(8, 4, 4, 64, 8, 4, 6);
    let (r, _) = routing(&c);
    let plan = plan_global(&r.plan_config(64, 8), &r.tpe).unwrap();
    assert!(!plan.rounds.is_empty() && plan.rounds.len() <= 7);
    assert!(plan.migrated_tokens() > 0);
    assert!(
        (1..8).all(|d| plan.replicas_on(d) >= 1),
        "every cold rank takes a replica"
    );
}

#[test]
fn verifier_catches_corrupted_plans() {
    let c = edge(4, 4, 4, 32, 8, 4, 6);
    let (r, topk) = routing(&c);
    let cfg = r.plan_config(32, 8);
    let plan = plan_global(&cfg, &r.tpe).unwrap();
    let dst: Vec<Vec<i64>> = (0..4)
        .map(|rank| plan_entries(&cfg, &plan, rank, &topk[rank]).unwrap())
        .collect();
    verify_entries(&plan, &topk, &dst).unwrap();

    let mut moved = plan.clone();
    let e = (0..16).find(|&e| plan.alloc[e * 4 + e / 4] > 0).unwrap();
    let d = (e / 4 + 1) % 4;
    moved.alloc[e * 4 + e / 4] -= 1;
    moved.alloc[e * 4 + d] += 1;
    assert!(verify_global(&cfg, &r.tpe, &moved).is_err());

    let mut cu = plan.clone();
    cu.layouts[1].cu_seqlens[0] += 1;
    assert!(verify_global(&cfg, &r.tpe, &cu).is_err());

    let mut order = plan.clone();
    order.layouts[2].experts_to_copy.reverse();
    assert!(verify_global(&cfg, &r.tpe, &order).is_err());

    // Two entries of different experts swapped: each lands in the wrong group.
    let i = topk[0].iter().position(|&x| x != topk[0][0]).unwrap();
    let mut swapped = dst.clone();
    swapped[0].swap(0, i);
    assert_eq!(
        verify_entries(&plan, &topk, &swapped)
            .unwrap_err()
            .invariant,
        "I8 expert"
    );

    // Two entries of one expert swapped: same slots, wrong order inside the segment.
    let j = topk[0]
        .iter()
        .skip(1)
        .position(|&x| x == topk[0][0])
        .unwrap()
        + 1;
    let mut reordered = dst.clone();
    reordered[0].swap(0, j);
    assert_eq!(
        verify_entries(&plan, &topk, &reordered)
            .unwrap_err()
            .invariant,
        "I9 order"
    );

    let mut twice = dst.clone();
    twice[1][0] = twice[0][0];
    assert!(verify_entries(&plan, &topk, &twice).is_err());
}
