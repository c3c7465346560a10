//! A writer for uncompressed `newc` cpio archives: the initramfs format the Linux kernel unpacks
//! (used by the KVM probe guest here and by agentenv's guest initramfs).

/// Builds a newc archive in memory.
pub struct CpioWriter {
    out: Vec<u8>,
    next_ino: u32,
}

impl Default for CpioWriter {
    fn default() -> Self {
        Self::new()
    }
}

impl CpioWriter {
    /// An empty archive.
    pub fn new() -> CpioWriter {
        CpioWriter {
            out: Vec::new(),
            next_ino: 1,
        }
    }

    /// Adds a directory.
    pub fn dir(&mut self, name: &str, perm: u32) {
        self.entry(name, 0o040000 | perm, 2, (0, 0), b"");
    }

    /// Adds a regular file.
    pub fn file(&mut self, name: &str, perm: u32, data: &[u8]) {
        self.entry(name, 0o100000 | perm, 1, (0, 0), data);
    }

    /// Adds a symbolic link to `target`.
    pub fn symlink(&mut self, name: &str, target: &str) {
        self.entry(name, 0o120777, 1, (0, 0), target.as_bytes());
    }

    /// Adds a character device node.
    pub fn char_dev(&mut self, name: &str, perm: u32, major: u32, minor: u32) {
        self.entry(name, 0o020000 | perm, 1, (major, minor), b"");
    }

    /// Appends the trailer and returns the archive.
    pub fn finish(mut self) -> Vec<u8> {
        self.header("TRAILER!!!", 0, 0, 1, 0, (0, 0));
        self.out.extend_from_slice(b"TRAILER!!!\0");
        self.pad();
        self.out
    }

    fn entry(&mut self, name: &str, mode: u32, nlink: u32, rdev: (u32, u32), data: &[u8]) {
        let ino = self.next_ino;
        self.next_ino += 1;
        self.header(name, ino, mode, nlink, data.len(), rdev);
        self.out.extend_from_slice(name.as_bytes());
        self.out.push(0);
        self.pad();
        self.out.extend_from_slice(data);
        self.pad();
    }

    fn header(
        &mut self,
        name: &str,
        ino: u32,
        mode: u32,
        nlink: u32,
        size: usize,
        rdev: (u32, u32),
    ) {
        let fields = [
            ino,
            mode,
            0,
            0,
            nlink,
            0,
            size as u32,
            0,
            0,
            rdev.0,
            rdev.1,
            name.len() as u32 + 1,
            0,
        ];
        self.out.extend_from_slice(b"070701");
        for f in fields {
            self.out.extend_from_slice(format!("{f:08x}").as_bytes());
        }
    }

    fn pad(&mut self) {
        while !self.out.len().is_multiple_of(4) {
            self.out.push(0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpio_tool_lists_and_extracts_our_archive() {
        let Ok(out) = std::process::Command::new("cpio").arg("--version").output() else {
            crate::require::skip_or_fail(crate::Tier::Cpu, "the cpio tool is not installed");
            return;
        };
        assert!(out.status.success());
        let mut w = CpioWriter::new();
        w.dir("bin", 0o755);
        w.file("bin/hello", 0o755, b"#!/bin/sh\necho hi\n");
        w.symlink("bin/sh", "hello");
        w.char_dev("console", 0o600, 5, 1);
        let bytes = w.finish();
        assert_eq!(bytes.len() % 4, 0);
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("a.cpio"), &bytes).unwrap();
        let st = std::process::Command::new("sh")
            .arg("-c")
            .arg("cpio -idm --quiet < a.cpio")
            .current_dir(dir.path())
            .status()
            .unwrap();
        assert!(st.success());
        assert_eq!(
            std::fs::read(dir.path().join("bin/hello")).unwrap(),
            b"#!/bin/sh\necho hi\n"
        );
        assert_eq!(
            std::fs::read_link(dir.path().join("bin/sh"))
                .unwrap()
                .to_str(),
            Some("hello")
        );
    }
}
