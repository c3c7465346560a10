//! File operations on VM images: sparse copies of RAM files, hard links, qcow2 overlays.

use std::path::Path;

/// Copies only the data of `src` into a new `dst` of the same length: holes and all-zero pages stay
/// holes ([`crate::sparse::copy_files`]). Returns the bytes written.
pub fn sparse_copy(src: &Path, dst: &Path) -> std::io::Result<u64> {
    let from = std::fs::File::open(src)?;
    let to = std::fs::OpenOptions::new()
        .create(true)
        .write(true)
        .truncate(true)
        .open(dst)?;
    crate::sparse::copy_files(&from, &to)
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

/// `qcow2` or `raw`, told apart by the file's magic (a lazy disk is raw).
fn image_format(path: &Path) -> std::io::Result<&'static str> {
    if crate::vmm::lazy::marker(path).is_some() {
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

/// Creates a qcow2 overlay `overlay` backed by `base` (a raw image or a qcow2 file), written directly
/// (what `qemu-img create -f qcow2 -F <fmt> -b <base>` makes, without a process on a create's path).
pub async fn create_overlay(base: &Path, overlay: &Path) -> std::io::Result<()> {
    let (base, overlay) = (base.to_owned(), overlay.to_owned());
    tokio::task::spawn_blocking(move || write_overlay(&base, &overlay))
        .await
        .map_err(std::io::Error::other)?
}

const QCOW2_CLUSTER_BITS: u32 = 16;
const QCOW2_HEADER_LEN: usize = 104;
const QCOW2_EXT_BACKING_FORMAT: u32 = 0xE279_2ACA;
/// Longest backing file name QEMU accepts.
const QCOW2_MAX_BACKING_NAME: usize = 1023;

/// The virtual size of image `path`: a lazy disk's recorded length, a raw file's length, or a qcow2
/// header's size field (the backing chain is never opened, so a chain ending in a lazy disk is fine).
fn virtual_size(path: &Path, format: &str) -> std::io::Result<u64> {
    if let Some(m) = crate::vmm::lazy::marker(path) {
        return Ok(m.len);
    }
    if format == "raw" {
        return Ok(std::fs::metadata(path)?.len());
    }
    let mut head = [0u8; 32];
    use std::io::Read;
    std::fs::File::open(path)?.read_exact(&mut head)?;
    Ok(u64::from_be_bytes(
        head[24..32].try_into().expect("8 bytes"),
    ))
}

/// The bytes of an empty qcow2 v3 image of `size` bytes backed by `backing` (format `format`): header
/// and extensions in cluster 0, the refcount table in cluster 1, its one block in cluster 2, the L1
/// table in cluster 3.
fn overlay_bytes(size: u64, backing: &[u8], format: &str) -> std::io::Result<Vec<u8>> {
    let cluster = 1u64 << QCOW2_CLUSTER_BITS;
    let per_l1 = cluster * (cluster / 8);
    let l1_size = size.div_ceil(per_l1);
    if backing.is_empty() || backing.len() > QCOW2_MAX_BACKING_NAME || l1_size * 8 > cluster {
        return Err(std::io::Error::other(format!(
            "no qcow2 overlay for a {size}-byte image with a {}-byte backing name",
            backing.len()
        )));
    }
    let mut ext = Vec::new();
    let fmt = format.as_bytes();
    ext.extend(QCOW2_EXT_BACKING_FORMAT.to_be_bytes());
    ext.extend((fmt.len() as u32).to_be_bytes());
    ext.extend(fmt);
    ext.resize(ext.len().next_multiple_of(8), 0);
    ext.extend([0u8; 8]); // end of extensions
    let backing_offset = (QCOW2_HEADER_LEN + ext.len()) as u64;
    let mut out = vec![0u8; 4 * cluster as usize];
    let mut h = Vec::with_capacity(QCOW2_HEADER_LEN);
    h.extend(b"QFI\xfb");
    h.extend(3u32.to_be_bytes()); // version
    h.extend(backing_offset.to_be_bytes());
    h.extend((backing.len() as u32).to_be_bytes());
    h.extend(QCOW2_CLUSTER_BITS.to_be_bytes());
    h.extend(size.to_be_bytes());
    h.extend(0u32.to_be_bytes()); // no encryption
    h.extend((l1_size as u32).to_be_bytes());
    h.extend((3 * cluster).to_be_bytes()); // L1 table
    h.extend(cluster.to_be_bytes()); // refcount table
    h.extend(1u32.to_be_bytes()); // refcount table clusters
    h.extend(0u32.to_be_bytes()); // snapshots
    h.extend(0u64.to_be_bytes()); // snapshots offset
    h.extend([0u8; 24]); // incompatible, compatible, autoclear features
    h.extend(4u32.to_be_bytes()); // 16-bit refcounts
    h.extend((QCOW2_HEADER_LEN as u32).to_be_bytes());
    debug_assert_eq!(h.len(), QCOW2_HEADER_LEN);
    out[..h.len()].copy_from_slice(&h);
    out[h.len()..h.len() + ext.len()].copy_from_slice(&ext);
    let b = backing_offset as usize;
    out[b..b + backing.len()].copy_from_slice(backing);
    let c = cluster as usize;
    out[c..c + 8].copy_from_slice(&(2 * cluster).to_be_bytes());
    for i in 0..4 {
        out[2 * c + 2 * i..2 * c + 2 * i + 2].copy_from_slice(&1u16.to_be_bytes());
    }
    Ok(out)
}

/// [`create_overlay`] on the calling thread.
pub(crate) fn write_overlay(base: &Path, overlay: &Path) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let format = image_format(base)?;
    let size = virtual_size(base, format)?;
    let bytes = overlay_bytes(size, base.as_os_str().as_bytes(), format)?;
    let mut f = std::fs::OpenOptions::new()
        .create_new(true)
        .write(true)
        .open(overlay)?;
    use std::io::Write;
    f.write_all(&bytes)
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

    fn qemu_tool(name: &str, args: &[&str]) -> Option<std::process::Output> {
        std::process::Command::new(name).args(args).output().ok()
    }

    /// Our overlays pass `qemu-img check`, name their backing file and format, read the base's data
    /// through, and keep writes to themselves (real `qemu-img` and `qemu-io`).
    #[tokio::test]
    async fn overlays_are_valid_qcow2_images_on_raw_and_qcow2_bases() {
        if qemu_tool("qemu-img", &["--version"]).is_none_or(|o| !o.status.success()) {
            k3_common::require::skip_part(
                k3_common::require::Part::Qemu,
                "overlays_are_valid_qcow2_images_on_raw_and_qcow2_bases",
                "qemu-img is not installed",
            );
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let raw = dir.path().join("base.raw");
        let size = (rand::random_range(1u64..3000) << 20) + 512 * rand::random_range(0u64..100);
        let mut f = std::fs::File::create(&raw).unwrap();
        f.set_len(size).unwrap();
        let off = rand::random_range(0..size / 4096 - 1) * 4096;
        let byte: u8 = rand::random_range(1..=255);
        f.seek(SeekFrom::Start(off)).unwrap();
        f.write_all(&[byte; 4096]).unwrap();
        drop(f);
        let mid = dir.path().join("mid.qcow2");
        create_overlay(&raw, &mid).await.unwrap();
        let top = dir.path().join("top.qcow2");
        create_overlay(&mid, &top).await.unwrap();
        assert!(
            create_overlay(&raw, &top).await.is_err(),
            "an existing file is kept"
        );
        for (img, backing, fmt) in [(&mid, &raw, "raw"), (&top, &mid, "qcow2")] {
            let check = qemu_tool("qemu-img", &["check", img.to_str().unwrap()]).unwrap();
            assert!(
                check.status.success(),
                "{}",
                String::from_utf8_lossy(&check.stdout)
            );
            let info = qemu_tool(
                "qemu-img",
                &["info", "--output=json", img.to_str().unwrap()],
            )
            .unwrap();
            let v: serde_json::Value = serde_json::from_slice(&info.stdout).unwrap();
            assert_eq!(v["format"], "qcow2");
            assert_eq!(v["virtual-size"], size);
            assert_eq!(v["backing-filename"], backing.to_str().unwrap());
            assert_eq!(v["backing-filename-format"], fmt);
        }
        let top_s = top.to_str().unwrap();
        let read = |pattern: u8, at: u64| {
            let cmd = format!("read -P {pattern} {at} 4k");
            qemu_tool("qemu-io", &["-f", "qcow2", "-c", &cmd, top_s]).unwrap()
        };
        let r = read(byte, off);
        assert!(
            r.status.success()
                && !String::from_utf8_lossy(&r.stdout).contains("Pattern verification failed"),
            "{}",
            String::from_utf8_lossy(&r.stdout)
        );
        let w = qemu_tool(
            "qemu-io",
            &["-f", "qcow2", "-c", &format!("write -P 7 {off} 4k"), top_s],
        )
        .unwrap();
        assert!(w.status.success());
        assert!(!String::from_utf8_lossy(&read(7, off).stdout).contains("failed"));
        let check = qemu_tool("qemu-img", &["check", top_s]).unwrap();
        assert!(
            check.status.success(),
            "{}",
            String::from_utf8_lossy(&check.stdout)
        );
        let mut base_now = vec![0u8; 4096];
        use std::os::unix::fs::FileExt;
        std::fs::File::open(&raw)
            .unwrap()
            .read_exact_at(&mut base_now, off)
            .unwrap();
        assert_eq!(base_now, vec![byte; 4096], "the base is untouched");
    }

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
