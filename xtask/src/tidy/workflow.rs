//! The CI matrix keeps its four tier jobs, the GPU and KVM jobs require their hardware, and the workflow
//! sits where GitHub reads it.

use std::path::Path;

pub const WORKFLOW: &str = ".github/workflows/k3.yml";

/// Each job and the variable it must set to "1" (cpu requires nothing: it runs everywhere).
const JOBS: &[(&str, Option<&str>)] = &[
    ("cpu", None),
    ("gpu-sm90", Some("K3_REQUIRE_GPU")),
    ("gpu-nvlink", Some("K3_REQUIRE_GPU")),
    ("kvm", Some("K3_REQUIRE_KVM")),
];

pub fn check(root: &Path) -> Vec<String> {
    let mut problems = Vec::new();
    if root.join("ci/github").exists() {
        problems
            .push("ci/github exists: GitHub reads workflows only from .github/workflows".into());
    }
    let Ok(text) = std::fs::read_to_string(root.join(WORKFLOW)) else {
        problems.push(format!("{WORKFLOW} is missing"));
        return problems;
    };
    problems.extend(check_text(&text));
    problems
}

/// The problems of one workflow text.
pub fn check_text(text: &str) -> Vec<String> {
    let mut problems = Vec::new();
    for &(job, var) in JOBS {
        let Some(body) = job_body(text, job) else {
            problems.push(format!("{WORKFLOW}: no job `{job}`"));
            continue;
        };
        if let Some(var) = var {
            let sets = body.lines().any(|l| {
                let l = l.trim();
                l == format!("{var}: \"1\"")
                    || l == format!("{var}: '1'")
                    || l == format!("{var}: 1")
            });
            if !sets {
                problems.push(format!("{WORKFLOW}: job `{job}` does not set {var}: \"1\""));
            }
        }
    }
    problems
}

/// The lines of job `name` (a key indented two spaces under `jobs:`), up to the next job.
fn job_body(text: &str, name: &str) -> Option<String> {
    let mut lines = text.lines().skip_while(|l| *l != "jobs:").skip(1);
    let head = format!("  {name}:");
    let is_job = |l: &str| l.starts_with("  ") && !l.starts_with("   ") && l.ends_with(':');
    lines.find(|l| *l == head)?;
    let body: Vec<&str> = lines
        .take_while(|l| !is_job(l) && (l.is_empty() || l.starts_with(' ')))
        .collect();
    Some(body.join("\n"))
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = "name: x\njobs:\n  cpu:\n    runs-on: a\n  gpu-sm90:\n    env:\n      K3_REQUIRE_GPU: \"1\"\n  \
                        gpu-nvlink:\n    env:\n      K3_REQUIRE_GPU: \"1\"\n  kvm:\n    env:\n      K3_REQUIRE_KVM: \"1\"\n";

    #[test]
    fn the_four_jobs_with_their_variables_pass() {
        assert_eq!(check_text(GOOD), Vec::<String>::new());
    }

    #[test]
    fn a_job_without_its_variable_or_a_missing_job_fails() {
        let no_var = GOOD.replace(
            "      K3_REQUIRE_KVM: \"1\"\n",
            "      K3_REQUIRE_KVM: \"0\"\n",
        );
        assert_eq!(
            check_text(&no_var),
            vec![format!(
                "{WORKFLOW}: job `kvm` does not set K3_REQUIRE_KVM: \"1\""
            )]
        );
        // The variable of another job does not count.
        let moved = GOOD.replace(
            "  gpu-nvlink:\n    env:\n      K3_REQUIRE_GPU: \"1\"\n",
            "  gpu-nvlink:\n    runs-on: b\n",
        );
        assert_eq!(check_text(&moved).len(), 1, "{:?}", check_text(&moved));
        let gone = GOOD.replace("  cpu:\n    runs-on: a\n", "");
        assert_eq!(check_text(&gone), vec![format!("{WORKFLOW}: no job `cpu`")]);
    }

    #[test]
    fn this_repository_workflow_passes() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
        assert_eq!(check(root), Vec::<String>::new());
    }
}
