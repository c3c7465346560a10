//! Dense forks (issue 31): the forks of one capture share its memory. Each maps the capture's RAM
//! copy-on-write (with uids of their own on QEMU before 8.2 through one sealed memfd), so the pages none
//! of them wrote are one copy in the host's memory: a fork's proportional share of its RAM mapping is a
//! fraction of what it has mapped.

mod common;

use agentenv_runtime::SnapshotMode;
use common::{StateDir, run, runtime, spec, token};

/// Resident and proportional KiB of the guest RAM mapping (the one of `size_kib`) of QEMU `pid`.
fn ram_mapping_kib(pid: u64, size_kib: u64) -> (u64, u64) {
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).unwrap();
    let field = |l: &str, name: &str| {
        l.strip_prefix(name)
            .and_then(|r| r.trim().strip_suffix("kB"))
            .and_then(|v| v.trim().parse::<u64>().ok())
    };
    let (mut in_ram, mut rss, mut pss) = (false, None, None);
    for l in smaps.lines() {
        if let Some(v) = field(l, "Size:") {
            if in_ram && rss.is_some() {
                break;
            }
            in_ram = v == size_kib;
        } else if in_ram && let Some(v) = field(l, "Rss:") {
            rss = Some(v);
        } else if in_ram && let Some(v) = field(l, "Pss:") {
            pss = Some(v);
        }
    }
    (rss.expect("no RAM mapping"), pss.expect("no RAM mapping"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forks_share_the_memory_of_their_capture() {
    let state = StateDir::new();
    let s = state.path();
    let rt = runtime(s).await;
    let id = format!("fk-{}", &token()[..8]);
    rt.create(spec(&id)).await.expect("create");
    // 48 MiB the capture holds and the forks only read.
    let (out, code) = run(
        &rt,
        &id,
        "head -c 50331648 /dev/urandom > /dev/shm/base && md5sum < /dev/shm/base",
    )
    .await;
    assert_eq!(code, 0, "{out}");
    rt.snapshot(&id, &format!("snap-{id}"), &[], SnapshotMode::Full)
        .await
        .expect("snapshot");
    let ids: Vec<String> = (0..3).map(|i| format!("{id}-f{i}")).collect();
    for r in rt.fork(&id, &ids).await.expect("fork") {
        r.expect("a fork");
    }
    for f in &ids {
        let (sum, _) = run(&rt, f, "md5sum < /dev/shm/base").await;
        assert_eq!(sum, out, "{f}: its memory is the capture's");
    }
    for f in &ids {
        let rec: serde_json::Value = serde_json::from_slice(
            &std::fs::read(s.join("sandboxes").join(f).join("sandbox.json")).unwrap(),
        )
        .unwrap();
        let pid = rec["phase"]["pid"].as_u64().expect("running");
        let mib = rec["machine"]["memory_mib"].as_u64().expect("memory_mib");
        let (rss, pss) = ram_mapping_kib(pid, mib << 10);
        println!("{f}: RAM mapping {rss} KiB resident, {pss} KiB proportional");
        assert!(rss >= 48 << 10, "{f}: {rss} KiB of its RAM resident");
        assert!(
            pss * 10 < rss * 6,
            "{f}: its RAM is its own ({pss} KiB proportional of {rss} KiB resident)"
        );
    }
    for f in ids.iter().chain([&id]) {
        rt.kill(f).await.expect("kill");
    }
}
