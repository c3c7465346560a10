//! The binaries end to end: `moonep-sim --quick` and the bench contract of `moonep-bench`.

use std::process::Command;

use k3_common::report::{Report, Tier};

#[test]
fn moonep_sim_quick_writes_csv_and_svgs() {
    let dir = tempfile::tempdir().unwrap();
    let status = Command::new(env!("CARGO_BIN_EXE_moonep-sim"))
        .args(["--quick", "--out"])
        .arg(dir.path())
        .status()
        .unwrap();
    assert!(status.success());
    let csv = std::fs::read_to_string(dir.path().join("moonep-sim.csv")).unwrap();
    assert!(csv.lines().count() > 100);
    assert!(dir.path().join("moonep-sim-by-ep.svg").exists());
}

#[test]
fn moonep_bench_cpu_tier_writes_a_report() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("moonep.json");
    let status = Command::new(env!("CARGO_BIN_EXE_moonep-bench"))
        .args(["--tier", "cpu", "--quick", "--out"])
        .arg(&out)
        .env("K3_COMMIT", "test")
        .status()
        .unwrap();
    assert!(status.success());
    let report = Report::read(&out).unwrap();
    assert_eq!(report.commit, "test");
    let section = &report.sections[0];
    assert_eq!(
        (section.system.as_str(), section.tier),
        ("moonep", Tier::Cpu)
    );
    let plan: Vec<_> = section
        .figures
        .iter()
        .filter(|f| f.name.starts_with("plan "))
        .collect();
    assert_eq!(plan.len(), 12, "A–C and D for six configs");
    assert!(
        plan.iter()
            .all(|f| f.value.is_finite() && f.value > 0.0 && f.unit == "us")
    );
    assert!(
        section
            .figures
            .iter()
            .any(|f| f.name.starts_with("sim rank load"))
    );
    assert!(!section.plots.is_empty());
    assert!(
        section
            .notes
            .iter()
            .any(|n| n.starts_with("command: moonep-bench --tier cpu"))
    );
}

#[test]
fn moonep_bench_other_tiers_are_skipped_not_failed() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("kvm.json");
    let status = Command::new(env!("CARGO_BIN_EXE_moonep-bench"))
        .args(["--tier", "kvm", "--out"])
        .arg(&out)
        .status()
        .unwrap();
    assert!(status.success());
    let report = Report::read(&out).unwrap();
    assert!(report.sections.is_empty());
    assert_eq!(report.skipped[0].tier, Tier::Kvm);
}
