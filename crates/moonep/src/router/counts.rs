//! Integer global expert counts from popularity weights, and their split over source ranks.

/// Turns `weights` into integer counts summing to `total`, each `<= cap` (water-filling the
/// excess of capped experts onto the rest; zero-weight experts take load only when every
/// positive one is full). Largest remainder rounding, ties to the lowest index.
pub fn integerise(weights: &[f64], total: u64, cap: u64) -> Vec<u64> {
    let n = weights.len();
    let mut fixed = vec![false; n];
    let mut frac = vec![0f64; n];
    let mut remaining = total as f64;
    let mut use_zero = false;
    loop {
        let active: Vec<usize> = (0..n)
            .filter(|&e| !fixed[e] && (use_zero || weights[e] > 0.0))
            .collect();
        if active.is_empty() {
            if use_zero || remaining <= 0.0 {
                break;
            }
            use_zero = true;
            continue;
        }
        let w = |e: usize| {
            if use_zero && weights[e] <= 0.0 {
                1.0
            } else {
                weights[e]
            }
        };
        let sum: f64 = active.iter().map(|&e| w(e)).sum();
        let mut capped = false;
        for &e in &active {
            frac[e] = remaining * w(e) / sum;
            if frac[e] > cap as f64 {
                capped = true;
            }
        }
        if !capped {
            break;
        }
        for &e in &active {
            if frac[e] >= cap as f64 {
                fixed[e] = true;
                frac[e] = cap as f64;
                remaining -= cap as f64;
            }
        }
        if remaining <= 0.0 {
            for &e in &active {
                if !fixed[e] {
                    frac[e] = 0.0;
                }
            }
            break;
        }
    }
    let mut counts: Vec<u64> = frac
        .iter()
        .map(|&f| (f.max(0.0).floor() as u64).min(cap))
        .collect();
    let mut short = total.saturating_sub(counts.iter().sum());
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&a, &b| {
        let ra = frac[a] - frac[a].floor();
        let rb = frac[b] - frac[b].floor();
        rb.total_cmp(&ra).then(a.cmp(&b))
    });
    // Float drift can leave a few entries short; hand them out round by round.
    while short > 0 {
        let before = short;
        for &e in &order {
            if short == 0 {
                break;
            }
            if counts[e] < cap {
                counts[e] += 1;
                short -= 1;
            }
        }
        if short == before {
            break;
        }
    }
    counts
}

/// `maxvio = max_e T_e / mean_e T_e − 1` (0 when there are no tokens).
pub fn maxvio(counts: &[u64]) -> f64 {
    let sum: u64 = counts.iter().sum();
    if sum == 0 {
        return 0.0;
    }
    let mean = sum as f64 / counts.len() as f64;
    *counts.iter().max().unwrap_or(&0) as f64 / mean - 1.0
}

/// Splits global counts over source ranks with row sums `tokens[r]*K`. Entries listed expert by
/// expert are dealt to ranks in an even interleaving (round robin when all `s_r` are equal), so
/// each `tpe[r][e]` is within one of its proportional share.
pub fn split_over_ranks(counts: &[u64], tokens: &[u32], top_k: usize) -> Vec<u32> {
    let r_n = tokens.len();
    let e_n = counts.len();
    let mut tpe = vec![0u32; r_n * e_n];
    if tokens.iter().all(|&s| s == tokens[0]) {
        let r = r_n as u64;
        let mut start = 0u64;
        for (e, &c) in counts.iter().enumerate() {
            for rank in 0..r_n {
                // Positions p in [start, start+c) with p mod R == rank.
                let first = start + ((rank as u64 + r - start % r) % r);
                let n = if first >= start + c {
                    0
                } else {
                    (start + c - 1 - first) / r + 1
                };
                tpe[rank * e_n + e] = n as u32;
            }
            start += c;
        }
        return tpe;
    }
    // Even interleaving of ranks by key (j + 0.5) / q_r.
    let mut seq: Vec<(f64, u32)> = Vec::new();
    for (rank, &s) in tokens.iter().enumerate() {
        let q = u64::from(s) * top_k as u64;
        seq.extend((0..q).map(|j| ((j as f64 + 0.5) / q as f64, rank as u32)));
    }
    seq.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    let mut p = 0usize;
    for (e, &c) in counts.iter().enumerate() {
        for &(_, rank) in &seq[p..p + c as usize] {
            tpe[rank as usize * e_n + e] += 1;
        }
        p += c as usize;
    }
    tpe
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integerise_respects_total_and_cap() {
        let c = integerise(&[100.0, 1.0, 1.0, 0.0], 40, 16);
        assert_eq!(c.iter().sum::<u64>(), 40);
        assert_eq!(c[0], 16);
        assert_eq!(c[1], 12);
        assert_eq!(c[3], 0);
        let c = integerise(&[1.0, 0.0, 0.0, 0.0], 20, 8);
        assert_eq!(c.iter().sum::<u64>(), 20);
        assert!(c.iter().all(|&x| x <= 8));
    }

    #[test]
    fn split_keeps_row_sums() {
        let counts = [7u64, 0, 5, 12];
        let tpe = split_over_ranks(&counts, &[3, 3], 4);
        assert_eq!(tpe[..4].iter().sum::<u32>(), 12);
        assert_eq!(tpe[4..].iter().sum::<u32>(), 12);
        let tpe = split_over_ranks(&counts, &[1, 5], 4);
        assert_eq!(tpe[..4].iter().sum::<u32>(), 4);
        assert_eq!(tpe[4..].iter().sum::<u32>(), 20);
        for e in 0..4 {
            assert_eq!(u64::from(tpe[e] + tpe[4 + e]), counts[e]);
        }
    }
}
