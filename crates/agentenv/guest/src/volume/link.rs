//! A mount's link to the host: its current channel (the upgraded attach stream), replaced by each
//! attach. The FUSE thread (blocking) hands a frame to the channel's task and waits for the answer;
//! a channel that breaks mid-request is dropped and the request resent on the next one, all within
//! the operation's deadline.

use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Instant;

use agentenv_envd::volume::{self, Request, Response};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;

use super::ops::Host;

/// One request on its way: the whole frame, its deadline, where the answer's body goes (`Err`:
/// the channel broke).
struct Job {
    frame: Arc<Vec<u8>>,
    deadline: Instant,
    answer: std_mpsc::Sender<Result<Vec<u8>, ()>>,
}

#[derive(Default)]
struct State {
    /// Bumped by each attach: a task drops the channel only while it is still the current one.
    generation: u64,
    jobs: Option<mpsc::UnboundedSender<Job>>,
    task: Option<tokio::task::AbortHandle>,
    /// Unmounted: every request fails at once.
    closed: bool,
}

/// The channel slot of one mount.
#[derive(Default)]
pub struct Link {
    state: Mutex<State>,
    changed: Condvar,
}

impl Link {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Makes `io` the channel (an older one is dropped). Needs a tokio runtime.
    pub fn install<IO>(self: &Arc<Self>, io: IO)
    where
        IO: AsyncRead + AsyncWrite + Send + Unpin + 'static,
    {
        let (tx, rx) = mpsc::unbounded_channel();
        let mut st = self.lock();
        st.generation += 1;
        if let Some(old) = st.task.take() {
            old.abort();
        }
        let task = tokio::spawn(serve(self.clone(), st.generation, io, rx));
        st.jobs = Some(tx);
        st.task = Some(task.abort_handle());
        st.closed = false;
        drop(st);
        self.changed.notify_all();
    }

    /// Whether a channel is installed now.
    pub fn attached(&self) -> bool {
        self.lock().jobs.is_some()
    }

    /// Drops the channel and fails every request from now on.
    pub fn close(&self) {
        let mut st = self.lock();
        st.closed = true;
        st.jobs = None;
        if let Some(t) = st.task.take() {
            t.abort();
        }
        drop(st);
        self.changed.notify_all();
    }

    /// Drops the channel of `generation` if it is still the current one.
    fn broken(&self, generation: u64) {
        let mut st = self.lock();
        if st.generation == generation {
            st.jobs = None;
            st.task = None;
        }
    }

    /// The current channel, waiting for one until `deadline`.
    fn current(&self, deadline: Instant) -> Option<(u64, mpsc::UnboundedSender<Job>)> {
        let mut st = self.lock();
        loop {
            if st.closed {
                return None;
            }
            if let Some(tx) = &st.jobs {
                return Some((st.generation, tx.clone()));
            }
            let left = deadline.checked_duration_since(Instant::now())?;
            st = self
                .changed
                .wait_timeout(st, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

impl Host for Arc<Link> {
    fn call(
        &self,
        req: &Request,
        data: &[u8],
        deadline: Instant,
    ) -> Result<(Response, Vec<u8>), i32> {
        let frame = Arc::new(volume::encode(req, data));
        if frame.len() - 4 > volume::MAX_FRAME {
            return Err(libc::EIO);
        }
        loop {
            let (generation, jobs) = self.current(deadline).ok_or(libc::EIO)?;
            let (tx, rx) = std_mpsc::channel();
            let job = Job {
                frame: frame.clone(),
                deadline,
                answer: tx,
            };
            if jobs.send(job).is_err() {
                self.broken(generation);
                continue;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(Ok(body)) => {
                    return match volume::decode::<Response>(&body) {
                        Ok((r, d)) => Ok((r, d.to_vec())),
                        Err(e) => {
                            tracing::warn!(error = %e, "bad answer on a volume channel");
                            Err(libc::EIO)
                        }
                    };
                }
                // The channel broke (or was replaced): wait for the next attach and resend.
                Ok(Err(())) | Err(std_mpsc::RecvTimeoutError::Disconnected) => {
                    self.broken(generation);
                }
                Err(std_mpsc::RecvTimeoutError::Timeout) => return Err(libc::EIO),
            }
        }
    }
}

/// Serves one channel: each job's frame out, one answer frame back, in order. Ends (dropping the
/// channel) when the stream fails or a job's deadline passes mid-exchange (the stream is then out
/// of step).
async fn serve<IO>(
    link: Arc<Link>,
    generation: u64,
    mut io: IO,
    mut jobs: mpsc::UnboundedReceiver<Job>,
) where
    IO: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    while let Some(job) = jobs.recv().await {
        if job.deadline <= Instant::now() {
            continue; // its caller gave up already
        }
        let deadline = tokio::time::Instant::from_std(job.deadline);
        match tokio::time::timeout_at(deadline, exchange(&mut io, &job.frame)).await {
            Ok(Ok(body)) => {
                let _ = job.answer.send(Ok(body));
            }
            Ok(Err(e)) => {
                tracing::info!(error = %e, "volume channel broke");
                let _ = job.answer.send(Err(()));
                break;
            }
            Err(_) => {
                tracing::warn!("volume channel: no answer in time; dropping it");
                break;
            }
        }
    }
    link.broken(generation);
}

/// Writes a frame and reads the answer's body (bounded by [`volume::frame_len`]).
async fn exchange<IO>(io: &mut IO, frame: &[u8]) -> std::io::Result<Vec<u8>>
where
    IO: AsyncRead + AsyncWrite + Unpin,
{
    io.write_all(frame).await?;
    io.flush().await?;
    let mut word = [0u8; 4];
    io.read_exact(&mut word).await?;
    let n = volume::frame_len(word).map_err(std::io::Error::other)?;
    let mut body = vec![0u8; n];
    io.read_exact(&mut body).await?;
    Ok(body)
}
