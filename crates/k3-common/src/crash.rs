//! Crash points for fault-injection tests: in debug builds, `K3_CRASH_AT=<name>` makes the process
//! SIGKILL itself when it reaches the point of that name (no unwinding, no destructors, no flush),
//! as a `kill -9` at that step would. Release builds ignore the variable.

/// The environment variable naming the crash point.
pub const CRASH_AT: &str = "K3_CRASH_AT";

/// Dies here when `K3_CRASH_AT` names `name` (debug builds only).
pub fn point(name: &str) {
    if cfg!(debug_assertions) && std::env::var_os(CRASH_AT).is_some_and(|v| v == name) {
        eprintln!("crash point {name}: SIGKILL");
        // SAFETY: kill(2) on our own pid; SIGKILL ends the process at once.
        unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
    }
}
