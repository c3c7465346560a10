//! Wire format: `[u32 stream_id BE][u8 kind][u32 len BE][payload]`.

use tokio::io::{AsyncBufRead, AsyncBufReadExt, AsyncRead, AsyncReadExt};

use crate::MuxError;

/// Largest payload a frame may carry; longer frames are a protocol error.
pub const MAX_PAYLOAD: usize = 64 * 1024;
/// Largest DATA payload this implementation sends.
pub const MAX_DATA_CHUNK: usize = 32 * 1024;
/// Bytes in a frame header.
pub const HEADER_LEN: usize = 9;
/// Magic at the start of every HELLO payload; lets a fresh server find a HELLO in a dirty channel.
pub const HELLO_MAGIC: [u8; 8] = *b"AENVMUX1";
/// HELLO payload: magic + 8-byte session nonce.
pub const HELLO_PAYLOAD_LEN: usize = 16;

/// Frame kinds. Zero is deliberately invalid so a zero-filled channel is rejected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// Session start/reset; payload = magic + nonce; the server echoes it back as the ack.
    Hello = 1,
    /// The client opens `stream_id`.
    Open = 2,
    /// Stream bytes; consumes the receiver's window.
    Data = 3,
    /// Sender will write no more on this stream (half-close).
    Fin = 4,
    /// Abort the stream in both directions.
    Rst = 5,
    /// Payload = u32 BE credit the receiver grants back to the sender.
    Window = 6,
}

impl Kind {
    fn from_u8(v: u8) -> Option<Kind> {
        Some(match v {
            1 => Kind::Hello,
            2 => Kind::Open,
            3 => Kind::Data,
            4 => Kind::Fin,
            5 => Kind::Rst,
            6 => Kind::Window,
            _ => return None,
        })
    }
}

/// One decoded frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    /// Stream the frame belongs to (0 for HELLO).
    pub stream_id: u32,
    /// What the frame means.
    pub kind: Kind,
    /// Payload bytes (at most [`MAX_PAYLOAD`]).
    pub payload: Vec<u8>,
}

impl Frame {
    /// A frame with an empty payload.
    pub fn empty(stream_id: u32, kind: Kind) -> Frame {
        Frame {
            stream_id,
            kind,
            payload: Vec::new(),
        }
    }

    /// A HELLO frame carrying `nonce`.
    pub fn hello(nonce: u64) -> Frame {
        let mut payload = Vec::with_capacity(HELLO_PAYLOAD_LEN);
        payload.extend_from_slice(&HELLO_MAGIC);
        payload.extend_from_slice(&nonce.to_be_bytes());
        Frame {
            stream_id: 0,
            kind: Kind::Hello,
            payload,
        }
    }

    /// A WINDOW frame granting `credit` bytes.
    pub fn window(stream_id: u32, credit: u32) -> Frame {
        Frame {
            stream_id,
            kind: Kind::Window,
            payload: credit.to_be_bytes().to_vec(),
        }
    }

    /// Appends the encoded frame to `out`.
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.stream_id.to_be_bytes());
        out.push(self.kind as u8);
        out.extend_from_slice(&(self.payload.len() as u32).to_be_bytes());
        out.extend_from_slice(&self.payload);
    }

    /// The nonce of a well-formed HELLO payload.
    pub fn hello_nonce(&self) -> Result<u64, MuxError> {
        if self.kind != Kind::Hello
            || self.stream_id != 0
            || self.payload.len() != HELLO_PAYLOAD_LEN
            || self.payload[..8] != HELLO_MAGIC
        {
            return Err(MuxError::Protocol("malformed HELLO frame".into()));
        }
        let mut n = [0u8; 8];
        n.copy_from_slice(&self.payload[8..16]);
        Ok(u64::from_be_bytes(n))
    }

    /// The credit of a well-formed WINDOW payload.
    pub fn window_credit(&self) -> Result<u32, MuxError> {
        let bytes: [u8; 4] = self.payload.as_slice().try_into().map_err(|_| {
            MuxError::Protocol(format!("WINDOW payload of {} bytes", self.payload.len()))
        })?;
        Ok(u32::from_be_bytes(bytes))
    }
}

/// Reads one frame. `Ok(None)` on clean EOF at a frame boundary.
pub async fn read_frame<R: AsyncRead + Unpin>(r: &mut R) -> Result<Option<Frame>, MuxError> {
    let mut header = [0u8; HEADER_LEN];
    let mut got = 0;
    while got < HEADER_LEN {
        let n = r.read(&mut header[got..]).await.map_err(MuxError::Io)?;
        if n == 0 {
            if got == 0 {
                return Ok(None);
            }
            return Err(MuxError::Protocol("EOF inside a frame header".into()));
        }
        got += n;
    }
    let (stream_id, kind, len) = parse_header(&header)?;
    let mut payload = vec![0u8; len];
    r.read_exact(&mut payload)
        .await
        .map_err(|e| MuxError::Protocol(format!("EOF inside a {len}-byte payload: {e}")))?;
    Ok(Some(Frame {
        stream_id,
        kind,
        payload,
    }))
}

/// Validates a header: known kind, length within [`MAX_PAYLOAD`].
pub fn parse_header(h: &[u8; HEADER_LEN]) -> Result<(u32, Kind, usize), MuxError> {
    if h.iter().all(|&b| b == 0) {
        return Err(MuxError::Restarted);
    }
    let stream_id = u32::from_be_bytes([h[0], h[1], h[2], h[3]]);
    let kind = Kind::from_u8(h[4])
        .ok_or_else(|| MuxError::Protocol(format!("unknown frame kind {}", h[4])))?;
    let len = u32::from_be_bytes([h[5], h[6], h[7], h[8]]) as usize;
    if len > MAX_PAYLOAD {
        return Err(MuxError::Protocol(format!(
            "frame of {len} bytes exceeds the {MAX_PAYLOAD}-byte cap"
        )));
    }
    Ok((stream_id, kind, len))
}

/// The bytes every HELLO frame starts with: its header and the magic.
fn hello_prefix() -> [u8; HEADER_LEN + 8] {
    let mut p = [0u8; HEADER_LEN + 8];
    p[4] = Kind::Hello as u8;
    p[5..9].copy_from_slice(&(HELLO_PAYLOAD_LEN as u32).to_be_bytes());
    p[9..].copy_from_slice(&HELLO_MAGIC);
    p
}

/// Discards bytes until a complete, well-formed HELLO frame has been read; returns its nonce.
/// Used by a fresh server session on a channel that may hold a restored peer's half-sent frames.
/// Scans whole buffers (a restored guest skips a 64 KiB preamble, and is slow per byte under TCG).
pub async fn hunt_hello<R: AsyncBufRead + Unpin>(r: &mut R) -> Result<Option<u64>, MuxError> {
    let prefix = hello_prefix();
    let finder = memchr::memmem::Finder::new(&prefix);
    // The last prefix.len() - 1 bytes already consumed: a match may straddle two buffers.
    let mut tail: Vec<u8> = Vec::with_capacity(2 * prefix.len());
    loop {
        let buf = r.fill_buf().await.map_err(MuxError::Io)?;
        if buf.is_empty() {
            return Ok(None);
        }
        let n = buf.len();
        let mut found = None;
        if !tail.is_empty() {
            let mut joined = tail.clone();
            joined.extend_from_slice(&buf[..n.min(prefix.len() - 1)]);
            found = finder
                .find(&joined)
                .map(|pos| pos + prefix.len() - tail.len());
        }
        let found = found.or_else(|| finder.find(buf).map(|pos| pos + prefix.len()));
        if let Some(end) = found {
            r.consume(end);
            let mut nonce = [0u8; 8];
            r.read_exact(&mut nonce)
                .await
                .map_err(|e| MuxError::Protocol(format!("EOF inside HELLO: {e}")))?;
            return Ok(Some(u64::from_be_bytes(nonce)));
        }
        tail.extend_from_slice(&buf[n.saturating_sub(prefix.len() - 1)..]);
        let excess = tail.len().saturating_sub(prefix.len() - 1);
        tail.drain(..excess);
        r.consume(n);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn roundtrip_random_frames() {
        let mut buf = Vec::new();
        let mut frames = Vec::new();
        for i in 0..50u32 {
            let len = rand::random_range(0..MAX_PAYLOAD);
            let payload: Vec<u8> = (0..len).map(|_| rand::random()).collect();
            let f = Frame {
                stream_id: i,
                kind: Kind::Data,
                payload,
            };
            f.encode_into(&mut buf);
            frames.push(f);
        }
        let mut r = buf.as_slice();
        for f in frames {
            assert_eq!(read_frame(&mut r).await.unwrap().unwrap(), f);
        }
        assert!(read_frame(&mut r).await.unwrap().is_none());
    }

    #[tokio::test]
    async fn rejects_oversized_and_unknown() {
        let mut h = [0u8; HEADER_LEN];
        h[4] = Kind::Data as u8;
        h[5..9].copy_from_slice(&u32::MAX.to_be_bytes());
        let mut r = &h[..];
        assert!(matches!(
            read_frame(&mut r).await,
            Err(MuxError::Protocol(_))
        ));
        let z = [0u8; HEADER_LEN];
        let mut r = &z[..];
        assert!(matches!(read_frame(&mut r).await, Err(MuxError::Restarted)));
        let mut u = [0u8; HEADER_LEN];
        u[4] = 0xEE;
        let mut r = &u[..];
        assert!(matches!(
            read_frame(&mut r).await,
            Err(MuxError::Protocol(_))
        ));
    }

    #[tokio::test]
    async fn hunt_skips_garbage() {
        let nonce: u64 = rand::random();
        let mut buf: Vec<u8> = (0..1000).map(|_| rand::random()).collect();
        Frame::hello(nonce).encode_into(&mut buf);
        Frame::empty(1, Kind::Open).encode_into(&mut buf);
        let mut r = buf.as_slice();
        assert_eq!(hunt_hello(&mut r).await.unwrap(), Some(nonce));
        assert_eq!(
            read_frame(&mut r).await.unwrap().unwrap(),
            Frame::empty(1, Kind::Open)
        );
    }

    #[tokio::test]
    async fn hunt_finds_a_hello_split_across_reads() {
        for _ in 0..50 {
            let nonce: u64 = rand::random();
            let zeros = rand::random_range(0..3 * MAX_PAYLOAD);
            let mut buf = vec![0u8; zeros];
            buf.extend((0..rand::random_range(0..40)).map(|_| rand::random::<u8>()));
            Frame::hello(nonce).encode_into(&mut buf);
            Frame::empty(7, Kind::Open).encode_into(&mut buf);
            // Buffers of 1..=32 bytes put the HELLO across boundaries at every offset.
            let cap = rand::random_range(1..=32);
            let mut r = tokio::io::BufReader::with_capacity(cap, buf.as_slice());
            assert_eq!(hunt_hello(&mut r).await.unwrap(), Some(nonce));
            assert_eq!(
                read_frame(&mut r).await.unwrap().unwrap(),
                Frame::empty(7, Kind::Open)
            );
        }
    }

    #[tokio::test]
    async fn hunt_ends_at_eof_without_a_hello() {
        let mut buf = vec![0u8; 1000];
        Frame::hello(5).encode_into(&mut buf);
        buf.truncate(buf.len() - 3);
        let mut r = buf.as_slice();
        assert!(matches!(
            hunt_hello(&mut r).await,
            Err(MuxError::Protocol(_))
        ));
        let mut r = &[0u8; 100][..];
        assert_eq!(hunt_hello(&mut r).await.unwrap(), None);
    }
}
