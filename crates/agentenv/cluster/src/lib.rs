//! agentenv on many machines: the cluster's state in etcd, the placement policy and node registration.
//!
//! - [`schema`]: every key and record in etcd (nodes, claims, the sandbox-to-node map, handoffs of
//!   paused sandboxes, snapshot metadata).
//! - [`placement`]: which node a new sandbox goes to, a pure function.
//! - [`store`]: [`ClusterStore`], etcd reads and transactional writes, each under a deadline; [`map`]:
//!   its sandbox map (where each sandbox is, its state), which a node writes only for itself.
//! - [`node`]: [`Registration`], a node's lease, record and keepalives.
//! - [`watch`]: [`ViewCache`], the nodes and claims kept by a watch, for placements without reads.
//! - [`tls`]: [`EtcdTls`], etcd over mutual TLS; [`auth`]: etcd users and roles, one per node and
//!   one for the gateways, so a node writes only its own record and its own sandboxes' entries.
//! - [`node_tls`]: gateway-to-node HTTPS, each node's certificate named by its node id.
//!
//! Boundary: this crate knows etcd and the cluster's records; it knows no HTTP, no E2B JSON and no
//! VMs. The gateway (HTTP) and the node's side live in `agentenv-server`.

pub mod auth;
pub mod error;
pub mod map;
pub mod node;
pub mod node_tls;
pub mod placement;
pub mod schema;
pub mod store;
pub mod testing;
pub mod tls;
pub mod watch;

pub use error::ClusterError;
pub use node::Registration;
pub use placement::{Candidate, Choice, Demand, Pending, Unplaceable, place};
pub use schema::{
    Claim, EntryState, Handoff, Keys, MachineSize, NodeRecord, SCHEMA_VERSION, SandboxEntry,
    SnapshotEntry,
};
pub use store::{ClaimOutcome, ClusterStore, ClusterView, StateChange, Versioned};
pub use tls::EtcdTls;
pub use watch::ViewCache;
