//! Sharing through the chunk store: snapshots and templates published to it and imported from it.

pub(crate) mod remote;
pub(crate) mod template_store;
