//! FUSE node ids and the volume paths they stand for, with the kernel's lookup counts. This table
//! is the whole state of a mount: it lives in the guest's memory and so survives a pause/restore.

use std::collections::HashMap;

use agentenv_envd::volume::{Kind, MAX_PATH};

/// The root's node id (the kernel's `FUSE_ROOT_ID`).
pub const ROOT: u64 = 1;

#[derive(Debug)]
struct Node {
    /// `None` once the entry is gone (unlinked, or replaced by a rename or by an entry of another kind).
    path: Option<String>,
    kind: Kind,
    /// How many entry replies the kernel holds for this node.
    lookups: u64,
}

/// Node id ↔ path, both ways.
#[derive(Debug)]
pub struct Nodes {
    by_id: HashMap<u64, Node>,
    by_path: HashMap<String, u64>,
    next: u64,
}

impl Default for Nodes {
    fn default() -> Self {
        let mut n = Nodes {
            by_id: HashMap::new(),
            by_path: HashMap::new(),
            next: ROOT + 1,
        };
        n.by_id.insert(
            ROOT,
            Node {
                path: Some("/".into()),
                kind: Kind::Dir,
                lookups: 1,
            },
        );
        n.by_path.insert("/".into(), ROOT);
        n
    }
}

/// Longest name of an entry.
pub const NAME_MAX: usize = 255;

/// A name from the kernel: UTF-8 (else `EINVAL`), at most [`NAME_MAX`] bytes (else
/// `ENAMETOOLONG`), not `.`/`..`, no `/` or NUL.
pub fn name(raw: &[u8]) -> Result<&str, i32> {
    if raw.len() > NAME_MAX {
        return Err(libc::ENAMETOOLONG);
    }
    let s = std::str::from_utf8(raw).map_err(|_| libc::EINVAL)?;
    if s.is_empty() || s == "." || s == ".." || s.contains(['/', '\0']) {
        return Err(libc::EINVAL);
    }
    Ok(s)
}

/// `dir/name`, at most [`MAX_PATH`] bytes.
pub fn join(dir: &str, name: &str) -> Result<String, i32> {
    let p = if dir == "/" {
        format!("/{name}")
    } else {
        format!("{dir}/{name}")
    };
    if p.len() > MAX_PATH {
        return Err(libc::ENAMETOOLONG);
    }
    Ok(p)
}

/// Whether `path` is `base` or below it.
pub fn is_under(path: &str, base: &str) -> bool {
    base == "/"
        || path == base
        || (path.starts_with(base) && path.as_bytes().get(base.len()) == Some(&b'/'))
}

impl Nodes {
    /// The path of a live node.
    pub fn path(&self, id: u64) -> Option<&str> {
        self.by_id.get(&id)?.path.as_deref()
    }

    /// The lookup count of a node (0: unknown).
    pub fn lookups(&self, id: u64) -> u64 {
        self.by_id.get(&id).map_or(0, |n| n.lookups)
    }

    /// Known nodes, the root included.
    pub fn len(&self) -> usize {
        self.by_id.len()
    }

    /// Whether only the root is known.
    pub fn is_empty(&self) -> bool {
        self.by_id.len() <= 1
    }

    /// The node for `path` with one more lookup: the known one, or a new id when the path is new or
    /// now holds an entry of another kind.
    pub fn lookup(&mut self, path: &str, kind: Kind) -> u64 {
        if path == "/" {
            return ROOT;
        }
        if let Some(&id) = self.by_path.get(path)
            && let Some(n) = self.by_id.get_mut(&id)
        {
            if n.kind == kind {
                n.lookups = n.lookups.saturating_add(1);
                return id;
            }
            n.path = None;
            self.by_path.remove(path);
        }
        let id = self.next;
        self.next += 1;
        self.by_id.insert(
            id,
            Node {
                path: Some(path.to_string()),
                kind,
                lookups: 1,
            },
        );
        self.by_path.insert(path.to_string(), id);
        id
    }

    /// Drops `n` lookups of a node (FORGET); a node at zero is gone. The root stays.
    pub fn forget(&mut self, id: u64, n: u64) {
        if id == ROOT {
            return;
        }
        let Some(node) = self.by_id.get_mut(&id) else {
            return;
        };
        node.lookups = node.lookups.saturating_sub(n);
        if node.lookups == 0 {
            if let Some(p) = node.path.take()
                && self.by_path.get(&p) == Some(&id)
            {
                self.by_path.remove(&p);
            }
            self.by_id.remove(&id);
        }
    }

    /// The entry at `path` and everything below it are gone (unlink, rmdir).
    pub fn detach(&mut self, path: &str) {
        if path == "/" {
            return;
        }
        let gone: Vec<String> = self
            .by_path
            .keys()
            .filter(|p| is_under(p, path))
            .cloned()
            .collect();
        for p in gone {
            if let Some(id) = self.by_path.remove(&p)
                && let Some(n) = self.by_id.get_mut(&id)
            {
                n.path = None;
            }
        }
    }

    /// `from` (and everything below it) is now at `to`: their ids move; what was at `to` is gone.
    pub fn rename(&mut self, from: &str, to: &str) {
        if from == "/" || to == "/" || from == to || is_under(to, from) {
            return;
        }
        self.detach(to);
        let moved: Vec<(String, u64)> = self
            .by_path
            .iter()
            .filter(|(p, _)| is_under(p, from))
            .map(|(p, &id)| (p.clone(), id))
            .collect();
        for (old, id) in moved {
            self.by_path.remove(&old);
            let new = format!("{to}{}", &old[from.len()..]);
            if let Some(n) = self.by_id.get_mut(&id) {
                n.path = Some(new.clone());
            }
            self.by_path.insert(new, id);
        }
    }
}
