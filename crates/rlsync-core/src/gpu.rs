//! The GPU backend's one face: CUDA through cudarc (feature `cuda`) or a dummy that answers "built without
//! CUDA"; the only module that names the feature.
//!
//! Everything above this module is backend-free: [`Gpu`] opens a device (the primary context PyTorch uses),
//! owns rlsync's device and pinned host buffers and launches the kernels of `kernels/rlsync.cu`
//! ([`kernels`]); [`mirror`] stages CUDA tensors through host copies for the host paths (bootstrap,
//! bucket, rejoin, checksums); [`differ`] builds patches on the device (the fused diff kernel, its output
//! collected by [`compact`] into the encoder's input); [`bucket`] packs and unpacks bucket bodies with casts
//! (`bucket_device: cuda`); [`installer`] writes verified patches into CUDA tensors;
//! [`ipc`] is the same-host GPU channel (the diff output shared with rollout processes by CUDA IPC).
//! Loading is dynamic: without `libcuda.so.1` every entry point returns [`GpuError::NoDriver`] (cudarc panics
//! on a missing library, so [`probe`] checks first and every driver call runs behind `catch_unwind`).

pub mod bucket;
pub mod checksum;
pub mod compact;
pub mod differ;
pub mod installer;
pub mod ipc;
pub mod kernels;
pub mod mirror;
pub mod payload;
pub mod reference;

#[cfg(feature = "cuda")]
#[path = "gpu/cuda.rs"]
mod backend;
#[cfg(not(feature = "cuda"))]
#[path = "gpu/dummy.rs"]
mod backend;
/// The dummy in the CUDA build's unit tests too, where its answers are tested (`make test` runs the unit tests
/// in that build only; the build without `cuda` is compiled and linted there, not run).
#[cfg(all(feature = "cuda", test))]
#[path = "gpu/dummy.rs"]
#[allow(dead_code)]
mod dummy;

use std::sync::Arc;

pub use backend::{DeviceBuf, PinnedBuf, Registered};

/// Whether this build has the CUDA backend.
pub const BUILT_WITH_CUDA: bool = cfg!(feature = "cuda");

/// Why a GPU operation could not run.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error(
        "this rlsync was built without CUDA (rlsync-core's `cuda` feature): CUDA tensors need a build with it (the released wheel and `make build` have it)"
    )]
    NotBuilt,
    #[error(
        "no usable CUDA driver: {reason} (CUDA tensors need the NVIDIA driver's libcuda.so.1 on the loader path)"
    )]
    NoDriver { reason: String },
    #[error("CUDA device {ordinal} does not exist: this machine has {count} CUDA device(s)")]
    NoDevice { ordinal: usize, count: usize },
    #[error("CUDA {op} failed: {name} (error {code})")]
    Driver {
        op: &'static str,
        code: u32,
        name: String,
    },
    #[error("the CUDA driver library panicked in {op} (a symbol this driver lacks?)")]
    Panicked { op: &'static str },
    #[error("reading the kernels from RLSYNC_PTX_DIR: {path}")]
    PtxFile {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the kernels' PTX ({origin}) has a NUL byte")]
    PtxNul { origin: String },
}

/// A `cuda…` device string that names no device (`cudax`, `cuda:x`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("not a CUDA device: expected cuda or cuda:N")]
pub struct UnreadableDevice;

/// The CUDA device ordinal of a torch device string (`cuda` is device 0, `cuda:N`); `None` for other devices
/// (`cpu`, `meta`).
pub fn cuda_ordinal(device: &str) -> Option<Result<usize, UnreadableDevice>> {
    let rest = device.strip_prefix("cuda")?;
    Some(match rest.strip_prefix(':') {
        None if rest.is_empty() => Ok(0),
        Some(n) => n.parse().map_err(|_| UnreadableDevice),
        None => Err(UnreadableDevice),
    })
}

/// What [`probe`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DriverInfo {
    /// `cuDriverGetVersion`'s number (e.g. 12040 for CUDA 12.4).
    pub driver_version: i32,
    pub devices: usize,
}

/// Whether CUDA tensors can be synced here: the build has the backend, the driver loads and initialises.
pub fn probe() -> Result<DriverInfo, GpuError> {
    backend::probe()
}

/// A CUDA stream: the raw `CUstream` handle (`torch.cuda.current_stream().cuda_stream`); 0 is the legacy
/// default stream. rlsync never destroys a stream it did not create.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Stream(pub u64);

/// The device addresses of a state dict's CUDA tensors by key (every name of a tied group), and the caller's
/// stream, for the operation about to run: the binding refreshes it before each one, the device build and
/// install read it.
#[derive(Debug, Default)]
pub struct DeviceState {
    pub addrs: std::collections::HashMap<String, u64>,
    pub stream: Stream,
}

/// Bytes of a CUDA IPC memory handle (`CUipcMemHandle`).
pub const IPC_HANDLE_BYTES: usize = 64;

/// A CUDA IPC memory handle: names one of rlsync's device allocations to other processes of the host
/// ([`ipc`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IpcHandle(pub [u8; IPC_HANDLE_BYTES]);

/// One of rlsync's kernel families, per element width (see `kernels/rlsync.cu`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernel {
    DiffCompact,
    Scatter,
    ApplyCompact,
    /// The GPU channel's pool checksum (`checksum_compact`, [`ipc`]).
    ChecksumCompact,
    /// `cast_gather`: one kernel for every width (the bucket device path, [`bucket`]).
    CastGather,
    /// `xxh3_chunks`: the state checksum's chunk digests ([`checksum`]); one kernel for every width.
    Xxh3Chunks,
}

/// The kernels with one entry point for every element width, in the order the backend loads them.
pub const SINGLE_KERNELS: [Kernel; 2] = [Kernel::CastGather, Kernel::Xxh3Chunks];

/// Every kernel family with an entry point per element width, in the order the backend loads them.
pub const KERNELS: [Kernel; 4] = [
    Kernel::DiffCompact,
    Kernel::Scatter,
    Kernel::ApplyCompact,
    Kernel::ChecksumCompact,
];

/// One kernel parameter, of the C type the kernel declares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arg {
    U32(u32),
    U64(u64),
}

/// Where one `diff_compact` launch reads its job table and writes its output (device addresses; see
/// `gpu/compact.rs` for the layouts).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DiffLaunch {
    pub width: usize,
    /// The job table (`DiffJob`s) and how many jobs it holds.
    pub jobs: u64,
    pub njobs: u32,
    pub ntiles: u64,
    /// The output pool (indices, values) and its capacity in changes.
    pub idx: u64,
    pub vals: u64,
    pub capacity: u64,
    /// The reservation cursor (one u64, zeroed here before the launch) and the tile directory.
    pub cursor: u64,
    pub dir: u64,
}

/// An open device: its primary context (shared with PyTorch) and rlsync's kernels loaded in it.
#[derive(Clone)]
pub struct Gpu {
    inner: Arc<backend::Context>,
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Gpu(cuda:{})", self.ordinal())
    }
}

impl Gpu {
    /// Open device `ordinal` (retains its primary context) and load the kernels ([`kernels::ptx`]).
    pub fn open(ordinal: usize) -> Result<Gpu, GpuError> {
        let ptx = kernels::ptx()?;
        Ok(Gpu {
            inner: Arc::new(backend::Context::open(ordinal, &ptx)?),
        })
    }

    pub fn ordinal(&self) -> usize {
        self.inner.ordinal()
    }

    /// The device's name (`NVIDIA H100 80GB HBM3`).
    pub fn name(&self) -> Result<String, GpuError> {
        self.inner.name()
    }

    /// Streaming multiprocessors (sizes persistent grids).
    pub fn sm_count(&self) -> usize {
        self.inner.sm_count()
    }

    /// How many blocks of `block` threads of `kernel` (for `width`-byte elements) fit on one multiprocessor
    /// at once (the driver's occupancy calculator; 1 when it cannot say): sizes grid-stride launches.
    pub fn blocks_per_sm(&self, kernel: Kernel, width: usize, block: u32) -> usize {
        self.inner.blocks_per_sm(kernel, width, block)
    }

    /// `bytes` of device memory owned by rlsync (freed on drop).
    pub fn alloc(&self, bytes: usize) -> Result<DeviceBuf, GpuError> {
        self.inner.alloc(bytes)
    }

    /// `bytes` of pinned host memory (not write-combined: the host reads it), zeroed, mapped for the device
    /// ([`PinnedBuf::device_addr`]).
    pub fn pinned(&self, bytes: usize) -> Result<PinnedBuf, GpuError> {
        self.inner.pinned(bytes)
    }

    /// Pin `len` bytes at `ptr` (host memory rlsync owns) and map them for the device; unregistered on drop.
    ///
    /// # Safety
    /// `ptr..ptr + len` must stay allocated, and not move, while the returned registration lives.
    pub unsafe fn register(&self, ptr: *mut u8, len: usize) -> Result<Registered, GpuError> {
        // SAFETY: forwarded to the caller.
        unsafe { self.inner.register(ptr, len) }
    }

    /// Copy `dst.len()` bytes from device address `src` into `dst`, ordered on `stream` and waited for.
    ///
    /// # Safety
    /// `src..src + dst.len()` must be readable device memory of this device.
    pub unsafe fn read(&self, dst: &mut [u8], src: u64, stream: Stream) -> Result<(), GpuError> {
        // SAFETY: forwarded to the caller.
        unsafe { self.inner.dtoh(dst.as_mut_ptr(), src, dst.len(), stream) }?;
        self.inner.sync(stream)
    }

    /// Copy `src` to device address `dst`, ordered on `stream` and waited for.
    ///
    /// # Safety
    /// `dst..dst + src.len()` must be writable device memory of this device, used by nothing else meanwhile.
    pub unsafe fn write(&self, dst: u64, src: &[u8], stream: Stream) -> Result<(), GpuError> {
        // SAFETY: forwarded to the caller.
        unsafe { self.inner.htod(dst, src.as_ptr(), src.len(), stream) }?;
        self.inner.sync(stream)
    }

    /// Queue a device-to-host copy on `stream` (not waited for).
    ///
    /// # Safety
    /// As [`Gpu::read`], and `dst..dst + len` must be pinned host memory that stays untouched until `stream`
    /// has been synchronised.
    pub unsafe fn read_async(
        &self,
        dst: *mut u8,
        src: u64,
        len: usize,
        stream: Stream,
    ) -> Result<(), GpuError> {
        // SAFETY: forwarded to the caller.
        unsafe { self.inner.dtoh(dst, src, len, stream) }
    }

    /// Queue a host-to-device copy on `stream` (not waited for).
    ///
    /// # Safety
    /// As [`Gpu::write`], and `src..src + len` must be pinned host memory that stays unchanged until `stream`
    /// has been synchronised.
    pub unsafe fn write_async(
        &self,
        dst: u64,
        src: *const u8,
        len: usize,
        stream: Stream,
    ) -> Result<(), GpuError> {
        // SAFETY: forwarded to the caller.
        unsafe { self.inner.htod(dst, src, len, stream) }
    }

    /// Queue a device-to-device copy on `stream`.
    ///
    /// # Safety
    /// Both ranges must be device memory of this device, `dst` writable and unused by anything else meanwhile.
    pub unsafe fn copy_async(
        &self,
        dst: u64,
        src: u64,
        len: usize,
        stream: Stream,
    ) -> Result<(), GpuError> {
        // SAFETY: forwarded to the caller.
        unsafe { self.inner.dtod(dst, src, len, stream) }
    }

    /// Queue zeroing `len` bytes at device address `dst` on `stream`.
    ///
    /// # Safety
    /// `dst..dst + len` must be writable device memory of this device.
    pub unsafe fn zero_async(&self, dst: u64, len: usize, stream: Stream) -> Result<(), GpuError> {
        // SAFETY: forwarded to the caller.
        unsafe { self.inner.zero(dst, len, stream) }
    }

    /// Wait until everything queued on `stream` has run.
    pub fn sync(&self, stream: Stream) -> Result<(), GpuError> {
        self.inner.sync(stream)
    }

    /// Run `queue` (work it queues on `stream`, reading or writing rlsync's pinned buffers), then wait for
    /// the stream whatever `queue` returned: a failure midway must not leave queued copies reading a pinned
    /// buffer the next call rewrites. The first error is returned.
    pub fn settled<T, E: From<GpuError>>(
        &self,
        stream: Stream,
        queue: impl FnOnce() -> Result<T, E>,
    ) -> Result<T, E> {
        let queued = queue();
        let synced = self.sync(stream);
        let value = queued?;
        synced?;
        Ok(value)
    }

    /// The CUDA IPC handle of `buf` (another process of this host opens it with [`Gpu::ipc_open`]).
    pub fn ipc_handle(&self, buf: &DeviceBuf) -> Result<IpcHandle, GpuError> {
        self.inner.ipc_handle(buf.addr())
    }

    /// Map another process's allocation named by `handle` into this device's context (peer access enabled
    /// when it lives on another GPU of the host); its device address here.
    ///
    /// # Safety
    /// The mapping must be closed once with [`Gpu::ipc_close`], after the last work using it has run.
    pub unsafe fn ipc_open(&self, handle: &IpcHandle) -> Result<u64, GpuError> {
        // SAFETY: forwarded to the caller.
        unsafe { self.inner.ipc_open(handle) }
    }

    /// Unmap an allocation mapped by [`Gpu::ipc_open`].
    ///
    /// # Safety
    /// `addr` came from `ipc_open` on this `Gpu`, is closed once, and no queued work still uses it.
    pub unsafe fn ipc_close(&self, addr: u64) -> Result<(), GpuError> {
        // SAFETY: forwarded to the caller.
        unsafe { self.inner.ipc_close(addr) }
    }

    /// Queue one `diff_compact` launch on `stream`: zero its cursor, then one wave of resident blocks (the
    /// driver's occupancy for the width's kernel) grid-striding over the tiles.
    ///
    /// # Safety
    /// Every address in `l` must be rlsync's device memory sized for the launch's layout, and the job table must
    /// name live state and snapshot tensors, until the launch has run.
    pub unsafe fn queue_diff_compact(
        &self,
        l: &DiffLaunch,
        stream: Stream,
    ) -> Result<(), GpuError> {
        const BLOCK: u32 = compact::BLOCK;
        let resident = self.sm_count() * self.blocks_per_sm(Kernel::DiffCompact, l.width, BLOCK);
        let grid = (l.ntiles as usize).min(resident).max(1) as u32;
        let args = [
            Arg::U64(l.jobs),
            Arg::U32(l.njobs),
            Arg::U64(l.ntiles),
            Arg::U64(l.idx),
            Arg::U64(l.vals),
            Arg::U64(l.capacity),
            Arg::U64(l.cursor),
            Arg::U64(l.dir),
        ];
        // SAFETY: forwarded to the caller; the arguments follow diff_compact's signature.
        unsafe {
            self.zero_async(l.cursor, 8, stream)?;
            self.launch(Kernel::DiffCompact, l.width, grid, BLOCK, &args, stream)
        }
    }

    /// Launch `kernel` for elements of `width` bytes with `grid` × `block` threads on `stream`; `args` are
    /// the kernel's parameters in order (device addresses, counts; see `kernels/rlsync.cu`).
    ///
    /// # Safety
    /// `args` must match the kernel's signature, and every address in them must be valid for what the
    /// kernel does with it until the launch has run.
    pub unsafe fn launch(
        &self,
        kernel: Kernel,
        width: usize,
        grid: u32,
        block: u32,
        args: &[Arg],
        stream: Stream,
    ) -> Result<(), GpuError> {
        // SAFETY: forwarded to the caller.
        unsafe { self.inner.launch(kernel, width, grid, block, args, stream) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuda_device_strings_name_their_ordinal() {
        assert_eq!(cuda_ordinal("cpu"), None);
        assert_eq!(cuda_ordinal("meta"), None);
        assert_eq!(cuda_ordinal("cuda"), Some(Ok(0)));
        assert_eq!(cuda_ordinal("cuda:3"), Some(Ok(3)));
        assert_eq!(cuda_ordinal("cuda:x"), Some(Err(UnreadableDevice)));
        assert_eq!(cuda_ordinal("cudax"), Some(Err(UnreadableDevice)));
    }

    #[test]
    fn a_build_without_cuda_answers_that_it_was_built_without_it() {
        #[cfg(not(feature = "cuda"))]
        use super::backend as without_cuda;
        #[cfg(feature = "cuda")]
        use super::dummy as without_cuda;
        assert!(matches!(without_cuda::probe(), Err(GpuError::NotBuilt)));
        let ptx = kernels::ptx().unwrap();
        let open = without_cuda::Context::open(0, &ptx).err();
        assert!(matches!(open, Some(GpuError::NotBuilt)));
        let text = GpuError::NotBuilt.to_string();
        assert!(
            text.contains("built without CUDA") && text.contains("`cuda` feature"),
            "{text}"
        );
    }

    #[test]
    fn without_a_driver_or_the_backend_a_device_is_a_clear_error_not_a_panic() {
        match probe() {
            // A machine with a driver: the device count is what opening checks against.
            Ok(info) => {
                let err = Gpu::open(info.devices).err().map(|e| e.to_string());
                assert!(err.is_some_and(|e| e.contains("does not exist")));
            }
            Err(e) => {
                if BUILT_WITH_CUDA {
                    assert!(matches!(e, GpuError::NoDriver { .. }), "{e}");
                    assert!(e.to_string().contains("libcuda"), "{e}");
                } else {
                    assert!(matches!(e, GpuError::NotBuilt), "{e}");
                }
                let again = Gpu::open(0).err().map(|e| e.to_string());
                assert_eq!(again, Some(e.to_string()));
            }
        }
    }
}
