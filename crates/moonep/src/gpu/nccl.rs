//! Raw NCCL communicator over cudarc's bindings (multi-process, one rank per process).

use cudarc::nccl::{result, sys};

use super::GpuError;

fn check<T>(r: Result<T, result::NcclError>, what: &'static str) -> Result<T, GpuError> {
    r.map_err(|e| GpuError::Nccl {
        what,
        code: format!("{e:?}"),
    })
}

/// A new NCCL unique id (128 bytes) to hand to every rank.
pub fn unique_id() -> Result<[u8; 128], GpuError> {
    // SAFETY: probing the loader has no preconditions.
    if !unsafe { sys::is_culib_present() } {
        return Err(GpuError::NoNccl);
    }
    let id = check(result::get_uniqueid(), "ncclGetUniqueId")?;
    Ok(id.internal.map(|c| c as u8))
}

/// One rank's communicator; aborted on drop.
pub struct Comm {
    comm: sys::ncclComm_t,
    pub rank: usize,
    pub world: usize,
}

// SAFETY: a communicator may be used from any thread as long as calls are not concurrent; the
// owner (`EpBuffer`/`Rank`) serialises them.
unsafe impl Send for Comm {}

/// NCCL element types used here.
#[derive(Debug, Clone, Copy)]
pub enum Dtype {
    I32,
    U8,
}

impl Dtype {
    fn raw(self) -> sys::ncclDataType_t {
        match self {
            Dtype::I32 => sys::ncclDataType_t::ncclInt32,
            Dtype::U8 => sys::ncclDataType_t::ncclUint8,
        }
    }
}

impl Comm {
    /// `ncclCommInitRank` from the shared unique id (the device context must be current).
    pub fn init(id: &[u8; 128], rank: usize, world: usize) -> Result<Comm, GpuError> {
        // SAFETY: probing the loader has no preconditions.
        if !unsafe { sys::is_culib_present() } {
            return Err(GpuError::NoNccl);
        }
        let uid = sys::ncclUniqueId {
            internal: id.map(|b| b as std::ffi::c_char),
        };
        let mut comm = std::ptr::null_mut();
        // SAFETY: valid out-pointer; id shared by all ranks.
        check(
            unsafe { result::comm_init_rank(&mut comm, world as i32, uid, rank as i32) },
            "ncclCommInitRank",
        )?;
        Ok(Comm { comm, rank, world })
    }

    /// `ncclAllGather` of `count` elements per rank on `stream`.
    pub fn all_gather(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        dt: Dtype,
        stream: cudarc::driver::sys::CUstream,
    ) -> Result<(), GpuError> {
        // SAFETY: caller passes device ranges of count and world*count elements.
        check(
            unsafe {
                result::all_gather(
                    send as *const _,
                    recv as *mut _,
                    count,
                    dt.raw(),
                    self.comm,
                    stream as _,
                )
            },
            "ncclAllGather",
        )
        .map(|_| ())
    }

    /// `ncclSend` (use inside [`group_start`]/[`group_end`]).
    pub fn send(
        &self,
        buf: u64,
        count: usize,
        dt: Dtype,
        peer: usize,
        stream: cudarc::driver::sys::CUstream,
    ) -> Result<(), GpuError> {
        // SAFETY: caller passes a device range of count elements.
        check(
            unsafe {
                result::send(
                    buf as *const _,
                    count,
                    dt.raw(),
                    peer as i32,
                    self.comm,
                    stream as _,
                )
            },
            "ncclSend",
        )
        .map(|_| ())
    }

    /// `ncclRecv` (use inside [`group_start`]/[`group_end`]).
    pub fn recv(
        &self,
        buf: u64,
        count: usize,
        dt: Dtype,
        peer: usize,
        stream: cudarc::driver::sys::CUstream,
    ) -> Result<(), GpuError> {
        // SAFETY: caller passes a device range of count elements.
        check(
            unsafe {
                result::recv(
                    buf as *mut _,
                    count,
                    dt.raw(),
                    peer as i32,
                    self.comm,
                    stream as _,
                )
            },
            "ncclRecv",
        )
        .map(|_| ())
    }
}

/// `ncclGroupStart`.
pub fn group_start() -> Result<(), GpuError> {
    check(result::group_start(), "ncclGroupStart").map(|_| ())
}

/// `ncclGroupEnd`.
pub fn group_end() -> Result<(), GpuError> {
    check(result::group_end(), "ncclGroupEnd").map(|_| ())
}

impl Drop for Comm {
    fn drop(&mut self) {
        // SAFETY: comm came from ncclCommInitRank; teardown errors are ignored.
        unsafe {
            let _ = result::comm_destroy(self.comm);
        }
    }
}
