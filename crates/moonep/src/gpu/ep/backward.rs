//! The backward of [`EpBuffer`] on the same fixed `S*K` shards (docs/specs/moonep.md §3):
//! combine-backward is a dispatch with the saved plan, dispatch-backward a combine, `reduce_grad` a
//! pull of every replica's weight gradient into its owner.

use super::{EpBuffer, Transport};
use crate::gpu::GpuError;
use crate::gpu::driver::Device;
use crate::gpu::kernels::{Grid, ReduceGrad, ZeroConsumed};
use crate::gpu::rank::Rank;

impl EpBuffer {
    /// Combine-backward: a dispatch of `grad_out` (device bf16 `[s,H]`) with the latest plan
    /// (no planning) into the shards; padding rows become 0, slot weights are kept (the expert
    /// backward still needs them). IPC path only.
    pub fn combine_backward(&self, rank: &Rank, grad_out: u64) -> Result<(), GpuError> {
        self.require_ipc("combine_backward")?;
        self.dispatch_nvlink(&rank.dev, grad_out, 0, false, true)
    }

    /// Dispatch-backward: a combine of the slot gradients the expert backward wrote into the
    /// shards (rows) and slot weights (router-weight grads): `dx` bf16 `[s,H]`, `dw` f32 `[s,K]`
    /// (0 = skip).
    pub fn dispatch_backward(&mut self, rank: &Rank, dx: u64, dw: u64) -> Result<(), GpuError> {
        self.combine(rank, dx, dw)
    }

    /// `reduce_grad`: each home rank adds every replica's reduce slot of its experts (peers in
    /// ascending rank order) into `home_grads` (device f32 `[epn][grad_elems]`); after a mid
    /// barrier every rank zeroes the slots it consumed. IPC path only.
    pub fn reduce_grad(&self, dev: &Device, home_grads: u64) -> Result<(), GpuError> {
        self.require_ipc("reduce_grad")?;
        let reduce = self
            .reduce
            .as_ref()
            .ok_or_else(|| GpuError::Invalid("EpConfig::grad_elems is 0".into()))?;
        let elems = self.cfg.grad_elems as i64;
        let status = self.status_ptr();
        let blocks = (self.cfg.grad_elems.div_ceil(512) as u32).clamp(1, dev.num_sms * 2);
        self.barrier(dev)?;
        // SAFETY: every rank's reduce chunk holds epn*grad_elems f32, home_grads as many.
        unsafe {
            ReduceGrad {
                dims: self.dims,
                etc: self.etc.ptr,
                home_grad: home_grads,
                peer_reduce: reduce.table.ptr,
                elems,
                status,
            }
            .launch(dev, Grid::new(blocks, 512).smem(self.ranks * 4))?
        };
        self.barrier(dev)?;
        // SAFETY: as above, own chunk only.
        unsafe {
            ZeroConsumed {
                dims: self.dims,
                etc: self.etc.ptr,
                own_reduce: reduce.ptr(),
                elems,
                status,
            }
            .launch(dev, Grid::new(blocks, 512))
        }
    }

    fn require_ipc(&self, what: &str) -> Result<(), GpuError> {
        if self.transport == Transport::Nvlink {
            Ok(())
        } else {
            Err(GpuError::Invalid(format!(
                "{what} needs the peer-mapped (IPC) transport"
            )))
        }
    }
}
