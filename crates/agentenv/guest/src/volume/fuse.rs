//! The FUSE kernel protocol on `/dev/fuse` (`linux/fuse.h`), without libfuse: message parsing, reply
//! encoding, INIT negotiation and the blocking device loop. Every read of a kernel message is
//! bounds-checked: a short or malformed message is refused, never trusted.

use std::io::{Read, Write};

use agentenv_envd::volume::{Attr, Kind, MAX_IO, Usage};

/// Opcodes (`enum fuse_opcode`).
pub mod op {
    pub const LOOKUP: u32 = 1;
    pub const FORGET: u32 = 2;
    pub const GETATTR: u32 = 3;
    pub const SETATTR: u32 = 4;
    pub const READLINK: u32 = 5;
    pub const SYMLINK: u32 = 6;
    pub const MKNOD: u32 = 8;
    pub const MKDIR: u32 = 9;
    pub const UNLINK: u32 = 10;
    pub const RMDIR: u32 = 11;
    pub const RENAME: u32 = 12;
    pub const LINK: u32 = 13;
    pub const OPEN: u32 = 14;
    pub const READ: u32 = 15;
    pub const WRITE: u32 = 16;
    pub const STATFS: u32 = 17;
    pub const RELEASE: u32 = 18;
    pub const FSYNC: u32 = 20;
    pub const SETXATTR: u32 = 21;
    pub const GETXATTR: u32 = 22;
    pub const LISTXATTR: u32 = 23;
    pub const REMOVEXATTR: u32 = 24;
    pub const FLUSH: u32 = 25;
    pub const INIT: u32 = 26;
    pub const OPENDIR: u32 = 27;
    pub const READDIR: u32 = 28;
    pub const RELEASEDIR: u32 = 29;
    pub const FSYNCDIR: u32 = 30;
    pub const CREATE: u32 = 35;
    pub const INTERRUPT: u32 = 36;
    pub const DESTROY: u32 = 38;
    pub const BATCH_FORGET: u32 = 42;
    pub const RENAME2: u32 = 45;
}

/// `FATTR_*` bits of SETATTR's `valid`.
pub mod fattr {
    pub const MODE: u32 = 1 << 0;
    pub const UID: u32 = 1 << 1;
    pub const GID: u32 = 1 << 2;
    pub const SIZE: u32 = 1 << 3;
    pub const ATIME: u32 = 1 << 4;
    pub const MTIME: u32 = 1 << 5;
    pub const ATIME_NOW: u32 = 1 << 7;
    pub const MTIME_NOW: u32 = 1 << 8;
}

/// Protocol version we speak (7.31: no extensions after the in-header, fixed struct sizes).
pub const MAJOR: u32 = 7;
pub const MINOR: u32 = 31;
/// Oldest kernel minor served (full-size mknod/write/read structs).
const MIN_MINOR: u32 = 12;
/// INIT flags we take when offered: big writes, and the kernel dropping cached pages when a file's
/// size or mtime changes (other writers share the volume). Not `FUSE_ATOMIC_O_TRUNC`: a truncating
/// open comes as SETATTR size.
const FUSE_BIG_WRITES: u32 = 1 << 5;
const FUSE_AUTO_INVAL_DATA: u32 = 1 << 12;
const WANTED_FLAGS: u32 = FUSE_BIG_WRITES | FUSE_AUTO_INVAL_DATA;

/// `sizeof(struct fuse_in_header)`.
pub const IN_HEADER: usize = 40;
/// Device read buffer: the largest WRITE (header, `fuse_write_in`, `max_write` bytes) with room.
pub const BUF_LEN: usize = MAX_IO as usize + 8192;
/// Entry and attribute cache timeout, seconds (other writers change the volume).
pub const TTL_SECS: u64 = 1;
/// Block size reported by STATFS and in attributes.
pub const BLOCK: u64 = 4096;

/// `struct fuse_in_header`, less its padding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InHeader {
    pub opcode: u32,
    pub unique: u64,
    pub nodeid: u64,
    pub uid: u32,
    pub gid: u32,
}

/// A kernel message: its header and the bytes after it. `None` for a message shorter than a header
/// or whose length word disagrees with what was read.
pub fn parse(msg: &[u8]) -> Option<(InHeader, &[u8])> {
    let mut r = Reader(msg);
    let len = r.u32()? as usize;
    let h = InHeader {
        opcode: r.u32()?,
        unique: r.u64()?,
        nodeid: r.u64()?,
        uid: r.u32()?,
        gid: r.u32()?,
    };
    if len != msg.len() || len < IN_HEADER {
        return None;
    }
    Some((h, &msg[IN_HEADER..]))
}

/// Little cursor over a message body (native endian, as the kernel writes it).
#[derive(Debug, Clone, Copy)]
pub struct Reader<'a>(pub &'a [u8]);

impl<'a> Reader<'a> {
    pub fn bytes(&mut self, n: usize) -> Option<&'a [u8]> {
        let (head, rest) = self.0.split_at_checked(n)?;
        self.0 = rest;
        Some(head)
    }
    pub fn u32(&mut self) -> Option<u32> {
        Some(u32::from_ne_bytes(self.bytes(4)?.try_into().ok()?))
    }
    pub fn u64(&mut self) -> Option<u64> {
        Some(u64::from_ne_bytes(self.bytes(8)?.try_into().ok()?))
    }
    /// A NUL-terminated name (without its NUL).
    pub fn cstr(&mut self) -> Option<&'a [u8]> {
        let end = self.0.iter().position(|&b| b == 0)?;
        let s = self.bytes(end)?;
        self.bytes(1)?;
        Some(s)
    }
    pub fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.0)
    }
}

/// A reply message: the out-header, then `payload` (or the negative errno alone).
pub fn reply(unique: u64, r: Result<Vec<u8>, i32>) -> Vec<u8> {
    let (error, payload) = match r {
        Ok(p) => (0i32, p),
        Err(e) if (1..4096).contains(&e) => (-e, Vec::new()),
        Err(_) => (-libc::EIO, Vec::new()),
    };
    let mut out = Vec::with_capacity(16 + payload.len());
    out.extend_from_slice(&((16 + payload.len()) as u32).to_ne_bytes());
    out.extend_from_slice(&error.to_ne_bytes());
    out.extend_from_slice(&unique.to_ne_bytes());
    out.extend_from_slice(&payload);
    out
}

fn put32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_ne_bytes());
}

fn put64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_ne_bytes());
}

/// `S_IF*` of a kind; an entry that is neither file, folder nor link shows as a file.
pub fn type_bits(kind: Kind) -> u32 {
    match kind {
        Kind::Dir => libc::S_IFDIR,
        Kind::Symlink => libc::S_IFLNK,
        Kind::File | Kind::Other => libc::S_IFREG,
    }
}

/// `DT_*` of a kind, for READDIR.
pub fn dirent_type(kind: Kind) -> u32 {
    match kind {
        Kind::Dir => libc::DT_DIR as u32,
        Kind::Symlink => libc::DT_LNK as u32,
        Kind::File => libc::DT_REG as u32,
        Kind::Other => libc::DT_UNKNOWN as u32,
    }
}

/// Seconds and nanoseconds of Unix nanoseconds (negative times round down).
fn split_ns(ns: i64) -> (u64, u32) {
    (
        ns.div_euclid(1_000_000_000) as u64,
        ns.rem_euclid(1_000_000_000) as u32,
    )
}

/// `struct fuse_attr` (88 bytes).
pub fn put_attr(out: &mut Vec<u8>, a: &Attr) {
    let (at, atn) = split_ns(a.atime_ns);
    let (mt, mtn) = split_ns(a.mtime_ns);
    let (ct, ctn) = split_ns(a.ctime_ns);
    put64(out, a.ino);
    put64(out, a.size);
    put64(out, a.size.div_ceil(512));
    for v in [at, mt, ct] {
        put64(out, v);
    }
    for v in [atn, mtn, ctn] {
        put32(out, v);
    }
    put32(out, (a.mode & 0o7777) | type_bits(a.kind));
    put32(out, a.nlink.max(1));
    put32(out, a.uid);
    put32(out, a.gid);
    put32(out, 0); // rdev
    put32(out, BLOCK as u32);
    put32(out, 0); // flags
}

/// `struct fuse_entry_out` (128 bytes), generation 0.
pub fn entry_out(nodeid: u64, a: &Attr) -> Vec<u8> {
    let mut out = Vec::with_capacity(128);
    put64(&mut out, nodeid);
    put64(&mut out, 0);
    put64(&mut out, TTL_SECS);
    put64(&mut out, TTL_SECS);
    put32(&mut out, 0);
    put32(&mut out, 0);
    put_attr(&mut out, a);
    out
}

/// `struct fuse_attr_out` (104 bytes).
pub fn attr_out(a: &Attr) -> Vec<u8> {
    let mut out = Vec::with_capacity(104);
    put64(&mut out, TTL_SECS);
    put32(&mut out, 0);
    put32(&mut out, 0);
    put_attr(&mut out, a);
    out
}

/// `struct fuse_open_out` (16 bytes).
pub fn open_out(fh: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(16);
    put64(&mut out, fh);
    put32(&mut out, 0);
    put32(&mut out, 0);
    out
}

/// `struct fuse_write_out` (8 bytes).
pub fn write_out(n: u32) -> Vec<u8> {
    let mut out = Vec::with_capacity(8);
    put32(&mut out, n);
    put32(&mut out, 0);
    out
}

/// `struct fuse_statfs_out` (80 bytes) in [`BLOCK`]-byte blocks. The volume counts no inodes: a
/// large free count keeps tools that check it happy.
pub fn statfs_out(u: &Usage) -> Vec<u8> {
    let mut out = Vec::with_capacity(80);
    let free = u.free_bytes.min(u.total_bytes) / BLOCK;
    for v in [u.total_bytes / BLOCK, free, free, 1 << 32, 1 << 32] {
        put64(&mut out, v);
    }
    put32(&mut out, BLOCK as u32);
    put32(&mut out, 255); // namelen
    put32(&mut out, BLOCK as u32); // frsize
    put32(&mut out, 0);
    out.extend_from_slice(&[0; 24]);
    out
}

/// Appends one `struct fuse_dirent` (8-byte aligned) if it fits in `max` bytes in all.
pub fn push_dirent(
    out: &mut Vec<u8>,
    max: usize,
    ino: u64,
    off: u64,
    typ: u32,
    name: &[u8],
) -> bool {
    let len = (24 + name.len()).next_multiple_of(8);
    if out.len() + len > max {
        return false;
    }
    let start = out.len();
    put64(out, ino);
    put64(out, off);
    put32(out, name.len() as u32);
    put32(out, typ);
    out.extend_from_slice(name);
    out.resize(start + len, 0);
    true
}

/// The INIT answer to `body` (`struct fuse_init_in`): our version, the kernel's readahead, the
/// flags we implement, `max_write` = [`MAX_IO`].
pub fn init_reply(body: &[u8]) -> Result<Vec<u8>, i32> {
    let mut r = Reader(body);
    let (major, minor, readahead, flags) = match (r.u32(), r.u32(), r.u32(), r.u32()) {
        (Some(a), Some(b), Some(c), Some(d)) => (a, b, c, d),
        _ => return Err(libc::EINVAL),
    };
    let mut out = Vec::with_capacity(64);
    if major > MAJOR {
        // The kernel asks again with our major.
        put32(&mut out, MAJOR);
        out.resize(64, 0);
        return Ok(out);
    }
    if major < MAJOR || minor < MIN_MINOR {
        return Err(libc::EPROTO);
    }
    let minor = minor.min(MINOR);
    put32(&mut out, MAJOR);
    put32(&mut out, minor);
    put32(&mut out, readahead);
    put32(&mut out, flags & WANTED_FLAGS);
    out.extend_from_slice(&16u16.to_ne_bytes()); // max_background
    out.extend_from_slice(&12u16.to_ne_bytes()); // congestion_threshold
    put32(&mut out, MAX_IO);
    put32(&mut out, 1); // time_gran: nanoseconds
    // The rest (max_pages, map_alignment, flags2, unused) only means something with flags we do not set.
    out.resize(if minor < 23 { 24 } else { 64 }, 0);
    Ok(out)
}

/// Reads kernel messages from `dev` until the mount goes away (ENODEV) and writes the answers
/// `handle` gives (none for FORGET and the like).
pub fn serve_device(mut dev: std::fs::File, mut handle: impl FnMut(&[u8]) -> Option<Vec<u8>>) {
    let mut buf = vec![0u8; BUF_LEN];
    loop {
        let n = match dev.read(&mut buf) {
            Ok(0) => return,
            Ok(n) => n,
            Err(e) => match e.raw_os_error() {
                // Interrupted, or a request the kernel took back before we read it.
                Some(libc::EINTR | libc::EAGAIN | libc::ENOENT) => continue,
                Some(libc::ENODEV) => return,
                _ => {
                    tracing::warn!(error = %e, "reading /dev/fuse failed");
                    return;
                }
            },
        };
        let Some(out) = handle(&buf[..n]) else {
            continue;
        };
        match dev.write(&out) {
            Ok(_) => {}
            // ENOENT: the request was interrupted meanwhile.
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
            Err(e) if e.raw_os_error() == Some(libc::ENODEV) => return,
            Err(e) => tracing::warn!(error = %e, "writing a FUSE reply failed"),
        }
    }
}
