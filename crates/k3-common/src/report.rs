//! Benchmark report types shared by every system and by `cargo xtask bench`.
//!
//! A bench binary writes one [`Report`] holding one or more [`Section`]s; xtask merges the
//! reports of every tier (and of several machines) into `target/k3-report/report.{json,md,html}`.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::provenance::Provenance;
pub use crate::stats::Stats;

/// Report format version; bump on incompatible changes.
pub const REPORT_SCHEMA: u32 = 1;

/// Hardware tier a figure was measured on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Tier {
    /// Any machine: CPU references, planner, simulator, agentenv on TCG.
    Cpu,
    /// A CUDA device with compute capability >= 9.0.
    Sm90,
    /// Two or more CUDA devices with peer access.
    Nvlink,
    /// `/dev/kvm` that really boots a standard guest.
    Kvm,
}

impl Tier {
    pub const ALL: [Tier; 4] = [Tier::Cpu, Tier::Sm90, Tier::Nvlink, Tier::Kvm];

    pub fn as_str(self) -> &'static str {
        match self {
            Tier::Cpu => "cpu",
            Tier::Sm90 => "sm90",
            Tier::Nvlink => "nvlink",
            Tier::Kvm => "kvm",
        }
    }
}

impl std::fmt::Display for Tier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Tier {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Tier::ALL
            .into_iter()
            .find(|t| t.as_str() == s)
            .ok_or_else(|| format!("unknown tier `{s}` (expected cpu, sm90, nvlink or kvm)"))
    }
}

/// Whether a smaller or a larger value is better; decides how the ratio reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Better {
    Lower,
    Higher,
}

/// A reference value measured (or quoted) for comparison.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Baseline {
    /// What the baseline is, e.g. "fla chunk_kda (Triton), same run".
    pub name: String,
    pub value: f64,
    /// True when measured in the same run; false for quoted anchor figures.
    pub same_run: bool,
}

/// One measured number.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Figure {
    /// What was measured, e.g. "kda fwd H=96 fixed".
    pub name: String,
    /// Parameters of the case (shape, skew, ...), shown as table columns.
    #[serde(default)]
    pub params: BTreeMap<String, String>,
    /// The headline value (a median for timings).
    pub value: f64,
    /// Unit of `value`, e.g. "ms", "us", "GB/s".
    pub unit: String,
    pub better: Better,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stats: Option<Stats>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub baselines: Vec<Baseline>,
}

impl Figure {
    pub fn new(
        name: impl Into<String>,
        value: f64,
        unit: impl Into<String>,
        better: Better,
    ) -> Self {
        Figure {
            name: name.into(),
            params: BTreeMap::new(),
            value,
            unit: unit.into(),
            better,
            stats: None,
            baselines: Vec::new(),
        }
    }

    /// A timing figure whose headline value is the median of `samples`.
    pub fn timing(name: impl Into<String>, samples: &[f64], unit: impl Into<String>) -> Self {
        let stats = Stats::from_samples(samples);
        let value = stats.as_ref().map_or(f64::NAN, |s| s.median);
        Figure {
            stats,
            ..Figure::new(name, value, unit, Better::Lower)
        }
    }

    pub fn param(mut self, key: impl Into<String>, value: impl ToString) -> Self {
        self.params.insert(key.into(), value.to_string());
        self
    }

    pub fn baseline(mut self, name: impl Into<String>, value: f64, same_run: bool) -> Self {
        self.baselines.push(Baseline {
            name: name.into(),
            value,
            same_run,
        });
        self
    }

    /// How many times better than `b` this figure is (> 1 means we win), whatever `better` is.
    pub fn ratio(&self, b: &Baseline) -> f64 {
        match self.better {
            Better::Lower => b.value / self.value,
            Better::Higher => self.value / b.value,
        }
    }
}

/// How a plot draws its series.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PlotKind {
    /// Grouped bars: one group per x label, one bar per series.
    Bars,
    /// Lines over a numeric x axis (x labels must parse as numbers).
    Lines,
    /// Distribution of values per series (histogram-like, sorted samples as a CDF).
    Cdf,
}

/// A named series of (x, y) points.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Series {
    pub name: String,
    pub points: Vec<(String, f64)>,
}

/// A plot the HTML report draws (SVG).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Plot {
    pub title: String,
    pub kind: PlotKind,
    pub x_label: String,
    pub y_label: String,
    pub series: Vec<Series>,
}

/// The figures of one system on one tier.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Section {
    /// "flashkda", "moonep" or "agentenv".
    pub system: String,
    pub tier: Tier,
    pub title: String,
    /// Hostname of the machine that measured it (key into [`Report::machines`]).
    pub machine: String,
    #[serde(default)]
    pub figures: Vec<Figure>,
    #[serde(default)]
    pub plots: Vec<Plot>,
    /// Free-form notes: the exact command, the backend (TCG/KVM), caveats.
    #[serde(default)]
    pub notes: Vec<String>,
}

/// A tier that did not run, with the reason.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Skipped {
    pub tier: Tier,
    pub machine: String,
    pub what: String,
    pub reason: String,
}

/// What a machine is, for the report header.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Machine {
    pub hostname: String,
    pub os: String,
    pub cpu: String,
    pub cores: usize,
    pub mem_gib: f64,
    #[serde(default)]
    pub gpus: Vec<String>,
    /// Tool versions (rustc, nvcc, driver, qemu, torch, ...).
    #[serde(default)]
    pub versions: BTreeMap<String, String>,
}

/// A whole benchmark report; several merge into one.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Report {
    pub schema: u32,
    /// Full git commit the figures were measured at.
    pub commit: String,
    /// True when the tree had uncommitted changes: the figures are not reproducible from `commit`.
    #[serde(default)]
    pub dirty: bool,
    /// RFC 3339 UTC time of creation.
    pub created: String,
    #[serde(default)]
    pub machines: Vec<Machine>,
    #[serde(default)]
    pub sections: Vec<Section>,
    #[serde(default)]
    pub skipped: Vec<Skipped>,
}

/// Errors reading or writing a report file.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    #[error("reading report {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("writing report {path}: {source}")]
    Write {
        path: String,
        source: std::io::Error,
    },
    #[error("report {path} is not valid JSON: {source}")]
    Parse {
        path: String,
        source: serde_json::Error,
    },
    #[error("report {path} has schema {found}, this build reads schema {expected}")]
    Schema {
        path: String,
        found: u32,
        expected: u32,
    },
}

impl Report {
    /// A report for `commit`, clean unless the legacy `-dirty` suffix says otherwise; prefer
    /// [`Report::here`] or [`Report::for_provenance`].
    pub fn new(commit: impl Into<String>) -> Self {
        let (commit, dirty) = crate::provenance::split_legacy(&commit.into());
        Report::for_provenance(&Provenance { commit, dirty })
    }

    /// A report for this process's [`Provenance::current`] (what bench binaries use).
    pub fn here() -> Self {
        Report::for_provenance(&Provenance::current())
    }

    pub fn for_provenance(p: &Provenance) -> Self {
        Report {
            schema: REPORT_SCHEMA,
            commit: p.commit.clone(),
            dirty: p.dirty,
            created: crate::time::now_rfc3339(),
            machines: Vec::new(),
            sections: Vec::new(),
            skipped: Vec::new(),
        }
    }

    pub fn read(path: &Path) -> Result<Report, ReportError> {
        let p = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| ReportError::Read {
            path: p.clone(),
            source,
        })?;
        let mut report: Report =
            serde_json::from_str(&text).map_err(|source| ReportError::Parse {
                path: p.clone(),
                source,
            })?;
        let (commit, legacy_dirty) = crate::provenance::split_legacy(&report.commit);
        report.commit = commit;
        report.dirty |= legacy_dirty;
        if report.schema != REPORT_SCHEMA {
            return Err(ReportError::Schema {
                path: p,
                found: report.schema,
                expected: REPORT_SCHEMA,
            });
        }
        Ok(report)
    }

    /// Writes pretty JSON atomically (temp file + rename).
    pub fn write(&self, path: &Path) -> Result<(), ReportError> {
        let p = path.display().to_string();
        let text = serde_json::to_string_pretty(self).expect("report serializes");
        crate::fsutil::write_atomic(path, text.as_bytes())
            .map_err(|source| ReportError::Write { path: p, source })
    }

    /// Joins `other` into `self`: machines deduplicated (hostname, CPU and GPUs: VM hostnames repeat across
    /// hosts), sections and skips appended.
    /// A skip is dropped when another report has a section for the same tier and system.
    pub fn merge(&mut self, other: Report) {
        for m in other.machines {
            if !self
                .machines
                .iter()
                .any(|x| x.hostname == m.hostname && x.cpu == m.cpu && x.gpus == m.gpus)
            {
                self.machines.push(m);
            }
        }
        self.dirty |= other.dirty;
        if self.commit != other.commit && !self.commit.contains(&other.commit) {
            self.commit = format!("{} + {}", self.commit, other.commit);
        }
        self.sections.extend(other.sections);
        self.skipped.extend(other.skipped);
        let ran: Vec<(Tier, String)> = self
            .sections
            .iter()
            .map(|s| (s.tier, s.system.clone()))
            .collect();
        self.skipped
            .retain(|s| !ran.iter().any(|(t, sys)| *t == s.tier && *sys == s.what));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ratio_reads_as_speedup() {
        let f = Figure::timing("t", &[2.0, 1.0, 3.0], "ms").baseline("base", 4.0, true);
        assert_eq!(f.value, 2.0);
        assert_eq!(f.ratio(&f.baselines[0]), 2.0);
        let g = Figure::new("bw", 300.0, "GB/s", Better::Higher).baseline("base", 150.0, true);
        assert_eq!(g.ratio(&g.baselines[0]), 2.0);
    }

    #[test]
    fn roundtrip_and_merge() {
        let dir = tempfile::tempdir().unwrap();
        let mut a = Report::new("abc");
        a.machines.push(Machine {
            hostname: "dev".into(),
            os: "debian".into(),
            cpu: "x".into(),
            cores: 2,
            mem_gib: 24.0,
            gpus: vec![],
            versions: BTreeMap::new(),
        });
        a.skipped.push(Skipped {
            tier: Tier::Sm90,
            machine: "dev".into(),
            what: "flashkda".into(),
            reason: "no driver".into(),
        });
        let path = dir.path().join("a.json");
        a.write(&path).unwrap();
        let back = Report::read(&path).unwrap();
        assert_eq!(back, a);

        let mut b = Report::new("abc");
        b.sections.push(Section {
            system: "flashkda".into(),
            tier: Tier::Sm90,
            title: "KDA".into(),
            machine: "gpu".into(),
            figures: vec![Figure::timing("fwd", &[1.0], "ms")],
            plots: vec![],
            notes: vec![],
        });
        a.merge(b);
        assert_eq!(a.sections.len(), 1);
        assert!(
            a.skipped.is_empty(),
            "the GPU machine's section replaces the dev machine's skip"
        );
        assert_eq!(a.commit, "abc");
    }

    #[test]
    fn dirty_flag_survives_write_read_and_merge() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("r.json");
        let clean = Report::for_provenance(&Provenance {
            commit: "c0ffee".into(),
            dirty: false,
        });
        let mut dirty = clean.clone();
        dirty.dirty = true;
        dirty.write(&p).unwrap();
        assert!(Report::read(&p).unwrap().dirty);
        let mut merged = clean.clone();
        merged.merge(Report::read(&p).unwrap());
        assert!(merged.dirty, "one dirty part makes the whole report dirty");
        assert_eq!(merged.commit, "c0ffee");
        // Reports written before the flag existed marked a dirty tree with a commit suffix.
        let mut legacy = serde_json::to_value(&clean).unwrap();
        legacy.as_object_mut().unwrap().remove("dirty");
        legacy["commit"] = "c0ffee-dirty".into();
        std::fs::write(&p, legacy.to_string()).unwrap();
        let back = Report::read(&p).unwrap();
        assert_eq!((back.commit.as_str(), back.dirty), ("c0ffee", true));
        assert!(Report::new("abc-dirty").dirty && !Report::new("abc").dirty);
    }

    #[test]
    fn rejects_other_schema_and_garbage() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("r.json");
        std::fs::write(&p, "{not json").unwrap();
        assert!(matches!(Report::read(&p), Err(ReportError::Parse { .. })));
        let mut r = Report::new("x");
        r.schema = 99;
        std::fs::write(&p, serde_json::to_string(&r).unwrap()).unwrap();
        assert!(matches!(
            Report::read(&p),
            Err(ReportError::Schema { found: 99, .. })
        ));
    }
}
