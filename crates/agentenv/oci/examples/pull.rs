//! Pulls an image into a folder with one indicatif bar per layer (how `aenv` can show a pull).
//!
//! `cargo run -p agentenv-oci --example pull -- REF DEST [--user U --password P]`, or
//! `cargo run -p agentenv-oci --example pull -- --sample DEST` to serve the test sample from a loopback
//! `docker-registry` and pull it.

use std::collections::HashMap;

use agentenv_oci::testing::{TestImage, TestRegistry};
use agentenv_oci::{Credentials, ImageRef, PullEvent, PullOptions, pull};
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let flag = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let mut opts = PullOptions::default();
    let _registry;
    let (image, dest) = if args.first().map(String::as_str) == Some("--sample") {
        let reg = TestRegistry::start()?;
        let image = reg.image("k3/sample:v1");
        TestImage::sample().push(&image, &reg.options())?;
        opts.registry = reg.options();
        _registry = reg;
        (image, args.get(1).cloned().ok_or("usage: --sample DEST")?)
    } else {
        let r = ImageRef::parse(args.first().ok_or("usage: REF DEST")?)?;
        (r, args.get(1).cloned().ok_or("usage: REF DEST")?)
    };
    if let (Some(username), Some(password)) = (flag("--user"), flag("--password")) {
        opts.registry.credentials = Some(Credentials { username, password });
    }

    let bars = MultiProgress::new();
    let style = ProgressStyle::with_template("{prefix} {bar:30} {bytes}/{total_bytes} {msg}")?;
    let mut layer: HashMap<usize, ProgressBar> = HashMap::new();
    let pulled = pull(&image, dest.as_ref(), &opts, &mut |e| match e {
        PullEvent::Resolved {
            digest,
            layer_sizes,
        } => {
            let _ = bars.println(format!("{image} {digest}: {} layers", layer_sizes.len()));
        }
        PullEvent::LayerStart {
            index,
            digest,
            size,
            cached,
        } => {
            let b = bars.add(ProgressBar::new(*size).with_style(style.clone()));
            b.set_prefix(digest.hex()[..12].to_owned());
            if *cached {
                b.set_position(*size);
                b.set_message("cached");
            }
            layer.insert(*index, b);
        }
        PullEvent::LayerBytes { index, done, .. } => {
            if let Some(b) = layer.get(index) {
                b.set_position(*done);
            }
        }
        PullEvent::LayerDownloaded { index } | PullEvent::Applying { index } => {
            if let Some(b) = layer.get(index) {
                b.set_message("applying");
            }
        }
        PullEvent::Applied { index, entries } => {
            if let Some(b) = layer.get(index) {
                b.finish_with_message(format!("applied {entries} entries"));
            }
        }
    })?;
    println!(
        "{} into {dest}: {} bytes, command {:?}, env {:?}, user {:?}, workdir {:?}",
        pulled.digest,
        pulled.bytes,
        pulled.config.command(),
        pulled.config.env,
        pulled.config.user,
        pulled.config.working_dir
    );
    Ok(())
}
