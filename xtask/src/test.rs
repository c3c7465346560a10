//! `cargo xtask test`: every check CI runs, in order, with a summary at the end.

use std::path::Path;
use std::process::Command;
use std::time::Instant;

use anyhow::bail;

use crate::{kernels, util};

/// One CI step: a name and a command line (or an in-process step).
enum Step {
    Cmd(&'static str, Vec<String>, Vec<(&'static str, String)>),
    Kernels,
}

fn cargo() -> String {
    std::env::var("CARGO").unwrap_or_else(|_| "cargo".into())
}

fn steps(fast: bool) -> Vec<Step> {
    let c = cargo();
    let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    if fast {
        return vec![Step::Cmd(
            "fast tests (lib and bin unit tests)",
            s(&[
                &c,
                "test",
                "--workspace",
                "--lib",
                "--bins",
                "--no-fail-fast",
            ]),
            vec![],
        )];
    }
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
    // `cargo test` already ran the SDK suite with the newest e2b; run it again with the oldest supported
    // one, on the files whose calls depend on the SDK's version (`K3_E2B_FLOOR`, conftest.py).
    // `--workspace` keeps the tests step's features, so its test binary is reused, not rebuilt.
    if let Ok(python) = std::env::var("K3_E2B_FLOOR_PYTHON") {
        steps.push(Step::Cmd(
            "e2b SDK 2.7 (floor)",
            s(&[&c, "test", "--workspace", "--test", "python_sdk"]),
            vec![("PYTHON", python), ("K3_E2B_FLOOR", "1".into())],
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

pub fn run(fast: bool) -> anyhow::Result<()> {
    println!("disk free at start: {}", disk_free());
    let logs = Path::new("target/k3-test");
    std::fs::create_dir_all(logs)?;
    // Every test that skips for a missing part appends a line here (k3_common::require).
    let skips = std::path::absolute(logs.join("skips.tsv"))?;
    let _ = std::fs::remove_file(&skips);
    let mut causes = Vec::new();
    let mut results = Vec::new();
    for step in steps(fast) {
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
                let mut cmd = Command::new(&argv[0]);
                cmd.args(&argv[1..]).env("CARGO_INCREMENTAL", "0").envs(env);
                util::backtrace_only_when_asked(&mut cmd);
                let log = logs.join(format!("{}.log", slug(name)));
                let ok = match tee(&mut cmd, &log) {
                    Ok(ok) => ok,
                    Err(e) => {
                        eprintln!("{name}: {e:#}");
                        false
                    }
                };
                if !ok {
                    let text = std::fs::read_to_string(&log).unwrap_or_default();
                    causes.push((name, util::failure_summary(&text, 4), log));
                }
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
    print_skips(&skips);
    for (name, lines, log) in &causes {
        println!("\n{name} failed:");
        for l in lines {
            println!("  {l}");
        }
        println!("  (whole log: {})", log.display());
    }
    let failed: Vec<_> = results.iter().filter(|r| !r.1).map(|r| r.0).collect();
    if !failed.is_empty() {
        bail!("failed: {}", failed.join(", "));
    }
    Ok(())
}

fn slug(name: &str) -> String {
    name.chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect()
}

/// Runs `cmd`, its output going both to this terminal and to `log`; true when it succeeded.
fn tee(cmd: &mut Command, log: &Path) -> anyhow::Result<bool> {
    use std::io::{Read, Write};
    use std::process::Stdio;
    use std::sync::{Arc, Mutex};
    let file = Arc::new(Mutex::new(std::fs::File::create(log)?));
    let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn()?;
    let pump = |mut r: Box<dyn Read + Send>, err: bool| {
        let file = file.clone();
        std::thread::spawn(move || {
            let mut buf = [0u8; 8192];
            while let Ok(n) = r.read(&mut buf) {
                if n == 0 {
                    break;
                }
                let _ = file.lock().map(|mut f| f.write_all(&buf[..n]));
                let _ = if err {
                    std::io::stderr().write_all(&buf[..n])
                } else {
                    std::io::stdout().write_all(&buf[..n])
                };
            }
        })
    };
    let out = pump(Box::new(child.stdout.take().expect("piped")), false);
    let err = pump(Box::new(child.stderr.take().expect("piped")), true);
    let status = child.wait()?;
    let _ = (out.join(), err.join());
    Ok(status.success())
}

/// The skips the tests recorded: a count per part and the first lines.
fn print_skips(path: &Path) {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let skips: Vec<(&str, &str)> = text
        .lines()
        .filter_map(|l| {
            let mut f = l.splitn(3, '\t');
            Some((f.next()?, f.nth(1)?))
        })
        .collect();
    let mut by_part: Vec<(&str, usize)> = Vec::new();
    for (part, _) in &skips {
        match by_part.iter_mut().find(|(p, _)| p == part) {
            Some((_, n)) => *n += 1,
            None => by_part.push((part, 1)),
        }
    }
    let parts: Vec<String> = by_part.iter().map(|(p, n)| format!("{p} {n}")).collect();
    println!(
        "\nskipped for a missing part: {}{}",
        skips.len(),
        if parts.is_empty() {
            String::new()
        } else {
            format!(" ({}; all in {})", parts.join(", "), path.display())
        }
    );
    for (_, line) in skips.iter().take(10) {
        println!("  {line}");
    }
}
