//! `cargo xtask bench`: run every tier that can run here, skip the rest with the reason, write one report.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, bail};
use k3_common::Tier;
use k3_common::report::{Report, Skipped};

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

pub fn run(
    tiers: &[Tier],
    systems: &[String],
    bin_dir: Option<&Path>,
    out: &Path,
) -> anyhow::Result<()> {
    for s in systems {
        if !JOBS.iter().any(|j| j.system == s) {
            bail!("unknown system `{s}` (expected flashkda, moonep or agentenv)");
        }
    }
    let findings = doctor::probe(false);
    let host = util::hostname();
    let commit = util::git_commit();
    let mut report = Report::new(commit.clone());
    report.machines.push(doctor::machine(&findings));
    let parts = out.join("parts");
    std::fs::create_dir_all(&parts).with_context(|| format!("creating {}", parts.display()))?;

    let selected: Vec<&BenchJob> = JOBS
        .iter()
        .filter(|j| tiers.is_empty() || tiers.contains(&j.tier))
        .filter(|j| systems.is_empty() || systems.iter().any(|s| s == j.system))
        .collect();
    let mut failures = Vec::new();
    for job in selected {
        let status = findings.status(job.tier);
        if !status.runs {
            println!("skip {} on {}: {}", job.system, job.tier, status.detail);
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
            None => {
                let mut c = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
                c.args([
                    "run",
                    "--quiet",
                    "--release",
                    "-p",
                    job.package,
                    "--bin",
                    job.bin,
                    "--",
                ]);
                c
            }
        };
        cmd.args(["--tier", job.tier.as_str(), "--out"])
            .arg(&part)
            .env("K3_COMMIT", &commit);
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
        let outcome = run_logged(&mut cmd, &log);
        pb.finish_and_clear();
        match outcome.and_then(|()| Report::read(&part).map_err(anyhow::Error::from)) {
            Ok(part_report) => {
                let figures: usize = part_report.sections.iter().map(|s| s.figures.len()).sum();
                println!("ran  {} on {}: {figures} figure(s)", job.system, job.tier);
                for m in part_report.machines.iter().filter(|m| m.hostname != host) {
                    report.machines.push(m.clone());
                }
                report.sections.extend(part_report.sections);
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
    println!("report: {}/report.{{json,md,html}}", out.display());
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
            None => {
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
                Path::new("target/release")
                    .join(bin)
                    .canonicalize()
                    .with_context(|| format!("locating {bin}"))?
            }
        };
        env.push((var, path));
    }
    Ok(env)
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
        let tail: Vec<&str> = text.lines().rev().take(15).collect();
        bail!(
            "{status}; last lines of {}:\n{}",
            log.display(),
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        );
    }
    Ok(())
}
