//! Sparse copies between open files: only the data extents (`SEEK_DATA`/`SEEK_HOLE`), with
//! `copy_file_range` where the filesystems allow it, else positioned reads and writes. A leaf: used by
//! [`crate::fsops`] and by the VM launcher's memfds.

use std::os::fd::AsRawFd;

/// [`crate::fsops::sparse_copy`] between open files (`to` empty, written at the same offsets, set to `from`'s length).
pub fn copy_files(from: &std::fs::File, to: &std::fs::File) -> std::io::Result<u64> {
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
                let n = copy_range(from, to, off_in as u64, want.min(1 << 20))?;
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
