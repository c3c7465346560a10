//! Unit tests of the image pull's progress reports (`template.rs`).

use super::*;
use agentenv_oci::PullEvent as E;

/// Pull events become byte counts over all layers: monotone, at most one report per MiB of
/// download, a cached layer counted whole, and every byte once the layers are down.
#[test]
fn pull_events_add_up_to_every_layers_bytes() {
    let sizes: Vec<u64> = (0..3).map(|_| rand::random_range(1u64..8 << 20)).collect();
    let total: u64 = sizes.iter().sum();
    let digest = agentenv_oci::Digest::parse(&format!("sha256:{}", "ab".repeat(32))).unwrap();
    let mut c = PullCounter::default();
    let mut seen = vec![];
    let mut push = |c: &mut PullCounter, e: E| {
        if let Some(p) = c.update(&e) {
            assert_eq!(p.step, BuildStep::Pull);
            seen.push(p.bytes.unwrap());
        }
    };
    push(
        &mut c,
        E::Resolved {
            digest: digest.clone(),
            layer_sizes: sizes.clone(),
        },
    );
    push(
        &mut c,
        E::LayerStart {
            index: 0,
            digest: digest.clone(),
            size: sizes[0],
            cached: true,
        },
    );
    for (i, &size) in sizes.iter().enumerate().skip(1) {
        push(
            &mut c,
            E::LayerStart {
                index: i,
                digest: digest.clone(),
                size,
                cached: false,
            },
        );
        let mut done = 0;
        while done < size {
            done = (done + 4096).min(size);
            push(
                &mut c,
                E::LayerBytes {
                    index: i,
                    done,
                    total: size,
                },
            );
        }
        push(&mut c, E::LayerDownloaded { index: i });
    }
    assert!(seen.iter().all(|&(_, t)| t == total || t == 0));
    assert!(
        seen.windows(2).all(|w| w[0].0 <= w[1].0),
        "monotone: {seen:?}"
    );
    assert_eq!(seen.last().unwrap().0, total);
    assert_eq!(seen[1].0, sizes[0], "a cached layer counts whole at once");
    let downloads = (sizes[1] + sizes[2]) >> 20;
    assert!(
        seen.len() as u64 <= downloads + 8,
        "{} reports for {downloads} MiB",
        seen.len()
    );
}
