//! `cargo xtask tidy`: repository rules, also run as a test.
//!
//! - files: no source file over 800 lines, no ignored or `should_panic` test;
//! - `refs`: every spec and notes reference in the checked scope resolves;
//! - `arch`: ARCHITECTURE.md maps every folder and workspace member and names only paths that exist;
//! - `workflow`: the CI matrix has its four jobs and the GPU/KVM ones require their hardware;
//! - no agentenv crate reaches a CUDA crate.

mod arch;
mod imports;
pub mod refs;
mod workflow;

use std::path::Path;

use crate::util;

const MAX_LINES: usize = 800;

/// Returns every rule violation found under `root`.
/// Crates split into rooms (agentenv's redesign) keep their files shorter.
const ROOMY: &[&str] = &[
    "crates/agentenv/api/",
    "crates/agentenv/control/",
    "crates/agentenv/egress/",
    "crates/agentenv/gateway/",
    "crates/agentenv/vm/",
];
const MAX_LINES_ROOMY: usize = 600;

pub fn check(root: &Path) -> anyhow::Result<Vec<String>> {
    let mut problems = Vec::new();
    let arch = std::fs::read_to_string(root.join("ARCHITECTURE.md")).unwrap_or_default();
    if arch.is_empty() {
        problems.push("ARCHITECTURE.md is missing".into());
    }
    problems.extend(arch::check(root, &arch));
    problems.extend(refs::check(root));
    problems.extend(workflow::check(root));
    problems.extend(imports::check(root));
    for ext in [".rs", ".cu", ".cuh", ".py"] {
        for file in util::files_with_suffix(root, ext) {
            let rel = file
                .strip_prefix(root)
                .unwrap_or(&file)
                .display()
                .to_string();
            let Ok(text) = std::fs::read_to_string(&file) else {
                continue;
            };
            let lines = text.lines().count();
            let limit = if ROOMY.iter().any(|r| rel.starts_with(r)) {
                MAX_LINES_ROOMY
            } else {
                MAX_LINES
            };
            if lines > limit {
                problems.push(format!("{rel}: {lines} lines (limit {limit})"));
            }
            if ext == ".rs" && !rel.starts_with("xtask/src/tidy/") {
                for (i, l) in text.lines().enumerate() {
                    let t = l.trim_start();
                    if t.starts_with("#[ignore") || t.starts_with("#[should_panic") {
                        problems.push(format!("{rel}:{}: ignored or should_panic test", i + 1));
                    }
                }
            }
        }
    }
    for (prefix, banned) in BOUNDARIES {
        problems.extend(boundary(root, prefix, banned));
    }
    Ok(problems)
}

/// Packages (by name prefix) and the crates (by name prefix) they must not reach.
const BOUNDARIES: &[(&str, &[&str])] = &[
    ("agentenv-", &["cudarc", "cuda-"]),
    // The lifecycle and the VM vocabulary know neither HTTP, QEMU (the runtime), etcd nor S3.
    (
        "agentenv-control",
        &[
            "axum",
            "hyper",
            "utoipa",
            "agentenv-runtime",
            "agentenv-cluster",
            "agentenv-store",
            "agentenv-oci",
        ],
    ),
    // The E2B edge and the cluster front run no VM.
    (
        "agentenv-api",
        &[
            "agentenv-runtime",
            "agentenv-cluster",
            "agentenv-store",
            "agentenv-oci",
        ],
    ),
    (
        "agentenv-gateway",
        &["agentenv-runtime", "agentenv-store", "agentenv-oci"],
    ),
    (
        "agentenv-vm",
        &[
            "axum",
            "hyper",
            "tokio",
            "agentenv-runtime",
            "agentenv-store",
        ],
    ),
];

/// Packages whose name starts with `prefix` must not reach a crate named `banned*` (feature-resolved,
/// normal and build dependencies, via `cargo tree`).
fn boundary(root: &Path, prefix: &str, banned: &[&str]) -> Vec<String> {
    let Ok(lock) = std::fs::read_to_string(root.join("Cargo.lock")) else {
        return vec![];
    };
    let mut problems = Vec::new();
    let packages: Vec<&str> = lock
        .lines()
        .filter_map(|l| l.strip_prefix("name = \"")?.strip_suffix('"'))
        .filter(|n| n.starts_with(prefix))
        .collect();
    for pkg in packages {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let out = std::process::Command::new(cargo)
            .args([
                "tree",
                "-e",
                "normal,build",
                "--prefix",
                "none",
                "-f",
                "{p}",
                "-p",
                pkg,
            ])
            .current_dir(root)
            .output();
        match out {
            Ok(o) if o.status.success() => {
                let text = String::from_utf8_lossy(&o.stdout);
                if let Some(l) = text
                    .lines()
                    .skip(1)
                    .find(|l| banned.iter().any(|b| l.starts_with(b)))
                {
                    problems.push(format!("{pkg} depends on {l}, which its boundary excludes"));
                }
            }
            Ok(o) => problems.push(format!(
                "cargo tree -p {pkg} failed: {}",
                String::from_utf8_lossy(&o.stderr).trim()
            )),
            Err(e) => problems.push(format!("cargo tree: {e}")),
        }
    }
    problems
}

#[cfg(test)]
mod tests {
    #[test]
    fn repository_is_tidy() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .unwrap();
        let problems = super::check(root).unwrap();
        assert!(
            problems.is_empty(),
            "tidy problems:\n{}",
            problems.join("\n")
        );
    }
}
