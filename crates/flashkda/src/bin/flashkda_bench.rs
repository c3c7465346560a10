//! `flashkda-bench --tier <cpu|sm90|nvlink|kvm> --out report.json`
//!
//! - cpu: reference timings (float64 recurrence vs chunked vs kernel-rounding emulation).
//! - sm90: our kernel on the six anchor shapes (T = 8192, H in {96, 64}, fixed / varlen6 /
//!   1024x8), CUDA-event timed, then fla's Triton `chunk_kda` timed in the same run by spawning
//!   `python3 bench_fla.py` (embedded in the binary; it also times the wheel and checks the fla
//!   backend hookup); anchor figures of the public FlashKDA are quoted as baselines.
//! - nvlink, kvm: flashkda has no figures there (a `skipped` entry).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Result;
use clap::Parser;
use cudarc::driver::{CudaStream, sys};
use flashkda::harness::{DeviceProblem, StateIo};
use flashkda::reference::emulated::emulated;
use flashkda::reference::{KdaProblem, chunked_f64, recurrence_f64};
use flashkda::{FwdArgs, FwdOptions, KdaKernels, KernelSchedule, ValueSplit, fwd, open_device};
use k3_common::Figure;
use k3_common::report::{Plot, PlotKind, Report, Section, Series, Skipped, Tier};

#[path = "flashkda_bench/bwd.rs"]
mod bwd;

/// Adds the GPU machine of a device run (which has no Rust, so only its GPU and tool versions are known)
/// to `report`, and returns its name.
fn push_device_machine(
    report: &mut Report,
    gpu: String,
    versions: BTreeMap<String, String>,
) -> String {
    let host = format!("{gpu} (device run)");
    report.machines.push(k3_common::report::Machine {
        hostname: host.clone(),
        os: String::new(),
        cpu: String::new(),
        cores: 0,
        mem_gib: 0.0,
        gpus: vec![gpu],
        versions,
    });
    host
}
#[path = "flashkda_bench/compare.rs"]
mod compare;
#[path = "flashkda_bench/fla.rs"]
mod fla;

#[derive(Parser, Debug)]
#[command(about = "flashkda benchmarks (writes a k3 report)")]
struct Args {
    #[arg(long)]
    tier: Tier,
    /// With `--tier sm90`: build the section from a `python/bench_compare.py` result instead of
    /// measuring (no GPU needed).
    #[arg(long)]
    from_compare: Option<PathBuf>,
    /// With `--tier sm90`: build the backward section from `python/bench_bwd.py --time` results
    /// (comma-separated; a later file's row replaces an earlier one) instead of measuring.
    #[arg(long, value_delimiter = ',')]
    from_bwd: Vec<PathBuf>,
    #[arg(long)]
    out: PathBuf,
    /// fla timing script (spawned for the same-run baseline); default: the copy embedded in this
    /// binary, so a bundle runs from any folder.
    #[arg(long)]
    fla_script: Option<PathBuf>,
    #[arg(long, default_value = "python3")]
    python: String,
    /// Skip the fla baseline.
    #[arg(long)]
    no_fla: bool,
    #[arg(long, default_value_t = 10)]
    warmup: usize,
    #[arg(long, default_value_t = 40)]
    iters: usize,
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Heads for the fla baseline (default: all of --heads).
    #[arg(long, value_delimiter = ',')]
    fla_heads: Vec<usize>,
    /// Cases for the fla baseline (fixed, varlen6, 1024x8; default all). fla autotunes
    /// 65-100 s per new (H, fixed/varlen) key on a fresh machine.
    #[arg(long, default_value = "fixed,varlen6,1024x8")]
    fla_cases: String,
    /// Report of an earlier sm90 run whose same-run fla figures are quoted (marked not same-run).
    #[arg(long)]
    fla_report: Option<PathBuf>,
    /// Heads to run on the sm90 tier.
    #[arg(long, default_value = "96,64", value_delimiter = ',')]
    heads: Vec<usize>,
    /// Kernel variants to time (sequential, pipelined, workspace-2, workspace-4, workspace-8;
    /// default all), e.g. only those that passed the GPU accuracy tests.
    #[arg(long, value_delimiter = ',')]
    kernels: Vec<String>,
    /// Do not time the Python wheel in the fla process (its `Auto` kernel failed its tests).
    #[arg(long)]
    no_fla_wheel: bool,
}

/// The variants compared with fla (which is timed with an fp32 state in and out).
const HEADLINES: [&str; 5] = [
    "fp32 state, sequential",
    "fp32 state, pipelined",
    "fp32 state, workspace 4 slices",
    "fp32 state, workspace 2 slices",
    "fp32 state, workspace 8 slices",
];

/// Timed variants: (label, kernel name for `--kernels`, state I/O, split, schedule).
fn variants() -> Vec<(
    &'static str,
    &'static str,
    StateIo,
    ValueSplit,
    KernelSchedule,
)> {
    use KernelSchedule::{Pipelined, Sequential, Workspace};
    let f32s = StateIo::both(true);
    let bf16s = StateIo::both(false);
    vec![
        (
            HEADLINES[0],
            "sequential",
            f32s,
            ValueSplit::Two,
            Sequential,
        ),
        (HEADLINES[1], "pipelined", f32s, ValueSplit::Two, Pipelined),
        (
            HEADLINES[2],
            "workspace-4",
            f32s,
            ValueSplit::Four,
            Workspace,
        ),
        (
            HEADLINES[3],
            "workspace-2",
            f32s,
            ValueSplit::Two,
            Workspace,
        ),
        (
            HEADLINES[4],
            "workspace-8",
            f32s,
            ValueSplit::Eight,
            Workspace,
        ),
        (
            "bf16 state, pipelined",
            "pipelined",
            bf16s,
            ValueSplit::Two,
            Pipelined,
        ),
        (
            "bf16 state, workspace 4 slices",
            "workspace-4",
            bf16s,
            ValueSplit::Four,
            Workspace,
        ),
        (
            "no state, pipelined",
            "pipelined",
            StateIo::NONE,
            ValueSplit::Two,
            Pipelined,
        ),
        (
            "no state, workspace 4 slices",
            "workspace-4",
            StateIo::NONE,
            ValueSplit::Four,
            Workspace,
        ),
    ]
}

const CASES: [(&str, &[usize]); 3] = [
    ("fixed", &[8192]),
    ("varlen6", &[1300, 547, 2048, 963, 271, 3063]),
    ("1024x8", &[1024, 1024, 1024, 1024, 1024, 1024, 1024, 1024]),
];

/// (H, case) -> (fla chunk_kda, public FlashKDA best state variant), ms, from shared/anchors.md.
fn anchor(h: usize, case: &str) -> Option<(f64, f64)> {
    Some(match (h, case) {
        (96, "fixed") => (2.632, 1.405),
        (96, "varlen6") => (2.657, 1.362),
        (96, "1024x8") => (2.628, 1.168),
        (64, "fixed") => (1.741, 1.187),
        (64, "varlen6") => (1.802, 0.987),
        (64, "1024x8") => (1.799, 0.790),
        _ => return None,
    })
}

use k3_common::machine::{hostname, probe as machine};
use k3_common::stats::median;

fn run_cpu(report: &mut Report) {
    let p = KdaProblem::random(&[512], 4, true, 1);
    let mut figures = Vec::new();
    let mut time = |name: &str, f: &dyn Fn()| {
        let samples: Vec<f64> = (0..3)
            .map(|_| {
                let t = Instant::now();
                f();
                t.elapsed().as_secs_f64() * 1e3
            })
            .collect();
        figures.push(
            Figure::timing(name, &samples, "ms")
                .param("H", 4)
                .param("T", 512),
        );
    };
    time("reference recurrence f64", &|| drop(recurrence_f64(&p)));
    time("reference chunked f64 (C=16)", &|| {
        drop(chunked_f64(&p, 16))
    });
    time("reference kernel-rounding emulation", &|| {
        drop(emulated(&p))
    });
    report.sections.push(Section {
        system: "flashkda".into(),
        tier: Tier::Cpu,
        title: "KDA CPU references".into(),
        machine: hostname(),
        figures,
        plots: vec![],
        notes: vec![
            "command: flashkda-bench --tier cpu; one sequence of 512 tokens, 4 heads, state in+out; median of 3 runs, all cores".into(),
        ],
    });
}

/// Times `fwd` with CUDA events: warm-up, then `repeats` blocks of `iters` calls.
fn time_fwd(
    a: &Args,
    kernels: &KdaKernels,
    stream: &Arc<CudaStream>,
    args: &FwdArgs,
    opts: &FwdOptions,
) -> Result<(Vec<f64>, Vec<f64>)> {
    for _ in 0..a.warmup {
        fwd(kernels, stream, args, opts)?;
    }
    stream.synchronize()?;
    let ctx = kernels.context();
    let (mut all, mut blocks) = (Vec::new(), Vec::new());
    for _ in 0..a.repeats {
        let mut evs = Vec::with_capacity(a.iters);
        for _ in 0..a.iters {
            let s = ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))?;
            let e = ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))?;
            s.record(stream)?;
            fwd(kernels, stream, args, opts)?;
            e.record(stream)?;
            evs.push((s, e));
        }
        stream.synchronize()?;
        let ms: Vec<f64> = evs
            .iter()
            .map(|(s, e)| s.elapsed_ms(e).map(f64::from))
            .collect::<Result<_, _>>()?;
        blocks.push(median(&ms));
        all.extend(ms);
    }
    Ok((all, blocks))
}

/// The fla process's part of this run.
fn fla_request(a: &Args) -> fla::FlaRequest {
    fla::FlaRequest {
        python: a.python.clone(),
        script: a.fla_script.clone(),
        heads: if a.fla_heads.is_empty() {
            a.heads.clone()
        } else {
            a.fla_heads.clone()
        },
        cases: a.fla_cases.split(',').map(str::to_string).collect(),
        wheel: !a.no_fla_wheel,
        warmup: a.warmup,
        iters: a.iters,
        repeats: a.repeats,
    }
}

fn run_sm90(a: &Args, report: &mut Report) -> Result<()> {
    let ctx = match open_device(0) {
        Ok(c) => c,
        Err(e) => {
            report.skipped.push(Skipped {
                tier: Tier::Sm90,
                machine: hostname(),
                what: "flashkda".into(),
                reason: e.to_string(),
            });
            return Ok(());
        }
    };
    let kernels = match KdaKernels::load(&ctx) {
        Ok(k) => k,
        Err(e) => {
            report.skipped.push(Skipped {
                tier: Tier::Sm90,
                machine: hostname(),
                what: "flashkda".into(),
                reason: e.to_string(),
            });
            return Ok(());
        }
    };
    // a baseline that was asked for must be able to run: find out before timing anything
    let fla_req = (!a.no_fla).then(|| fla_request(a));
    if let Some(req) = &fla_req {
        req.preflight()?;
    }
    // fla from an earlier run's report (when this run could not afford fla's autotuning)
    let (earlier, fla_earlier) = match &a.fla_report {
        Some(path) => {
            let want: Vec<(usize, String)> = a
                .heads
                .iter()
                .flat_map(|&h| CASES.iter().map(move |(c, _)| (h, c.to_string())))
                .collect();
            let (old, found) = fla::earlier_fla(path, &want)?;
            (Some((path, old)), found)
        }
        None => (None, fla::ByShape::new()),
    };
    let gpu = ctx.name().unwrap_or_default();
    let stream = ctx.new_stream()?;
    let mut figures = Vec::new();
    let mut lines = Vec::new();
    for &h in &a.heads {
        for (case, lens) in CASES {
            let p = KdaProblem::random(lens, h, true, 0x6b64 + h as u64);
            let picked: Vec<_> = variants()
                .into_iter()
                .filter(|v| a.kernels.is_empty() || a.kernels.iter().any(|k| k == v.1))
                .collect();
            let dev_f32 = DeviceProblem::upload(&stream, &p, StateIo::both(true), false)?;
            let dev_bf16 = DeviceProblem::upload(&stream, &p, StateIo::both(false), false)?;
            for (label, _, state, split, schedule) in picked {
                let mut args = if state.fp32 || !state.initial {
                    dev_f32.args()
                } else {
                    dev_bf16.args()
                };
                if !state.initial {
                    args.initial_state = None;
                    args.final_state = None;
                }
                let opts = FwdOptions {
                    value_split: split,
                    schedule,
                    ..Default::default()
                };
                let (samples, blocks) = time_fwd(a, &kernels, &stream, &args, &opts)?;
                let m = median(&samples);
                let spread = blocks.iter().cloned().fold(f64::MIN, f64::max)
                    / blocks.iter().cloned().fold(f64::MAX, f64::min)
                    - 1.0;
                tracing::info!(h, case, label, median_ms = m, ?blocks, "timed");
                lines.push(format!("H={h} {case} flashkda [{label}]: median {m:.4} ms, block medians {blocks:.4?} (spread {:.1} %)", spread * 100.0));
                let mut f =
                    Figure::timing(format!("kda fwd H={h} {case} [{label}]"), &samples, "ms")
                        .param("H", h)
                        .param("case", case)
                        .param("state", label)
                        .param("chains", lens.len() * h);
                if let (true, Some((fla, fk))) = (HEADLINES.contains(&label), anchor(h, case)) {
                    f = f
                        .baseline(
                            "public FlashKDA (anchor 2026-11-29, best state variant)",
                            fk,
                            false,
                        )
                        .baseline("fla chunk_kda (anchor 2026-11-29)", fla, false);
                }
                figures.push(f);
            }
        }
    }
    let mut versions = BTreeMap::new();
    let mut notes = vec![
        format!(
            "command: flashkda-bench --tier sm90 --out {} (warm-up {}, {} blocks x {} calls, CUDA events around each public call incl. the cu_seqlens check)",
            a.out.display(),
            a.warmup,
            a.repeats,
            a.iters
        ),
        format!(
            "GPU: {gpu}; inputs per docs/specs/kda.md §4 (bf16 randn, A_log/dt_bias U(0,1), lower_bound -5, state 0.1 randn); headline = fp32 state in+out (what fla is timed with)"
        ),
    ];
    notes.extend(lines);
    // fla in the same run (its rows, every one asked for, or an error)
    let mut fla = fla::ByShape::new();
    if let Some(req) = &fla_req {
        let res = req.run()?;
        versions.extend(res.env);
        for row in res.rows {
            let (h, case) = (row.h, row.case.clone());
            fla.insert((h, case.clone()), row.fla_median());
            notes.push(format!(
                "H={h} {case} fla chunk_kda (same run): median {:.4} ms, block medians {:?}, first call {:.1} s",
                row.fla_median(),
                row.fla_block_medians,
                row.fla_first_call_s
            ));
            if let Some((ws, vs_fla)) = row.wheel {
                figures.push(
                    Figure::timing(
                        format!("kda fwd H={h} {case} [python wheel, fp32 state]"),
                        &ws,
                        "ms",
                    )
                    .param("H", h)
                    .param("case", case.as_str()),
                );
                notes.push(format!(
                    "H={h} {case} flashkda via wheel vs fla output: {vs_fla}"
                ));
            }
        }
        if let Some(hookup) = res.hookup {
            notes.push(format!("fla backend hookup check: {hookup}"));
        }
    }
    if let Some((path, old)) = &earlier {
        notes.push(format!("fla chunk_kda from an earlier run on the same machine kind ({}, created {}), not this run", path.display(), old.created));
    }
    let mut series: Vec<Series> = HEADLINES
        .iter()
        .map(|l| format!("flashkda {l}"))
        .chain(
            [
                "fla chunk_kda, same run",
                "fla chunk_kda, earlier run",
                "public FlashKDA (anchor)",
            ]
            .map(String::from),
        )
        .map(|name| Series {
            name,
            points: vec![],
        })
        .collect();
    for f in figures.iter_mut() {
        let (Some(h), Some(case)) = (
            f.params.get("H").and_then(|x| x.parse::<usize>().ok()),
            f.params.get("case").cloned(),
        ) else {
            continue;
        };
        let Some(which) = HEADLINES
            .iter()
            .position(|l| f.params.get("state").map(String::as_str) == Some(*l))
        else {
            continue;
        };
        let x = format!("H={h} {case}");
        series[which].points.push((x.clone(), f.value));
        if let Some(&m) = fla.get(&(h, case.clone())) {
            *f = f
                .clone()
                .baseline("fla chunk_kda (Triton), same run", m, true);
            push_once(&mut series[HEADLINES.len()], &x, m);
            notes.push(format!(
                "{x} [{}]: {:.2}x faster than fla chunk_kda (same run, {m:.4} ms)",
                HEADLINES[which],
                m / f.value
            ));
        }
        if let Some(&m) = fla_earlier.get(&(h, case.clone())) {
            *f = f
                .clone()
                .baseline("fla chunk_kda (Triton), earlier run", m, false);
            push_once(&mut series[HEADLINES.len() + 1], &x, m);
            notes.push(format!(
                "{x} [{}]: {:.2}x faster than fla chunk_kda (earlier run, {m:.4} ms)",
                HEADLINES[which],
                m / f.value
            ));
        }
        if let Some((_, fk)) = anchor(h, &case) {
            push_once(&mut series[HEADLINES.len() + 2], &x, fk);
            notes.push(format!(
                "{x} [{}]: {:.2}x vs public FlashKDA anchor {fk} ms",
                HEADLINES[which],
                fk / f.value
            ));
        }
    }
    // headline: the fastest fp32-state variant of this run per shape, against fla of this run
    let mut best: BTreeMap<(usize, String), (f64, String)> = BTreeMap::new();
    for f in &figures {
        let (Some(h), Some(case), Some(label)) = (
            f.params.get("H").and_then(|x| x.parse::<usize>().ok()),
            f.params.get("case"),
            f.params.get("state"),
        ) else {
            continue;
        };
        if !HEADLINES.contains(&label.as_str()) {
            continue;
        }
        let e = best
            .entry((h, case.clone()))
            .or_insert((f64::MAX, String::new()));
        if f.value < e.0 {
            *e = (f.value, label.clone());
        }
    }
    for ((h, case), (ms, label)) in &best {
        if let Some(&m) = fla.get(&(*h, case.clone())) {
            notes.push(format!(
                "BEST H={h} {case}: flashkda [{label}] {ms:.4} ms vs fla chunk_kda (same run) {m:.4} ms = {:.2}x",
                m / ms
            ));
        }
    }
    series.retain(|s| !s.points.is_empty());
    report.machines.push(machine(vec![gpu], versions));
    report.sections.push(Section {
        system: "flashkda".into(),
        tier: Tier::Sm90,
        title: "KDA chunked-prefill forward, T = 8192, K = V = 128".into(),
        machine: hostname(),
        figures,
        plots: vec![Plot {
            title: "KDA forward time per shape".into(),
            kind: PlotKind::Bars,
            x_label: "shape".into(),
            y_label: "ms (lower is better)".into(),
            series,
        }],
        notes,
    });
    Ok(())
}

/// Adds `(x, y)` to `s` unless `x` is already there (one baseline point per shape).
fn push_once(s: &mut Series, x: &str, y: f64) {
    if !s.points.iter().any(|(px, _)| px == x) {
        s.points.push((x.to_string(), y));
    }
}

fn main() -> Result<()> {
    k3_common::telemetry::init("info");
    let a = Args::parse();
    let mut report = Report::here();
    match a.tier {
        Tier::Cpu => {
            report.machines.push(machine(vec![], BTreeMap::new()));
            run_cpu(&mut report);
        }
        Tier::Sm90 => match &a.from_compare {
            Some(path) => compare::add_compare_section(path, &mut report)?,
            None if !a.from_bwd.is_empty() => bwd::add_bwd_section(&a.from_bwd, &mut report)?,
            None => run_sm90(&a, &mut report)?,
        },
        t => report.skipped.push(Skipped {
            tier: t,
            machine: hostname(),
            what: "flashkda".into(),
            reason: format!("flashkda has no {t} benchmarks"),
        }),
    }
    report.write(&a.out)?;
    for s in &report.sections {
        for f in &s.figures {
            println!("{} = {:.4} {}", f.name, f.value, f.unit);
        }
        for n in &s.notes {
            println!("note: {n}");
        }
    }
    for s in &report.skipped {
        println!("skipped {}: {}", s.tier, s.reason);
    }
    Ok(())
}
