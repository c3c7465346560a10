//! Tier requirements: a test or bench that lacks its hardware skips with a printed reason, unless the
//! environment requires that tier, and then it fails.
//!
//! - `K3_REQUIRE_GPU=1` requires `sm90` and `nvlink` (the GPU CI jobs set it).
//! - `K3_REQUIRE_KVM=1` requires `kvm` (the KVM CI job sets it).
//! - `K3_REQUIRE_TIERS=cpu,sm90,...` requires the tiers it lists (any tier, `cpu` included).
//!
//! Values other than empty or `0` count as set.
//!
//! Tests that need an external part (QEMU, KVM, root, host networking, an S3 server, etcd, an OCI
//! registry, a GPU) skip through [`skip_part`], which also appends the skip to `K3_SKIP_LOG` when set:
//! `cargo xtask test` counts and prints them at the end.

use crate::report::Tier;

/// The environment variables this module reads.
pub const REQUIRE_GPU: &str = "K3_REQUIRE_GPU";
pub const REQUIRE_KVM: &str = "K3_REQUIRE_KVM";
pub const REQUIRE_TIERS: &str = "K3_REQUIRE_TIERS";

/// Which tiers must not be skipped, as read from the environment.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Required {
    tiers: Vec<Tier>,
    /// Names in `K3_REQUIRE_TIERS` that are no tier (reported, never ignored silently).
    pub unknown: Vec<String>,
}

impl Required {
    /// Reads the variables of this process.
    pub fn from_env() -> Self {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    /// Reads the variables through `get` (tests pass a map).
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Self {
        let set = |k: &str| get(k).is_some_and(|v| !v.trim().is_empty() && v.trim() != "0");
        let mut r = Required::default();
        if set(REQUIRE_GPU) {
            r.tiers.extend([Tier::Sm90, Tier::Nvlink]);
        }
        if set(REQUIRE_KVM) {
            r.tiers.push(Tier::Kvm);
        }
        for name in get(REQUIRE_TIERS).unwrap_or_default().split([',', ' ']) {
            let name = name.trim();
            if name.is_empty() {
                continue;
            }
            match name.parse::<Tier>() {
                Ok(t) => r.tiers.push(t),
                Err(_) => r.unknown.push(name.to_string()),
            }
        }
        r.tiers.sort();
        r.tiers.dedup();
        r
    }

    pub fn requires(&self, tier: Tier) -> bool {
        self.tiers.contains(&tier)
    }

    pub fn tiers(&self) -> &[Tier] {
        &self.tiers
    }
}

/// True when the environment requires `tier`.
pub fn is_required(tier: Tier) -> bool {
    Required::from_env().requires(tier)
}

/// What [`skip_or_fail`] decided, for callers that report instead of panicking.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Not required: skip, with this line printed.
    Skip(String),
    /// Required: fail with this message.
    Fail(String),
}

/// The decision for a missing `tier`, without side effects.
pub fn decide(required: &Required, tier: Tier, reason: &str) -> Verdict {
    if required.requires(tier) {
        Verdict::Fail(format!(
            "tier {tier} is required here ({}) but cannot run: {reason}",
            which_var(tier)
        ))
    } else {
        Verdict::Skip(format!("skip {tier}: {reason}"))
    }
}

fn which_var(tier: Tier) -> &'static str {
    match tier {
        Tier::Sm90 | Tier::Nvlink => "K3_REQUIRE_GPU or K3_REQUIRE_TIERS",
        Tier::Kvm => "K3_REQUIRE_KVM or K3_REQUIRE_TIERS",
        Tier::Cpu => "K3_REQUIRE_TIERS",
    }
}

/// For tests whose hardware is missing: prints `skip <tier>: <reason>` and returns, or panics when the
/// environment requires `tier`. Call it, then `return` from the test.
///
/// ```no_run
/// # use k3_common::{Tier, require::skip_or_fail};
/// let gpu: Option<()> = None;
/// let Some(gpu) = gpu else {
///     skip_or_fail(Tier::Sm90, "no CUDA device");
///     return;
/// };
/// ```
#[track_caller]
pub fn skip_or_fail(tier: Tier, reason: impl std::fmt::Display) {
    match decide(&Required::from_env(), tier, &reason.to_string()) {
        Verdict::Skip(line) => {
            record_skip(tier.as_str(), &caller(), &line);
            println!("{line}");
        }
        Verdict::Fail(msg) => panic!("{msg}"),
    }
}

/// Where skips are counted: one line per skip (`part<TAB>where<TAB>reason`), appended.
pub const SKIP_LOG: &str = "K3_SKIP_LOG";

/// An external part a test needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    /// A QEMU that boots guests (TCG is enough).
    Qemu,
    /// Guests under KVM.
    Kvm,
    /// Root (namespaces, other uids, nftables).
    Root,
    /// Sandbox networking on the host (`/dev/net/tun`, `ip`, `nft`) or the package mirror.
    Network,
    /// An S3 server (SeaweedFS).
    S3,
    /// etcd.
    Etcd,
    /// An OCI registry (the CNCF distribution server) and `openssl`.
    Registry,
    /// A CUDA device of compute capability 9.0.
    Gpu,
}

impl Part {
    pub fn as_str(self) -> &'static str {
        match self {
            Part::Qemu => "qemu",
            Part::Kvm => "kvm",
            Part::Root => "root",
            Part::Network => "network",
            Part::S3 => "s3",
            Part::Etcd => "etcd",
            Part::Registry => "registry",
            Part::Gpu => "gpu",
        }
    }

    /// The variable whose value `1` turns this part's skip into a failure.
    pub fn variable(self) -> &'static str {
        match self {
            Part::Qemu | Part::Kvm | Part::Root | Part::Network => REQUIRE_KVM,
            Part::S3 => "K3_REQUIRE_S3",
            Part::Etcd => "K3_REQUIRE_CLUSTER",
            Part::Registry => "K3_REQUIRE_REGISTRY",
            Part::Gpu => REQUIRE_GPU,
        }
    }

    /// Whether this environment requires the part.
    pub fn required(self) -> bool {
        let set = |k: &str| std::env::var(k).is_ok_and(|v| !v.trim().is_empty() && v.trim() != "0");
        set(self.variable()) || (self == Part::S3 && std::env::var("CI").is_ok_and(|v| v == "true"))
    }
}

/// For a test whose external `part` is missing: records and prints `skip <part>: <test>: <reason>`
/// and returns, or panics when the environment requires the part. Call it, then `return`.
#[track_caller]
pub fn skip_part(part: Part, test: &str, reason: impl std::fmt::Display) {
    let log = std::env::var_os(SKIP_LOG).map(std::path::PathBuf::from);
    if let Some(line) = part_skip(
        part,
        part.required(),
        log.as_deref(),
        test,
        &reason.to_string(),
    ) {
        println!("{line}");
    }
}

/// [`skip_part`] with the environment passed in; the printed line, or a panic when `required`.
#[track_caller]
fn part_skip(
    part: Part,
    required: bool,
    log: Option<&std::path::Path>,
    test: &str,
    reason: &str,
) -> Option<String> {
    if required {
        panic!(
            "{test}: {} is required here ({}=1) but missing: {reason}",
            part.as_str(),
            part.variable()
        );
    }
    let line = format!("skip {}: {test}: {reason}", part.as_str());
    append_skip(log, part.as_str(), test, &line);
    Some(line)
}

#[track_caller]
fn caller() -> String {
    let l = std::panic::Location::caller();
    let thread = std::thread::current();
    format!(
        "{} ({}:{})",
        thread.name().unwrap_or("?"),
        l.file(),
        l.line()
    )
}

fn record_skip(part: &str, test: &str, line: &str) {
    let log = std::env::var_os(SKIP_LOG).map(std::path::PathBuf::from);
    append_skip(log.as_deref(), part, test, line);
}

fn append_skip(log: Option<&std::path::Path>, part: &str, test: &str, line: &str) {
    use std::io::Write;
    let Some(path) = log else {
        return;
    };
    let one_line = |s: &str| s.replace(['\n', '\t'], " ");
    let entry = format!("{part}\t{}\t{}\n", one_line(test), one_line(line));
    if let Ok(mut f) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
    {
        let _ = f.write_all(entry.as_bytes());
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_part_skip_is_recorded_and_a_required_part_fails() {
        let path = std::env::temp_dir().join(format!("k3-skips-{}", std::process::id()));
        let line = part_skip(Part::Etcd, false, Some(&path), "t1", "no etcd\nbinary");
        assert_eq!(line.as_deref(), Some("skip etcd: t1: no etcd\nbinary"));
        let text = std::fs::read_to_string(&path).unwrap();
        let _ = std::fs::remove_file(&path);
        assert_eq!(text, "etcd\tt1\tskip etcd: t1: no etcd binary\n");
        let r = std::panic::catch_unwind(|| part_skip(Part::Etcd, true, None, "t2", "none"));
        let msg = *r.unwrap_err().downcast::<String>().unwrap();
        assert!(
            msg.contains("K3_REQUIRE_CLUSTER=1") && msg.contains("t2"),
            "{msg}"
        );
    }

    use std::collections::HashMap;

    use super::*;

    fn req(pairs: &[(&str, &str)]) -> Required {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Required::from_vars(|k| m.get(k).cloned())
    }

    #[test]
    fn gpu_variable_requires_both_gpu_tiers_only() {
        let r = req(&[(REQUIRE_GPU, "1")]);
        assert_eq!(r.tiers(), &[Tier::Sm90, Tier::Nvlink]);
        assert!(matches!(
            decide(&r, Tier::Sm90, "no driver"),
            Verdict::Fail(m) if m.contains("no driver") && m.contains("K3_REQUIRE_GPU")
        ));
        assert_eq!(
            decide(&r, Tier::Kvm, "PVM-only"),
            Verdict::Skip("skip kvm: PVM-only".into())
        );
    }

    #[test]
    fn zero_or_empty_is_unset_and_tiers_list_is_parsed() {
        assert_eq!(req(&[(REQUIRE_GPU, "0"), (REQUIRE_KVM, "")]).tiers(), &[]);
        let r = req(&[(REQUIRE_KVM, "1"), (REQUIRE_TIERS, "cpu, sm90,bogus")]);
        assert_eq!(r.tiers(), &[Tier::Cpu, Tier::Sm90, Tier::Kvm]);
        assert_eq!(r.unknown, vec!["bogus".to_string()]);
        assert!(!r.requires(Tier::Nvlink));
    }

    #[test]
    fn skip_or_fail_panics_only_when_required() {
        // This process may run under a CI job's variables: decide through the same reader it uses.
        let required = Required::from_env().requires(Tier::Cpu);
        let outcome = std::panic::catch_unwind(|| skip_or_fail(Tier::Cpu, "test reason"));
        assert_eq!(outcome.is_err(), required);
    }
}
