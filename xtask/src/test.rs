//! `cargo xtask test`: every check CI runs, in order, with a summary at the end.

use std::path::Path;
use std::process::Command;
use std::time::Instant;

use anyhow::bail;

use crate::kernels;

/// One CI step: a name and a command line (or an in-process step).
enum Step {
    Cmd(&'static str, Vec<String>, Vec<(&'static str, String)>),
    Kernels,
}

fn cargo() -> String {
    std::env::var("CARGO").unwrap_or_else(|_| "cargo".into())
}

fn steps() -> Vec<Step> {
    let c = cargo();
    let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    let mut steps = vec![
        Step::Cmd("format", s(&[&c, "fmt", "--all", "--", "--check"]), vec![]),
        Step::Cmd(
            "clippy",
            s(&[
                &c,
                "clippy",
                "--workspace",
                "--all-targets",
                "--",
                "-D",
                "warnings",
            ]),
            vec![],
        ),
        Step::Kernels,
        Step::Cmd(
            "tests",
            s(&[&c, "test", "--workspace", "--no-fail-fast"]),
            vec![("K3_REQUIRE_KERNELS", "1".into())],
        ),
    ];
    if Path::new("crates/moonep/src/bin/moonep-sim.rs").is_file() {
        steps.push(Step::Cmd(
            "simulator (quick)",
            s(&[
                &c,
                "run",
                "--release",
                "-p",
                "moonep",
                "--bin",
                "moonep-sim",
                "--",
                "--quick",
                "--out",
                "target/k3-sim",
            ]),
            vec![],
        ));
    }
    // `cargo test` already ran the SDK suite with the newest e2b; run it again with the oldest supported one.
    if let Ok(python) = std::env::var("K3_E2B_FLOOR_PYTHON") {
        steps.push(Step::Cmd(
            "e2b SDK 2.7 (floor)",
            s(&[&c, "test", "-p", "agentenv-server", "--test", "python_sdk"]),
            vec![("PYTHON", python)],
        ));
    }
    steps
}

/// Free space on the target folder's file system, as `df` prints it (a CI run once ran out of disk).
fn disk_free() -> String {
    Command::new("df")
        .args(["-h", "--output=avail", "."])
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.lines().nth(1).map(|l| l.trim().to_string()))
        .unwrap_or_else(|| "unknown".into())
}

pub fn run() -> anyhow::Result<()> {
    println!("disk free at start: {}", disk_free());
    let mut results = Vec::new();
    for step in steps() {
        let start = Instant::now();
        let (name, ok) = match step {
            Step::Kernels => {
                println!("\n=== kernels (sm_90a)");
                (
                    "kernels (sm_90a)",
                    kernels::build_all(Path::new("target/k3-kernels"))
                        .map_err(|e| eprintln!("{e:#}"))
                        .is_ok(),
                )
            }
            Step::Cmd(name, argv, env) => {
                println!("\n=== {name}: {}", argv.join(" "));
                // No incremental caches: CI builds once, and they cost gigabytes of its disk.
                let ok = Command::new(&argv[0])
                    .args(&argv[1..])
                    .env("CARGO_INCREMENTAL", "0")
                    .envs(env)
                    .status()
                    .is_ok_and(|s| s.success());
                (name, ok)
            }
        };
        println!(
            "=== {name}: {} in {:.0?}; disk free: {}",
            if ok { "ok" } else { "FAILED" },
            start.elapsed(),
            disk_free()
        );
        results.push((name, ok, start.elapsed()));
    }
    println!("\nsummary:");
    for (name, ok, t) in &results {
        println!(
            "  {:<22} {:<6} {:>8.1?}",
            name,
            if *ok { "ok" } else { "FAILED" },
            t
        );
    }
    let failed: Vec<_> = results.iter().filter(|r| !r.1).map(|r| r.0).collect();
    if !failed.is_empty() {
        bail!("failed: {}", failed.join(", "));
    }
    Ok(())
}
