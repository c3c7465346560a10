//! `--from-compare bench.json`: a report section from a `python/bench_compare.py` result (the
//! public Python calls of flashkda and FlashKDA timed on the GPU machine), built without a GPU.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{Context, Result};
use k3_common::Figure;
use k3_common::report::{Better, Plot, PlotKind, Report, Section, Series, Tier};

fn ms(row: &serde_json::Value, key: &str) -> Option<f64> {
    row[key]["median_ms"].as_f64()
}

/// Appends the flashkda sm90 section of `path` to `report`.
pub fn add_compare_section(path: &Path, report: &mut Report) -> Result<()> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let v: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    let env = v["env"]
        .as_object()
        .context("no env in the compare result")?;
    let gpu = env
        .get("gpu")
        .and_then(|g| g.as_str())
        .unwrap_or("?")
        .to_string();
    let versions: BTreeMap<String, String> = env
        .iter()
        .map(|(k, x)| {
            (
                k.clone(),
                x.as_str().map_or_else(|| x.to_string(), str::to_string),
            )
        })
        .collect();
    let rows = v["rows"]
        .as_array()
        .context("no rows in the compare result")?;
    anyhow::ensure!(!rows.is_empty(), "the compare result has no rows");
    let (mut figures, mut notes) = (Vec::new(), Vec::new());
    let mut ours = Series {
        name: "flashkda (Python call)".into(),
        points: Vec::new(),
    };
    let mut theirs = Series {
        name: "public FlashKDA (same run)".into(),
        points: Vec::new(),
    };
    for row in rows {
        let shape = row["shape"].as_str().unwrap_or("?");
        let m = ms(row, "flashkda").with_context(|| format!("{shape}: no flashkda timing"))?;
        let mut f = Figure::new(
            format!("kda fwd {shape} [python, default]"),
            m,
            "ms",
            Better::Lower,
        )
        .param("shape", shape)
        .param("H", row["H"].as_u64().unwrap_or(0))
        .param("T", row["T"].as_u64().unwrap_or(0));
        ours.points.push((shape.to_string(), m));
        match row["flash_kda_best_ms"].as_f64() {
            Some(b) => {
                f = f.baseline("public FlashKDA (best state variant), same run", b, true);
                theirs.points.push((shape.to_string(), b));
            }
            None => anyhow::bail!("{shape}: the FlashKDA baseline is missing"),
        }
        if let Some(u) = ms(row, "flashkda_seg0") {
            f = f.baseline("flashkda without context parallelism, same run", u, true);
        }
        if let Some(g) = ms(row, "graph_replay") {
            notes.push(format!(
                "{shape}: CUDA-graph replay {g:.4} ms, equal to eager bitwise: {}",
                row["graph_equal_eager"]
            ));
        }
        if let Some(r) = row["rel_out_f64"].as_f64() {
            notes.push(format!(
                "{shape}: vs float64 out {r:.3e} state {:.3e} (FlashKDA {:.3e} / {:.3e})",
                row["rel_state_f64"].as_f64().unwrap_or(f64::NAN),
                row["flash_kda_rel_out_f64"].as_f64().unwrap_or(f64::NAN),
                row["flash_kda_rel_state_f64"].as_f64().unwrap_or(f64::NAN)
            ));
        }
        figures.push(f);
    }
    notes.push(format!(
        "from {} (python/bench_compare.py on the GPU machine)",
        path.display()
    ));
    let host = super::push_device_machine(report, gpu, versions);
    report.sections.push(Section {
        system: "flashkda".into(),
        tier: Tier::Sm90,
        title:
            "KDA forward through the Python call vs the public FlashKDA (anchors, long sequences)"
                .into(),
        machine: host,
        figures,
        plots: vec![Plot {
            title: "KDA forward time per shape, Python calls".into(),
            kind: PlotKind::Bars,
            x_label: "shape".into(),
            y_label: "ms (lower is better)".into(),
            series: vec![ours, theirs],
        }],
        notes,
    });
    Ok(())
}
