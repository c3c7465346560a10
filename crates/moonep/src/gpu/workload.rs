//! Seeded host-side workloads for the GPU checks: routings (random and extreme), `tpe`, bf16
//! rows and f32 weights, identical on every rank for the same seed.

use half::bf16;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

/// Routing shapes exercised by the tests and the benchmark.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Routing {
    /// K distinct uniform experts per token.
    Random,
    /// Every entry to expert 0 (repeats inside a token).
    OneExpert,
    /// Only even experts are used (half the experts empty).
    HalfEmpty,
    /// A share `f` of the entries goes to home group 0 (rank-level skew), distinct per token.
    Clustered(f64),
    /// Uniform with repeats allowed inside a token.
    Duplicates,
}

/// Per-rank `topk` (flat `[s*K]`) for `routing`; identical on every rank for the same seed.
pub fn make_topk(
    routing: Routing,
    ranks: usize,
    experts: usize,
    k: usize,
    s: usize,
    seed: u64,
) -> Vec<Vec<i32>> {
    let epn = experts / ranks;
    (0..ranks)
        .map(|r| {
            let mut rng = StdRng::seed_from_u64(seed.wrapping_mul(7919).wrapping_add(r as u64));
            let mut out = Vec::with_capacity(s * k);
            let n0_total = match routing {
                Routing::Clustered(f) => ((s * k) as f64 * f).round() as usize,
                _ => 0,
            };
            for t in 0..s {
                match routing {
                    Routing::Random => out.extend(distinct(&mut rng, 0, experts, k)),
                    Routing::OneExpert => out.extend(std::iter::repeat_n(0, k)),
                    Routing::HalfEmpty => out.extend(
                        distinct(&mut rng, 0, experts.div_ceil(2), k)
                            .into_iter()
                            .map(|e| 2 * e),
                    ),
                    Routing::Duplicates => {
                        out.extend((0..k).map(|_| rng.random_range(0..experts as i32)))
                    }
                    Routing::Clustered(_) => {
                        // Token t gets n0 entries in group 0 so that the total is exact.
                        let n0 = (n0_total * (t + 1)) / s - (n0_total * t) / s;
                        let n0 = n0.min(epn).min(k);
                        let rest = k - n0;
                        let mut v = distinct(&mut rng, 0, epn, n0);
                        if experts > epn {
                            v.extend(distinct(&mut rng, epn, experts, rest));
                        } else {
                            v.extend(distinct(&mut rng, 0, epn, rest));
                        }
                        v.shuffle(&mut rng);
                        out.extend(v);
                    }
                }
            }
            out
        })
        .collect()
}

fn distinct(rng: &mut StdRng, lo: usize, hi: usize, k: usize) -> Vec<i32> {
    let n = hi - lo;
    if k <= n {
        rand::seq::index::sample(rng, n, k)
            .into_iter()
            .map(|x| (lo + x) as i32)
            .collect()
    } else {
        (0..k)
            .map(|_| (lo + rng.random_range(0..n)) as i32)
            .collect()
    }
}

/// `tpe[e]` of one rank's `topk`.
pub fn tpe_of(topk: &[i32], experts: usize) -> Vec<i32> {
    let mut t = vec![0i32; experts];
    for &e in topk {
        t[e as usize] += 1;
    }
    t
}

/// Seeded bf16 rows `[rows, h]` (as bits).
pub fn random_bf16(rows: usize, h: usize, seed: u64) -> Vec<u16> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..rows * h)
        .map(|_| bf16::from_f32(rng.random_range(-2.0f32..2.0)).to_bits())
        .collect()
}

pub fn random_f32(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..n).map(|_| rng.random_range(0.0f32..1.0)).collect()
}
