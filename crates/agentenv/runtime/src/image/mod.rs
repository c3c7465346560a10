//! What sandboxes start from: the root filesystem and the templates built from it (booted once with
//! the VMM's guest kernel, kept as base snapshots).

pub mod rootfs;
pub mod template;
