//! Checker for the plan invariants I1–I12 of docs/specs/moonep.md §2.3 (used by the property tests,
//! the simulator's self-check and the GPU tests on plans read back from the device).

use super::{GlobalPlan, PlanConfig, align_up, unpack_slot};

/// Which invariant failed, with context.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{invariant}: {detail}")]
pub struct InvariantViolation {
    pub invariant: &'static str,
    pub detail: String,
}

fn fail<T>(invariant: &'static str, detail: String) -> Result<T, InvariantViolation> {
    Err(InvariantViolation { invariant, detail })
}

/// Checks I1–I6 and I10–I12 on `plan` (from `tpe`, row-major `[R*E]`).
pub fn verify_global(
    cfg: &PlanConfig,
    tpe: &[u32],
    plan: &GlobalPlan,
) -> Result<(), InvariantViolation> {
    let (r_n, e_n, epn) = (plan.ranks, plan.experts, plan.experts_per_rank);
    let mut t_e = vec![0u64; e_n];
    for row in tpe.chunks_exact(e_n) {
        for (acc, &x) in t_e.iter_mut().zip(row) {
            *acc += u64::from(x);
        }
    }
    for e in 0..e_n {
        let sum: u64 = (0..r_n).map(|d| u64::from(plan.alloc_at(e, d))).sum();
        if sum != t_e[e] {
            return fail(
                "I1/I2 conservation",
                format!("expert {e}: Σ_d alloc = {sum}, T_e = {}", t_e[e]),
            );
        }
    }
    for d in 0..r_n {
        let load: u64 = (0..e_n).map(|e| u64::from(plan.alloc_at(e, d))).sum();
        if load != cfg.quota(d) {
            return fail(
                "I3 quota",
                format!("rank {d}: load {load} != cap {}", cfg.quota(d)),
            );
        }
        let mut donors: Vec<usize> = (0..e_n)
            .filter(|&e| e / epn != d && plan.alloc_at(e, d) > 0)
            .map(|e| e / epn)
            .collect();
        donors.dedup();
        if donors.len() > 1 {
            return fail(
                "I4 single donor",
                format!("rank {d} takes from homes {donors:?}"),
            );
        }
        let remote: Vec<i32> = (0..e_n)
            .filter(|&e| e / epn != d && plan.alloc_at(e, d) > 0)
            .map(|e| e as i32)
            .collect();
        if remote.len() > epn {
            return fail(
                "I5 replicas",
                format!("rank {d} holds {} > epn={epn}", remote.len()),
            );
        }
        let layout = &plan.layouts[d];
        let mut expected = remote.clone();
        expected.resize(epn, -1);
        if layout.experts_to_copy != expected {
            return fail(
                "I10 experts_to_copy",
                format!("rank {d}: {:?} != {expected:?}", layout.experts_to_copy),
            );
        }
        let mut prev = 0u32;
        for g in 0..2 * epn {
            let count = match plan.expert_of_group(d, g) {
                Some(e) => plan.alloc_at(e, d),
                None => 0,
            };
            let seg = layout.cu_seqlens[g].checked_sub(prev);
            let want = align_up(u64::from(count), cfg.padding) as u32;
            if layout.counts[g] != count || seg != Some(want) {
                return fail(
                    "I6 cu_seqlens",
                    format!(
                        "rank {d} group {g}: count {} segment {seg:?}, want {count}/{want}",
                        layout.counts[g]
                    ),
                );
            }
            if layout.zero_fill[g] != (prev + count, want - count) {
                return fail(
                    "I6 zero_fill",
                    format!("rank {d} group {g}: {:?}", layout.zero_fill[g]),
                );
            }
            prev = layout.cu_seqlens[g];
        }
        if u64::from(prev) > plan.step_slots || plan.step_slots > plan.shard_slots {
            return fail(
                "I6 rows",
                format!(
                    "rank {d}: used {prev}, nvs_s {}, NvS {}",
                    plan.step_slots, plan.shard_slots
                ),
            );
        }
    }
    if plan.rounds.len() > r_n.saturating_sub(1) {
        return fail(
            "I11 rounds",
            format!("{} rounds for R={r_n}", plan.rounds.len()),
        );
    }
    let balanced =
        (0..r_n).all(|h| t_e[h * epn..(h + 1) * epn].iter().sum::<u64>() == cfg.quota(h));
    if balanced && plan.migrated_tokens() != 0 {
        return fail(
            "I12 no migration",
            format!("{} tokens moved although balanced", plan.migrated_tokens()),
        );
    }
    Ok(())
}

/// Checks I7–I9 on the destination slots of every rank (`topk[r]` and `dst[r]` flat).
pub fn verify_entries(
    plan: &GlobalPlan,
    topk: &[Vec<u32>],
    dst: &[Vec<i64>],
) -> Result<(), InvariantViolation> {
    let nvs = plan.shard_slots;
    // owner[d][row] = (source rank, entry) in visiting order, which is (r, i) ascending.
    let mut owner: Vec<Vec<Option<(usize, usize)>>> = (0..plan.ranks)
        .map(|d| vec![None; plan.layouts[d].used_rows() as usize])
        .collect();
    for (r, (row_topk, row_dst)) in topk.iter().zip(dst).enumerate() {
        if row_topk.len() != row_dst.len() {
            return fail(
                "I7 shape",
                format!(
                    "rank {r}: {} entries, {} slots",
                    row_topk.len(),
                    row_dst.len()
                ),
            );
        }
        for (i, (&e, &slot)) in row_topk.iter().zip(row_dst).enumerate() {
            let (d, row) = unpack_slot(slot, nvs);
            let layout = plan.layouts.get(d);
            let Some(layout) = layout.filter(|l| row < u64::from(l.used_rows())) else {
                return fail(
                    "I7 range",
                    format!("rank {r} entry {i}: slot ({d}, {row}) outside used rows"),
                );
            };
            let g = layout.cu_seqlens.partition_point(|&c| u64::from(c) <= row);
            let start = u64::from(layout.group_start(g));
            if row >= start + u64::from(layout.counts[g]) {
                return fail(
                    "I7 padding",
                    format!("rank {r} entry {i}: slot ({d}, {row}) is a padding row"),
                );
            }
            if plan.expert_of_group(d, g) != Some(e as usize) {
                return fail(
                    "I8 expert",
                    format!("rank {r} entry {i}: expert {e} lands in group {g} of rank {d}"),
                );
            }
            let cell = &mut owner[d][row as usize];
            if let Some(prev) = cell {
                return fail(
                    "I7 injective",
                    format!("slot ({d}, {row}) taken by {prev:?} and ({r}, {i})"),
                );
            }
            *cell = Some((r, i));
        }
    }
    for d in 0..plan.ranks {
        let layout = &plan.layouts[d];
        for g in 0..layout.counts.len() {
            let start = layout.group_start(g) as usize;
            let rows = &owner[d][start..start + layout.counts[g] as usize];
            if rows.iter().any(Option::is_none) {
                return fail(
                    "I7 surjective",
                    format!("rank {d} group {g} has an unfilled real row"),
                );
            }
            if rows.windows(2).any(|w| w[0] >= w[1]) {
                return fail(
                    "I9 order",
                    format!("rank {d} group {g} not ordered by (source, entry)"),
                );
            }
        }
    }
    Ok(())
}
