//! `moonep-sim`: cluster-scale load simulator (docs/specs/moonep.md §4.2). Writes a CSV and SVG
//! plots.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Parser;
use moonep::router::{Placement, Skew};
use moonep::sim::{self, ClusterShape, Policy, SweepSpec, Workload};

/// Simulate per-rank load, replicas, traffic and a bandwidth-model time for the balancing
/// policies (none, capacity dropping, moonep) over EP sizes and routing skews.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// CI-sized sweep (a few shapes, three maxvio points): seconds.
    #[arg(long)]
    quick: bool,
    /// Output directory for `moonep-sim.csv` and the SVG plots.
    #[arg(long, default_value = "target/moonep-sim")]
    out: PathBuf,
    /// Only these EP sizes (comma separated); default: the preset's.
    #[arg(long, value_delimiter = ',')]
    ranks: Vec<usize>,
    /// Only these shapes: dsv3 (E=256, K=8), k3 (E=896, K=16; E=1024 at EP=256).
    #[arg(long, value_delimiter = ',')]
    shapes: Vec<String>,
    /// Tokens per rank (overrides the preset).
    #[arg(long)]
    tokens: Option<u32>,
    /// Zipf maxvio targets (overrides the preset).
    #[arg(long, value_delimiter = ',')]
    maxvio: Vec<f64>,
    /// Hidden size H and expert inner size H' for byte and time figures.
    #[arg(long, default_value_t = 7168)]
    hidden: u64,
    #[arg(long, default_value_t = 2048)]
    ffn: u64,
    /// NVLink bandwidth per direction (GB/s) and per-call latency (us) of the model.
    #[arg(long, default_value_t = 450.0)]
    link_gbps: f64,
    #[arg(long, default_value_t = 10.0)]
    alpha_us: f64,
    /// Workload seed.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Skip the SVG plots.
    #[arg(long)]
    no_plots: bool,
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .init();
    let args = Args::parse();
    let mut spec = if args.quick {
        SweepSpec::quick()
    } else {
        SweepSpec::full()
    };
    if !args.shapes.is_empty() {
        let want = |s: &ClusterShape| {
            args.shapes
                .iter()
                .any(|w| s.name.to_lowercase().starts_with(&w.to_lowercase()))
        };
        spec.shapes.retain(want);
    }
    if !args.ranks.is_empty() {
        spec.shapes.retain(|s| args.ranks.contains(&s.ranks));
    }
    if let Some(t) = args.tokens {
        spec.shapes.iter_mut().for_each(|s| s.tokens = t);
    }
    if !args.maxvio.is_empty() {
        spec.workloads
            .retain(|w| !matches!(w.skew, Skew::Zipf { .. }));
        for placement in [Placement::Random, Placement::Clustered] {
            for &m in &args.maxvio {
                spec.workloads.push(Workload {
                    skew: Skew::Zipf { maxvio: m },
                    placement,
                });
            }
        }
    }
    spec.hardware.hidden = args.hidden;
    spec.hardware.ffn = args.ffn;
    spec.hardware.link_gbps = args.link_gbps;
    spec.hardware.alpha_us = args.alpha_us;
    spec.seed = args.seed;
    anyhow::ensure!(
        !spec.shapes.is_empty(),
        "no shape left after --shapes/--ranks filters"
    );

    let start = std::time::Instant::now();
    let rows = sim::run_sweep(&spec).context("simulating")?;
    tracing::info!(
        rows = rows.len(),
        secs = start.elapsed().as_secs_f64(),
        "sweep done"
    );
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    let csv = args.out.join("moonep-sim.csv");
    sim::write_csv(&rows, &csv)?;
    println!("wrote {} rows to {}", rows.len(), csv.display());
    if !args.no_plots {
        for p in sim::write_svgs(&rows, &args.out)? {
            println!("wrote {}", p.display());
        }
    }
    summary(&rows);
    Ok(())
}

/// Prints one line per (shape, Zipf maxvio, random placement) comparing none and moonep.
fn summary(rows: &[sim::SimRow]) {
    println!(
        "{:<34} {:>7} {:>9} {:>9} {:>9} {:>8} {:>9}",
        "shape", "maxvio", "none max", "moonep", "replicas", "moved", "comm us"
    );
    for r in rows.iter().filter(|r| {
        r.workload == "zipf" && r.placement == "random" && r.policy == Policy::MoonEp.label()
    }) {
        let none = rows.iter().find(|n| {
            n.policy == "none"
                && n.workload == r.workload
                && n.param == r.param
                && n.placement == r.placement
                && (n.ranks, n.experts, &n.shape) == (r.ranks, r.experts, &r.shape)
        });
        let label = format!("{} EP{} E={} s={}", r.shape, r.ranks, r.experts, r.tokens);
        println!(
            "{:<34} {:>7.2} {:>9.3} {:>9.3} {:>9} {:>7.1}% {:>9.1}",
            label,
            r.maxvio,
            none.map_or(f64::NAN, |n| n.load_max_over_mean),
            r.load_max_over_mean,
            r.replicas_total,
            100.0 * r.migrated_fraction,
            r.comm_us
        );
    }
}
