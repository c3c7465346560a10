//! User metadata of files (envd 0.6.2): `user.e2b.<key>` extended attributes, set from an upload's
//! `X-Metadata-<key>` headers (keys lowercased) and shown in `EntryInfo.metadata`.

use std::collections::BTreeMap;
use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// Namespace of the attributes.
const PREFIX: &str = "user.e2b.";
/// Header prefix of an upload's metadata.
pub const HEADER_PREFIX: &str = "x-metadata-";
/// Most attributes read per file, and the longest value read.
const MAX_KEYS: usize = 64;
const MAX_VALUE: usize = 4096;

/// The metadata of an upload's headers: keys lowercased; `Err` names a bad key or value.
pub fn from_headers(h: &http::HeaderMap) -> Result<BTreeMap<String, String>, String> {
    let mut out = BTreeMap::new();
    for (name, value) in h {
        let Some(key) = name.as_str().strip_prefix(HEADER_PREFIX) else {
            continue;
        };
        let token = |b: u8| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b);
        if key.is_empty() || !key.bytes().all(token) {
            return Err(format!("invalid metadata key {key:?}"));
        }
        let v = value
            .to_str()
            .ok()
            .filter(|v| v.len() <= MAX_VALUE && v.bytes().all(|b| (0x20..0x7f).contains(&b)))
            .ok_or_else(|| format!("invalid metadata value for key {key:?}"))?;
        out.insert(key.to_ascii_lowercase(), v.to_string());
    }
    if out.len() > MAX_KEYS {
        return Err(format!("at most {MAX_KEYS} metadata keys"));
    }
    Ok(out)
}

fn cpath(p: &Path) -> std::io::Result<CString> {
    CString::new(p.as_os_str().as_bytes()).map_err(std::io::Error::other)
}

/// The `user.e2b.*` attribute names of `path` (not following a final symlink).
fn names(path: &Path) -> std::io::Result<Vec<String>> {
    let c = cpath(path)?;
    let mut buf = vec![0u8; 4096];
    loop {
        // SAFETY: llistxattr(2) into a buffer of the length given.
        let n = unsafe { libc::llistxattr(c.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
        if n >= 0 {
            buf.truncate(n as usize);
            break;
        }
        let e = std::io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::ERANGE) if buf.len() < 1 << 20 => buf.resize(buf.len() * 4, 0),
            Some(libc::ENOTSUP) => return Ok(vec![]),
            _ => return Err(e),
        }
    }
    Ok(buf
        .split(|b| *b == 0)
        .filter_map(|n| std::str::from_utf8(n).ok())
        .filter(|n| n.starts_with(PREFIX))
        .take(MAX_KEYS)
        .map(str::to_string)
        .collect())
}

/// The metadata of `path` (empty where the file system has none).
pub fn read(path: &Path) -> BTreeMap<String, String> {
    let Ok(c) = cpath(path) else {
        return BTreeMap::new();
    };
    let mut out = BTreeMap::new();
    for name in names(path).unwrap_or_default() {
        let Ok(cn) = CString::new(name.as_bytes()) else {
            continue;
        };
        let mut v = vec![0u8; MAX_VALUE];
        // SAFETY: lgetxattr(2) into a buffer of the length given.
        let n = unsafe { libc::lgetxattr(c.as_ptr(), cn.as_ptr(), v.as_mut_ptr().cast(), v.len()) };
        if n >= 0 {
            v.truncate(n as usize);
            out.insert(
                name[PREFIX.len()..].to_string(),
                String::from_utf8_lossy(&v).into_owned(),
            );
        }
    }
    out
}

/// Replaces the metadata of `path` with `meta` (an empty map clears it).
pub fn replace(path: &Path, meta: &BTreeMap<String, String>) -> std::io::Result<()> {
    let c = cpath(path)?;
    for name in names(path)? {
        let cn = CString::new(name).map_err(std::io::Error::other)?;
        // SAFETY: lremovexattr(2) of a NUL-terminated name.
        unsafe { libc::lremovexattr(c.as_ptr(), cn.as_ptr()) };
    }
    for (k, v) in meta {
        let cn = CString::new(format!("{PREFIX}{k}")).map_err(std::io::Error::other)?;
        // SAFETY: lsetxattr(2) of a NUL-terminated name and a value of the length given.
        let r = unsafe { libc::lsetxattr(c.as_ptr(), cn.as_ptr(), v.as_ptr().cast(), v.len(), 0) };
        if r != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_become_lowercased_metadata_and_bad_ones_are_refused() {
        let mut h = http::HeaderMap::new();
        let v = format!("v{}", rand::random::<u32>());
        h.insert("x-metadata-Owner", v.parse().unwrap());
        h.insert("content-type", "text/plain".parse().unwrap());
        let m = from_headers(&h).unwrap();
        assert_eq!(m, BTreeMap::from([("owner".to_string(), v)]));
        h.insert(
            "x-metadata-k",
            http::HeaderValue::from_bytes(b"caf\xc3\xa9").unwrap(),
        );
        assert!(from_headers(&h).is_err());
    }

    #[test]
    fn metadata_round_trips_and_is_replaced_where_xattrs_work() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("f");
        std::fs::write(&f, b"x").unwrap();
        let first = BTreeMap::from([
            ("a".to_string(), format!("{}", rand::random::<u64>())),
            ("b".to_string(), "two words".to_string()),
        ]);
        if let Err(e) = replace(&f, &first) {
            assert_eq!(e.raw_os_error(), Some(libc::ENOTSUP), "{e}");
            eprintln!("skipped: no user xattrs in the temporary folder");
            return;
        }
        assert_eq!(read(&f), first);
        let second = BTreeMap::from([("c".to_string(), "3".to_string())]);
        replace(&f, &second).unwrap();
        assert_eq!(read(&f), second, "stale keys are cleared");
        // Other attributes are left alone.
        let other = CString::new("user.other").unwrap();
        let c = cpath(&f).unwrap();
        // SAFETY: lsetxattr(2) of NUL-terminated strings.
        assert_eq!(
            unsafe { libc::lsetxattr(c.as_ptr(), other.as_ptr(), b"1".as_ptr().cast(), 1, 0) },
            0
        );
        replace(&f, &BTreeMap::new()).unwrap();
        assert!(read(&f).is_empty());
        assert!(names(&f).unwrap().is_empty());
    }
}
