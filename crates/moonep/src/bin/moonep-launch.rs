//! `moonep-launch -n R [--port P] -- <bin> args`: one process per GPU (see `moonep::gpu::launch`).

use std::path::PathBuf;

use clap::Parser;

/// Launches R ranks of a program, one per GPU; kills all ranks if one fails.
#[derive(Parser)]
#[command(name = "moonep-launch")]
struct Cli {
    /// Number of ranks (processes).
    #[arg(short = 'n', long = "nproc", default_value_t = 2)]
    n: usize,
    /// Store port (MASTER_PORT); 0 picks a free one.
    #[arg(long, default_value_t = 0)]
    port: u16,
    /// Program to run.
    program: PathBuf,
    /// Its arguments.
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    args: Vec<String>,
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    moonep::gpu::launch::launch(cli.n, &cli.program, &cli.args, cli.port)?;
    Ok(())
}
