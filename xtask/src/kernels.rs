//! `cargo xtask build-kernels`: compile every `crates/*/kernels/*.cu` for sm_90a.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};
use k3_common::toolkit::{SM90A_FLAGS, find_nvcc};

use crate::util;

/// Compiles each kernel file to `<out>/<crate>/<name>.sm_90a.cubin`; returns the cubins.
pub fn build_all(out: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let nvcc = find_nvcc().context(
        "nvcc not found (PATH, CUDA_HOME, NVCC or /opt/cuda13); install it with: \
         pip install --target /opt/cuda13 \"cuda-toolkit[nvcc,crt,nvvm,cudart,cccl]==13.0.2\"",
    )?;
    let sources: Vec<PathBuf> = util::files_with_suffix(Path::new("crates"), ".cu")
        .into_iter()
        .filter(|p| {
            p.parent()
                .and_then(|d| d.file_name())
                .is_some_and(|n| n == "kernels")
        })
        .collect();
    if sources.is_empty() {
        bail!("no crates/*/kernels/*.cu found");
    }
    println!("nvcc: {}", nvcc.nvcc.display());
    let pb = util::bar(sources.len() as u64, "compiling kernels for sm_90a");
    let mut cubins = Vec::new();
    let mut failures = Vec::new();
    for src in &sources {
        let krate = src
            .components()
            .nth(1)
            .map(|c| c.as_os_str().to_string_lossy().into_owned())
            .unwrap_or_default();
        let stem = src
            .file_stem()
            .unwrap_or_default()
            .to_string_lossy()
            .into_owned();
        let dir = out.join(&krate);
        std::fs::create_dir_all(&dir)?;
        let cubin = dir.join(format!("{stem}.sm_90a.cubin"));
        pb.set_message(format!("{krate}/{stem}.cu"));
        let mut cmd = Command::new(&nvcc.nvcc);
        cmd.args(SM90A_FLAGS)
            .arg("-cubin")
            .arg("-I")
            .arg(src.parent().expect("kernels dir"));
        if let Some(inc) = std::env::var_os("CUTLASS_INCLUDE") {
            cmd.arg("-I").arg(inc);
        }
        cmd.arg("-o").arg(&cubin).arg(src);
        match util::run_checked(&mut cmd) {
            Ok(()) => cubins.push(cubin),
            Err(e) => failures.push(format!("{}: {e}", src.display())),
        }
        pb.inc(1);
    }
    pb.finish_and_clear();
    for c in &cubins {
        println!(
            "built {} ({} bytes)",
            c.display(),
            std::fs::metadata(c).map_or(0, |m| m.len())
        );
    }
    if !failures.is_empty() {
        bail!(
            "{} kernel file(s) failed:\n{}",
            failures.len(),
            failures.join("\n")
        );
    }
    Ok(cubins)
}
