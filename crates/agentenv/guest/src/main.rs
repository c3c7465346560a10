//! `agentenv-guest`: the envd-compatible agent. `init` = PID 1 in the VM; `agent` = the
//! port server PID 1 supervises; `serve` = the same protocol on a host socket for tests.

use std::sync::Arc;

use agentenv_guest::{Agent, AgentConfig, init};
use anyhow::{Context, bail};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "agentenv-guest",
    version,
    about = "agentenv guest agent (E2B envd protocol)"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(clap::Args, Clone)]
struct AgentArgs {
    /// Default user for requests that name none (default: `user` in the VM, else the current user).
    #[arg(long)]
    default_user: Option<String>,
    /// Require this X-Access-Token (may also be set later through POST /init).
    #[arg(long, env = "AGENTENV_ACCESS_TOKEN")]
    access_token: Option<String>,
    /// Largest accepted upload per file, in bytes.
    #[arg(long, default_value_t = 4 << 30)]
    max_upload_bytes: u64,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run as PID 1: mount pseudo filesystems, set the hostname, supervise `agent`, reap zombies.
    Init {
        /// Hostname to set.
        #[arg(long, default_value = "sandbox")]
        hostname: String,
        /// virtio-serial port name (or device path).
        #[arg(long, default_value = init::PORT_NAME)]
        port: String,
        #[command(flatten)]
        agent: AgentArgs,
    },
    /// Serve mux sessions on the virtio-serial port (what `init` runs).
    Agent {
        /// virtio-serial port name (or device path).
        #[arg(long, default_value = init::PORT_NAME)]
        port: String,
        /// Let POST /init set the clock.
        #[arg(long)]
        set_clock: bool,
        #[command(flatten)]
        agent: AgentArgs,
    },
    /// Serve on the host: `unix:<path>` or `tcp:<addr>` (plain HTTP/1.1 per connection), or
    /// `mux-unix:<path>` (every accepted connection is a mux channel, like the VM's port).
    Serve {
        /// Where to listen.
        #[arg(long)]
        listen: String,
        #[command(flatten)]
        agent: AgentArgs,
    },
}

fn agent_config(a: &AgentArgs, vm_default_user: bool, set_clock: bool) -> AgentConfig {
    let default_user = a.default_user.clone().unwrap_or_else(|| {
        if vm_default_user && agentenv_guest::users::lookup("user").is_some() {
            "user".into()
        } else {
            agentenv_guest::users::current().name
        }
    });
    AgentConfig {
        default_user,
        access_token: a.access_token.clone(),
        max_upload_bytes: a.max_upload_bytes,
        set_clock,
    }
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Init {
            hostname,
            port,
            agent,
        } => {
            // SAFETY: getpid has no preconditions.
            if unsafe { libc::getpid() } != 1 {
                bail!("`init` must run as PID 1");
            }
            init::mount_pseudo_filesystems();
            if let Err(e) = init::set_hostname(&hostname) {
                eprintln!("agentenv-guest init: sethostname: {e}");
            }
            if agent
                .default_user
                .as_deref()
                .is_none_or(|u| u == init::DEFAULT_USER.0)
                && let Err(e) = init::ensure_default_user()
            {
                eprintln!("agentenv-guest init: creating the default user: {e}");
            }
            // SAFETY: setting a variable before any other thread exists.
            unsafe {
                std::env::set_var(
                    "PATH",
                    "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                )
            };
            // The magic link still reaches our binary after the tmpfs mounts above hide its path.
            let exe = "/proc/self/exe".to_string();
            let mut cmd = vec![
                exe,
                "agent".into(),
                "--port".into(),
                port,
                "--set-clock".into(),
            ];
            if let Some(u) = agent.default_user {
                cmd.extend(["--default-user".into(), u]);
            }
            if let Some(t) = agent.access_token {
                cmd.extend(["--access-token".into(), t]);
            }
            cmd.extend([
                "--max-upload-bytes".into(),
                agent.max_upload_bytes.to_string(),
            ]);
            init::supervise(&cmd)
        }
        Cmd::Agent {
            port,
            set_clock,
            agent,
        } => {
            k3_common::telemetry::init("info");
            let rt = tokio::runtime::Runtime::new().context("starting the runtime")?;
            let cfg = agent_config(&agent, true, set_clock);
            if set_clock && let Err(e) = agentenv_guest::net::prepare() {
                eprintln!("agentenv-guest: preparing the NIC: {e}");
            }
            rt.block_on(async move {
                let a = Agent::new(cfg);
                tracing::info!(%port, "agentenv-guest agent serving the virtio port");
                init::serve_port(a, &port).await
            })
        }
        Cmd::Serve { listen, agent } => {
            k3_common::telemetry::init("info");
            let rt = tokio::runtime::Runtime::new().context("starting the runtime")?;
            let cfg = agent_config(&agent, false, false);
            rt.block_on(serve(Agent::new(cfg), &listen))
        }
    }
}

async fn serve(agent: Arc<Agent>, listen: &str) -> anyhow::Result<()> {
    if let Some(path) = listen.strip_prefix("unix:") {
        let _ = std::fs::remove_file(path);
        let l = tokio::net::UnixListener::bind(path).with_context(|| format!("binding {path}"))?;
        tracing::info!(%listen, "serving envd over HTTP/1.1");
        loop {
            let (s, _) = l.accept().await?;
            let a = agent.clone();
            tokio::spawn(async move { a.serve_connection(s).await });
        }
    } else if let Some(addr) = listen.strip_prefix("tcp:") {
        let l = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("binding {addr}"))?;
        tracing::info!(addr = %l.local_addr()?, "serving envd over HTTP/1.1");
        loop {
            let (s, _) = l.accept().await?;
            let _ = s.set_nodelay(true);
            let a = agent.clone();
            tokio::spawn(async move { a.serve_connection(s).await });
        }
    } else if let Some(path) = listen.strip_prefix("mux-unix:") {
        let _ = std::fs::remove_file(path);
        let l = tokio::net::UnixListener::bind(path).with_context(|| format!("binding {path}"))?;
        tracing::info!(%listen, "serving envd over mux sessions");
        loop {
            let (s, _) = l.accept().await?;
            let a = agent.clone();
            tokio::spawn(async move {
                let reason = init::serve_mux(a, s).await;
                tracing::info!(%reason, "mux session ended");
            });
        }
    } else {
        bail!("--listen must be unix:<path>, tcp:<addr> or mux-unix:<path>, got {listen}")
    }
}
