//! File operations on VM images: sparse copies of RAM files, hard links, qcow2 overlays.

use std::os::fd::AsRawFd;
use std::path::Path;

/// Copies only the data extents of `src` into a new `dst` of the same length (holes stay holes),
/// with `SEEK_DATA`/`SEEK_HOLE` and `copy_file_range`.
pub fn sparse_copy(src: &Path, dst: &Path) -> std::io::Result<u64> {
    let from = std::fs::File::open(src)?;
    let to = std::fs::OpenOptions::new()
        .create(true)
        .write(true)
        .truncate(true)
        .open(dst)?;
    let len = from.metadata()?.len();
    to.set_len(len)?;
    let (fi, fo) = (from.as_raw_fd(), to.as_raw_fd());
    let mut pos: i64 = 0;
    let mut copied = 0u64;
    while (pos as u64) < len {
        // SAFETY: plain lseek on an owned fd.
        let data = unsafe { libc::lseek(fi, pos, libc::SEEK_DATA) };
        if data < 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::ENXIO) {
                break; // no data after pos
            }
            return Err(e);
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(fi, data, libc::SEEK_HOLE) };
        if hole < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let (mut off_in, mut off_out) = (data, data);
        while off_in < hole {
            let want = (hole - off_in) as usize;
            // SAFETY: both fds are open; the offsets are owned locals.
            let n = unsafe { libc::copy_file_range(fi, &mut off_in, fo, &mut off_out, want, 0) };
            let n = if n < 0 {
                let e = std::io::Error::last_os_error();
                if !matches!(
                    e.raw_os_error(),
                    Some(libc::EXDEV | libc::EOPNOTSUPP | libc::ENOSYS)
                ) {
                    return Err(e);
                }
                // Another filesystem (e.g. a tmpfs RAM folder): plain positioned copy.
                let n = copy_range(&from, &to, off_in as u64, want.min(1 << 20))?;
                off_in += n as i64;
                off_out += n as i64;
                n as isize
            } else {
                n
            };
            if n == 0 {
                break;
            }
            copied += n as u64;
        }
        pos = hole;
    }
    Ok(copied)
}

fn copy_range(
    from: &std::fs::File,
    to: &std::fs::File,
    off: u64,
    len: usize,
) -> std::io::Result<usize> {
    use std::os::unix::fs::FileExt;
    let mut buf = vec![0u8; len];
    let n = from.read_at(&mut buf, off)?;
    to.write_all_at(&buf[..n], off)?;
    Ok(n)
}

/// Hard-links `src` to `dst`, or copies it sparsely where a link is impossible (another filesystem).
pub fn link_or_copy(src: &Path, dst: &Path) -> std::io::Result<()> {
    let _ = std::fs::remove_file(dst);
    match std::fs::hard_link(src, dst) {
        Ok(()) => Ok(()),
        Err(_) => sparse_copy(src, dst).map(|_| ()),
    }
}

/// Bytes of data a file holds on disk (its allocated blocks), 0 when it is missing.
pub fn allocated_bytes(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).map_or(0, |m| m.blocks() * 512)
}

/// `(format, virtual size)` of `base` when it is a lazy disk or a qcow2 file whose chain ends in one.
fn lazy_base(base: &Path) -> std::io::Result<Option<(&'static str, u64)>> {
    use std::os::unix::fs::FileExt;
    if let Some(m) = crate::lazy::marker(base) {
        return Ok(Some(("raw", m.len)));
    }
    if image_format(base)? != "qcow2" {
        return Ok(None);
    }
    let chain = crate::launch::backing_chain_with(base, &|p| crate::lazy::marker(p).is_some())?;
    if !chain.iter().any(|(p, _)| crate::lazy::marker(p).is_some()) {
        return Ok(None);
    }
    let mut size = [0u8; 8];
    std::fs::File::open(base)?.read_exact_at(&mut size, 24)?;
    Ok(Some(("qcow2", u64::from_be_bytes(size))))
}

/// `qcow2` or `raw`, told apart by the file's magic (a lazy disk is raw).
fn image_format(path: &Path) -> std::io::Result<&'static str> {
    if crate::lazy::marker(path).is_some() {
        return Ok("raw");
    }
    let mut magic = [0u8; 4];
    use std::io::Read;
    let _ = std::fs::File::open(path)?.read(&mut magic)?;
    Ok(if &magic == b"QFI\xfb" { "qcow2" } else { "raw" })
}

async fn qemu_img(bin: &Path, args: &[&std::ffi::OsStr], what: &Path) -> std::io::Result<()> {
    let o = tokio::process::Command::new(bin)
        .args(args)
        .output()
        .await?;
    if !o.status.success() {
        return Err(std::io::Error::other(format!(
            "qemu-img {:?} {}: {}",
            args.first().unwrap_or(&std::ffi::OsStr::new("")),
            what.display(),
            String::from_utf8_lossy(&o.stderr).trim()
        )));
    }
    Ok(())
}

/// Creates a qcow2 overlay `overlay` backed by `base` (a raw image or a qcow2 file). A base whose chain
/// ends in a lazy disk ([`crate::lazy`]) is not opened (`-u`, its size given).
pub async fn create_overlay(
    qemu_img_bin: &Path,
    base: &Path,
    overlay: &Path,
) -> std::io::Result<()> {
    if let Some((format, len)) = lazy_base(base)? {
        let len = len.to_string();
        let args: [&std::ffi::OsStr; 11] = [
            "create".as_ref(),
            "-q".as_ref(),
            "-f".as_ref(),
            "qcow2".as_ref(),
            "-F".as_ref(),
            format.as_ref(),
            "-u".as_ref(),
            "-b".as_ref(),
            base.as_os_str(),
            overlay.as_os_str(),
            len.as_ref(),
        ];
        return qemu_img(qemu_img_bin, &args, overlay).await;
    }
    let format = image_format(base)?;
    let args: [&std::ffi::OsStr; 9] = [
        "create".as_ref(),
        "-q".as_ref(),
        "-f".as_ref(),
        "qcow2".as_ref(),
        "-F".as_ref(),
        format.as_ref(),
        "-b".as_ref(),
        base.as_os_str(),
        overlay.as_os_str(),
    ];
    qemu_img(qemu_img_bin, &args, overlay).await
}

/// Points the qcow2 `overlay` at `base` without touching its data (`qemu-img rebase -u`): the same backing
/// content at another path, as on another machine.
pub async fn rebase_unsafe(
    qemu_img_bin: &Path,
    base: &Path,
    overlay: &Path,
) -> std::io::Result<()> {
    let format = image_format(base)?;
    let args: [&std::ffi::OsStr; 7] = [
        "rebase".as_ref(),
        "-u".as_ref(),
        "-F".as_ref(),
        format.as_ref(),
        "-b".as_ref(),
        base.as_os_str(),
        overlay.as_os_str(),
    ];
    qemu_img(qemu_img_bin, &args, overlay).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Seek, SeekFrom, Write};

    #[test]
    fn sparse_copy_keeps_data_and_holes() {
        let dir = tempfile::tempdir().unwrap();
        let (src, dst) = (dir.path().join("src"), dir.path().join("dst"));
        let mut f = std::fs::File::create(&src).unwrap();
        f.set_len(64 << 20).unwrap();
        let mut expect = vec![0u8; 64 << 20];
        for _ in 0..20 {
            let off = rand::random_range(0..(64u64 << 20) - 10_000);
            let chunk: Vec<u8> = (0..9000).map(|_| rand::random::<u8>()).collect();
            f.seek(SeekFrom::Start(off)).unwrap();
            f.write_all(&chunk).unwrap();
            expect[off as usize..off as usize + chunk.len()].copy_from_slice(&chunk);
        }
        drop(f);
        let copied = sparse_copy(&src, &dst).unwrap();
        assert!(
            copied < 32 << 20,
            "copied {copied} bytes: holes were copied"
        );
        assert_eq!(std::fs::read(&dst).unwrap(), expect);
    }
}
