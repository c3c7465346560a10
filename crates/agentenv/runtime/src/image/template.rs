//! Templates: rootfs image + one cold boot + a ready-to-resume base snapshot (RAM file + device state).
//!
//! Built artefacts are cached under `cache_dir()/agentenv/templates/<key>/`, keyed by every input (guest
//! agent binary, kernel, machine shape, accelerator), so tests and restarts reuse them; each runtime then
//! hard-links them into `state_dir/templates/<id>/<key>/`. Base files are never written after the build,
//! so sandbox overlays and RAM copies stay valid.

use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::agent;
use crate::error::TemplateError;
use crate::fsops;
use crate::image::rootfs;
use crate::persist::{self, MachineRecord, RECORD_VERSION, TemplateInfo, TemplateRecord};
use crate::vmm::DiskFormat;
use crate::{Inner, valid_id};

/// Bumped whenever the way a base snapshot is made changes (invalidates cached builds).
const BUILD_FORMAT: u32 = 4;

/// Time for the guest agent to notice a host (dis)connect and re-open its port (it waits 100 ms).
const SETTLE: Duration = Duration::from_millis(500);

/// envd protocol version reported for templates built here (E2B compat spec section 6.7).
pub const ENVD_VERSION: &str = agentenv_envd::ENVD_VERSION;

pub use agentenv_vm::template::{
    BuildProgress, BuildStep, ImageSource, TEMPLATE_DISK_MIB, TEMPLATE_MEMORY_MIB, TEMPLATE_VCPUS,
    TemplateSpec,
};

/// Builds (or reuses from the cache) the template and installs it into the state folder.
pub(crate) async fn build(
    inner: &Inner,
    spec: TemplateSpec,
    progress: &(dyn Fn(BuildProgress) + Send + Sync),
) -> Result<TemplateRecord, TemplateError> {
    if !valid_id(&spec.id) || spec.aliases.iter().any(|a| !valid_id(a)) {
        return Err(TemplateError::InvalidId(spec.id));
    }
    spec.check_size().map_err(TemplateError::InvalidSpec)?;
    let say = |step, detail: String| progress(BuildProgress::step(step, detail));
    let guest_bin = rootfs::find_guest_binary(inner.cfg.guest_bin.as_deref())?;
    let machine = MachineRecord {
        kernel: inner.kernel.vmlinux.clone(),
        initrd: inner.kernel.initrd.clone(),
        cmdline: crate::vmm::kernel::cmdline(),
        vcpus: spec.vcpus,
        memory_mib: spec.memory_mib,
        nic: true,
        cpu: Some(cpu_model(inner.vmm.accel()).into()),
        free_page_reporting: true,
    };
    let image = match &spec.from_image {
        Some(src) => Some(resolve_image(src, &inner.cfg.registry_allow).await?),
        None => None,
    };
    let key = build_key(inner, &spec, &machine, &guest_bin, image.as_ref())?;
    let cached = inner.cache.join("templates").join(&key);
    let lock_path = inner.cache.join("templates").join(format!("{key}.lock"));
    let lock = tokio::task::spawn_blocking(move || build_lock(&lock_path))
        .await
        .map_err(|e| TemplateError::Io {
            what: "lock",
            path: PathBuf::new(),
            source: std::io::Error::other(e),
        })??;
    if cached.join("complete").exists() {
        say(BuildStep::Cached, format!("reusing {}", cached.display()));
    } else {
        build_into_cache(
            inner,
            &spec,
            &machine,
            &guest_bin,
            image.as_ref(),
            &cached,
            progress,
        )
        .await?;
    }
    drop(lock);

    let dir = inner
        .cfg
        .state_dir
        .join("templates")
        .join(&spec.id)
        .join(&key);
    std::fs::create_dir_all(&dir).map_err(|e| TemplateError::Io {
        what: "create",
        path: dir.clone(),
        source: e,
    })?;
    for f in ["base.ext4", "base.mem", "base.state"] {
        let (src, dst) = (cached.join(f), dir.join(f));
        fsops::link_or_copy(&src, &dst).map_err(|e| TemplateError::Io {
            what: "install",
            path: dst,
            source: e,
        })?;
    }
    let record = TemplateRecord {
        version: RECORD_VERSION,
        info: TemplateInfo {
            id: spec.id.clone(),
            aliases: spec.aliases.clone(),
            vcpus: spec.vcpus,
            memory_mib: spec.memory_mib,
            disk_mib: spec.disk_mib,
            built_at: k3_common::time::now_rfc3339(),
            envd_version: ENVD_VERSION.into(),
            from_image: image
                .as_ref()
                .map(|i| format!("{}@{}", i.reference, i.digest)),
        },
        machine,
        base_disk: dir.join("base.ext4"),
        base_ram: dir.join("base.mem"),
        base_state: dir.join("base.state"),
    };
    persist::write(
        &inner
            .cfg
            .state_dir
            .join("templates")
            .join(&spec.id)
            .join("template.json"),
        &record,
    )?;
    Ok(record)
}

async fn build_into_cache(
    inner: &Inner,
    spec: &TemplateSpec,
    machine: &MachineRecord,
    guest_bin: &Path,
    image: Option<&ResolvedSource>,
    cached: &Path,
    progress: &(dyn Fn(BuildProgress) + Send + Sync),
) -> Result<(), TemplateError> {
    let say = &|step, detail: String| progress(BuildProgress::step(step, detail));
    let partial = cached.with_extension("partial");
    // A build killed before (kill -9 of its server) may have left its QEMU running there.
    kill_vms_under(&partial);
    let _ = std::fs::remove_dir_all(&partial);
    let vm_dir = partial.join("vm");
    std::fs::create_dir_all(&vm_dir).map_err(|e| TemplateError::Io {
        what: "create",
        path: vm_dir.clone(),
        source: e,
    })?;

    let mut start = agentenv_envd::InitRequest::default();
    let (tree, disk_mib) = match image {
        None => {
            say(
                BuildStep::Userland,
                "debootstrap bookworm minbase + the default packages (cached after the first run)"
                    .into(),
            );
            let cache = inner.cache.clone();
            let gb = guest_bin.to_owned();
            let tree = blocking(move || {
                let tree = rootfs::debootstrap(&cache)?;
                rootfs::customize(&tree, &gb)?;
                Ok(tree)
            })
            .await?;
            (tree, spec.disk_mib)
        }
        Some(img) => {
            let tree = partial.join("rootfs");
            let config = pull_image(img, &tree, progress).await?;
            let gb = guest_bin.to_owned();
            let t = tree.clone();
            blocking(move || {
                // Images may ship no account files at all (distroless); the agent needs them.
                for (f, root) in [
                    ("etc/passwd", "root:x:0:0:root:/root:/bin/sh\n"),
                    ("etc/group", "root:x:0:\n"),
                    ("etc/shadow", "root:*:20000:0:99999:7:::\n"),
                ] {
                    let p = t.join(f);
                    if std::fs::symlink_metadata(&p).is_err() {
                        let _ = std::fs::create_dir_all(t.join("etc"));
                        std::fs::write(&p, root).map_err(|e| rootfs::RootfsError::Io {
                            what: "write",
                            path: p.clone(),
                            source: e,
                        })?;
                    }
                }
                rootfs::customize(&t, &gb)
            })
            .await?;
            start = image_defaults(&config, &tree)?;
            let used = dir_bytes(&tree) >> 20;
            (tree, spec.disk_mib.max(used * 2 + 256))
        }
    };
    say(
        BuildStep::Image,
        format!("mkfs.ext4 -d {} ({} MiB)", tree.display(), disk_mib),
    );
    let disk = partial.join("base.ext4");
    let d = disk.clone();
    let t = tree.clone();
    blocking(move || rootfs::make_ext4(&t, &d, disk_mib)).await?;
    if image.is_some() {
        let _ = std::fs::remove_dir_all(&tree);
    }

    say(
        BuildStep::Boot,
        format!("cold boot under {}", inner.vmm.accel().as_str()),
    );
    let ram = partial.join("base.mem");
    let vm_spec = machine.spec(&vm_dir, &ram, &disk, DiskFormat::Raw);
    let vm = inner.vmm.boot(&vm_spec).await?;
    let link = match agent::connect_healthy(
        &vm_spec.agent_socket(),
        Duration::from_secs(5),
        Duration::from_secs(120),
    )
    .await
    {
        Ok(l) => l,
        Err(source) => {
            let _ = vm.kill().await;
            let log = std::fs::read_to_string(vm_spec.console_log()).unwrap_or_default();
            return Err(TemplateError::Agent {
                source,
                log: tail(&log, 3000),
            });
        }
    };
    if start != agentenv_envd::InitRequest::default() {
        say(
            BuildStep::Boot,
            format!(
                "image defaults: user {:?}, workdir {:?}, start {:?}",
                start.default_user, start.default_workdir, start.start
            ),
        );
        if let Err(e) = agent::configure(&link, &start).await {
            let _ = vm.kill().await;
            return Err(TemplateError::InvalidSpec(format!(
                "applying the image config: {e}"
            )));
        }
    }
    k3_common::crash::point("runtime:template:after-boot");
    say(
        BuildStep::Snapshot,
        "stop + device state (x-ignore-shared)".into(),
    );
    // Snapshot the guest with a fresh port session that is still hunting for a HELLO, and with a host
    // connected (but silent): a restore connects before the state loads, so the guest sees no port
    // close/open and its session takes the new client's HELLO at once.
    drop(link);
    tokio::time::sleep(SETTLE).await;
    let quiet = tokio::net::UnixStream::connect(vm_spec.agent_socket())
        .await
        .map_err(|e| TemplateError::Io {
            what: "connect",
            path: vm_spec.agent_socket(),
            source: e,
        })?;
    tokio::time::sleep(SETTLE).await;
    let r = async {
        vm.stop().await?;
        vm.save_device_state(&partial.join("base.state")).await?;
        drop(quiet);
        vm.shutdown().await
    }
    .await;
    if let Err(e) = r {
        let _ = vm.kill().await;
        return Err(e.into());
    }
    // The build VM's socket folder belonged to its uid, which the next VM may get.
    let _ = std::fs::remove_dir_all(vm_spec.socket_dir());
    std::fs::write(partial.join("complete"), b"").map_err(|e| TemplateError::Io {
        what: "write",
        path: partial.join("complete"),
        source: e,
    })?;
    let _ = std::fs::remove_dir_all(cached);
    std::fs::rename(&partial, cached).map_err(|e| TemplateError::Io {
        what: "rename",
        path: cached.to_owned(),
        source: e,
    })
}

/// The CPU model of new machines: the host's under KVM; under TCG everything TCG emulates but 5-level
/// paging (so wheels built for x86-64-v2/v3, such as numpy 2.4's, run; QEMU's default `qemu64` lacks SSE4.2).
pub(crate) fn cpu_model(accel: crate::AccelKind) -> &'static str {
    match accel {
        crate::AccelKind::Kvm => "host",
        crate::AccelKind::Tcg => "max,la57=off",
    }
}

fn build_key(
    inner: &Inner,
    spec: &TemplateSpec,
    machine: &MachineRecord,
    guest_bin: &Path,
    image: Option<&ResolvedSource>,
) -> Result<String, TemplateError> {
    let bin = std::fs::read(guest_bin).map_err(|e| TemplateError::Io {
        what: "read",
        path: guest_bin.to_owned(),
        source: e,
    })?;
    let initrd = std::fs::read(&machine.initrd).unwrap_or_default();
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (
        RECORD_VERSION,
        BUILD_FORMAT,
        &bin,
        &initrd,
        &inner.kernel.release,
        machine,
        spec.disk_mib,
    )
        .hash(&mut h);
    (
        inner.vmm.accel().as_str(),
        inner.cfg.qemu_bin.as_os_str(),
        inner.vmm.version(),
    )
        .hash(&mut h);
    image.map(|i| i.digest.as_str()).hash(&mut h);
    crate::image::rootfs::host_cas().hash(&mut h);
    // The rootfs recipe and this file's build steps: an edited recipe never reuses an old template.
    (
        crate::image::rootfs::recipe_key(),
        include_str!("template.rs"),
    )
        .hash(&mut h);
    Ok(format!("{:016x}", h.finish()))
}

impl Hash for MachineRecord {
    fn hash<H: Hasher>(&self, state: &mut H) {
        (
            &self.kernel,
            &self.initrd,
            &self.cmdline,
            self.vcpus,
            self.memory_mib,
            self.nic,
            &self.cpu,
            self.free_page_reporting,
        )
            .hash(state);
    }
}

fn tail(s: &str, n: usize) -> String {
    let start = s.len().saturating_sub(n);
    let start = (start..s.len())
        .find(|i| s.is_char_boundary(*i))
        .unwrap_or(s.len());
    s[start..].to_owned()
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, rootfs::RootfsError> + Send + 'static,
) -> Result<T, TemplateError> {
    match tokio::task::spawn_blocking(f).await {
        Ok(r) => r.map_err(TemplateError::from),
        Err(e) => Err(TemplateError::Io {
            what: "join",
            path: PathBuf::new(),
            source: std::io::Error::other(e),
        }),
    }
}

/// The lock of one template build (`<key>.lock`), so concurrent builds (tests, several runtimes) do
/// not race; a free one means no builder is alive.
fn build_lock(path: &Path) -> Result<k3_common::fsutil::FileLock, TemplateError> {
    let err = |e| TemplateError::Io {
        what: "lock",
        path: path.to_owned(),
        source: e,
    };
    if let Some(d) = path.parent() {
        std::fs::create_dir_all(d).map_err(err)?;
    }
    k3_common::fsutil::FileLock::lock(path).map_err(err)
}

/// SIGKILLs every QEMU whose command line names a folder under `dir`.
fn kill_vms_under(dir: &Path) -> usize {
    let pids = crate::vmm::vm_processes_under(dir);
    for (pid, _) in &pids {
        // SAFETY: kill(2) of a QEMU this runtime's cache folder names.
        unsafe { libc::kill(*pid as libc::pid_t, libc::SIGKILL) };
    }
    pids.len()
}

/// Builds of `<cache>/templates` whose builder is gone (its lock is free): their QEMUs are killed
/// and their `.partial` folders removed. Returns how many QEMUs it killed.
pub(crate) fn sweep_stale_builds(cache: &Path) -> usize {
    let dir = cache.join("templates");
    let mut killed = 0;
    for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
        let path = e.path();
        let (Some(key), Some("partial")) = (
            path.file_stem().and_then(|s| s.to_str()),
            path.extension().and_then(|s| s.to_str()),
        ) else {
            continue;
        };
        if let Ok(Some(_lock)) =
            k3_common::fsutil::FileLock::try_lock(&dir.join(format!("{key}.lock")))
        {
            killed += kill_vms_under(&path);
            let _ = std::fs::remove_dir_all(&path);
        }
    }
    killed
}

/// An image reference resolved to its manifest digest (the cache key of its build).
pub(crate) struct ResolvedSource {
    reference: String,
    digest: String,
    image: agentenv_oci::ImageRef,
    options: agentenv_oci::PullOptions,
}

fn pull_options(
    src: &ImageSource,
    allow: &[agentenv_oci::AllowedNet],
) -> agentenv_oci::PullOptions {
    let mut o = agentenv_oci::PullOptions::default();
    o.registry.allow = allow.to_vec();
    if let (Some(u), Some(p)) = (&src.username, &src.password) {
        o.registry.credentials = Some(agentenv_oci::Credentials {
            username: u.clone(),
            password: p.clone(),
        });
    }
    o
}

async fn resolve_image(
    src: &ImageSource,
    allow: &[agentenv_oci::AllowedNet],
) -> Result<ResolvedSource, TemplateError> {
    let image = agentenv_oci::ImageRef::parse(&src.reference).map_err(|e| {
        TemplateError::InvalidSpec(format!("image reference {:?}: {e}", src.reference))
    })?;
    let options = pull_options(src, allow);
    let (i, o) = (image.clone(), options.clone());
    let resolved = tokio::task::spawn_blocking(move || agentenv_oci::resolve(&i, &o)).await??;
    Ok(ResolvedSource {
        reference: src.reference.clone(),
        digest: resolved.digest.to_string(),
        image,
        options,
    })
}

async fn pull_image(
    img: &ResolvedSource,
    tree: &Path,
    progress: &(dyn Fn(BuildProgress) + Send + Sync),
) -> Result<agentenv_oci::ImageConfig, TemplateError> {
    let _ = std::fs::remove_dir_all(tree);
    std::fs::create_dir_all(tree).map_err(|e| TemplateError::Io {
        what: "create",
        path: tree.to_owned(),
        source: e,
    })?;
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<BuildProgress>();
    let (i, o, t) = (img.image.clone(), img.options.clone(), tree.to_owned());
    let job = tokio::task::spawn_blocking(move || {
        let mut counter = PullCounter::default();
        agentenv_oci::pull(&i, &t, &o, &mut |e| {
            if let Some(p) = counter.update(e) {
                let _ = tx.send(p);
            }
        })
    });
    let mut job = std::pin::pin!(job);
    let pulled = loop {
        tokio::select! {
            Some(p) = rx.recv() => progress(p),
            r = &mut job => break r,
        }
    };
    while let Ok(p) = rx.try_recv() {
        progress(p);
    }
    let pulled = pulled??;
    progress(BuildProgress {
        step: BuildStep::Pull,
        detail: format!(
            "{} ({} layers, {} bytes)",
            pulled.digest,
            pulled.layers.len(),
            pulled.bytes
        ),
        bytes: Some((pulled.bytes, pulled.bytes)),
    });
    Ok(pulled.config)
}

/// Turns pull events into progress reports with the bytes of all layers: at most one per MiB received,
/// plus one per layer step.
#[derive(Debug, Default)]
struct PullCounter {
    sizes: Vec<u64>,
    done: Vec<u64>,
    reported: u64,
}

impl PullCounter {
    fn update(&mut self, e: &agentenv_oci::PullEvent) -> Option<BuildProgress> {
        use agentenv_oci::PullEvent as E;
        let detail = match e {
            E::Resolved {
                digest,
                layer_sizes,
            } => {
                self.sizes = layer_sizes.clone();
                self.done = vec![0; layer_sizes.len()];
                format!("{digest}: {} layers", layer_sizes.len())
            }
            E::LayerStart { index, cached, .. } => {
                if *cached
                    && let (Some(d), Some(s)) = (self.done.get_mut(*index), self.sizes.get(*index))
                {
                    *d = *s;
                }
                format!(
                    "layer {}{}",
                    index + 1,
                    if *cached { " (cached)" } else { "" }
                )
            }
            E::LayerBytes { index, done, .. } => {
                if let Some(d) = self.done.get_mut(*index) {
                    *d = *done;
                }
                let now: u64 = self.done.iter().sum();
                if now < self.reported + (1 << 20) {
                    return None;
                }
                format!("layer {}", index + 1)
            }
            E::LayerDownloaded { index } => {
                if let (Some(d), Some(s)) = (self.done.get_mut(*index), self.sizes.get(*index)) {
                    *d = *s;
                }
                format!("layer {} downloaded", index + 1)
            }
            E::Applying { index } => format!("applying layer {}", index + 1),
            E::Applied { index, entries } => {
                format!("layer {} applied ({entries} entries)", index + 1)
            }
        };
        self.reported = self.done.iter().sum();
        Some(BuildProgress {
            step: BuildStep::Pull,
            detail,
            bytes: Some((self.reported, self.sizes.iter().sum())),
        })
    }
}

/// The image's Env, User, WorkingDir and Entrypoint+Cmd as the template's `/init` defaults.
fn image_defaults(
    c: &agentenv_oci::ImageConfig,
    tree: &Path,
) -> Result<agentenv_envd::InitRequest, TemplateError> {
    let env: std::collections::BTreeMap<String, String> = c
        .env
        .iter()
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
    let user = match c.user.as_deref().map(|u| u.split(':').next().unwrap_or(u)) {
        None | Some("") => "root".to_owned(),
        Some(u) => user_name(tree, u).ok_or_else(|| {
            TemplateError::InvalidSpec(format!(
                "image user {u:?} is not in the image's /etc/passwd"
            ))
        })?,
    };
    let command = c.command();
    Ok(agentenv_envd::InitRequest {
        env_vars: (!env.is_empty()).then_some(env),
        default_user: Some(user),
        default_workdir: c.working_dir.clone(),
        start: (!command.is_empty()).then_some(command),
        ..Default::default()
    })
}

/// `u` (a name or a uid) as a user name from `tree`'s /etc/passwd.
fn user_name(tree: &Path, u: &str) -> Option<String> {
    let passwd = std::fs::read_to_string(tree.join("etc/passwd")).ok()?;
    passwd.lines().find_map(|l| {
        let mut f = l.split(':');
        let (name, _, uid) = (f.next()?, f.next()?, f.next()?);
        (name == u || uid == u).then(|| name.to_owned())
    })
}

/// Bytes of file data under `dir` (not following links).
fn dir_bytes(dir: &Path) -> u64 {
    let mut total = 0;
    let mut stack = vec![dir.to_owned()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            match e.metadata() {
                Ok(m) if m.is_dir() => stack.push(e.path()),
                Ok(m) => total += m.len(),
                Err(_) => {}
            }
        }
    }
    total
}

#[cfg(test)]
#[path = "template_pull_tests.rs"]
mod pull_progress_tests;
