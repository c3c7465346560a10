//! `cargo xtask device-bundle`: everything a GPU machine without Rust needs, in one folder.
//!
//! Layout: `bin/` (release binaries: xtask and every bench/launcher binary), `tests/` (test executables of the
//! GPU crates, which skip nothing there), `wheels/` (abi3 wheels), `run.sh`.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};

use crate::util;

const GPU_PACKAGES: &[&str] = &["flashkda", "moonep"];

pub fn build(out: &Path, wheels: bool) -> anyhow::Result<()> {
    let bin = out.join("bin");
    let tests = out.join("tests");
    let wheel_dir = out.join("wheels");
    for d in [&bin, &tests, &wheel_dir] {
        let _ = std::fs::remove_dir_all(d);
        std::fs::create_dir_all(d)?;
    }
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let steps = 3 + u64::from(wheels);
    let pb = util::bar(steps, "release build");

    let mut build = Command::new(&cargo);
    build.args(["build", "--release", "--bins", "-p", "xtask"]);
    for p in GPU_PACKAGES {
        build.args(["-p", p]);
    }
    let executables = cargo_executables(&mut build)?;
    for exe in &executables {
        copy_stripped(exe, &bin)?;
    }
    pb.inc(1);

    pb.set_message("test executables");
    let mut test = Command::new(&cargo);
    test.args(["test", "--release", "--no-run"]);
    for p in GPU_PACKAGES {
        test.args(["-p", p]);
    }
    // Only the GPU test binaries travel: the CPU tests run in CI, and the tree that travels is capped at 64 MiB.
    for exe in cargo_executables(&mut test)?.into_iter().filter(|e| {
        e.file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with("gpu"))
    }) {
        copy_stripped(&exe, &tests)?;
    }
    pb.inc(1);

    if wheels {
        pb.set_message("abi3 wheels (maturin)");
        for p in GPU_PACKAGES {
            let manifest = Path::new("crates").join(p).join("Cargo.toml");
            if !Path::new("crates").join(p).join("pyproject.toml").is_file() {
                continue;
            }
            util::run_checked(
                Command::new("maturin")
                    .args(["build", "--release", "--features", "python", "-m"])
                    .arg(&manifest)
                    .arg("-o")
                    .arg(&wheel_dir),
            )
            .with_context(|| format!("building the {p} wheel (pip install maturin)"))?;
        }
        if let Ok(rd) = std::fs::read_dir(".whl") {
            for e in rd
                .flatten()
                .filter(|e| e.path().extension().is_some_and(|x| x == "whl"))
            {
                std::fs::copy(e.path(), wheel_dir.join(e.file_name()))?;
            }
        }
        pb.inc(1);
    }

    let provenance = k3_common::provenance::Provenance::current();
    std::fs::write(out.join("COMMIT"), &provenance.commit)?;
    std::fs::write(out.join("DIRTY"), if provenance.dirty { "1" } else { "0" })?;
    pb.set_message("run script");
    let script = out.join("run.sh");
    std::fs::write(&script, RUN_SH)?;
    set_executable(&script)?;
    pb.inc(1);
    pb.finish_and_clear();
    let size: u64 = util::files_with_suffix(out, "")
        .iter()
        .filter_map(|p| std::fs::metadata(p).ok())
        .map(|m| m.len())
        .sum();
    println!(
        "device bundle: {} ({:.1} MiB); on the GPU machine run: {}/run.sh all",
        out.display(),
        size as f64 / 1048576.0,
        out.display()
    );
    Ok(())
}

/// Runs a cargo build with `--message-format=json` and returns the executables it produced.
fn cargo_executables(cmd: &mut Command) -> anyhow::Result<Vec<PathBuf>> {
    let out = cmd
        .arg("--message-format=json-render-diagnostics")
        .output()
        .context("running cargo")?;
    if !out.status.success() {
        bail!("{cmd:?} failed:\n{}", String::from_utf8_lossy(&out.stderr));
    }
    let mut exes = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if v["reason"] == "compiler-artifact"
            && let Some(exe) = v["executable"].as_str()
        {
            exes.push(PathBuf::from(exe));
        }
    }
    Ok(exes)
}

fn copy_stripped(exe: &Path, dir: &Path) -> anyhow::Result<()> {
    let dst = dir.join(exe.file_name().context("executable name")?);
    std::fs::copy(exe, &dst).with_context(|| format!("copying {}", exe.display()))?;
    let _ = Command::new("strip")
        .arg("--strip-debug")
        .arg(&dst)
        .status();
    Ok(())
}

fn set_executable(p: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o755))
}

const RUN_SH: &str = r#"#!/usr/bin/env bash
# k3-stack GPU tiers on a machine without Rust. Run from the repository root:
#   .bundle/run.sh [doctor|test|bench|all] [extra args for xtask bench]
# Results go to $OUT (or .bundle/out): doctor.txt, tests.log, k3-report/.
set -uo pipefail
B=$(cd "$(dirname "$0")" && pwd)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-$B/out}; mkdir -p "$OUT"
SP=$(python3 -c 'import sysconfig;print(sysconfig.get_paths()["purelib"])' 2>/dev/null || true)
SHIM=/tmp/k3-cudarc-shim; mkdir -p "$SHIM"
[ -e "$SP/nvidia/nccl/lib/libnccl.so.2" ] && ln -sfn "$SP/nvidia/nccl/lib/libnccl.so.2" "$SHIM/libnccl.so"
[ -e "$SP/nvidia/cu13/lib/libnvrtc.so.13" ] && ln -sfn "$SP/nvidia/cu13/lib/libnvrtc.so.13" "$SHIM/libnvrtc.so"
export LD_LIBRARY_PATH="$SHIM:$SP/nvidia/cu13/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
if ls "$B"/wheels/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/k3-site "$B"/wheels/*.whl \
    && export PYTHONPATH=/tmp/k3-site${PYTHONPATH:+:$PYTHONPATH}
fi
export K3_COMMIT=${K3_COMMIT:-$(cat "$B/COMMIT" 2>/dev/null || echo unknown)}
export K3_DIRTY=${K3_DIRTY:-$(cat "$B/DIRTY" 2>/dev/null || echo 0)}
export MOONEP_BIN_DIR="$B/bin"
cmd=${1:-all}; [ $# -gt 0 ] && shift
rc=0
do_doctor() { "$B/bin/xtask" doctor 2>&1 | tee "$OUT/doctor.txt"; }
# K3_REQUIRE_GPU=1 (or K3_REQUIRE_TIERS) in the environment turns a GPU test's skip into a failure.
do_test() {
  ( r=0
    for t in "$B"/tests/*; do
      echo "== $(basename "$t")"
      "$t" --test-threads=1 --nocapture || r=1
    done
    exit $r ) 2>&1 | tee "$OUT/tests.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
}
do_bench() { "$B/bin/xtask" bench --bin-dir "$B/bin" --out "$OUT/k3-report" "$@" || rc=1; }
case "$cmd" in
  doctor) do_doctor ;;
  test) do_test ;;
  bench) do_bench "$@" ;;
  all) do_doctor; do_test; do_bench "$@" ;;
  *) echo "usage: $0 [doctor|test|bench|all]"; exit 2 ;;
esac
exit $rc
"#;
