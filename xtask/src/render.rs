//! Report rendering (Markdown tables, HTML with SVG plots) and merging.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::Context;
use k3_common::report::{Figure, Plot, PlotKind, Report, Section};
use plotters::prelude::*;

/// Merges `inputs` into one report and renders it into `out`.
pub fn merge(inputs: &[PathBuf], out: &Path) -> anyhow::Result<()> {
    let mut iter = inputs.iter();
    let first = iter.next().context("no input reports")?;
    let mut merged = Report::read(first)?;
    for p in iter {
        merged.merge(Report::read(p)?);
    }
    write_all(&merged, out)?;
    println!(
        "merged {} report(s): {} machine(s), {} section(s) -> {}/report.{{json,md,html}}",
        inputs.len(),
        merged.machines.len(),
        merged.sections.len(),
        out.display()
    );
    Ok(())
}

/// Writes `report.json`, `report.md` and `report.html` into `out`.
pub fn write_all(report: &Report, out: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(out)?;
    report.write(&out.join("report.json"))?;
    k3_common::fsutil::write_atomic(&out.join("report.md"), markdown(report).as_bytes())?;
    k3_common::fsutil::write_atomic(&out.join("report.html"), html(report).as_bytes())?;
    Ok(())
}

fn fmt_value(v: f64) -> String {
    if !v.is_finite() {
        return "n/a".into();
    }
    let a = v.abs();
    if a >= 100.0 {
        format!("{v:.1}")
    } else if a >= 1.0 {
        format!("{v:.3}")
    } else {
        format!("{v:.4}")
    }
}

fn params(f: &Figure) -> String {
    f.params
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(" ")
}

fn baselines(f: &Figure) -> String {
    f.baselines
        .iter()
        .map(|b| {
            format!(
                "{}: {} {} → **{:.2}x**{}",
                b.name,
                fmt_value(b.value),
                f.unit,
                f.ratio(b),
                if b.same_run { "" } else { " (anchor)" }
            )
        })
        .collect::<Vec<_>>()
        .join("<br>")
}

fn spread(f: &Figure) -> String {
    f.stats.as_ref().map_or(String::new(), |s| {
        format!("{}–{} (n={})", fmt_value(s.p10), fmt_value(s.p90), s.n)
    })
}

fn section_table(s: &Section, out: &mut String) {
    out.push_str("| figure | params | value | p10–p90 | vs baseline |\n|---|---|---|---|---|\n");
    for f in &s.figures {
        let _ = writeln!(
            out,
            "| {} | {} | {} {} | {} | {} |",
            f.name,
            params(f),
            fmt_value(f.value),
            f.unit,
            spread(f),
            baselines(f)
        );
    }
}

/// The report as Markdown.
pub fn markdown(r: &Report) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "# k3-stack benchmark report\n\ncommit `{}`, created {}\n{}",
        r.commit,
        r.created,
        if r.dirty {
            "\n**Dirty tree**: measured with uncommitted changes; these figures are not reproducible from the commit.\n"
        } else {
            ""
        }
    );
    out.push_str(
        "## Machines\n\n| host | OS | CPU | cores | memory | GPUs |\n|---|---|---|---|---|---|\n",
    );
    for m in &r.machines {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {:.0} GiB | {} |",
            m.hostname,
            m.os,
            m.cpu,
            m.cores,
            m.mem_gib,
            if m.gpus.is_empty() {
                "none".into()
            } else {
                m.gpus.join(", ")
            }
        );
    }
    for m in &r.machines {
        let v: Vec<String> = m
            .versions
            .iter()
            .map(|(k, v)| format!("{k}: {v}"))
            .collect();
        let _ = writeln!(out, "\n{}: {}", m.hostname, v.join("; "));
    }
    for s in &r.sections {
        let _ = writeln!(
            out,
            "\n## {} — {} (tier {}, {})\n",
            s.system, s.title, s.tier, s.machine
        );
        section_table(s, &mut out);
        for n in &s.notes {
            let _ = writeln!(out, "\n- {n}");
        }
    }
    if !r.skipped.is_empty() {
        out.push_str("\n## Skipped\n\n| tier | what | machine | reason |\n|---|---|---|---|\n");
        for s in &r.skipped {
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} |",
                s.tier,
                s.what,
                s.machine,
                s.reason.replace('\n', " ")
            );
        }
    }
    out
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// The report as a self-contained HTML page with SVG plots.
pub fn html(r: &Report) -> String {
    let md = markdown(r);
    let mut out = String::from(
        "<!doctype html><html><head><meta charset=\"utf-8\"><title>k3-stack report</title><style>\
         body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em}\
         table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:3px 8px;font-size:90%}\
         th{background:#f3f3f3}.plot{margin:1em 0}</style></head><body>",
    );
    let _ = write!(
        out,
        "<h1>k3-stack benchmark report</h1><p>commit <code>{}</code>, created {}</p>{}",
        esc(&r.commit),
        esc(&r.created),
        if r.dirty {
            "<p><strong>Dirty tree</strong>: measured with uncommitted changes; these figures are not \
             reproducible from the commit.</p>"
        } else {
            ""
        }
    );
    out.push_str("<h2>Machines</h2><table><tr><th>host</th><th>OS</th><th>CPU</th><th>cores</th><th>GPUs</th><th>versions</th></tr>");
    for m in &r.machines {
        let v: Vec<String> = m
            .versions
            .iter()
            .map(|(k, v)| format!("{k}: {v}"))
            .collect();
        let _ = write!(
            out,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            esc(&m.hostname),
            esc(&m.os),
            esc(&m.cpu),
            m.cores,
            esc(&m.gpus.join(", ")),
            esc(&v.join("; "))
        );
    }
    out.push_str("</table>");
    for s in &r.sections {
        let _ = write!(
            out,
            "<h2>{} — {} <small>(tier {}, {})</small></h2>",
            esc(&s.system),
            esc(&s.title),
            s.tier,
            esc(&s.machine)
        );
        for p in &s.plots {
            match plot_svg(p) {
                Ok(svg) => {
                    let _ = write!(out, "<div class=\"plot\">{svg}</div>");
                }
                Err(e) => {
                    let _ = write!(
                        out,
                        "<p>plot {} failed: {}</p>",
                        esc(&p.title),
                        esc(&e.to_string())
                    );
                }
            }
        }
        out.push_str("<table><tr><th>figure</th><th>params</th><th>value</th><th>p10–p90</th><th>vs baseline</th></tr>");
        for f in &s.figures {
            let _ = write!(
                out,
                "<tr><td>{}</td><td>{}</td><td>{} {}</td><td>{}</td><td>{}</td></tr>",
                esc(&f.name),
                esc(&params(f)),
                fmt_value(f.value),
                esc(&f.unit),
                spread(f),
                esc(&baselines(f))
                    .replace("&lt;br&gt;", "<br>")
                    .replace("**", "")
            );
        }
        out.push_str("</table><ul>");
        for n in &s.notes {
            let _ = write!(out, "<li>{}</li>", esc(n));
        }
        out.push_str("</ul>");
    }
    if !r.skipped.is_empty() {
        out.push_str("<h2>Skipped</h2><table><tr><th>tier</th><th>what</th><th>machine</th><th>reason</th></tr>");
        for s in &r.skipped {
            let _ = write!(
                out,
                "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                s.tier,
                esc(&s.what),
                esc(&s.machine),
                esc(&s.reason)
            );
        }
        out.push_str("</table>");
    }
    let _ = write!(
        out,
        "<details><summary>Markdown</summary><pre>{}</pre></details></body></html>",
        esc(&md)
    );
    out
}

const PALETTE: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];

/// Renders one plot as an SVG string.
pub fn plot_svg(p: &Plot) -> anyhow::Result<String> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (900, 420)).into_drawing_area();
        root.fill(&WHITE)?;
        let ymax = p
            .series
            .iter()
            .flat_map(|s| s.points.iter().map(|(_, y)| *y))
            .filter(|y| y.is_finite())
            .fold(0.0f64, f64::max);
        let ymax = if ymax > 0.0 { ymax * 1.1 } else { 1.0 };
        match p.kind {
            PlotKind::Bars => {
                let mut labels: Vec<String> = Vec::new();
                for s in &p.series {
                    for (x, _) in &s.points {
                        if !labels.contains(x) {
                            labels.push(x.clone());
                        }
                    }
                }
                let n = labels.len().max(1);
                let k = p.series.len().max(1);
                let mut chart = ChartBuilder::on(&root)
                    .caption(&p.title, ("sans-serif", 20))
                    .margin(10)
                    .x_label_area_size(40)
                    .y_label_area_size(60)
                    .build_cartesian_2d(0f64..n as f64, 0f64..ymax)?;
                let lbl = labels.clone();
                chart
                    .configure_mesh()
                    .disable_x_mesh()
                    .x_labels(n)
                    .x_label_formatter(&|x| {
                        let i = x.floor() as usize;
                        if (x - x.floor() - 0.5).abs() < 0.26 {
                            lbl.get(i).cloned().unwrap_or_default()
                        } else {
                            String::new()
                        }
                    })
                    .x_desc(&p.x_label)
                    .y_desc(&p.y_label)
                    .draw()?;
                let width = 0.8 / k as f64;
                for (si, s) in p.series.iter().enumerate() {
                    let color = PALETTE[si % PALETTE.len()];
                    let rects = s.points.iter().filter_map(|(x, y)| {
                        let i = labels.iter().position(|l| l == x)?;
                        let x0 = i as f64 + 0.1 + si as f64 * width;
                        Some(Rectangle::new(
                            [(x0, 0.0), (x0 + width * 0.95, *y)],
                            color.filled(),
                        ))
                    });
                    chart
                        .draw_series(rects)?
                        .label(&s.name)
                        .legend(move |(x, y)| {
                            Rectangle::new([(x, y - 5), (x + 10, y + 5)], color.filled())
                        });
                }
                chart
                    .configure_series_labels()
                    .border_style(BLACK)
                    .background_style(WHITE.mix(0.8))
                    .draw()?;
            }
            PlotKind::Lines | PlotKind::Cdf => {
                let series: Vec<(String, Vec<(f64, f64)>)> = p
                    .series
                    .iter()
                    .map(|s| {
                        let mut pts: Vec<(f64, f64)> = if p.kind == PlotKind::Cdf {
                            let ys: Vec<f64> = s.points.iter().map(|(_, y)| *y).collect();
                            k3_common::stats::cdf(&ys)
                        } else {
                            s.points
                                .iter()
                                .filter_map(|(x, y)| x.parse::<f64>().ok().map(|x| (x, *y)))
                                .collect()
                        };
                        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
                        (s.name.clone(), pts)
                    })
                    .collect();
                let xs = series.iter().flat_map(|(_, p)| p.iter().map(|(x, _)| *x));
                let (xmin, xmax) = xs.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), x| {
                    (a.min(x), b.max(x))
                });
                let (xmin, xmax) = if xmin.is_finite() && xmax > xmin {
                    (xmin, xmax)
                } else {
                    (0.0, 1.0)
                };
                let ytop = if p.kind == PlotKind::Cdf { 1.0 } else { ymax };
                let mut chart = ChartBuilder::on(&root)
                    .caption(&p.title, ("sans-serif", 20))
                    .margin(10)
                    .x_label_area_size(40)
                    .y_label_area_size(60)
                    .build_cartesian_2d(xmin..xmax, 0f64..ytop)?;
                chart
                    .configure_mesh()
                    .x_desc(&p.x_label)
                    .y_desc(&p.y_label)
                    .draw()?;
                for (si, (name, pts)) in series.into_iter().enumerate() {
                    let color = PALETTE[si % PALETTE.len()];
                    chart
                        .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))?
                        .label(name)
                        .legend(move |(x, y)| {
                            PathElement::new(vec![(x, y), (x + 15, y)], color.stroke_width(2))
                        });
                    chart.draw_series(
                        pts.into_iter()
                            .map(|(x, y)| Circle::new((x, y), 3, color.filled())),
                    )?;
                }
                chart
                    .configure_series_labels()
                    .border_style(BLACK)
                    .background_style(WHITE.mix(0.8))
                    .draw()?;
            }
        }
        root.present()?;
    }
    Ok(svg)
}

#[cfg(test)]
mod tests {
    use k3_common::report::{Series, Skipped, Tier};

    use super::*;

    fn sample() -> Report {
        let mut r = Report::new("abc123");
        r.sections.push(Section {
            system: "flashkda".into(),
            tier: Tier::Sm90,
            title: "KDA forward".into(),
            machine: "gpu".into(),
            figures: vec![
                Figure::timing("fwd", &[1.0, 1.2, 0.9], "ms")
                    .param("H", 96)
                    .baseline("fla", 2.6, true),
            ],
            plots: vec![
                Plot {
                    title: "time per shape".into(),
                    kind: PlotKind::Bars,
                    x_label: "shape".into(),
                    y_label: "ms".into(),
                    series: vec![
                        Series {
                            name: "ours".into(),
                            points: vec![("H96".into(), 1.0), ("H64".into(), 0.7)],
                        },
                        Series {
                            name: "fla".into(),
                            points: vec![("H96".into(), 2.6), ("H64".into(), 1.7)],
                        },
                    ],
                },
                Plot {
                    title: "vs skew".into(),
                    kind: PlotKind::Lines,
                    x_label: "skew %".into(),
                    y_label: "ms".into(),
                    series: vec![Series {
                        name: "d".into(),
                        points: vec![("50".into(), 0.5), ("90".into(), 0.6)],
                    }],
                },
                Plot {
                    title: "latency".into(),
                    kind: PlotKind::Cdf,
                    x_label: "ms".into(),
                    y_label: "fraction".into(),
                    series: vec![Series {
                        name: "create".into(),
                        points: vec![("".into(), 40.0), ("".into(), 60.0)],
                    }],
                },
            ],
            notes: vec!["cmd <x>".into()],
        });
        r.skipped.push(Skipped {
            tier: Tier::Kvm,
            machine: "dev".into(),
            what: "agentenv".into(),
            reason: "PVM-only: TCG".into(),
        });
        r
    }

    #[test]
    fn markdown_has_ratio_and_skip() {
        let md = markdown(&sample());
        assert!(
            md.contains(
                "| fwd | H=96 | 1.000 ms | 0.9000–1.200 (n=3) | fla: 2.600 ms → **2.60x** |"
            ),
            "{md}"
        );
        assert!(md.contains("| kvm | agentenv | dev | PVM-only: TCG |"));
    }

    #[test]
    fn html_embeds_one_svg_per_plot_and_escapes() {
        let h = html(&sample());
        assert_eq!(h.matches("<svg").count(), 3);
        assert!(h.contains("cmd &lt;x&gt;"));
        assert!(!h.contains("plot time per shape failed"));
    }
}
