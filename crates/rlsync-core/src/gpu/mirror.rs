//! Pinned host copies of CUDA tensors: what the syncer's host paths (init bootstrap, buckets, rejoins,
//! checksums) read and write when a state dict lives on the GPU, pulled from and pushed to the device.

use super::{GpuError, PinnedBuf, Stream};
use crate::gpu::Gpu;

/// A CUDA tensor's memory as its owner describes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceTensor {
    /// Device address of the first element.
    pub addr: u64,
    pub bytes: usize,
}

/// One pinned host buffer per device tensor, in the order given.
pub struct Mirror {
    gpu: Gpu,
    tensors: Vec<DeviceTensor>,
    host: Vec<PinnedBuf>,
}

impl Mirror {
    /// Pinned host buffers for `tensors` (zeroed; [`Mirror::pull`] fills them).
    pub fn new(gpu: &Gpu, tensors: Vec<DeviceTensor>) -> Result<Mirror, GpuError> {
        let host = tensors
            .iter()
            .map(|t| gpu.pinned(t.bytes))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Mirror {
            gpu: gpu.clone(),
            tensors,
            host,
        })
    }

    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// The device tensors, in order.
    pub fn tensors(&self) -> &[DeviceTensor] {
        &self.tensors
    }

    /// Whether this mirror copies exactly `tensors` (same addresses and sizes, same order).
    pub fn matches(&self, tensors: &[DeviceTensor]) -> bool {
        self.tensors == tensors
    }

    /// Host address of tensor `i`'s copy (page-aligned; valid while the mirror lives).
    pub fn host_addr(&self, i: usize) -> Option<usize> {
        self.host.get(i).map(|h| h.as_ptr() as usize)
    }

    /// Copy every device tensor into its host buffer (waits for `stream`, so the copies see all work queued
    /// on it before).
    pub fn pull(&mut self, stream: Stream) -> Result<(), GpuError> {
        for (t, h) in self.tensors.iter().zip(&mut self.host) {
            // SAFETY: `t` describes a live device tensor (the caller keeps the tensors alive while the mirror
            // is used) and `h` is pinned memory of exactly its size, untouched until the sync below.
            unsafe { self.gpu.read_async(h.as_mut_ptr(), t.addr, t.bytes, stream) }?;
        }
        self.gpu.sync(stream)
    }

    /// Copy every host buffer into its device tensor, in `stream` order (waited for).
    pub fn push(&mut self, stream: Stream) -> Result<(), GpuError> {
        for (t, h) in self.tensors.iter().zip(&self.host) {
            // SAFETY: as in `pull`; the device tensor is written by nothing else while the syncer's operation
            // on it runs (the API's contract).
            unsafe { self.gpu.write_async(t.addr, h.as_ptr(), t.bytes, stream) }?;
        }
        self.gpu.sync(stream)
    }
}
