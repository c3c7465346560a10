//! Cluster-scale load simulator (docs/specs/moonep.md §4.2): only `tpe` is needed, so EP=8..256
//! with E up to 1024 and S·K up to 128K·16 run in seconds. Policies: none, capacity dropping (per
//! source and global), moonep (the real planner). Output: one [`SimRow`] per (config, workload,
//! policy), as CSV and SVG plots.

mod model;
mod plot;

pub use model::{HardwareModel, Policy, PolicyOutcome, evaluate};
pub use plot::{report_plots, write_svgs};

use std::fmt::Write as _;
use std::path::Path;

use crate::plan::PlanError;
use crate::router::{Placement, RouterError, Skew, WorkloadSpec, generate};

/// One cluster shape.
#[derive(Debug, Clone, PartialEq)]
pub struct ClusterShape {
    /// Label such as "DSv3-like".
    pub name: String,
    pub ranks: usize,
    pub experts: usize,
    pub top_k: usize,
    /// Tokens per rank `s` (uniform).
    pub tokens: u32,
}

/// One workload of the sweep.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Workload {
    pub skew: Skew,
    pub placement: Placement,
}

impl Workload {
    /// `(kind, parameter)` labels for CSV.
    pub fn labels(&self) -> (String, String) {
        let (kind, param) = match self.skew {
            Skew::Uniform => ("uniform", String::new()),
            Skew::Zipf { maxvio } => ("zipf", format!("{maxvio}")),
            Skew::Lognormal { sigma } => ("lognormal", format!("{sigma}")),
            Skew::SingleHotExpert => ("single-hot-expert", String::new()),
            Skew::HotHomeGroup => ("hot-home-group", String::new()),
            Skew::HotSourceRank => ("hot-source-rank", String::new()),
            Skew::HalfExpertsEmpty => ("half-experts-empty", String::new()),
            Skew::IntraGroupSkew => ("intra-group-skew", String::new()),
            Skew::RankShare { share } => ("rank-share", format!("{share}")),
        };
        (kind.into(), param)
    }
}

/// What to simulate.
#[derive(Debug, Clone, PartialEq)]
pub struct SweepSpec {
    pub shapes: Vec<ClusterShape>,
    pub workloads: Vec<Workload>,
    pub policies: Vec<Policy>,
    pub hardware: HardwareModel,
    pub seed: u64,
}

/// The Zipf maxvio sweep of docs/specs/moonep.md §6.2.
pub const MAXVIO_SWEEP: [f64; 7] = [0.0, 0.25, 0.5, 1.0, 2.0, 3.0, 4.0];

impl SweepSpec {
    /// Full sweep: EP 2..256 on DSv3-like (E=256, K=8) and K3-like (E=896, K=16; E=1024 at
    /// EP=256), S=4096; Zipf maxvio sweep (random and clustered), lognormal σ, adversarial kinds.
    pub fn full() -> Self {
        let mut shapes = Vec::new();
        for r in [2, 8, 16, 32, 64, 128, 256] {
            shapes.push(shape("DSv3-like", r, 256, 8, 4096));
        }
        for r in [8, 16, 32, 64, 128] {
            shapes.push(shape("K3-like", r, 896, 16, 4096));
        }
        shapes.push(shape("K3-like", 256, 1024, 16, 4096));
        SweepSpec {
            shapes,
            workloads: all_workloads(&MAXVIO_SWEEP),
            policies: all_policies(),
            hardware: HardwareModel::default(),
            seed: 1,
        }
    }

    /// CI-sized sweep (well under a second in release, seconds in debug).
    pub fn quick() -> Self {
        let shapes = vec![
            shape("DSv3-like", 2, 256, 8, 512),
            shape("DSv3-like", 8, 256, 8, 512),
            shape("K3-like", 64, 896, 16, 256),
        ];
        SweepSpec {
            shapes,
            workloads: all_workloads(&[0.0, 1.0, 2.0, 4.0]),
            policies: all_policies(),
            hardware: HardwareModel::default(),
            seed: 1,
        }
    }
}

fn shape(name: &str, ranks: usize, experts: usize, top_k: usize, tokens: u32) -> ClusterShape {
    ClusterShape {
        name: name.into(),
        ranks,
        experts,
        top_k,
        tokens,
    }
}

fn all_policies() -> Vec<Policy> {
    vec![
        Policy::None,
        Policy::Capacity { cf: 1.0 },
        Policy::Capacity { cf: 1.25 },
        Policy::CapacityGlobal { cf: 1.25 },
        Policy::MoonEp,
    ]
}

fn all_workloads(maxvios: &[f64]) -> Vec<Workload> {
    let mut w = Vec::new();
    for placement in [Placement::Random, Placement::Clustered] {
        w.extend(maxvios.iter().map(|&m| Workload {
            skew: Skew::Zipf { maxvio: m },
            placement,
        }));
    }
    w.extend([0.25, 0.5, 1.0].map(|s| Workload {
        skew: Skew::Lognormal { sigma: s },
        placement: Placement::Random,
    }));
    for skew in [
        Skew::SingleHotExpert,
        Skew::HotHomeGroup,
        Skew::HotSourceRank,
        Skew::HalfExpertsEmpty,
        Skew::IntraGroupSkew,
    ] {
        w.push(Workload {
            skew,
            placement: Placement::Clustered,
        });
    }
    // Share of copies to rank 0's experts (the EP=2 anchor table of anchors.md).
    w.extend([0.5, 0.6, 0.75, 0.9].map(|share| Workload {
        skew: Skew::RankShare { share },
        placement: Placement::Clustered,
    }));
    w
}

/// Errors of the simulator.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error("workload for {shape}: {source}")]
    Router { shape: String, source: RouterError },
    #[error("planning {shape}: {source}")]
    Plan { shape: String, source: PlanError },
    #[error("writing {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("plotting {path}: {reason}")]
    Plot { path: String, reason: String },
}

/// One simulated (shape, workload, policy).
#[derive(Debug, Clone, PartialEq)]
pub struct SimRow {
    pub shape: String,
    pub ranks: usize,
    pub experts: usize,
    pub top_k: usize,
    pub tokens: u32,
    pub workload: String,
    pub param: String,
    pub placement: String,
    /// Expert-level `maxvio` and rank-level `max G / mean G` of the routing.
    pub maxvio: f64,
    pub rank_imbalance: f64,
    pub policy: String,
    pub load_max_over_mean: f64,
    pub load_p99_over_mean: f64,
    pub drop_rate: f64,
    pub replicas_total: u64,
    pub replicas_max: u64,
    pub migrated_fraction: f64,
    pub stage_a_rounds: usize,
    pub weight_bytes_in_max: u64,
    pub grad_bytes_max: u64,
    pub remote_in_max: u64,
    pub remote_out_max: u64,
    pub comm_us: f64,
    pub gemm_us: f64,
}

/// Runs every (shape, workload, policy) of `spec`; shapes with `E % R != 0` are an error.
pub fn run_sweep(spec: &SweepSpec) -> Result<Vec<SimRow>, SimError> {
    let mut rows = Vec::new();
    for sh in &spec.shapes {
        let label = format!(
            "{} EP{} E={} K={} s={}",
            sh.name, sh.ranks, sh.experts, sh.top_k, sh.tokens
        );
        for wl in &spec.workloads {
            let ws = WorkloadSpec {
                experts: sh.experts,
                top_k: sh.top_k,
                tokens: vec![sh.tokens; sh.ranks],
                skew: wl.skew,
                placement: wl.placement,
                seed: spec.seed,
            };
            let routing = generate(&ws).map_err(|source| SimError::Router {
                shape: label.clone(),
                source,
            })?;
            let (workload, param) = wl.labels();
            let (maxvio, rank_imbalance) = (routing.maxvio(), routing.rank_imbalance());
            for policy in &spec.policies {
                let out = evaluate(&routing, *policy, &spec.hardware).map_err(|source| {
                    SimError::Plan {
                        shape: label.clone(),
                        source,
                    }
                })?;
                let mean = out.load.iter().sum::<u64>() as f64 / sh.ranks as f64;
                let mut sorted = out.load.clone();
                sorted.sort_unstable();
                let p99 = sorted[((0.99 * sh.ranks as f64).ceil() as usize).clamp(1, sh.ranks) - 1];
                let ratio = |x: u64| if mean > 0.0 { x as f64 / mean } else { 1.0 };
                let weight_in_max = *out.weight_in.iter().max().unwrap_or(&0);
                rows.push(SimRow {
                    shape: sh.name.clone(),
                    ranks: sh.ranks,
                    experts: sh.experts,
                    top_k: sh.top_k,
                    tokens: sh.tokens,
                    workload: workload.clone(),
                    param: param.clone(),
                    placement: format!("{:?}", wl.placement).to_lowercase(),
                    maxvio,
                    rank_imbalance,
                    policy: policy.label(),
                    load_max_over_mean: ratio(*sorted.last().unwrap_or(&0)),
                    load_p99_over_mean: ratio(p99),
                    drop_rate: out.drop_rate,
                    replicas_total: out.replicas.iter().sum(),
                    replicas_max: *out.replicas.iter().max().unwrap_or(&0),
                    migrated_fraction: out.migrated_fraction,
                    stage_a_rounds: out.rounds,
                    weight_bytes_in_max: weight_in_max,
                    // f32 replica grads are twice the bf16 weight bytes.
                    grad_bytes_max: 2 * weight_in_max,
                    remote_in_max: *out.remote_in.iter().max().unwrap_or(&0),
                    remote_out_max: *out.remote_out.iter().max().unwrap_or(&0),
                    comm_us: out.comm_us(&spec.hardware),
                    gemm_us: out.gemm_us(&spec.hardware),
                });
            }
        }
    }
    Ok(rows)
}

/// CSV header matching [`to_csv`].
pub const CSV_HEADER: &str = "shape,ranks,experts,top_k,tokens,workload,param,placement,maxvio,rank_imbalance,policy,load_max_over_mean,load_p99_over_mean,drop_rate,replicas_total,replicas_max,migrated_fraction,stage_a_rounds,weight_bytes_in_max,grad_bytes_max,remote_in_max,remote_out_max,comm_us,gemm_us";

/// Rows as CSV text (header first).
pub fn to_csv(rows: &[SimRow]) -> String {
    let mut s = String::from(CSV_HEADER);
    s.push('\n');
    for r in rows {
        let _ = writeln!(
            s,
            "{},{},{},{},{},{},{},{},{:.4},{:.4},\"{}\",{:.4},{:.4},{:.5},{},{},{:.5},{},{},{},{},{},{:.2},{:.2}",
            r.shape,
            r.ranks,
            r.experts,
            r.top_k,
            r.tokens,
            r.workload,
            r.param,
            r.placement,
            r.maxvio,
            r.rank_imbalance,
            r.policy,
            r.load_max_over_mean,
            r.load_p99_over_mean,
            r.drop_rate,
            r.replicas_total,
            r.replicas_max,
            r.migrated_fraction,
            r.stage_a_rounds,
            r.weight_bytes_in_max,
            r.grad_bytes_max,
            r.remote_in_max,
            r.remote_out_max,
            r.comm_us,
            r.gemm_us
        );
    }
    s
}

/// Writes [`to_csv`] to `path`.
pub fn write_csv(rows: &[SimRow], path: &Path) -> Result<(), SimError> {
    std::fs::write(path, to_csv(rows)).map_err(|source| SimError::Io {
        path: path.display().to_string(),
        source,
    })
}
