//! Sandbox lifecycle: create, pause, resume, kill, snapshots and forks, warm VMs, networking, and
//! recovery after a restart.

pub mod network;
pub(crate) mod pause_fs;
pub(crate) mod prepared;
pub(crate) mod recover;
pub(crate) mod sandbox;
pub mod snapshot;
pub(crate) mod source;
pub(crate) mod warm;
