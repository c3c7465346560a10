//! Shared generators of the reference-cluster tests: random shapes over the spec's range
//! (R<=16, epn<=8, K<=8, s<=64, P in {1, 8, 128}) and every skew kind, and their plans.
#![allow(dead_code)]

use half::bf16;
use moonep::reference::ClusterPlan;
use moonep::router::{Placement, Routing, Skew, WorkloadSpec, generate};
use proptest::prelude::*;

pub const H: usize = 8;

#[derive(Debug, Clone)]
pub struct Shape {
    pub ranks: usize,
    pub epn: usize,
    pub top_k: usize,
    pub tokens: Vec<u32>,
    pub padding: u32,
    pub skew: Skew,
    pub placement: Placement,
    pub seed: u64,
}

pub fn skew() -> impl Strategy<Value = Skew> {
    prop_oneof![
        Just(Skew::Uniform),
        (0.0f64..4.0).prop_map(|m| Skew::Zipf { maxvio: m }),
        (0.0f64..1.5).prop_map(|s| Skew::Lognormal { sigma: s }),
        Just(Skew::SingleHotExpert),
        Just(Skew::HotHomeGroup),
        Just(Skew::HotSourceRank),
        Just(Skew::HalfExpertsEmpty),
        Just(Skew::IntraGroupSkew),
        (0.5f64..0.95).prop_map(|s| Skew::RankShare { share: s }),
    ]
}

pub fn shape() -> impl Strategy<Value = Shape> {
    (
        1usize..=16,
        1usize..=8,
        1usize..=8,
        1u32..=64,
        prop_oneof![Just(1u32), Just(8), Just(128)],
    )
        .prop_flat_map(|(ranks, epn, k, s, padding)| {
            let tokens = prop_oneof![
                Just(vec![s; ranks]),
                proptest::collection::vec(1u32..=64, ranks..=ranks)
            ];
            let placement = prop_oneof![
                Just(Placement::Clustered),
                Just(Placement::Random),
                Just(Placement::Spread)
            ];
            (
                Just((ranks, epn, k.min(ranks * epn), padding)),
                tokens,
                skew(),
                placement,
                any::<u64>(),
            )
        })
        .prop_map(
            |((ranks, epn, top_k, padding), tokens, skew, placement, seed)| Shape {
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

pub fn plan_for(s: &Shape) -> (Routing, Vec<Vec<u32>>, ClusterPlan) {
    let spec = WorkloadSpec {
        experts: s.ranks * s.epn,
        top_k: s.top_k,
        tokens: s.tokens.clone(),
        skew: s.skew,
        placement: s.placement,
        seed: s.seed,
    };
    let routing = generate(&spec).unwrap();
    let topk: Vec<Vec<u32>> = (0..s.ranks).map(|r| routing.topk(r, s.seed)).collect();
    let cfg = routing.plan_config(*s.tokens.iter().max().unwrap(), s.padding);
    let plan = ClusterPlan::new(&cfg, &routing.tpe, &topk).unwrap();
    (routing, topk, plan)
}

pub fn bits(v: &[bf16]) -> Vec<u16> {
    v.iter().map(|x| x.to_bits()).collect()
}
