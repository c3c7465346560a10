//! `agentenv-store`: operate a chunk store folder by hand (ingest, materialize, verify, gc, serve a
//! manifest over NBD), plus the `churn-*` loops the crash-safety tests kill with SIGKILL.

use std::path::PathBuf;

use agentenv_store::{ChunkStore, Compression, ManifestId, StoreConfig};
use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(about = "agentenv snapshot chunk store")]
struct Cli {
    /// Store folder.
    #[arg(long)]
    dir: PathBuf,
    /// Local bound in MiB.
    #[arg(long, default_value_t = 4096)]
    max_mib: u64,
    /// Chunk size in KiB.
    #[arg(long, default_value_t = 64)]
    chunk_kib: usize,
    /// zstd level per chunk (0 = off).
    #[arg(long, default_value_t = 0)]
    zstd: i32,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Ingest files; prints one JSON line per file.
    Ingest { files: Vec<PathBuf> },
    /// Write manifest ID to DEST.
    Materialize { id: String, dest: PathBuf },
    /// Check every local chunk.
    Verify,
    /// Remove unreferenced chunks.
    Gc,
    /// Serve manifest ID read-only over NBD on SOCKET until killed.
    ServeNbd { id: String, socket: PathBuf },
    /// Forever: fill FILE (MIB MiB) from seed SEED+k, print `ingesting <k>`, ingest, print `committed <k> <id>`.
    ChurnIngest {
        file: PathBuf,
        #[arg(long, default_value_t = 32)]
        mib: usize,
        #[arg(long)]
        seed: u64,
    },
    /// Forever: materialize manifest ID to DEST, print `materialized <k>`.
    ChurnMaterialize { id: String, dest: PathBuf },
}

fn manifest_id(s: &str) -> Result<ManifestId> {
    ManifestId::from_hex(s).with_context(|| format!("{s:?} is not a manifest id"))
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<()> {
    let cli = Cli::parse();
    let mut cfg = StoreConfig::local(&cli.dir, cli.max_mib << 20);
    cfg.chunk_size = cli.chunk_kib << 10;
    if cli.zstd > 0 {
        cfg.compression = Compression::Zstd { level: cli.zstd };
    }
    let store = ChunkStore::open(cfg)
        .await
        .with_context(|| format!("open {}", cli.dir.display()))?;
    match cli.cmd {
        Cmd::Ingest { files } => {
            for f in files {
                let (m, s) = store.ingest(&f).await?;
                println!(
                    r#"{{"file":{:?},"manifest":"{}","bytes_total":{},"bytes_data":{},"bytes_new":{},"chunks_new":{},"chunks_reused":{},"elapsed_ms":{:.3}}}"#,
                    f.display().to_string(),
                    m.id(),
                    s.bytes_total,
                    s.bytes_data,
                    s.bytes_new,
                    s.chunks_new,
                    s.chunks_reused,
                    s.elapsed.as_secs_f64() * 1e3
                );
            }
        }
        Cmd::Materialize { id, dest } => {
            let m = store.manifest(&manifest_id(&id)?).await?;
            let s = store.materialize(&m, &dest).await?;
            println!("{s:?}");
        }
        Cmd::Verify => {
            let r = store.verify().await?;
            println!(
                "{} chunks, {} bytes, {} corrupt, {} missing",
                r.chunks,
                r.bytes,
                r.corrupt.len(),
                r.missing.len()
            );
            if !r.corrupt.is_empty() {
                bail!("corrupt chunks: {:?}", r.corrupt);
            }
        }
        Cmd::Gc => println!("{:?}", store.gc().await?),
        Cmd::ServeNbd { id, socket } => {
            let m = store.manifest(&manifest_id(&id)?).await?;
            let srv = agentenv_store::nbd::NbdServer::serve(store, m, "disk", &socket).await?;
            println!("{}", srv.uri());
            tokio::signal::ctrl_c().await?;
            srv.shutdown().await;
        }
        Cmd::ChurnIngest { file, mib, seed } => {
            let mut buf = vec![0u8; mib << 20];
            for k in 0u64.. {
                agentenv_store::testing::fill_random(&mut buf, seed + k);
                std::fs::write(&file, &buf).with_context(|| format!("write {}", file.display()))?;
                println!("ingesting {k}");
                let (m, _) = store.ingest(&file).await?;
                println!("committed {k} {}", m.id());
            }
        }
        Cmd::ChurnMaterialize { id, dest } => {
            let m = store.manifest(&manifest_id(&id)?).await?;
            for k in 0u64.. {
                store.materialize(&m, &dest).await?;
                println!("materialized {k}");
            }
        }
    }
    Ok(())
}
