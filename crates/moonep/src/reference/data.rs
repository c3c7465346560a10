//! Seeded test data for the reference cluster and the GPU tests.

use half::bf16;
use rand::{Rng, SeedableRng, rngs::StdRng};
use rand_distr::{Distribution, StandardNormal};

/// `[s*H]` bf16 tokens drawn from N(0, 1).
pub fn random_tokens(tokens: usize, hidden: usize, seed: u64) -> Vec<bf16> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..tokens * hidden)
        .map(|_| bf16::from_f32(StandardNormal.sample(&mut rng)))
        .collect()
}

/// `[s*K]` router weights in `(0, 1)`.
pub fn random_router_weights(entries: usize, seed: u64) -> Vec<f32> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..entries)
        .map(|_| rng.random_range(0.01f32..1.0))
        .collect()
}

/// `[n]` dyadic values `k/2`, `|k| <= 2` (exact in bf16, sums exact in f32/f64).
pub fn dyadic_tokens(n: usize, seed: u64) -> Vec<bf16> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..n)
        .map(|_| bf16::from_f32(rng.random_range(-2i32..=2) as f32 / 2.0))
        .collect()
}

/// `[n]` dyadic router weights `k/4`, `k in 1..=4`.
pub fn dyadic_router_weights(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..n)
        .map(|_| rng.random_range(1i32..=4) as f32 / 4.0)
        .collect()
}
