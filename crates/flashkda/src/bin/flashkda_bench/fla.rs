//! The same-run fla baseline: runs the copy of `python/bench_fla.py` embedded in this binary (so a
//! bundle needs no source tree) and reads its rows back. A baseline that was asked for and did not
//! come back whole is a [`FlaError`], never a missing column.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus};

use k3_common::report::Report;
use k3_common::stats::median;

/// `python/bench_fla.py`, embedded so the bundled binary needs no source tree.
pub const BENCH_FLA_PY: &str = include_str!("../../../python/bench_fla.py");

/// The cases `bench_fla.py` knows.
pub const FLA_CASES: [&str; 3] = ["fixed", "varlen6", "1024x8"];

#[derive(Debug, thiserror::Error)]
pub enum FlaError {
    #[error("fla baseline: unknown case `{0}` (expected fixed, varlen6 or 1024x8)")]
    UnknownCase(String),
    #[error("fla baseline: writing the embedded bench_fla.py to {path}: {source}")]
    WriteScript {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "fla baseline: cannot run `{python} {script}`: {source} (needs Python with torch and fla-core >= 0.6; \
         --python picks the interpreter, --no-fla skips the baseline)"
    )]
    Spawn {
        python: String,
        script: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "fla baseline: `{python} {script}{mode}` exited with {status} (is fla-core >= 0.6 importable? \
         --no-fla skips the baseline)"
    )]
    Script {
        python: String,
        script: PathBuf,
        mode: &'static str,
        status: ExitStatus,
    },
    #[error("fla baseline: reading its results {path}: {source}")]
    Results {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("fla baseline: parsing its results: {0}")]
    Parse(#[from] serde_json::Error),
    #[error("fla baseline: no result for H={h} {case}")]
    Missing { h: usize, case: String },
    #[error("fla baseline failed on H={h} {case}: {error}")]
    Fla {
        h: usize,
        case: String,
        error: String,
    },
    #[error(
        "flashkda wheel (timed beside fla) failed on H={h} {case}: {error} (--no-fla-wheel skips it)"
    )]
    Wheel {
        h: usize,
        case: String,
        error: String,
    },
    #[error("fla backend hookup check failed: {0} (--no-fla-wheel skips it)")]
    Hookup(String),
    #[error("--fla-report {path}: {source}")]
    EarlierReport {
        path: PathBuf,
        source: k3_common::report::ReportError,
    },
    #[error("--fla-report {path}: no same-run fla chunk_kda figure for H={h} {case}")]
    EarlierMissing {
        path: PathBuf,
        h: usize,
        case: String,
    },
}

/// What the fla process is asked to measure.
#[derive(Debug, Clone)]
pub struct FlaRequest {
    pub python: String,
    /// `None`: the embedded copy of `bench_fla.py`.
    pub script: Option<PathBuf>,
    pub heads: Vec<usize>,
    pub cases: Vec<String>,
    /// Also time the flashkda wheel and check the fla backend hookup (`--flashkda`).
    pub wheel: bool,
    pub warmup: usize,
    pub iters: usize,
    pub repeats: usize,
}

/// One (H, case) of the fla process.
#[derive(Debug, Clone, PartialEq)]
pub struct FlaRow {
    pub h: usize,
    pub case: String,
    pub fla_ms: Vec<f64>,
    pub fla_block_medians: serde_json::Value,
    pub fla_first_call_s: f64,
    /// With [`FlaRequest::wheel`]: the wheel's samples and its output vs fla's.
    pub wheel: Option<(Vec<f64>, serde_json::Value)>,
}

impl FlaRow {
    pub fn fla_median(&self) -> f64 {
        median(&self.fla_ms)
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct FlaResults {
    /// Versions (torch, triton, fla, ...) as the fla process saw them.
    pub env: BTreeMap<String, String>,
    pub rows: Vec<FlaRow>,
    /// With [`FlaRequest::wheel`]: the hookup check's result.
    pub hookup: Option<serde_json::Value>,
}

/// A private folder holding the script (and its results), removed on drop.
struct Scratch {
    dir: PathBuf,
}

impl Scratch {
    fn new() -> Result<Scratch, FlaError> {
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir =
            std::env::temp_dir().join(format!("flashkda-bench-fla-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|source| FlaError::WriteScript {
            path: dir.clone(),
            source,
        })?;
        Ok(Scratch { dir })
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl FlaRequest {
    fn check_cases(&self) -> Result<(), FlaError> {
        match self.cases.iter().find(|c| !FLA_CASES.contains(&c.as_str())) {
            Some(c) => Err(FlaError::UnknownCase(c.clone())),
            None => Ok(()),
        }
    }

    /// The script to run: `--fla-script` or the embedded copy written into `scratch`.
    fn script(&self, scratch: &Scratch) -> Result<PathBuf, FlaError> {
        if let Some(p) = &self.script {
            return Ok(p.clone());
        }
        let path = scratch.dir.join("bench_fla.py");
        std::fs::write(&path, BENCH_FLA_PY).map_err(|source| FlaError::WriteScript {
            path: path.clone(),
            source,
        })?;
        Ok(path)
    }

    fn spawn(&self, script: &Path, args: &[String], mode: &'static str) -> Result<(), FlaError> {
        // ETXTBSY: an interpreter just written is briefly held open for writing by a child another
        // thread forks meanwhile (the fork-exec race); it passes within milliseconds.
        let mut tries = 0;
        let status = loop {
            let r = Command::new(&self.python).arg(script).args(args).status();
            match r {
                Err(e) if e.kind() == std::io::ErrorKind::ExecutableFileBusy && tries < 20 => {
                    tries += 1;
                    std::thread::sleep(std::time::Duration::from_millis(50));
                }
                r => break r,
            }
        }
        .map_err(|source| FlaError::Spawn {
            python: self.python.clone(),
            script: script.to_path_buf(),
            source,
        })?;
        if !status.success() {
            return Err(FlaError::Script {
                python: self.python.clone(),
                script: script.to_path_buf(),
                mode,
                status,
            });
        }
        Ok(())
    }

    /// Seconds, before any timing: the interpreter runs the script's `--check` (torch with a
    /// GPU, fla's `chunk_kda`, and with `wheel` the flashkda wheel import).
    pub fn preflight(&self) -> Result<(), FlaError> {
        self.check_cases()?;
        let scratch = Scratch::new()?;
        let script = self.script(&scratch)?;
        let mut args = vec!["--check".to_string()];
        if self.wheel {
            args.push("--flashkda".into());
        }
        self.spawn(&script, &args, " --check")
    }

    /// Runs the fla process and returns every requested row, or the first reason it cannot.
    pub fn run(&self) -> Result<FlaResults, FlaError> {
        self.check_cases()?;
        let scratch = Scratch::new()?;
        let script = self.script(&scratch)?;
        let json = scratch.dir.join("results.json");
        let heads: Vec<String> = self.heads.iter().map(|h| h.to_string()).collect();
        let mut args = vec![
            "--out".to_string(),
            json.display().to_string(),
            "--heads".into(),
            heads.join(","),
            "--cases".into(),
            self.cases.join(","),
            "--warmup".into(),
            self.warmup.to_string(),
            "--iters".into(),
            self.iters.to_string(),
            "--repeats".into(),
            self.repeats.to_string(),
        ];
        if self.wheel {
            args.push("--flashkda".into());
        }
        self.spawn(&script, &args, "")?;
        let text = std::fs::read_to_string(&json).map_err(|source| FlaError::Results {
            path: json.clone(),
            source,
        })?;
        self.parse(&text)
    }

    /// `bench_fla.py`'s JSON, checked against the request: every (H, case) with fla samples,
    /// and with `wheel` the wheel's samples and a hookup result without an error.
    pub fn parse(&self, text: &str) -> Result<FlaResults, FlaError> {
        let v: serde_json::Value = serde_json::from_str(text)?;
        let env = v["env"]
            .as_object()
            .map(|m| {
                m.iter()
                    .map(|(k, x)| (k.clone(), x.as_str().unwrap_or_default().to_string()))
                    .collect()
            })
            .unwrap_or_default();
        let empty = Vec::new();
        let found = v["rows"].as_array().unwrap_or(&empty);
        let samples = |row: &serde_json::Value, key: &str| -> Vec<f64> {
            row[key]["samples_ms"]
                .as_array()
                .map(|a| a.iter().filter_map(|x| x.as_f64()).collect())
                .unwrap_or_default()
        };
        let text_of =
            |x: &serde_json::Value| x.as_str().map_or_else(|| x.to_string(), String::from);
        let mut rows = Vec::new();
        for &h in &self.heads {
            for case in &self.cases {
                let missing = || FlaError::Missing {
                    h,
                    case: case.clone(),
                };
                let row = found
                    .iter()
                    .find(|r| r["H"].as_u64() == Some(h as u64) && r["case"].as_str() == Some(case))
                    .ok_or_else(missing)?;
                let fla_ms = samples(row, "fla");
                if fla_ms.is_empty() {
                    return Err(FlaError::Fla {
                        h,
                        case: case.clone(),
                        error: text_of(&row["fla_error"]),
                    });
                }
                let wheel = if self.wheel {
                    let ws = samples(row, "flashkda_wheel");
                    if ws.is_empty() || !row["flashkda_error"].is_null() {
                        return Err(FlaError::Wheel {
                            h,
                            case: case.clone(),
                            error: text_of(&row["flashkda_error"]),
                        });
                    }
                    Some((ws, row["flashkda_vs_fla"].clone()))
                } else {
                    None
                };
                rows.push(FlaRow {
                    h,
                    case: case.clone(),
                    fla_ms,
                    fla_block_medians: row["fla"]["block_medians_ms"].clone(),
                    fla_first_call_s: row["fla_first_call_s"].as_f64().unwrap_or(0.0),
                    wheel,
                });
            }
        }
        let hookup = if self.wheel {
            let hk = &v["hookup"];
            if hk.is_null() || !hk["error"].is_null() {
                return Err(FlaError::Hookup(text_of(&hk["error"])));
            }
            Some(hk.clone())
        } else {
            None
        };
        Ok(FlaResults { env, rows, hookup })
    }
}

/// Milliseconds by (H, case).
pub type ByShape = BTreeMap<(usize, String), f64>;

/// The same-run fla medians of an earlier report, one for every `(H, case)` in `want`.
pub fn earlier_fla(path: &Path, want: &[(usize, String)]) -> Result<(Report, ByShape), FlaError> {
    let old = Report::read(path).map_err(|source| FlaError::EarlierReport {
        path: path.to_path_buf(),
        source,
    })?;
    let mut found = BTreeMap::new();
    for f in old.sections.iter().flat_map(|s| &s.figures) {
        let (Some(h), Some(case)) = (
            f.params.get("H").and_then(|x| x.parse().ok()),
            f.params.get("case"),
        ) else {
            continue;
        };
        if let Some(b) = f
            .baselines
            .iter()
            .find(|b| b.same_run && b.name.starts_with("fla chunk_kda"))
        {
            found.insert((h, case.clone()), b.value);
        }
    }
    if let Some((h, case)) = want.iter().find(|k| !found.contains_key(k)) {
        return Err(FlaError::EarlierMissing {
            path: path.to_path_buf(),
            h: *h,
            case: case.clone(),
        });
    }
    Ok((old, found))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(python: &str, wheel: bool) -> FlaRequest {
        FlaRequest {
            python: python.into(),
            script: None,
            heads: vec![96, 64],
            cases: vec!["fixed".into(), "varlen6".into()],
            wheel,
            warmup: 1,
            iters: 2,
            repeats: 1,
        }
    }

    /// A stand-in interpreter: saves the script it was given and its arguments, then writes
    /// `rows` as fla's results (to `--out`) and exits with `code`.
    fn fake_python(dir: &Path, json: &str, code: i32) -> String {
        let path = dir.join("python");
        let body = format!(
            "#!/bin/sh\ncp \"$1\" '{seen}'\necho \"$1\" > '{arg0}'\nshift\necho \"$@\" > '{args}'\n\
             while [ $# -gt 0 ]; do [ \"$1\" = --out ] && printf '%s' '{json}' > \"$2\"; shift; done\nexit {code}\n",
            seen = dir.join("seen.py").display(),
            arg0 = dir.join("arg0").display(),
            args = dir.join("args").display(),
        );
        std::fs::write(&path, body).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        path.display().to_string()
    }

    #[test]
    fn missing_interpreter_is_a_spawn_error() {
        let err = request("/nonexistent/python3", false).run().unwrap_err();
        assert!(matches!(err, FlaError::Spawn { .. }), "{err}");
        assert!(err.to_string().contains("--no-fla"), "{err}");
        let err = request("/nonexistent/python3", false)
            .preflight()
            .unwrap_err();
        assert!(matches!(err, FlaError::Spawn { .. }), "{err}");
    }

    #[test]
    fn failing_script_is_a_script_error() {
        let dir = tempfile::tempdir().unwrap();
        let py = fake_python(dir.path(), "", 1);
        let err = request(&py, false).preflight().unwrap_err();
        assert!(
            matches!(
                err,
                FlaError::Script {
                    mode: " --check",
                    ..
                }
            ),
            "{err}"
        );
        let err = request(&py, false).run().unwrap_err();
        assert!(matches!(err, FlaError::Script { mode: "", .. }), "{err}");
    }

    #[test]
    fn embedded_script_runs_outside_the_source_tree_and_fla_missing_is_typed() {
        let dir = tempfile::tempdir().unwrap();
        let json = r#"{"env": {"torch": "2.11"}, "rows": [{"H": 96, "case": "fixed", "fla_error": "ModuleNotFoundError: No module named fla"}], "hookup": null}"#;
        let py = fake_python(dir.path(), json, 0);
        let err = request(&py, false).run().unwrap_err();
        match &err {
            FlaError::Fla { h: 96, case, error } => {
                assert_eq!(case, "fixed");
                assert!(error.contains("No module named fla"), "{error}");
            }
            e => panic!("expected FlaError::Fla, got {e}"),
        }
        // the interpreter got the embedded copy, from a scratch folder that is gone afterwards
        let seen = std::fs::read_to_string(dir.path().join("seen.py")).unwrap();
        assert_eq!(seen, BENCH_FLA_PY);
        assert_eq!(
            seen,
            std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/python/bench_fla.py"))
                .unwrap()
        );
        let arg0 = std::fs::read_to_string(dir.path().join("arg0")).unwrap();
        let script = Path::new(arg0.trim());
        assert!(
            script.starts_with(std::env::temp_dir()),
            "{}",
            script.display()
        );
        assert!(!script.exists(), "scratch copy left behind");
        let args = std::fs::read_to_string(dir.path().join("args")).unwrap();
        assert!(
            args.contains("--heads 96,64 --cases fixed,varlen6"),
            "{args}"
        );
    }

    #[test]
    fn every_requested_row_must_come_back() {
        let row = |h: usize, case: &str| {
            format!(
                r#"{{"H": {h}, "case": "{case}", "fla": {{"samples_ms": [2.0, 1.0, 3.0], "block_medians_ms": [2.0]}},
                "fla_first_call_s": 70.5, "flashkda_wheel": {{"samples_ms": [1.0]}}, "flashkda_vs_fla": {{"out": 0.003}}}}"#
            )
        };
        let all = [
            row(96, "fixed"),
            row(96, "varlen6"),
            row(64, "fixed"),
            row(64, "varlen6"),
        ];
        let json = |rows: &[String], hookup: &str| {
            format!(
                r#"{{"env": {{"fla-core": "0.6.1"}}, "rows": [{}], "hookup": {hookup}}}"#,
                rows.join(",")
            )
        };
        let ok = request("python3", true)
            .parse(&json(&all, r#"{"registered": true}"#))
            .unwrap();
        assert_eq!(ok.rows.len(), 4);
        assert_eq!(ok.rows[0].fla_median(), 2.0);
        assert_eq!(ok.env["fla-core"], "0.6.1");
        assert!(ok.rows.iter().all(|r| r.wheel.is_some()));
        // a head the script skipped
        let err = request("python3", true)
            .parse(&json(&all[..3], "null"))
            .unwrap_err();
        assert!(
            matches!(err, FlaError::Missing { h: 64, ref case } if case == "varlen6"),
            "{err}"
        );
        // the wheel failed in the fla process
        let bad = r#"{"H": 64, "case": "varlen6", "fla": {"samples_ms": [1.0]}, "flashkda_error": "RuntimeError('x')"}"#;
        let rows = [
            all[0].clone(),
            all[1].clone(),
            all[2].clone(),
            bad.to_string(),
        ];
        let err = request("python3", true)
            .parse(&json(&rows, "null"))
            .unwrap_err();
        assert!(matches!(err, FlaError::Wheel { h: 64, .. }), "{err}");
        // ... which is not asked for without --flashkda
        assert!(
            request("python3", false)
                .parse(&json(&rows, "null"))
                .is_ok()
        );
        // the hookup check failed
        let err = request("python3", true)
            .parse(&json(&all, r#"{"error": "ImportError('fla.backends')"}"#))
            .unwrap_err();
        assert!(
            matches!(err, FlaError::Hookup(ref e) if e.contains("fla.backends")),
            "{err}"
        );
        let mut r = request("python3", false);
        r.cases.push("fixd".into());
        assert!(matches!(r.run(), Err(FlaError::UnknownCase(c)) if c == "fixd"));
    }

    #[test]
    fn earlier_report_must_cover_every_shape() {
        use k3_common::Figure;
        use k3_common::report::{Section, Tier};
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("old.json");
        let mut old = Report::here();
        let fig = |h: usize, same_run: bool| {
            Figure::timing(format!("kda fwd H={h} fixed"), &[1.0], "ms")
                .param("H", h)
                .param("case", "fixed")
                .baseline("fla chunk_kda (Triton), same run", 2.5, same_run)
        };
        old.sections.push(Section {
            system: "flashkda".into(),
            tier: Tier::Sm90,
            title: "t".into(),
            machine: "m".into(),
            figures: vec![fig(96, true), fig(64, false)],
            plots: vec![],
            notes: vec![],
        });
        old.write(&path).unwrap();
        let (_, found) = earlier_fla(&path, &[(96, "fixed".into())]).unwrap();
        assert_eq!(found[&(96, "fixed".to_string())], 2.5);
        // H=64 has only a quoted (not same-run) fla figure
        let err = earlier_fla(&path, &[(96, "fixed".into()), (64, "fixed".into())]).unwrap_err();
        assert!(
            matches!(err, FlaError::EarlierMissing { h: 64, .. }),
            "{err}"
        );
        let err = earlier_fla(&dir.path().join("none.json"), &[]).unwrap_err();
        assert!(matches!(err, FlaError::EarlierReport { .. }), "{err}");
    }
}
