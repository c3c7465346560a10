//! The sandbox egress proxy. The runtime redirects two kinds of guest connections to it: those to
//! the sandbox domain (its resolver answers those names with the guest's gateway), which the proxy
//! serves through the server's own data plane (the hairpin), and those to the addresses of names a
//! transform rule (E2B's `network.rules`) names. A connection whose name has a rule, or that goes
//! to the sandbox domain, is intercepted: TLS ends here under a leaf of the server's [`Ca`] (which
//! the guest trusts), each request gets the rule's headers and goes on to its destination; any
//! other is spliced through unchanged.

pub mod ca;
pub mod hello;
mod proxy;

use std::path::PathBuf;

pub use ca::Ca;
pub use proxy::{Dialer, Flow, Hairpin, Proxy};

/// Errors of the egress proxy.
#[derive(Debug, thiserror::Error)]
pub enum EgressError {
    /// A certificate could not be made.
    #[error("certificate: {0}")]
    Cert(String),
    /// A TLS setting or handshake failed.
    #[error("tls: {0}")]
    Tls(String),
    /// A file of the CA.
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    /// The connection's first bytes did not come within the deadline.
    #[error("no request within {0:?}")]
    Slow(std::time::Duration),
    /// The policy does not let the connection out, or it names nothing this proxy serves.
    #[error("refused: {0}")]
    Refused(String),
    /// The guest or the destination failed.
    #[error("{what}: {source}")]
    Net {
        what: &'static str,
        source: std::io::Error,
    },
    /// HTTP between the guest and the destination failed.
    #[error("http: {0}")]
    Http(#[from] hyper::Error),
}

impl EgressError {
    fn cert(e: rcgen::Error) -> EgressError {
        EgressError::Cert(e.to_string())
    }
    fn net(what: &'static str) -> impl FnOnce(std::io::Error) -> EgressError {
        move |source| EgressError::Net { what, source }
    }
}

#[cfg(test)]
mod tests;
