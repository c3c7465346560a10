//! Helpers shared by the registry test binaries.
#![allow(dead_code)]

use agentenv_oci::manifest::RunConfig;
use agentenv_oci::testing::{LayerBuilder, TestImage, TestRegistry};
use agentenv_oci::{Compression, Platform, PullOptions};

pub fn opts(reg: &TestRegistry) -> PullOptions {
    PullOptions {
        registry: reg.options(),
        ..PullOptions::default()
    }
}

/// A one-layer image whose file `arch` names its architecture.
pub fn arch_image(arch: &str, variant: Option<&str>) -> (TestImage, Platform) {
    let p = Platform {
        architecture: arch.into(),
        os: "linux".into(),
        variant: variant.map(Into::into),
    };
    let layer = LayerBuilder::new()
        .file("arch", arch.as_bytes(), 0o644)
        .tar();
    (
        TestImage::new(RunConfig::default())
            .layer(&layer, Compression::Gzip)
            .platform(&p),
        p,
    )
}
