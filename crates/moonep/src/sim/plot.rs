//! SVG plots (plotters) and report plots of a sweep.

use std::path::{Path, PathBuf};

use k3_common::report::{Plot, PlotKind, Series};
use plotters::prelude::*;

use super::{SimError, SimRow};

/// Zipf rows with random placement of one shape, grouped by policy, sorted by maxvio target.
fn zipf_series<'a>(
    rows: &'a [SimRow],
    key: &(String, usize, usize),
) -> Vec<(String, Vec<&'a SimRow>)> {
    let mut out: Vec<(String, Vec<&SimRow>)> = Vec::new();
    for r in rows.iter().filter(|r| {
        (&r.shape, r.ranks, r.experts) == (&key.0, key.1, key.2)
            && r.workload == "zipf"
            && r.placement == "random"
    }) {
        match out.iter_mut().find(|(p, _)| *p == r.policy) {
            Some((_, v)) => v.push(r),
            None => out.push((r.policy.clone(), vec![r])),
        }
    }
    for (_, v) in &mut out {
        v.sort_by(|a, b| param(a).total_cmp(&param(b)));
    }
    out
}

fn param(r: &SimRow) -> f64 {
    r.param.parse().unwrap_or(0.0)
}

fn shapes(rows: &[SimRow]) -> Vec<(String, usize, usize)> {
    let mut keys: Vec<(String, usize, usize)> = Vec::new();
    for r in rows {
        let k = (r.shape.clone(), r.ranks, r.experts);
        if !keys.contains(&k) {
            keys.push(k);
        }
    }
    keys
}

type Metric = (&'static str, fn(&SimRow) -> f64);

const PANELS: [Metric; 6] = [
    ("rank load max/mean", |r| r.load_max_over_mean),
    ("replicas (total)", |r| r.replicas_total as f64),
    ("migrated token fraction", |r| r.migrated_fraction),
    ("replica weight MiB in (max rank)", |r| {
        r.weight_bytes_in_max as f64 / (1u64 << 20) as f64
    }),
    ("dispatch bandwidth model (us)", |r| r.comm_us),
    ("drop rate", |r| r.drop_rate),
];

/// One SVG per shape (six panels over the Zipf maxvio sweep, random placement, one line per
/// policy) plus `moonep-sim-by-ep.svg` (rank imbalance of `none` and moonep replicas vs EP).
pub fn write_svgs(rows: &[SimRow], dir: &Path) -> Result<Vec<PathBuf>, SimError> {
    let mut written = Vec::new();
    for key in shapes(rows) {
        let series = zipf_series(rows, &key);
        if series.is_empty() {
            continue;
        }
        let path = dir.join(format!(
            "moonep-sim-{}-ep{}-e{}.svg",
            key.0.to_lowercase(),
            key.1,
            key.2
        ));
        let title = format!(
            "{} EP{} E={}: Zipf maxvio sweep (random placement)",
            key.0, key.1, key.2
        );
        draw_panels(&path, &title, &series).map_err(|reason| SimError::Plot {
            path: path.display().to_string(),
            reason,
        })?;
        written.push(path);
    }
    let path = dir.join("moonep-sim-by-ep.svg");
    draw_by_ep(rows, &path).map_err(|reason| SimError::Plot {
        path: path.display().to_string(),
        reason,
    })?;
    written.push(path);
    Ok(written)
}

fn draw_panels(path: &Path, title: &str, series: &[(String, Vec<&SimRow>)]) -> Result<(), String> {
    let root = SVGBackend::new(path, (1500, 900)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let root = root
        .titled(title, ("sans-serif", 22))
        .map_err(|e| e.to_string())?;
    let x_max = series
        .iter()
        .flat_map(|(_, v)| v.iter().map(|r| param(r)))
        .fold(0.0, f64::max)
        .max(1e-3);
    for (area, (name, metric)) in root.split_evenly((2, 3)).iter().zip(PANELS) {
        let y_max = series
            .iter()
            .flat_map(|(_, v)| v.iter().map(|r| metric(r)))
            .fold(0.0, f64::max);
        let y_max = if y_max > 0.0 { y_max * 1.1 } else { 1.0 };
        let mut chart = ChartBuilder::on(area)
            .caption(name, ("sans-serif", 16))
            .margin(10)
            .x_label_area_size(30)
            .y_label_area_size(50)
            .build_cartesian_2d(0.0..x_max * 1.05, 0.0..y_max)
            .map_err(|e| e.to_string())?;
        chart
            .configure_mesh()
            .x_desc("target maxvio")
            .draw()
            .map_err(|e| e.to_string())?;
        for (i, (policy, rows)) in series.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            let pts: Vec<(f64, f64)> = rows.iter().map(|r| (param(r), metric(r))).collect();
            chart
                .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))
                .map_err(|e| e.to_string())?
                .label(policy.as_str())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], color));
            chart
                .draw_series(pts.into_iter().map(|p| Circle::new(p, 3, color.filled())))
                .map_err(|e| e.to_string())?;
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .label_font(("sans-serif", 11))
            .draw()
            .map_err(|e| e.to_string())?;
    }
    root.present().map_err(|e| e.to_string())
}

/// (series name, points (EP, value)) for the by-EP figure.
fn by_ep_series(rows: &[SimRow]) -> Vec<(String, Vec<(f64, f64)>)> {
    let mut out = Vec::new();
    for shape in ["DSv3-like", "K3-like"] {
        for (target, policy, what) in [
            ("1", "none", "rank max/mean (none)"),
            ("4", "none", "rank max/mean (none)"),
            ("4", "moonep", "replicas/R (moonep)"),
        ] {
            let mut pts: Vec<(f64, f64)> = rows
                .iter()
                .filter(|r| {
                    r.shape == shape
                        && r.workload == "zipf"
                        && r.placement == "random"
                        && r.param == target
                        && r.policy == policy
                })
                .map(|r| {
                    let v = if policy == "moonep" {
                        r.replicas_total as f64 / r.ranks as f64
                    } else {
                        r.load_max_over_mean
                    };
                    (r.ranks as f64, v)
                })
                .collect();
            pts.sort_by(|a, b| a.0.total_cmp(&b.0));
            if !pts.is_empty() {
                out.push((format!("{shape} maxvio {target}: {what}"), pts));
            }
        }
    }
    out
}

fn draw_by_ep(rows: &[SimRow], path: &Path) -> Result<(), String> {
    let series = by_ep_series(rows);
    let root = SVGBackend::new(path, (1000, 600)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let y_max = series
        .iter()
        .flat_map(|(_, p)| p.iter().map(|q| q.1))
        .fold(1.0, f64::max)
        * 1.1;
    let x_max = series
        .iter()
        .flat_map(|(_, p)| p.iter().map(|q| q.0))
        .fold(2.0, f64::max);
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "Rank imbalance without balancing, and moonep replicas, vs EP (Zipf, random placement)",
            ("sans-serif", 18),
        )
        .margin(15)
        .x_label_area_size(35)
        .y_label_area_size(50)
        .build_cartesian_2d((1.0..x_max * 1.5).log_scale(), 0.0..y_max)
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .x_desc("EP ranks (log)")
        .draw()
        .map_err(|e| e.to_string())?;
    for (i, (name, pts)) in series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))
            .map_err(|e| e.to_string())?
            .label(name.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], color));
        chart
            .draw_series(pts.iter().map(|&p| Circle::new(p, 3, color.filled())))
            .map_err(|e| e.to_string())?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| e.to_string())?;
    root.present().map_err(|e| e.to_string())
}

/// Report plots: rank load max/mean and moonep replicas over the Zipf sweep for every shape,
/// and the by-EP summary.
pub fn report_plots(rows: &[SimRow]) -> Vec<Plot> {
    let mut plots = Vec::new();
    for key in shapes(rows) {
        let series = zipf_series(rows, &key);
        if series.is_empty() {
            continue;
        }
        plots.push(Plot {
            title: format!(
                "{} EP{} E={}: rank load max/mean vs maxvio (Zipf, random placement)",
                key.0, key.1, key.2
            ),
            kind: PlotKind::Lines,
            x_label: "target maxvio".into(),
            y_label: "max/mean".into(),
            series: series
                .iter()
                .map(|(p, v)| Series {
                    name: p.clone(),
                    points: v
                        .iter()
                        .map(|r| (r.param.clone(), r.load_max_over_mean))
                        .collect(),
                })
                .collect(),
        });
    }
    plots.push(Plot {
        title: "No-balancing rank imbalance and moonep replicas per rank vs EP".into(),
        kind: PlotKind::Lines,
        x_label: "EP ranks".into(),
        y_label: "ratio".into(),
        series: by_ep_series(rows)
            .into_iter()
            .map(|(name, pts)| Series {
                name,
                points: pts.into_iter().map(|(x, y)| (format!("{x}"), y)).collect(),
            })
            .collect(),
    });
    plots
}
