//! A read-only NBD export of one manifest on a unix socket, served chunk by chunk from the store
//! (fetching on demand), so QEMU boots a disk this node does not hold whole.
//!
//! Protocol: newstyle fixed handshake, `NBD_OPT_GO`/`INFO`/`EXPORT_NAME`/`LIST`/`ABORT` (others answered
//! `ERR_UNSUP`, so clients fall back to simple replies), then `NBD_CMD_READ`, `DISC`, `FLUSH`; writes get
//! `EPERM`.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::{UnixListener, UnixStream};

use crate::chunk::ChunkId;
use crate::error::{Result, StoreError};
use crate::manifest::Manifest;
use crate::store::ChunkStore;

const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
const IHAVEOPT: u64 = 0x4948_4156_454F_5054;
const REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
const REQUEST_MAGIC: u32 = 0x2560_9513;
const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;

const FLAG_FIXED_NEWSTYLE: u16 = 1;
const FLAG_NO_ZEROES: u16 = 2;
const TFLAGS: u16 = 1 /* HAS_FLAGS */ | 2 /* READ_ONLY */ | 4 /* SEND_FLUSH */ | (1 << 8) /* CAN_MULTI_CONN */;

const OPT_EXPORT_NAME: u32 = 1;
const OPT_ABORT: u32 = 2;
const OPT_LIST: u32 = 3;
const OPT_INFO: u32 = 6;
const OPT_GO: u32 = 7;

const REP_ACK: u32 = 1;
const REP_SERVER: u32 = 2;
const REP_INFO: u32 = 3;
const REP_ERR_UNSUP: u32 = (1 << 31) + 1;
const REP_ERR_INVALID: u32 = (1 << 31) + 3;
const REP_ERR_UNKNOWN: u32 = (1 << 31) + 6;

const INFO_EXPORT: u16 = 0;
const INFO_BLOCK_SIZE: u16 = 3;

const CMD_READ: u16 = 0;
const CMD_WRITE: u16 = 1;
const CMD_DISC: u16 = 2;
const CMD_FLUSH: u16 = 3;

const EPERM: u32 = 1;
const EIO: u32 = 5;
const EINVAL: u32 = 22;

/// Largest read request served.
const MAX_READ: u32 = 32 << 20;
/// Deadline for a client to finish the handshake.
const HANDSHAKE_DEADLINE: Duration = Duration::from_secs(10);
/// Decoded chunks kept per connection (sequential small reads hit the same chunk).
const CONN_CACHE: usize = 16;

/// A running export; stops (and removes its socket) on [`NbdServer::shutdown`] or drop.
pub struct NbdServer {
    socket: PathBuf,
    /// Device and inode of the socket it bound: only that file is removed at the end (a later export may
    /// have bound the same path meanwhile).
    inode: (u64, u64),
    export: String,
    task: Option<tokio::task::JoinHandle<()>>,
}

fn inode_of(p: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(p)
        .ok()
        .map(|m| (m.dev(), m.ino()))
}

struct Export {
    store: ChunkStore,
    manifest: Manifest,
    name: String,
}

impl NbdServer {
    /// Listens on `socket` (replacing a stale socket file) and serves `manifest` as export `name`
    /// (clients asking for the default export `""` get it too).
    pub async fn serve(
        store: ChunkStore,
        manifest: Manifest,
        name: &str,
        socket: &Path,
    ) -> Result<NbdServer> {
        let _ = std::fs::remove_file(socket);
        let listener = UnixListener::bind(socket).map_err(StoreError::io("bind", socket))?;
        let inode = inode_of(socket).unwrap_or_default();
        let ex = Arc::new(Export {
            store,
            manifest,
            name: name.to_owned(),
        });
        let task = tokio::spawn(async move {
            let mut conns = tokio::task::JoinSet::new();
            loop {
                tokio::select! {
                    acc = listener.accept() => match acc {
                        Ok((s, _)) => {
                            let ex = ex.clone();
                            conns.spawn(async move {
                                if let Err(e) = serve_conn(&ex, s).await {
                                    tracing::debug!(error = %e, "nbd connection ended");
                                }
                            });
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, "nbd accept");
                            tokio::time::sleep(Duration::from_millis(50)).await;
                        }
                    },
                    Some(_) = conns.join_next(), if !conns.is_empty() => {}
                }
            }
        });
        Ok(NbdServer {
            socket: socket.to_owned(),
            inode,
            export: name.to_owned(),
            task: Some(task),
        })
    }

    /// The socket path.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// The export as a QEMU NBD URI: `nbd+unix:///<name>?socket=<path>`.
    pub fn uri(&self) -> String {
        format!(
            "nbd+unix:///{}?socket={}",
            self.export,
            self.socket.display()
        )
    }

    /// Stops accepting, drops every connection and removes the socket.
    pub async fn shutdown(mut self) {
        if let Some(t) = self.task.take() {
            t.abort();
            let _ = t.await;
        }
    }
}

impl Drop for NbdServer {
    fn drop(&mut self) {
        if let Some(t) = &self.task {
            t.abort();
        }
        if inode_of(&self.socket) == Some(self.inode) {
            let _ = std::fs::remove_file(&self.socket);
        }
    }
}

type R = BufReader<tokio::net::unix::OwnedReadHalf>;
type W = BufWriter<tokio::net::unix::OwnedWriteHalf>;

async fn serve_conn(ex: &Export, s: UnixStream) -> std::io::Result<()> {
    let (r, w) = s.into_split();
    let (mut r, mut w) = (BufReader::new(r), BufWriter::new(w));
    let go = tokio::time::timeout(HANDSHAKE_DEADLINE, handshake(ex, &mut r, &mut w))
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "handshake deadline"))??;
    if go {
        transmission(ex, &mut r, &mut w).await?;
    }
    Ok(())
}

async fn opt_reply(w: &mut W, opt: u32, kind: u32, data: &[u8]) -> std::io::Result<()> {
    w.write_u64(REPLY_MAGIC).await?;
    w.write_u32(opt).await?;
    w.write_u32(kind).await?;
    w.write_u32(data.len() as u32).await?;
    w.write_all(data).await
}

fn bad(msg: &str) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, msg.to_owned())
}

/// Runs option haggling; `Ok(true)` when the client entered transmission.
async fn handshake(ex: &Export, r: &mut R, w: &mut W) -> std::io::Result<bool> {
    w.write_u64(NBDMAGIC).await?;
    w.write_u64(IHAVEOPT).await?;
    w.write_u16(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).await?;
    w.flush().await?;
    let cflags = r.read_u32().await?;
    if cflags & !3 != 0 || cflags & 1 == 0 {
        return Err(bad("client flags"));
    }
    let no_zeroes = cflags & 2 != 0;
    let size = ex.manifest.len;
    loop {
        if r.read_u64().await? != IHAVEOPT {
            return Err(bad("option magic"));
        }
        let opt = r.read_u32().await?;
        let len = r.read_u32().await?;
        if len > 64 << 10 {
            return Err(bad("option too long"));
        }
        let mut data = vec![0u8; len as usize];
        r.read_exact(&mut data).await?;
        match opt {
            OPT_EXPORT_NAME => {
                let name = String::from_utf8_lossy(&data);
                if name != ex.name && !name.is_empty() {
                    return Err(bad("unknown export"));
                }
                w.write_u64(size).await?;
                w.write_u16(TFLAGS).await?;
                if !no_zeroes {
                    w.write_all(&[0u8; 124]).await?;
                }
                w.flush().await?;
                return Ok(true);
            }
            OPT_ABORT => {
                opt_reply(w, opt, REP_ACK, &[]).await?;
                w.flush().await?;
                return Ok(false);
            }
            OPT_LIST => {
                if len != 0 {
                    opt_reply(w, opt, REP_ERR_INVALID, &[]).await?;
                } else {
                    let mut d = (ex.name.len() as u32).to_be_bytes().to_vec();
                    d.extend_from_slice(ex.name.as_bytes());
                    opt_reply(w, opt, REP_SERVER, &d).await?;
                    opt_reply(w, opt, REP_ACK, &[]).await?;
                }
            }
            OPT_INFO | OPT_GO => {
                let Some(reqs) = parse_info_request(&data) else {
                    opt_reply(w, opt, REP_ERR_INVALID, &[]).await?;
                    w.flush().await?;
                    continue;
                };
                let (name, wanted) = reqs;
                if name != ex.name && !name.is_empty() {
                    opt_reply(w, opt, REP_ERR_UNKNOWN, &[]).await?;
                    w.flush().await?;
                    continue;
                }
                let mut info = INFO_EXPORT.to_be_bytes().to_vec();
                info.extend_from_slice(&size.to_be_bytes());
                info.extend_from_slice(&TFLAGS.to_be_bytes());
                opt_reply(w, opt, REP_INFO, &info).await?;
                if wanted.contains(&INFO_BLOCK_SIZE) {
                    let mut b = INFO_BLOCK_SIZE.to_be_bytes().to_vec();
                    b.extend_from_slice(&1u32.to_be_bytes());
                    b.extend_from_slice(&(4096u32).to_be_bytes());
                    b.extend_from_slice(&MAX_READ.to_be_bytes());
                    opt_reply(w, opt, REP_INFO, &b).await?;
                }
                opt_reply(w, opt, REP_ACK, &[]).await?;
                w.flush().await?;
                if opt == OPT_GO {
                    return Ok(true);
                }
            }
            _ => opt_reply(w, opt, REP_ERR_UNSUP, &[]).await?,
        }
        w.flush().await?;
    }
}

/// `(export name, info types)` of an `NBD_OPT_INFO`/`GO` payload.
fn parse_info_request(d: &[u8]) -> Option<(String, Vec<u16>)> {
    let nlen = u32::from_be_bytes(d.get(..4)?.try_into().ok()?) as usize;
    let name = std::str::from_utf8(d.get(4..4 + nlen)?).ok()?.to_owned();
    let rest = d.get(4 + nlen..)?;
    let n = u16::from_be_bytes(rest.get(..2)?.try_into().ok()?) as usize;
    let reqs = rest.get(2..2 + 2 * n)?;
    if rest.len() != 2 + 2 * n {
        return None;
    }
    Some((
        name,
        reqs.chunks(2)
            .map(|c| u16::from_be_bytes([c[0], c[1]]))
            .collect(),
    ))
}

async fn simple_reply(w: &mut W, err: u32, handle: u64) -> std::io::Result<()> {
    w.write_u32(SIMPLE_REPLY_MAGIC).await?;
    w.write_u32(err).await?;
    w.write_u64(handle).await
}

async fn transmission(ex: &Export, r: &mut R, w: &mut W) -> std::io::Result<()> {
    let mut cache: VecDeque<(ChunkId, Arc<Vec<u8>>)> = VecDeque::new();
    let size = ex.manifest.len;
    loop {
        if r.read_u32().await? != REQUEST_MAGIC {
            return Err(bad("request magic"));
        }
        let _flags = r.read_u16().await?;
        let kind = r.read_u16().await?;
        let handle = r.read_u64().await?;
        let off = r.read_u64().await?;
        let len = r.read_u32().await?;
        match kind {
            CMD_READ => {
                if len > MAX_READ || off.checked_add(len as u64).is_none_or(|e| e > size) {
                    simple_reply(w, EINVAL, handle).await?;
                } else {
                    match read_range(ex, &mut cache, off, len as usize).await {
                        Ok(data) => {
                            simple_reply(w, 0, handle).await?;
                            w.write_all(&data).await?;
                        }
                        Err(e) => {
                            tracing::error!(error = %e, off, len, "nbd read");
                            simple_reply(w, EIO, handle).await?;
                        }
                    }
                }
            }
            CMD_WRITE => {
                // Read-only: drain the payload, refuse.
                tokio::io::copy(&mut (&mut *r).take(len as u64), &mut tokio::io::sink()).await?;
                simple_reply(w, EPERM, handle).await?;
            }
            CMD_DISC => {
                w.flush().await?;
                return Ok(());
            }
            CMD_FLUSH => simple_reply(w, 0, handle).await?,
            _ => simple_reply(w, EINVAL, handle).await?,
        }
        w.flush().await?;
    }
}

async fn read_range(
    ex: &Export,
    cache: &mut VecDeque<(ChunkId, Arc<Vec<u8>>)>,
    off: u64,
    len: usize,
) -> Result<Vec<u8>> {
    let m = &ex.manifest;
    let cs = m.chunk_size as u64;
    let mut out = vec![0u8; len];
    let end = off + len as u64;
    // Fetch the request's chunks that are not in the connection cache concurrently.
    let mut need: Vec<ChunkId> = (off / cs..end.div_ceil(cs))
        .filter_map(|i| m.chunk_at(i))
        .filter(|id| !cache.iter().any(|(c, _)| c == id))
        .collect();
    need.dedup();
    if need.len() > 1 {
        use futures_util::StreamExt;
        let got: Vec<Result<(ChunkId, Vec<u8>)>> = futures_util::stream::iter(need)
            .map(|id| async move { ex.store.chunk(&id).await.map(|d| (id, d)) })
            .buffered(ex.store.config().remote_concurrency)
            .collect()
            .await;
        for g in got {
            let (id, d) = g?;
            if cache.len() >= CONN_CACHE.max(len.div_ceil(cs as usize) + 1) {
                cache.pop_front();
            }
            cache.push_back((id, Arc::new(d)));
        }
    }
    let mut pos = off;
    while pos < end {
        let idx = pos / cs;
        let (coff, clen) = m.chunk_range(idx);
        let take_end = end.min(coff + clen as u64);
        if let Some(id) = m.chunk_at(idx) {
            let data = match cache.iter().find(|(c, _)| *c == id) {
                Some((_, d)) => d.clone(),
                None => {
                    let d = Arc::new(ex.store.chunk(&id).await?);
                    if cache.len() >= CONN_CACHE.max(len.div_ceil(cs as usize) + 1) {
                        cache.pop_front();
                    }
                    cache.push_back((id, d.clone()));
                    d
                }
            };
            if data.len() != clen {
                return Err(StoreError::BadManifest {
                    id: m.id().to_hex(),
                    detail: format!("chunk {idx} is {} bytes, its slot {clen}", data.len()),
                });
            }
            let (a, b) = ((pos - coff) as usize, (take_end - coff) as usize);
            let dst = (pos - off) as usize;
            out[dst..dst + (b - a)].copy_from_slice(&data[a..b]);
        }
        pos = take_end;
    }
    Ok(out)
}
