//! The volume channel: how a guest reaches a volume mounted into it (agentenv extension).
//!
//! The host opens an agent stream and sends [`attach_request`]; the agent answers `101` and mounts
//! the volume at the asked path (FUSE) if it is not mounted yet. From then on the guest sends
//! [`Request`] frames and the host answers each with one [`Response`] frame, in order. Requests name
//! paths from the volume's root (`/a/b`), so the host keeps no state per guest and a channel lost to
//! a pause or a restore is replaced by the next attach. A frame is `[u32 len][u32 head len][head
//! JSON][data]`, little-endian, at most [`MAX_FRAME`] bytes after the first length; the data part
//! carries a write's bytes and a read's answer.

use serde::{Deserialize, Serialize};

/// Upgrade token of the attach request.
pub const UPGRADE: &str = "agentenv-volume";
/// Header of the attach request naming the mount point in the guest (an absolute path).
pub const MOUNT_HEADER: &str = "x-agentenv-mount";
/// Longest frame, after its length word.
pub const MAX_FRAME: usize = 256 << 10;
/// Most bytes one read or write moves.
pub const MAX_IO: u32 = 128 << 10;
/// Most entries of one [`Response::Entries`].
pub const MAX_ENTRIES: usize = 256;
/// Longest path in a request, in bytes.
pub const MAX_PATH: usize = 4096;

/// The attach request head (a host-only path, [`crate::paths::VOLUME`]).
pub fn attach_request(mount: &str) -> String {
    format!(
        "POST {} HTTP/1.1\r\nHost: agent\r\nConnection: Upgrade\r\nUpgrade: {UPGRADE}\r\n{MOUNT_HEADER}: {mount}\r\nContent-Length: 0\r\n\r\n",
        crate::paths::VOLUME
    )
}

/// What an entry is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Kind {
    File,
    Dir,
    Symlink,
    Other,
}

/// An entry's attributes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Attr {
    pub kind: Kind,
    /// The host's inode number (stable while the entry lives).
    pub ino: u64,
    pub size: u64,
    /// Permission bits (`0o7777` at most).
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub nlink: u32,
    /// Unix nanoseconds.
    pub atime_ns: i64,
    pub mtime_ns: i64,
    pub ctime_ns: i64,
}

/// One entry of a folder.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    pub name: String,
    pub attr: Attr,
}

/// Size and use of the volume.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Usage {
    pub total_bytes: u64,
    pub free_bytes: u64,
}

/// A guest's request. Paths start with `/`, the volume's root.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "camelCase")]
pub enum Request {
    Stat {
        path: String,
    },
    /// The folder's entries sorted by name, from the `offset`-th on, at most [`MAX_ENTRIES`].
    List {
        path: String,
        offset: u64,
    },
    Read {
        path: String,
        offset: u64,
        len: u32,
    },
    /// The bytes are the frame's data.
    Write {
        path: String,
        offset: u64,
    },
    /// A new file (an existing one is opened unless `exclusive`).
    Create {
        path: String,
        mode: u32,
        uid: u32,
        gid: u32,
        exclusive: bool,
    },
    Mkdir {
        path: String,
        mode: u32,
        uid: u32,
        gid: u32,
    },
    Symlink {
        path: String,
        target: String,
        uid: u32,
        gid: u32,
    },
    Readlink {
        path: String,
    },
    Unlink {
        path: String,
    },
    Rmdir {
        path: String,
    },
    Rename {
        from: String,
        to: String,
        /// Fail with `EEXIST` where `to` exists.
        noreplace: bool,
    },
    /// Changes what is `Some`; times in Unix nanoseconds.
    SetAttr {
        path: String,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime_ns: Option<i64>,
        mtime_ns: Option<i64>,
    },
    Fsync {
        path: String,
    },
    Usage,
}

/// The host's answer to one [`Request`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "r", content = "v", rename_all = "camelCase")]
pub enum Response {
    /// Stat, Create, Mkdir, Symlink, SetAttr.
    Attr(Attr),
    /// List; fewer than [`MAX_ENTRIES`] means the end.
    Entries(Vec<Entry>),
    /// Read: the bytes are the frame's data (fewer than asked at the end of the file).
    Data,
    /// Write: bytes written.
    Written(u32),
    Link(String),
    Usage(Usage),
    /// Unlink, Rmdir, Rename, Fsync.
    Done,
    /// A Linux errno.
    Errno(i32),
}

/// Why a frame could not be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FrameError {
    /// Longer than [`MAX_FRAME`] or shorter than its head.
    Length(usize),
    /// The head is not the JSON of the expected type.
    Head(String),
}

impl std::fmt::Display for FrameError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FrameError::Length(n) => write!(f, "volume frame of {n} bytes"),
            FrameError::Head(e) => write!(f, "volume frame head: {e}"),
        }
    }
}

impl std::error::Error for FrameError {}

/// One frame: its length word, then head and data.
pub fn encode<T: Serialize>(head: &T, data: &[u8]) -> Vec<u8> {
    let head = serde_json::to_vec(head).expect("volume frames serialise");
    let len = 4 + head.len() + data.len();
    let mut out = Vec::with_capacity(4 + len);
    out.extend_from_slice(&(len as u32).to_le_bytes());
    out.extend_from_slice(&(head.len() as u32).to_le_bytes());
    out.extend_from_slice(&head);
    out.extend_from_slice(data);
    out
}

/// The length a frame's first word announces, checked against [`MAX_FRAME`].
pub fn frame_len(word: [u8; 4]) -> Result<usize, FrameError> {
    let n = u32::from_le_bytes(word) as usize;
    if !(4..=MAX_FRAME).contains(&n) {
        return Err(FrameError::Length(n));
    }
    Ok(n)
}

/// Head and data of a frame's body (the bytes after its length word).
pub fn decode<T: for<'de> Deserialize<'de>>(body: &[u8]) -> Result<(T, &[u8]), FrameError> {
    let Some(word) = body.first_chunk::<4>() else {
        return Err(FrameError::Length(body.len()));
    };
    let n = u32::from_le_bytes(*word) as usize;
    let Some(head) = body.get(4..4 + n) else {
        return Err(FrameError::Length(body.len()));
    };
    let head = serde_json::from_slice(head).map_err(|e| FrameError::Head(e.to_string()))?;
    Ok((head, &body[4 + n..]))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip<T: Serialize + for<'de> Deserialize<'de> + PartialEq + std::fmt::Debug>(
        head: T,
        data: &[u8],
    ) {
        let f = encode(&head, data);
        let n = frame_len(f[..4].try_into().unwrap()).unwrap();
        assert_eq!(n, f.len() - 4);
        let (h, d): (T, &[u8]) = decode(&f[4..]).unwrap();
        assert_eq!((h, d), (head, data));
    }

    #[test]
    fn frames_round_trip_with_random_data() {
        for i in 0..32u64 {
            let data: Vec<u8> = (0..(i * 977) as usize)
                .map(|j| (j as u64 * 31 + i) as u8)
                .collect();
            round_trip(
                Request::Write {
                    path: format!("/d{i}/f"),
                    offset: i << 20,
                },
                &data,
            );
            round_trip(Response::Data, &data);
        }
        round_trip(Request::Usage, b"");
        round_trip(Response::Errno(2), b"");
    }

    #[test]
    fn bad_frames_are_refused() {
        assert_eq!(frame_len(0u32.to_le_bytes()), Err(FrameError::Length(0)));
        let big = (MAX_FRAME as u32 + 1).to_le_bytes();
        assert!(frame_len(big).is_err());
        assert!(decode::<Request>(&[9, 0, 0, 0, b'{']).is_err());
        let f = encode(&serde_json::json!({"op": "nope"}), b"");
        assert!(matches!(
            decode::<Request>(&f[4..]),
            Err(FrameError::Head(_))
        ));
        assert!(attach_request("/mnt/v").contains("x-agentenv-mount: /mnt/v\r\n"));
    }
}
