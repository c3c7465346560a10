//! Hand-worked planner examples (values derived on paper from docs/specs/moonep.md §2.2).

use moonep::plan::{PlanConfig, PlanError, TokenMode, Transfer, plan_entries, plan_global};

fn cfg(ranks: u32, experts: u32, top_k: u32, s: u32, padding: u32) -> PlanConfig {
    PlanConfig {
        ranks,
        experts,
        top_k,
        capacity_s: s,
        padding,
        mode: TokenMode::Uniform { s },
    }
}

#[test]
fn one_hot_expert_is_split_across_two_ranks() {
    let c = cfg(2, 4, 1, 4, 1);
    let tpe = [4, 0, 0, 0, 4, 0, 0, 0];
    let plan = plan_global(&c, &tpe).unwrap();
    assert_eq!(
        plan.rounds,
        vec![Transfer {
            donor: 0,
            receiver: 1,
            tokens: 4
        }]
    );
    assert_eq!(&plan.alloc[0..2], &[4, 4]);
    assert_eq!(plan.layouts[0].cu_seqlens, vec![4, 4, 4, 4]);
    assert_eq!(plan.layouts[1].experts_to_copy, vec![0, -1]);
    assert_eq!(plan.layouts[1].cu_seqlens, vec![0, 0, 4, 4]);
    assert_eq!(
        plan_entries(&c, &plan, 0, &[0; 4]).unwrap(),
        vec![0, 1, 2, 3]
    );
    assert_eq!(
        plan_entries(&c, &plan, 1, &[0; 4]).unwrap(),
        vec![4, 5, 6, 7]
    );
}

#[test]
fn padding_and_three_ranks() {
    // R=3, E=3 (epn=1), K=2, s=3, P=4.
    let c = cfg(3, 3, 2, 3, 4);
    // T_e = [4+2+3, 1+2+0, 1+2+3] = [9, 3, 6]; quota 6 each; bal = [3, -3, 0].
    let tpe = [4, 1, 1, 2, 2, 2, 3, 0, 3];
    let plan = plan_global(&c, &tpe).unwrap();
    assert_eq!(
        plan.rounds,
        vec![Transfer {
            donor: 0,
            receiver: 1,
            tokens: 3
        }]
    );
    assert_eq!(plan.alloc, vec![6, 3, 0, 0, 3, 0, 0, 0, 6]);
    // NvS = align_up(3*2 + 3*2*1, 4) = 12.
    assert_eq!(plan.shard_slots, 12);
    assert_eq!(plan.layouts[1].counts, vec![3, 3]);
    assert_eq!(plan.layouts[1].cu_seqlens, vec![4, 8]);
    assert_eq!(plan.layouts[1].zero_fill, vec![(3, 1), (7, 1)]);
    // Rank 2 has T-order positions 6,7,8 of expert 0 -> rank 1 rows 4+0..3 (group 1 starts at 4).
    let dst = plan_entries(&c, &plan, 2, &[0, 2, 0, 2, 0, 2]).unwrap();
    assert_eq!(dst, vec![12 + 4, 24 + 3, 12 + 5, 24 + 4, 12 + 6, 24 + 5]);
}

#[test]
fn contract_violations_are_errors() {
    let c = cfg(2, 4, 1, 4, 1);
    let err = plan_global(&c, &[4, 0, 0, 0, 3, 0, 0, 0]).unwrap_err();
    assert!(matches!(
        err,
        PlanError::RankTokens {
            rank: 1,
            sum: 3,
            expected: 4
        }
    ));
    let plan = plan_global(&c, &[4, 0, 0, 0, 4, 0, 0, 0]).unwrap();
    assert!(matches!(
        plan_entries(&c, &plan, 0, &[0, 0, 0, 1]),
        Err(PlanError::TopkHistogram { .. })
    ));
}
