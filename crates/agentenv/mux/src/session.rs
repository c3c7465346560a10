//! The session: one reader task and one writer task over the channel, and the stream table.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, BufReader, ReadHalf, WriteHalf};
use tokio::sync::{mpsc, watch};

use crate::frame::{self, Frame, HEADER_LEN, Kind, MAX_PAYLOAD};
use crate::stream::{Delivery, Link, MuxStream, StreamShared, TaskGuard};
use crate::{MAX_STREAMS, MuxError};

/// How often the client repeats its HELLO until the server acknowledges it. A clean channel (the
/// server at a frame boundary, as after every snapshot of an idle channel) answers the first one.
const HELLO_RETRY: Duration = Duration::from_millis(150);
/// Nonce of the HELLO a server sends when it starts: "any session you had with me is gone".
const RESTART_NONCE: u64 = 0;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    Client,
    Server,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Phase {
    Handshaking,
    Ready,
    Closed(String),
}

struct Table {
    streams: HashMap<u32, Arc<StreamShared>>,
    next_id: u32,
    nonce: u64,
}

pub(crate) struct Inner {
    role: Role,
    tx: mpsc::UnboundedSender<Outgoing>,
    table: Mutex<Table>,
    phase: watch::Sender<Phase>,
    accept_tx: Mutex<Option<mpsc::UnboundedSender<Arc<StreamShared>>>>,
}

impl Inner {
    fn table(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues a frame for the writer; false when the session is gone.
    fn send(&self, f: Frame) -> bool {
        self.tx.send(Outgoing::Frame(f)).is_ok()
    }
}

impl Link for Inner {
    fn send_frame(&self, f: Frame) -> bool {
        self.send(f)
    }

    fn forget_stream(&self, id: u32, shared: &Arc<StreamShared>) {
        let mut t = self.table();
        if t.streams.get(&id).is_some_and(|s| Arc::ptr_eq(s, shared)) {
            t.streams.remove(&id);
        }
    }
}

impl Inner {
    fn reset_all(&self, reason: &str) {
        let old: Vec<_> = self.table().streams.drain().map(|(_, s)| s).collect();
        for s in old {
            s.reset(reason);
        }
    }

    fn close(&self, reason: String) {
        tracing::debug!(role = ?self.role, %reason, "mux session closed");
        self.phase.send_replace(Phase::Closed(reason.clone()));
        self.accept_tx
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        self.reset_all(&format!("mux session closed: {reason}"));
    }
}

/// A multiplexed session over one byte channel. See the crate docs for the protocol.
pub struct Session {
    inner: Arc<Inner>,
    guard: Arc<TaskGuard>,
    accept_rx: tokio::sync::Mutex<Option<mpsc::UnboundedReceiver<Arc<StreamShared>>>>,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("role", &self.inner.role)
            .finish()
    }
}

impl Session {
    /// Starts the host side: sends a resync preamble and a HELLO with a fresh nonce (repeated
    /// until the server echoes it), then lets [`Session::open`] open streams.
    /// Must be called inside a tokio runtime.
    pub fn client<IO>(io: IO) -> Session
    where
        IO: AsyncRead + AsyncWrite + Send + 'static,
    {
        Session::start(io, Role::Client)
    }

    /// Starts the guest side: skips bytes until a HELLO, acknowledges it, and hands every
    /// stream the client opens to [`Session::accept`]. Must be called inside a tokio runtime.
    pub fn server<IO>(io: IO) -> Session
    where
        IO: AsyncRead + AsyncWrite + Send + 'static,
    {
        Session::start(io, Role::Server)
    }

    fn start<IO>(io: IO, role: Role) -> Session
    where
        IO: AsyncRead + AsyncWrite + Send + 'static,
    {
        let (rd, wr) = tokio::io::split(io);
        let (tx, rx) = mpsc::unbounded_channel();
        let (accept_tx, accept_rx) = mpsc::unbounded_channel();
        let nonce = if role == Role::Client {
            rand::random::<u64>()
        } else {
            0
        };
        let inner = Arc::new(Inner {
            role,
            tx,
            table: Mutex::new(Table {
                streams: HashMap::new(),
                next_id: 1,
                nonce,
            }),
            phase: watch::channel(Phase::Handshaking).0,
            accept_tx: Mutex::new((role == Role::Server).then_some(accept_tx)),
        });
        if role == Role::Server {
            // Tells a client that still holds an older session that this side started afresh.
            inner.send_frame(Frame::hello(RESTART_NONCE));
        }
        if role == Role::Client {
            // A zero header: at a frame boundary it is invalid, so a restored server restarts its
            // HELLO hunt. The first retry sends a full frame of zeros (see `hello_retry_task`).
            let _ = inner.tx.send(Outgoing::Raw(vec![0u8; HEADER_LEN]));
            inner.send_frame(Frame::hello(nonce));
        }
        let mut tasks = vec![
            tokio::spawn(writer_task(wr, rx, inner.clone())),
            tokio::spawn(reader_task(rd, inner.clone())),
        ];
        if role == Role::Client {
            tasks.push(tokio::spawn(hello_retry_task(inner.clone(), nonce)));
        }
        Session {
            inner,
            guard: Arc::new(TaskGuard {
                tasks: Mutex::new(tasks),
            }),
            accept_rx: tokio::sync::Mutex::new((role == Role::Server).then_some(accept_rx)),
        }
    }

    /// Opens a new stream (client only). Waits for the handshake; fails once the session is closed.
    pub async fn open(&self) -> Result<MuxStream, MuxError> {
        if self.inner.role != Role::Client {
            return Err(MuxError::Protocol(
                "only the client side opens streams".into(),
            ));
        }
        self.ready().await?;
        let shared = StreamShared::new();
        let id = {
            let mut t = self.inner.table();
            let id = t.next_id;
            t.next_id = t.next_id.wrapping_add(1).max(1);
            t.streams.insert(id, shared.clone());
            id
        };
        if !self.inner.send_frame(Frame::empty(id, Kind::Open)) {
            return Err(MuxError::Closed("writer gone".into()));
        }
        Ok(MuxStream::new(
            id,
            shared,
            self.inner.clone(),
            self.guard.clone(),
        ))
    }

    /// Next stream opened by the client (server only); `None` once the session has ended.
    pub async fn accept(&self) -> Option<MuxStream> {
        let mut rx = self.accept_rx.lock().await;
        let rx = rx.as_mut()?;
        loop {
            let shared = rx.recv().await?;
            if shared.is_reset() {
                continue; // dropped by a HELLO reset before anyone took it
            }
            let id = self
                .inner
                .table()
                .streams
                .iter()
                .find(|(_, s)| Arc::ptr_eq(s, &shared))
                .map(|(id, _)| *id);
            let Some(id) = id else { continue };
            return Some(MuxStream::new(
                id,
                shared,
                self.inner.clone(),
                self.guard.clone(),
            ));
        }
    }

    /// Waits until the HELLO exchange is done.
    pub async fn ready(&self) -> Result<(), MuxError> {
        let mut rx = self.inner.phase.subscribe();
        loop {
            match &*rx.borrow_and_update() {
                Phase::Ready => return Ok(()),
                Phase::Closed(r) => return Err(MuxError::Closed(r.clone())),
                Phase::Handshaking => {}
            }
            if rx.changed().await.is_err() {
                return Err(MuxError::Closed("session dropped".into()));
            }
        }
    }

    /// Why the session ended, or `None` while it is alive.
    pub fn close_reason(&self) -> Option<String> {
        match &*self.inner.phase.borrow() {
            Phase::Closed(r) => Some(r.clone()),
            _ => None,
        }
    }

    /// Waits until the session has ended and returns the reason.
    pub async fn closed(&self) -> String {
        let mut rx = self.inner.phase.subscribe();
        loop {
            if let Phase::Closed(r) = &*rx.borrow_and_update() {
                return r.clone();
            }
            if rx.changed().await.is_err() {
                return "session dropped".into();
            }
        }
    }

    /// The nonce of the current session (0 on a server before the first HELLO).
    pub fn nonce(&self) -> u64 {
        self.inner.table().nonce
    }

    /// Number of streams currently open.
    pub fn stream_count(&self) -> usize {
        self.inner.table().streams.len()
    }
}

/// What the writer task puts on the channel.
enum Outgoing {
    Frame(Frame),
    /// Raw bytes (the client's resync preamble), not a frame.
    Raw(Vec<u8>),
}

async fn writer_task<W: AsyncWrite>(
    wr: WriteHalf<W>,
    mut rx: mpsc::UnboundedReceiver<Outgoing>,
    inner: Arc<Inner>,
) {
    let mut wr = wr;
    let mut buf = Vec::with_capacity(256 * 1024);
    while let Some(f) = rx.recv().await {
        buf.clear();
        push_encoded(&f, &mut buf);
        while buf.len() < 256 * 1024 {
            match rx.try_recv() {
                Ok(f) => push_encoded(&f, &mut buf),
                Err(_) => break,
            }
        }
        let res = async {
            wr.write_all(&buf).await?;
            wr.flush().await
        }
        .await;
        if let Err(e) = res {
            inner.close(format!("write failed: {e}"));
            return;
        }
    }
}

fn push_encoded(o: &Outgoing, out: &mut Vec<u8>) {
    match o {
        Outgoing::Frame(f) => f.encode_into(out),
        Outgoing::Raw(bytes) => out.extend_from_slice(bytes),
    }
}

async fn hello_retry_task(inner: Arc<Inner>, nonce: u64) {
    let mut rx = inner.phase.subscribe();
    let mut first = true;
    loop {
        tokio::select! {
            _ = tokio::time::sleep(HELLO_RETRY) => {}
            r = rx.changed() => if r.is_err() { return; },
        }
        if *rx.borrow() != Phase::Handshaking {
            return;
        }
        // A server restored half-way through a frame took the first HELLO as payload: the zeros of
        // the longest frame complete it, and the zero header after them restarts its hunt.
        let zeros = if first {
            MAX_PAYLOAD + HEADER_LEN
        } else {
            HEADER_LEN
        };
        first = false;
        let _ = inner.tx.send(Outgoing::Raw(vec![0u8; zeros]));
        inner.send_frame(Frame::hello(nonce));
    }
}

async fn reader_task<R: AsyncRead>(rd: ReadHalf<R>, inner: Arc<Inner>) {
    let mut rd = BufReader::with_capacity(128 * 1024, rd);
    let reason = match read_loop(&mut rd, &inner).await {
        Ok(()) => "peer closed the channel".to_string(),
        Err(e) => e.to_string(),
    };
    inner.close(reason);
}

async fn read_loop<R: AsyncRead>(
    rd: &mut BufReader<ReadHalf<R>>,
    inner: &Arc<Inner>,
) -> Result<(), MuxError> {
    // Both sides skip whatever precedes the first HELLO (a restored peer's half-sent frames).
    let my_nonce = inner.table().nonce;
    loop {
        loop {
            let Some(nonce) = frame::hunt_hello(rd).await? else {
                return Ok(());
            };
            match inner.role {
                Role::Server => {
                    inner.table().nonce = nonce;
                    inner.send_frame(Frame::hello(nonce));
                    break;
                }
                Role::Client if nonce == my_nonce => break,
                Role::Client => continue, // an ack for someone else's HELLO
            }
        }
        inner.phase.send_replace(Phase::Ready);
        loop {
            match frame::read_frame(rd).await {
                Ok(Some(f)) => handle_frame(inner, f)?,
                Ok(None) => return Ok(()),
                // A restored VM's new host: drop the old streams and hunt for its HELLO in place,
                // without closing the port (re-opening it would cost the guest a retry cycle).
                Err(MuxError::Restarted) if inner.role == Role::Server => {
                    tracing::info!("mux channel restarted by the host; waiting for its HELLO");
                    inner.reset_all("mux channel restarted by the host");
                    break;
                }
                Err(e) => return Err(e),
            }
        }
    }
}

fn handle_frame(inner: &Arc<Inner>, f: Frame) -> Result<(), MuxError> {
    let id = f.stream_id;
    match f.kind {
        Kind::Hello => {
            let nonce = f.hello_nonce()?;
            if inner.role == Role::Server {
                let mut t = inner.table();
                if t.nonce != nonce {
                    t.nonce = nonce;
                    drop(t);
                    tracing::info!(nonce, "mux session reset by a new HELLO");
                    inner.reset_all("mux session reset by the peer");
                }
                inner.send_frame(Frame::hello(nonce));
            } else if nonce != inner.table().nonce {
                return Err(MuxError::Protocol(
                    "the server restarted its session".into(),
                ));
            }
            Ok(())
        }
        Kind::Open => {
            if inner.role != Role::Server || id == 0 {
                return Err(MuxError::Protocol(format!(
                    "unexpected OPEN of stream {id}"
                )));
            }
            let shared = StreamShared::new();
            let mut t = inner.table();
            if t.streams.contains_key(&id) || t.streams.len() >= MAX_STREAMS {
                drop(t);
                inner.send_frame(Frame::empty(id, Kind::Rst));
                return Ok(());
            }
            t.streams.insert(id, shared.clone());
            drop(t);
            let delivered = inner
                .accept_tx
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .as_ref()
                .is_some_and(|tx| tx.send(shared.clone()).is_ok());
            if !delivered {
                inner.table().streams.remove(&id);
                inner.send_frame(Frame::empty(id, Kind::Rst));
            }
            Ok(())
        }
        Kind::Data | Kind::Fin | Kind::Rst | Kind::Window => {
            let Some(shared) = inner.table().streams.get(&id).cloned() else {
                return Ok(()); // late frame for a stream already gone
            };
            match f.kind {
                Kind::Data => {
                    if let Delivery::Violation(why) = shared.push_data(f.payload) {
                        tracing::warn!(stream = id, %why, "mux stream reset");
                        shared.reset(&why);
                        inner.table().streams.remove(&id);
                        inner.send_frame(Frame::empty(id, Kind::Rst));
                    }
                }
                Kind::Fin => shared.push_fin(),
                Kind::Rst => {
                    shared.reset("stream reset by the peer");
                    inner.forget_stream(id, &shared);
                }
                _ => shared.add_credit(f.window_credit()?),
            }
            Ok(())
        }
    }
}
