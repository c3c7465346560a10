//! Inputs shared by the cross-crate benches in `benches/benches/`: the configurations of a K3-like layer.

use moonep::router::{Placement, Skew, WorkloadSpec};

/// An expert-parallel configuration (`docs/specs/moonep.md` §6.1).
#[derive(Debug, Clone, Copy)]
pub struct EpConfig {
    pub name: &'static str,
    pub ranks: usize,
    pub experts: usize,
    pub top_k: usize,
    pub tokens_per_rank: u32,
}

/// DSv3-like and K3-like configurations at EP 8 and 64 (S = 4096 tokens per rank).
pub const EP_CONFIGS: &[EpConfig] = &[
    EpConfig {
        name: "dsv3-ep8",
        ranks: 8,
        experts: 256,
        top_k: 8,
        tokens_per_rank: 4096,
    },
    EpConfig {
        name: "dsv3-ep64",
        ranks: 64,
        experts: 256,
        top_k: 8,
        tokens_per_rank: 4096,
    },
    EpConfig {
        name: "k3-ep8",
        ranks: 8,
        experts: 896,
        top_k: 16,
        tokens_per_rank: 4096,
    },
    EpConfig {
        name: "k3-ep64",
        ranks: 64,
        experts: 1024,
        top_k: 16,
        tokens_per_rank: 4096,
    },
];

impl EpConfig {
    /// A skewed workload (Zipf with expert maxvio 2, hot experts clustered on rank 0's home group).
    pub fn workload(&self, seed: u64) -> WorkloadSpec {
        WorkloadSpec {
            experts: self.experts,
            top_k: self.top_k,
            tokens: vec![self.tokens_per_rank; self.ranks],
            skew: Skew::Zipf { maxvio: 2.0 },
            placement: Placement::Clustered,
            seed,
        }
    }
}

/// KDA shapes small enough for the float64 CPU references: (name, sequence lengths, heads).
pub const KDA_SHAPES: &[(&str, &[usize], usize)] = &[
    ("T256-H2-fixed", &[256], 2),
    ("T256-H2-varlen", &[100, 17, 139], 2),
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_ep_config_generates_a_plannable_workload() {
        for c in EP_CONFIGS {
            let routing = moonep::router::generate(&c.workload(1)).unwrap();
            let cfg = routing.plan_config(c.tokens_per_rank, 128);
            let plan = moonep::plan::plan_global(&cfg, &routing.tpe).unwrap();
            assert!(
                plan.quota
                    .iter()
                    .all(|&q| q == u64::from(c.tokens_per_rank) * c.top_k as u64),
                "{}",
                c.name
            );
        }
    }
}
