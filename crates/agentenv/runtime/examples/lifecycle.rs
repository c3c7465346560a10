//! Prints lifecycle latency medians: `cargo run --release -p agentenv-runtime --example lifecycle -- [n]`.
//! Needs the guest agent (`cargo build --release -p agentenv-guest`, or `AGENTENV_GUEST_BIN`).
//! `AGENTENV_RAM_DIR=/dev/shm/x` puts guest RAM files on a tmpfs ([`RuntimeConfig::ram_dir`]).

use agentenv_runtime::bench::{BenchError, LifecycleStats, lifecycle, lifecycle_on};
use agentenv_runtime::{Runtime, RuntimeConfig};

async fn with_ram_dir(n: usize, ram_dir: std::path::PathBuf) -> Result<LifecycleStats, BenchError> {
    let state = std::env::temp_dir().join(format!("agentenv-example-{}", std::process::id()));
    let mut cfg = RuntimeConfig::new(&state);
    cfg.ram_dir = Some(ram_dir.clone());
    let rt = Runtime::open(cfg).await?;
    rt.ensure_default_template(&|_| {}).await?;
    let r = lifecycle_on(&rt, n).await;
    let _ = std::fs::remove_dir_all(&state);
    let _ = std::fs::remove_dir_all(&ram_dir);
    r
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let n = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(20);
    let stats = match std::env::var_os("AGENTENV_RAM_DIR") {
        Some(d) => with_ram_dir(n, d.into()).await,
        None => lifecycle(n).await,
    };
    match stats {
        Ok(st) => {
            let med = LifecycleStats::median;
            println!(
                "accel={} n={} create_p50={:.1}ms pause_p50={:.1}ms resume_p50={:.1}ms kill_p50={:.1}ms",
                st.accel.as_str(),
                st.n,
                med(&st.create_ms),
                med(&st.pause_ms),
                med(&st.resume_ms),
                med(&st.kill_ms)
            );
            println!("create_ms={:?}\npause_ms={:?}", st.create_ms, st.pause_ms);
        }
        Err(e) => {
            eprintln!("lifecycle bench failed: {e}");
            std::process::exit(1);
        }
    }
}
