//! OS users: name → uid/gid/home/shell, and uid/gid → names (passwd/group database via libc).

use std::ffi::{CStr, CString};
use std::path::PathBuf;

/// An OS account processes and files run as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct User {
    /// Login name.
    pub name: String,
    /// User id.
    pub uid: u32,
    /// Primary group id.
    pub gid: u32,
    /// Home directory.
    pub home: PathBuf,
    /// Login shell.
    pub shell: String,
}

/// Looks up a user by name; `None` if the account does not exist.
pub fn lookup(name: &str) -> Option<User> {
    let cname = CString::new(name).ok()?;
    let mut buf = vec![0u8; 16 * 1024];
    // SAFETY: passwd is plain data; getpwnam_r writes only into `pw` and `buf`, whose sizes we pass.
    unsafe {
        let mut pw: libc::passwd = std::mem::zeroed();
        let mut out: *mut libc::passwd = std::ptr::null_mut();
        let rc = libc::getpwnam_r(
            cname.as_ptr(),
            &mut pw,
            buf.as_mut_ptr().cast(),
            buf.len(),
            &mut out,
        );
        if rc != 0 || out.is_null() {
            return None;
        }
        Some(User {
            name: name.to_string(),
            uid: pw.pw_uid,
            gid: pw.pw_gid,
            home: PathBuf::from(cstr(pw.pw_dir)),
            shell: cstr(pw.pw_shell),
        })
    }
}

/// Name of the user with this uid, or the number as text.
pub fn user_name(uid: u32) -> String {
    let mut buf = vec![0u8; 16 * 1024];
    // SAFETY: as in `lookup`.
    unsafe {
        let mut pw: libc::passwd = std::mem::zeroed();
        let mut out: *mut libc::passwd = std::ptr::null_mut();
        let rc = libc::getpwuid_r(uid, &mut pw, buf.as_mut_ptr().cast(), buf.len(), &mut out);
        if rc == 0 && !out.is_null() {
            return cstr(pw.pw_name);
        }
    }
    uid.to_string()
}

/// Name of the group with this gid, or the number as text.
pub fn group_name(gid: u32) -> String {
    let mut buf = vec![0u8; 16 * 1024];
    // SAFETY: group is plain data; getgrgid_r writes only into `gr` and `buf`.
    unsafe {
        let mut gr: libc::group = std::mem::zeroed();
        let mut out: *mut libc::group = std::ptr::null_mut();
        let rc = libc::getgrgid_r(gid, &mut gr, buf.as_mut_ptr().cast(), buf.len(), &mut out);
        if rc == 0 && !out.is_null() {
            return cstr(gr.gr_name);
        }
    }
    gid.to_string()
}

/// The user this agent runs as.
pub fn current() -> User {
    // SAFETY: geteuid has no preconditions.
    let uid = unsafe { libc::geteuid() };
    let name = user_name(uid);
    lookup(&name).unwrap_or_else(|| User {
        name,
        uid,
        // SAFETY: getegid has no preconditions.
        gid: unsafe { libc::getegid() },
        home: std::env::var_os("HOME")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("/")),
        shell: "/bin/sh".into(),
    })
}

/// Supplementary group ids of `user` (for setgroups before exec).
pub fn group_list(user: &User) -> Vec<u32> {
    let Ok(cname) = CString::new(user.name.as_str()) else {
        return vec![user.gid];
    };
    let mut n: libc::c_int = 64;
    loop {
        let mut groups = vec![0 as libc::gid_t; n as usize];
        let before = n;
        // SAFETY: `groups` has room for `n` entries; getgrouplist updates `n`.
        let rc =
            unsafe { libc::getgrouplist(cname.as_ptr(), user.gid, groups.as_mut_ptr(), &mut n) };
        if rc >= 0 {
            groups.truncate(n as usize);
            return groups;
        }
        if n <= before {
            return vec![user.gid];
        }
    }
}

fn cstr(p: *const libc::c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: libc returned a NUL-terminated string that lives in our buffer.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn current_user_round_trips() {
        let me = current();
        assert_eq!(user_name(me.uid), me.name);
        assert!(lookup("no-such-user-k3-guest").is_none());
    }
}
