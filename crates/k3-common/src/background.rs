//! Work that yields the cores: a thread of its own at a lower CPU priority (nice +10), for what runs
//! beside the requests and sandboxes a user waits on (chunk ingests, files prepared for later creates),
//! and a [`Pacer`] through which such a thread also pauses while a [`foreground`] section runs (a
//! snapshot's capture until it is committed), up to [`MAX_PAUSE`] at a time.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

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

/// The longest a [`Pacer`] waits for the foreground sections to end; it then runs as long before it
/// waits again, so background work keeps at least half of its time under a steady foreground.
pub const MAX_PAUSE: Duration = Duration::from_millis(100);

/// Foreground sections running in this process, and the condition background threads wait on.
static RUNNING: AtomicUsize = AtomicUsize::new(0);
static ENDED: (Mutex<()>, Condvar) = (Mutex::new(()), Condvar::new());

/// A foreground section: background threads pace themselves while one runs. Ends when dropped.
#[must_use = "the section ends when this is dropped"]
#[derive(Debug)]
pub struct Foreground(());

/// Starts a foreground section.
pub fn foreground() -> Foreground {
    RUNNING.fetch_add(1, Ordering::SeqCst);
    Foreground(())
}

impl Drop for Foreground {
    fn drop(&mut self) {
        if RUNNING.fetch_sub(1, Ordering::SeqCst) == 1 {
            let _held = ENDED.0.lock().unwrap_or_else(|e| e.into_inner());
            ENDED.1.notify_all();
        }
    }
}

/// Paces one background loop: [`Pacer::pace`] between units of work.
#[derive(Debug)]
pub struct Pacer {
    free_until: Instant,
}

impl Default for Pacer {
    fn default() -> Self {
        Pacer {
            free_until: Instant::now(),
        }
    }
}

impl Pacer {
    /// Returns at once unless a foreground section runs; then waits until none does, at most
    /// [`MAX_PAUSE`], after which it does not wait again for as long as it waited.
    pub fn pace(&mut self) {
        if RUNNING.load(Ordering::SeqCst) == 0 {
            return;
        }
        let now = Instant::now();
        if now < self.free_until {
            return;
        }
        let held = ENDED.0.lock().unwrap_or_else(|e| e.into_inner());
        let (_held, waited) = ENDED
            .1
            .wait_timeout_while(held, MAX_PAUSE, |_| RUNNING.load(Ordering::SeqCst) > 0)
            .unwrap_or_else(|e| e.into_inner());
        if waited.timed_out() {
            self.free_until = Instant::now() + MAX_PAUSE;
        }
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

    #[test]
    fn a_pacer_waits_for_the_foreground_then_runs_as_long_as_it_waited() {
        let mut p = Pacer::default();
        p.pace();
        // A section that ends: the pacer returns once it has.
        let fg = foreground();
        let ended = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let e2 = ended.clone();
        let h = std::thread::spawn(move || {
            std::thread::sleep(MAX_PAUSE / 4);
            e2.store(true, Ordering::SeqCst);
            drop(fg);
        });
        p.pace();
        assert!(
            ended.load(Ordering::SeqCst),
            "returned before the section ended"
        );
        h.join().unwrap();
        // A section that outlasts the wait: one pause, then free running for as long.
        let fg = foreground();
        let t = Instant::now();
        p.pace();
        assert!(t.elapsed() >= MAX_PAUSE, "waited {:?}", t.elapsed());
        assert!(
            p.free_until >= t + MAX_PAUSE,
            "no free running after a full pause"
        );
        drop(fg);
    }
}
