//! `--from-bwd a.json,b.json`: a report section from `python/bench_bwd.py --time` results (the
//! training call `flashkda.chunk_kda` forward+backward and backward alone, fla's Triton `chunk_kda`
//! timed in the same process on the same inputs), built without a GPU.

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::{Context, Result};
use k3_common::Figure;
use k3_common::report::{Better, Plot, PlotKind, Report, Section, Series, Tier};

fn ms(row: &serde_json::Value, key: &str) -> Option<f64> {
    row[key]["median_ms"].as_f64()
}

/// Appends the flashkda backward section of `paths` to `report`; a later file's row for the same
/// (H, case) replaces an earlier one unless it lacks fla and the earlier one has it.
pub fn add_bwd_section(paths: &[PathBuf], report: &mut Report) -> Result<()> {
    let mut rows: BTreeMap<(u64, String), (serde_json::Value, String)> = BTreeMap::new();
    let mut versions = BTreeMap::new();
    let mut gpu = String::from("?");
    for path in paths {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let v: serde_json::Value =
            serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
        for k in ["torch", "fla_core"] {
            if let Some(x) = v[k].as_str() {
                versions.insert(k.to_string(), x.to_string());
            }
        }
        if let Some(g) = v["gpu"].as_str() {
            gpu = g.to_string();
        }
        let timing = v["timing"]
            .as_array()
            .with_context(|| format!("{}: no timing rows", path.display()))?;
        for row in timing {
            let key = (
                row["H"].as_u64().unwrap_or(0),
                row["case"].as_str().unwrap_or("?").to_string(),
            );
            let has_fla = ms(row, "fla_fwd_bwd").is_some();
            let keep_old = rows
                .get(&key)
                .is_some_and(|(old, _)| ms(old, "fla_fwd_bwd").is_some() && !has_fla);
            if !keep_old {
                rows.insert(key, (row.clone(), path.display().to_string()));
            }
        }
    }
    anyhow::ensure!(!rows.is_empty(), "no timing rows in {paths:?}");
    let (mut figures, mut notes) = (Vec::new(), Vec::new());
    let mut series: Vec<Series> = ["flashkda fwd+bwd", "fla fwd+bwd (same run)"]
        .iter()
        .map(|n| Series {
            name: n.to_string(),
            points: Vec::new(),
        })
        .collect();
    for ((h, case), (row, file)) in &rows {
        let shape = format!("H={h} {case}");
        for (what, key) in [("fwd+bwd", "fwd_bwd"), ("bwd", "bwd")] {
            let m = ms(row, &format!("flashkda_{key}"))
                .with_context(|| format!("{shape}: no flashkda {what} timing"))?;
            let mut f = Figure::new(
                format!("kda {what} {shape} [python, training call]"),
                m,
                "ms",
                Better::Lower,
            )
            .param("H", h)
            .param("case", case)
            .param("T", 8192);
            if let Some(b) = ms(row, &format!("fla_{key}")) {
                f = f.baseline("fla chunk_kda (Triton), same run", b, true);
            }
            figures.push(f);
        }
        let fb = ms(row, "flashkda_fwd_bwd").unwrap_or(f64::NAN);
        series[0].points.push((shape.clone(), fb));
        match ms(row, "fla_fwd_bwd") {
            Some(b) => series[1].points.push((shape.clone(), b)),
            None => notes.push(format!("{shape}: fla not timed in this run")),
        }
        let saved = |who: &str| {
            let all = row[format!("{who}_saved_bytes_per_token_head")].as_f64();
            let extra = row[format!("{who}_saved_beyond_inputs_per_token_head")].as_f64();
            all.zip(extra)
                .map(|(a, e)| format!("{who} {a:.0} ({e:.0} beyond inputs)"))
        };
        let saved: Vec<String> = ["flashkda", "fla"].into_iter().filter_map(saved).collect();
        notes.push(format!(
            "{shape}: saved for backward, B/token/head: {}; from {file}",
            saved.join(", ")
        ));
    }
    notes.push(
        "python/bench_bwd.py --time on the GPU machine: CUDA events, median of iters x repeats, \
         fp32 initial and final state with upstream gradients for both"
            .into(),
    );
    let host = super::push_device_machine(report, gpu, versions);
    report.sections.push(Section {
        system: "flashkda".into(),
        tier: Tier::Sm90,
        title: "KDA training call (forward+backward, backward alone) vs fla chunk_kda".into(),
        machine: host,
        figures,
        plots: vec![Plot {
            title: "KDA forward+backward per anchor, Python calls".into(),
            kind: PlotKind::Bars,
            x_label: "shape".into(),
            y_label: "ms (lower is better)".into(),
            series,
        }],
        notes,
    });
    Ok(())
}
