//! What this machine is, for report headers: hostname, OS, CPU, cores, memory; and its boot id.
//!
//! GPUs and tool versions are the caller's to add (they need the `cuda` feature or child processes).

use std::collections::BTreeMap;

use crate::report::Machine;

/// Hostname of this machine (`/proc/sys/kernel/hostname`, else `gethostname`, else `unknown`).
pub fn hostname() -> String {
    if let Ok(s) = std::fs::read_to_string("/proc/sys/kernel/hostname") {
        let s = s.trim();
        if !s.is_empty() {
            return s.to_string();
        }
    }
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is valid for its length; gethostname NUL-terminates on success.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc == 0 {
        let end = buf.iter().position(|&c| c == 0).unwrap_or(buf.len());
        if let Ok(s) = std::str::from_utf8(&buf[..end])
            && !s.is_empty()
        {
            return s.to_string();
        }
    }
    "unknown".into()
}

/// This host boot's id (`/proc/sys/kernel/random/boot_id`): it changes on every restart of the host.
pub fn boot_id() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
}

/// `PRETTY_NAME` of `/etc/os-release`, else the OS family.
pub fn os_name() -> String {
    std::fs::read_to_string("/etc/os-release")
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| {
                l.strip_prefix("PRETTY_NAME=")
                    .map(|v| v.trim().trim_matches('"').to_string())
            })
        })
        .unwrap_or_else(|| std::env::consts::OS.into())
}

/// The first `model name` of `/proc/cpuinfo`, else the architecture.
pub fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| {
                let (k, v) = l.split_once(':')?;
                (k.trim() == "model name").then(|| v.trim().to_string())
            })
        })
        .unwrap_or_else(|| std::env::consts::ARCH.into())
}

/// CPUs this process may use.
pub fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// `MemTotal` in GiB (0 when unknown).
pub fn mem_gib() -> f64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| {
                l.strip_prefix("MemTotal:")?
                    .trim()
                    .trim_end_matches("kB")
                    .trim()
                    .parse::<f64>()
                    .ok()
            })
        })
        .map_or(0.0, |kib| kib / (1024.0 * 1024.0))
}

/// This machine, with the caller's GPU descriptions and tool versions.
pub fn probe(gpus: Vec<String>, versions: BTreeMap<String, String>) -> Machine {
    Machine {
        hostname: hostname(),
        os: os_name(),
        cpu: cpu_model(),
        cores: cores(),
        mem_gib: mem_gib(),
        gpus,
        versions,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_describes_this_machine() {
        let m = probe(vec!["gpu".into()], BTreeMap::new());
        assert!(!m.hostname.is_empty() && m.hostname != "unknown");
        assert!(!m.hostname.contains('\n'));
        let mut buf = [0u8; 256];
        // SAFETY: as in `hostname`.
        assert_eq!(
            unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) },
            0
        );
        let end = buf.iter().position(|&c| c == 0).unwrap();
        assert_eq!(m.hostname.as_bytes(), &buf[..end]);
        assert!(m.cores >= 1);
        assert!(m.mem_gib > 0.0, "MemTotal read from /proc/meminfo");
        assert!(!m.cpu.is_empty() && !m.os.is_empty());
        assert_eq!(m.gpus, vec!["gpu".to_string()]);
    }
}
