//! CPU references for the KDA forward (`docs/specs/kda.md §1`): the float64 token recurrence (the
//! definition, `docs/specs/kda.md §1.3`), the float64 chunked form (`docs/specs/kda.md §1.4`) and [`emulated`], which rounds where the
//! sm_90a kernel rounds so GPU results compare at tight tolerances.
//!
//! All tensors are token-major like the device API: `q/k/v/g` are `[T, H, D]` with the
//! sequences packed back to back, `beta` is `[T, H]`, states are `[N, H, V=D, K=D]` with
//! row = value channel, `D` = [`KdaProblem::head_dim`] (64 or 128; the backward references take 128
//! only).

// Index loops mirror the math (and the kernel) more readably than iterator chains.
#![allow(clippy::needless_range_loop)]

mod backward;
mod chunked;
pub mod chunked64;
mod chunked_grad;
pub mod emulated;
pub mod emulated64;
pub mod metrics;
mod segmented;

pub use backward::{KdaGrads, recurrence_grad_f64};
pub use chunked::chunked_f64;
pub use chunked_grad::chunked_grad_f64;
pub use chunked64::chunked_sub_f64;
pub use segmented::segmented_f64;

use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, StandardNormal};

/// Default key and value head dimension (K = V), and the only one of the backward.
pub const HEAD_DIM: usize = 128;
/// The head dimensions (K = V) of the forward references and kernels.
pub const HEAD_DIMS: [usize; 2] = [64, 128];
/// Chunk length of the kernels.
pub const CHUNK: usize = 16;
/// Epsilon inside the L2-norm square root.
pub const NORM_EPS: f64 = 1e-6;

/// One KDA forward problem on the host. Values are f32 holding bf16-representable numbers
/// (inputs), so the float64 reference sees exactly what the kernel sees.
#[derive(Debug, Clone)]
pub struct KdaProblem {
    /// Value heads (v, g, beta, states, output).
    pub heads: usize,
    /// Query/key heads (`heads` is a multiple; GVA when smaller): q, k are `[T, qk_heads, D]`.
    pub qk_heads: usize,
    /// Key and value head dimension `D` (K = V), one of [`HEAD_DIMS`].
    pub head_dim: usize,
    /// Length of every sequence, packed in order (`cu_seqlens` = prefix sums).
    pub seq_lens: Vec<usize>,
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    pub g: Vec<f32>,
    /// Beta logits `[T, H]` (sigmoid applied inside).
    pub beta: Vec<f32>,
    /// `[H]`.
    pub a_log: Vec<f32>,
    /// `[H, D]`.
    pub dt_bias: Vec<f32>,
    pub scale: f32,
    /// In `[-5, 0)`.
    pub lower_bound: f32,
    /// `[N, H, D, D]`, absent means zeros.
    pub initial_state: Option<Vec<f32>>,
}

/// `n` values `bf16(mul * N(0,1))`, generated in parallel chunks (deterministic for a seed).
fn randn_bf16(n: usize, mul: f32, seed: u64, stream: u64) -> Vec<f32> {
    const CHUNK_ELEMS: usize = 1 << 18;
    let mut out = vec![0.0f32; n];
    let chunks: Vec<(usize, &mut [f32])> = out.chunks_mut(CHUNK_ELEMS).enumerate().collect();
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(chunks.len().max(1));
    let work = std::sync::Mutex::new(chunks);
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                loop {
                    let Some((i, chunk)) = work.lock().unwrap_or_else(|p| p.into_inner()).pop()
                    else {
                        break;
                    };
                    let mut rng = rand::rngs::StdRng::seed_from_u64(
                        seed ^ stream.wrapping_mul(0x9e37_79b9_7f4a_7c15)
                            ^ (i as u64).wrapping_mul(0xd1b5_4a32_d192_ed03),
                    );
                    for x in chunk.iter_mut() {
                        let z: f32 = StandardNormal.sample(&mut rng);
                        *x = bf16_round(mul * z);
                    }
                }
            });
        }
    });
    out
}

/// Result of a reference forward.
#[derive(Debug, Clone)]
pub struct KdaOutput {
    /// `[T, H, D]`.
    pub out: Vec<f64>,
    /// `[N, H, D, D]`.
    pub final_state: Vec<f64>,
}

impl KdaOutput {
    /// Relative Frobenius errors (output, final state) against `reference`
    /// ([`metrics::rel_frobenius`]).
    pub fn rel_errors(&self, reference: &KdaOutput) -> (f64, f64) {
        (
            metrics::rel_frobenius(&self.out, &reference.out),
            metrics::rel_frobenius(&self.final_state, &reference.final_state),
        )
    }
}

fn bf16_round(x: f32) -> f32 {
    half::bf16::from_f32(x).to_f32()
}

impl KdaProblem {
    /// Fresh random inputs following the benchmark protocol (`docs/specs/kda.md §4`): bf16 `randn` q, k, v, g and
    /// beta logits, `U(0,1)` A_log and dt_bias, scale `1/sqrt(D)`, lower bound -5, and (when
    /// `with_state`) an initial state `0.1 * randn` rounded to bf16; head dim [`HEAD_DIM`].
    pub fn random(seq_lens: &[usize], heads: usize, with_state: bool, seed: u64) -> Self {
        Self::random_gva(seq_lens, heads, heads, with_state, seed)
    }

    /// [`Self::random`] with `qk_heads` query/key heads (GVA when fewer than `heads`).
    pub fn random_gva(
        seq_lens: &[usize],
        heads: usize,
        qk_heads: usize,
        with_state: bool,
        seed: u64,
    ) -> Self {
        Self::random_dim(seq_lens, heads, qk_heads, HEAD_DIM, with_state, seed)
    }

    /// [`Self::random_gva`] with head dimension `head_dim` (one of [`HEAD_DIMS`]).
    pub fn random_dim(
        seq_lens: &[usize],
        heads: usize,
        qk_heads: usize,
        head_dim: usize,
        with_state: bool,
        seed: u64,
    ) -> Self {
        check_head_dim(head_dim);
        assert!(
            qk_heads > 0 && heads.is_multiple_of(qk_heads),
            "heads must be a multiple of qk_heads"
        );
        let t: usize = seq_lens.iter().sum();
        let d = head_dim;
        let act = t * heads * d;
        let q = randn_bf16(t * qk_heads * d, 1.0, seed, 1);
        let k = randn_bf16(t * qk_heads * d, 1.0, seed, 2);
        let v = randn_bf16(act, 1.0, seed, 3);
        let g = randn_bf16(act, 1.0, seed, 4);
        let beta = randn_bf16(t * heads, 1.0, seed, 5);
        let initial_state =
            with_state.then(|| randn_bf16(seq_lens.len() * heads * d * d, 0.1, seed, 6));
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ 0x5eed);
        let a_log = (0..heads).map(|_| rng.random::<f32>()).collect();
        let dt_bias = (0..heads * d).map(|_| rng.random::<f32>()).collect();
        KdaProblem {
            heads,
            qk_heads,
            head_dim,
            seq_lens: seq_lens.to_vec(),
            q,
            k,
            v,
            g,
            beta,
            a_log,
            dt_bias,
            scale: 1.0 / (d as f32).sqrt(),
            lower_bound: -5.0,
            initial_state,
        }
    }

    /// Offset of the q/k row that value head `h` of token `t` reads.
    pub fn qk_offset(&self, t: usize, h: usize) -> usize {
        (t * self.qk_heads + h / (self.heads / self.qk_heads)) * self.head_dim
    }

    /// Total tokens.
    pub fn tokens(&self) -> usize {
        self.seq_lens.iter().sum()
    }

    /// `cu_seqlens` (prefix sums starting at 0).
    pub fn cu_seqlens(&self) -> Vec<i64> {
        let mut cu = vec![0i64];
        for &l in &self.seq_lens {
            cu.push(cu.last().unwrap() + l as i64);
        }
        cu
    }

    fn state_len(&self) -> usize {
        self.seq_lens.len() * self.heads * self.head_dim * self.head_dim
    }
}

/// Panics unless `d` is one of [`HEAD_DIMS`].
pub(crate) fn check_head_dim(d: usize) {
    assert!(
        HEAD_DIMS.contains(&d),
        "head dim {d} is not supported (the forward references take {HEAD_DIMS:?})"
    );
}

/// Per-token activations of one (token, head) in float64: normalised q, k, decay `alpha`
/// (per key channel) and sigmoid beta.
pub(crate) struct TokenActs {
    pub q: Vec<f64>,
    pub k: Vec<f64>,
    /// Log decay `gamma` (natural log), `alpha = exp(gamma)`.
    pub gamma: Vec<f64>,
    pub beta: f64,
}

pub(crate) fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

pub(crate) fn token_acts(p: &KdaProblem, t: usize, h: usize) -> TokenActs {
    let d = p.head_dim;
    let base = (t * p.heads + h) * d;
    let qk = p.qk_offset(t, h);
    let l2 = |x: &[f32]| -> Vec<f64> {
        let ss: f64 = x.iter().map(|&a| f64::from(a) * f64::from(a)).sum();
        let inv = 1.0 / (ss + NORM_EPS).sqrt();
        x.iter().map(|&a| f64::from(a) * inv).collect()
    };
    let a = f64::from(p.a_log[h]).exp();
    let lb = f64::from(p.lower_bound);
    TokenActs {
        q: l2(&p.q[qk..qk + d]),
        k: l2(&p.k[qk..qk + d]),
        gamma: (0..d)
            .map(|c| {
                let x = f64::from(p.g[base + c]) + f64::from(p.dt_bias[h * d + c]);
                lb * sigmoid(a * x)
            })
            .collect(),
        beta: sigmoid(f64::from(p.beta[t * p.heads + h])),
    }
}

/// `G_i = sum_{s <= i} gamma_s / ln 2` (log2 cumulative decay per key channel) of one chunk's tokens,
/// and `G` of its last token.
pub(crate) fn log2_cumulative_gates(acts: &[TokenActs], d: usize) -> (Vec<Vec<f64>>, Vec<f64>) {
    let ln2 = std::f64::consts::LN_2;
    let mut acc = vec![0.0f64; d];
    let g = acts
        .iter()
        .map(|a| {
            for (x, gamma) in acc.iter_mut().zip(&a.gamma) {
                *x += gamma / ln2;
            }
            acc.clone()
        })
        .collect();
    (g, acc)
}

/// Runs `f(seq, head) -> (out rows [len, D], state [D*D])` for every (sequence, head) on
/// all cores and assembles the token-major output.
pub(crate) fn per_sequence_head<F>(p: &KdaProblem, f: F) -> KdaOutput
where
    F: Fn(usize, usize, usize, usize) -> (Vec<f64>, Vec<f64>) + Sync,
{
    check_head_dim(p.head_dim);
    let d = p.head_dim;
    let cu = p.cu_seqlens();
    let tasks: Vec<(usize, usize)> = (0..p.seq_lens.len())
        .flat_map(|n| (0..p.heads).map(move |h| (n, h)))
        .collect();
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(tasks.len().max(1));
    let next = std::sync::atomic::AtomicUsize::new(0);
    type Done = Vec<(usize, Vec<f64>, Vec<f64>)>;
    let results: Vec<Done> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| {
                    let mut done = Vec::new();
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some(&(n, h)) = tasks.get(i) else { break };
                        let (o, st) = f(n, h, cu[n] as usize, p.seq_lens[n]);
                        done.push((i, o, st));
                    }
                    done
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("reference worker panicked"))
            .collect()
    });
    let t = p.tokens();
    let mut out = vec![0.0; t * p.heads * d];
    let mut final_state = vec![0.0; p.state_len()];
    let hd2 = d * d;
    for (i, o, st) in results.into_iter().flatten() {
        let (n, h) = tasks[i];
        let bos = cu[n] as usize;
        for (r, row) in o.chunks_exact(d).enumerate() {
            let dst = ((bos + r) * p.heads + h) * d;
            out[dst..dst + d].copy_from_slice(row);
        }
        let sb = (n * p.heads + h) * hd2;
        final_state[sb..sb + hd2].copy_from_slice(&st);
    }
    KdaOutput { out, final_state }
}

pub(crate) fn initial_state_f64(p: &KdaProblem, n: usize, h: usize) -> Vec<f64> {
    let hd2 = p.head_dim * p.head_dim;
    match &p.initial_state {
        Some(s) => s[(n * p.heads + h) * hd2..][..hd2]
            .iter()
            .map(|&x| f64::from(x))
            .collect(),
        None => vec![0.0; hd2],
    }
}

/// The definition (`docs/specs/kda.md §1.3`): float64 token-by-token recurrence.
pub fn recurrence_f64(p: &KdaProblem) -> KdaOutput {
    let scale = f64::from(p.scale);
    let d = p.head_dim;
    per_sequence_head(p, |n, h, bos, len| {
        let mut s = initial_state_f64(p, n, h); // [v][k]
        let mut out = vec![0.0; len * d];
        for t in 0..len {
            let a = token_acts(p, bos + t, h);
            let alpha: Vec<f64> = a.gamma.iter().map(|g| g.exp()).collect();
            let vrow = &p.v[((bos + t) * p.heads + h) * d..][..d];
            for (vi, row) in s.chunks_exact_mut(d).enumerate() {
                let mut pred = 0.0;
                for c in 0..d {
                    row[c] *= alpha[c];
                    pred += row[c] * a.k[c];
                }
                let u = a.beta * (f64::from(vrow[vi]) - pred);
                let mut o = 0.0;
                for c in 0..d {
                    row[c] += u * a.k[c];
                    o += row[c] * a.q[c];
                }
                out[t * d + vi] = scale * o;
            }
        }
        (out, s)
    })
}
