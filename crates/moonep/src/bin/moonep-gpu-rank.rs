//! One rank of the moonep GPU checks and benchmark; run under `moonep-launch -n 2 --`.
//!
//! - `selftest`: every GPU correctness check (exit 1 on any failure).
//! - `bench --out FILE`: the nvlink-tier benchmark; rank 0 writes a `k3_common` report.
//! - `report --out FILE`: runs the benchmark through the launcher itself (2 GPUs) and writes the
//!   report, or a `skipped` entry when the tier cannot run here.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};
use k3_common::provenance::Provenance;
use k3_common::report::{Report, Skipped, Tier};
use moonep::gpu::bench::{NvlinkOptions, bench_rank, run_nvlink};
use moonep::gpu::rank::{Rank, RankEnv};

#[derive(Parser)]
#[command(name = "moonep-gpu-rank")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(clap::Args, Clone)]
struct BenchArgs {
    #[arg(long, default_value_t = 20)]
    warmup: usize,
    #[arg(long, default_value_t = 50)]
    iters: usize,
    #[arg(long, default_value_t = 64)]
    num_blocks: u32,
    #[arg(long, value_delimiter = ',', default_values_t = vec![0.5, 0.6, 0.75, 0.85, 0.9, 0.95])]
    shares: Vec<f64>,
    #[arg(long, value_delimiter = ',', default_values_t = vec![0.0, 0.5, 1.0, 2.0, 4.0])]
    maxvios: Vec<f64>,
    #[arg(long)]
    dsv3_only: bool,
    /// Report file.
    #[arg(long)]
    out: PathBuf,
}

impl BenchArgs {
    fn options(&self) -> NvlinkOptions {
        NvlinkOptions {
            warmup: self.warmup,
            iters: self.iters,
            num_blocks: self.num_blocks,
            shares: self.shares.clone(),
            maxvios: self.maxvios.clone(),
            dsv3_only: self.dsv3_only,
        }
    }
}

#[derive(Subcommand)]
enum Cmd {
    /// GPU correctness checks (rank side).
    Selftest,
    /// Benchmark (rank side).
    Bench(BenchArgs),
    /// Benchmark through the launcher; writes a report (skipped entry where it cannot run).
    Report(BenchArgs),
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .init();
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Selftest => {
            let mut rank = Rank::init(RankEnv::from_env()?).context("rank bootstrap")?;
            let failures = moonep::gpu::selftest::run_all(&mut rank)?;
            rank.store.barrier()?;
            if failures > 0 {
                anyhow::bail!("{failures} GPU check(s) failed");
            }
            if rank.env.rank == 0 {
                println!("all GPU checks passed");
            }
        }
        Cmd::Bench(a) => {
            let mut rank = Rank::init(RankEnv::from_env()?).context("rank bootstrap")?;
            let sections = bench_rank(&mut rank, &a.options())?;
            if let Some(sections) = sections {
                let mut report = Report::for_provenance(&Provenance::current());
                report.sections = sections;
                report.write(&a.out)?;
            }
            rank.store.barrier()?;
        }
        Cmd::Report(a) => {
            let mut report = Report::for_provenance(&Provenance::current());
            match run_nvlink(&a.options()) {
                Ok(sections) => report.sections = sections,
                Err(e) => report.skipped.push(Skipped {
                    tier: Tier::Nvlink,
                    machine: k3_common::machine::hostname(),
                    what: "moonep EP=2 dispatch/combine".into(),
                    reason: e.to_string(),
                }),
            }
            report.write(&a.out)?;
        }
    }
    Ok(())
}
