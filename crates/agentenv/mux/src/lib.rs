//! Stream multiplexer over one byte channel (the agentenv virtio-serial port).
//!
//! Frames are `[u32 stream_id BE][u8 kind][u32 len BE][payload]` ([`frame`]). The host is the
//! client and opens streams; the guest is the server and accepts them. Each stream has a
//! credit window ([`INITIAL_WINDOW`]) in each direction, so a slow reader stalls only its own
//! stream. A HELLO with a new nonce resets the session (every old stream is dropped): the host
//! sends one on every (re)connect, e.g. after a snapshot restore. Both ends skip bytes until
//! the first HELLO, so a channel holding half-written frames from before a restore recovers.

pub mod frame;
mod session;
mod stream;

pub use session::Session;
pub use stream::MuxStream;

/// Initial per-stream receive window in bytes, in each direction.
pub const INITIAL_WINDOW: u32 = 256 * 1024;
/// Most streams a server keeps open at once; further OPENs are answered with RST.
pub const MAX_STREAMS: usize = 4096;

/// Errors of the multiplexer.
#[derive(Debug, thiserror::Error)]
pub enum MuxError {
    /// Reading or writing the underlying channel failed.
    #[error("mux channel I/O failed: {0}")]
    Io(#[source] std::io::Error),
    /// The peer sent bytes that are not a valid frame sequence.
    #[error("mux protocol violation: {0}")]
    Protocol(String),
    /// An all-zero frame header: the peer restarted the channel (a restored VM's host sends zeros
    /// before its HELLO). A server answers by hunting for the next HELLO.
    #[error("mux channel restarted by the peer (zero frame header)")]
    Restarted,
    /// The session has ended (EOF, error, or all handles dropped).
    #[error("mux session closed: {0}")]
    Closed(String),
}
