//! VMs restored ahead of creates. Per image (and with or without a network), a few QEMUs have loaded
//! the image's state, answered one request (so that TCG has translated the guest's hot paths) and
//! stopped. A create takes one, continues it and sends `/init` with the host's clock, fresh entropy, its
//! env and network: no process start, no state load and no mux handshake on its critical path.
//!
//! The pool of an image follows its demand: at least `warm_vms`, and up to `warm_vms_max` when creates
//! of it come in bursts (the largest burst of the last [`PEAK_TTL`], counted over [`BURST_WINDOW`]);
//! none once the image has had no create for `warm_idle`. All pools together hold at most
//! `max_warm_vms` ([`shares`]): the most recently used images are served first, so the least recently
//! used ones are drained when another image needs room. VMs above the demand or the budget are stopped
//! by a sweep ([`Runtime::trim_warm_later`]) or before a refill makes room for another.
//!
//! A warm VM's files live in `<state>/vms/w<n>/`; the sandbox that takes it records that folder
//! (`VmRecord::vm_dir`). Warm VMs nobody took are killed when the runtime closes, and by the next
//! runtime's recovery after a crash.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::agent::{self, AgentLink, Probe};
use crate::error::CreateError;
use crate::lifecycle::source::{Image, ImageStart};
use crate::net::{Attachment, EgressPolicy};
use crate::vmm::{DiskFormat, VmInstance};
use crate::{Inner, Runtime};

/// A stopped VM of an image, with its live agent session.
pub(crate) struct WarmVm {
    pub(crate) dir: PathBuf,
    pub(crate) vm: Box<dyn VmInstance>,
    pub(crate) link: AgentLink,
    pub(crate) ram_file: PathBuf,
    pub(crate) ram_shared: bool,
    pub(crate) net: Option<Attachment>,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct Key {
    disk: PathBuf,
    state: PathBuf,
    ram: PathBuf,
    network: bool,
}

impl Key {
    /// The pool of `image` (`None`: not kept warm, e.g. a cold-booted filesystem snapshot).
    pub(crate) fn of(image: &Image, network: bool) -> Option<Key> {
        let (ram, state) = match &image.start {
            ImageStart::CopyRam { ram, state } | ImageStart::CowRam { ram, state } => (ram, state),
            ImageStart::Stream { .. } | ImageStart::Boot => return None,
        };
        Some(Key {
            disk: image.disk.clone(),
            state: state.clone(),
            ram: ram.clone(),
            network,
        })
    }
}

/// Creates closer together than this count as one burst.
pub(crate) const BURST_WINDOW: Duration = Duration::from_secs(2);
/// How long a burst keeps its image's pool at the burst's size.
pub(crate) const PEAK_TTL: Duration = Duration::from_secs(300);

/// Recent creates of one image, for the pool's size.
#[derive(Debug, Clone)]
pub(crate) struct Demand {
    recent: std::collections::VecDeque<Instant>,
    peak: usize,
    peak_at: Instant,
    /// The last create.
    last: Instant,
}

impl Demand {
    fn new(now: Instant) -> Demand {
        Demand {
            recent: Default::default(),
            peak: 0,
            peak_at: now,
            last: now,
        }
    }

    /// Counts a create at `now`.
    pub(crate) fn record(&mut self, now: Instant) {
        while self
            .recent
            .front()
            .is_some_and(|t| now.duration_since(*t) > BURST_WINDOW)
        {
            self.recent.pop_front();
        }
        self.recent.push_back(now);
        self.last = self.last.max(now);
        let burst = self.recent.len();
        if burst >= self.peak || now.duration_since(self.peak_at) > PEAK_TTL {
            self.peak = burst;
            self.peak_at = now;
        }
    }

    /// The pool size for this demand at `now`, between `floor` and `max`; 0 once the image has had no
    /// create for `idle`.
    pub(crate) fn target(&self, now: Instant, floor: usize, max: usize, idle: Duration) -> usize {
        if now.saturating_duration_since(self.last) > idle {
            return 0;
        }
        let peak = if now.duration_since(self.peak_at) > PEAK_TTL {
            0
        } else {
            self.peak
        };
        peak.clamp(floor.min(max), max.max(floor))
    }
}

/// Each image's share of a budget of `cap` warm VMs, from `wants` (image, last create, own target):
/// by last create, newest first, each gets its own target while the budget lasts, so the least
/// recently used get what is left, often none.
pub(crate) fn shares<K: Clone + Eq + std::hash::Hash>(
    mut wants: Vec<(K, Instant, usize)>,
    cap: usize,
) -> HashMap<K, usize> {
    wants.sort_by_key(|w| std::cmp::Reverse(w.1));
    let mut left = cap;
    wants
        .into_iter()
        .map(|(k, _, want)| {
            let got = want.min(left);
            left -= got;
            (k, got)
        })
        .collect()
}

/// How a [`WarmPool`] is sized (`RuntimeConfig::{warm_vms, warm_vms_max, max_warm_vms, warm_idle}`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Sizes {
    /// Warm VMs of each recently used image.
    pub(crate) per_image: usize,
    /// Most of one image while its creates come in bursts.
    pub(crate) max_per_image: usize,
    /// Warm VMs of all images together.
    pub(crate) max_total: usize,
    /// An image with no create for this long keeps none.
    pub(crate) idle: Duration,
}

/// The warm VMs of one runtime.
pub(crate) struct WarmPool {
    dir: PathBuf,
    /// Its sizes (`max_per_image` at least `per_image`).
    sizes: Sizes,
    demand: Mutex<HashMap<Key, Demand>>,
    ready: Mutex<HashMap<Key, Vec<WarmVm>>>,
    filling: Mutex<HashSet<Key>>,
    /// Whether a sweep is scheduled.
    trimming: std::sync::atomic::AtomicBool,
    /// One warm VM is made at a time: creates keep the cores.
    work: tokio::sync::Semaphore,
    next: AtomicU64,
    closed: std::sync::atomic::AtomicBool,
}

/// How long a warm VM's first answer may take.
const WARM_DEADLINE: Duration = Duration::from_secs(60);

/// Runs `true` through envd's shell as a claim's first command will run its own, so that under TCG
/// that command finds the guest's exec and shell paths translated. Best effort: a warm VM whose
/// guest cannot is kept.
async fn warm_shell(link: &AgentLink) {
    let req = agentenv_envd::ExecRequest {
        cmd: "true".into(),
        user: "user".into(),
        cwd: None,
        envs: Default::default(),
        timeout_ms: 10_000,
        stdin_b64: None,
        background: false,
    };
    let r = match link.open().await {
        Ok(s) => agent::exec_on(s, &req, Duration::from_secs(10), |_| {}).await,
        Err(e) => Err(e.into()),
    };
    if let Err(e) = r {
        tracing::debug!(error = %e, "warming the guest's shell failed");
    }
}

impl WarmPool {
    /// A pool keeping `per_image` VMs per recently used image, up to `max_per_image` while creates come
    /// in bursts, and `max_total` in all.
    pub(crate) fn new(dir: PathBuf, sizes: Sizes) -> WarmPool {
        WarmPool {
            dir,
            sizes: Sizes {
                max_per_image: sizes.max_per_image.max(sizes.per_image),
                ..sizes
            },
            demand: Mutex::new(HashMap::new()),
            ready: Mutex::new(HashMap::new()),
            filling: Mutex::new(HashSet::new()),
            trimming: Default::default(),
            work: tokio::sync::Semaphore::new(1),
            next: AtomicU64::new(0),
            closed: Default::default(),
        }
    }

    /// `<state>/vms`.
    pub(crate) fn dir(&self) -> &Path {
        &self.dir
    }

    /// Counts a create of `key` (taken from the pool or not) towards the pool's size.
    pub(crate) fn record_create(&self, key: &Key) {
        if self.sizes.per_image == 0 {
            return;
        }
        let now = Instant::now();
        self.demand
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(key.clone())
            .or_insert_with(|| Demand::new(now))
            .record(now);
    }

    /// How many warm VMs each image should have now (images missing: none), within the budget; images
    /// idle past [`PEAK_TTL`] and `idle` are forgotten.
    fn targets(&self) -> HashMap<Key, usize> {
        if self.sizes.per_image == 0 {
            return HashMap::new();
        }
        let now = Instant::now();
        let mut demand = self.demand.lock().unwrap_or_else(|e| e.into_inner());
        demand
            .retain(|_, d| now.saturating_duration_since(d.last) <= self.sizes.idle.max(PEAK_TTL));
        let wants = demand
            .iter()
            .map(|(k, d)| {
                let want = d.target(
                    now,
                    self.sizes.per_image,
                    self.sizes.max_per_image,
                    self.sizes.idle,
                );
                (k.clone(), d.last, want)
            })
            .collect();
        shares(wants, self.sizes.max_total)
    }

    /// How many warm VMs `key` should have now.
    fn target(&self, key: &Key) -> usize {
        self.targets().get(key).copied().unwrap_or(0)
    }

    /// Warm VMs ready now, of all images.
    fn total(&self) -> usize {
        self.lock().values().map(Vec::len).sum()
    }

    /// Warm VMs ready now for the image on `disk` (with and without a network).
    pub(crate) fn ready_for(&self, disk: &Path) -> usize {
        self.lock()
            .iter()
            .filter(|(k, _)| k.disk == disk)
            .map(|(_, v)| v.len())
            .sum()
    }

    /// Takes out the warm VMs above their image's current target (the burst that sized it aged out, the
    /// image went idle, or images used more recently need the budget), oldest first.
    fn surplus(&self) -> Vec<WarmVm> {
        let targets = self.targets();
        let mut map = self.lock();
        let out = map
            .iter_mut()
            .flat_map(|(k, v)| {
                let keep = targets.get(k).copied().unwrap_or(0);
                let over = v.len().saturating_sub(keep);
                v.drain(..over).collect::<Vec<_>>()
            })
            .collect();
        map.retain(|_, v| !v.is_empty());
        out
    }

    /// A warm VM of `key` whose QEMU still runs.
    pub(crate) fn take(&self, key: &Key) -> Option<WarmVm> {
        loop {
            let w = self.lock().get_mut(key)?.pop()?;
            if w.vm.alive() {
                return Some(w);
            }
            tracing::warn!(dir = %w.dir.display(), "a warm VM died while waiting; dropped");
            discard(w, None);
        }
    }

    /// Kills every warm VM of images on `disk` (its snapshot is going away).
    pub(crate) fn forget(&self, disk: &Path, inner: &Inner) {
        let gone: Vec<WarmVm> = {
            let mut map = self.lock();
            let keys: Vec<Key> = map.keys().filter(|k| k.disk == disk).cloned().collect();
            keys.iter()
                .flat_map(|k| map.remove(k).unwrap_or_default())
                .collect()
        };
        self.demand
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|k, _| k.disk != disk);
        for w in gone {
            discard(w, inner.net.as_ref());
        }
    }

    /// Takes every warm VM out, and makes no more (the runtime is closing).
    pub(crate) fn drain(&self) -> Vec<WarmVm> {
        self.closed.store(true, Ordering::SeqCst);
        self.lock().drain().flat_map(|(_, v)| v).collect()
    }

    /// Returns once no warm VM is being made (after [`WarmPool::drain`], none will be again).
    pub(crate) async fn settled(&self) {
        let _permit = self.work.acquire().await;
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Key, Vec<WarmVm>>> {
        self.ready.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for WarmPool {
    fn drop(&mut self) {
        for w in self.lock().drain().flat_map(|(_, v)| v) {
            discard(w, None);
        }
    }
}

/// Kills a warm VM at once and removes its files (and gives its network slot back when `net` is given).
pub(crate) fn discard(w: WarmVm, net: Option<&Arc<crate::net::Network>>) {
    let pid = w.vm.pid();
    if pid > 0 && w.vm.alive() {
        // SAFETY: plain syscall on the pid of a QEMU this runtime started.
        unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
    }
    if let (Some(att), Some(net)) = (w.net, net) {
        net.release(att);
    }
    if w.ram_shared {
        let _ = std::fs::remove_file(&w.ram_file);
    }
    let _ = std::fs::remove_dir_all(&w.dir);
}

impl Runtime {
    /// Kills warm VM `w`, waiting for its exit, and removes its files and network slot.
    pub(crate) async fn discard_warm(&self, w: WarmVm) {
        if let Err(e) = w.vm.kill().await {
            tracing::warn!(dir = %w.dir.display(), error = %e, "a warm VM did not exit");
        }
        discard(w, self.inner.net.as_ref());
    }

    /// Tops `image`'s warm VMs (with or without a network) up to the kept number, in the background.
    pub(crate) fn refill_warm(&self, image: &Image, network: bool) {
        let inner = &self.inner;
        let Some(key) = Key::of(image, network) else {
            return;
        };
        if inner.warm.sizes.per_image == 0
            || inner.warm.closed.load(Ordering::SeqCst)
            || !inner
                .warm
                .filling
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(key.clone())
        {
            return;
        }
        let (weak, image) = (Arc::downgrade(&self.inner), image.clone());
        tokio::spawn(async move {
            // Holds the runtime only while making one VM: a dropped runtime stops the refill.
            while let Some(inner) = weak.upgrade() {
                let rt = Runtime { inner };
                let pool = &rt.inner.warm;
                if pool.lock().get(&key).map_or(0, Vec::len) >= pool.target(&key) {
                    break;
                }
                let Ok(_permit) = pool.work.acquire().await else {
                    break;
                };
                // Room first: the VMs over their images' shares (the least recently used) go.
                for w in pool.surplus() {
                    rt.discard_warm(w).await;
                }
                let have = pool.lock().get(&key).map_or(0, Vec::len);
                if pool.closed.load(Ordering::SeqCst)
                    || have >= pool.target(&key)
                    || pool.total() >= pool.sizes.max_total
                {
                    break;
                }
                match rt.make_warm(&image, network).await {
                    Ok(w) if pool.closed.load(Ordering::SeqCst) => rt.discard_warm(w).await,
                    Ok(w) => pool.lock().entry(key.clone()).or_default().push(w),
                    Err(e) => {
                        tracing::warn!(image = %image.template_id, error = %e, "making a warm VM failed");
                        break;
                    }
                }
            }
            if let Some(inner) = weak.upgrade() {
                inner
                    .warm
                    .filling
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .remove(&key);
                Runtime { inner }.trim_warm_later();
            }
        });
    }

    /// While any warm VM is kept, sweeps the pools now and then: VMs above their image's target (a burst
    /// aged out, the image went idle, the budget went to images used since) are stopped.
    pub(crate) fn trim_warm_later(&self) {
        let pool = &self.inner.warm;
        if pool.total() == 0 || pool.trimming.swap(true, Ordering::SeqCst) {
            return;
        }
        let every = (PEAK_TTL / 4)
            .min(pool.sizes.idle / 4)
            .max(Duration::from_millis(200));
        let weak = Arc::downgrade(&self.inner);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                let Some(inner) = weak.upgrade() else { return };
                let rt = Runtime { inner };
                let pool = &rt.inner.warm;
                let _permit = pool.work.acquire().await;
                for w in pool.surplus() {
                    rt.discard_warm(w).await;
                }
                if pool.closed.load(Ordering::SeqCst) || pool.total() == 0 {
                    pool.trimming.store(false, Ordering::SeqCst);
                    return;
                }
            }
        });
    }

    async fn make_warm(&self, image: &Image, network: bool) -> Result<WarmVm, CreateError> {
        let inner = &self.inner;
        let n = inner.warm.next.fetch_add(1, Ordering::Relaxed);
        let dir = inner.warm.dir.join(format!("w{n}"));
        let io = |what, path: &Path| {
            let path = path.to_owned();
            move |source| CreateError::Io { what, path, source }
        };
        std::fs::create_dir_all(&dir).map_err(io("create", &dir))?;
        let (ram_file, ram_shared, state) = match &image.start {
            ImageStart::CopyRam { state, .. } => (
                match &inner.cfg.ram_dir {
                    Some(d) => d.join(format!(
                        "warm-{}-w{n}.mem",
                        crate::lifecycle::prepared::dir_tag(&inner.cfg.state_dir)
                    )),
                    None => dir.join("ram.mem"),
                },
                true,
                state.clone(),
            ),
            ImageStart::CowRam { ram, state } => (ram.clone(), false, state.clone()),
            _ => return Err(CreateError::UnknownTemplate(image.template_id.clone())),
        };
        let mut w = WarmVmParts {
            dir: dir.clone(),
            ram_file: ram_file.clone(),
            ram_shared,
            net: None,
        };
        let r = async {
            let mut spec =
                image
                    .machine
                    .spec(&dir, &ram_file, &dir.join("disk.qcow2"), DiskFormat::Qcow2);
            spec.ram_shared = ram_shared;
            // It prepares beside the sandboxes running (its QEMU's start included) and yields to them.
            spec.background = true;
            let copy = image.ram_copied().map(|src| (src, ram_file.as_path()));
            inner
                .prepared
                .place(&image.disk, copy, &spec.disk, true)
                .await
                .map_err(|(what, source)| CreateError::Io {
                    what,
                    path: dir.clone(),
                    source,
                })?;
            if network && let Some(net) = &inner.net {
                let att = net.attach(&dir, EgressPolicy::default()).await?;
                spec.tap = Some(att.tap()?);
                w.net = Some(att);
            }
            let restored = inner.vmm.restore(&spec, &state).await?;
            let vm = restored.vm;
            let warmed = async {
                vm.cont().await?;
                let sock = spec.agent_socket();
                // With a network, the slot's settings already: the claim's `/init` then finds the
                // guest's NIC code translated and its settings in place.
                let env_vars = Default::default();
                let probe = match &w.net {
                    Some(att) => Probe::Init {
                        env_vars: &env_vars,
                        network: Some(att.guest()),
                    },
                    None => Probe::Health,
                };
                let link = agent::answering(
                    Some(restored.agent),
                    &sock,
                    Duration::from_secs(3),
                    WARM_DEADLINE,
                    probe,
                )
                .await?;
                // A template's pool only: a snapshot's VMs are made for restores in a row, where the
                // shell's translation would cost more CPU than it saves (measured).
                if image.parent.is_none() {
                    warm_shell(&link).await;
                }
                vm.stop().await?;
                Ok::<_, CreateError>(link)
            }
            .await;
            match warmed {
                Ok(link) => Ok((vm, link)),
                Err(e) => {
                    let _ = vm.kill().await;
                    Err(e)
                }
            }
        }
        .await;
        match r {
            Ok((vm, link)) => Ok(WarmVm {
                dir: w.dir,
                vm,
                link,
                ram_file: w.ram_file,
                ram_shared: w.ram_shared,
                net: w.net,
            }),
            Err(e) => {
                if let (Some(att), Some(net)) = (w.net.take(), &inner.net) {
                    net.release(att);
                }
                if w.ram_shared {
                    let _ = std::fs::remove_file(&w.ram_file);
                }
                let _ = std::fs::remove_dir_all(&w.dir);
                Err(e)
            }
        }
    }

    /// Kills QEMUs under `vms/` that neither this pool nor a kept sandbox (`keep_pids`) runs, and
    /// removes every `vms/` folder no sandbox holds (`held`): what a previous process left.
    pub(crate) fn remove_stale_warm(&self, held: &HashSet<PathBuf>, keep_pids: &[u32]) {
        let pool = &self.inner.warm;
        for (pid, name) in crate::vmm::vm_processes_under(&pool.dir) {
            let dir = pool.dir.join(&name);
            if !keep_pids.contains(&pid) && !pool.is_pooled(&dir) {
                tracing::warn!(pid, dir = %dir.display(), "killing a QEMU left by a previous run");
                // SAFETY: plain syscall on a pid whose command line names our vms folder.
                unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
            }
        }
        let Ok(rd) = std::fs::read_dir(&pool.dir) else {
            return;
        };
        for e in rd.flatten() {
            let dir = e.path();
            if !held.contains(&dir) && !pool.is_pooled(&dir) {
                let _ = std::fs::remove_dir_all(&dir);
            }
        }
    }
}

impl WarmPool {
    fn is_pooled(&self, dir: &Path) -> bool {
        self.lock().values().flatten().any(|w| w.dir == dir)
    }
}

/// The parts of a warm VM being made, for cleanup on failure.
struct WarmVmParts {
    dir: PathBuf,
    ram_file: PathBuf,
    ram_shared: bool,
    net: Option<Attachment>,
}

#[cfg(test)]
mod tests {
    use super::*;

    const IDLE: Duration = Duration::from_secs(600);

    #[test]
    fn the_pool_follows_bursts_and_shrinks_once_they_age_out() {
        let t0 = Instant::now();
        let mut d = Demand::new(t0);
        assert_eq!(d.target(t0, 2, 8, IDLE), 2, "no creates: the floor");
        for i in 0..8 {
            d.record(t0 + Duration::from_millis(10 * i));
        }
        assert_eq!(
            d.target(t0 + Duration::from_secs(1), 2, 8, IDLE),
            8,
            "a burst of 8"
        );
        // Spread-out creates afterwards keep the peak until it ages out.
        let later = t0 + Duration::from_secs(60);
        d.record(later);
        assert_eq!(d.target(later, 2, 8, IDLE), 8);
        let aged = t0 + PEAK_TTL + Duration::from_secs(1);
        assert_eq!(d.target(aged, 2, 8, IDLE), 2, "the burst aged out");
        d.record(aged);
        assert_eq!(d.target(aged, 2, 8, IDLE), 2, "one create is no burst");
        // A burst above the maximum is capped; the maximum is never below the floor.
        for i in 0..20 {
            d.record(aged + Duration::from_millis(i));
        }
        assert_eq!(d.target(aged, 2, 8, IDLE), 8);
        assert_eq!(d.target(aged, 4, 3, IDLE), 4);
        assert_eq!(d.target(aged, 0, 0, IDLE), 0);
    }

    #[test]
    fn an_image_idle_for_a_while_keeps_no_warm_vm() {
        let t0 = Instant::now();
        let idle = Duration::from_secs(rand::random_range(60..1200));
        let mut d = Demand::new(t0);
        d.record(t0);
        assert_eq!(d.target(t0 + idle, 2, 8, idle), 2, "not idle yet");
        let later = t0 + idle + Duration::from_secs(1);
        assert_eq!(d.target(later, 2, 8, idle), 0, "idle: none");
        d.record(later);
        assert_eq!(d.target(later, 2, 8, idle), 2, "used again: the floor");
    }

    #[test]
    fn the_budget_goes_to_the_most_recently_used_images_first() {
        let t0 = Instant::now();
        let at = |s| t0 + Duration::from_secs(s);
        // Used last: a, then c, then b.
        let wants = || vec![("a", at(30), 2), ("b", at(10), 8), ("c", at(20), 8)];
        let got = shares(wants(), 16);
        assert_eq!((got["a"], got["c"], got["b"]), (2, 8, 6));
        let cap = rand::random_range(0..20);
        let got = shares(wants(), cap);
        let a = cap.min(2);
        let c = (cap - a).min(8);
        assert_eq!((got["a"], got["c"], got["b"]), (a, c, (cap - a - c).min(8)));
        assert!(got.values().sum::<usize>() <= cap);
    }

    #[test]
    fn a_pool_within_its_budget_serves_the_image_used_last() {
        let dir = tempfile::tempdir().unwrap();
        let key = |n: &str| Key {
            disk: dir.path().join(n),
            state: dir.path().join("state"),
            ram: dir.path().join("ram"),
            network: false,
        };
        let (k1, k2, k3) = (key("1"), key("2"), key("3"));
        let pool = WarmPool::new(
            dir.path().join("vms"),
            Sizes {
                per_image: 2,
                max_per_image: 8,
                max_total: 3,
                idle: IDLE,
            },
        );
        let pause = || std::thread::sleep(Duration::from_millis(2));
        pool.record_create(&k1);
        pause();
        pool.record_create(&k2);
        assert_eq!((pool.target(&k2), pool.target(&k1)), (2, 1));
        assert_eq!(pool.target(&k3), 0, "never used: none");
        pause();
        pool.record_create(&k1);
        assert_eq!((pool.target(&k1), pool.target(&k2)), (2, 1));
        pause();
        pool.record_create(&k3);
        assert_eq!(
            (pool.target(&k3), pool.target(&k1), pool.target(&k2)),
            (2, 1, 0),
            "the least recently used image is drained first"
        );
        let off = WarmPool::new(
            dir.path().join("vms"),
            Sizes {
                per_image: 0,
                max_per_image: 8,
                max_total: 3,
                idle: IDLE,
            },
        );
        off.record_create(&k1);
        assert_eq!(off.target(&k1), 0);
    }
}
