//! One multiplexed stream: shared receive buffer and send credit, and the `MuxStream` handle.

use std::collections::VecDeque;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::INITIAL_WINDOW;
use crate::frame::{Frame, Kind, MAX_DATA_CHUNK};
use tokio::task::JoinHandle;

/// What a stream needs of its session: sending a frame (`false` once the session is gone) and
/// forgetting the stream.
pub(crate) trait Link: Send + Sync {
    fn send_frame(&self, f: Frame) -> bool;
    fn forget_stream(&self, id: u32, shared: &Arc<StreamShared>);
}

/// Aborts the session tasks once the session and all its streams are dropped.
pub(crate) struct TaskGuard {
    pub(crate) tasks: Mutex<Vec<JoinHandle<()>>>,
}

impl Drop for TaskGuard {
    fn drop(&mut self) {
        for t in self
            .tasks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain(..)
        {
            t.abort();
        }
    }
}

/// Credit returned to the sender once this many bytes were consumed.
const WINDOW_UPDATE_THRESHOLD: u32 = INITIAL_WINDOW / 4;

#[derive(Debug)]
pub(crate) struct StreamState {
    recv: VecDeque<Vec<u8>>,
    recv_off: usize,
    recv_window_left: u32,
    consumed_unacked: u32,
    pub(crate) recv_fin: bool,
    pub(crate) reset: Option<String>,
    read_waker: Option<Waker>,
    send_credit: u32,
    pub(crate) fin_sent: bool,
    write_waker: Option<Waker>,
}

#[derive(Debug)]
pub(crate) struct StreamShared {
    pub(crate) state: Mutex<StreamState>,
}

/// What the session reader should do after delivering a frame to a stream.
pub(crate) enum Delivery {
    Ok,
    /// The peer overran the window or wrote after FIN: reset the stream.
    Violation(String),
}

impl StreamShared {
    pub(crate) fn new() -> Arc<StreamShared> {
        Arc::new(StreamShared {
            state: Mutex::new(StreamState {
                recv: VecDeque::new(),
                recv_off: 0,
                recv_window_left: INITIAL_WINDOW,
                consumed_unacked: 0,
                recv_fin: false,
                reset: None,
                read_waker: None,
                send_credit: INITIAL_WINDOW,
                fin_sent: false,
                write_waker: None,
            }),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, StreamState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn push_data(&self, data: Vec<u8>) -> Delivery {
        let mut s = self.lock();
        if s.reset.is_some() {
            return Delivery::Ok;
        }
        if s.recv_fin {
            return Delivery::Violation("DATA after FIN".into());
        }
        let len = data.len() as u32;
        if len > s.recv_window_left {
            return Delivery::Violation(format!(
                "DATA of {len} bytes overruns window of {}",
                s.recv_window_left
            ));
        }
        s.recv_window_left -= len;
        if !data.is_empty() {
            s.recv.push_back(data);
        }
        wake(&mut s.read_waker);
        Delivery::Ok
    }

    pub(crate) fn push_fin(&self) {
        let mut s = self.lock();
        s.recv_fin = true;
        wake(&mut s.read_waker);
    }

    pub(crate) fn add_credit(&self, credit: u32) {
        let mut s = self.lock();
        s.send_credit = s.send_credit.saturating_add(credit);
        wake(&mut s.write_waker);
    }

    pub(crate) fn reset(&self, reason: &str) {
        let mut s = self.lock();
        if s.reset.is_none() {
            s.reset = Some(reason.to_string());
        }
        // Bytes that arrived before the reset stay readable (like data before a FIN).
        wake(&mut s.read_waker);
        wake(&mut s.write_waker);
    }

    pub(crate) fn is_reset(&self) -> bool {
        self.lock().reset.is_some()
    }
}

fn wake(w: &mut Option<Waker>) {
    if let Some(w) = w.take() {
        w.wake();
    }
}

/// One bidirectional byte stream of a [`crate::Session`]. Dropping it without a clean
/// two-way close sends RST; `shutdown()` sends FIN (half-close).
pub struct MuxStream {
    id: u32,
    shared: Arc<StreamShared>,
    inner: Arc<dyn Link>,
    _guard: Arc<TaskGuard>,
}

impl std::fmt::Debug for MuxStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MuxStream").field("id", &self.id).finish()
    }
}

impl MuxStream {
    pub(crate) fn new(
        id: u32,
        shared: Arc<StreamShared>,
        inner: Arc<dyn Link>,
        guard: Arc<TaskGuard>,
    ) -> MuxStream {
        MuxStream {
            id,
            shared,
            inner,
            _guard: guard,
        }
    }

    /// The stream id on the wire.
    pub fn id(&self) -> u32 {
        self.id
    }
}

impl AsyncRead for MuxStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let mut s = this.shared.lock();
        let mut copied = 0usize;
        while buf.remaining() > 0 {
            let off = s.recv_off;
            let Some(front) = s.recv.front() else { break };
            let n = (front.len() - off).min(buf.remaining());
            buf.put_slice(&front[off..off + n]);
            copied += n;
            if off + n == front.len() {
                s.recv.pop_front();
                s.recv_off = 0;
            } else {
                s.recv_off = off + n;
            }
        }
        if copied > 0 {
            s.consumed_unacked += copied as u32;
            if s.consumed_unacked >= WINDOW_UPDATE_THRESHOLD && !s.recv_fin && s.reset.is_none() {
                let credit = s.consumed_unacked;
                s.consumed_unacked = 0;
                s.recv_window_left += credit;
                drop(s);
                this.inner.send_frame(Frame::window(this.id, credit));
            }
            return Poll::Ready(Ok(()));
        }
        if s.recv_fin {
            return Poll::Ready(Ok(()));
        }
        if let Some(reason) = &s.reset {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::ConnectionReset,
                reason.clone(),
            )));
        }
        s.read_waker = Some(cx.waker().clone());
        Poll::Pending
    }
}

impl AsyncWrite for MuxStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let mut s = this.shared.lock();
        if let Some(reason) = &s.reset {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::ConnectionReset,
                reason.clone(),
            )));
        }
        if s.fin_sent {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "write after shutdown",
            )));
        }
        if buf.is_empty() {
            return Poll::Ready(Ok(0));
        }
        if s.send_credit == 0 {
            s.write_waker = Some(cx.waker().clone());
            return Poll::Pending;
        }
        let n = buf.len().min(s.send_credit as usize).min(MAX_DATA_CHUNK);
        s.send_credit -= n as u32;
        drop(s);
        let frame = Frame {
            stream_id: this.id,
            kind: Kind::Data,
            payload: buf[..n].to_vec(),
        };
        if !this.inner.send_frame(frame) {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "mux session closed",
            )));
        }
        Poll::Ready(Ok(n))
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        // Frames go to the writer task at once; the writer flushes after every batch.
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let mut s = this.shared.lock();
        if s.fin_sent || s.reset.is_some() {
            return Poll::Ready(Ok(()));
        }
        s.fin_sent = true;
        drop(s);
        this.inner.send_frame(Frame::empty(this.id, Kind::Fin));
        Poll::Ready(Ok(()))
    }
}

impl Drop for MuxStream {
    fn drop(&mut self) {
        let s = self.shared.lock();
        let clean = s.fin_sent && s.recv_fin;
        let already_reset = s.reset.is_some();
        drop(s);
        self.inner.forget_stream(self.id, &self.shared);
        if !clean && !already_reset {
            self.inner.send_frame(Frame::empty(self.id, Kind::Rst));
        }
    }
}
