//! `cargo xtask`: the build system of k3-stack (kernels, tier detection, benchmarks, reports, device bundle).

mod bench;
mod bundle;
mod doctor;
mod kernels;
mod render;
mod test;
mod tidy;
mod util;

use std::path::PathBuf;

use clap::{Parser, Subcommand};
use k3_common::Tier;

#[derive(Parser)]
#[command(
    name = "cargo xtask",
    about = "Build, check and benchmark k3-stack",
    version
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Print each tier (cpu, sm90, nvlink, kvm), whether it can run here, and why not.
    Doctor {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
        /// Boot the KVM probe guest again instead of reusing the cached verdict.
        #[arg(long)]
        recheck: bool,
    },
    /// Compile every `crates/*/kernels/*.cu` for sm_90a with nvcc (PATH, CUDA_HOME or the pip layout).
    BuildKernels {
        /// Output folder for the cubins.
        #[arg(long, default_value = "target/k3-kernels")]
        out: PathBuf,
    },
    /// Run every tier that can run here, skip the others with the reason, write target/k3-report/report.{json,md,html}.
    /// Under K3_REQUIRE_GPU=1 / K3_REQUIRE_KVM=1 / K3_REQUIRE_TIERS a selected tier that cannot run fails.
    Bench {
        /// Only these tiers (repeatable); default: all that can run.
        #[arg(long = "tier", value_name = "TIER")]
        tiers: Vec<Tier>,
        /// Only these systems (flashkda, moonep, agentenv; repeatable).
        #[arg(long = "system", value_name = "SYSTEM")]
        systems: Vec<String>,
        /// Use prebuilt bench binaries from this folder instead of `cargo run` (device bundles).
        #[arg(long, env = "K3_BIN_DIR")]
        bin_dir: Option<PathBuf>,
        /// Report folder.
        #[arg(long, default_value = "target/k3-report")]
        out: PathBuf,
        /// Append this run's entry (date, machine, commit, dirty flag, command) to a benchmarks file.
        #[arg(long, value_name = "FILE", num_args = 0..=1, default_missing_value = "docs/benchmarks.md")]
        record: Option<PathBuf>,
    },
    /// Reports: merge several machines' reports into one.
    Report {
        #[command(subcommand)]
        command: ReportCmd,
    },
    /// Build the release binaries and abi3 wheels a GPU machine without Rust needs, plus a run script.
    DeviceBundle {
        #[arg(long, default_value = ".bundle")]
        out: PathBuf,
        /// Skip the Python wheels.
        #[arg(long)]
        no_wheels: bool,
    },
    /// Run every check CI runs: fmt, clippy, kernels for sm_90a, all tests, simulator, e2b SDK tests.
    Test {
        /// Only the lib and bin unit tests of the whole workspace (fakes, no QEMU, etcd, S3 or GPU):
        /// the fast lane, under two minutes warm.
        #[arg(long)]
        fast: bool,
    },
    /// Check repository rules (file sizes, ARCHITECTURE.md coverage, no ignored tests).
    Tidy,
}

#[derive(Subcommand)]
enum ReportCmd {
    /// Join reports from several machines into one and render it.
    Merge {
        /// Input report.json files.
        #[arg(required = true)]
        inputs: Vec<PathBuf>,
        #[arg(long, default_value = "target/k3-report")]
        out: PathBuf,
    },
    /// Render report.md and report.html from a report.json.
    Render {
        input: PathBuf,
        #[arg(long, default_value = "target/k3-report")]
        out: PathBuf,
    },
}

/// Ends with the error chain, one cause a line (never a backtrace: the logs named above hold the rest).
fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            for cause in e.chain().skip(1) {
                eprintln!("  caused by: {cause}");
            }
            std::process::ExitCode::FAILURE
        }
    }
}

fn run() -> anyhow::Result<()> {
    k3_common::telemetry::init("info");
    let cli = Cli::parse();
    let root = util::repo_root()?;
    std::env::set_current_dir(&root)?;
    match cli.command {
        Cmd::Doctor { json, recheck } => doctor::run(json, recheck),
        Cmd::BuildKernels { out } => kernels::build_all(&out).map(|_| ()),
        Cmd::Bench {
            tiers,
            systems,
            bin_dir,
            out,
            record,
        } => bench::run(&bench::BenchArgs {
            tiers: &tiers,
            systems: &systems,
            bin_dir: bin_dir.as_deref(),
            out: &out,
            record: record.as_deref(),
        }),
        Cmd::Report {
            command: ReportCmd::Merge { inputs, out },
        } => render::merge(&inputs, &out),
        Cmd::Report {
            command: ReportCmd::Render { input, out },
        } => {
            let report = k3_common::Report::read(&input)?;
            render::write_all(&report, &out)
        }
        Cmd::DeviceBundle { out, no_wheels } => bundle::build(&out, !no_wheels),
        Cmd::Test { fast } => test::run(fast),
        Cmd::Tidy => {
            let problems = tidy::check(&root)?;
            let pending = tidy::refs::pending(&root);
            if !pending.is_empty() {
                println!(
                    "tidy: {} unresolved spec/notes reference(s) outside the checked scope \
                     (tidy::refs::SCOPE; their owners repoint them):",
                    pending.len()
                );
                for p in &pending {
                    println!("  {p}");
                }
            }
            if problems.is_empty() {
                println!("tidy: ok");
                Ok(())
            } else {
                for p in &problems {
                    eprintln!("tidy: {p}");
                }
                anyhow::bail!("{} tidy problem(s)", problems.len())
            }
        }
    }
}
