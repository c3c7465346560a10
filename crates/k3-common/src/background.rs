//! Work that yields the cores: a thread of its own at a lower CPU priority (nice +10), for what runs
//! beside the requests and sandboxes a user waits on (chunk ingests, files prepared for later creates).

/// How much lower than the caller's a background thread's priority is.
pub const NICE: i32 = 10;

/// Runs `f` on a new thread named `name` at [`NICE`] more than the calling process's niceness.
pub fn spawn<T: Send + 'static>(
    name: String,
    f: impl FnOnce() -> T + Send + 'static,
) -> std::io::Result<std::thread::JoinHandle<T>> {
    std::thread::Builder::new().name(name).spawn(move || {
        lower_this_thread();
        f()
    })
}

/// Lowers the calling thread's priority by [`NICE`] (at most to 19).
fn lower_this_thread() {
    // SAFETY: plain syscalls on this thread's own id.
    unsafe {
        let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
        let now = libc::getpriority(libc::PRIO_PROCESS, tid);
        libc::setpriority(libc::PRIO_PROCESS, tid, (now + NICE).min(19));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn niceness() -> i32 {
        // SAFETY: plain syscalls on this thread's own id.
        unsafe {
            let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
            libc::getpriority(libc::PRIO_PROCESS, tid)
        }
    }

    #[test]
    fn the_thread_runs_at_a_lower_priority_and_the_caller_keeps_its_own() {
        let mine = niceness();
        let theirs = spawn("k3-test-bg".into(), niceness)
            .unwrap()
            .join()
            .unwrap();
        assert_eq!(theirs, (mine + NICE).min(19));
        assert_eq!(niceness(), mine);
    }
}
