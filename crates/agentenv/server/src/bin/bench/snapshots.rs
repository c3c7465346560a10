//! Snapshot, fork, create-from-snapshot and concurrent-create figures, the incremental snapshot, and PSS
//! per idle fork, through the E2B API.

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use hyper::Method;
use k3_common::report::Figure;
use k3_common::stats;
use serde_json::{Value, json};

use crate::{Http, ms};

/// Snapshot, fork, create-from-snapshot and concurrent-create figures, and PSS per idle fork.
pub async fn snapshot_figures(
    http: &Http,
    n: usize,
    rt: &agentenv_runtime::Runtime,
) -> anyhow::Result<Vec<Figure>> {
    let create = |template: &str| http.create(json!({"templateID": template, "timeout": 600}));
    let kill = |id: String| async move { http.kill(&id).await };
    let (src, src_token) = create("base").await?;
    http.command(&src, &src_token).await?;
    let (mut snap, mut from_snap, mut fork8) = (vec![], vec![], vec![]);
    let mut snap_ids = vec![];
    for _ in 0..n {
        let t = Instant::now();
        let s = http
            .json(
                Method::POST,
                &format!("/sandboxes/{src}/snapshots"),
                json!({}),
                201,
            )
            .await?;
        snap.push(ms(t));
        snap_ids.push(s["snapshotID"].as_str().context("snapshotID")?.to_string());
    }
    let last = snap_ids.last().cloned().context("no snapshot")?;
    for _ in 0..n {
        let t = Instant::now();
        let (id, token) = create(&last).await?;
        from_snap.push(ms(t));
        http.command(&id, &token).await?;
        kill(id).await?;
    }
    let (mut pss_kib, mut floor, mut over_floor) = (vec![], vec![], vec![]);
    let cores = cores();
    for round in 0..3 {
        let r = fork_round(http, &src, Duration::ZERO).await?;
        fork8.push(r.ms);
        if let Some(f) = r.floor_ms {
            floor.push(f);
            over_floor.push(r.ms / f);
        }
        if round == 0 {
            pss_kib = r.pss_kib;
        }
    }
    // The first burst finds the pool at its floor; it grows the pool to the burst's size, and the later
    // bursts start once it is ready again (at most 60 s).
    let (mut conc_first, mut conc, mut burst_floor) = (vec![], vec![], None);
    for round in 0..3 {
        if round > 0 {
            let end = Instant::now() + std::time::Duration::from_secs(60);
            while rt.warm_ready("base") < 8 && Instant::now() < end {
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
        }
        let made = futures_util::future::join_all((0..8).map(|_| async {
            let t = Instant::now();
            let r = create("base").await;
            (ms(t), r)
        }))
        .await;
        let made = made
            .into_iter()
            .map(|(d, r)| r.map(|(id, _)| (d, id)))
            .collect::<anyhow::Result<Vec<_>>>()?;
        if round == 0 {
            // Creates served by the pool continue a QEMU that warmed up before the burst (its command
            // line names `vms/w<n>`, not the sandbox); the others started one each.
            let cpu: f64 = made
                .iter()
                .filter_map(|(_, id)| qemu_pid(id).and_then(cpu_seconds))
                .sum();
            burst_floor = Some(cpu / cores * 1000.0);
        }
        for (d, id) in made {
            match round {
                0 => conc_first.push(d),
                _ => conc.push(d),
            }
            kill(id).await?;
        }
    }
    let (inc_first, inc_second) = incremental(http, &create).await?;
    let (held_before, held_peak, held_after) = freed(http, rt, &create).await?;
    for id in &snap_ids {
        http.send(Method::DELETE, &format!("/templates/{id}"), &[], vec![])
            .await?;
    }
    kill(src).await?;
    let pss_med = stats::median(&pss_kib);
    let fit = if pss_med > 0.0 {
        (16.0 * 1024.0 * 1024.0 / pss_med).floor()
    } else {
        f64::NAN
    };
    Ok(vec![
        Figure::timing(
            "snapshot of a running 256 MiB sandbox (POST /sandboxes/{id}/snapshots)",
            &snap,
            "ms",
        )
        .baseline("issue #8 target", 100.0, false)
        .baseline("issue #31 goal", 60.0, false),
        Figure::timing(
            "create from a snapshot in the local cache (POST /v2/sandboxes)",
            &from_snap,
            "ms",
        )
        .baseline("issue #8 target", 60.0, false),
        Figure::timing(
            "fork x8 until all eight answer a command (POST /sandboxes/{id}/fork)",
            &fork8,
            "ms",
        )
        .baseline("issue #8 target", 500.0, false),
        Figure::timing(
            "fork x8: its CPU floor (the eight QEMUs' CPU seconds until their first answer, over the cores)",
            &floor,
            "ms",
        )
        .param("cores", cores),
        Figure::new(
            "fork x8 over its CPU floor",
            stats::median(&over_floor),
            "x",
            k3_common::report::Better::Lower,
        )
        .param("rounds", over_floor.len())
        .baseline("issue #31 goal", 1.3, false),
        Figure::timing(
            "8 concurrent creates, each until envd answers (warm pool grown by an earlier burst)",
            &conc,
            "ms",
        )
        .baseline("issue #8 target", 250.0, false),
        Figure::timing(
            "8 concurrent creates, each until envd answers (first burst: warm pool at its floor of 2)",
            &conc_first,
            "ms",
        )
        .baseline("issue #31 goal", 250.0, false),
        Figure::new(
            "first burst: its CPU floor (the QEMUs it started, CPU seconds until all answered, over the cores)",
            burst_floor.unwrap_or(f64::NAN),
            "ms",
            k3_common::report::Better::Lower,
        )
        .param("cores", cores),
        Figure::new(
            "incremental snapshot: bytes stored after the guest wrote 1 MiB, over the first snapshot's data",
            inc_second as f64 / inc_first as f64 * 100.0,
            "%",
            k3_common::report::Better::Lower,
        )
        .param("first snapshot data bytes", inc_first as f64)
        .param("second snapshot new bytes", inc_second as f64)
        .baseline("issue #8 target", 10.0, false),
        Figure::new(
            "RAM file a sandbox keeps of 64 MiB its guest wrote and freed (free page reporting, 20 s at most)",
            held_after - held_before,
            "MiB",
            k3_common::report::Better::Lower,
        )
        .param("RAM file before, MiB", held_before.round())
        .param("with the 64 MiB written, MiB", held_peak.round()),
        Figure::timing(
            "PSS per idle fork (QEMU process, smaps_rollup)",
            &pss_kib,
            "KiB",
        )
        .param("idle forks in 16 GiB", fit)
        .baseline("issue #31 goal (30 MiB)", 30.0 * 1024.0, false),
    ])
}

/// One `fork` of eight: its time until all eight answered a command, and its CPU floor.
struct ForkRound {
    ms: f64,
    /// The CPU the eight QEMUs spent from their start to their first answer, over the cores (`None`
    /// where a QEMU's stat could not be read).
    floor_ms: Option<f64>,
    /// PSS of each fork's QEMU right after its first answer.
    pss_kib: Vec<f64>,
    /// The same after the round's settle time (empty without one).
    pss_settled_kib: Vec<f64>,
}

fn cores() -> f64 {
    std::thread::available_parallelism().map_or(1, |n| n.get()) as f64
}

/// Forks `src` eight times, runs a command in each, reads their CPU and PSS (again after `settle`, when
/// not zero: what the host's KSM merged meanwhile), and kills them.
async fn fork_round(http: &Http, src: &str, settle: Duration) -> anyhow::Result<ForkRound> {
    let t = Instant::now();
    let forks = http
        .json(
            Method::POST,
            &format!("/sandboxes/{src}/fork"),
            json!({"count": 8, "timeout": 600}),
            201,
        )
        .await?;
    let ids: Vec<(String, String)> = forks
        .as_array()
        .context("fork list")?
        .iter()
        .map(|f| {
            let sb = &f["sandbox"];
            Some((
                sb["sandboxID"].as_str()?.to_string(),
                sb["envdAccessToken"].as_str()?.to_string(),
            ))
        })
        .collect::<Option<_>>()
        .context("a fork failed")?;
    let answered =
        futures_util::future::join_all(ids.iter().map(|(id, tok)| http.command(id, tok))).await;
    let took = ms(t);
    answered.into_iter().collect::<anyhow::Result<Vec<_>>>()?;
    let cpu: Option<f64> = ids
        .iter()
        .map(|(id, _)| qemu_pid(id).and_then(cpu_seconds))
        .sum();
    let pss = || -> Vec<f64> {
        ids.iter()
            .filter_map(|(id, _)| qemu_pid(id).and_then(pss_kib_of))
            .map(|k| k as f64)
            .collect()
    };
    let pss_kib = pss();
    let mut pss_settled_kib = vec![];
    if !settle.is_zero() {
        tokio::time::sleep(settle).await;
        pss_settled_kib = pss();
    }
    for (id, _) in ids {
        http.kill(&id).await?;
    }
    Ok(ForkRound {
        ms: took,
        floor_ms: cpu.map(|c| c / cores() * 1000.0),
        pss_kib,
        pss_settled_kib,
    })
}

/// `--forks-only`: `rounds` forks of eight from one sandbox (fork x8, its CPU floor and the ratio, PSS
/// per idle fork over every fork), then `creates` creates from `base`, each from a full warm pool, with
/// the first and second command after it and its QEMU's PSS after them. With `settle`, each round's
/// forks stay idle that long before a second PSS reading.
pub async fn fork_figures(
    http: &Http,
    rounds: usize,
    settle: Duration,
    creates: usize,
    rt: &agentenv_runtime::Runtime,
    runtime_dir: &std::path::Path,
) -> anyhow::Result<Vec<Figure>> {
    let (src, src_token) = http
        .create(json!({"templateID": "base", "timeout": 600}))
        .await?;
    http.command(&src, &src_token).await?;
    let (mut fork8, mut floor, mut over_floor, mut pss_fork) = (vec![], vec![], vec![], vec![]);
    let mut pss_settled = vec![];
    for _ in 0..rounds {
        let r = fork_round(http, &src, settle).await?;
        fork8.push(r.ms);
        if let Some(f) = r.floor_ms {
            floor.push(f);
            over_floor.push(r.ms / f);
        }
        pss_fork.extend(r.pss_kib);
        pss_settled.extend(r.pss_settled_kib);
    }
    http.kill(&src).await?;
    let (mut create, mut first, mut second, mut pss_create) = (vec![], vec![], vec![], vec![]);
    for _ in 0..creates {
        let end = Instant::now() + std::time::Duration::from_secs(60);
        while rt.warm_ready("base") < 2 && Instant::now() < end {
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        let t = Instant::now();
        let (id, token) = http.create(json!({"templateID": "base"})).await?;
        create.push(ms(t));
        let t = Instant::now();
        http.command(&id, &token).await?;
        first.push(ms(t));
        let t = Instant::now();
        http.command(&id, &token).await?;
        second.push(ms(t));
        // A create continues a warm VM, whose command line names its own folder: the record has its pid.
        let record = runtime_dir.join("sandboxes").join(&id).join("sandbox.json");
        let pid = std::fs::read(&record)
            .ok()
            .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
            .and_then(|v| v["phase"]["pid"].as_u64());
        if let Some(k) = pid.and_then(|p| pss_kib_of(p as u32)) {
            pss_create.push(k as f64);
        }
        http.kill(&id).await?;
    }
    let mut figures = vec![
        Figure::timing(
            "fork x8 until all eight answer a command (POST /sandboxes/{id}/fork)",
            &fork8,
            "ms",
        ),
        Figure::timing("fork x8: its CPU floor", &floor, "ms").param("cores", cores()),
        Figure::new(
            "fork x8 over its CPU floor",
            stats::median(&over_floor),
            "x",
            k3_common::report::Better::Lower,
        )
        .param("rounds", over_floor.len()),
        Figure::timing(
            "PSS per idle fork (QEMU process, smaps_rollup)",
            &pss_fork,
            "KiB",
        ),
        Figure::timing("create (POST /v2/sandboxes, full warm pool)", &create, "ms"),
        Figure::timing("first command after create", &first, "ms"),
        Figure::timing("second command after create", &second, "ms"),
        Figure::timing(
            "PSS per created sandbox after two commands",
            &pss_create,
            "KiB",
        ),
    ];
    if !settle.is_zero() {
        figures.push(
            Figure::timing(
                "PSS per idle fork after it settled (QEMU process, smaps_rollup)",
                &pss_settled,
                "KiB",
            )
            .param("settle_s", settle.as_secs()),
        );
    }
    Ok(figures)
}

/// A fresh sandbox's first snapshot (its data bytes) and, after the guest wrote 1 MiB of random data to
/// a file, what the next snapshot added to the chunk store.
async fn incremental<F, Fut>(http: &Http, create: &F) -> anyhow::Result<(u64, u64)>
where
    F: Fn(&'static str) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<(String, String)>>,
{
    let (id, token) = create("base").await?;
    let snap = |id: String| async move {
        let s = http
            .json(
                Method::POST,
                &format!("/sandboxes/{id}/snapshots"),
                json!({}),
                201,
            )
            .await?;
        let sid = s["snapshotID"].as_str().context("snapshotID")?.to_string();
        let end = Instant::now() + std::time::Duration::from_secs(120);
        while Instant::now() < end {
            let list = http
                .json(
                    Method::GET,
                    &format!("/snapshots?sandboxID={id}"),
                    Value::Null,
                    200,
                )
                .await?;
            let found = list
                .as_array()
                .into_iter()
                .flatten()
                .find(|v| v["snapshotID"] == sid);
            if let Some(v) = found
                && let (Some(new), Some(data)) =
                    (v["storedBytesNew"].as_u64(), v["storedBytesData"].as_u64())
            {
                http.send(Method::DELETE, &format!("/templates/{sid}"), &[], vec![])
                    .await?;
                return Ok::<_, anyhow::Error>((new, data));
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        bail!("snapshot {sid} was not stored within 120 s")
    };
    let (_, first_data) = snap(id.clone()).await?;
    http.run(
        &id,
        &token,
        "head -c 1048576 /dev/urandom > /tmp/blob.bin && sync",
    )
    .await?;
    let (second_new, _) = snap(id.clone()).await?;
    http.kill(&id).await?;
    Ok((first_data, second_new))
}

/// MiB a new sandbox's RAM file holds before its guest writes 64 MiB, with them written, and once the
/// guest freed them and reported that (at most 20 s).
async fn freed<F, Fut>(
    http: &Http,
    rt: &agentenv_runtime::Runtime,
    create: &F,
) -> anyhow::Result<(f64, f64, f64)>
where
    F: Fn(&'static str) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<(String, String)>>,
{
    let (id, token) = create("base").await?;
    let held = || async {
        let b = rt
            .ram_file_bytes(&id)
            .await
            .context("the sandbox's RAM file")?;
        Ok::<_, anyhow::Error>(b as f64 / (1 << 20) as f64)
    };
    let before = held().await?;
    http.run(&id, &token, "head -c 67108864 /dev/urandom > /dev/shm/x")
        .await?;
    let peak = held().await?;
    http.run(&id, &token, "rm /dev/shm/x").await?;
    let end = Instant::now() + Duration::from_secs(20);
    let mut after = held().await?;
    while after > before + 4.0 && Instant::now() < end {
        tokio::time::sleep(Duration::from_millis(200)).await;
        after = held().await?;
    }
    http.kill(&id).await?;
    Ok((before, peak, after))
}

/// The QEMU process whose command line names sandbox `id`.
fn qemu_pid(id: &str) -> Option<u32> {
    std::fs::read_dir("/proc")
        .ok()?
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .find(|pid| {
            let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let cmd = String::from_utf8_lossy(&cmd);
            cmd.contains("qemu-system") && cmd.contains(&format!("/{id}/"))
        })
}

/// PSS in KiB of process `pid`.
fn pss_kib_of(pid: u32) -> Option<u64> {
    let roll = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).ok()?;
    roll.lines()
        .find(|l| l.starts_with("Pss:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// CPU seconds (user and system) process `pid` has used.
fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command (which may hold spaces): state is the 3rd, utime the 14th, stime the 15th.
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split(' ').collect();
    let ticks: f64 = f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    (hz > 0.0).then(|| ticks / hz)
}
