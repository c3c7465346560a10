//! Stages A–C: rank quotas, expert split per donor, per-rank layouts.

use super::{GlobalPlan, PlanConfig, PlanError, RankLayout, TokenMode, Transfer, align_up};

/// Runs stages A–C on the gathered `tpe` (row-major `[R*E]`, `tpe[r*E + e]`).
///
/// Validates the contract first: `Σ_e tpe[r][e] == s*K` per rank in uniform mode; in per-rank
/// mode each row sum is a multiple of K with `1 <= s_r <= S` and `Σ_r s_r == T`.
pub fn plan_global(cfg: &PlanConfig, tpe: &[u32]) -> Result<GlobalPlan, PlanError> {
    cfg.validate()?;
    let r_n = cfg.ranks as usize;
    let e_n = cfg.experts as usize;
    let epn = cfg.experts_per_rank();
    if tpe.len() != r_n * e_n {
        return Err(PlanError::TpeLength {
            got: tpe.len(),
            expected: r_n * e_n,
        });
    }
    let tokens_per_rank = check_contract(cfg, tpe)?;

    let quota: Vec<u64> = (0..r_n).map(|d| cfg.quota(d)).collect();
    let mut expert_tokens = vec![0u64; e_n];
    let mut src_offset = vec![0u32; r_n * e_n];
    for r in 0..r_n {
        for e in 0..e_n {
            src_offset[r * e_n + e] = expert_tokens[e] as u32;
            expert_tokens[e] += u64::from(tpe[r * e_n + e]);
        }
    }

    let rounds = stage_a(&expert_tokens, &quota, epn);
    let alloc = stage_b(&expert_tokens, &rounds, r_n, epn)?;
    let mut alloc_cum = vec![0u32; e_n * r_n];
    for e in 0..e_n {
        let mut acc = 0u32;
        for d in 0..r_n {
            acc += alloc[e * r_n + d];
            alloc_cum[e * r_n + d] = acc;
        }
    }
    // Remote experts on d can only come from the single donor that filled d in stage A.
    let mut donor_of = vec![None; r_n];
    for t in &rounds {
        donor_of[t.receiver as usize] = Some(t.donor as usize);
    }
    let layouts = (0..r_n)
        .map(|d| stage_c(&alloc, d, donor_of[d], r_n, epn, cfg.padding))
        .collect();

    Ok(GlobalPlan {
        ranks: r_n,
        experts: e_n,
        experts_per_rank: epn,
        shard_slots: cfg.shard_slots(),
        step_slots: cfg.step_slots(),
        tokens_per_rank,
        quota,
        expert_tokens,
        alloc,
        alloc_cum,
        src_offset,
        rounds,
        layouts,
    })
}

/// Returns `s_r` per rank after checking the row sums against the token mode.
fn check_contract(cfg: &PlanConfig, tpe: &[u32]) -> Result<Vec<u32>, PlanError> {
    let e_n = cfg.experts as usize;
    let k = u64::from(cfg.top_k);
    let mut tokens = Vec::with_capacity(cfg.ranks as usize);
    for (rank, row) in tpe.chunks_exact(e_n).enumerate() {
        let sum: u64 = row.iter().map(|&x| u64::from(x)).sum();
        match cfg.mode {
            TokenMode::Uniform { s } => {
                let expected = u64::from(s) * k;
                if sum != expected {
                    return Err(PlanError::RankTokens {
                        rank,
                        sum,
                        expected,
                    });
                }
                tokens.push(s);
            }
            TokenMode::PerRank { .. } => {
                if !sum.is_multiple_of(k) {
                    return Err(PlanError::NotMultipleOfK {
                        rank,
                        sum,
                        top_k: cfg.top_k,
                    });
                }
                let s_r = sum / k;
                if s_r == 0 || s_r > u64::from(cfg.capacity_s) {
                    return Err(PlanError::RankTokensOutOfRange {
                        rank,
                        tokens: s_r,
                        capacity: cfg.capacity_s,
                    });
                }
                tokens.push(s_r as u32);
            }
        }
    }
    let sum: u64 = tokens.iter().map(|&s| u64::from(s)).sum();
    if sum != cfg.total_tokens() {
        return Err(PlanError::TotalMismatch {
            sum,
            total: cfg.total_tokens(),
        });
    }
    Ok(tokens)
}

/// Index of the first maximum (ties → lowest index).
fn argmax<T: Copy + PartialOrd>(xs: &[T]) -> usize {
    let mut best = 0;
    for (i, &x) in xs.iter().enumerate().skip(1) {
        if x > xs[best] {
            best = i;
        }
    }
    best
}

/// Index of the first minimum (ties → lowest index).
fn argmin<T: Copy + PartialOrd>(xs: &[T]) -> usize {
    let mut best = 0;
    for (i, &x) in xs.iter().enumerate().skip(1) {
        if x < xs[best] {
            best = i;
        }
    }
    best
}

/// Stage A: each round fills the most negative rank from the most positive one.
fn stage_a(expert_tokens: &[u64], quota: &[u64], epn: usize) -> Vec<Transfer> {
    let mut bal: Vec<i64> = quota
        .iter()
        .enumerate()
        .map(|(h, &cap)| {
            let g: u64 = expert_tokens[h * epn..(h + 1) * epn].iter().sum();
            g as i64 - cap as i64
        })
        .collect();
    let mut rounds = Vec::new();
    loop {
        let h = argmax(&bal);
        if bal[h] <= 0 {
            break;
        }
        let u = argmin(&bal);
        let m = -bal[u];
        rounds.push(Transfer {
            donor: h as u32,
            receiver: u as u32,
            tokens: m as u64,
        });
        bal[h] -= m;
        bal[u] = 0;
    }
    rounds
}

/// Stage B: per donor (ascending), largest remaining expert goes to the largest remaining quota.
fn stage_b(
    expert_tokens: &[u64],
    rounds: &[Transfer],
    r_n: usize,
    epn: usize,
) -> Result<Vec<u32>, PlanError> {
    let e_n = expert_tokens.len();
    let mut alloc = vec![0u32; e_n * r_n];
    for (e, &t) in expert_tokens.iter().enumerate() {
        alloc[e * r_n + e / epn] = t as u32;
    }
    let mut q = vec![0u64; r_n];
    let mut rem = vec![0u64; epn];
    for h in 0..r_n {
        q.fill(0);
        let mut sends = false;
        for t in rounds.iter().filter(|t| t.donor as usize == h) {
            q[t.receiver as usize] += t.tokens;
            sends = true;
        }
        if !sends {
            continue;
        }
        rem.copy_from_slice(&expert_tokens[h * epn..(h + 1) * epn]);
        loop {
            let d = argmax(&q);
            if q[d] == 0 {
                break;
            }
            let le = argmax(&rem);
            if rem[le] == 0 {
                return Err(PlanError::Internal {
                    what: format!(
                        "donor {h} ran out of tokens with {} still owed to {d}",
                        q[d]
                    ),
                });
            }
            let take = rem[le].min(q[d]);
            let e = h * epn + le;
            alloc[e * r_n + h] -= take as u32;
            alloc[e * r_n + d] += take as u32;
            rem[le] -= take;
            q[d] -= take;
        }
    }
    Ok(alloc)
}

/// Stage C: layout of rank `d` (home groups, then remote experts in ascending id; they all
/// belong to `donor`, the rank that filled `d` in stage A).
fn stage_c(
    alloc: &[u32],
    d: usize,
    donor: Option<usize>,
    r_n: usize,
    epn: usize,
    padding: u32,
) -> RankLayout {
    let mut experts_to_copy = vec![-1i32; epn];
    let mut counts = vec![0u32; 2 * epn];
    for g in 0..epn {
        counts[g] = alloc[(d * epn + g) * r_n + d];
    }
    let donor_experts = donor.map_or(0..0, |h| h * epn..(h + 1) * epn);
    let remote = donor_experts.filter(|&e| alloc[e * r_n + d] > 0);
    for (b, e) in remote.enumerate() {
        experts_to_copy[b] = e as i32;
        counts[epn + b] = alloc[e * r_n + d];
    }
    let mut cu_seqlens = vec![0u32; 2 * epn];
    let mut zero_fill = vec![(0u32, 0u32); 2 * epn];
    let mut end = 0u32;
    for g in 0..2 * epn {
        let padded = align_up(u64::from(counts[g]), padding) as u32;
        zero_fill[g] = (end + counts[g], padded - counts[g]);
        end += padded;
        cu_seqlens[g] = end;
    }
    RankLayout {
        experts_to_copy,
        counts,
        cu_seqlens,
        zero_fill,
    }
}
