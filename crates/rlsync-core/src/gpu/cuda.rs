//! The CUDA backend: the driver API through cudarc's `sys`/`result` layers, loaded at run time — the device's
//! primary context, the kernels' module, rlsync's device and pinned buffers, copies and launches.
//!
//! Every driver call runs inside [`call`]: cudarc panics when `libcuda` or one of its symbols is missing, and
//! [`probe`] loads the library without panicking first, so a missing driver is an error, never a crash. The
//! context is the device's primary context (the one PyTorch uses), retained for as long as a [`Context`] or
//! any buffer made in it lives, and made current on the calling thread for each operation only (the syncer's
//! work runs on any of its threads; the caller's current context, PyTorch's current device, is put back
//! after). Nothing here frees or owns memory that PyTorch allocated: tensors are raw addresses.

use std::ffi::{CString, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, OnceLock};

use cudarc::driver::result::{self, DriverError};
use cudarc::driver::sys;

use super::kernels::{self, Ptx, WIDTHS};
use super::{
    Arg, DriverInfo, GpuError, IPC_HANDLE_BYTES, IpcHandle, KERNELS, Kernel, SINGLE_KERNELS, Stream,
};

/// Run driver call(s) `f` for operation `op`: a driver error or a panic in cudarc becomes a [`GpuError`].
fn call<T>(op: &'static str, f: impl FnOnce() -> Result<T, DriverError>) -> Result<T, GpuError> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(driver_error(op, e)),
        Err(_) => Err(GpuError::Panicked { op }),
    }
}

fn driver_error(op: &'static str, e: DriverError) -> GpuError {
    let name = e
        .error_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|_| "unknown error".to_owned());
    GpuError::Driver {
        op,
        code: e.0 as u32,
        name,
    }
}

/// Load and initialise the driver once per process (the answer is kept: a driver does not appear later).
fn driver() -> Result<DriverInfo, GpuError> {
    static INIT: OnceLock<Result<DriverInfo, String>> = OnceLock::new();
    INIT.get_or_init(|| {
        // SAFETY: loads the library by name without resolving symbols; it never panics.
        let present = catch_unwind(|| unsafe { sys::is_culib_present() }).unwrap_or(false);
        if !present {
            return Err("libcuda.so (libcuda.so.1) was not found by the dynamic loader".to_owned());
        }
        call("cuInit", result::init).map_err(|e| e.to_string())?;
        let mut version = 0;
        // SAFETY: writes one int.
        call("cuDriverGetVersion", || unsafe {
            sys::cuDriverGetVersion(&mut version).result()
        })
        .map_err(|e| e.to_string())?;
        let devices =
            call("cuDeviceGetCount", result::device::get_count).map_err(|e| e.to_string())?;
        Ok(DriverInfo {
            driver_version: version,
            devices: devices.max(0) as usize,
        })
    })
    .clone()
    .map_err(|reason| GpuError::NoDriver { reason })
}

pub(super) fn probe() -> Result<DriverInfo, GpuError> {
    driver()
}

/// A device's primary context, retained while this lives (the [`Context`] and every buffer made in it hold it,
/// so the context outlives the last of them whatever order they are dropped in).
struct Primary {
    dev: sys::CUdevice,
    ctx: sys::CUcontext,
}

// SAFETY: driver handles usable from any thread; every use makes the context current on that thread first.
unsafe impl Send for Primary {}
// SAFETY: as for Send; the handles are never mutated.
unsafe impl Sync for Primary {}

impl Primary {
    /// Make the context current on this thread until the guard drops, which puts back the one that was current
    /// (the caller's: PyTorch's current device).
    fn enter(&self) -> Result<Current, GpuError> {
        let prev = call("cuCtxGetCurrent", result::ctx::get_current)?;
        if prev != Some(self.ctx) {
            // SAFETY: the context is retained while `self` lives.
            call("cuCtxSetCurrent", || unsafe {
                result::ctx::set_current(self.ctx)
            })?;
        }
        Ok(Current {
            restore: (prev != Some(self.ctx)).then_some(prev),
        })
    }
}

impl Drop for Primary {
    fn drop(&mut self) {
        // SAFETY: balances the retain in `Context::open`.
        let _ = call("cuDevicePrimaryCtxRelease", || unsafe {
            result::primary_ctx::release(self.dev)
        });
    }
}

/// While it lives, rlsync's context is current on this thread; dropped, the previous one is again.
struct Current {
    /// The context to make current again (`Some(None)`: none was), `None` when it already was rlsync's.
    restore: Option<Option<sys::CUcontext>>,
}

impl Drop for Current {
    fn drop(&mut self) {
        if let Some(prev) = self.restore {
            // SAFETY: the context that was current before (the caller's, still retained by its owner), or
            // none.
            let _ = call("cuCtxSetCurrent", || unsafe {
                result::ctx::set_current(prev.unwrap_or(std::ptr::null_mut()))
            });
        }
    }
}

/// An open device: its retained primary context and rlsync's module in it.
pub(super) struct Context {
    ordinal: usize,
    primary: Arc<Primary>,
    module: sys::CUmodule,
    /// `[family][width slot]`, families in [`KERNELS`] order.
    functions: [[sys::CUfunction; 4]; KERNELS.len()],
    /// The kernels with one entry point for every width, in [`SINGLE_KERNELS`] order.
    single: [sys::CUfunction; SINGLE_KERNELS.len()],
    sms: usize,
}

// SAFETY: driver handles (device, context, module, functions) may be used from any thread; operations make
// the context current on the calling thread first.
unsafe impl Send for Context {}
// SAFETY: as for Send; the handles are never mutated after `open`.
unsafe impl Sync for Context {}

impl Context {
    pub(super) fn open(ordinal: usize, ptx: &Ptx) -> Result<Context, GpuError> {
        let info = driver()?;
        if ordinal >= info.devices {
            return Err(GpuError::NoDevice {
                ordinal,
                count: info.devices,
            });
        }
        let dev = call("cuDeviceGet", || result::device::get(ordinal as i32))?;
        // SAFETY: `dev` is a valid device; released in Drop (or below on failure).
        let ctx = call("cuDevicePrimaryCtxRetain", || unsafe {
            result::primary_ctx::retain(dev)
        })?;
        // Released when the last holder drops (below on failure).
        let primary = Arc::new(Primary { dev, ctx });
        let loaded = (|| {
            let _current = primary.enter()?;
            let image = CString::new(ptx.text.as_bytes()).map_err(|_| GpuError::PtxNul {
                origin: ptx.origin.clone(),
            })?;
            // SAFETY: a NUL-terminated PTX image; the driver copies what it needs.
            let module = call("cuModuleLoadData", || unsafe {
                result::module::load_data(image.as_ptr().cast())
            })?;
            let get = |kernel: Kernel, width: usize| {
                let name = CString::new(kernels::name(kernel, width)).unwrap_or_default();
                // SAFETY: `module` was just loaded.
                call("cuModuleGetFunction", || unsafe {
                    result::module::get_function(module, name)
                })
            };
            let found = (|| {
                let mut functions = [[std::ptr::null_mut(); 4]; KERNELS.len()];
                for (f, kernel) in KERNELS.into_iter().enumerate() {
                    for (slot, w) in WIDTHS.into_iter().enumerate() {
                        functions[f][slot] = get(kernel, w)?;
                    }
                }
                let mut single = [std::ptr::null_mut(); SINGLE_KERNELS.len()];
                for (f, kernel) in SINGLE_KERNELS.into_iter().enumerate() {
                    single[f] = get(kernel, 1)?;
                }
                // SAFETY: reads one attribute of a valid device.
                let sms = call("cuDeviceGetAttribute", || unsafe {
                    result::device::get_attribute(
                        dev,
                        sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
                    )
                })?;
                Ok((functions, single, sms.max(1) as usize))
            })();
            match found {
                Ok((functions, single, sms)) => Ok((module, functions, single, sms)),
                Err(e) => {
                    // SAFETY: unloads the module loaded above, used by nothing yet.
                    let _ = call("cuModuleUnload", || unsafe {
                        result::module::unload(module)
                    });
                    Err(e)
                }
            }
        })();
        let (module, functions, single, sms) = loaded?;
        Ok(Context {
            ordinal,
            primary,
            module,
            functions,
            single,
            sms,
        })
    }

    /// Make the context current on this thread until the guard drops.
    fn enter(&self) -> Result<Current, GpuError> {
        self.primary.enter()
    }

    pub(super) fn ordinal(&self) -> usize {
        self.ordinal
    }

    pub(super) fn name(&self) -> Result<String, GpuError> {
        call("cuDeviceGetName", || {
            result::device::get_name(self.primary.dev)
        })
    }

    pub(super) fn sm_count(&self) -> usize {
        self.sms
    }

    pub(super) fn blocks_per_sm(&self, kernel: Kernel, width: usize, block: u32) -> usize {
        let Some(f) = self.function(kernel, width) else {
            return 1;
        };
        let Ok(_current) = self.enter() else {
            return 1;
        };
        // SAFETY: `f` belongs to the loaded module.
        call("cuOccupancyMaxActiveBlocksPerMultiprocessor", || unsafe {
            result::occupancy::max_active_block_per_multiprocessor(f, block as i32, 0)
        })
        .map_or(1, |n| n.max(1) as usize)
    }

    pub(super) fn alloc(&self, bytes: usize) -> Result<DeviceBuf, GpuError> {
        let _current = self.enter()?;
        // SAFETY: a fresh allocation of at least one byte in the current context.
        let ptr = call("cuMemAlloc", || unsafe {
            result::malloc_sync(bytes.max(1))
        })?;
        Ok(DeviceBuf {
            ptr,
            len: bytes,
            primary: self.primary.clone(),
        })
    }

    pub(super) fn pinned(&self, bytes: usize) -> Result<PinnedBuf, GpuError> {
        let _current = self.enter()?;
        // Page-locked and cached (never write-combined: the host reads these buffers too), mapped into the
        // device's address space (the kernels may read and write it over the bus).
        let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
        // SAFETY: a fresh allocation of at least one byte; zeroed below before anyone reads it.
        let ptr = call("cuMemHostAlloc", || unsafe {
            result::malloc_host(bytes.max(1), flags)
        })?;
        // SAFETY: `ptr` is a fresh allocation of `bytes.max(1)` bytes.
        unsafe { std::ptr::write_bytes(ptr.cast::<u8>(), 0, bytes) };
        Ok(PinnedBuf {
            ptr: ptr.cast(),
            len: bytes,
            primary: self.primary.clone(),
        })
    }

    /// # Safety
    /// See [`super::Gpu::register`].
    pub(super) unsafe fn register(&self, ptr: *mut u8, len: usize) -> Result<Registered, GpuError> {
        let _current = self.enter()?;
        if len == 0 {
            return Ok(Registered {
                host: std::ptr::null_mut(),
                device: 0,
                primary: self.primary.clone(),
            });
        }
        let flags = sys::CU_MEMHOSTREGISTER_DEVICEMAP | sys::CU_MEMHOSTREGISTER_PORTABLE;
        // SAFETY: the caller keeps the range allocated and in place while the registration lives.
        call("cuMemHostRegister", || unsafe {
            sys::cuMemHostRegister_v2(ptr.cast(), len, flags).result()
        })?;
        let mut device = 0;
        // SAFETY: `ptr` was just registered with DEVICEMAP.
        let mapped = call("cuMemHostGetDevicePointer", || unsafe {
            sys::cuMemHostGetDevicePointer_v2(&mut device, ptr.cast(), 0).result()
        });
        match mapped {
            Ok(()) => Ok(Registered {
                host: ptr,
                device,
                primary: self.primary.clone(),
            }),
            Err(e) => {
                // SAFETY: balances the registration above.
                let _ = call("cuMemHostUnregister", || unsafe {
                    sys::cuMemHostUnregister(ptr.cast()).result()
                });
                Err(e)
            }
        }
    }

    /// # Safety
    /// See [`super::Gpu::read_async`].
    pub(super) unsafe fn dtoh(
        &self,
        dst: *mut u8,
        src: u64,
        len: usize,
        stream: Stream,
    ) -> Result<(), GpuError> {
        if len == 0 {
            return Ok(());
        }
        let _current = self.enter()?;
        // SAFETY: the caller guarantees both ranges.
        call("cuMemcpyDtoHAsync", || unsafe {
            sys::cuMemcpyDtoHAsync_v2(dst.cast(), src, len, stream.raw()).result()
        })
    }

    /// # Safety
    /// See [`super::Gpu::write_async`].
    pub(super) unsafe fn htod(
        &self,
        dst: u64,
        src: *const u8,
        len: usize,
        stream: Stream,
    ) -> Result<(), GpuError> {
        if len == 0 {
            return Ok(());
        }
        let _current = self.enter()?;
        // SAFETY: the caller guarantees both ranges.
        call("cuMemcpyHtoDAsync", || unsafe {
            sys::cuMemcpyHtoDAsync_v2(dst, src.cast(), len, stream.raw()).result()
        })
    }

    /// # Safety
    /// See [`super::Gpu::copy_async`].
    pub(super) unsafe fn dtod(
        &self,
        dst: u64,
        src: u64,
        len: usize,
        stream: Stream,
    ) -> Result<(), GpuError> {
        if len == 0 {
            return Ok(());
        }
        let _current = self.enter()?;
        // SAFETY: the caller guarantees both ranges.
        call("cuMemcpyDtoDAsync", || unsafe {
            result::memcpy_dtod_async(dst, src, len, stream.raw())
        })
    }

    /// # Safety
    /// See [`super::Gpu::zero_async`].
    pub(super) unsafe fn zero(&self, dst: u64, len: usize, stream: Stream) -> Result<(), GpuError> {
        if len == 0 {
            return Ok(());
        }
        let _current = self.enter()?;
        // SAFETY: the caller guarantees the range.
        call("cuMemsetD8Async", || unsafe {
            sys::cuMemsetD8Async(dst, 0, len, stream.raw()).result()
        })
    }

    pub(super) fn sync(&self, stream: Stream) -> Result<(), GpuError> {
        let _current = self.enter()?;
        // SAFETY: a stream of this context (the caller's or the legacy default stream).
        call("cuStreamSynchronize", || unsafe {
            result::stream::synchronize(stream.raw())
        })
    }

    /// # Safety
    /// See [`super::Gpu::launch`].
    pub(super) unsafe fn launch(
        &self,
        kernel: Kernel,
        width: usize,
        grid: u32,
        block: u32,
        args: &[Arg],
        stream: Stream,
    ) -> Result<(), GpuError> {
        let Some(f) = self.function(kernel, width) else {
            return Err(GpuError::Driver {
                op: "cuLaunchKernel",
                code: sys::cudaError_enum::CUDA_ERROR_INVALID_VALUE as u32,
                name: format!("no kernel for {width}-byte elements"),
            });
        };
        if grid == 0 {
            return Ok(());
        }
        let _current = self.enter()?;
        // The driver reads each parameter through a pointer to its value.
        let mut values: Vec<Arg> = args.to_vec();
        let mut params: Vec<*mut c_void> = values
            .iter_mut()
            .map(|a| match a {
                Arg::U32(v) => (v as *mut u32).cast(),
                Arg::U64(v) => (v as *mut u64).cast(),
            })
            .collect();
        // SAFETY: `f` belongs to the loaded module; the caller guarantees the parameters; `values` outlives the
        // call, which copies them.
        call("cuLaunchKernel", || unsafe {
            result::launch_kernel(f, (grid, 1, 1), (block, 1, 1), 0, stream.raw(), &mut params)
        })
    }
}

impl Context {
    /// `kernel`'s entry point for `width`-byte elements (any width for the [`SINGLE_KERNELS`]).
    fn function(&self, kernel: Kernel, width: usize) -> Option<sys::CUfunction> {
        if let Some(k) = SINGLE_KERNELS.iter().position(|&s| s == kernel) {
            return Some(self.single[k]);
        }
        let family = KERNELS.iter().position(|&f| f == kernel)?;
        Some(self.functions[family][kernels::width_slot(width)?])
    }
}

impl Context {
    /// The CUDA IPC handle of device memory rlsync allocated (`cuIpcGetMemHandle`; `addr` is an allocation's
    /// start).
    pub(super) fn ipc_handle(&self, addr: u64) -> Result<IpcHandle, GpuError> {
        let _current = self.enter()?;
        let mut handle = sys::CUipcMemHandle {
            reserved: [0; IPC_HANDLE_BYTES],
        };
        // SAFETY: writes one handle; `addr` is a device allocation of this context (the driver checks it).
        call("cuIpcGetMemHandle", || unsafe {
            sys::cuIpcGetMemHandle(&mut handle, addr).result()
        })?;
        Ok(IpcHandle(handle.reserved.map(|b| b as u8)))
    }

    /// Map another process's allocation into this context (`cuIpcOpenMemHandle_v2`, peer access enabled
    /// lazily when it lives on another GPU); its address here.
    ///
    /// # Safety
    /// The mapping must be closed once ([`Context::ipc_close`]) and not used after.
    pub(super) unsafe fn ipc_open(&self, handle: &IpcHandle) -> Result<u64, GpuError> {
        let _current = self.enter()?;
        let raw = sys::CUipcMemHandle {
            reserved: handle.0.map(|b| b as std::ffi::c_char),
        };
        let mut addr = 0;
        let flags = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32;
        // SAFETY: writes one address; the driver validates the handle.
        call("cuIpcOpenMemHandle", || unsafe {
            sys::cuIpcOpenMemHandle_v2(&mut addr, raw, flags).result()
        })?;
        Ok(addr)
    }

    /// Unmap an allocation mapped by [`Context::ipc_open`].
    ///
    /// # Safety
    /// `addr` came from `ipc_open` on this context, is closed once, and no queued work still uses it.
    pub(super) unsafe fn ipc_close(&self, addr: u64) -> Result<(), GpuError> {
        let _current = self.enter()?;
        // SAFETY: forwarded to the caller.
        call("cuIpcCloseMemHandle", || unsafe {
            sys::cuIpcCloseMemHandle(addr).result()
        })
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        let _current = self.enter();
        // SAFETY: the module was loaded in `open` and no launch can follow (every `Gpu` is gone). The primary
        // context is released once the buffers still holding it are freed too.
        let _ = call("cuModuleUnload", || unsafe {
            result::module::unload(self.module)
        });
    }
}

impl Stream {
    fn raw(self) -> sys::CUstream {
        self.0 as sys::CUstream
    }
}

/// Device memory allocated by rlsync (never a tensor's), freed on drop.
pub struct DeviceBuf {
    ptr: sys::CUdeviceptr,
    len: usize,
    primary: Arc<Primary>,
}

// SAFETY: a device address and its context handle; usable from any thread.
unsafe impl Send for DeviceBuf {}
// SAFETY: as for Send; `&DeviceBuf` only exposes the address.
unsafe impl Sync for DeviceBuf {}

impl DeviceBuf {
    /// The device address.
    pub fn addr(&self) -> u64 {
        self.ptr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for DeviceBuf {
    fn drop(&mut self) {
        // The buffer holds the context retained, so it is still there.
        let _current = self.primary.enter();
        // SAFETY: allocated by `alloc`, freed once; the device work using it was waited for by its owner.
        let _ = call("cuMemFree", || unsafe { result::free_sync(self.ptr) });
    }
}

/// Page-locked host memory allocated by rlsync, zeroed at allocation, freed on drop.
pub struct PinnedBuf {
    ptr: *mut u8,
    len: usize,
    primary: Arc<Primary>,
}

// SAFETY: plain host memory owned by this value.
unsafe impl Send for PinnedBuf {}
// SAFETY: shared access is read-only through `Deref`.
unsafe impl Sync for PinnedBuf {}

impl std::ops::Deref for PinnedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `len` initialised bytes owned by `self`.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl std::ops::DerefMut for PinnedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: `len` initialised bytes owned by `self`, borrowed uniquely.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl PinnedBuf {
    /// The buffer's address for the device (kernels read and write it over the bus).
    pub fn device_addr(&self) -> Result<u64, GpuError> {
        let mut device = 0;
        // SAFETY: the buffer was allocated with CU_MEMHOSTALLOC_DEVICEMAP and lives while `self` does.
        call("cuMemHostGetDevicePointer", || unsafe {
            sys::cuMemHostGetDevicePointer_v2(&mut device, self.ptr.cast(), 0).result()
        })?;
        Ok(device)
    }
}

impl Drop for PinnedBuf {
    fn drop(&mut self) {
        // The buffer holds the context retained, so it is still there.
        let _current = self.primary.enter();
        // SAFETY: allocated by `pinned`, freed once; copies into or out of it were waited for by its owner.
        let _ = call("cuMemFreeHost", || unsafe {
            result::free_host(self.ptr.cast())
        });
    }
}

/// Host memory of rlsync's registered (pinned and mapped) for the device; unregistered on drop.
pub struct Registered {
    host: *mut u8,
    device: u64,
    primary: Arc<Primary>,
}

// SAFETY: the registration's handles; the memory is owned elsewhere.
unsafe impl Send for Registered {}
// SAFETY: as for Send.
unsafe impl Sync for Registered {}

impl Registered {
    /// The device address of the host memory.
    pub fn device_addr(&self) -> u64 {
        self.device
    }
}

impl Drop for Registered {
    fn drop(&mut self) {
        if self.host.is_null() {
            return;
        }
        // The buffer holds the context retained, so it is still there.
        let _current = self.primary.enter();
        // SAFETY: registered by `register`, unregistered once.
        let _ = call("cuMemHostUnregister", || unsafe {
            sys::cuMemHostUnregister(self.host.cast()).result()
        });
    }
}
