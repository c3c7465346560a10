//! `agentenv-bench --tier <cpu|kvm> --out report.json`: sandbox lifecycle latency through the
//! E2B HTTP API of an in-process server on loopback (real runtime, real guests).
//! Tier cpu forces TCG; tier kvm runs only where a probe guest boots under KVM.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, bail};
use bytes::Bytes;
use clap::Parser;
use http_body_util::{BodyExt, Full};
use hyper::{Method, Request};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use k3_common::kvm::{self, KvmVerdict};
use k3_common::report::{Figure, Plot, PlotKind, Report, Section, Series, Skipped, Tier};
use k3_common::stats;
use serde_json::{Value, json};

use agentenv_server::app::{self, AppState, ServerConfig};
use agentenv_server::backend::VmBackend;
use agentenv_server::{keys, runtime_backend};

mod cluster;
mod host;
mod lazy;
mod load;
mod net;
mod s3;
mod snapshots;

#[derive(Parser)]
#[command(
    name = "agentenv-bench",
    about = "agentenv sandbox lifecycle latency through the E2B API"
)]
struct Args {
    #[arg(long)]
    tier: Tier,
    #[arg(long)]
    out: PathBuf,
    /// Sandboxes created (each is paused, resumed and killed once).
    #[arg(long, default_value_t = 12)]
    iterations: usize,
    /// Command round trips per sandbox.
    #[arg(long, default_value_t = 5)]
    commands: usize,
    /// Concurrent connections of the get/list load.
    #[arg(long, default_value_t = 16)]
    load_conns: usize,
    /// Requests per connection of the get/list load.
    #[arg(long, default_value_t = 250)]
    load_requests: usize,
    /// Run only the soak: create/pause/resume/kill churn for this many seconds (0: no soak).
    #[arg(long, default_value_t = 0)]
    soak_s: u64,
    /// Run every QEMU as this process's user instead of a uid of its own (for A/B runs).
    #[arg(long)]
    no_qemu_uids: bool,
    /// Folder for guest RAM files, as the server's `--ram-dir` (e.g. a tmpfs; default: the state folder).
    #[arg(long)]
    ram_dir: Option<PathBuf>,
    /// Give sandboxes a network (to the bench's own test internet) and time its throughput.
    #[arg(long)]
    network: bool,
    /// Run only the cluster bench: create through a gateway vs. the node directly, and placements per
    /// second with 100 simulated nodes (needs `etcd`).
    #[arg(long)]
    cluster: bool,
    /// Run only the restore from S3 with a cold cache (needs `weed`) and print its figures.
    #[arg(long)]
    s3_only: bool,
    /// Placements of the cluster bench.
    #[arg(long, default_value_t = 4000)]
    placements: usize,
    /// Run only the lazy disk bench: first-command latency of the 1 GiB template image served from S3
    /// (SeaweedFS on loopback) over NBD on a node with an empty cache, against a warm cache and a local
    /// disk (needs `weed`).
    #[arg(long)]
    lazy: bool,
    /// Rounds of the lazy disk bench (one fresh node each).
    #[arg(long, default_value_t = 3)]
    lazy_rounds: usize,
    /// Cap of each QEMU's TCG translation cache in MiB, as the server's `--tcg-tb-mib` (0: QEMU's
    /// default; unset: the runtime's default).
    #[arg(long)]
    tcg_tb_mib: Option<u32>,
    /// Run only this many forks of eight (fork x8, its CPU floor, PSS per idle fork), then `--iterations`
    /// creates with their first command, and print the figures (0: the whole bench).
    #[arg(long, default_value_t = 0)]
    forks_only: usize,
    /// With `--forks-only`: seconds each round's forks stay idle before a second PSS reading (what
    /// the host's KSM merged meanwhile; see `--mem-merge`).
    #[arg(long, default_value_t = 0)]
    settle_s: u64,
    /// Let the host's KSM merge the VMs' pages, as the server's `--mem-merge`.
    #[arg(long)]
    mem_merge: bool,
}

struct Http {
    base: String,
    key: String,
    client: Client<HttpConnector, Full<Bytes>>,
}

impl Http {
    /// The same server and key through a client with its own connections.
    fn clone_with_own_pool(&self) -> Http {
        Http {
            base: self.base.clone(),
            key: self.key.clone(),
            client: Client::builder(TokioExecutor::new()).build_http(),
        }
    }

    async fn send(
        &self,
        method: Method,
        path: &str,
        headers: &[(&str, &str)],
        body: Vec<u8>,
    ) -> anyhow::Result<(u16, Bytes)> {
        let mut b = Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.base))
            .header("X-API-KEY", &self.key);
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        let resp = self
            .client
            .request(b.body(Full::new(Bytes::from(body)))?)
            .await?;
        let status = resp.status().as_u16();
        Ok((status, resp.into_body().collect().await?.to_bytes()))
    }

    async fn json(
        &self,
        method: Method,
        path: &str,
        body: Value,
        want: u16,
    ) -> anyhow::Result<Value> {
        let (status, bytes) = self
            .send(
                method,
                path,
                &[("Content-Type", "application/json")],
                serde_json::to_vec(&body)?,
            )
            .await?;
        if status != want {
            bail!("{path}: HTTP {status}: {}", String::from_utf8_lossy(&bytes));
        }
        Ok(serde_json::from_slice(&bytes).unwrap_or(Value::Null))
    }

    /// `POST /v2/sandboxes` with `body`: the new sandbox's id and envd access token.
    async fn create(&self, body: Value) -> anyhow::Result<(String, String)> {
        let c = self.json(Method::POST, "/v2/sandboxes", body, 201).await?;
        let id = c["sandboxID"].as_str().context("sandboxID")?.to_string();
        let token = c["envdAccessToken"]
            .as_str()
            .context("envdAccessToken")?
            .to_string();
        Ok((id, token))
    }

    /// `DELETE /sandboxes/{id}`.
    async fn kill(&self, id: &str) -> anyhow::Result<()> {
        self.send(Method::DELETE, &format!("/sandboxes/{id}"), &[], vec![])
            .await
            .map(|_| ())
    }

    /// One `commands.run("true")`-style Start stream through the data plane, to its end.
    async fn command(&self, id: &str, token: &str) -> anyhow::Result<()> {
        self.run(id, token, "true").await.map(|_| ())
    }

    /// Runs `script` with bash in the guest through the data plane; returns its stdout.
    async fn run(&self, id: &str, token: &str, script: &str) -> anyhow::Result<String> {
        let msg = serde_json::to_vec(
            &json!({"process": {"cmd": "/bin/bash", "args": ["-c", script]}, "stdin": false}),
        )?;
        let mut body = vec![0u8];
        body.extend_from_slice(&(msg.len() as u32).to_be_bytes());
        body.extend_from_slice(&msg);
        let headers = [
            ("E2b-Sandbox-Id", id),
            ("E2b-Sandbox-Port", "49983"),
            ("X-Access-Token", token),
            ("Content-Type", "application/connect+json"),
            ("Connect-Protocol-Version", "1"),
        ];
        let (status, bytes) = self
            .send(Method::POST, "/process.Process/Start", &headers, body)
            .await?;
        if status != 200 || !String::from_utf8_lossy(&bytes).contains("\"end\"") {
            bail!(
                "command: HTTP {status}: {}",
                String::from_utf8_lossy(&bytes)
            );
        }
        Ok(stdout_of(&bytes))
    }
}

/// The stdout of a Connect stream of process events (envelopes: flags, length, JSON).
fn stdout_of(mut b: &[u8]) -> String {
    use base64::Engine;
    let mut out = Vec::new();
    while b.len() >= 5 {
        let n = u32::from_be_bytes([b[1], b[2], b[3], b[4]]) as usize;
        let Some(msg) = b.get(5..5 + n) else { break };
        if let Ok(v) = serde_json::from_slice::<Value>(msg)
            && let Some(d) = v["event"]["data"]["stdout"].as_str()
        {
            out.extend(
                base64::engine::general_purpose::STANDARD
                    .decode(d)
                    .unwrap_or_default(),
            );
        }
        b = &b[5 + n..];
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// An in-process server on `backend` (state and API key in `dir`) on a loopback port: a client with
/// its key, the server task, and its state.
async fn serve(
    backend: Arc<dyn VmBackend>,
    dir: &std::path::Path,
) -> anyhow::Result<(Http, tokio::task::JoinHandle<()>, AppState)> {
    let (api_key, _) = keys::load_or_create_api_key(dir)?;
    let state = AppState::open(
        backend,
        ServerConfig {
            state_dir: dir.to_path_buf(),
            api_key: api_key.clone(),
            max_upload_bytes: 1 << 30,
            lifecycle: Default::default(),
            rate_limit: None,
        },
    )
    .await?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let router = app::app(state.clone());
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, router).await;
    });
    let http = Http {
        base: format!("http://{addr}"),
        key: api_key,
        client: Client::builder(TokioExecutor::new()).build_http(),
    };
    Ok((http, task, state))
}

/// [`serve`] on runtime `rt`.
async fn serve_runtime(
    rt: agentenv_runtime::Runtime,
    dir: &std::path::Path,
) -> anyhow::Result<(Http, tokio::task::JoinHandle<()>)> {
    serve(Arc::new(runtime_backend::RuntimeBackend(rt)), dir)
        .await
        .map(|(h, t, _)| (h, t))
}

/// The notes of a section run on its own: the command line, `notes`, and the machine caveat.
fn side_notes(notes: Vec<String>) -> Vec<String> {
    let cmd: Vec<String> = std::env::args().collect();
    std::iter::once(format!("command: {}", cmd.join(" ")))
        .chain(notes)
        .chain([CAVEAT.to_string()])
        .collect()
}

/// Every section's caveat about this machine.
const CAVEAT: &str = "caveat: 2-core dev box shared with other builds; TCG is software emulation";

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

fn cdf(name: &str, samples: &[f64]) -> Series {
    Series {
        name: name.into(),
        points: stats::cdf(samples)
            .into_iter()
            .map(|(v, f)| (format!("{v:.3}"), f))
            .collect(),
    }
}

/// Why the kvm tier cannot run here, from the host-level KVM verdict (cached by k3-common).
async fn kvm_skip_reason() -> String {
    let verdict = tokio::task::spawn_blocking(|| {
        kvm::cached_check(false, agentenv_runtime::vmm::accel::PROBE_TIMEOUT)
    })
    .await;
    let why = match verdict {
        Ok(KvmVerdict::TcgOnly { pvm, reason, .. }) => {
            format!("{reason}{}", if pvm { " (PVM-only host)" } else { "" })
        }
        Ok(KvmVerdict::Kvm { .. }) => {
            "a host-level probe boots under KVM, but the runtime's microvm probe did not".into()
        }
        Ok(KvmVerdict::None { reason }) => reason,
        Err(e) => format!("KVM check task failed: {e}"),
    };
    format!("{why}; the runtime falls back to TCG")
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    k3_common::telemetry::init("warn");
    let args = Args::parse();
    let mut report = Report::here();
    let machine = k3_common::machine::hostname();
    let accel = match args.tier {
        Tier::Cpu => agentenv_runtime::Accel::Tcg,
        Tier::Kvm => agentenv_runtime::Accel::Auto,
        other => {
            report.skipped.push(Skipped {
                tier: other,
                machine,
                what: "agentenv".into(),
                reason: "agentenv has only the cpu (TCG) and kvm tiers".into(),
            });
            report.write(&args.out)?;
            return Ok(());
        }
    };
    let state = tempfile::Builder::new()
        .prefix("agentenv-bench-")
        .tempdir()?;
    if args.lazy {
        let l = lazy::run(state.path(), accel, args.lazy_rounds).await?;
        let notes = side_notes(l.notes);
        report.sections.push(Section {
            system: "agentenv".into(),
            tier: args.tier,
            title: "Lazy disks: a template image served from S3 over NBD".into(),
            machine,
            figures: l.figures,
            plots: vec![],
            notes,
        });
        report.write(&args.out)?;
        println!("wrote {}", args.out.display());
        // Background work of the dropped runtimes (prepared files) may still write for a moment.
        for _ in 0..50 {
            if std::fs::remove_dir_all(state.path()).is_ok() {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        return Ok(());
    }
    let mut cfg = agentenv_runtime::RuntimeConfig::new(state.path().join("runtime"));
    cfg.accel = accel;
    if args.no_qemu_uids {
        cfg.qemu_uids = None;
    }
    cfg.ram_dir = args.ram_dir.clone();
    if let Some(mib) = args.tcg_tb_mib {
        cfg.tcg_tb_mib = (mib > 0).then_some(mib);
    }
    cfg.mem_merge = args.mem_merge;
    let tb_label = cfg
        .tcg_tb_mib
        .map_or("QEMU's default".to_string(), |m| format!("{m} MiB"));
    // Namespace and veth only: the host routes nothing to the test internet until the default
    // template (whose build fetches from the package mirror) is built.
    let mut internet = match args.network {
        true => Some(net::up().context("the test internet")?),
        false => None,
    };
    cfg.network = internet.as_ref().map(|i| agentenv_runtime::net::NetConfig {
        uplink: Some(i.uplink().to_owned()),
        warm: 2,
        required: true,
        ..Default::default()
    });
    let rt = agentenv_runtime::Runtime::open(cfg)
        .await
        .context("opening the runtime")?;
    let accel_name = runtime_backend::accel_label(&rt);
    if args.tier == Tier::Kvm && rt.accel() != agentenv_runtime::AccelKind::Kvm {
        let reason = kvm_skip_reason().await;
        report.skipped.push(Skipped {
            tier: Tier::Kvm,
            machine,
            what: "agentenv".into(),
            reason: reason.clone(),
        });
        report.write(&args.out)?;
        println!("kvm tier skipped: {reason}");
        return Ok(());
    }
    let progress =
        |p: agentenv_runtime::BuildProgress| tracing::info!(progress = ?p, "default template");
    let template_started = Instant::now();
    rt.ensure_default_template(&progress)
        .await
        .context("default template")?;
    let template_s = template_started.elapsed().as_secs_f64();
    println!("default template ready in {template_s:.1} s");
    if let Some(i) = internet.as_mut() {
        i.route(&[]).context("routing the test internet")?;
    }
    let warm_rt = rt.clone();
    let backend: Arc<dyn VmBackend> = Arc::new(runtime_backend::RuntimeBackend(rt));
    let (http, server, app_state) = serve(backend.clone(), state.path()).await?;
    let sandboxes = app_state.sandboxes.clone();
    let cmd: Vec<String> = std::env::args().collect();

    if args.cluster {
        let c = cluster::run(
            &http,
            state.path(),
            sandboxes,
            args.iterations,
            args.placements,
        )
        .await?;
        server.abort();
        let notes = side_notes(c.notes);
        report.sections.push(Section {
            system: "agentenv".into(),
            tier: args.tier,
            title: format!("Cluster: gateway and scheduler over etcd ({accel_name})"),
            machine,
            figures: c
                .figures
                .into_iter()
                .map(|f| f.param("accel", accel_name))
                .collect(),
            plots: vec![],
            notes,
        });
        report.write(&args.out)?;
        println!("wrote {}", args.out.display());
        return Ok(());
    }

    if args.forks_only > 0 {
        let figures = snapshots::fork_figures(
            &http,
            args.forks_only,
            std::time::Duration::from_secs(args.settle_s),
            args.iterations,
            &warm_rt,
            &state.path().join("runtime"),
        )
        .await?;
        server.abort();
        for f in &figures {
            let s = f.stats.as_ref();
            println!(
                "{}: {:.1} {} (p10 {:.1}, p90 {:.1}, n={}) [tb-size: {tb_label}]",
                f.name,
                f.value,
                f.unit,
                s.map_or(f64::NAN, |s| s.p10),
                s.map_or(f64::NAN, |s| s.p90),
                s.map_or(0, |s| s.n),
            );
        }
        report.sections.push(Section {
            system: "agentenv".into(),
            tier: args.tier,
            title: format!(
                "Forks and first commands, TCG translation cache {tb_label} ({accel_name})"
            ),
            machine,
            figures: figures
                .into_iter()
                .map(|f| f.param("accel", accel_name).param("tb-size", &tb_label))
                .collect(),
            plots: vec![],
            notes: side_notes(vec![]),
        });
        report.write(&args.out)?;
        return Ok(());
    }

    if args.s3_only {
        server.abort();
        match s3::cold_restore(accel, args.iterations.clamp(1, 5)).await? {
            Ok(figures) => {
                for f in &figures {
                    println!("{}: {:.1} {} {:?}", f.name, f.value, f.unit, f.params);
                }
            }
            Err(reason) => println!("not run: {reason}"),
        }
        return Ok(());
    }

    if args.soak_s > 0 {
        let soak = load::churn(
            &http,
            &state.path().to_string_lossy(),
            std::time::Duration::from_secs(args.soak_s),
        )
        .await;
        server.abort();
        let (figures, plot) = load::soak_figures(&soak);
        let mut notes = vec![
            format!("command: {}", cmd.join(" ")),
            format!("{} s of back-to-back cycles, one sandbox at a time, through the E2B API of an in-process server ({accel_name})", args.soak_s),
            "fds and RSS are the server process's (runtime included); QEMU processes are those naming the bench's state folder".into(),
        ];
        if let Some(e) = &soak.first_error {
            notes.push(format!("first failed cycle: {e}"));
        }
        report.sections.push(Section {
            system: "agentenv".into(),
            tier: args.tier,
            title: format!("Soak: create/pause/resume/kill churn ({accel_name})"),
            machine,
            figures: figures
                .into_iter()
                .map(|f| f.param("accel", accel_name))
                .collect(),
            plots: vec![plot],
            notes,
        });
        report.write(&args.out)?;
        println!(
            "soak: {} cycles, {} failed, {} QEMU left; wrote {}",
            soak.cycles,
            soak.errors,
            soak.qemu_after,
            args.out.display()
        );
        return Ok(());
    }

    let (mut create, mut command, mut pause, mut resume, mut kill) =
        (vec![], vec![], vec![], vec![], vec![]);
    for _ in 0..args.iterations {
        let t = Instant::now();
        let (id, token) = http.create(json!({"templateID": "base"})).await?;
        create.push(ms(t));
        for _ in 0..args.commands {
            let t = Instant::now();
            http.command(&id, &token).await?;
            command.push(ms(t));
        }
        let t = Instant::now();
        http.send(Method::POST, &format!("/sandboxes/{id}/pause"), &[], vec![])
            .await?;
        pause.push(ms(t));
        let t = Instant::now();
        http.json(
            Method::POST,
            &format!("/v2/sandboxes/{id}/connect"),
            json!({}),
            201,
        )
        .await?;
        resume.push(ms(t));
        http.command(&id, &token).await?;
        let t = Instant::now();
        http.kill(&id).await?;
        kill.push(ms(t));
    }
    let mut v2 = snapshots::snapshot_figures(&http, args.iterations, &warm_rt).await?;
    if let Some(i) = internet.as_ref() {
        let (id, token) = http.create(json!({"templateID": "base"})).await?;
        v2.extend(net::throughput(&http, i, &id, &token).await?);
        http.kill(&id).await?;
    }
    let mut s3_note = None;
    match s3::cold_restore(accel, args.iterations.clamp(1, 5)).await {
        Ok(Ok(f)) => v2.extend(f),
        Ok(Err(reason)) => {
            s3_note = Some(format!(
                "restore from S3 with a cold cache not run: {reason}"
            ))
        }
        Err(e) => s3_note = Some(format!("restore from S3 with a cold cache failed: {e:#}")),
    }
    let (load_ms, load_errors, load_rate) =
        load::get_list(&http, args.load_conns, args.load_requests, 4).await?;
    // Same-run baseline: the runtime's own create (no HTTP, no records).
    let mut direct = vec![];
    for i in 0..args.iterations.min(5) {
        let id = format!("benchdirect{i}");
        let t = Instant::now();
        backend
            .create(agentenv_server::backend::CreateSpec {
                sandbox_id: id.clone(),
                template_id: "base".into(),
                env_vars: BTreeMap::new(),
                network: None,
            })
            .await?;
        direct.push(ms(t));
        backend.kill(&id).await?;
    }
    server.abort();
    // Last, so that the gigabyte it writes and frees cannot speed up the figures above.
    let host_figure = host::fresh_memory_figure();

    let direct_med = stats::median(&direct);
    let anchor = |f: Figure, name: &str, v: f64| f.baseline(name, v, false);
    let figures = vec![
        anchor(
            Figure::timing(
                "create (POST /v2/sandboxes until envd answers)",
                &create,
                "ms",
            )
            .baseline("runtime.create without HTTP, same run", direct_med, true)
            .baseline("issue #31: keep (29bb2c3 on this box)", 20.4, false),
            "target on this TCG box",
            150.0,
        ),
        Figure::timing(
            "command round trip (process.Process/Start `true` via proxy)",
            &command,
            "ms",
        ),
        anchor(
            anchor(
                Figure::timing("pause (POST /sandboxes/{id}/pause)", &pause, "ms").baseline(
                    "issue #31 goal",
                    20.0,
                    false,
                ),
                "target on this TCG box",
                100.0,
            ),
            "public AgentENV claim (Firecracker on KVM)",
            100.0,
        ),
        anchor(
            Figure::timing(
                "resume (POST /v2/sandboxes/{id}/connect, paused)",
                &resume,
                "ms",
            )
            .baseline("issue #31: keep (29bb2c3 on this box)", 15.0, false),
            "public AgentENV claim: resume from snapshot (Firecracker on KVM)",
            50.0,
        ),
        Figure::timing("kill (DELETE /sandboxes/{id})", &kill, "ms"),
        Figure::timing(
            "get/list under load (GET /sandboxes/{id} and /v2/sandboxes)",
            &load_ms,
            "ms",
        )
        .param("connections", args.load_conns)
        .param("requests", load_ms.len())
        .param("errors", load_errors)
        .param("req/s", format!("{load_rate:.0}")),
        Figure::new(
            "get/list under load, p99",
            stats::percentile(&load_ms, 99.0),
            "ms",
            k3_common::report::Better::Lower,
        )
        .param("connections", args.load_conns)
        .param("errors", load_errors)
        .baseline("issue 9 bound", 20.0, false),
    ];
    let figures: Vec<Figure> = figures
        .into_iter()
        .chain(v2)
        .map(|f| {
            f.param("accel", accel_name)
                .param("n", args.iterations)
                .param("network", if args.network { "on" } else { "off" })
        })
        .chain(host_figure.as_ref().ok().cloned())
        .collect();
    let plot = Plot {
        title: format!("agentenv lifecycle latency CDF ({accel_name})"),
        kind: PlotKind::Cdf,
        x_label: "latency (ms)".into(),
        y_label: "fraction".into(),
        series: vec![
            cdf("create", &create),
            cdf("command", &command),
            cdf("pause", &pause),
            cdf("resume", &resume),
            cdf("kill", &kill),
        ],
    };
    report.sections.push(Section {
        system: "agentenv".into(),
        tier: args.tier,
        title: format!("Sandbox lifecycle through the E2B API ({accel_name})"),
        machine,
        figures,
        plots: vec![plot],
        notes: [
            format!("command: {}", cmd.join(" ")),
            format!("backend: QEMU -M microvm, accelerator {accel_name}; create restores the template's base snapshot"),
            format!("default template ready in {template_s:.1} s (built in the run when the cache had none)"),
            format!("QEMU users: {}", if args.no_qemu_uids { "the bench's own (--no-qemu-uids)" } else { "one uid per VM" }),
            format!("TCG translation cache per QEMU (tb-size): {tb_label}"),
            format!("guest RAM files: {}", args.ram_dir.as_ref().map_or("in the state folder (ext4)".into(), |d| d.display().to_string())),
            format!("network: {}", if args.network { "on (namespace, tap and nftables per sandbox; NAT to the bench's test internet namespace)" } else { "off" }),
            match internet.as_ref() {
                Some(i) => format!("test internet: {} (picked at run time: no host address, route, resolver or mirror answer uses it)", i.range()),
                None => "test internet: none".into(),
            },
            "client: HTTP/1.1 on loopback to an in-process agentenv server; one sandbox at a time".into(),
            format!("{} sandboxes, {} command round trips each; medians quoted, stats hold p99", args.iterations, args.commands),
            CAVEAT.into(),
        ]
        .into_iter()
        .chain(s3_note)
        .chain(host_figure.err().map(|e| format!("first-touch memory probe failed: {e:#}")))
        .collect(),
    });
    report.write(&args.out)?;
    println!("wrote {}", args.out.display());
    Ok(())
}
