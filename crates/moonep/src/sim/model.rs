//! Per-policy load and traffic of one routing (docs/specs/moonep.md §4.2).

use crate::plan::{GlobalPlan, PlanError, plan_global};
use crate::router::Routing;

/// Balancing policy.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Policy {
    /// Dropless, no replicas: every token goes to its expert's home rank.
    None,
    /// Megatron-style dropping with capacity `ceil(cf·s·K/E)` per source rank per expert.
    Capacity { cf: f64 },
    /// Dropping with a global capacity per expert `ceil(cf·T·K/E)` (earliest sources kept).
    CapacityGlobal { cf: f64 },
    /// The moonep planner: exact quotas, dynamic replicas.
    MoonEp,
}

impl Policy {
    /// Short label for CSV and plots.
    pub fn label(&self) -> String {
        match self {
            Policy::None => "none".into(),
            Policy::Capacity { cf } => format!("capacity(cf={cf})"),
            Policy::CapacityGlobal { cf } => format!("capacity-global(cf={cf})"),
            Policy::MoonEp => "moonep".into(),
        }
    }
}

/// Model sizes and link figures used to turn counts into bytes and microseconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HardwareModel {
    /// Hidden size `H`.
    pub hidden: u64,
    /// Expert FFN inner size `H'`.
    pub ffn: u64,
    /// Token padding `P` of the moonep layout.
    pub padding: u32,
    /// NVLink bandwidth per direction, GB/s.
    pub link_gbps: f64,
    /// Fixed latency per collective, µs.
    pub alpha_us: f64,
    /// Sustained bf16 GEMM rate per GPU, TFLOP/s (compute proxy).
    pub gemm_tflops: f64,
}

impl Default for HardwareModel {
    /// H200: 450 GB/s per direction NVLink, 10 µs latency, 600 TFLOP/s sustained bf16.
    fn default() -> Self {
        HardwareModel {
            hidden: 7168,
            ffn: 2048,
            padding: 128,
            link_gbps: 450.0,
            alpha_us: 10.0,
            gemm_tflops: 600.0,
        }
    }
}

/// What one policy does with one routing.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyOutcome {
    /// Tokens computed on each rank.
    pub load: Vec<u64>,
    /// Dropped entries / all entries.
    pub drop_rate: f64,
    /// Replicas per rank.
    pub replicas: Vec<u64>,
    /// Entries computed away from their home rank / all entries.
    pub migrated_fraction: f64,
    /// Stage-A rounds (moonep only).
    pub rounds: usize,
    /// Token bytes received from / sent to other ranks, per rank.
    pub remote_in: Vec<u64>,
    pub remote_out: Vec<u64>,
    /// Replica weight bytes received / pushed, per rank (bf16 gate, up, down).
    pub weight_in: Vec<u64>,
    pub weight_out: Vec<u64>,
}

/// Evaluates `policy` on `routing`. Moonep runs the real planner (uniform or per-rank mode).
pub fn evaluate(
    routing: &Routing,
    policy: Policy,
    hw: &HardwareModel,
) -> Result<PolicyOutcome, PlanError> {
    let (r_n, e_n) = (routing.ranks, routing.experts);
    let epn = e_n / r_n;
    let k = routing.top_k as u64;
    let total: u64 = routing.tokens.iter().map(|&s| u64::from(s) * k).sum();
    let row_bytes = 2 * hw.hidden;
    // flow[r*R + d]: entries sent from source r to compute rank d.
    let mut flow = vec![0u64; r_n * r_n];
    let mut replicas = vec![0u64; r_n];
    let mut rounds = 0;
    let mut dropped = 0u64;
    let mut plan: Option<GlobalPlan> = None;
    match policy {
        Policy::None => {
            for r in 0..r_n {
                for e in 0..e_n {
                    flow[r * r_n + e / epn] += u64::from(routing.tpe[r * e_n + e]);
                }
            }
        }
        Policy::Capacity { cf } => {
            for r in 0..r_n {
                let cap = (cf * f64::from(routing.tokens[r]) * k as f64 / e_n as f64).ceil() as u64;
                for e in 0..e_n {
                    let t = u64::from(routing.tpe[r * e_n + e]);
                    flow[r * r_n + e / epn] += t.min(cap);
                    dropped += t.saturating_sub(cap);
                }
            }
        }
        Policy::CapacityGlobal { cf } => {
            let cap = (cf * total as f64 / e_n as f64).ceil() as u64;
            for e in 0..e_n {
                let mut seen = 0u64;
                for r in 0..r_n {
                    let t = u64::from(routing.tpe[r * e_n + e]);
                    let kept = t.min(cap.saturating_sub(seen));
                    seen += t;
                    flow[r * r_n + e / epn] += kept;
                    dropped += t - kept;
                }
            }
        }
        Policy::MoonEp => {
            let capacity = *routing.tokens.iter().max().unwrap_or(&1);
            let cfg = routing.plan_config(capacity, hw.padding);
            let p = plan_global(&cfg, &routing.tpe)?;
            for e in 0..e_n {
                // Overlap of source runs [src_off, +tpe) with destination runs [cum[d-1], cum[d]).
                let (mut r, mut d) = (0usize, 0usize);
                let (mut r_end, mut d_end) = (0u64, 0u64);
                let mut pos = 0u64;
                let t_e = p.expert_tokens[e];
                while pos < t_e {
                    while r_end <= pos {
                        r_end += u64::from(routing.tpe[r * e_n + e]);
                        r += 1;
                    }
                    while d_end <= pos {
                        d_end += u64::from(p.alloc_at(e, d));
                        d += 1;
                    }
                    let next = r_end.min(d_end);
                    flow[(r - 1) * r_n + (d - 1)] += next - pos;
                    pos = next;
                }
            }
            for (d, slot) in replicas.iter_mut().enumerate() {
                *slot = p.replicas_on(d) as u64;
            }
            rounds = p.rounds.len();
            plan = Some(p);
        }
    }
    let mut load = vec![0u64; r_n];
    let mut remote_in = vec![0u64; r_n];
    let mut remote_out = vec![0u64; r_n];
    let mut migrated = 0u64;
    for r in 0..r_n {
        for d in 0..r_n {
            let f = flow[r * r_n + d];
            load[d] += f;
            if r != d {
                remote_in[d] += f * row_bytes;
                remote_out[r] += f * row_bytes;
            }
        }
    }
    if let Some(p) = &plan {
        migrated = p.migrated_tokens();
    }
    let expert_bytes = 3 * hw.hidden * hw.ffn * 2;
    let mut weight_in = vec![0u64; r_n];
    let mut weight_out = vec![0u64; r_n];
    if let Some(p) = &plan {
        for (d, layout) in p.layouts.iter().enumerate() {
            for &e in layout.experts_to_copy.iter().filter(|&&e| e >= 0) {
                weight_in[d] += expert_bytes;
                weight_out[e as usize / epn] += expert_bytes;
            }
        }
    }
    Ok(PolicyOutcome {
        load,
        drop_rate: if total == 0 {
            0.0
        } else {
            dropped as f64 / total as f64
        },
        replicas,
        migrated_fraction: if total == 0 {
            0.0
        } else {
            migrated as f64 / total as f64
        },
        rounds,
        remote_in,
        remote_out,
        weight_in,
        weight_out,
    })
}

impl PolicyOutcome {
    /// Bandwidth-model time of one dispatch, µs: `max_d max(in_d, out_d) / B + α`, replica
    /// weight bytes included (not overlapped).
    pub fn comm_us(&self, hw: &HardwareModel) -> f64 {
        let worst = (0..self.load.len())
            .map(|d| {
                (self.remote_in[d] + self.weight_in[d]).max(self.remote_out[d] + self.weight_out[d])
            })
            .max()
            .unwrap_or(0);
        worst as f64 / (hw.link_gbps * 1e3) + hw.alpha_us
    }

    /// Expert GEMM time of the busiest rank, µs (3 GEMMs of `2·H·H'` flops per token row).
    pub fn gemm_us(&self, hw: &HardwareModel) -> f64 {
        let worst = *self.load.iter().max().unwrap_or(&0) as f64;
        worst * 6.0 * (hw.hidden * hw.ffn) as f64 / (hw.gemm_tflops * 1e6)
    }
}
