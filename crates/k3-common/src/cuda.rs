//! The CUDA driver error helper (feature `cuda`): one typed error for a failed driver call.
//!
//! Safe to call on a machine without the driver: names then come from the enum, never from
//! `cuGetErrorName` (calling into an absent library would panic in cudarc's loader).

use std::ffi::{CStr, c_char};

use cudarc::driver::sys::{self, CUresult};

/// A CUDA driver call that did not return `CUDA_SUCCESS`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("CUDA {what}: {name}: {message}")]
pub struct CudaError {
    /// The call or step that failed, e.g. `cuModuleLoadData`.
    pub what: String,
    pub code: CUresult,
    /// `CUDA_ERROR_...`.
    pub name: String,
    /// The driver's description, or the name again without a driver.
    pub message: String,
}

/// `Ok` for `CUDA_SUCCESS`, else a [`CudaError`] naming `what` and the driver's message.
pub fn check(r: CUresult, what: impl Into<String>) -> Result<(), CudaError> {
    if r == CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    let fallback = format!("{r:?}");
    let (name, message) = if driver_loadable() {
        (
            driver_string(r, sys::cuGetErrorName).unwrap_or_else(|| fallback.clone()),
            driver_string(r, sys::cuGetErrorString).unwrap_or_else(|| fallback.clone()),
        )
    } else {
        (fallback.clone(), fallback)
    };
    Err(CudaError {
        what: what.into(),
        code: r,
        name,
        message,
    })
}

/// True when `libcuda.so` can be loaded on this machine.
pub fn driver_loadable() -> bool {
    // SAFETY: only asks whether the shared library can be loaded.
    std::panic::catch_unwind(|| unsafe { sys::is_culib_present() }).unwrap_or(false)
}

type ErrFn = unsafe fn(CUresult, *mut *const c_char) -> CUresult;

fn driver_string(r: CUresult, f: ErrFn) -> Option<String> {
    let mut p: *const c_char = std::ptr::null();
    // SAFETY: the driver writes a pointer to a static NUL-terminated string, or leaves it null.
    let ok = unsafe { f(r, &mut p) } == CUresult::CUDA_SUCCESS;
    // SAFETY: non-null pointers from the driver point at static C strings.
    (ok && !p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn success_is_ok_and_failure_names_the_call_and_code() {
        assert_eq!(check(CUresult::CUDA_SUCCESS, "cuInit"), Ok(()));
        let e = check(CUresult::CUDA_ERROR_INVALID_VALUE, "cuMemAlloc").unwrap_err();
        assert_eq!(e.what, "cuMemAlloc");
        assert_eq!(e.code, CUresult::CUDA_ERROR_INVALID_VALUE);
        assert!(e.name.contains("CUDA_ERROR_INVALID_VALUE"), "{e}");
        let text = e.to_string();
        assert!(
            text.starts_with("CUDA cuMemAlloc: CUDA_ERROR_INVALID_VALUE"),
            "{text}"
        );
    }
}
