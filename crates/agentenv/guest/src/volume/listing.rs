//! READDIR: a folder's entries as `fuse_dirent`s, paged through the host's `List`. Kernel offset 0
//! is `.`, 1 is `..`, `2 + i` the host's `i`-th entry (sorted by name); each dirent's `off` is the
//! offset of the next one, so a READDIR at any offset resumes where the last one stopped.

use agentenv_envd::volume::{Entry, MAX_ENTRIES};

use super::fuse;
use super::nodes;

/// One listing page of an open folder.
#[derive(Debug, Default)]
pub struct DirPage {
    path: String,
    start: u64,
    entries: Vec<Entry>,
    /// The page is the folder's last.
    end: bool,
}

impl DirPage {
    /// The folder's `idx`-th entry, from this page or from a new one `list(idx)` gives.
    fn entry(
        &mut self,
        path: &str,
        idx: u64,
        list: &mut impl FnMut(u64) -> Result<Vec<Entry>, i32>,
    ) -> Result<Option<Entry>, i32> {
        let holds = |p: &DirPage| {
            idx.checked_sub(p.start)
                .is_some_and(|i| i < p.entries.len() as u64)
        };
        let past_end = self.end && idx >= self.start;
        if self.path != path || !(holds(self) || past_end) {
            let entries = list(idx)?;
            if entries.len() > MAX_ENTRIES {
                return Err(libc::EIO);
            }
            *self = DirPage {
                path: path.to_string(),
                start: idx,
                end: entries.len() < MAX_ENTRIES,
                entries,
            };
        }
        let i = idx.saturating_sub(self.start);
        Ok(usize::try_from(i)
            .ok()
            .and_then(|i| self.entries.get(i))
            .cloned())
    }
}

/// The dirents of folder `node` at `path` from kernel offset `offset`, at most `size` bytes. An
/// error after some entries ends the answer early instead; a host entry whose name cannot be shown
/// is skipped (its offset still counts).
pub fn dirents(
    page: &mut DirPage,
    node: u64,
    path: &str,
    offset: u64,
    size: usize,
    mut list: impl FnMut(u64) -> Result<Vec<Entry>, i32>,
) -> Result<Vec<u8>, i32> {
    let mut out = Vec::new();
    let mut off = offset;
    let dir = libc::DT_DIR as u32;
    if off == 0 {
        *page = DirPage::default(); // a rewind lists afresh
        if !fuse::push_dirent(&mut out, size, node, 1, dir, b".") {
            return Ok(out);
        }
        off = 1;
    }
    if off == 1 {
        if !fuse::push_dirent(&mut out, size, nodes::ROOT, 2, dir, b"..") {
            return Ok(out);
        }
        off = 2;
    }
    loop {
        let Some(next) = off.checked_add(1) else {
            return Ok(out);
        };
        let e = match page.entry(path, off - 2, &mut list) {
            Ok(Some(e)) => e,
            Ok(None) => return Ok(out),
            Err(e) if out.is_empty() => return Err(e),
            Err(_) => return Ok(out),
        };
        if nodes::name(e.name.as_bytes()).is_ok() {
            let typ = fuse::dirent_type(e.attr.kind);
            if !fuse::push_dirent(&mut out, size, e.attr.ino, next, typ, e.name.as_bytes()) {
                return Ok(out);
            }
        }
        off = next;
    }
}
