//! Workload generators: contracts (row sums, distinct experts per token) and skew targets.

use moonep::router::{
    Placement, Routing, Skew, WorkloadSpec, generate, sample_lognormal, sample_lognormal_for_maxvio,
};
use proptest::prelude::*;

fn spec(
    ranks: usize,
    epn: usize,
    k: usize,
    s: u32,
    skew: Skew,
    placement: Placement,
    seed: u64,
) -> WorkloadSpec {
    WorkloadSpec {
        experts: ranks * epn,
        top_k: k,
        tokens: vec![s; ranks],
        skew,
        placement,
        seed,
    }
}

fn check_contract(r: &Routing, seed: u64) {
    for rank in 0..r.ranks {
        let row = &r.tpe[rank * r.experts..(rank + 1) * r.experts];
        let s = r.tokens[rank] as usize;
        assert_eq!(row.iter().map(|&x| x as usize).sum::<usize>(), s * r.top_k);
        let topk = r.topk(rank, seed);
        assert_eq!(
            Routing::from_topk(r.experts, r.top_k, std::slice::from_ref(&topk)).tpe,
            row
        );
        if row.iter().all(|&x| x as usize <= s) {
            for t in 0..s {
                let mut tok = topk[t * r.top_k..(t + 1) * r.top_k].to_vec();
                tok.sort_unstable();
                tok.dedup();
                assert_eq!(
                    tok.len(),
                    r.top_k,
                    "token {t} of rank {rank} repeats an expert"
                );
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn zipf_hits_its_target(target in 0.0f64..4.0, seed in any::<u64>()) {
        let r = generate(&spec(8, 32, 8, 512, Skew::Zipf { maxvio: target }, Placement::Random, seed)).unwrap();
        prop_assert!((r.maxvio() - target).abs() < 0.02, "maxvio {} target {}", r.maxvio(), target);
        check_contract(&r, seed);
    }

    #[test]
    fn rank_share_puts_that_share_on_rank_0(share in 0.5f64..0.95, seed in any::<u64>()) {
        let r = generate(&spec(2, 128, 8, 256, Skew::RankShare { share }, Placement::Clustered, seed)).unwrap();
        let g = r.group_loads();
        let got = g[0] as f64 / (g[0] + g[1]) as f64;
        prop_assert!((got - share).abs() < 1e-3, "share {} got {}", share, got);
        check_contract(&r, seed);
    }
}

#[test]
fn every_kind_keeps_the_contract() {
    let kinds = [
        Skew::Uniform,
        Skew::Zipf { maxvio: 2.0 },
        Skew::Lognormal { sigma: 1.0 },
        Skew::SingleHotExpert,
        Skew::HotHomeGroup,
        Skew::HotSourceRank,
        Skew::HalfExpertsEmpty,
        Skew::IntraGroupSkew,
        Skew::RankShare { share: 0.9 },
    ];
    for skew in kinds {
        for placement in [Placement::Clustered, Placement::Random, Placement::Spread] {
            let r = generate(&spec(4, 4, 4, 33, skew, placement, 7)).unwrap();
            check_contract(&r, 7);
            let mut varlen = spec(4, 4, 4, 1, skew, placement, 7);
            varlen.tokens = vec![1, 9, 33, 5];
            check_contract(&generate(&varlen).unwrap(), 7);
        }
    }
}

#[test]
fn placement_orders_rank_imbalance() {
    let make = |p| generate(&spec(8, 32, 8, 4096, Skew::Zipf { maxvio: 2.0 }, p, 3)).unwrap();
    let (clustered, random, spread) = (
        make(Placement::Clustered),
        make(Placement::Random),
        make(Placement::Spread),
    );
    assert!(clustered.rank_imbalance() > random.rank_imbalance());
    assert!(random.rank_imbalance() > spread.rank_imbalance());
    assert!(
        (clustered.maxvio() - spread.maxvio()).abs() < 1e-9,
        "placement keeps expert counts"
    );
}

#[test]
fn intra_group_skew_keeps_groups_at_quota() {
    let r = generate(&spec(
        8,
        8,
        4,
        64,
        Skew::IntraGroupSkew,
        Placement::Clustered,
        1,
    ))
    .unwrap();
    assert!(r.group_loads().iter().all(|&g| g == 64 * 4));
    assert!(r.maxvio() > 1.0);
}

#[test]
fn lognormal_sampler_skew_grows_with_sigma() {
    let s = spec(4, 16, 4, 256, Skew::Uniform, Placement::Random, 5);
    let (flat, topk) = sample_lognormal(&s, 0.05);
    let (steep, _) = sample_lognormal(&s, 1.5);
    assert!(
        steep.maxvio() > flat.maxvio() + 0.5,
        "{} vs {}",
        steep.maxvio(),
        flat.maxvio()
    );
    for row in &topk {
        for tok in row.chunks_exact(4) {
            let mut t = tok.to_vec();
            t.sort_unstable();
            t.dedup();
            assert_eq!(t.len(), 4, "sampling without replacement");
        }
    }
}

#[test]
fn lognormal_sigma_is_bisected_to_the_target() {
    let s = spec(4, 16, 4, 128, Skew::Uniform, Placement::Random, 11);
    for target in [0.5, 1.0, 2.0] {
        let (r, topk, sigma) = sample_lognormal_for_maxvio(&s, target);
        assert!(
            (r.maxvio() - target).abs() < 0.15,
            "target {target}: maxvio {} (sigma {sigma})",
            r.maxvio()
        );
        assert_eq!(Routing::from_topk(64, 4, &topk), r);
    }
}
