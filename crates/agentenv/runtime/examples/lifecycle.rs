//! Prints lifecycle latency medians: `cargo run --release -p agentenv-runtime --example lifecycle -- [n]`.
//! Needs the guest agent (`cargo build --release -p agentenv-guest`, or `AGENTENV_GUEST_BIN`).

use agentenv_runtime::bench::{LifecycleStats, lifecycle};

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let n = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(20);
    match lifecycle(n).await {
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
