//! Raw CUDA driver wrapper: primary context, stream, embedded module, device buffers, events and
//! kernel launches. Raw `CUdeviceptr`s everywhere (IPC needs `cuMemAlloc` memory, not pools).

use std::collections::HashMap;
use std::ffi::c_void;

use cudarc::driver::sys;
pub use k3_common::cuda::check;

use super::GpuError;

/// The sm_90a cubin built by build.rs (empty without nvcc).
static CUBIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/moonep.sm_90a.cubin"));

/// True when build.rs embedded the kernels.
pub fn kernels_embedded() -> bool {
    !CUBIN.is_empty()
}

/// Initialises the driver and returns the device count (error when libcuda is absent).
pub fn device_count() -> Result<usize, GpuError> {
    if !k3_common::cuda::driver_loadable() {
        return Err(GpuError::NoDriver);
    }
    // SAFETY: plain driver calls with valid out-pointers.
    unsafe {
        check(sys::cuInit(0), "cuInit")?;
        let mut n = 0;
        check(sys::cuDeviceGetCount(&mut n), "cuDeviceGetCount")?;
        Ok(n as usize)
    }
}

/// Whether device `a` can access device `b`'s memory directly.
pub fn can_access_peer(a: usize, b: usize) -> Result<bool, GpuError> {
    // SAFETY: plain driver calls with valid out-pointers.
    unsafe {
        let (mut da, mut db, mut ok) = (0, 0, 0);
        check(sys::cuDeviceGet(&mut da, a as i32), "cuDeviceGet")?;
        check(sys::cuDeviceGet(&mut db, b as i32), "cuDeviceGet")?;
        check(
            sys::cuDeviceCanAccessPeer(&mut ok, da, db),
            "cuDeviceCanAccessPeer",
        )?;
        Ok(ok != 0)
    }
}

/// One GPU: primary context made current on this thread, a non-blocking stream, the kernels.
pub struct Device {
    pub ordinal: usize,
    pub dev: sys::CUdevice,
    pub ctx: sys::CUcontext,
    pub stream: sys::CUstream,
    module: sys::CUmodule,
    funcs: std::sync::Mutex<HashMap<&'static str, usize>>,
    pub num_sms: u32,
}

// SAFETY: the handles are plain driver handles usable from any thread once the context is current.
unsafe impl Send for Device {}
// SAFETY: see above; the function cache is behind a mutex.
unsafe impl Sync for Device {}

impl Device {
    /// Opens device `ordinal` and loads the embedded cubin.
    pub fn open(ordinal: usize) -> Result<Device, GpuError> {
        if !kernels_embedded() {
            return Err(GpuError::NoKernels);
        }
        device_count()?;
        // SAFETY: plain driver calls with valid out-pointers; the cubin outlives the call.
        unsafe {
            let mut dev = 0;
            check(sys::cuDeviceGet(&mut dev, ordinal as i32), "cuDeviceGet")?;
            let mut ctx = std::ptr::null_mut();
            check(
                sys::cuDevicePrimaryCtxRetain(&mut ctx, dev),
                "cuDevicePrimaryCtxRetain",
            )?;
            check(sys::cuCtxSetCurrent(ctx), "cuCtxSetCurrent")?;
            let mut stream = std::ptr::null_mut();
            check(
                sys::cuStreamCreate(
                    &mut stream,
                    sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
                ),
                "cuStreamCreate",
            )?;
            let mut module = std::ptr::null_mut();
            check(
                sys::cuModuleLoadData(&mut module, CUBIN.as_ptr() as *const c_void),
                "cuModuleLoadData",
            )?;
            let mut sms = 0;
            check(
                sys::cuDeviceGetAttribute(
                    &mut sms,
                    sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
                    dev,
                ),
                "cuDeviceGetAttribute",
            )?;
            Ok(Device {
                ordinal,
                dev,
                ctx,
                stream,
                module,
                funcs: Default::default(),
                num_sms: sms as u32,
            })
        }
    }

    /// Makes this device's context current on the calling thread.
    pub fn bind(&self) -> Result<(), GpuError> {
        // SAFETY: ctx is a retained primary context.
        check(unsafe { sys::cuCtxSetCurrent(self.ctx) }, "cuCtxSetCurrent")?;
        Ok(())
    }

    fn func(&self, name: &'static str) -> Result<sys::CUfunction, GpuError> {
        let mut map = self.funcs.lock().expect("function cache poisoned");
        if let Some(&f) = map.get(name) {
            return Ok(f as sys::CUfunction);
        }
        let cname = std::ffi::CString::new(name).expect("kernel name");
        let mut f = std::ptr::null_mut();
        // SAFETY: module is loaded; cname is a valid C string.
        check(
            unsafe { sys::cuModuleGetFunction(&mut f, self.module, cname.as_ptr()) },
            "cuModuleGetFunction",
        )?;
        map.insert(name, f as usize);
        Ok(f)
    }

    /// Launches `name` on this device's stream with `args`.
    ///
    /// # Safety
    /// `args` must match the kernel's parameter list exactly, and every pointer argument must be
    /// valid for what the kernel does with it.
    pub unsafe fn launch(
        &self,
        name: &'static str,
        grid: u32,
        block: u32,
        smem: u32,
        mut args: Args,
    ) -> Result<(), GpuError> {
        let f = self.func(name)?;
        if smem > 48 * 1024 {
            // SAFETY: f is a valid function handle.
            check(
                unsafe {
                    sys::cuFuncSetAttribute(
                        f,
                        sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                        smem as i32,
                    )
                },
                "cuFuncSetAttribute",
            )?;
        }
        // SAFETY: forwarded from the caller's contract.
        check(
            unsafe {
                sys::cuLaunchKernel(
                    f,
                    grid.max(1),
                    1,
                    1,
                    block,
                    1,
                    1,
                    smem,
                    self.stream,
                    args.ptrs.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            },
            name,
        )?;
        Ok(())
    }

    /// Waits for all work on this device's stream.
    pub fn sync(&self) -> Result<(), GpuError> {
        // SAFETY: stream is valid.
        check(
            unsafe { sys::cuStreamSynchronize(self.stream) },
            "cuStreamSynchronize",
        )?;
        Ok(())
    }

    /// Allocates `bytes` with `cuMemAlloc` (IPC-capable).
    pub fn alloc(&self, bytes: usize) -> Result<DevBuf, GpuError> {
        let mut ptr = 0;
        // SAFETY: valid out-pointer; size at least 1.
        check(
            unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes.max(16)) },
            "cuMemAlloc",
        )?;
        Ok(DevBuf { ptr, bytes })
    }

    /// Allocates and uploads `data`.
    pub fn upload<T: Copy>(&self, data: &[T]) -> Result<DevBuf, GpuError> {
        let buf = self.alloc(std::mem::size_of_val(data))?;
        buf.write(data)?;
        Ok(buf)
    }

    /// Stream-ordered byte fill.
    pub fn memset_u8(&self, ptr: u64, value: u8, bytes: usize) -> Result<(), GpuError> {
        // SAFETY: caller passes a pointer into an allocation of at least `bytes`.
        check(
            unsafe { sys::cuMemsetD8Async(ptr, value, bytes, self.stream) },
            "cuMemsetD8Async",
        )?;
        Ok(())
    }

    /// Stream-ordered 32-bit fill of `n` words.
    pub fn memset_u32(&self, ptr: u64, value: u32, n: usize) -> Result<(), GpuError> {
        // SAFETY: caller passes a pointer into an allocation of at least `4n` bytes.
        check(
            unsafe { sys::cuMemsetD32Async(ptr, value, n, self.stream) },
            "cuMemsetD32Async",
        )?;
        Ok(())
    }

    /// Stream-ordered device-to-device copy.
    pub fn copy_d2d(&self, dst: u64, src: u64, bytes: usize) -> Result<(), GpuError> {
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: caller passes ranges of at least `bytes` on this device.
        check(
            unsafe { sys::cuMemcpyDtoDAsync_v2(dst, src, bytes, self.stream) },
            "cuMemcpyDtoDAsync",
        )?;
        Ok(())
    }

    /// Creates a timing event.
    pub fn event(&self) -> Result<Event, GpuError> {
        let mut ev = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        check(
            unsafe { sys::cuEventCreate(&mut ev, sys::CUevent_flags::CU_EVENT_DEFAULT as u32) },
            "cuEventCreate",
        )?;
        Ok(Event(ev))
    }

    /// Records `ev` on this device's stream.
    pub fn record(&self, ev: &Event) -> Result<(), GpuError> {
        // SAFETY: event and stream are valid.
        check(
            unsafe { sys::cuEventRecord(ev.0, self.stream) },
            "cuEventRecord",
        )?;
        Ok(())
    }
}

/// A CUDA event with timing enabled.
pub struct Event(sys::CUevent);

impl Event {
    /// Milliseconds from `self` to `end` (both recorded and complete).
    pub fn elapsed_ms(&self, end: &Event) -> Result<f32, GpuError> {
        let mut ms = 0f32;
        // SAFETY: both events are valid.
        check(
            unsafe { sys::cuEventElapsedTime_v2(&mut ms, self.0, end.0) },
            "cuEventElapsedTime",
        )?;
        Ok(ms)
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: event created by cuEventCreate; errors on teardown are ignored.
        unsafe {
            sys::cuEventDestroy_v2(self.0);
        }
    }
}

/// A `cuMemAlloc` allocation, freed on drop.
pub struct DevBuf {
    pub ptr: u64,
    pub bytes: usize,
}

impl DevBuf {
    /// Synchronous upload of `data` to the start of the buffer.
    pub fn write<T: Copy>(&self, data: &[T]) -> Result<(), GpuError> {
        let n = std::mem::size_of_val(data);
        if n > self.bytes {
            return Err(GpuError::Invalid(format!(
                "upload of {n} bytes into {} bytes",
                self.bytes
            )));
        }
        // SAFETY: sizes checked; host slice valid for n bytes.
        check(
            unsafe { sys::cuMemcpyHtoD_v2(self.ptr, data.as_ptr() as *const c_void, n) },
            "cuMemcpyHtoD",
        )?;
        Ok(())
    }

    /// Synchronous download of `n` elements from the start of the buffer.
    pub fn read<T: Copy + Default>(&self, n: usize) -> Result<Vec<T>, GpuError> {
        read_ptr(self.ptr, n)
    }
}

/// Synchronous download of `n` elements of `T` from `ptr`.
pub fn read_ptr<T: Copy + Default>(ptr: u64, n: usize) -> Result<Vec<T>, GpuError> {
    let mut v = vec![T::default(); n];
    // SAFETY: host vector sized for n elements; caller vouches for the device range.
    check(
        unsafe {
            sys::cuMemcpyDtoH_v2(
                v.as_mut_ptr() as *mut c_void,
                ptr,
                std::mem::size_of_val(v.as_slice()),
            )
        },
        "cuMemcpyDtoH",
    )?;
    Ok(v)
}

/// Synchronous upload of `data` to `ptr`.
pub fn write_ptr<T: Copy>(ptr: u64, data: &[T]) -> Result<(), GpuError> {
    // SAFETY: caller vouches for the device range.
    check(
        unsafe {
            sys::cuMemcpyHtoD_v2(
                ptr,
                data.as_ptr() as *const c_void,
                std::mem::size_of_val(data),
            )
        },
        "cuMemcpyHtoD",
    )?;
    Ok(())
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        // SAFETY: ptr came from cuMemAlloc; teardown errors are ignored.
        unsafe {
            sys::cuMemFree_v2(self.ptr);
        }
    }
}

/// Kernel arguments: each value is boxed so its address stays fixed until the launch.
#[derive(Default)]
pub struct Args {
    boxes: Vec<Box<dyn std::any::Any>>,
    ptrs: Vec<*mut c_void>,
}

impl Args {
    /// Starts an empty argument list.
    pub fn new() -> Args {
        Args::default()
    }

    /// Appends one argument (a `#[repr(C)]` value, an integer or a device pointer as `u64`).
    pub fn arg<T: Copy + 'static>(mut self, v: T) -> Args {
        let mut b = Box::new(v);
        self.ptrs.push(std::ptr::from_mut(&mut *b).cast::<c_void>());
        self.boxes.push(b);
        self
    }
}
