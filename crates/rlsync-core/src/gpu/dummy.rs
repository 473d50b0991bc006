//! The GPU backend of a build without the `cuda` feature: the same types as `gpu/cuda.rs`, uninhabited, and
//! every entry point answers [`GpuError::NotBuilt`].

use super::kernels::Ptx;
use super::{Arg, DriverInfo, GpuError, IpcHandle, Kernel, Stream};

/// No value of this type exists: nothing can be opened without the backend.
enum Never {}

pub(super) fn probe() -> Result<DriverInfo, GpuError> {
    Err(GpuError::NotBuilt)
}

pub(super) struct Context(Never);

impl Context {
    pub(super) fn open(_ordinal: usize, _ptx: &Ptx) -> Result<Context, GpuError> {
        Err(GpuError::NotBuilt)
    }

    pub(super) fn ordinal(&self) -> usize {
        match self.0 {}
    }

    pub(super) fn name(&self) -> Result<String, GpuError> {
        match self.0 {}
    }

    pub(super) fn sm_count(&self) -> usize {
        match self.0 {}
    }

    pub(super) fn blocks_per_sm(&self, _: Kernel, _: usize, _: u32) -> usize {
        match self.0 {}
    }

    pub(super) fn alloc(&self, _bytes: usize) -> Result<DeviceBuf, GpuError> {
        match self.0 {}
    }

    pub(super) fn pinned(&self, _bytes: usize) -> Result<PinnedBuf, GpuError> {
        match self.0 {}
    }

    /// # Safety
    /// Never callable (no `Context` exists).
    pub(super) unsafe fn register(
        &self,
        _ptr: *mut u8,
        _len: usize,
    ) -> Result<Registered, GpuError> {
        match self.0 {}
    }

    /// # Safety
    /// Never callable (no `Context` exists).
    pub(super) unsafe fn dtoh(
        &self,
        _: *mut u8,
        _: u64,
        _: usize,
        _: Stream,
    ) -> Result<(), GpuError> {
        match self.0 {}
    }

    /// # Safety
    /// Never callable (no `Context` exists).
    pub(super) unsafe fn htod(
        &self,
        _: u64,
        _: *const u8,
        _: usize,
        _: Stream,
    ) -> Result<(), GpuError> {
        match self.0 {}
    }

    /// # Safety
    /// Never callable (no `Context` exists).
    pub(super) unsafe fn dtod(&self, _: u64, _: u64, _: usize, _: Stream) -> Result<(), GpuError> {
        match self.0 {}
    }

    /// # Safety
    /// Never callable (no `Context` exists).
    pub(super) unsafe fn zero(&self, _: u64, _: usize, _: Stream) -> Result<(), GpuError> {
        match self.0 {}
    }

    pub(super) fn sync(&self, _stream: Stream) -> Result<(), GpuError> {
        match self.0 {}
    }

    pub(super) fn ipc_handle(&self, _addr: u64) -> Result<IpcHandle, GpuError> {
        match self.0 {}
    }

    /// # Safety
    /// Never callable (no `Context` exists).
    pub(super) unsafe fn ipc_open(&self, _handle: &IpcHandle) -> Result<u64, GpuError> {
        match self.0 {}
    }

    /// # Safety
    /// Never callable (no `Context` exists).
    pub(super) unsafe fn ipc_close(&self, _addr: u64) -> Result<(), GpuError> {
        match self.0 {}
    }

    /// # Safety
    /// Never callable (no `Context` exists).
    pub(super) unsafe fn launch(
        &self,
        _: Kernel,
        _: usize,
        _: u32,
        _: u32,
        _: &[Arg],
        _: Stream,
    ) -> Result<(), GpuError> {
        match self.0 {}
    }
}

/// Device memory (none exists without the backend).
pub struct DeviceBuf(Never);

impl DeviceBuf {
    pub fn addr(&self) -> u64 {
        match self.0 {}
    }

    pub fn len(&self) -> usize {
        match self.0 {}
    }

    pub fn is_empty(&self) -> bool {
        match self.0 {}
    }
}

/// Pinned host memory (none exists without the backend).
pub struct PinnedBuf(Never);

impl PinnedBuf {
    pub fn device_addr(&self) -> Result<u64, GpuError> {
        match self.0 {}
    }
}

impl std::ops::Deref for PinnedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self.0 {}
    }
}

impl std::ops::DerefMut for PinnedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        match self.0 {}
    }
}

/// A host registration (none exists without the backend).
pub struct Registered(Never);

impl Registered {
    pub fn device_addr(&self) -> u64 {
        match self.0 {}
    }
}
