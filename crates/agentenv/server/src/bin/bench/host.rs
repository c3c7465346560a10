//! How fast this host backs memory touched for the first time. A snapshot's RAM copy writes that many
//! fresh pages; in a VM whose freed pages go back to its hypervisor (virtio-balloon free page
//! reporting) this rate, not the disk, bounds the copy.

use std::io::Write;
use std::time::Instant;

use k3_common::report::{Better, Figure};
use k3_common::stats;

const BLOCK: usize = 64 << 20;
const BLOCKS: usize = 16;

/// Writes a new 1 GiB file on tmpfs (`/dev/shm`) in 64 MiB blocks and reports the slowest block's
/// rate (MB/s: pages the host must back anew, once recently freed ones are used up), with the
/// fastest and overall rates as parameters; the file is removed.
pub fn fresh_memory_figure() -> anyhow::Result<Figure> {
    let path = std::path::Path::new("/dev/shm")
        .join(format!("agentenv-bench-probe-{}", std::process::id()));
    let res = write_blocks(&path);
    let _ = std::fs::remove_file(&path);
    let rates = res?;
    let total_s: f64 = rates.iter().map(|r| BLOCK as f64 / 1e6 / r).sum();
    let overall = (BLOCK * BLOCKS) as f64 / 1e6 / total_s;
    Ok(Figure::new(
        "host: first-touch memory write rate, slowest 64 MiB block of a new 1 GiB tmpfs file",
        stats::percentile(&rates, 0.0),
        "MB/s",
        Better::Higher,
    )
    .param(
        "fastest block",
        format!("{:.0} MB/s", stats::percentile(&rates, 100.0)),
    )
    .param("whole file", format!("{overall:.0} MB/s"))
    .param(
        "free page reporting (virtio-balloon)",
        if balloon_present() {
            "present"
        } else {
            "absent"
        },
    ))
}

/// The rate of each block, MB/s.
fn write_blocks(path: &std::path::Path) -> anyhow::Result<Vec<f64>> {
    let mut f = std::fs::File::create(path)?;
    let buf: Vec<u8> = (0..1 << 20).map(|i| (i % 251) as u8 + 1).collect();
    let mut rates = Vec::with_capacity(BLOCKS);
    for _ in 0..BLOCKS {
        let t = Instant::now();
        for _ in 0..BLOCK / buf.len() {
            f.write_all(&buf)?;
        }
        rates.push(BLOCK as f64 / 1e6 / t.elapsed().as_secs_f64());
    }
    Ok(rates)
}

/// Whether a virtio-balloon device is bound (it reports freed guest pages to the hypervisor).
fn balloon_present() -> bool {
    std::fs::read_dir("/sys/bus/virtio/drivers/virtio_balloon")
        .map(|d| {
            d.flatten()
                .any(|e| e.file_name().to_string_lossy().starts_with("virtio"))
        })
        .unwrap_or(false)
}
