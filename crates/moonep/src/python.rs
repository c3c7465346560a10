//! The `moonep._moonep` Python module (feature `python`): one rank's [`EpBuffer`] driven by raw
//! device pointers on the caller's stream. The torch-facing package (`python/moonep`) builds
//! tensors, zero-copy views and the autograd functions on top. No libtorch link; bad arguments
//! raise ValueError, device trouble RuntimeError.

use std::sync::Mutex;

use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

use crate::gpu::GpuError;
use crate::gpu::ep::{EpBuffer, EpConfig, Tokens, Transport};
use crate::gpu::rank::{Rank, RankEnv};

fn to_py(e: GpuError) -> PyErr {
    match e {
        GpuError::Invalid(_) | GpuError::Plan(_) | GpuError::Env(_) => {
            PyValueError::new_err(e.to_string())
        }
        e => PyRuntimeError::new_err(e.to_string()),
    }
}

struct Inner {
    rank: Rank,
    buf: EpBuffer,
}

// SAFETY: driver handles, device pointers and a TCP stream, used by one thread at a time behind
// the mutex; every call first makes the (primary) context current on the calling thread, which
// torch's autograd threads need.
unsafe impl Send for Inner {}

/// One rank's symmetric buffers, sized once per (S, K, H, E). Collective: every rank constructs
/// it and then issues the same calls in the same order.
#[pyclass]
struct Buffer {
    inner: Mutex<Inner>,
}

impl Buffer {
    /// Runs `f` with the device's stream swapped for the caller's `stream` (a `CUstream` as int;
    /// 0 is the legacy default stream, torch's default). `None` keeps moonep's own stream.
    fn on_stream<T>(
        &self,
        stream: Option<usize>,
        f: impl FnOnce(&Rank, &mut EpBuffer) -> Result<T, GpuError>,
    ) -> PyResult<T> {
        let mut guard = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let Inner { rank, buf } = &mut *guard;
        rank.dev.bind().map_err(to_py)?;
        let own = rank.dev.stream;
        if let Some(stream) = stream {
            rank.dev.stream = stream as cudarc::driver::sys::CUstream;
        }
        let res = f(rank, buf);
        rank.dev.stream = own;
        res.map_err(to_py)
    }
}

#[pymethods]
impl Buffer {
    /// Bootstraps the rank (`rank`, `world`, our TCP store on 127.0.0.1:`store_port`, run by rank
    /// 0) and allocates the buffers. The device is `MOONEP_DEVICE` or `LOCAL_RANK % devices`.
    #[new]
    #[pyo3(signature = (rank, world, local_rank, store_port, experts, top_k, capacity_s, hidden,
        padding=128, num_blocks=32, dedup=true, grad_elems=0, expert_bytes=0))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        rank: usize,
        world: usize,
        local_rank: usize,
        store_port: u16,
        experts: usize,
        top_k: usize,
        capacity_s: usize,
        hidden: usize,
        padding: usize,
        num_blocks: u32,
        dedup: bool,
        grad_elems: usize,
        expert_bytes: usize,
    ) -> PyResult<Buffer> {
        if rank >= world {
            return Err(PyValueError::new_err(format!(
                "rank {rank} >= world {world}"
            )));
        }
        let env = RankEnv {
            rank,
            world,
            local_rank,
            port: store_port,
        };
        let mut r = Rank::init(env).map_err(to_py)?;
        let mut cfg = EpConfig::new(experts, top_k, capacity_s, hidden);
        cfg.padding = padding;
        cfg.num_blocks = num_blocks;
        cfg.dedup = dedup;
        cfg.grad_elems = grad_elems;
        cfg.expert_bytes = expert_bytes;
        let buf = EpBuffer::new(&mut r, cfg).map_err(to_py)?;
        if buf.transport != Transport::Nvlink {
            return Err(PyRuntimeError::new_err(
                "moonep's Python API needs peer-mapped (IPC) buffers; this host has no peer access",
            ));
        }
        Ok(Buffer {
            inner: Mutex::new(Inner { rank: r, buf }),
        })
    }

    /// Plans and dispatches `s` tokens: `x` bf16 `[s,H]`, `w` f32 `[s,K]` (0 = none), `topk`
    /// i32 `[s,K]`, `tpe` i32 `[E]` (device pointers).
    #[allow(clippy::too_many_arguments)]
    fn dispatch(
        &self,
        x: u64,
        w: u64,
        topk: u64,
        tpe: u64,
        s: usize,
        stream: usize,
    ) -> PyResult<()> {
        self.on_stream(Some(stream), |rank, buf| {
            buf.dispatch(
                rank,
                &Tokens {
                    x,
                    w,
                    topk,
                    tpe,
                    s,
                    total_tokens: None,
                },
            )
        })
    }

    /// `out` bf16 `[s,H]` = the K-sum of the slot rows; `w_out` f32 `[s,K]` (0 = skip).
    fn combine(&self, out: u64, w_out: u64, stream: usize) -> PyResult<()> {
        self.on_stream(Some(stream), |rank, buf| buf.combine(rank, out, w_out))
    }

    /// Token gradients `grad_out` bf16 `[s,H]` dispatched into the slots (saved plan).
    fn combine_backward(&self, grad_out: u64, stream: usize) -> PyResult<()> {
        self.on_stream(Some(stream), |rank, buf| {
            buf.combine_backward(rank, grad_out)
        })
    }

    /// Slot gradients (in the shard and slot weights) combined into `dx` and `dw`.
    fn dispatch_backward(&self, dx: u64, dw: u64, stream: usize) -> PyResult<()> {
        self.on_stream(Some(stream), |rank, buf| {
            buf.dispatch_backward(rank, dx, dw)
        })
    }

    /// Replica weight gradients (reduce slots) summed into `home_grads` f32 `[epn, grad_elems]`.
    fn reduce_grad(&self, home_grads: u64, stream: usize) -> PyResult<()> {
        self.on_stream(Some(stream), |rank, buf| {
            buf.reduce_grad(&rank.dev, home_grads)
        })
    }

    /// Home ranks push `local_weights` (`[epn][expert_bytes]`) into every replica's prefetch slot.
    fn prefetch(&self, local_weights: u64, stream: usize) -> PyResult<()> {
        self.on_stream(Some(stream), |rank, buf| {
            buf.prefetch(&rank.dev, local_weights)
        })
    }

    /// Waits for this rank's stream and raises on a device status error.
    fn check(&self, stream: usize) -> PyResult<()> {
        self.on_stream(Some(stream), |rank, buf| buf.check(&rank.dev))
    }

    /// Device pointers and sizes for zero-copy views:
    /// `(hidden, wts, cu_seqlens, dst, reduce, shard_slots, step_slots, pool)` (0 = absent).
    fn layout(&self) -> (u64, u64, u64, u64, u64, usize, usize, u64) {
        let guard = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let b = &guard.buf;
        (
            b.hidden.ptr(),
            b.wts.ptr(),
            b.cu_seqlens_ptr(),
            b.dst_ptr(),
            b.reduce.as_ref().map_or(0, |r| r.ptr()),
            b.shard_slots(),
            b.step_slots(),
            b.pool.as_ref().map_or(0, |p| p.ptr()),
        )
    }

    /// `experts_to_copy` `[R*epn]` of the latest plan (syncs; for tests and prefetch).
    fn experts_to_copy(&self, stream: usize) -> PyResult<Vec<i32>> {
        self.on_stream(Some(stream), |rank, buf| {
            Ok(buf.read_plan(&rank.dev)?.experts_to_copy)
        })
    }

    /// True when ranks share a GPU (no NCCL).
    fn shares_device(&self) -> bool {
        let guard = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        guard.rank.shares_device()
    }
}

/// True when build.rs embedded the sm_90a kernels.
#[pyfunction]
fn kernels_built() -> bool {
    crate::gpu::driver::kernels_embedded()
}

#[pymodule]
fn _moonep(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_class::<Buffer>()?;
    m.add_function(wrap_pyfunction!(kernels_built, m)?)?;
    Ok(())
}
