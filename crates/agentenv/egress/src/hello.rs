//! The first bytes of a guest's connection: a TLS ClientHello (its SNI) or an HTTP request head (its
//! `Host`), read in full but no further, and replayed to whatever handles the connection.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};

/// Most bytes read before a connection is classified.
pub const MAX_HELLO: usize = 16 * 1024 + 5;

/// What a connection starts with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Hello {
    /// A TLS ClientHello, with its server name.
    Tls { sni: Option<String> },
    /// An HTTP/1 request head, with its `Host` (no port).
    Http { host: Option<String> },
    /// Anything else.
    Other,
}

impl Hello {
    /// The host name the client asked for.
    pub fn name(&self) -> Option<&str> {
        match self {
            Hello::Tls { sni } => sni.as_deref(),
            Hello::Http { host } => host.as_deref(),
            Hello::Other => None,
        }
    }
}

/// Reads until the first bytes classify; returns them and what they are. A peer that closes
/// first gives what it sent, classified as far as it goes.
pub async fn read_hello<S: AsyncRead + Unpin>(s: &mut S) -> io::Result<(Vec<u8>, Hello)> {
    let mut buf = Vec::with_capacity(1024);
    loop {
        if let Some(h) = classify(&buf) {
            return Ok((buf, h));
        }
        if buf.len() >= MAX_HELLO {
            return Ok((buf, Hello::Other));
        }
        let mut chunk = [0u8; 2048];
        let want = chunk.len().min(MAX_HELLO - buf.len());
        let n = s.read(&mut chunk[..want]).await?;
        if n == 0 {
            return Ok((buf, Hello::Other));
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// `Some` once `buf` is complete enough to say what it is.
pub fn classify(buf: &[u8]) -> Option<Hello> {
    let first = *buf.first()?;
    if first == 0x16 {
        if buf.len() < 5 {
            return None;
        }
        let len = u16::from_be_bytes([buf[3], buf[4]]) as usize;
        let body = buf.get(5..5 + len)?;
        return Some(Hello::Tls { sni: sni(body) });
    }
    if !first.is_ascii_uppercase() {
        return Some(Hello::Other);
    }
    let end = buf.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = std::str::from_utf8(&buf[..end]).ok();
    let host = head.and_then(|h| {
        h.split("\r\n").skip(1).find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.trim()
                .eq_ignore_ascii_case("host")
                .then(|| host_only(v.trim()))
        })
    });
    Some(Hello::Http { host })
}

/// `name` of `name:port`, lower case.
fn host_only(v: &str) -> String {
    let h = match v.rsplit_once(':') {
        Some((h, p)) if p.bytes().all(|b| b.is_ascii_digit()) => h,
        _ => v,
    };
    h.to_ascii_lowercase()
}

/// The server name of a ClientHello handshake message (the record's body).
fn sni(hs: &[u8]) -> Option<String> {
    let mut r = Reader(hs);
    if r.u8()? != 1 {
        return None;
    }
    r.take(3)?; // handshake length
    r.take(2 + 32)?; // version, random
    let n = r.u8()? as usize;
    r.take(n)?; // session id
    let n = r.u16()? as usize;
    r.take(n)?; // cipher suites
    let n = r.u8()? as usize;
    r.take(n)?; // compression
    let n = r.u16()? as usize;
    let mut ext = Reader(r.take(n)?);
    while let (Some(kind), Some(len)) = (ext.u16(), ext.u16()) {
        let data = ext.take(len as usize)?;
        if kind != 0 {
            continue;
        }
        let mut d = Reader(data);
        let n = d.u16()? as usize;
        let mut list = Reader(d.take(n)?);
        while let Some(t) = list.u8() {
            let n = list.u16()? as usize;
            let name = list.take(n)?;
            if t == 0 {
                let s = std::str::from_utf8(name).ok()?;
                return Some(s.trim_end_matches('.').to_ascii_lowercase());
            }
        }
    }
    None
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Some(a)
    }
    fn u8(&mut self) -> Option<u8> {
        self.take(1).map(|b| b[0])
    }
    fn u16(&mut self) -> Option<u16> {
        self.take(2).map(|b| u16::from_be_bytes([b[0], b[1]]))
    }
}

/// A stream whose reads give `head` first.
pub struct Replay<S> {
    head: Vec<u8>,
    pos: usize,
    inner: S,
}

impl<S> Replay<S> {
    pub fn new(head: Vec<u8>, inner: S) -> Replay<S> {
        Replay {
            head,
            pos: 0,
            inner,
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Replay<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.pos < self.head.len() {
            let n = buf.remaining().min(self.head.len() - self.pos);
            let start = self.pos;
            buf.put_slice(&self.head[start..start + n]);
            self.pos += n;
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Replay<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}
