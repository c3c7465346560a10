//! Float64 composed form of intra-card context parallelism: each segment of a sequence is run
//! from a zero state (particular solution `P`) and, with `v = 0`, from the identity (transition
//! `M`, so `S_end = S_start M + P`); a scan over segments gives every start state, and the
//! outputs come from each segment's start. Exact up to rounding, since the recurrence is affine
//! in the state.

use super::{HEAD_DIM, KdaOutput, KdaProblem, initial_state_f64, per_sequence_head, token_acts};

const D: usize = HEAD_DIM;

/// Runs tokens `[bos, bos + len)` of head `h` from state `s` (`[v][k]`, updated in place); with
/// `with_v == false` the values are taken as zero. Returns the outputs `[len][128]`.
fn run(p: &KdaProblem, h: usize, bos: usize, len: usize, s: &mut [f64], with_v: bool) -> Vec<f64> {
    let scale = f64::from(p.scale);
    let rows = s.len() / D;
    let mut out = vec![0.0; len * rows];
    for t in 0..len {
        let a = token_acts(p, bos + t, h);
        let alpha: [f64; D] = std::array::from_fn(|c| a.gamma[c].exp());
        let vrow = &p.v[((bos + t) * p.heads + h) * D..][..D];
        for (vi, row) in s.chunks_exact_mut(D).enumerate() {
            let mut pred = 0.0;
            for c in 0..D {
                row[c] *= alpha[c];
                pred += row[c] * a.k[c];
            }
            let v = if with_v { f64::from(vrow[vi]) } else { 0.0 };
            let u = a.beta * (v - pred);
            let mut o = 0.0;
            for c in 0..D {
                row[c] += u * a.k[c];
                o += row[c] * a.q[c];
            }
            out[t * rows + vi] = scale * o;
        }
    }
    out
}

/// The composed form with segments of `seg_tokens` tokens (the last one ragged) in every sequence.
pub fn segmented_f64(p: &KdaProblem, seg_tokens: usize) -> KdaOutput {
    assert!(seg_tokens > 0, "segment length must be positive");
    per_sequence_head(p, |n, h, bos, len| {
        let starts: Vec<usize> = (0..len).step_by(seg_tokens).collect();
        // pass 1: P and M of every segment, independent of each other
        let pm: Vec<(Vec<f64>, Vec<f64>)> = starts
            .iter()
            .map(|&s0| {
                let l = seg_tokens.min(len - s0);
                let mut pst = vec![0.0; D * D];
                run(p, h, bos + s0, l, &mut pst, true);
                let mut m: Vec<f64> = (0..D * D)
                    .map(|i| if i / D == i % D { 1.0 } else { 0.0 })
                    .collect();
                run(p, h, bos + s0, l, &mut m, false);
                (pst, m)
            })
            .collect();
        // scan: S_{j+1} = S_j M_j + P_j
        let mut s = initial_state_f64(p, n, h);
        let mut seg_start = Vec::with_capacity(starts.len());
        for (pst, m) in &pm {
            seg_start.push(s.clone());
            let mut next = pst.clone();
            for r in 0..D {
                for k in 0..D {
                    let x = s[r * D + k];
                    for c in 0..D {
                        next[r * D + c] += x * m[k * D + c];
                    }
                }
            }
            s = next;
        }
        // pass 2: outputs of every segment from its start
        let mut out = Vec::with_capacity(len * D);
        for (j, &s0) in starts.iter().enumerate() {
            let l = seg_tokens.min(len - s0);
            let mut st = seg_start[j].clone();
            out.extend(run(p, h, bos + s0, l, &mut st, true));
        }
        (out, s)
    })
}
