//! A pulled tree becomes an ext4 image the way templates build theirs (`mkfs.ext4 -d`, no mounts),
//! keeping owners, modes, links and whiteouts.

use std::process::Command;

use agentenv_oci::testing::{TestImage, TestRegistry};
use agentenv_oci::{PullOptions, pull};

fn debugfs(img: &std::path::Path, req: &str) -> String {
    let o = Command::new("debugfs")
        .arg("-R")
        .arg(req)
        .arg(img)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "debugfs {req}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

#[test]
fn pulled_tree_makes_an_ext4_image() {
    if Command::new("mkfs.ext4").arg("-V").output().is_err()
        || Command::new("debugfs").arg("-V").output().is_err()
    {
        eprintln!(
            "skipping pulled_tree_makes_an_ext4_image: mkfs.ext4 or debugfs missing (apt-get install e2fsprogs)"
        );
        return;
    }
    let Some(reg) = TestRegistry::start_or_skip("ext4", None) else {
        return;
    };
    let image = reg.image("k3/sample:v1");
    TestImage::sample().push(&image, &reg.options()).unwrap();
    let t = tempfile::tempdir().unwrap();
    let tree = t.path().join("rootfs");
    let o = PullOptions {
        registry: reg.options(),
        ..PullOptions::default()
    };
    pull(&image, &tree, &o, &mut |_| {}).unwrap();
    let img = t.path().join("root.ext4");
    std::fs::File::create(&img).unwrap(); // mkfs.ext4 announces a file it creates itself
    let st = Command::new("mkfs.ext4")
        .args(["-q", "-F", "-L", "root", "-E", "root_owner=0:0", "-d"])
        .arg(&tree)
        .arg(&img)
        .arg("64M")
        .status()
        .unwrap();
    assert!(st.success());

    let profile = debugfs(&img, "stat /home/app/.profile");
    assert!(profile.contains("User:  1000   Group:  1000"), "{profile}");
    assert!(profile.contains("Mode:  0640"), "{profile}");
    assert!(debugfs(&img, "stat /bin/tool").contains("Mode:  04755"));
    assert_eq!(
        debugfs(&img, "cat /srv/work/README"),
        "hello from the top layer\n"
    );
    assert_eq!(
        debugfs(&img, "cat /etc/os-release"),
        "ID=k3test\nVERSION=2\n"
    );
    let doc = debugfs(&img, "ls /usr/share/doc");
    assert!(doc.contains("keep") && !doc.contains("gone"), "{doc}");
    let cache = debugfs(&img, "ls /var/cache/app");
    assert!(
        cache.contains("new") && !cache.contains("old1") && !cache.contains("sub"),
        "{cache}"
    );
    let link = debugfs(&img, "stat /bin/tool-link");
    assert!(
        link.contains("Type: symlink") && link.contains("Fast link dest: \"tool\""),
        "{link}"
    );
    let links = debugfs(&img, "stat /bin/tool");
    assert!(links.contains("Links: 2"), "hard link kept: {links}");
}
