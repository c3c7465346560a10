//! `agentenv-bench --cluster`: the cluster's costs, against a real etcd on loopback.
//! - create through an in-process gateway vs. the same node called directly, interleaved in one run;
//! - placements per second of the scheduler (the watched view, place, claim in one transaction) with
//!   100 simulated nodes registered in etcd, against reading the view from etcd per placement.

use std::sync::Arc;
use std::time::{Duration, Instant};

use agentenv_cluster::placement::{Demand, place};
use agentenv_cluster::{Claim, ClaimOutcome, ClusterStore, NodeRecord, SCHEMA_VERSION, ViewCache};
use anyhow::Context;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use k3_common::report::{Better, Figure};
use k3_common::stats;
use serde_json::json;

use super::{Http, ms};

/// Simulated nodes of the placement benchmark.
pub const SIM_NODES: usize = 100;

pub struct ClusterFigures {
    pub figures: Vec<Figure>,
    pub notes: Vec<String>,
}

/// Runs both parts; `node` is the in-process server, `state` its state folder (keys for the gateway).
pub async fn run(
    node: &Http,
    state_dir: &std::path::Path,
    sandboxes: Arc<agentenv_server::sandboxes::Sandboxes>,
    iterations: usize,
    placements: usize,
) -> anyhow::Result<ClusterFigures> {
    let etcd = agentenv_cluster::testing::Etcd::start(state_dir)
        .map_err(|e| anyhow::anyhow!("etcd for the cluster bench: {e}"))?;
    let endpoints = vec![etcd.endpoint.clone()];
    let join = agentenv_server::join::JoinConfig {
        etcd: endpoints.clone(),
        tls: None,
        node_id: None,
        prefix: "/bench/gw/".into(),
        advertise: node.base.clone(),
        ttl: Duration::from_secs(6),
        interval: Duration::from_secs(2),
        max_running: None,
        shared_store: false,
        reconcile_every: agentenv_server::join::RECONCILE_EVERY,
    };
    let reg = agentenv_server::join::join(state_dir, sandboxes, join).await?;
    let store = ClusterStore::connect(
        &endpoints,
        "/bench/gw/",
        agentenv_cluster::store::DEFAULT_DEADLINE,
    )
    .await?;
    let ring = Arc::new(agentenv_server::tenants::KeyRing::open(
        state_dir,
        node.key.clone(),
        Default::default(),
        None,
    ));
    let gw = agentenv_server::gateway::Gateway::new(store, ring, node.key.clone(), None);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let server =
        tokio::spawn(axum::serve(listener, agentenv_server::gateway::app(gw)).into_future());
    let via_gw = Http {
        base: format!("http://{addr}"),
        key: node.key.clone(),
        client: Client::builder(TokioExecutor::new()).build_http(),
    };

    // Interleaved: gateway, node, gateway, node, ... so drift hits both alike.
    let (mut through, mut direct) = (vec![], vec![]);
    for _ in 0..iterations {
        for (http, out) in [(&via_gw, &mut through), (node, &mut direct)] {
            let t = Instant::now();
            let (id, _) = http.create(json!({"templateID": "base"})).await?;
            out.push(ms(t));
            http.kill(&id).await?;
        }
    }
    server.abort();
    reg.leave().await;

    let (p, read) = placements_per_second(&endpoints, placements).await?;
    drop(etcd);
    let p99 = |v: &[f64]| stats::percentile(v, 99.0);
    let figures = vec![
        Figure::timing(
            "create through the gateway (POST /v2/sandboxes)",
            &through,
            "ms",
        )
        .baseline(
            "the same node called directly, same run",
            stats::median(&direct),
            true,
        )
        .param("n", iterations),
        Figure::new(
            "create through the gateway, p99",
            p99(&through),
            "ms",
            Better::Lower,
        )
        .baseline(
            "the same node called directly, p99, same run",
            p99(&direct),
            true,
        )
        .param("n", iterations),
        Figure::new(
            "placements per second (100 simulated nodes, real etcd)",
            p.rate,
            "1/s",
            Better::Higher,
        )
        .baseline(
            "reading nodes and claims from etcd per placement, same run",
            read.rate,
            true,
        )
        .param("placements", placements)
        .param("concurrency", CONCURRENCY)
        .param("lost claim races", p.lost),
        Figure::timing(
            "one placement (the watched view, place, claim transaction)",
            &p.latency,
            "ms",
        )
        .baseline(
            "reading nodes and claims from etcd instead, same run",
            stats::median(&read.latency),
            true,
        )
        .param("nodes", SIM_NODES),
        Figure::timing("  of which: the view, placing", &p.read, "ms"),
        Figure::timing("  of which: the claim transaction", &p.claim, "ms"),
    ];
    let notes = vec![
        "gateway and node in one process on loopback; etcd 3.4 (Debian etcd-server) on loopback, its data on the bench's temp folder".into(),
        format!("create: {iterations} through the gateway and {iterations} direct, interleaved; each killed before the next"),
        format!("placements: {CONCURRENCY} concurrent schedulers in one process (one ClusterStore) over {SIM_NODES} node records (refreshed every 10 s, 20 snapshot names each): the view kept by the gateway's watch (ViewCache), scoring every node and claiming the winner in one transaction; the baseline reads the node records and the claims newer than them from etcd per placement (serializable), as before the watch"),
    ];
    Ok(ClusterFigures { figures, notes })
}

const CONCURRENCY: usize = 8;

/// Placements through the watched view, then with etcd reads per placement (the baseline), over the
/// same simulated nodes.
async fn placements_per_second(
    endpoints: &[String],
    total: usize,
) -> anyhow::Result<(Placements, Placements)> {
    let store = ClusterStore::connect(endpoints, "/bench/sim/", Duration::from_secs(5)).await?;
    let mut regs = vec![];
    for i in 0..SIM_NODES {
        let rec = NodeRecord {
            version: SCHEMA_VERSION,
            id: format!("sim{i:03}"),
            url: format!("http://10.0.{}.{}:3000", i / 250, i % 250 + 1),
            cpus: 64,
            vcpus_used: (i % 7) as u32 * 4,
            memory_mb: 256 * 1024,
            free_memory_mb: 256 * 1024 - (i % 11) as u64 * 4096,
            running: (i % 13) as u32,
            paused: 0,
            max_running: Some(200),
            templates: vec!["base".into()],
            snapshots: (0..20)
                .map(|s| format!("snap-{}", (i * 7 + s) % 300))
                .collect(),
            shared_store: true,
            updated_at_ms: 0,
            sizes: Default::default(),
        };
        // Refreshed like a real node's (every DEFAULT_INTERVAL), so claims count until the next refresh.
        regs.push(
            agentenv_cluster::testing::register(&store, rec)
                .await
                .context("registering a simulated node")?,
        );
    }
    let views = ViewCache::start(store.clone());
    for _ in 0..100 {
        if views.is_live() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    anyhow::ensure!(views.is_live(), "the view watch did not start within 5 s");
    let cached = place_many(&store, Some(&views), total).await?;
    let read = place_many(&store, None, total).await?;
    for r in regs {
        r.leave().await;
    }
    Ok((cached, read))
}

/// `total` placements by [`CONCURRENCY`] schedulers, with the watched view or reading etcd.
async fn place_many(
    store: &ClusterStore,
    views: Option<&ViewCache>,
    total: usize,
) -> anyhow::Result<Placements> {
    let per_task = total.div_ceil(CONCURRENCY);
    let t0 = Instant::now();
    let tasks: Vec<_> = (0..CONCURRENCY)
        .map(|k| {
            let store = store.clone();
            let views = views.cloned();
            tokio::spawn(async move {
                let (mut lat, mut read, mut write) = (vec![], vec![], vec![]);
                let mut lost = 0usize;
                for j in 0..per_task {
                    let source = format!("snap-{}", (k * 31 + j * 17) % 300);
                    let t = Instant::now();
                    let view = match &views {
                        Some(v) => v.view().await?,
                        None => store.view().await?,
                    };
                    read.push(ms(t));
                    let choice = place(
                        &view.candidates(),
                        &Demand {
                            vcpus: 2,
                            memory_mb: 512,
                            source: &source,
                            exclude: &[],
                        },
                    )?;
                    let claim = Claim {
                        version: SCHEMA_VERSION,
                        node: choice.node,
                        vcpus: 2,
                        memory_mb: 512,
                        at_ms: 0,
                    };
                    let tw = Instant::now();
                    let outcome = match &views {
                        Some(v) => v.claim(&claim, None).await?,
                        None => store.claim(&claim, None).await?,
                    };
                    if outcome != ClaimOutcome::Claimed {
                        lost += 1;
                    }
                    write.push(ms(tw));
                    lat.push(ms(t));
                }
                anyhow::Ok((lat, read, write, lost))
            })
        })
        .collect();
    let mut p = Placements::default();
    for t in tasks {
        let (l, r, w, n) = t.await??;
        p.latency.extend(l);
        p.read.extend(r);
        p.claim.extend(w);
        p.lost += n;
    }
    p.rate = p.latency.len() as f64 / t0.elapsed().as_secs_f64();
    Ok(p)
}

#[derive(Default)]
struct Placements {
    rate: f64,
    latency: Vec<f64>,
    /// Reading the view, and placing on it (ms).
    read: Vec<f64>,
    /// The claim transaction (ms).
    claim: Vec<f64>,
    lost: usize,
}
