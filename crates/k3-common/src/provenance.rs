//! Which source a measurement came from: the exact commit and whether the tree had changes.
//!
//! `cargo xtask bench` reads it from git and passes it to every bench binary it starts through
//! `K3_COMMIT` and `K3_DIRTY`; a device bundle carries the same two values to the GPU machine.

use std::path::Path;
use std::process::Command;

use serde::{Deserialize, Serialize};

/// The variable holding the full commit hash.
pub const COMMIT_VAR: &str = "K3_COMMIT";
/// The variable saying the tree had changes (`1`) or not (`0`).
pub const DIRTY_VAR: &str = "K3_DIRTY";

/// The source state a report was measured at.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Provenance {
    /// Full commit hash, or `unknown` outside a checkout.
    pub commit: String,
    /// True when tracked files differ from the commit or untracked, non-ignored files exist.
    pub dirty: bool,
}

impl Provenance {
    /// `K3_COMMIT` / `K3_DIRTY` when set, else git in the current folder, else `unknown`.
    pub fn current() -> Provenance {
        Self::from_vars(|k| std::env::var(k).ok()).unwrap_or_else(|| {
            std::env::current_dir()
                .ok()
                .and_then(|d| Self::from_git(&d))
                .unwrap_or_else(Self::unknown)
        })
    }

    /// From the two variables; `None` when `K3_COMMIT` is unset or empty. A legacy `-dirty` suffix
    /// on the commit also marks it dirty.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Option<Provenance> {
        let commit = get(COMMIT_VAR).filter(|c| !c.trim().is_empty())?;
        let flag = get(DIRTY_VAR).is_some_and(|v| !v.trim().is_empty() && v.trim() != "0");
        let (commit, suffix) = split_legacy(commit.trim());
        Some(Provenance {
            commit,
            dirty: flag || suffix,
        })
    }

    /// From git in `dir`; `None` when `dir` is not in a checkout or git is missing.
    pub fn from_git(dir: &Path) -> Option<Provenance> {
        let git = |args: &[&str]| {
            Command::new("git")
                .args(args)
                .current_dir(dir)
                .output()
                .ok()
                .filter(|o| o.status.success())
                .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        };
        let commit = git(&["rev-parse", "HEAD"])?.trim().to_string();
        let status = git(&["status", "--porcelain", "--untracked-files=normal"])?;
        Some(Provenance {
            commit,
            dirty: !status.trim().is_empty(),
        })
    }

    pub fn unknown() -> Provenance {
        Provenance {
            commit: "unknown".into(),
            dirty: false,
        }
    }

    /// The first 12 characters of the commit, for headings.
    pub fn short(&self) -> &str {
        &self.commit[..self.commit.len().min(12)]
    }

    /// The two variables a child process needs to report the same provenance.
    pub fn env(&self) -> [(&'static str, String); 2] {
        [
            (COMMIT_VAR, self.commit.clone()),
            (DIRTY_VAR, if self.dirty { "1" } else { "0" }.into()),
        ]
    }
}

impl std::fmt::Display for Provenance {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.dirty {
            write!(f, "{} (dirty tree: uncommitted changes)", self.commit)
        } else {
            f.write_str(&self.commit)
        }
    }
}

/// Strips the `-dirty` suffix older reports put on the commit.
pub(crate) fn split_legacy(commit: &str) -> (String, bool) {
    match commit.strip_suffix("-dirty") {
        Some(c) => (c.to_string(), true),
        None => (commit.to_string(), false),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> Option<Provenance> {
        let m: HashMap<&str, &str> = pairs.iter().copied().collect();
        Provenance::from_vars(|k| m.get(k).map(|v| v.to_string()))
    }

    #[test]
    fn variables_carry_commit_and_dirty_flag() {
        assert_eq!(vars(&[]), None);
        assert_eq!(vars(&[(COMMIT_VAR, " ")]), None);
        let p = vars(&[(COMMIT_VAR, "abc"), (DIRTY_VAR, "1")]).unwrap();
        assert!(p.dirty && p.commit == "abc");
        assert!(
            !vars(&[(COMMIT_VAR, "abc"), (DIRTY_VAR, "0")])
                .unwrap()
                .dirty
        );
        let legacy = vars(&[(COMMIT_VAR, "abc-dirty")]).unwrap();
        assert_eq!((legacy.commit.as_str(), legacy.dirty), ("abc", true));
        let back = Provenance::from_vars(|k| {
            p.env()
                .iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.clone())
        });
        assert_eq!(back, Some(p.clone()));
        assert!(p.to_string().contains("dirty tree"));
    }

    #[test]
    fn git_sees_a_change_in_a_fresh_repository() {
        let dir = tempfile::tempdir().unwrap();
        let git = |args: &[&str]| {
            Command::new("git")
                .args([
                    "-c",
                    "user.name=t",
                    "-c",
                    "user.email=t@t",
                    "-c",
                    "commit.gpgsign=false",
                ])
                .args(args)
                .current_dir(dir.path())
                .output()
                .map(|o| o.status.success())
        };
        if !git(&["init", "-q"]).unwrap_or(false) {
            crate::require::skip_or_fail(crate::Tier::Cpu, "git is not installed");
            return;
        }
        assert_eq!(Provenance::from_git(dir.path()), None, "no commit yet");
        std::fs::write(dir.path().join("a"), "1").unwrap();
        assert!(git(&["add", "a"]).unwrap() && git(&["commit", "-qm", "a"]).unwrap());
        let clean = Provenance::from_git(dir.path()).unwrap();
        assert_eq!(clean.commit.len(), 40, "{clean:?}");
        assert!(!clean.dirty);
        std::fs::write(dir.path().join("a"), "2").unwrap();
        let changed = Provenance::from_git(dir.path()).unwrap();
        assert!(changed.dirty && changed.commit == clean.commit);
        assert!(git(&["checkout", "-q", "a"]).unwrap());
        std::fs::write(dir.path().join("new"), "x").unwrap();
        assert!(
            Provenance::from_git(dir.path()).unwrap().dirty,
            "untracked file"
        );
    }
}
