//! Tier requirements: a test or bench that lacks its hardware skips with a printed reason, unless the
//! environment requires that tier, and then it fails.
//!
//! - `K3_REQUIRE_GPU=1` requires `sm90` and `nvlink` (the GPU CI jobs set it).
//! - `K3_REQUIRE_KVM=1` requires `kvm` (the KVM CI job sets it).
//! - `K3_REQUIRE_TIERS=cpu,sm90,...` requires the tiers it lists (any tier, `cpu` included).
//!
//! Values other than empty or `0` count as set.

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
        Verdict::Skip(line) => println!("{line}"),
        Verdict::Fail(msg) => panic!("{msg}"),
    }
}

#[cfg(test)]
mod tests {
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
