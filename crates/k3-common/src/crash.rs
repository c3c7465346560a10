//! Crash points for fault-injection tests: in debug builds, `K3_CRASH_AT=<name>` makes the process
//! SIGKILL itself when it reaches the point of that name (no unwinding, no destructors, no flush),
//! as a `kill -9` at that step would. `K3_KILL_VM_AT=<name>` instead SIGKILLs the VM process the
//! caller names there, and the caller carries on. Release builds ignore both variables.

/// The environment variable naming the crash point.
pub const CRASH_AT: &str = "K3_CRASH_AT";

/// The environment variable naming the point where the VM process is killed.
pub const KILL_VM_AT: &str = "K3_KILL_VM_AT";

/// SIGKILLs process `vm_pid` here when `K3_KILL_VM_AT` names `name` (debug builds only).
pub fn kill_vm_point(name: &str, vm_pid: u32) {
    if cfg!(debug_assertions)
        && vm_pid > 0
        && std::env::var_os(KILL_VM_AT).is_some_and(|v| v == name)
    {
        eprintln!("VM kill point {name}: SIGKILL to {vm_pid}");
        // SAFETY: kill(2) with a pid the caller owns.
        unsafe { libc::kill(vm_pid as libc::pid_t, libc::SIGKILL) };
    }
}

/// Dies here when `K3_CRASH_AT` names `name` (debug builds only).
pub fn point(name: &str) {
    if cfg!(debug_assertions) && std::env::var_os(CRASH_AT).is_some_and(|v| v == name) {
        eprintln!("crash point {name}: SIGKILL");
        // SAFETY: kill(2) on our own pid; SIGKILL ends the process at once.
        unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
    }
}
