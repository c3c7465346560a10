//! A minimal writer for the `newc` cpio format that the Linux kernel unpacks as an initramfs.

/// An in-memory newc archive.
#[derive(Debug, Default)]
pub struct CpioWriter {
    buf: Vec<u8>,
    ino: u32,
}

impl CpioWriter {
    pub fn new() -> Self {
        CpioWriter {
            buf: Vec::new(),
            ino: 1,
        }
    }

    fn entry(&mut self, name: &str, mode: u32, data: &[u8]) {
        let name_len = name.len() + 1;
        let header = format!(
            "070701{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}",
            self.ino,
            mode,
            0,
            0,
            1,
            0,
            data.len(),
            0,
            0,
            0,
            0,
            name_len,
            0
        );
        self.ino += 1;
        self.buf.extend_from_slice(header.as_bytes());
        self.buf.extend_from_slice(name.as_bytes());
        self.buf.push(0);
        self.pad4();
        self.buf.extend_from_slice(data);
        self.pad4();
    }

    fn pad4(&mut self) {
        while !self.buf.len().is_multiple_of(4) {
            self.buf.push(0);
        }
    }

    /// Adds a directory (no leading slash, e.g. `"bin"`).
    pub fn dir(&mut self, path: &str) -> &mut Self {
        self.entry(path, 0o040_755, &[]);
        self
    }

    /// Adds a regular file with permission bits `perm` (e.g. `0o755`).
    pub fn file(&mut self, path: &str, perm: u32, data: &[u8]) -> &mut Self {
        self.entry(path, 0o100_000 | (perm & 0o7777), data);
        self
    }

    /// Adds a symbolic link `path -> target`.
    pub fn symlink(&mut self, path: &str, target: &str) -> &mut Self {
        self.entry(path, 0o120_777, target.as_bytes());
        self
    }

    /// Appends the trailer and returns the archive bytes.
    pub fn finish(mut self) -> Vec<u8> {
        self.entry("TRAILER!!!", 0, &[]);
        while !self.buf.len().is_multiple_of(512) {
            self.buf.push(0);
        }
        self.buf
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpio_tool_lists_and_extracts_our_archive() {
        let Ok(out) = std::process::Command::new("cpio").arg("--version").output() else {
            println!("skipped: the cpio tool is not installed");
            return;
        };
        assert!(out.status.success());
        let mut w = CpioWriter::new();
        w.dir("bin")
            .file("bin/hello", 0o755, b"#!/bin/sh\necho hi\n")
            .symlink("bin/sh", "hello");
        let bytes = w.finish();
        assert_eq!(bytes.len() % 512, 0);
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
