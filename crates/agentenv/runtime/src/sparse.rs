//! Sparse copies between open files: only the data extents (`SEEK_DATA`/`SEEK_HOLE`), and in them only
//! the pages that are not all zero (a guest's RAM file holds many: its kernel's zeroed memory). The copy
//! reads the same bytes as its source; a page left out is a hole. Reads and writes go through one buffer:
//! on this kind of host, mapping the source costs more in page-table work than the copy it saves. The
//! extents and the zero test are the chunk store's, which leaves out the same. Used by [`crate::fsops`]
//! and by the VM launcher's memfds.

use std::os::unix::fs::FileExt;

use agentenv_store::{data_ranges, is_zero};

/// The unit in which zero pages are left out.
const PAGE: usize = 4096;
/// Bytes read at a time.
const BUF: usize = 1 << 20;

/// [`crate::fsops::sparse_copy`] between open files (`to` empty, written at the same offsets, set to
/// `from`'s length). Returns the bytes written.
pub fn copy_files(from: &std::fs::File, to: &std::fs::File) -> std::io::Result<u64> {
    let len = from.metadata()?.len();
    to.set_len(len)?;
    let mut buf = vec![0u8; BUF];
    let mut copied = 0u64;
    for (data, end) in data_ranges(from, len)? {
        let mut at = data;
        while at < end {
            let want = ((end - at) as usize).min(BUF);
            let n = from.read_at(&mut buf[..want], at)?;
            if n == 0 {
                break; // the source shrank: it ends here
            }
            copied += write_nonzero(to, &buf[..n], at)?;
            at += n as u64;
        }
    }
    Ok(copied)
}

/// Writes the pages of `b` (the source's bytes at `off`) that hold data; returns the bytes written.
fn write_nonzero(to: &std::fs::File, b: &[u8], off: u64) -> std::io::Result<u64> {
    let page = |i: usize| &b[i..(i + PAGE).min(b.len())];
    let (mut i, mut written) = (0, 0u64);
    while i < b.len() {
        while i < b.len() && is_zero(page(i)) {
            i += PAGE;
        }
        let start = i.min(b.len());
        while i < b.len() && !is_zero(page(i)) {
            i += PAGE;
        }
        let end = i.min(b.len());
        if end > start {
            to.write_all_at(&b[start..end], off + start as u64)?;
            written += (end - start) as u64;
        }
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    /// A file of random pages, written zero pages, holes and a partial last page; its expected bytes.
    fn source(dir: &std::path::Path) -> (std::fs::File, Vec<u8>) {
        let pages = 300 + rand::random_range(0..100);
        let len = pages * PAGE + rand::random_range(1..PAGE);
        let mut expect = vec![0u8; len];
        let f = std::fs::File::options()
            .create(true)
            .truncate(true)
            .read(true)
            .write(true)
            .open(dir.join("src"))
            .unwrap();
        f.set_len(len as u64).unwrap();
        for p in 0..=pages {
            let (at, end) = (p * PAGE, ((p + 1) * PAGE).min(len));
            match rand::random_range(0..4) {
                0 => {} // a hole
                1 => f.write_all_at(&vec![0u8; end - at], at as u64).unwrap(),
                _ => {
                    let mut page: Vec<u8> = (at..end).map(|_| rand::random()).collect();
                    if rand::random() {
                        page.iter_mut().for_each(|b| *b = 0);
                        let i = rand::random_range(0..page.len());
                        page[i] = 1 + rand::random::<u8>() % 255; // one byte set anywhere
                    }
                    f.write_all_at(&page, at as u64).unwrap();
                    expect[at..end].copy_from_slice(&page);
                }
            }
        }
        f.sync_all().unwrap();
        (f, expect)
    }

    #[test]
    fn a_copy_reads_as_its_source_and_leaves_zero_pages_out() {
        let dir = tempfile::tempdir().unwrap();
        let (src, expect) = source(dir.path());
        let data_pages = expect.chunks(PAGE).filter(|p| !is_zero(p)).count() as u64;
        let dst = std::fs::File::create(dir.path().join("dst")).unwrap();
        let written = copy_files(&src, &dst).unwrap();
        assert_eq!(std::fs::read(dir.path().join("dst")).unwrap(), expect);
        assert!(
            written <= data_pages * PAGE as u64,
            "{written} > {data_pages} pages"
        );
        assert!(written > (data_pages - 1) * PAGE as u64);
        let blocks = dst.metadata().unwrap().blocks() * 512;
        assert!(
            blocks <= (data_pages + 16) * PAGE as u64,
            "{blocks} bytes allocated for {data_pages} pages of data"
        );
    }

    #[test]
    fn a_copy_into_a_memfd_writes_from_the_mapping() {
        let dir = tempfile::tempdir().unwrap();
        let (src, expect) = source(dir.path());
        // SAFETY: a new memfd with a constant name.
        let fd = unsafe { libc::memfd_create(c"sparse-test".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: `fd` is a new fd this test owns.
        let mem = unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        copy_files(&src, &mem).unwrap();
        let mut got = vec![0xa5u8; expect.len()];
        mem.read_exact_at(&mut got, 0).unwrap();
        assert_eq!(got, expect);
    }

    #[test]
    fn an_empty_file_copies_to_an_empty_file() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::File::create(dir.path().join("src")).unwrap();
        let src = std::fs::File::open(dir.path().join("src")).unwrap();
        let dst = std::fs::File::create(dir.path().join("dst")).unwrap();
        assert_eq!(copy_files(&src, &dst).unwrap(), 0);
        assert_eq!(dst.metadata().unwrap().len(), 0);
    }
}
