//! Float64 composed form of intra-card context parallelism: each segment of a sequence is run
//! from a zero state (particular solution `P`) and, with `v = 0`, from the identity (transition
//! `M`, so `S_end = S_start M + P`); a scan over segments gives every start state, and the
//! outputs come from each segment's start. Exact up to rounding, since the recurrence is affine
//! in the state.

use super::{KdaOutput, KdaProblem, initial_state_f64, per_sequence_head, token_acts};

/// Runs tokens `[bos, bos + len)` of head `h` from state `s` (`[v][k]`, updated in place); with
/// `with_v == false` the values are taken as zero. Returns the outputs `[len][D]`.
fn run(p: &KdaProblem, h: usize, bos: usize, len: usize, s: &mut [f64], with_v: bool) -> Vec<f64> {
    let scale = f64::from(p.scale);
    let d = p.head_dim;
    let rows = s.len() / d;
    let mut out = vec![0.0; len * rows];
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
            let v = if with_v { f64::from(vrow[vi]) } else { 0.0 };
            let u = a.beta * (v - pred);
            let mut o = 0.0;
            for c in 0..d {
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
    let d = p.head_dim;
    per_sequence_head(p, |n, h, bos, len| {
        let starts: Vec<usize> = (0..len).step_by(seg_tokens).collect();
        // pass 1: P and M of every segment, independent of each other
        let pm: Vec<(Vec<f64>, Vec<f64>)> = starts
            .iter()
            .map(|&s0| {
                let l = seg_tokens.min(len - s0);
                let mut pst = vec![0.0; d * d];
                run(p, h, bos + s0, l, &mut pst, true);
                let mut m: Vec<f64> = (0..d * d)
                    .map(|i| if i / d == i % d { 1.0 } else { 0.0 })
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
            for r in 0..d {
                for k in 0..d {
                    let x = s[r * d + k];
                    for c in 0..d {
                        next[r * d + c] += x * m[k * d + c];
                    }
                }
            }
            s = next;
        }
        // pass 2: outputs of every segment from its start
        let mut out = Vec::with_capacity(len * d);
        for (j, &s0) in starts.iter().enumerate() {
            let l = seg_tokens.min(len - s0);
            let mut st = seg_start[j].clone();
            out.extend(run(p, h, bos + s0, l, &mut st, true));
        }
        (out, s)
    })
}
