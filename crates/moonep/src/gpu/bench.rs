//! nvlink-tier benchmark (docs/specs/moonep.md §6): moonep dispatch (planning included) and combine
//! against the Megatron-style baseline, measured in the same run on every rank, over a rank-level
//! skew sweep (share of copies to rank 0's experts, 50%..95%) and a maxvio sweep (Zipf, clustered
//! placement), at the DSv3-like and K3-like configs. Figures are the median over iterations of the
//! slowest rank's time (CUDA events, ranks aligned by a device barrier before each iteration).
//!
//! Contract with `moonep-bench --tier nvlink` (moonep-cpu): call
//! [`run_nvlink`]`(&NvlinkOptions::default())`; `Ok(sections)` go into the report, `Err(e)` becomes
//! a `skipped` entry with `e.to_string()` as the reason. It spawns `moonep-launch -n 2 --
//! moonep-gpu-rank bench` from the directory of the current executable (or `MOONEP_BIN_DIR`).

use std::path::PathBuf;

use k3_common::machine::hostname;
use k3_common::report::{Figure, Plot, PlotKind, Report, Section, Series, Tier};
use k3_common::stats::median;

use super::GpuError;
use super::baseline::Baseline;
use super::driver::Device;
use super::ep::{EpBuffer, EpConfig, Tokens, plan_config};
use super::rank::Rank;
use super::selftest::check_plan;
use super::selftest::{random_bf16, tpe_of};
use crate::plan::{plan_entries, plan_global};
use crate::router::{Placement, Skew, WorkloadSpec, generate};

/// Benchmark knobs.
#[derive(Debug, Clone)]
pub struct NvlinkOptions {
    pub warmup: usize,
    pub iters: usize,
    /// Blocks for the comm kernels (moonep and baseline).
    pub num_blocks: u32,
    /// Rank-level skews (share of copies to rank 0's experts).
    pub shares: Vec<f64>,
    /// Expert-level maxvio targets (Zipf, clustered placement).
    pub maxvios: Vec<f64>,
    /// Only the DSv3-like config.
    pub dsv3_only: bool,
}

impl Default for NvlinkOptions {
    fn default() -> Self {
        NvlinkOptions {
            warmup: 20,
            iters: 50,
            num_blocks: 64,
            shares: vec![0.5, 0.6, 0.75, 0.85, 0.9, 0.95],
            maxvios: vec![0.0, 0.5, 1.0, 2.0, 4.0],
            dsv3_only: false,
        }
    }
}

/// One benchmark configuration.
#[derive(Debug, Clone, Copy)]
struct Config {
    name: &'static str,
    experts: usize,
    k: usize,
    s: usize,
    h: usize,
}

const CONFIGS: [Config; 2] = [
    Config {
        name: "DSv3-like",
        experts: 256,
        k: 8,
        s: 4096,
        h: 7168,
    },
    Config {
        name: "K3-like",
        experts: 896,
        k: 16,
        s: 4096,
        h: 7168,
    },
];

fn bin_dir() -> Result<PathBuf, GpuError> {
    if let Some(d) = std::env::var_os("MOONEP_BIN_DIR") {
        return Ok(PathBuf::from(d));
    }
    let exe = std::env::current_exe().map_err(|source| GpuError::Io {
        what: "current_exe".into(),
        source,
    })?;
    let dir = exe
        .parent()
        .ok_or_else(|| GpuError::Env("executable has no directory".into()))?;
    // Test and bench executables live in target/<profile>/deps.
    Ok(if dir.ends_with("deps") {
        dir.parent().unwrap_or(dir).to_path_buf()
    } else {
        dir.to_path_buf()
    })
}

/// Why the nvlink tier cannot run here, if it cannot (no kernels, driver, 2 GPUs or peer access).
pub fn unavailable_reason() -> Option<String> {
    if !super::driver::kernels_embedded() {
        return Some(GpuError::NoKernels.to_string());
    }
    match super::driver::device_count() {
        Err(e) => Some(e.to_string()),
        Ok(n) if n < 2 => Some(format!("{n} CUDA device(s); the nvlink tier needs 2")),
        Ok(_) => match super::driver::can_access_peer(0, 1) {
            Ok(true) => None,
            Ok(false) => Some("devices 0 and 1 have no peer access".into()),
            Err(e) => Some(e.to_string()),
        },
    }
}

/// Runs the benchmark on 2 GPUs through the launcher and returns its report sections.
pub fn run_nvlink(opts: &NvlinkOptions) -> Result<Vec<Section>, GpuError> {
    if let Some(reason) = unavailable_reason() {
        return Err(GpuError::Env(reason));
    }
    let dir = bin_dir()?;
    let out = std::env::temp_dir().join(format!("moonep-nvlink-{}.json", std::process::id()));
    let mut args = vec![
        "bench".to_string(),
        "--out".into(),
        out.display().to_string(),
        "--warmup".into(),
        opts.warmup.to_string(),
        "--iters".into(),
        opts.iters.to_string(),
        "--num-blocks".into(),
        opts.num_blocks.to_string(),
        "--shares".into(),
        opts.shares
            .iter()
            .map(|x| x.to_string())
            .collect::<Vec<_>>()
            .join(","),
        "--maxvios".into(),
        opts.maxvios
            .iter()
            .map(|x| x.to_string())
            .collect::<Vec<_>>()
            .join(","),
    ];
    if opts.dsv3_only {
        args.push("--dsv3-only".into());
    }
    super::launch::launch(2, &dir.join("moonep-gpu-rank"), &args, 0)
        .map_err(|e| GpuError::Env(format!("launching {}/moonep-gpu-rank: {e}", dir.display())))?;
    let report = Report::read(&out).map_err(|e| GpuError::Env(e.to_string()))?;
    let _ = std::fs::remove_file(&out);
    Ok(report.sections)
}

/// Times `op` `iters` times after `warmup` runs; every iteration starts with a host barrier and a
/// device barrier so both ranks' events bracket the same collective call. Returns this rank's
/// samples (ms).
fn time_op(
    rank: &mut Rank,
    buf: &mut EpBuffer,
    warmup: usize,
    iters: usize,
    mut op: impl FnMut(&mut Rank, &mut EpBuffer) -> Result<(), GpuError>,
) -> Result<Vec<f64>, GpuError> {
    let (a, b) = (rank.dev.event()?, rank.dev.event()?);
    let mut out = Vec::with_capacity(iters);
    for it in 0..warmup + iters {
        rank.store.barrier()?;
        buf.barrier(&rank.dev)?;
        rank.dev.record(&a)?;
        op(rank, buf)?;
        rank.dev.record(&b)?;
        buf.check(&rank.dev)?;
        if it >= warmup {
            out.push(f64::from(a.elapsed_ms(&b)?));
        }
    }
    Ok(out)
}

/// Per-iteration maximum over ranks (all ranks get it).
fn slowest(rank: &mut Rank, mine: &[f64]) -> Result<Vec<f64>, GpuError> {
    let bytes: Vec<u8> = mine.iter().flat_map(|x| x.to_le_bytes()).collect();
    let all = rank.store.all_gather(&bytes)?;
    let per: Vec<Vec<f64>> = all
        .iter()
        .map(|v| {
            v.chunks_exact(8)
                .map(|c| f64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
                .collect()
        })
        .collect();
    Ok((0..mine.len())
        .map(|i| per.iter().map(|p| p[i]).fold(f64::MIN, f64::max))
        .collect())
}

/// Anchor figures (anchors.md, torch permute + all_to_all_single, same hardware kind).
fn anchor(share: f64) -> Option<f64> {
    [(0.5, 1.113), (0.6, 1.176), (0.75, 1.255), (0.9, 1.492)]
        .iter()
        .find(|(s, _)| (s - share).abs() < 1e-9)
        .map(|x| x.1)
}

struct Point {
    label: String,
    params: Vec<(String, String)>,
    share: Option<f64>,
    ms: [Vec<f64>; 6],
}

const OPS: [&str; 6] = [
    "moonep dispatch incl. plan (dedup)",
    "moonep dispatch incl. plan (no dedup)",
    "moonep plan",
    "moonep combine",
    "baseline dispatch (permute + a2a-v + permute-2)",
    "baseline combine (unpermute-2 + a2a-v + unpermute-1)",
];

/// Rank side of the benchmark; rank 0 returns the report sections.
pub fn bench_rank(rank: &mut Rank, opts: &NvlinkOptions) -> Result<Option<Vec<Section>>, GpuError> {
    let mut sections = Vec::new();
    let configs: Vec<Config> = CONFIGS
        .iter()
        .copied()
        .filter(|c| !opts.dsv3_only || c.name == "DSv3-like")
        .collect();
    for c in configs {
        let sec = bench_config(rank, opts, c)?;
        sections.push(sec);
    }
    Ok((rank.env.rank == 0).then_some(sections))
}

fn bench_config(rank: &mut Rank, opts: &NvlinkOptions, c: Config) -> Result<Section, GpuError> {
    let (me, r) = (rank.env.rank, rank.env.world);
    let mut cfg = EpConfig::new(c.experts, c.k, c.s, c.h);
    cfg.num_blocks = opts.num_blocks;
    let mut buf = EpBuffer::new(rank, cfg)?;
    let mut base = Baseline::new(rank, cfg)?;
    let x = rank.dev.upload(&random_bf16(c.s, c.h, 77 + me as u64))?;
    let out = rank.dev.alloc(c.s * c.h * 2)?;
    let mut workloads: Vec<(String, Option<f64>, Skew)> = opts
        .shares
        .iter()
        .map(|&f| {
            (
                format!("share {:.0}%", f * 100.0),
                Some(f),
                Skew::RankShare { share: f },
            )
        })
        .collect();
    workloads.extend(
        opts.maxvios
            .iter()
            .map(|&m| (format!("maxvio {m}"), None, Skew::Zipf { maxvio: m })),
    );
    let mut points = Vec::new();
    for (i, (label, share, skew)) in workloads.into_iter().enumerate() {
        let spec = WorkloadSpec {
            experts: c.experts,
            top_k: c.k,
            tokens: vec![c.s as u32; r],
            skew,
            placement: Placement::Clustered,
            seed: 500 + i as u64,
        };
        let routing = generate(&spec).map_err(|e| GpuError::Invalid(e.to_string()))?;
        let topk: Vec<i32> = routing
            .topk(me, 900 + i as u64)
            .iter()
            .map(|&e| e as i32)
            .collect();
        let topk_d = rank.dev.upload(&topk)?;
        let tpe_d = rank.dev.upload(&tpe_of(&topk, c.experts))?;
        let (w, it) = (opts.warmup, opts.iters);
        let (xp, tk, tp, s) = (x.ptr, topk_d.ptr, tpe_d.ptr, c.s);
        buf.cfg.dedup = true;
        let d1 = time_op(rank, &mut buf, w, it, |rk, buf| {
            buf.dispatch(
                rk,
                &Tokens {
                    x: xp,
                    w: 0,
                    topk: tk,
                    tpe: tp,
                    s,
                    total_tokens: None,
                },
            )
        })?;
        let comb = time_op(rank, &mut buf, w, it, |rk, buf| buf.combine(rk, out.ptr, 0))?;
        buf.cfg.dedup = false;
        let d0 = time_op(rank, &mut buf, w, it, |rk, buf| {
            buf.dispatch(
                rk,
                &Tokens {
                    x: xp,
                    w: 0,
                    topk: tk,
                    tpe: tp,
                    s,
                    total_tokens: None,
                },
            )
        })?;
        buf.cfg.dedup = true;
        let pl = time_op(rank, &mut buf, w, it, |rk, buf| {
            buf.plan(rk, tk, tp, s, None)
        })?;
        let bd = time_op(rank, &mut buf, w, it, |rk, _| {
            base.dispatch(
                rk,
                &Tokens {
                    x: xp,
                    w: 0,
                    topk: tk,
                    tpe: tp,
                    s,
                    total_tokens: None,
                },
            )
        })?;
        let bc = time_op(rank, &mut buf, w, it, |rk, _| base.combine(rk, out.ptr))?;
        let ms = [
            slowest(rank, &d1)?,
            slowest(rank, &d0)?,
            slowest(rank, &pl)?,
            slowest(rank, &comb)?,
            slowest(rank, &bd)?,
            slowest(rank, &bc)?,
        ];
        // The device plan of this point, bit for bit against the CPU planner.
        let pc = plan_config(&cfg, r, c.s, None);
        let gp = plan_global(&pc, &routing.tpe)?;
        let mine: Vec<u32> = topk.iter().map(|&e| e as u32).collect();
        let dst = plan_entries(&pc, &gp, me, &mine)?;
        check_plan(&buf, rank, &gp, &dst).map_err(|m| {
            GpuError::Invalid(format!(
                "{} {label}: GPU plan differs from the CPU planner: {m}",
                c.name
            ))
        })?;
        let params = vec![
            ("config".into(), c.name.to_string()),
            ("workload".into(), label.clone()),
            (
                "rank_imbalance".into(),
                format!("{:.3}", routing.rank_imbalance()),
            ),
            ("maxvio".into(), format!("{:.2}", routing.maxvio())),
            (
                "padding_rows_per_rank".into(),
                format!(
                    "{:?}",
                    gp.layouts
                        .iter()
                        .map(|l| l.zero_fill.iter().map(|z| z.1).sum::<u32>())
                        .collect::<Vec<_>>()
                ),
            ),
            (
                "replicas".into(),
                buf.read_plan(&rank.dev)?
                    .experts_to_copy
                    .iter()
                    .filter(|&&e| e >= 0)
                    .count()
                    .to_string(),
            ),
        ];
        if me == 0 {
            println!(
                "{} {label}: imb {:.3} maxvio {:.2} | moonep dispatch {:.3} ms (no dedup {:.3}, plan {:.3}) combine {:.3} | baseline dispatch {:.3} combine {:.3}",
                c.name,
                routing.rank_imbalance(),
                routing.maxvio(),
                median(&ms[0]),
                median(&ms[1]),
                median(&ms[2]),
                median(&ms[3]),
                median(&ms[4]),
                median(&ms[5])
            );
        }
        points.push(Point {
            label,
            params,
            share,
            ms,
        });
    }
    Ok(section(rank, opts, c, &points, &rank.dev))
}

fn section(
    rank: &Rank,
    opts: &NvlinkOptions,
    c: Config,
    points: &[Point],
    dev: &Device,
) -> Section {
    let mut figures = Vec::new();
    for p in points {
        let bd = median(&p.ms[4]);
        let bc = median(&p.ms[5]);
        for (j, op) in OPS.iter().enumerate().take(4) {
            let mut f = Figure::timing(format!("{op}, {}", c.name), &p.ms[j], "ms");
            for (k, v) in &p.params {
                f = f.param(k, v);
            }
            if j < 2 {
                f = f.baseline(
                    "baseline dispatch (Megatron-style, grouped ncclSend/Recv), same run",
                    bd,
                    true,
                );
                if let (Some(a), "DSv3-like") = (p.share.and_then(anchor), c.name) {
                    f = f.baseline("torch permute + all_to_all_single (anchors.md)", a, false);
                }
            }
            if j == 3 {
                f = f.baseline("baseline combine (Megatron-style), same run", bc, true);
            }
            figures.push(f);
        }
        let mut f = Figure::timing(format!("{}, {}", OPS[4], c.name), &p.ms[4], "ms");
        for (k, v) in &p.params {
            f = f.param(k, v);
        }
        figures.push(f);
        let mut f = Figure::timing(format!("{}, {}", OPS[5], c.name), &p.ms[5], "ms");
        for (k, v) in &p.params {
            f = f.param(k, v);
        }
        figures.push(f);
    }
    let shares: Vec<&Point> = points.iter().filter(|p| p.share.is_some()).collect();
    let flat = |j: usize| {
        let m: Vec<f64> = shares.iter().map(|p| median(&p.ms[j])).collect();
        m.iter().copied().fold(f64::MIN, f64::max) / m.iter().copied().fold(f64::MAX, f64::min)
    };
    for (j, what) in [
        (0usize, "dispatch incl. plan (dedup)"),
        (1, "dispatch incl. plan (no dedup)"),
        (3, "combine"),
    ] {
        figures.push(
            Figure::new(
                format!(
                    "moonep {what} flatness max/min over the share sweep, {}",
                    c.name
                ),
                flat(j),
                "x",
                k3_common::report::Better::Lower,
            )
            .param("config", c.name),
        );
    }
    let series = |j: usize, name: &str| Series {
        name: name.to_string(),
        points: shares
            .iter()
            .map(|p| (p.label.clone(), median(&p.ms[j])))
            .collect(),
    };
    let plots = vec![Plot {
        title: format!("{}: time vs rank-level skew (slowest rank, median)", c.name),
        kind: PlotKind::Lines,
        x_label: "share of copies to rank 0's experts".into(),
        y_label: "ms".into(),
        series: vec![
            series(0, "moonep dispatch+plan (dedup)"),
            series(1, "moonep dispatch+plan (no dedup)"),
            series(4, "baseline dispatch"),
            series(3, "moonep combine"),
            series(5, "baseline combine"),
        ],
    }];
    let cmd = std::env::args().collect::<Vec<_>>().join(" ");
    Section {
        system: "moonep".into(),
        tier: Tier::Nvlink,
        title: format!("EP=2 dispatch/combine vs Megatron-style baseline, {} (S={}, H={}, K={}, E={})", c.name, c.s, c.h, c.k, c.experts),
        machine: hostname(),
        figures,
        plots,
        notes: vec![
            format!("command: moonep-launch -n {} -- {cmd}", rank.env.world),
            format!(
                "backend: CUDA IPC symmetric buffers + sm_90a kernels ({} blocks x 512 threads for comm kernels, {} SMs per GPU), tpe all-gathered through the IPC tables; baseline: grouped ncclSend/ncclRecv + permute kernels, host sync for split sizes",
                opts.num_blocks, dev.num_sms
            ),
            format!("timing: CUDA events, warmup {} + {} iterations, host + device barrier before each; value = median over iterations of the slowest rank", opts.warmup, opts.iters),
            "the device plan (alloc, experts_to_copy, counts, cu_seqlens, zero_fill, dst) was checked bit-exact against the CPU planner at every point; dispatch includes tpe all-gather, planning kernels, entry/exit device barriers and (dedup) the receiver-side replication; dedup sends each token once per remote rank, results are bit-identical".into(),
            "dispatch zeroes the padding rows of every group (P=128): at shares 50% and 75% all DSv3 group counts are multiples of 128 (no padding), elsewhere up to ~15K rows (~210 MB) per rank are zeroed, which is most of the rise of the dedup curve (param padding_rows_per_rank)".into(),
            "expert compute is not included (identity); combine pulls K rows per token over NVLink, f32 accumulate in ascending k".into(),
            "routing: moonep::router exact generator, clustered placement; share = fraction of all copies routed to rank 0's home experts; EP=2 only (see docs/specs/moonep.md §6.4 for what EP=2 cannot show)".into(),
        ],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_bench_workload_generates_with_exact_row_sums_and_rising_imbalance() {
        let opts = NvlinkOptions::default();
        for c in CONFIGS {
            let mut last = 0.0;
            for &share in &opts.shares {
                let spec = WorkloadSpec {
                    experts: c.experts,
                    top_k: c.k,
                    tokens: vec![c.s as u32; 2],
                    skew: Skew::RankShare { share },
                    placement: Placement::Clustered,
                    seed: 1,
                };
                let routing = generate(&spec).unwrap();
                let topk = routing.topk(0, 3);
                assert_eq!(topk.len(), c.s * c.k);
                assert!(
                    routing.rank_imbalance() >= last - 1e-9,
                    "{} share {share}",
                    c.name
                );
                assert!(
                    (routing.rank_imbalance() - 2.0 * share).abs() < 0.01,
                    "{} share {share}: {}",
                    c.name,
                    routing.rank_imbalance()
                );
                last = routing.rank_imbalance();
            }
        }
    }
}
