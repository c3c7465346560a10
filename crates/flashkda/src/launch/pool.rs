//! The per-stream workspace pool and side streams of [`KdaKernels`], and what makes one-time work
//! safe inside a caller's CUDA-graph capture.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream};

use super::{KdaKernels, Workspace};
use crate::error::{DriverContext, FlashKdaError};

/// Puts the calling thread in relaxed stream-capture mode until dropped, so that one-time work
/// (loading the cubins, growing a pooled workspace) done inside a caller's capture neither fails
/// nor invalidates it (torch's allocator does the same around its cudaMalloc). Best effort: a
/// driver that refuses leaves the mode as it was.
pub(super) struct RelaxedCapture(Option<cudarc::driver::sys::CUstreamCaptureMode>);

impl RelaxedCapture {
    pub(super) fn enter() -> Self {
        let mut mode = cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        // SAFETY: swaps this thread's capture mode; the previous one is restored on drop.
        let ok = unsafe { cudarc::driver::sys::cuThreadExchangeStreamCaptureMode(&mut mode) }
            == cudarc::driver::sys::CUresult::CUDA_SUCCESS;
        RelaxedCapture(ok.then_some(mode))
    }
}

impl Drop for RelaxedCapture {
    fn drop(&mut self) {
        if let Some(mut mode) = self.0.take() {
            // SAFETY: restores the mode `enter` swapped out.
            let _ = unsafe { cudarc::driver::sys::cuThreadExchangeStreamCaptureMode(&mut mode) };
        }
    }
}

/// Whether `stream` is being captured into a CUDA graph.
pub fn is_capturing(stream: &CudaStream) -> Result<bool, FlashKdaError> {
    // SAFETY: queries the capture status of the caller's live stream.
    let status = unsafe { cudarc::driver::result::stream::is_capturing(stream.cu_stream()) }
        .during("querying the stream's capture status")?;
    Ok(status != cudarc::driver::sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
}

/// One device allocation, freed on drop.
#[derive(Debug)]
struct OwnedBuffer {
    ctx: Arc<CudaContext>,
    ptr: cudarc::driver::sys::CUdeviceptr,
    bytes: usize,
}

impl OwnedBuffer {
    fn new(ctx: &Arc<CudaContext>, bytes: usize) -> Result<Self, FlashKdaError> {
        ctx.bind_to_thread().during("binding the context")?;
        // SAFETY: a plain allocation on the bound context.
        let ptr = unsafe { cudarc::driver::result::malloc_sync(bytes) }
            .during("allocating the workspace")?;
        Ok(OwnedBuffer {
            ctx: ctx.clone(),
            ptr,
            bytes,
        })
    }
}

impl Drop for OwnedBuffer {
    fn drop(&mut self) {
        // cuMemFree waits for work still using the allocation; errors cannot be reported here.
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: `ptr` came from malloc_sync on this context and is freed once.
            let _ = unsafe { cudarc::driver::result::free_sync(self.ptr) };
        }
    }
}

#[derive(Debug, Default)]
pub(super) struct WorkspacePool {
    by_stream: HashMap<usize, PooledBuffer>,
    /// Buffers replaced after a graph captured them: kept until the kernels are dropped, since a
    /// graph may still replay with their address.
    retired: Vec<OwnedBuffer>,
}

/// A stream this crate created (destroyed on drop).
#[derive(Debug)]
pub(super) struct SideStream(cudarc::driver::sys::CUstream);

// SAFETY: a CUstream handle may be used from any thread.
unsafe impl Send for SideStream {}

impl Drop for SideStream {
    fn drop(&mut self) {
        // SAFETY: created by create_with_priority below and destroyed once.
        let _ = unsafe { cudarc::driver::result::stream::destroy(self.0) };
    }
}

#[derive(Debug)]
struct PooledBuffer {
    buf: OwnedBuffer,
    captured: bool,
}

/// The caller's workspace (checked: at least `need` bytes, 16-aligned) or this stream's pooled one.
pub(super) fn workspace_ptr(
    kernels: &KdaKernels,
    stream: &CudaStream,
    given: Option<Workspace>,
    need: usize,
    capturing: bool,
) -> Result<u64, FlashKdaError> {
    match given {
        Some(w) if w.bytes < need => Err(FlashKdaError::WorkspaceTooSmall {
            need,
            have: w.bytes,
        }),
        Some(w) if w.ptr == 0 || !w.ptr.is_multiple_of(16) => Err(FlashKdaError::Misaligned {
            tensor: "workspace",
            ptr: w.ptr,
            align: 16,
        }),
        Some(w) => Ok(w.ptr),
        None => pooled_workspace(kernels, stream, need, capturing),
    }
}

/// The stream's pooled workspace of at least `need` bytes: allocated once per stream and reused
/// by every later call (no allocation in a steady-state call). It grows when a call needs more;
/// inside a capture the new buffer is allocated in relaxed mode and the old one kept alive (the
/// stream may still be running it). A buffer a graph captured is retired (kept until the kernels
/// are dropped), never freed, when it is replaced.
fn pooled_workspace(
    kernels: &KdaKernels,
    stream: &CudaStream,
    need: usize,
    capturing: bool,
) -> Result<u64, FlashKdaError> {
    let mut pool = kernels.workspaces.lock().unwrap_or_else(|p| p.into_inner());
    let key = stream.cu_stream() as usize;
    if let Some(b) = pool.by_stream.get_mut(&key)
        && b.buf.bytes >= need
    {
        b.captured |= capturing;
        return Ok(b.buf.ptr);
    }
    if let Some(old) = pool.by_stream.remove(&key) {
        if capturing {
            // no wait is possible while capturing: the stream's earlier calls may still read it
            pool.retired.push(old.buf);
        } else {
            // the old one may still be read by this stream's previous call
            stream
                .synchronize()
                .during("waiting before growing the workspace")?;
            if old.captured {
                pool.retired.push(old.buf);
            }
        }
    }
    let buf = {
        let _relaxed = RelaxedCapture::enter();
        OwnedBuffer::new(&kernels.ctx, need)?
    };
    let ptr = buf.ptr;
    pool.by_stream.insert(
        key,
        PooledBuffer {
            buf,
            captured: capturing,
        },
    );
    Ok(ptr)
}

/// The highest-priority side stream kept for `stream` (created on first use).
pub(super) fn side_stream(
    kernels: &KdaKernels,
    stream: &CudaStream,
) -> Result<Arc<CudaStream>, FlashKdaError> {
    let mut map = kernels
        .side_streams
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    let key = stream.cu_stream() as usize;
    let raw = match map.get(&key) {
        Some(s) => s.0,
        None => {
            // created once, possibly inside a capture
            let _relaxed = RelaxedCapture::enter();
            let (_, greatest) = cudarc::driver::result::stream::get_priority_range()
                .during("reading the stream priority range")?;
            let raw = cudarc::driver::result::stream::create_with_priority(
                cudarc::driver::result::stream::StreamKind::NonBlocking,
                greatest,
            )
            .during("creating the side stream")?;
            map.insert(key, SideStream(raw));
            raw
        }
    };
    // SAFETY: `raw` stays alive in the map as long as `kernels`; the wrapper does not destroy it.
    Ok(unsafe { kernels.ctx.wrap_borrowed_stream(raw) })
}

impl KdaKernels {
    /// Frees the pooled workspaces after waiting for the device (the next call allocates again);
    /// those a graph captured stay alive. Returns the bytes freed.
    pub fn release_workspaces(&self) -> Result<usize, FlashKdaError> {
        let mut pool = self.workspaces.lock().unwrap_or_else(|p| p.into_inner());
        self.ctx
            .synchronize()
            .during("waiting before freeing the workspaces")?;
        let mut freed = 0;
        for (_, b) in pool.by_stream.drain().collect::<Vec<_>>() {
            if b.captured {
                pool.retired.push(b.buf);
            } else {
                freed += b.buf.bytes;
            }
        }
        Ok(freed)
    }
}
