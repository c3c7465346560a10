//! Load and soak: get/list latency under concurrent connections, and a create/pause/resume/kill churn that
//! watches the server's file descriptors and memory and the QEMU processes it leaves.

use std::time::{Duration, Instant};

use anyhow::Context;
use hyper::Method;
use k3_common::report::{Better, Figure, Plot, PlotKind, Series};
use serde_json::json;

use super::{Http, ms};

/// `conns` clients, each sending `per_conn` requests back to back, alternating `GET /sandboxes/{id}` and
/// `GET /v2/sandboxes` over `sandboxes` live ones. Returns the latencies (ms) and the non-200 count.
pub async fn get_list(
    http: &Http,
    conns: usize,
    per_conn: usize,
    sandboxes: usize,
) -> anyhow::Result<(Vec<f64>, usize, f64)> {
    let mut ids = vec![];
    for _ in 0..sandboxes {
        let c = http
            .json(
                Method::POST,
                "/v2/sandboxes",
                json!({"templateID": "base", "timeout": 600}),
                201,
            )
            .await?;
        ids.push(c["sandboxID"].as_str().context("sandboxID")?.to_string());
    }
    let t0 = Instant::now();
    let tasks: Vec<_> = (0..conns)
        .map(|c| {
            let http = http.clone_with_own_pool();
            let ids = ids.clone();
            tokio::spawn(async move {
                let mut lat = Vec::with_capacity(per_conn);
                let mut errors = 0;
                for i in 0..per_conn {
                    let path = if i % 2 == 0 {
                        format!("/sandboxes/{}", ids[(c + i) % ids.len()])
                    } else {
                        "/v2/sandboxes".to_string()
                    };
                    let t = Instant::now();
                    match http.send(Method::GET, &path, &[], vec![]).await {
                        Ok((200, _)) => {}
                        _ => errors += 1,
                    }
                    lat.push(ms(t));
                }
                (lat, errors)
            })
        })
        .collect();
    let (mut lat, mut errors) = (vec![], 0);
    for t in tasks {
        let (l, e) = t.await?;
        lat.extend(l);
        errors += e;
    }
    let rate = lat.len() as f64 / t0.elapsed().as_secs_f64();
    for id in ids {
        http.send(Method::DELETE, &format!("/sandboxes/{id}"), &[], vec![])
            .await?;
    }
    Ok((lat, errors, rate))
}

/// Open file descriptors of this process.
fn fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count())
}

/// Resident memory of this process, KiB.
fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or(0)
}

/// QEMU processes whose command line names `state_dir`.
fn qemu_processes(state_dir: &str) -> usize {
    std::fs::read_dir("/proc").map_or(0, |d| {
        d.flatten()
            .filter(|e| {
                e.file_name()
                    .to_string_lossy()
                    .bytes()
                    .all(|b| b.is_ascii_digit())
            })
            .filter(|e| {
                let cmd = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
                let cmd = String::from_utf8_lossy(&cmd);
                cmd.contains("qemu-system") && cmd.contains(state_dir)
            })
            .count()
    })
}

/// (seconds since start, fds, RSS KiB, QEMU processes).
pub type Sample = (f64, usize, u64, usize);

/// What the churn saw.
pub struct Soak {
    pub cycles: usize,
    pub errors: usize,
    pub first_error: Option<String>,
    /// After a warm-up cycle, once a minute, and at the end.
    pub samples: Vec<Sample>,
    pub qemu_after: usize,
    pub cycle_ms: Vec<f64>,
}

/// Create, command, pause, resume, command, kill, over and over for `duration`.
pub async fn churn(http: &Http, state_dir: &str, duration: Duration) -> Soak {
    let t0 = Instant::now();
    let mut soak = Soak {
        cycles: 0,
        errors: 0,
        first_error: None,
        samples: vec![],
        qemu_after: 0,
        cycle_ms: vec![],
    };
    // The first sample follows one warm-up cycle (connection pools, lazily opened files).
    if let Err(e) = cycle(http).await {
        soak.errors += 1;
        soak.first_error = Some(format!("warm-up: {e:#}"));
    }
    soak.samples.push((
        t0.elapsed().as_secs_f64(),
        fds(),
        rss_kib(),
        qemu_processes(state_dir),
    ));
    let mut next_sample = Duration::from_secs(60);
    while t0.elapsed() < duration {
        let t = Instant::now();
        match cycle(http).await {
            Ok(()) => soak.cycle_ms.push(ms(t)),
            Err(e) => {
                soak.errors += 1;
                soak.first_error.get_or_insert_with(|| format!("{e:#}"));
                tracing::warn!(error = %e, "soak cycle failed");
            }
        }
        soak.cycles += 1;
        if t0.elapsed() >= next_sample {
            soak.samples.push((
                t0.elapsed().as_secs_f64(),
                fds(),
                rss_kib(),
                qemu_processes(state_dir),
            ));
            next_sample += Duration::from_secs(60);
        }
    }
    // Sandboxes a failed cycle left are the server's to kill: list and kill what remains.
    if let Ok((200, body)) = http
        .send(
            Method::GET,
            "/v2/sandboxes?state=running,paused",
            &[],
            vec![],
        )
        .await
        && let Ok(v) = serde_json::from_slice::<serde_json::Value>(&body)
        && let Some(list) = v.as_array()
    {
        for s in list {
            if let Some(id) = s["sandboxID"].as_str() {
                let _ = http
                    .send(Method::DELETE, &format!("/sandboxes/{id}"), &[], vec![])
                    .await;
            }
        }
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    soak.qemu_after = qemu_processes(state_dir);
    soak.samples.push((
        t0.elapsed().as_secs_f64(),
        fds(),
        rss_kib(),
        soak.qemu_after,
    ));
    soak
}

async fn cycle(http: &Http) -> anyhow::Result<()> {
    let c = http
        .json(
            Method::POST,
            "/v2/sandboxes",
            json!({"templateID": "base", "timeout": 600}),
            201,
        )
        .await?;
    let id = c["sandboxID"].as_str().context("sandboxID")?.to_string();
    let token = c["envdAccessToken"].as_str().context("token")?.to_string();
    let r = async {
        http.command(&id, &token).await?;
        let (st, body) = http
            .send(Method::POST, &format!("/sandboxes/{id}/pause"), &[], vec![])
            .await?;
        anyhow::ensure!(
            st == 204,
            "pause: HTTP {st}: {}",
            String::from_utf8_lossy(&body)
        );
        http.json(
            Method::POST,
            &format!("/v2/sandboxes/{id}/connect"),
            json!({}),
            201,
        )
        .await?;
        http.command(&id, &token).await
    }
    .await;
    let (st, body) = http
        .send(Method::DELETE, &format!("/sandboxes/{id}"), &[], vec![])
        .await?;
    r?;
    anyhow::ensure!(
        st == 204,
        "kill: HTTP {st}: {}",
        String::from_utf8_lossy(&body)
    );
    Ok(())
}

/// The soak as report figures and a plot of fds, RSS and QEMU processes over time.
pub fn soak_figures(s: &Soak) -> (Vec<Figure>, Plot) {
    let first = s.samples.first().copied().unwrap_or_default();
    let last = s.samples.last().copied().unwrap_or_default();
    let max_fds = s.samples.iter().map(|x| x.1).max().unwrap_or(0);
    let max_rss = s.samples.iter().map(|x| x.2).max().unwrap_or(0);
    let figures = vec![
        Figure::new(
            "soak: cycles (create, command, pause, resume, command, kill)",
            s.cycles as f64,
            "cycles",
            Better::Higher,
        ),
        Figure::new(
            "soak: failed cycles",
            s.errors as f64,
            "cycles",
            Better::Lower,
        ),
        Figure::timing("soak: one cycle", &s.cycle_ms, "ms"),
        Figure::new(
            "soak: QEMU processes left after the churn",
            s.qemu_after as f64,
            "processes",
            Better::Lower,
        ),
        Figure::new(
            "soak: server fds, last minus first sample",
            last.1 as f64 - first.1 as f64,
            "fds",
            Better::Lower,
        )
        .param("first", first.1)
        .param("max", max_fds),
        Figure::new(
            "soak: server RSS, last minus first sample",
            (last.2 as f64 - first.2 as f64) / 1024.0,
            "MiB",
            Better::Lower,
        )
        .param("first MiB", format!("{:.1}", first.2 as f64 / 1024.0))
        .param("max MiB", format!("{:.1}", max_rss as f64 / 1024.0)),
    ];
    let series = |name: &str, f: &dyn Fn(&Sample) -> f64| Series {
        name: name.into(),
        points: s
            .samples
            .iter()
            .map(|x| (format!("{:.0}", x.0 / 60.0), f(x)))
            .collect(),
    };
    let plot = Plot {
        title: "agentenv soak: server fds, RSS and QEMU processes".into(),
        kind: PlotKind::Lines,
        x_label: "minutes".into(),
        y_label: "count / MiB".into(),
        series: vec![
            series("fds", &|x| x.1 as f64),
            series("RSS MiB", &|x| x.2 as f64 / 1024.0),
            series("QEMU processes", &|x| x.3 as f64),
        ],
    };
    (figures, plot)
}
