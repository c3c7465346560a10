//! `moonep-bench --tier <cpu|nvlink> --out report.json` (bench contract of `cargo xtask bench`).
//!
//! - cpu: planner latency (stages A–C on the gathered `tpe`, stage D for one rank) on DSv3-like
//!   and K3-like configs at EP 8/64/256 (median µs, one CPU thread), plus a simulator sweep summary
//!   (CSV and SVGs beside the report, plots in the report).
//! - nvlink: delegated to `moonep::gpu::bench::run_nvlink` (moonep-gpu); its error becomes a
//!   `skipped` entry with the reason.
//! - sm90, kvm: not measured by moonep (skipped entry).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Parser;
use k3_common::machine;
use k3_common::report::{Better, Figure, Report, Section, Skipped, Tier};
use moonep::plan::{plan_entries, plan_global};
use moonep::router::{Placement, Skew, WorkloadSpec, generate};
use moonep::sim::{self, Policy, SimRow, SweepSpec};

#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// Hardware tier to measure.
    #[arg(long)]
    tier: Tier,
    /// Report JSON to write.
    #[arg(long)]
    out: PathBuf,
    /// Fewer planner iterations and the quick simulator sweep.
    #[arg(long)]
    quick: bool,
}

fn main() -> Result<()> {
    k3_common::telemetry::init("info");
    let args = Args::parse();
    let machine = machine::probe(Vec::new(), BTreeMap::new());
    let host = machine.hostname.clone();
    let mut report = Report::here();
    report.machines.push(machine);
    let command = format!(
        "moonep-bench --tier {} --out {}{}",
        args.tier,
        args.out.display(),
        if args.quick { " --quick" } else { "" }
    );
    match args.tier {
        Tier::Cpu => report.sections.push(cpu_tier(&host, &args, &command)?),
        Tier::Nvlink => nvlink_tier(&mut report, &host),
        tier => report.skipped.push(Skipped {
            tier,
            machine: host,
            what: "moonep".into(),
            reason: format!("moonep has no {tier} tier (cpu and nvlink only)"),
        }),
    }
    if let Some(dir) = args.out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    report.write(&args.out)?;
    println!("wrote {}", args.out.display());
    Ok(())
}

/// The nvlink tier (contract documented on `moonep::gpu::bench::run_nvlink`).
fn nvlink_tier(report: &mut Report, host: &str) {
    let opts = moonep::gpu::bench::NvlinkOptions::default();
    match moonep::gpu::bench::run_nvlink(&opts) {
        Ok(sections) => report.sections.extend(sections),
        Err(e) => report.skipped.push(Skipped {
            tier: Tier::Nvlink,
            machine: host.into(),
            what: "moonep".into(),
            reason: e.to_string(),
        }),
    }
}

/// One planner configuration.
struct PlanCase {
    name: &'static str,
    ranks: usize,
    experts: usize,
    top_k: usize,
}

const PLAN_CASES: [PlanCase; 6] = [
    PlanCase {
        name: "DSv3-like",
        ranks: 8,
        experts: 256,
        top_k: 8,
    },
    PlanCase {
        name: "DSv3-like",
        ranks: 64,
        experts: 256,
        top_k: 8,
    },
    PlanCase {
        name: "DSv3-like",
        ranks: 256,
        experts: 256,
        top_k: 8,
    },
    PlanCase {
        name: "K3-like",
        ranks: 8,
        experts: 896,
        top_k: 16,
    },
    PlanCase {
        name: "K3-like",
        ranks: 64,
        experts: 896,
        top_k: 16,
    },
    PlanCase {
        name: "K3-like",
        ranks: 256,
        experts: 1024,
        top_k: 16,
    },
];

/// Tokens per rank of the planner timing (docs/specs/moonep.md §6.1, S = 4096).
const PLAN_TOKENS: u32 = 4096;

fn cpu_tier(host: &str, args: &Args, command: &str) -> Result<Section> {
    let iters = if args.quick { 5 } else { 31 };
    let mut figures = Vec::new();
    for case in &PLAN_CASES {
        figures.extend(time_planner(case, iters)?);
    }
    let spec = if args.quick {
        SweepSpec::quick()
    } else {
        SweepSpec::full()
    };
    let start = Instant::now();
    let rows = sim::run_sweep(&spec)?;
    let sweep_secs = start.elapsed().as_secs_f64();
    let sim_dir = args.out.with_extension("moonep-sim");
    std::fs::create_dir_all(&sim_dir).with_context(|| format!("creating {}", sim_dir.display()))?;
    sim::write_csv(&rows, &sim_dir.join("moonep-sim.csv"))?;
    let svgs = sim::write_svgs(&rows, &sim_dir)?;
    figures.extend(sim_figures(&rows));
    let mut notes = vec![
        format!("command: {command}"),
        "planner: pure Rust, one CPU thread, release build; A–C = plan_global on the gathered tpe (every \
         rank runs it), D = plan_entries for rank 0 (s*K entries). Workload: Zipf maxvio 2, random \
         placement, s = 4096 tokens per rank."
            .into(),
        "anchor (same_run false, different hardware): the upstream varlen fork plans A–D in one CUDA \
         kernel in 43–51 us on 8xH200 (E=896, s=1024..8192)."
            .into(),
        format!(
            "simulator: {} rows ({} shapes x {} workloads x {} policies) in {sweep_secs:.2} s; CSV and SVGs in {}",
            rows.len(),
            spec.shapes.len(),
            spec.workloads.len(),
            spec.policies.len(),
            sim_dir.display()
        ),
        "simulator model: per-rank load from tpe only; dispatch time = max over ranks of max(remote in, \
         remote out) bytes / 450 GB/s + 10 us, replica weight pushes (3*H*H'*2 bytes each, H=7168, \
         H'=2048) counted and not overlapped; GEMM proxy at 600 TFLOP/s."
            .into(),
    ];
    notes.extend(svgs.iter().map(|p| format!("plot: {}", p.display())));
    Ok(Section {
        system: "moonep".into(),
        tier: Tier::Cpu,
        title: "moonep planner latency and cluster simulator".into(),
        machine: host.into(),
        figures,
        plots: sim::report_plots(&rows),
        notes,
    })
}

fn time_planner(case: &PlanCase, iters: usize) -> Result<Vec<Figure>> {
    let spec = WorkloadSpec {
        experts: case.experts,
        top_k: case.top_k,
        tokens: vec![PLAN_TOKENS; case.ranks],
        skew: Skew::Zipf { maxvio: 2.0 },
        placement: Placement::Random,
        seed: 7,
    };
    let routing = generate(&spec)?;
    let cfg = routing.plan_config(PLAN_TOKENS, 128);
    let topk = routing.topk(0, 7);
    let (mut global_us, mut entries_us) = (Vec::new(), Vec::new());
    let mut replicas = 0;
    for _ in 0..iters {
        let t0 = Instant::now();
        let plan = plan_global(&cfg, &routing.tpe)?;
        let t1 = Instant::now();
        let dst = plan_entries(&cfg, &plan, 0, &topk)?;
        let t2 = Instant::now();
        std::hint::black_box(&dst);
        global_us.push((t1 - t0).as_secs_f64() * 1e6);
        entries_us.push((t2 - t1).as_secs_f64() * 1e6);
        replicas = (0..case.ranks).map(|d| plan.replicas_on(d)).sum::<usize>();
    }
    let params = |f: Figure| {
        f.param("config", case.name)
            .param("EP", case.ranks)
            .param("E", case.experts)
            .param("K", case.top_k)
            .param("s", PLAN_TOKENS)
            .param("replicas", replicas)
    };
    let mut a_c = params(Figure::timing(
        format!("plan A–C {} EP{}", case.name, case.ranks),
        &global_us,
        "us",
    ));
    if case.name == "K3-like" && case.ranks == 8 {
        a_c = a_c.baseline("varlen fork, CUDA plan A–D, 8xH200 (anchor)", 51.0, false);
    }
    let d = params(Figure::timing(
        format!("plan D (one rank) {} EP{}", case.name, case.ranks),
        &entries_us,
        "us",
    ));
    Ok(vec![a_c, d])
}

/// Headline simulator figures: Zipf maxvio 2, random placement, per shape.
fn sim_figures(rows: &[SimRow]) -> Vec<Figure> {
    let find = |r: &SimRow, policy: &str| {
        rows.iter().find(|n| {
            n.policy == policy
                && (n.shape.as_str(), n.ranks, n.experts) == (r.shape.as_str(), r.ranks, r.experts)
                && (n.workload.as_str(), n.param.as_str(), n.placement.as_str())
                    == (r.workload.as_str(), r.param.as_str(), r.placement.as_str())
        })
    };
    let mut out = Vec::new();
    for r in rows.iter().filter(|r| {
        r.policy == Policy::MoonEp.label()
            && r.workload == "zipf"
            && r.param == "2"
            && r.placement == "random"
    }) {
        let tag = format!("{} EP{} E={}", r.shape, r.ranks, r.experts);
        let with = |f: Figure| {
            f.param("config", &r.shape)
                .param("EP", r.ranks)
                .param("E", r.experts)
                .param("K", r.top_k)
                .param("s", r.tokens)
                .param("maxvio", format!("{:.2}", r.maxvio))
                .param("workload", "zipf, random placement")
        };
        let none = find(r, "none");
        let mut load = with(Figure::new(
            format!("sim rank load max/mean, moonep, {tag}"),
            r.load_max_over_mean,
            "x",
            Better::Lower,
        ));
        if let Some(n) = none {
            load = load.baseline(
                "no balancing (simulated, same run)",
                n.load_max_over_mean,
                true,
            );
        }
        if let Some(c) = find(r, &Policy::Capacity { cf: 1.25 }.label()) {
            load = load.baseline(
                "capacity cf=1.25 drop (simulated, same run)",
                c.load_max_over_mean,
                true,
            );
        }
        out.push(load);
        out.push(with(Figure::new(
            format!("sim moonep replicas, {tag}"),
            r.replicas_total as f64,
            "replicas",
            Better::Lower,
        )));
        out.push(with(Figure::new(
            format!("sim moonep migrated tokens, {tag}"),
            100.0 * r.migrated_fraction,
            "%",
            Better::Lower,
        )));
        let mut gemm = with(Figure::new(
            format!("sim busiest-rank GEMM proxy, moonep, {tag}"),
            r.gemm_us,
            "us",
            Better::Lower,
        ));
        if let Some(n) = none {
            gemm = gemm.baseline("no balancing (simulated, same run)", n.gemm_us, true);
        }
        out.push(gemm);
        let mut comm = with(Figure::new(
            format!("sim dispatch bandwidth model, moonep, {tag}"),
            r.comm_us,
            "us",
            Better::Lower,
        ));
        if let Some(n) = none {
            comm = comm.baseline("no balancing (simulated, same run)", n.comm_us, true);
        }
        out.push(comm);
    }
    out
}
