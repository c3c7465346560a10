//! Stage D: destination slot of every entry of one source rank.

use super::{GlobalPlan, PlanConfig, PlanError};

/// Packs `(rank, row)` as `rank*NvS + row`.
pub fn pack_slot(rank: usize, row: u64, shard_slots: u64) -> i64 {
    (rank as u64 * shard_slots + row) as i64
}

/// Splits a packed slot into `(rank, row)`.
pub fn unpack_slot(slot: i64, shard_slots: u64) -> (usize, u64) {
    let s = slot as u64;
    ((s / shard_slots) as usize, s % shard_slots)
}

/// Runs stage D for source rank `rank`: `topk` is its flat `[s_r*K]` expert ids (entry
/// `i = t*K + k`). Returns `dst[i]` packed with [`pack_slot`].
///
/// Checks that `topk` has `s_r*K` entries, ids `< E`, and the same histogram as `tpe[rank]`.
pub fn plan_entries(
    cfg: &PlanConfig,
    plan: &GlobalPlan,
    rank: usize,
    topk: &[u32],
) -> Result<Vec<i64>, PlanError> {
    let (r_n, e_n) = (plan.ranks, plan.experts);
    if cfg.ranks as usize != r_n || cfg.experts as usize != e_n {
        return Err(PlanError::PlanMismatch {
            ranks: r_n,
            experts: e_n,
        });
    }
    if rank >= r_n {
        return Err(PlanError::RankOutOfRange { rank, ranks: r_n });
    }
    let expected = plan.tokens_per_rank[rank] as usize * cfg.top_k as usize;
    if topk.len() != expected {
        return Err(PlanError::TopkLength {
            rank,
            got: topk.len(),
            expected,
        });
    }
    // Stable ordinal of each entry among the same expert's entries (counting pass).
    let mut seen = vec![0u32; e_n];
    let mut ordinal = Vec::with_capacity(topk.len());
    for (entry, &e) in topk.iter().enumerate() {
        let ei = e as usize;
        if ei >= e_n {
            return Err(PlanError::ExpertOutOfRange {
                rank,
                entry,
                expert: e,
                experts: e_n,
            });
        }
        ordinal.push(seen[ei]);
        seen[ei] += 1;
    }
    for (expert, &counted) in seen.iter().enumerate() {
        let expected = plan.src_offset.get((rank + 1) * e_n + expert).map_or_else(
            || plan.expert_tokens[expert] - u64::from(plan.src_offset[rank * e_n + expert]),
            |&next| u64::from(next - plan.src_offset[rank * e_n + expert]),
        );
        if u64::from(counted) != expected {
            return Err(PlanError::TopkHistogram {
                rank,
                expert,
                counted: counted.into(),
                expected,
            });
        }
    }
    let nvs = plan.shard_slots;
    let mut dst = Vec::with_capacity(topk.len());
    for (&e, &j) in topk.iter().zip(&ordinal) {
        let e = e as usize;
        let g = plan.src_offset[rank * e_n + e] + j;
        let cum = &plan.alloc_cum[e * r_n..(e + 1) * r_n];
        // First d with cum[d] > g.
        let d = cum.partition_point(|&c| c <= g);
        let before = if d == 0 { 0 } else { cum[d - 1] };
        let group = plan.group_of(d, e).ok_or_else(|| PlanError::Internal {
            what: format!("expert {e} has tokens on rank {d} but no group there"),
        })?;
        let off = u64::from(plan.layouts[d].group_start(group));
        dst.push(pack_slot(d, off + u64::from(g - before), nvs));
    }
    Ok(dst)
}
