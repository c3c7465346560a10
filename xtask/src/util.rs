//! Helpers shared by the subcommands.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, bail};
use indicatif::{ProgressBar, ProgressStyle};

/// The workspace root: the nearest ancestor of the current folder whose Cargo.toml has `[workspace]`.
pub fn repo_root() -> anyhow::Result<PathBuf> {
    let mut dir = std::env::current_dir()?;
    loop {
        let manifest = dir.join("Cargo.toml");
        if manifest.is_file() && std::fs::read_to_string(&manifest)?.contains("[workspace]") {
            return Ok(dir);
        }
        if !dir.pop() {
            // A device bundle runs outside a checkout: use the current folder.
            return Ok(std::env::current_dir()?);
        }
    }
}

/// First line of `cmd --version`-like output, if the program runs.
pub fn tool_version(program: &str, args: &[&str]) -> Option<String> {
    let o = Command::new(program)
        .args(args)
        .output()
        .ok()
        .filter(|o| o.status.success())?;
    let text = if o.stdout.is_empty() {
        o.stderr
    } else {
        o.stdout
    };
    String::from_utf8_lossy(&text)
        .lines()
        .find(|l| !l.trim().is_empty())
        .map(|l| l.trim().to_string())
}

/// A spinner with a message and elapsed time, for long steps.
pub fn spinner(msg: impl Into<String>) -> ProgressBar {
    let pb = ProgressBar::new_spinner();
    pb.set_style(
        ProgressStyle::with_template("{spinner} [{elapsed_precise}] {msg}")
            .expect("valid template"),
    );
    pb.set_message(msg.into());
    pb.enable_steady_tick(Duration::from_millis(120));
    pb
}

/// A bar over `n` steps.
pub fn bar(n: u64, msg: impl Into<String>) -> ProgressBar {
    let pb = ProgressBar::new(n);
    pb.set_style(
        ProgressStyle::with_template("[{elapsed_precise}] {bar:30} {pos}/{len} {msg}")
            .expect("valid template"),
    );
    pb.set_message(msg.into());
    pb
}

/// Runs a command, failing with its stderr tail when it exits non-zero.
pub fn run_checked(cmd: &mut Command) -> anyhow::Result<()> {
    let out = cmd.output().with_context(|| format!("starting {cmd:?}"))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let tail: Vec<&str> = err.lines().rev().take(20).collect();
        bail!(
            "{cmd:?} failed ({}):\n{}",
            out.status,
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        );
    }
    Ok(())
}

/// Files below `dir` (recursively) whose name ends with `suffix`, sorted.
pub fn files_with_suffix(dir: &Path, suffix: &str) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            let p = e.path();
            let name = e.file_name().to_string_lossy().into_owned();
            if p.is_dir() {
                if !name.starts_with('.') && name != "target" && name != "node_modules" {
                    stack.push(p);
                }
            } else if name.ends_with(suffix) {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

/// Last non-empty line of `cmd --version`-like output (nvcc prints its release last).
pub fn tool_version_last(program: &str, args: &[&str]) -> Option<String> {
    let o = Command::new(program).args(args).output().ok()?;
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .map(|l| l.trim().to_string())
}

/// The cause of a failed run, read from its log in at most `max` lines: an anyhow `Error:` with its
/// `Caused by:` chain, a panic message, or failing tests; else the last lines that are not backtrace.
pub fn failure_summary(log: &str, max: usize) -> Vec<String> {
    let clip = |s: &str| {
        let s = s.trim();
        match s.char_indices().nth(240) {
            Some((i, _)) => format!("{}...", &s[..i]),
            None => s.to_string(),
        }
    };
    let lines: Vec<&str> = log.lines().collect();
    let frame = |l: &str| {
        let t = l.trim_start();
        t.starts_with("at ")
            || t.split_once(": ")
                .is_some_and(|(n, _)| !n.is_empty() && n.chars().all(|c| c.is_ascii_digit()))
            || t.eq_ignore_ascii_case("stack backtrace:")
            || t.starts_with("note: run with `RUST_BACKTRACE")
    };
    if let Some(i) = lines.iter().rposition(|l| l.starts_with("Error: ")) {
        let mut out = vec![clip(lines[i])];
        let chain = lines[i + 1..]
            .iter()
            .skip_while(|l| l.trim().is_empty() || l.trim() == "Caused by:")
            .take_while(|l| {
                !l.trim().is_empty() && !l.trim().eq_ignore_ascii_case("stack backtrace:")
            })
            .map(|l| {
                let t = l.trim();
                let t = t
                    .split_once(": ")
                    .filter(|(n, _)| n.chars().all(|c| c.is_ascii_digit()));
                format!("caused by: {}", clip(t.map_or(l.trim(), |(_, m)| m)))
            });
        out.extend(chain);
        out.truncate(max);
        return out;
    }
    let failing: Vec<&str> = lines
        .iter()
        .filter_map(|l| {
            l.strip_prefix("test ")
                .and_then(|r| r.strip_suffix(" ... FAILED"))
        })
        .collect();
    if !failing.is_empty() {
        let mut out = vec![format!(
            "{} failing test(s): {}",
            failing.len(),
            clip(&failing.join(", "))
        )];
        // pytest's short summary names the Python tests that failed (`FAILED file::test - why`).
        out.extend(
            lines
                .iter()
                .filter(|l| l.starts_with("FAILED ") || l.starts_with("ERROR "))
                .chain(lines.iter().filter(|l| l.contains("panicked at")))
                .take(max.saturating_sub(1))
                .map(|l| clip(l)),
        );
        return out;
    }
    if let Some(i) = lines.iter().rposition(|l| l.contains("panicked at")) {
        return lines[i..]
            .iter()
            .filter(|l| !l.trim().is_empty() && !frame(l))
            .take(max)
            .map(|l| clip(l))
            .collect();
    }
    let mut tail: Vec<String> = lines
        .iter()
        .rev()
        .filter(|l| !l.trim().is_empty() && !frame(l))
        .take(max)
        .map(|l| clip(l))
        .collect();
    tail.reverse();
    tail
}

/// Children print a backtrace only when the caller asked for one (`RUST_BACKTRACE` set).
pub fn backtrace_only_when_asked(cmd: &mut Command) {
    if std::env::var_os("RUST_BACKTRACE").is_none() {
        cmd.env("RUST_BACKTRACE", "0")
            .env("RUST_LIB_BACKTRACE", "0");
    }
}

#[cfg(test)]
mod summary_tests {
    use super::failure_summary;

    #[test]
    fn an_anyhow_error_with_a_backtrace_comes_back_as_its_chain() {
        let mut log = String::from(
            "INFO starting\nError: default template\n\nCaused by:\n    0: building the rootfs\n    1: Debian mirror http://m is unreachable\n\nStack backtrace:\n",
        );
        for i in 0..60 {
            log.push_str(&format!("  {i}: std::rt::lang_start\n             at /rustc/x/library/std/src/rt.rs:175:24\n"));
        }
        let s = failure_summary(&log, 5);
        assert_eq!(
            s,
            [
                "Error: default template",
                "caused by: building the rootfs",
                "caused by: Debian mirror http://m is unreachable"
            ]
        );
        let one = failure_summary("x\nError: plain failure\n", 5);
        assert_eq!(one, ["Error: plain failure"]);
    }

    #[test]
    fn panics_and_failing_tests_are_named_and_backtraces_dropped() {
        let log = "running 3 tests\ntest a::one ... ok\ntest a::two ... FAILED\n\nthread 'a::two' panicked at src/x.rs:3:5:\nboom\nstack backtrace:\n   0: rust_begin_unwind\n             at /rustc/x/panicking.rs:1:1\n";
        let s = failure_summary(log, 5);
        assert_eq!(s[0], "1 failing test(s): a::two");
        assert!(s[1].contains("panicked at src/x.rs"), "{s:?}");
        let p = failure_summary(
            "thread 'main' panicked at src/main.rs:9:1:\nno mirror\n   0: frame\n             at /x.rs:1:1\n",
            5,
        );
        assert_eq!(
            p,
            ["thread 'main' panicked at src/main.rs:9:1:", "no mirror"]
        );
        assert!(failure_summary(&"line\n".repeat(50), 5).len() == 5);
        let py = "test e2b ... FAILED\nFAILED tests/python/t.py::test_x - AssertionError: 3 != 4\nthread 'e2b' panicked at tests/p.rs:40:5:\n";
        let s = failure_summary(py, 5);
        assert_eq!(
            s[1], "FAILED tests/python/t.py::test_x - AssertionError: 3 != 4",
            "{s:?}"
        );
        assert!(s[2].contains("panicked at tests/p.rs"), "{s:?}");
    }
}
