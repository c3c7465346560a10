//! Workload generators (docs/specs/moonep.md §6.2): seeded routings with a controlled skew.
//!
//! The exact generator turns popularity weights into integer global counts `T_e` (capped at
//! `T = Σ s_r` and water-filled), deals them over source ranks (row sums `s_r*K`), and builds
//! each rank's `topk` so that every token gets distinct experts whenever `tpe[r][e] <= s_r`.
//! [`sample_lognormal`] is the upstream-compatible per-token sampler.

mod counts;

pub use counts::{integerise, maxvio, split_over_ranks};

use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng, rngs::StdRng};
use rand_distr::{Distribution, Normal};

use crate::plan::{PlanConfig, TokenMode};

/// Where the most popular experts live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// Hot experts fill home group 0 first: worst rank imbalance.
    Clustered,
    /// Seeded random permutation.
    Random,
    /// Round robin over ranks: best case.
    Spread,
}

/// Kind of routing skew.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Skew {
    /// Equal popularity.
    Uniform,
    /// `p ∝ (rank+1)^−α` with α bisected to hit `maxvio` (attainable up to `E/K − 1`).
    Zipf { maxvio: f64 },
    /// Popularity `exp(N(0, σ))`, integerised like Zipf.
    Lognormal { sigma: f64 },
    /// One expert gets every token it can.
    SingleHotExpert,
    /// All experts of one home group are hot.
    HotHomeGroup,
    /// Source rank 0 sends every token to the same K experts; others are uniform.
    HotSourceRank,
    /// Half the experts get nothing.
    HalfExpertsEmpty,
    /// Every home group gets exactly its quota, but skewed inside the group (must not migrate).
    IntraGroupSkew,
    /// `share` of all copies go to rank 0's home experts, the rest uniform (EP=2 anchors).
    RankShare { share: f64 },
}

/// What to generate.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkloadSpec {
    pub experts: usize,
    pub top_k: usize,
    /// `s_r` per source rank (its length is R).
    pub tokens: Vec<u32>,
    pub skew: Skew,
    pub placement: Placement,
    pub seed: u64,
}

/// Errors of the generators.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RouterError {
    #[error("invalid workload: {reason}")]
    Invalid { reason: String },
}

/// Routing counts of one step: `tpe[r*E + e]` with `Σ_e tpe[r][e] = s_r*K`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Routing {
    pub ranks: usize,
    pub experts: usize,
    pub top_k: usize,
    pub tokens: Vec<u32>,
    pub tpe: Vec<u32>,
}

impl Routing {
    /// Counts of given per-rank `topk` rows (each `s_r*K` expert ids).
    pub fn from_topk(experts: usize, top_k: usize, topk: &[Vec<u32>]) -> Routing {
        let mut tpe = vec![0u32; topk.len() * experts];
        for (r, row) in topk.iter().enumerate() {
            for &e in row {
                tpe[r * experts + e as usize] += 1;
            }
        }
        let tokens = topk.iter().map(|row| (row.len() / top_k) as u32).collect();
        Routing {
            ranks: topk.len(),
            experts,
            top_k,
            tokens,
            tpe,
        }
    }

    /// Global tokens per expert, `T_e`.
    pub fn expert_tokens(&self) -> Vec<u64> {
        let mut t = vec![0u64; self.experts];
        for row in self.tpe.chunks_exact(self.experts) {
            for (acc, &x) in t.iter_mut().zip(row) {
                *acc += u64::from(x);
            }
        }
        t
    }

    /// Expert-level `maxvio`.
    pub fn maxvio(&self) -> f64 {
        maxvio(&self.expert_tokens())
    }

    /// Home-group loads `G_h`.
    pub fn group_loads(&self) -> Vec<u64> {
        let epn = self.experts / self.ranks;
        self.expert_tokens()
            .chunks_exact(epn)
            .map(|c| c.iter().sum())
            .collect()
    }

    /// Rank-level imbalance `max_h G_h / mean` (what sets a dropless baseline's time).
    pub fn rank_imbalance(&self) -> f64 {
        let g = self.group_loads();
        let mean = g.iter().sum::<u64>() as f64 / g.len() as f64;
        if mean == 0.0 {
            1.0
        } else {
            *g.iter().max().unwrap_or(&0) as f64 / mean
        }
    }

    /// Planner config for this routing: uniform when all `s_r` agree, else per-rank.
    pub fn plan_config(&self, capacity_s: u32, padding: u32) -> PlanConfig {
        let uniform = self.tokens.iter().all(|&s| s == self.tokens[0]);
        let mode = if uniform {
            TokenMode::Uniform { s: self.tokens[0] }
        } else {
            TokenMode::PerRank {
                total_tokens: self.tokens.iter().map(|&s| u64::from(s)).sum(),
            }
        };
        PlanConfig {
            ranks: self.ranks as u32,
            experts: self.experts as u32,
            top_k: self.top_k as u32,
            capacity_s,
            padding,
            mode,
        }
    }

    /// Builds rank `r`'s flat `topk[s*K]` from its counts: expert ids listed with their counts,
    /// item `p` at token `p mod s`, slot `p div s`, then tokens shuffled with `seed`.
    pub fn topk(&self, rank: usize, seed: u64) -> Vec<u32> {
        let s = self.tokens[rank] as usize;
        let k = self.top_k;
        let row = &self.tpe[rank * self.experts..(rank + 1) * self.experts];
        let mut topk = vec![0u32; s * k];
        let mut p = 0usize;
        for (e, &c) in row.iter().enumerate() {
            for _ in 0..c {
                topk[(p % s) * k + p / s] = e as u32;
                p += 1;
            }
        }
        let mut order: Vec<usize> = (0..s).collect();
        order.shuffle(&mut StdRng::seed_from_u64(
            seed ^ (rank as u64).wrapping_mul(0x9E37),
        ));
        order
            .iter()
            .flat_map(|&t| topk[t * k..(t + 1) * k].to_vec())
            .collect()
    }
}

/// Maps popularity rank `j` (0 = hottest) to an expert id.
pub fn placement_map(placement: Placement, experts: usize, ranks: usize, seed: u64) -> Vec<usize> {
    let epn = experts / ranks;
    match placement {
        Placement::Clustered => (0..experts).collect(),
        Placement::Spread => (0..experts)
            .map(|j| (j % ranks) * epn + j / ranks)
            .collect(),
        Placement::Random => {
            let mut p: Vec<usize> = (0..experts).collect();
            p.shuffle(&mut StdRng::seed_from_u64(seed.wrapping_add(0x5EED)));
            p
        }
    }
}

/// Generates a routing with the exact generator.
pub fn generate(spec: &WorkloadSpec) -> Result<Routing, RouterError> {
    let r_n = spec.tokens.len();
    let (e_n, k) = (spec.experts, spec.top_k);
    let bad = |reason: String| Err(RouterError::Invalid { reason });
    if r_n == 0 || e_n == 0 || k == 0 || e_n % r_n != 0 {
        return bad(format!(
            "need R >= 1, K >= 1 and E % R == 0 (R={r_n}, E={e_n}, K={k})"
        ));
    }
    if spec.tokens.contains(&0) {
        return bad("every rank needs s >= 1".into());
    }
    let epn = e_n / r_n;
    let t: u64 = spec.tokens.iter().map(|&s| u64::from(s)).sum();
    let total = t * k as u64;
    // A token can hit an expert at most once when K <= E.
    let cap = if k <= e_n { t } else { total };
    let map = placement_map(spec.placement, e_n, r_n, spec.seed);
    let place = |by_rank: Vec<u64>| {
        let mut c = vec![0u64; e_n];
        for (j, x) in by_rank.into_iter().enumerate() {
            c[map[j]] = x;
        }
        c
    };
    let weighted = |w: Vec<f64>| place(integerise(&w, total, cap));
    let counts = match spec.skew {
        Skew::Uniform => weighted(vec![1.0; e_n]),
        Skew::Zipf { maxvio: target } => place(zipf_counts(e_n, total, cap, target)),
        Skew::Lognormal { sigma } => weighted(lognormal_weights(e_n, sigma, spec.seed)),
        Skew::SingleHotExpert => {
            weighted((0..e_n).map(|j| if j == 0 { 1e12 } else { 1.0 }).collect())
        }
        Skew::HotHomeGroup => weighted((0..e_n).map(|j| if j < epn { 1e6 } else { 1.0 }).collect()),
        Skew::HalfExpertsEmpty => weighted(
            (0..e_n)
                .map(|j| if j < e_n.div_ceil(2) { 1.0 } else { 0.0 })
                .collect(),
        ),
        Skew::IntraGroupSkew => intra_group_counts(spec, epn, cap),
        Skew::RankShare { share } => {
            if !(0.0..=1.0).contains(&share) {
                return bad(format!("share {share} outside [0, 1]"));
            }
            rank_share_counts(e_n, epn, total, cap, share)
        }
        Skew::HotSourceRank => return Ok(hot_source_rank(spec)),
    };
    let tpe = split_over_ranks(&counts, &spec.tokens, k);
    Ok(Routing {
        ranks: r_n,
        experts: e_n,
        top_k: k,
        tokens: spec.tokens.clone(),
        tpe,
    })
}

/// Zipf counts with α bisected so that the integerised maxvio is closest to `target`.
fn zipf_counts(e_n: usize, total: u64, cap: u64, target: f64) -> Vec<u64> {
    let counts_for = |alpha: f64| {
        let w: Vec<f64> = (0..e_n).map(|j| ((j + 1) as f64).powf(-alpha)).collect();
        integerise(&w, total, cap)
    };
    let (mut lo, mut hi) = (0.0f64, 64.0f64);
    let mut best = counts_for(0.0);
    let mut best_err = (maxvio(&best) - target).abs();
    for _ in 0..60 {
        let mid = 0.5 * (lo + hi);
        let c = counts_for(mid);
        let v = maxvio(&c);
        let err = (v - target).abs();
        if err < best_err {
            best_err = err;
            best = c;
        }
        if v < target {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    best
}

/// Lognormal popularity `exp(N(0, σ))`, sorted hottest first.
pub fn lognormal_weights(e_n: usize, sigma: f64, seed: u64) -> Vec<f64> {
    let mut rng = StdRng::seed_from_u64(seed);
    let normal =
        Normal::new(0.0, sigma.max(0.0)).unwrap_or_else(|_| Normal::new(0.0, 0.0).unwrap());
    let mut w: Vec<f64> = (0..e_n).map(|_| normal.sample(&mut rng).exp()).collect();
    w.sort_by(|a, b| b.total_cmp(a));
    w
}

/// Groups get exactly their quota; inside a group the weights fall off as `(g+1)^−2`.
fn intra_group_counts(spec: &WorkloadSpec, epn: usize, cap: u64) -> Vec<u64> {
    let r_n = spec.tokens.len();
    let t: u64 = spec.tokens.iter().map(|&s| u64::from(s)).sum();
    let tk = t * spec.top_k as u64;
    let w: Vec<f64> = (0..epn).map(|g| ((g + 1) as f64).powi(-2)).collect();
    (0..r_n)
        .flat_map(|h| {
            let quota = tk / r_n as u64 + u64::from((h as u64) < tk % r_n as u64);
            integerise(&w, quota, cap)
        })
        .collect()
}

/// `share` of the copies on home group 0, the rest spread evenly over the other experts.
fn rank_share_counts(e_n: usize, epn: usize, total: u64, cap: u64, share: f64) -> Vec<u64> {
    if e_n == epn {
        return integerise(&vec![1.0; e_n], total, cap);
    }
    let hot = ((share * total as f64).round() as u64).min(epn as u64 * cap);
    let mut c = integerise(&vec![1.0; epn], hot, cap);
    c.extend(integerise(&vec![1.0; e_n - epn], total - hot, cap));
    c
}

/// Rank 0 routes every token to experts `0..K` (mod E); the others are uniform.
fn hot_source_rank(spec: &WorkloadSpec) -> Routing {
    let (e_n, k) = (spec.experts, spec.top_k);
    let mut tpe = Vec::with_capacity(spec.tokens.len() * e_n);
    for (r, &s) in spec.tokens.iter().enumerate() {
        let s = u64::from(s);
        let row: Vec<u64> = if r == 0 {
            let mut row = vec![0u64; e_n];
            for j in 0..k {
                row[j % e_n] += s;
            }
            row
        } else {
            let cap = if k <= e_n { s } else { s * k as u64 };
            let mut row = integerise(&vec![1.0; e_n], s * k as u64, cap);
            row.rotate_right(r % e_n);
            row
        };
        tpe.extend(row.into_iter().map(|x| x as u32));
    }
    Routing {
        ranks: spec.tokens.len(),
        experts: e_n,
        top_k: k,
        tokens: spec.tokens.clone(),
        tpe,
    }
}

/// Upstream-compatible sampler: logits `exp(N(0, σ))` shared by all ranks (placed by
/// `placement`), each token picks K distinct experts by weighted sampling without replacement
/// (Gumbel top-k). Returns the counts and every rank's flat `topk`.
pub fn sample_lognormal(spec: &WorkloadSpec, sigma: f64) -> (Routing, Vec<Vec<u32>>) {
    let (e_n, k, r_n) = (
        spec.experts,
        spec.top_k.min(spec.experts),
        spec.tokens.len(),
    );
    let map = placement_map(spec.placement, e_n, r_n, spec.seed);
    let by_rank = lognormal_weights(e_n, sigma, spec.seed);
    let mut log_w = vec![0f64; e_n];
    for (j, w) in by_rank.iter().enumerate() {
        log_w[map[j]] = w.ln();
    }
    let mut rng = StdRng::seed_from_u64(spec.seed.wrapping_add(1));
    let mut keys: Vec<(f64, u32)> = Vec::with_capacity(e_n);
    let topk: Vec<Vec<u32>> = spec
        .tokens
        .iter()
        .map(|&s| {
            let mut row = Vec::with_capacity(s as usize * spec.top_k);
            for _ in 0..s {
                keys.clear();
                for (e, lw) in log_w.iter().enumerate() {
                    let u: f64 = rng.random_range(f64::MIN_POSITIVE..1.0);
                    keys.push((lw - (-u.ln()).ln(), e as u32));
                }
                keys.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
                row.extend(keys.iter().take(k).map(|&(_, e)| e));
                // K > E: repeat the top choices (repeated experts are legal).
                row.extend((k..spec.top_k).map(|j| keys[j % k].1));
            }
            row
        })
        .collect();
    (Routing::from_topk(e_n, spec.top_k, &topk), topk)
}

/// [`sample_lognormal`] with σ bisected on a log scale (fixed seeds) so that the sampled maxvio
/// is closest to `target`. Returns the routing, every rank's `topk` and the σ used.
pub fn sample_lognormal_for_maxvio(
    spec: &WorkloadSpec,
    target: f64,
) -> (Routing, Vec<Vec<u32>>, f64) {
    let (mut lo, mut hi) = (1e-3f64.ln(), 4f64.ln());
    let mut best = (f64::INFINITY, 1e-3);
    for _ in 0..24 {
        let mid = 0.5 * (lo + hi);
        let v = sample_lognormal(spec, mid.exp()).0.maxvio();
        if (v - target).abs() < best.0 {
            best = ((v - target).abs(), mid.exp());
        }
        if v < target {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    let (routing, topk) = sample_lognormal(spec, best.1);
    (routing, topk, best.1)
}
