//! Symmetric buffers through CUDA IPC: every rank `cuMemAlloc`s its chunk, exports a 64-byte
//! `cuIpcGetMemHandle`, the handles are all-gathered over the store, and each rank opens its
//! peers' chunks (`cuIpcOpenMemHandle`, lazy peer access). Kernels get a device table of `R`
//! base pointers. Peer access must be checked first ([`peer_access_all`]).

use cudarc::driver::sys;

use super::GpuError;
use super::driver::{DevBuf, Device, can_access_peer, check};
use super::store::StoreClient;

/// True when this rank's device can access every peer's device (ordinals all-gathered).
pub fn peer_access_all(dev: &Device, store: &mut StoreClient) -> Result<bool, GpuError> {
    let ords = store.all_gather(&(dev.ordinal as u32).to_le_bytes())?;
    let mut ok = true;
    for o in ords {
        let o = u32::from_le_bytes(
            o[..4]
                .try_into()
                .map_err(|_| GpuError::Env("bad ordinal".into()))?,
        ) as usize;
        if o != dev.ordinal {
            ok &= can_access_peer(dev.ordinal, o)?;
        }
    }
    // Every rank must agree, or the collective paths would diverge.
    let all = store.all_gather(&[ok as u8])?;
    Ok(all.iter().all(|v| v == &[1]))
}

/// One symmetric allocation: the local chunk, the opened peer chunks and a device pointer table.
pub struct SymmBuf {
    pub local: DevBuf,
    /// Base pointer of every rank's chunk as mapped here (own chunk at `me`; 0 when unmapped).
    pub peers: Vec<u64>,
    /// Device array `[R]` of `peers`.
    pub table: DevBuf,
    opened: Vec<u64>,
}

impl SymmBuf {
    /// Collective: allocates `bytes` on every rank and maps all chunks when `map_peers`
    /// (without it only the own chunk is in the table, for the NCCL fallback).
    pub fn new(
        dev: &Device,
        store: &mut StoreClient,
        me: usize,
        bytes: usize,
        map_peers: bool,
    ) -> Result<SymmBuf, GpuError> {
        let local = dev.alloc(bytes)?;
        let world = store.all_gather(&[])?.len();
        let mut peers = vec![0u64; world];
        peers[me] = local.ptr;
        let mut opened = Vec::new();
        if map_peers {
            let mut h = sys::CUipcMemHandle_st { reserved: [0; 64] };
            // SAFETY: local.ptr is a cuMemAlloc base pointer; valid out-pointer.
            check(
                unsafe { sys::cuIpcGetMemHandle(&mut h, local.ptr) },
                "cuIpcGetMemHandle",
            )?;
            let mine: Vec<u8> = h.reserved.iter().map(|&c| c as u8).collect();
            let all = store.all_gather(&mine)?;
            for (r, blob) in all.iter().enumerate() {
                if r == me {
                    continue;
                }
                let mut ph = sys::CUipcMemHandle_st { reserved: [0; 64] };
                for (d, s) in ph.reserved.iter_mut().zip(blob) {
                    *d = *s as std::ffi::c_char;
                }
                let mut p = 0;
                // SAFETY: handle exported by a peer process for a live allocation.
                check(
                    unsafe {
                        sys::cuIpcOpenMemHandle_v2(
                            &mut p,
                            ph,
                            sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
                        )
                    },
                    "cuIpcOpenMemHandle",
                )?;
                peers[r] = p;
                opened.push(p);
            }
        }
        let table = dev.upload(&peers)?;
        Ok(SymmBuf {
            local,
            peers,
            table,
            opened,
        })
    }

    /// Local chunk base pointer.
    pub fn ptr(&self) -> u64 {
        self.local.ptr
    }
}

impl Drop for SymmBuf {
    fn drop(&mut self) {
        for &p in &self.opened {
            // SAFETY: p came from cuIpcOpenMemHandle; teardown errors are ignored.
            unsafe {
                sys::cuIpcCloseMemHandle(p);
            }
        }
    }
}
