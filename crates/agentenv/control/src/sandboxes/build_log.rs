//! One build's state and log, with their bounds: long output lines are cut, a log keeps its newest
//! entries (offsets stay absolute), and a template keeps only its newest finished builds.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::build_view::{BuildFailure, BuildSize, BuildStatus, LOGS_PAGE, LogEntry, LogLevel};
use super::now_ms;

/// Log entries a build keeps: the newest; offsets stay absolute, so pages past the dropped head go on.
pub const MAX_LOG_ENTRIES: usize = 10_000;
/// Longest log line: a longer run of output without a newline is cut into lines of this size.
pub const MAX_LOG_LINE: usize = 8 << 10;
/// Builds kept per template: when a new one starts, the oldest finished ones beyond this go.
pub const MAX_BUILDS_KEPT: usize = 10;

pub(super) struct Build {
    pub(super) size: BuildSize,
    pub(super) status: BuildStatus,
    /// The newest [`MAX_LOG_ENTRIES`]; `dropped` older ones are gone.
    logs: std::collections::VecDeque<LogEntry>,
    dropped: usize,
    pub(super) failure: Option<BuildFailure>,
    started: Instant,
}

impl Build {
    pub(super) fn new(size: BuildSize) -> Build {
        Build {
            size,
            status: BuildStatus::Waiting,
            logs: Default::default(),
            dropped: 0,
            failure: None,
            started: Instant::now(),
        }
    }

    pub(super) fn log(&mut self, e: LogEntry) {
        if self.logs.len() >= MAX_LOG_ENTRIES {
            self.logs.pop_front();
            self.dropped += 1;
        }
        self.logs.push_back(e);
    }

    /// Entries from absolute offset `offset` on, at most [`LOGS_PAGE`].
    pub(super) fn page(&self, offset: usize) -> Vec<LogEntry> {
        self.logs
            .iter()
            .skip(offset.saturating_sub(self.dropped))
            .take(LOGS_PAGE)
            .cloned()
            .collect()
    }

    fn finished(&self) -> bool {
        matches!(self.status, BuildStatus::Ready | BuildStatus::Error)
    }
}

/// Moves the complete lines of `pending` to `emit`, and cuts a run without a newline into lines of
/// [`MAX_LOG_LINE`] bytes, so `pending` never holds more than that.
pub(super) fn take_lines(pending: &mut String, mut emit: impl FnMut(String)) {
    loop {
        if let Some(nl) = pending.find('\n') {
            let line: String = pending.drain(..=nl).collect();
            emit(line.trim_end().to_string());
            continue;
        }
        if pending.len() < MAX_LOG_LINE {
            return;
        }
        let mut cut = MAX_LOG_LINE;
        while !pending.is_char_boundary(cut) {
            cut -= 1;
        }
        emit(pending.drain(..cut).collect());
    }
}

/// Removes the oldest finished builds of `builds` until at most `keep` finished ones are left.
pub(super) fn evict_finished(builds: &mut HashMap<String, Arc<Mutex<Build>>>, keep: usize) {
    let mut finished: Vec<(Instant, String)> = builds
        .iter()
        .filter_map(|(id, b)| {
            let b = b.lock().unwrap_or_else(|e| e.into_inner());
            b.finished().then(|| (b.started, id.clone()))
        })
        .collect();
    finished.sort();
    let extra = finished.len().saturating_sub(keep);
    for (_, id) in finished.into_iter().take(extra) {
        builds.remove(&id);
    }
}

pub(super) fn entry(level: LogLevel, step: Option<String>, message: String) -> LogEntry {
    LogEntry {
        at_ms: now_ms(),
        level,
        message,
        step,
    }
}

/// Appends to one build's log.
pub(super) struct BuildLog(pub(super) Arc<Mutex<Build>>);

impl BuildLog {
    fn push(&self, level: LogLevel, step: Option<&str>, message: String) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).log(entry(
            level,
            step.map(str::to_string),
            message,
        ));
    }
    pub(super) fn info(&self, step: Option<&str>, message: impl Into<String>) {
        self.push(LogLevel::Info, step, message.into());
    }
    pub(super) fn warn(&self, step: Option<&str>, message: impl Into<String>) {
        self.push(LogLevel::Warn, step, message.into());
    }
}

#[cfg(test)]
mod bound_tests {
    use super::*;

    fn size() -> BuildSize {
        BuildSize {
            vcpus: None,
            memory_mib: None,
        }
    }

    #[test]
    fn output_without_newlines_becomes_bounded_lines() {
        let mut pending = String::new();
        let mut lines = Vec::new();
        // 3 MB of `yes`-like output in 64 KiB chunks, then no newline at all, then some.
        for _ in 0..48 {
            pending.push_str(&"y".repeat(64 << 10));
            take_lines(&mut pending, |l| lines.push(l));
            assert!(pending.len() < MAX_LOG_LINE, "{}", pending.len());
        }
        pending.push_str("é\nlast\n");
        take_lines(&mut pending, |l| lines.push(l));
        assert!(lines.iter().all(|l| l.len() <= MAX_LOG_LINE));
        assert_eq!(lines.last().unwrap(), "last");
        assert_eq!(
            lines.iter().map(String::len).sum::<usize>(),
            3 * (1 << 20) + "é".len() + 4
        );
    }

    #[test]
    fn a_log_keeps_its_newest_entries_with_absolute_offsets() {
        let mut b = Build::new(size());
        let n = MAX_LOG_ENTRIES + 2_500;
        for i in 0..n {
            b.log(entry(LogLevel::Info, None, format!("line {i}")));
        }
        assert_eq!(b.logs.len(), MAX_LOG_ENTRIES);
        // A reader that saw the first 5 entries resumes at the oldest kept one.
        assert_eq!(b.page(5)[0].message, "line 2500");
        assert_eq!(b.page(n - 1)[0].message, format!("line {}", n - 1));
        assert!(b.page(n).is_empty());
    }

    #[test]
    fn old_finished_builds_are_evicted_and_running_ones_kept() {
        let mut builds = HashMap::new();
        for i in 0..25 {
            let mut b = Build::new(size());
            b.status = if i % 5 == 0 {
                BuildStatus::Building
            } else {
                BuildStatus::Ready
            };
            builds.insert(format!("b{i:02}"), Arc::new(Mutex::new(b)));
        }
        evict_finished(&mut builds, MAX_BUILDS_KEPT - 1);
        let finished = builds
            .values()
            .filter(|b| b.lock().unwrap().finished())
            .count();
        assert_eq!(finished, MAX_BUILDS_KEPT - 1);
        assert_eq!(builds.len(), MAX_BUILDS_KEPT - 1 + 5, "running builds stay");
        assert!(builds.contains_key("b24") && !builds.contains_key("b01"));
    }
}
