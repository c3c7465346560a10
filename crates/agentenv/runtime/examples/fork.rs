//! Times snapshot, fork x8 and 8 concurrent creates on the runtime alone (no HTTP), to find where the
//! time goes: `RUST_LOG=agentenv_runtime=debug cargo run --release -p agentenv-runtime --example fork -- [rounds]`.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use agentenv_envd::ExecRequest;
use agentenv_runtime::{CreateSpec, Runtime, RuntimeConfig, SnapshotMode};

fn spec(id: &str, template: &str) -> CreateSpec {
    CreateSpec {
        sandbox_id: id.into(),
        template_id: template.into(),
        env_vars: BTreeMap::new(),
        network: None,
    }
}

async fn run(rt: &Runtime, id: &str) {
    let req = exec_req("true");
    let (code, _) = rt
        .exec(id, &req, Duration::from_secs(60), |_| {})
        .await
        .expect("exec");
    assert_eq!(code, 0);
}

/// Two snapshots around a 1 MiB write in the guest, with what each added to the chunk store.
async fn incremental(rt: &Runtime) {
    let stored = |id: &str| {
        let id = id.to_string();
        async move {
            for _ in 0..600 {
                if let Some(s) = rt
                    .snapshots()
                    .into_iter()
                    .find(|s| s.id == id)
                    .and_then(|s| s.stored)
                {
                    return s;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            panic!("{id} not stored");
        }
    };
    rt.snapshot("src", "inc1", &[], SnapshotMode::Full)
        .await
        .expect("snapshot");
    let first = stored("inc1").await;
    let req = exec_req("head -c 1048576 /dev/urandom > /root/blob.bin && sync");
    let (code, _) = rt
        .exec("src", &req, Duration::from_secs(60), |_| {})
        .await
        .expect("exec");
    assert_eq!(code, 0);
    rt.snapshot("src", "inc2", &[], SnapshotMode::Full)
        .await
        .expect("snapshot");
    let second = stored("inc2").await;
    println!(
        "first: {} new of {} data; second: {} new ({:.1} % of the first's data)",
        first.bytes_new,
        first.bytes_data,
        second.bytes_new,
        100.0 * second.bytes_new as f64 / first.bytes_data as f64
    );
}

fn exec_req(cmd: &str) -> ExecRequest {
    ExecRequest {
        cmd: cmd.into(),
        user: "root".into(),
        cwd: None,
        envs: BTreeMap::new(),
        timeout_ms: 0,
        stdin_b64: None,
        background: false,
    }
}

/// User and system CPU seconds of all QEMU processes on the host.
fn qemu_cpu() -> (f64, f64) {
    let (mut u, mut s) = (0u64, 0u64);
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let p = e.path();
        let Ok(cmd) = std::fs::read(p.join("cmdline")) else {
            continue;
        };
        if !String::from_utf8_lossy(&cmd).contains("qemu-system") {
            continue;
        }
        let Ok(stat) = std::fs::read_to_string(p.join("stat")) else {
            continue;
        };
        let rest: Vec<&str> = stat
            .rsplit_once(')')
            .unwrap()
            .1
            .split_whitespace()
            .collect();
        u += rest[11].parse::<u64>().unwrap();
        s += rest[12].parse::<u64>().unwrap();
    }
    (u as f64 / 100.0, s as f64 / 100.0)
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let rounds: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(3);
    let state = std::env::temp_dir().join(format!("agentenv-fork-{}", std::process::id()));
    let mut cfg = RuntimeConfig::new(&state);
    if let Some(kib) = std::env::var("CHUNK_KIB")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
    {
        let mut store = agentenv_store::StoreConfig::local(state.join("chunks"), 32 << 30);
        store.chunk_size = kib << 10;
        cfg.store = Some(store);
    }
    let rt = Runtime::open(cfg).await.expect("runtime");
    rt.ensure_default_template(&|_| {}).await.expect("template");
    rt.create(spec("src", "base")).await.expect("create");
    run(&rt, "src").await;
    if std::env::var_os("INCREMENTAL").is_some() {
        incremental(&rt).await;
        rt.kill("src").await.expect("kill");
        rt.close().await;
        let _ = std::fs::remove_dir_all(&state);
        return;
    }
    for r in 0..rounds {
        let t = Instant::now();
        rt.snapshot("src", &format!("snap{r}"), &[], SnapshotMode::Full)
            .await
            .expect("snapshot");
        println!("snapshot {r}: {:.1} ms", ms(t));
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let n: usize = std::env::var("FORKS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(8);
    for r in 0..rounds {
        let ids: Vec<String> = (0..n).map(|i| format!("f{r}x{i}")).collect();
        let t = Instant::now();
        let made = rt.fork("src", &ids).await.expect("fork");
        let forked = ms(t);
        for m in made {
            m.expect("a fork");
        }
        let cpu0 = qemu_cpu();
        let firsts = futures_util::future::join_all(ids.iter().map(|id| async {
            let t = Instant::now();
            run(&rt, id).await;
            ms(t).round()
        }))
        .await;
        let all = ms(t);
        let cpu1 = qemu_cpu();
        let t2 = Instant::now();
        futures_util::future::join_all(ids.iter().map(|id| run(&rt, id))).await;
        let cpu2 = qemu_cpu();
        tokio::time::sleep(Duration::from_secs(2)).await;
        let cpu3 = qemu_cpu();
        println!(
            "idle QEMU CPU over 2 s: {:?}",
            (cpu3.0 - cpu2.0, cpu3.1 - cpu2.1)
        );
        println!(
            "QEMU CPU (user, sys) s: first commands {:?}, second {:?}",
            (cpu1.0 - cpu0.0, cpu1.1 - cpu0.1),
            (cpu2.0 - cpu1.0, cpu2.1 - cpu1.1)
        );
        println!(
            "fork x{n} {r}: {forked:.1} ms forked, {all:.1} ms all answered (first commands {firsts:?} ms, second round {:.1} ms)",
            ms(t2)
        );
        for id in &ids {
            rt.kill(id).await.expect("kill");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    for r in 0..rounds {
        let t = Instant::now();
        let made = futures_util::future::join_all((0..8).map(|i| {
            let rt = rt.clone();
            async move {
                let t = Instant::now();
                rt.create(spec(&format!("c{r}x{i}"), "base"))
                    .await
                    .expect("create");
                ms(t)
            }
        }))
        .await;
        let mut sorted = made.clone();
        sorted.sort_by(f64::total_cmp);
        println!(
            "8 creates {r}: all {:.1} ms, each {:?}",
            ms(t),
            sorted.iter().map(|v| v.round()).collect::<Vec<_>>()
        );
        for i in 0..8 {
            rt.kill(&format!("c{r}x{i}")).await.expect("kill");
        }
        tokio::time::sleep(Duration::from_millis(2000)).await;
    }
    rt.kill("src").await.expect("kill");
    rt.close().await;
    let _ = std::fs::remove_dir_all(&state);
}
