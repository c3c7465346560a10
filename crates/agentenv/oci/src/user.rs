//! The image config's `User` (`name`, `uid`, `name:group`, `uid:gid`, ...) resolved against the image's
//! own `/etc/passwd` and `/etc/group`, as runc does.

use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use crate::error::OciError;

/// uid, gid and supplementary groups of a resolved `User`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UserIds {
    /// User id.
    pub uid: u32,
    /// Primary group id.
    pub gid: u32,
    /// User name when the image's passwd knows it.
    pub name: Option<String>,
    /// Home directory from passwd (`/` when unknown).
    pub home: String,
}

/// Resolves `user` in `rootfs`. An empty user is root. A numeric uid missing from passwd is allowed
/// (gid 0 unless given); a name must exist. Files are read without following a final symlink, and
/// `etc` must be a real directory, so a hostile image cannot make us read host files.
pub fn resolve_user(rootfs: &Path, user: &str) -> Result<UserIds, OciError> {
    let bad = |reason: String| OciError::UnknownUser {
        user: user.to_owned(),
        reason,
    };
    let (u, g) = match user.split_once(':') {
        Some((u, g)) => (u, Some(g)),
        None => (user, None),
    };
    let passwd = read_etc(rootfs, "passwd")?;
    let entry = passwd
        .lines()
        .map(|l| l.split(':').collect::<Vec<_>>())
        .filter(|f| f.len() >= 7)
        .find(|f| match u.parse::<u32>() {
            Ok(n) => f[2].parse::<u32>() == Ok(n),
            Err(_) => f[0] == u,
        });
    let (uid, mut gid, name, home) = match (u, u.parse::<u32>(), entry) {
        ("", _, _) => (0, 0, Some("root".to_owned()), "/root".to_owned()),
        (_, _, Some(f)) => {
            let uid = f[2]
                .parse()
                .map_err(|_| bad(format!("bad uid in passwd: {:?}", f[2])))?;
            let gid = f[3]
                .parse()
                .map_err(|_| bad(format!("bad gid in passwd: {:?}", f[3])))?;
            (uid, gid, Some(f[0].to_owned()), f[5].to_owned())
        }
        (_, Ok(n), None) => (n, 0, None, "/".to_owned()),
        (_, Err(_), None) => return Err(bad("no such user in the image's /etc/passwd".into())),
    };
    if let Some(g) = g {
        gid = match g.parse::<u32>() {
            Ok(n) => n,
            Err(_) => {
                let group = read_etc(rootfs, "group")?;
                group
                    .lines()
                    .map(|l| l.split(':').collect::<Vec<_>>())
                    .find(|f| f.len() >= 3 && f[0] == g)
                    .and_then(|f| f[2].parse().ok())
                    .ok_or_else(|| bad(format!("no group {g:?} in the image's /etc/group")))?
            }
        };
    }
    Ok(UserIds {
        uid,
        gid,
        name,
        home,
    })
}

/// `rootfs/etc/<name>` if it is a regular file in a real `etc` directory; empty otherwise.
fn read_etc(rootfs: &Path, name: &str) -> Result<String, OciError> {
    let etc = rootfs.join("etc");
    match std::fs::symlink_metadata(&etc) {
        Ok(m) if m.is_dir() => {}
        _ => return Ok(String::new()),
    }
    let path = etc.join(name);
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&path);
    let mut f = match f {
        Ok(f) => f,
        Err(_) => return Ok(String::new()),
    };
    let mut s = String::new();
    f.by_ref()
        .take(4 << 20)
        .read_to_string(&mut s)
        .map_err(crate::error::io("read", &path))?;
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn users_and_groups() {
        let t = tempfile::tempdir().unwrap();
        let etc = t.path().join("etc");
        std::fs::create_dir(&etc).unwrap();
        std::fs::write(
            etc.join("passwd"),
            "root:x:0:0:root:/root:/bin/sh\napp:x:1000:1001:App:/home/app:/bin/sh\n",
        )
        .unwrap();
        std::fs::write(
            etc.join("group"),
            "root:x:0:\napp:x:1001:\nstaff:x:50:app\n",
        )
        .unwrap();
        let r = |u: &str| resolve_user(t.path(), u);
        assert_eq!(r("").unwrap().uid, 0);
        let app = r("app").unwrap();
        assert_eq!(
            (app.uid, app.gid, app.home.as_str()),
            (1000, 1001, "/home/app")
        );
        assert_eq!(r("1000").unwrap().name.as_deref(), Some("app"));
        assert_eq!(
            (r("app:staff").unwrap().gid, r("1000:7").unwrap().gid),
            (50, 7)
        );
        assert_eq!((r("4242").unwrap().uid, r("4242").unwrap().gid), (4242, 0));
        assert!(matches!(r("nobody"), Err(OciError::UnknownUser { .. })));
        assert!(matches!(
            r("app:nogroup"),
            Err(OciError::UnknownUser { .. })
        ));
        // A passwd that is a symlink (to the host's) is not read.
        std::fs::remove_file(etc.join("passwd")).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", etc.join("passwd")).unwrap();
        assert!(matches!(r("root"), Err(OciError::UnknownUser { .. })));
    }
}
