//! Unit tests of `snapshot.rs`.

use super::*;

#[test]
fn names_normalise_with_a_default_tag() {
    assert_eq!(normalize_name("app").as_deref(), Some("app:default"));
    assert_eq!(normalize_name("app:v2").as_deref(), Some("app:v2"));
    for bad in ["", ":v1", "app:", "a/b", "app:v1:v2", ".hidden", "a b"] {
        assert_eq!(normalize_name(bad), None, "{bad}");
    }
    let long = "x".repeat(65);
    assert_eq!(normalize_name(&long), None);
}

pub(crate) fn record(dir: &Path, boot: Option<&str>) -> SnapshotRecord {
    SnapshotRecord {
        version: RECORD_VERSION,
        id: "s1".into(),
        names: vec!["app:default".into()],
        source_sandbox: None,
        template_id: "base".into(),
        machine: crate::persist::MachineRecord {
            kernel: "k".into(),
            initrd: "i".into(),
            cmdline: String::new(),
            vcpus: 1,
            memory_mib: 256,
            nic: false,
            cpu: None,
            free_page_reporting: false,
        },
        disk: dir.join("disk.qcow2"),
        ram: Some(dir.join("ram.mem")),
        state: Some(dir.join("device.state")),
        parent: None,
        deleted: false,
        created_at: String::new(),
        bytes: 0,
        envd_version: String::new(),
        boot_id: boot.map(Into::into),
    }
}

/// After a host restart, an unflushed RAM copy is dropped: restored from the chunk store when it
/// holds it, else the snapshot is hidden; the same boot, or a flushed capture, keeps everything.
#[test]
fn unflushed_ram_copies_are_not_trusted_after_a_host_restart() {
    for (taken, stored, keeps_ram, hidden) in [
        (Some("boot-a"), false, true, false),
        (None, false, true, false),
        (Some("boot-old"), true, false, false),
        (Some("boot-old"), false, false, true),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let data: Vec<u8> = (0..4096).map(|_| rand::random()).collect();
        for f in ["disk.qcow2", "ram.mem", "device.state"] {
            std::fs::write(dir.join(f), &data).unwrap();
        }
        if stored {
            let s = StoredChunks {
                manifests: [("ram.mem".to_string(), "ab".repeat(32))].into(),
                ..Default::default()
            };
            std::fs::write(dir.join(CHUNKS_FILE), serde_json::to_vec(&s).unwrap()).unwrap();
        }
        let mut r = record(dir, taken);
        after_host_restart(&mut r, dir, Some("boot-a")).unwrap();
        let case = format!("{taken:?} stored={stored}");
        assert_eq!(dir.join("ram.mem").exists(), keeps_ram, "{case}");
        assert_eq!(r.deleted, hidden, "{case}");
        assert_eq!(r.ram.is_none(), hidden, "{case}");
        assert_eq!(
            std::fs::read(dir.join("disk.qcow2")).unwrap(),
            data,
            "{case}: the disk stays"
        );
        if taken.is_some_and(|b| b != "boot-a") {
            assert_eq!(r.boot_id, None, "{case}");
            let back: SnapshotRecord = persist::read(&dir.join("snapshot.json")).unwrap();
            assert_eq!(back, r, "{case}: rewritten");
        }
    }
}
