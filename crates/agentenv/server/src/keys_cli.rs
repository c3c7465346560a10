//! `agentenv keys create|ls|revoke`: named API keys (tenants) and their quotas, in the state folder.

use clap::Subcommand;

#[derive(Subcommand)]
pub enum KeysCommand {
    /// Make a key; it is printed once and stored only as its SHA-256.
    Create {
        /// Tenant name: 1-24 of [a-z0-9-], starting with a letter.
        name: String,
        /// Most running sandboxes of this key at once (429 beyond; 0: no limit).
        #[arg(long, default_value_t = agentenv_server::sandboxes::Quota::KEY_DEFAULT_RUNNING)]
        max_running: usize,
        /// Most paused sandboxes of this key at once (0: no limit).
        #[arg(long, default_value_t = agentenv_server::sandboxes::Quota::KEY_DEFAULT_PAUSED)]
        max_paused: usize,
        /// Most memory of this key's running sandboxes together, MiB (0: no limit).
        #[arg(long, default_value_t = agentenv_server::sandboxes::Quota::KEY_DEFAULT_MEMORY_MB)]
        max_memory_mb: u64,
        /// Most snapshots of this key (API-built templates included) on a node (0: no limit).
        #[arg(long, default_value_t = agentenv_server::sandboxes::Quota::KEY_DEFAULT_SNAPSHOTS)]
        max_snapshots: usize,
        /// Most disk this key's snapshots occupy on a node together, GiB (0: no limit).
        #[arg(long, default_value_t = agentenv_server::sandboxes::Quota::KEY_DEFAULT_SNAPSHOT_GB)]
        max_snapshot_gb: u64,
    },
    /// List the keys (names, prefixes, quotas; never the keys).
    Ls {
        /// As JSON.
        #[arg(long)]
        json: bool,
    },
    /// Revoke a key; a running server refuses it from its next request on.
    Revoke { name: String },
}

pub fn manage_keys(state_dir: &std::path::Path, command: KeysCommand) -> anyhow::Result<()> {
    use agentenv_server::tenants;
    match command {
        KeysCommand::Create {
            name,
            max_running,
            max_paused,
            max_memory_mb,
            max_snapshots,
            max_snapshot_gb,
        } => {
            let quota = agentenv_server::sandboxes::Quota {
                max_running: (max_running > 0).then_some(max_running),
                max_paused: (max_paused > 0).then_some(max_paused),
                max_memory_mb: (max_memory_mb > 0).then_some(max_memory_mb),
                max_snapshots: (max_snapshots > 0).then_some(max_snapshots),
                max_snapshot_gb: (max_snapshot_gb > 0).then_some(max_snapshot_gb),
            };
            let (key, _) = tenants::create_key(state_dir, &name, quota)?;
            eprintln!("key {name:?} created; it is shown only this once:");
            println!("{key}");
        }
        KeysCommand::Ls { json } => {
            let keys = tenants::list_keys(state_dir)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&keys)?);
                return Ok(());
            }
            let limit = |v: Option<String>| v.unwrap_or_else(|| "-".into());
            println!(
                "{:<24} {:<14} {:<24} {:<8} {:>7} {:>6} {:>8} {:>5} {:>8}",
                "NAME",
                "PREFIX",
                "CREATED",
                "STATE",
                "RUNNING",
                "PAUSED",
                "MEM MiB",
                "SNAPS",
                "SNAP GiB"
            );
            for k in keys {
                println!(
                    "{:<24} {:<14} {:<24} {:<8} {:>7} {:>6} {:>8} {:>5} {:>8}",
                    k.name,
                    format!("{}…", k.prefix),
                    k.created_at,
                    if k.revoked_at.is_some() {
                        "revoked"
                    } else {
                        "active"
                    },
                    limit(k.quota.max_running.map(|v| v.to_string())),
                    limit(k.quota.max_paused.map(|v| v.to_string())),
                    limit(k.quota.max_memory_mb.map(|v| v.to_string())),
                    limit(k.quota.max_snapshots.map(|v| v.to_string())),
                    limit(k.quota.max_snapshot_gb.map(|v| v.to_string())),
                );
            }
        }
        KeysCommand::Revoke { name } => {
            tenants::revoke_key(state_dir, &name)?;
            println!("key {name:?} revoked");
        }
    }
    Ok(())
}
