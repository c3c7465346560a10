//! `cargo xtask bench`: run every tier that can run here, skip the rest with the reason, write one report.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, bail};
use k3_common::Tier;
use k3_common::provenance::Provenance;
use k3_common::report::{Report, Skipped};
use k3_common::require::{self, Required, Verdict};

use crate::{doctor, render, util};

/// One system's benchmark on one tier: a binary that writes a `Report` (`--tier T --out F`).
struct BenchJob {
    system: &'static str,
    tier: Tier,
    package: &'static str,
    bin: &'static str,
    /// Other binaries the bench needs beside it: (package, binary, env var that points at it).
    needs: &'static [(&'static str, &'static str, &'static str)],
}

const GUEST: &[(&str, &str, &str)] = &[("agentenv-guest", "agentenv-guest", "AGENTENV_GUEST_BIN")];

const JOBS: &[BenchJob] = &[
    BenchJob {
        system: "flashkda",
        tier: Tier::Cpu,
        package: "flashkda",
        bin: "flashkda-bench",
        needs: &[],
    },
    BenchJob {
        system: "moonep",
        tier: Tier::Cpu,
        package: "moonep",
        bin: "moonep-bench",
        needs: &[],
    },
    BenchJob {
        system: "agentenv",
        tier: Tier::Cpu,
        package: "agentenv-server",
        bin: "agentenv-bench",
        needs: GUEST,
    },
    BenchJob {
        system: "flashkda",
        tier: Tier::Sm90,
        package: "flashkda",
        bin: "flashkda-bench",
        needs: &[],
    },
    BenchJob {
        system: "moonep",
        tier: Tier::Nvlink,
        package: "moonep",
        bin: "moonep-bench",
        needs: &[],
    },
    BenchJob {
        system: "agentenv",
        tier: Tier::Kvm,
        package: "agentenv-server",
        bin: "agentenv-bench",
        needs: GUEST,
    },
];

/// What `cargo xtask bench` was asked to do.
pub struct BenchArgs<'a> {
    pub tiers: &'a [Tier],
    pub systems: &'a [String],
    pub bin_dir: Option<&'a Path>,
    pub out: &'a Path,
    /// Append the run's entry to this docs/benchmarks.md.
    pub record: Option<&'a Path>,
}

pub fn run(args: &BenchArgs<'_>) -> anyhow::Result<()> {
    let BenchArgs {
        tiers,
        systems,
        bin_dir,
        out,
        record,
    } = *args;
    let required = Required::from_env();
    if !required.unknown.is_empty() {
        bail!(
            "K3_REQUIRE_TIERS names no tier: {} (expected cpu, sm90, nvlink or kvm)",
            required.unknown.join(", ")
        );
    }
    for s in systems {
        if !JOBS.iter().any(|j| j.system == s) {
            bail!("unknown system `{s}` (expected flashkda, moonep or agentenv)");
        }
    }
    let findings = doctor::probe(false);
    let host = k3_common::machine::hostname();
    let provenance = Provenance::current();
    if provenance.dirty {
        println!(
            "note: the tree has uncommitted changes; the report and its docs/benchmarks.md entry say so"
        );
    }
    let mut report = Report::for_provenance(&provenance);
    report.machines.push(doctor::machine(&findings));
    let parts = out.join("parts");
    std::fs::create_dir_all(&parts).with_context(|| format!("creating {}", parts.display()))?;

    let selected: Vec<&BenchJob> = JOBS
        .iter()
        .filter(|j| tiers.is_empty() || tiers.contains(&j.tier))
        .filter(|j| systems.is_empty() || systems.iter().any(|s| s == j.system))
        .collect();
    let mut failures = Vec::new();
    let mut phases: Vec<(String, std::time::Duration)> = Vec::new();
    for job in selected {
        let status = findings.status(job.tier);
        if !status.runs {
            if let Verdict::Fail(msg) = require::decide(&required, job.tier, &status.detail) {
                println!("FAIL {} on {}: {msg}", job.system, job.tier);
                failures.push(format!("{} on {}: {msg}", job.system, job.tier));
            } else {
                println!("skip {} on {}: {}", job.system, job.tier, status.detail);
            }
            report.skipped.push(Skipped {
                tier: job.tier,
                machine: host.clone(),
                what: job.system.into(),
                reason: status.detail.clone(),
            });
            continue;
        }
        let part = parts.join(format!("{}-{}.json", job.system, job.tier));
        let log = parts.join(format!("{}-{}.log", job.system, job.tier));
        let _ = std::fs::remove_file(&part);
        let needs = prepare_needs(job, bin_dir);
        let mut cmd = match bin_dir {
            Some(dir) => Command::new(dir.join(job.bin)),
            None => match build_release(job.package, job.bin) {
                Ok((path, took)) => {
                    phases.push((format!("build {}", job.bin), took));
                    Command::new(path)
                }
                Err(e) => {
                    println!("FAIL {} on {}: {e:#}", job.system, job.tier);
                    failures.push(format!("{} on {}: {e:#}", job.system, job.tier));
                    continue;
                }
            },
        };
        util::backtrace_only_when_asked(&mut cmd);
        cmd.args(["--tier", job.tier.as_str(), "--out"])
            .arg(&part)
            .envs(provenance.env());
        // Sandbox networking where the host allows it: the report then has the guest's throughput.
        if job.system == "agentenv" && k3_common::netcheck::sandbox_network_blocker().is_none() {
            cmd.arg("--network");
        }
        let needs = match needs {
            Ok(n) => n,
            Err(e) => {
                println!("FAIL {} on {}: {e:#}", job.system, job.tier);
                failures.push(format!("{} on {}: {e:#}", job.system, job.tier));
                continue;
            }
        };
        cmd.envs(needs);
        let pb = util::spinner(format!(
            "{} on {} (log: {})",
            job.system,
            job.tier,
            log.display()
        ));
        let started = std::time::Instant::now();
        let outcome = run_logged(&mut cmd, &log);
        pb.finish_and_clear();
        phases.push((format!("{} on {}", job.system, job.tier), started.elapsed()));
        match outcome.and_then(|()| Report::read(&part).map_err(anyhow::Error::from)) {
            Ok(part_report) => {
                let figures: usize = part_report.sections.iter().map(|s| s.figures.len()).sum();
                println!("ran  {} on {}: {figures} figure(s)", job.system, job.tier);
                for m in part_report.machines.iter().filter(|m| m.hostname != host) {
                    report.machines.push(m.clone());
                }
                report.sections.extend(part_report.sections);
                // A bench binary that skipped a required tier itself fails the run too.
                for msg in required_skips(&required, &part_report.skipped) {
                    println!("FAIL {} on {}: {msg}", job.system, job.tier);
                    failures.push(format!("{} on {}: {msg}", job.system, job.tier));
                }
                report.skipped.extend(part_report.skipped);
            }
            Err(e) => {
                println!("FAIL {} on {}: {e:#}", job.system, job.tier);
                failures.push(format!("{} on {}: {e:#}", job.system, job.tier));
                report.skipped.push(Skipped {
                    tier: job.tier,
                    machine: host.clone(),
                    what: job.system.into(),
                    reason: format!("benchmark failed: {e:#}"),
                });
            }
        }
    }
    render::write_all(&report, out)?;
    println!("\ntime per phase:");
    for (name, took) in &phases {
        println!("  {name:<28} {:>7.1} s", took.as_secs_f64());
    }
    println!("report: {}/report.{{json,md,html}}", out.display());
    let entry = benchmarks_entry(&report, &command_line(), out);
    println!("\ndocs/benchmarks.md entry:\n{entry}");
    if let Some(path) = record {
        let mut text = std::fs::read_to_string(path).unwrap_or_default();
        if !text.is_empty() && !text.ends_with("\n\n") {
            text.push_str(if text.ends_with('\n') { "\n" } else { "\n\n" });
        }
        text.push_str(&entry);
        k3_common::fsutil::write_atomic(path, text.as_bytes())
            .with_context(|| format!("appending to {}", path.display()))?;
        println!("appended to {}", path.display());
    }
    if !failures.is_empty() {
        bail!(
            "{} benchmark job(s) failed:\n{}",
            failures.len(),
            failures.join("\n")
        );
    }
    Ok(())
}

/// Builds (cargo mode) or finds (bundle mode) the helper binaries a job needs; returns env vars pointing at them.
fn prepare_needs(
    job: &BenchJob,
    bin_dir: Option<&Path>,
) -> anyhow::Result<Vec<(&'static str, PathBuf)>> {
    let mut env = Vec::new();
    for &(package, bin, var) in job.needs {
        if std::env::var_os(var).is_some() {
            continue;
        }
        let path = match bin_dir {
            Some(dir) => dir.join(bin),
            None => build_release(package, bin)?.0,
        };
        env.push((var, path));
    }
    Ok(env)
}

/// Builds `bin` of `package` in release mode (a spinner meanwhile); its path and the time it took.
fn build_release(package: &str, bin: &str) -> anyhow::Result<(PathBuf, std::time::Duration)> {
    let started = std::time::Instant::now();
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let pb = util::spinner(format!("building {bin} (release)"));
    let built = util::run_checked(Command::new(cargo).args([
        "build",
        "--quiet",
        "--release",
        "-p",
        package,
        "--bin",
        bin,
    ]));
    pb.finish_and_clear();
    built?;
    let path = Path::new("target/release")
        .join(bin)
        .canonicalize()
        .with_context(|| format!("locating {bin}"))?;
    Ok((path, started.elapsed()))
}

fn run_logged(cmd: &mut Command, log: &PathBuf) -> anyhow::Result<()> {
    let file = std::fs::File::create(log).with_context(|| format!("creating {}", log.display()))?;
    let status = cmd
        .stdin(Stdio::null())
        .stdout(file.try_clone()?)
        .stderr(file)
        .status()
        .with_context(|| format!("starting {cmd:?}"))?;
    if !status.success() {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        bail!(
            "{status}: {}\n  (whole log: {})",
            util::failure_summary(&text, 5).join("\n  "),
            log.display()
        );
    }
    Ok(())
}

/// The failure messages of `skipped` entries whose tier `required` demands.
fn required_skips(required: &Required, skipped: &[Skipped]) -> Vec<String> {
    skipped
        .iter()
        .filter_map(|s| match require::decide(required, s.tier, &s.reason) {
            Verdict::Fail(msg) => Some(format!("{}: {msg}", s.what)),
            Verdict::Skip(_) => None,
        })
        .collect()
}

/// The command as typed, for the benchmarks entry.
fn command_line() -> String {
    let args: Vec<String> = std::env::args().skip(1).collect();
    format!("cargo xtask {}", args.join(" "))
}

/// The docs/benchmarks.md entry of a run: heading with date, machine and commit, the command, what ran and
/// what was skipped. A dirty tree is said in the heading, where nobody can miss it.
pub fn benchmarks_entry(report: &Report, command: &str, out: &Path) -> String {
    let hosts: Vec<String> = report
        .machines
        .iter()
        .map(|m| {
            if m.gpus.is_empty() {
                format!("`{}` ({} cores, {})", m.hostname, m.cores, m.cpu)
            } else {
                format!("`{}` ({})", m.hostname, m.gpus.join(", "))
            }
        })
        .collect();
    let mut e = format!(
        "### {}, {}, commit {}{}\n\nCommand: `{command}`; report: `{}/report.md`.\n",
        report.created,
        if hosts.is_empty() {
            "unknown machine".into()
        } else {
            hosts.join(" + ")
        },
        report.commit,
        if report.dirty {
            " (DIRTY TREE: uncommitted changes; figures not reproducible from this commit)"
        } else {
            ""
        },
        out.display()
    );
    for s in &report.sections {
        e.push_str(&format!(
            "- ran {} on {}: {} figure(s)\n",
            s.system,
            s.tier,
            s.figures.len()
        ));
    }
    for s in &report.skipped {
        e.push_str(&format!(
            "- skipped {} on {}: {}\n",
            s.what, s.tier, s.reason
        ));
    }
    e
}

#[cfg(test)]
mod tests {
    use k3_common::report::Section;

    use super::*;

    fn report(dirty: bool) -> Report {
        let mut r = Report::for_provenance(&Provenance {
            commit: "0123456789abcdef0123456789abcdef01234567".into(),
            dirty,
        });
        r.sections.push(Section {
            system: "moonep".into(),
            tier: Tier::Cpu,
            title: "plan".into(),
            machine: "dev".into(),
            figures: vec![k3_common::Figure::timing("plan", &[1.0, 2.0], "us")],
            plots: vec![],
            notes: vec![],
        });
        r.skipped.push(Skipped {
            tier: Tier::Sm90,
            machine: "dev".into(),
            what: "flashkda".into(),
            reason: "no driver".into(),
        });
        r
    }

    #[test]
    fn benchmarks_entry_names_the_exact_commit_and_a_dirty_tree() {
        let out = Path::new("target/k3-report");
        let clean = benchmarks_entry(&report(false), "cargo xtask bench", out);
        let heading = clean.lines().next().unwrap();
        assert!(heading.starts_with("### "), "{clean}");
        assert!(heading.contains("commit 0123456789abcdef0123456789abcdef01234567"));
        assert!(!clean.contains("DIRTY"), "{clean}");
        assert!(clean.contains("- ran moonep on cpu: 1 figure(s)"));
        assert!(clean.contains("- skipped flashkda on sm90: no driver"));
        let dirty = benchmarks_entry(&report(true), "cargo xtask bench", out);
        assert!(
            dirty.lines().next().unwrap().contains("DIRTY TREE"),
            "{dirty}"
        );
    }

    #[test]
    fn a_bench_binary_skipping_a_required_tier_fails_the_bench() {
        let skipped = report(false).skipped;
        let gpu = Required::from_vars(|k| (k == "K3_REQUIRE_GPU").then(|| "1".to_string()));
        let fails = required_skips(&gpu, &skipped);
        assert_eq!(fails.len(), 1, "{fails:?}");
        assert!(fails[0].starts_with("flashkda: ") && fails[0].contains("no driver"));
        let kvm = Required::from_vars(|k| (k == "K3_REQUIRE_KVM").then(|| "1".to_string()));
        assert!(required_skips(&kvm, &skipped).is_empty());
    }

    #[test]
    fn a_required_tier_that_cannot_run_fails_the_bench() {
        let r = Required::from_vars(|k| (k == "K3_REQUIRE_GPU").then(|| "1".to_string()));
        assert!(matches!(
            require::decide(&r, Tier::Sm90, "no driver"),
            Verdict::Fail(_)
        ));
        assert!(matches!(
            require::decide(&r, Tier::Kvm, "PVM-only"),
            Verdict::Skip(_)
        ));
    }
}
