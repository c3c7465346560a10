//! The guest's FUSE volume mount and the host's channel end, both real, on this host (root and
//! `/dev/fuse`): `agentenv_guest::volume::attach` with a duplex channel whose other end is
//! `agentenv_control::volumes::channel::serve` on a temp folder, then std::fs through the mount, and
//! a reattach through the agent's `POST /volume` while an operation waits.

use std::fs;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use agentenv_control::volumes::MAX_VOLUME_BYTES;
use agentenv_control::volumes::channel::{self, VolumeDir};
use agentenv_guest::volume::{self, VolumeError};
use agentenv_guest::{Agent, AgentConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};

const TEST: &str = "a_volume_mount_serves_std_fs_through_its_host";

/// Unmounts at the end, failed or not.
struct Unmount(PathBuf);

impl Drop for Unmount {
    fn drop(&mut self) {
        volume::unmount(&self.0);
    }
}

fn random(n: usize) -> Vec<u8> {
    (0..n).map(|_| rand::random()).collect()
}

fn skip(reason: &str) {
    k3_common::require::skip_part(k3_common::require::Part::Root, TEST, reason);
}

/// The host's end of a channel to the volume folder `root`.
fn host(root: &Path, io: DuplexStream) -> impl std::future::Future<Output = ()> + use<> {
    let dir = std::sync::Arc::new(VolumeDir::open(root).unwrap());
    async move {
        let _ = channel::serve(dir, io).await;
    }
}

/// A new host for `root` on a fresh channel, attached at `mount`.
fn attach(
    rt: &tokio::runtime::Runtime,
    root: &Path,
    mount: &Path,
) -> Result<tokio::task::JoinHandle<()>, VolumeError> {
    let (guest, host_end) = tokio::io::duplex(1 << 20);
    let server = rt.spawn(host(root, host_end));
    rt.block_on(volume::attach(mount, guest))?;
    Ok(server)
}

/// `POST /volume` on a new connection of `agent`: the answer's head and the stream after it.
async fn http_attach(agent: &std::sync::Arc<Agent>, mount: &str) -> (String, DuplexStream) {
    let (mut client, server) = tokio::io::duplex(1 << 20);
    let agent = agent.clone();
    tokio::spawn(async move { agent.serve_connection(server).await });
    let head = agentenv_envd::volume::attach_request(mount);
    client.write_all(head.as_bytes()).await.unwrap();
    let mut got = Vec::new();
    while !got.ends_with(b"\r\n\r\n") {
        got.push(client.read_u8().await.unwrap());
    }
    (String::from_utf8(got).unwrap().to_lowercase(), client)
}

#[tokio::test]
async fn the_volume_route_answers_bad_attaches_before_upgrading() {
    let agent = Agent::new(AgentConfig::default());
    for bad in ["relative", "/proc/x", "/run/agentenv/v", "/a/../b"] {
        let (head, _) = http_attach(&agent, bad).await;
        assert!(head.starts_with("http/1.1 400"), "{bad}: {head}");
    }
    let (mut client, server) = tokio::io::duplex(1 << 16);
    tokio::spawn(async move { agent.serve_connection(server).await });
    let plain = "POST /volume HTTP/1.1\r\nHost: agent\r\nx-agentenv-mount: /mnt/v\r\nContent-Length: 0\r\n\r\n";
    client.write_all(plain.as_bytes()).await.unwrap();
    let mut buf = [0u8; 12];
    client.read_exact(&mut buf).await.unwrap();
    assert_eq!(&buf, b"HTTP/1.1 400");
}

#[test]
fn a_volume_mount_serves_std_fs_through_its_host() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return skip("mounting FUSE needs root");
    }
    if !Path::new("/dev/fuse").exists() {
        return skip("no /dev/fuse");
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let store = tempfile::tempdir().unwrap();
    let root = store.path().to_path_buf();
    let base = tempfile::tempdir().unwrap();
    let mount = fs::canonicalize(base.path()).unwrap().join("vol");
    let server = match attach(&rt, &root, &mount) {
        Ok(s) => s,
        Err(VolumeError::Mount { source, .. }) if source.raw_os_error() == Some(libc::EPERM) => {
            return skip(&format!("mount(2) refused: {source}"));
        }
        Err(e) => panic!("attach: {e}"),
    };
    let _unmount = Unmount(mount.clone());
    let m = |p: &str| mount.join(p);
    let h = |p: &str| root.join(p);

    // Files of several sizes, written and read back through the mount.
    for (i, n) in [0usize, 1, 4095, 4096, 100_000, 200_000, (1 << 20) + 123]
        .into_iter()
        .enumerate()
    {
        let data = random(n);
        fs::write(m(&format!("f{i}")), &data).unwrap();
        assert_eq!(fs::read(m(&format!("f{i}"))).unwrap(), data, "size {n}");
        assert_eq!(
            fs::read(h(&format!("f{i}"))).unwrap(),
            data,
            "host copy, size {n}"
        );
    }

    // Overwriting a file truncates it first (SETATTR size: no atomic O_TRUNC).
    fs::write(m("f4"), b"short").unwrap();
    assert_eq!(fs::read(m("f4")).unwrap(), b"short");
    assert_eq!(fs::read(h("f4")).unwrap(), b"short");

    // Append, then truncate down and up.
    let head = random(5000);
    let tail = random(3000);
    fs::write(m("log"), &head).unwrap();
    fs::OpenOptions::new()
        .append(true)
        .open(m("log"))
        .unwrap()
        .write_all(&tail)
        .unwrap();
    assert_eq!(fs::read(m("log")).unwrap(), [&head[..], &tail[..]].concat());
    let f = fs::OpenOptions::new().write(true).open(m("log")).unwrap();
    f.set_len(10).unwrap();
    assert_eq!(fs::read(m("log")).unwrap(), head[..10]);
    f.set_len(4096).unwrap();
    let grown = fs::read(m("log")).unwrap();
    assert_eq!((grown.len(), &grown[..10]), (4096, &head[..10]));
    assert!(grown[10..].iter().all(|&b| b == 0));
    drop(f);
    assert_eq!(fs::metadata(h("log")).unwrap().len(), 4096);

    // A folder of more entries than one host page.
    fs::create_dir(m("many")).unwrap();
    let count = 300;
    for i in 0..count {
        fs::write(m(&format!("many/e{i:04}")), i.to_string()).unwrap();
    }
    let mut names: Vec<String> = fs::read_dir(m("many"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    let want: Vec<String> = (0..count).map(|i| format!("e{i:04}")).collect();
    assert_eq!(names, want);
    assert!(fs::metadata(h("many")).unwrap().is_dir());

    // Rename a folder while a file under it and the folder itself are open.
    fs::create_dir(m("r1")).unwrap();
    fs::write(m("r1/f"), b"hello").unwrap();
    let mut held = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(m("r1/f"))
        .unwrap();
    let dir = fs::File::open(m("r1")).unwrap();
    fs::rename(m("r1"), m("r2")).unwrap();
    assert!(!m("r1").exists() && h("r2/f").exists());
    held.write_all(b"HE").unwrap();
    assert_eq!(fs::read(h("r2/f")).unwrap(), b"HEllo");
    let mut s = String::new();
    held.seek(SeekFrom::Start(0)).unwrap();
    held.read_to_string(&mut s).unwrap();
    assert_eq!(s, "HEllo");
    let via_dir = format!("/proc/self/fd/{}/f", dir.as_raw_fd());
    assert_eq!(fs::read(&via_dir).unwrap(), b"HEllo");
    fs::write(format!("/proc/self/fd/{}/g", dir.as_raw_fd()), b"new").unwrap();
    assert_eq!(fs::read(h("r2/g")).unwrap(), b"new");
    drop((held, dir));

    // Symlinks, unlink, rmdir, chmod, times, statfs.
    std::os::unix::fs::symlink("some/target", m("ln")).unwrap();
    assert_eq!(fs::read_link(m("ln")).unwrap(), Path::new("some/target"));
    assert!(
        fs::symlink_metadata(m("ln"))
            .unwrap()
            .file_type()
            .is_symlink()
    );
    assert_eq!(fs::read_link(h("ln")).unwrap(), Path::new("some/target"));
    fs::remove_file(m("ln")).unwrap();
    fs::remove_file(m("f1")).unwrap();
    assert!(fs::symlink_metadata(h("ln")).is_err() && !h("f1").exists());
    assert!(!m("f1").exists());
    let e = fs::remove_dir(m("r2")).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::ENOTEMPTY));
    fs::create_dir(m("empty")).unwrap();
    fs::remove_dir(m("empty")).unwrap();
    assert!(!h("empty").exists());
    fs::set_permissions(m("f2"), fs::Permissions::from_mode(0o604)).unwrap();
    assert_eq!(fs::metadata(m("f2")).unwrap().mode() & 0o7777, 0o604);
    assert_eq!(fs::metadata(h("f2")).unwrap().mode() & 0o7777, 0o604);
    let when = std::time::UNIX_EPOCH + Duration::from_secs(1_600_000_000);
    fs::File::options()
        .write(true)
        .open(m("f2"))
        .unwrap()
        .set_modified(when)
        .unwrap();
    assert_eq!(fs::metadata(h("f2")).unwrap().modified().unwrap(), when);
    assert_eq!(
        fs::create_dir(m("many")).unwrap_err().raw_os_error(),
        Some(libc::EEXIST)
    );
    let c = std::ffi::CString::new(mount.to_str().unwrap()).unwrap();
    // SAFETY: statvfs writes into a zeroed struct we own.
    let st = unsafe {
        let mut st: libc::statvfs = std::mem::zeroed();
        assert_eq!(libc::statvfs(c.as_ptr(), &mut st), 0);
        st
    };
    assert_eq!((st.f_bsize, st.f_blocks), (4096, MAX_VOLUME_BYTES / 4096));

    // Reattach: the channel dies, an operation waits, a new channel comes and the op completes.
    server.abort();
    let _ = rt.block_on(server);
    let mp = mount.clone();
    let op = std::thread::spawn(move || fs::write(mp.join("after"), b"reattached"));
    std::thread::sleep(Duration::from_millis(500));
    assert!(!op.is_finished(), "the operation waits for a channel");
    // This attach goes through the agent's HTTP route, as the host's does.
    let agent = Agent::new(AgentConfig::default());
    let (head, channel) = rt.block_on(http_attach(&agent, mount.to_str().unwrap()));
    assert!(head.starts_with("http/1.1 101"), "{head}");
    assert!(head.contains("upgrade: agentenv-volume\r\n"), "{head}");
    rt.spawn(host(&root, channel));
    op.join().unwrap().unwrap();
    assert_eq!(fs::read(h("after")).unwrap(), b"reattached");
    assert_eq!(fs::read(m("after")).unwrap(), b"reattached");
}
