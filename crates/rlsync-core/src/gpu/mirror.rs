//! Host copies of CUDA tensors: what the syncer's host paths (init bootstrap, buckets, rejoins, checksums)
//! read and write when a state dict lives on the GPU, pulled from and pushed to the device.
//!
//! The copies are ordinary (pageable, cache-line aligned) host memory: pinning the model's size takes
//! seconds per ten gigabytes at allocation (measured: 26 s of a 7B init on an H100 machine), while the copies
//! run only at init, for buckets and for checksums — the device patch path never touches them.

use super::{GpuError, Stream};
use crate::gpu::Gpu;
use crate::tensor::Storage;

/// A CUDA tensor's memory as its owner describes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceTensor {
    /// Device address of the first element.
    pub addr: u64,
    pub bytes: usize,
}

/// One host buffer per device tensor, in the order given.
pub struct Mirror {
    gpu: Gpu,
    tensors: Vec<DeviceTensor>,
    host: Vec<Storage>,
}

impl Mirror {
    /// Host buffers for `tensors` (zeroed, untouched pages cost nothing; [`Mirror::pull`] fills them).
    pub fn new(gpu: &Gpu, tensors: Vec<DeviceTensor>) -> Result<Mirror, GpuError> {
        let host = tensors.iter().map(|t| Storage::zeroed(t.bytes)).collect();
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

    /// Host address of tensor `i`'s copy (cache-line aligned; valid while the mirror lives).
    pub fn host_addr(&self, i: usize) -> Option<usize> {
        self.host.get(i).map(|h| h.bytes().as_ptr() as usize)
    }

    /// Copy every device tensor into its host buffer (waits for `stream`, so the copies see all work queued
    /// on it before).
    pub fn pull(&mut self, stream: Stream) -> Result<(), GpuError> {
        for (t, h) in self.tensors.iter().zip(&mut self.host) {
            // SAFETY: `t` describes a live device tensor (the caller keeps the tensors alive while the mirror
            // is used) and `h` is host memory of exactly its size.
            unsafe { self.gpu.read(h.bytes_mut(), t.addr, stream) }?;
        }
        Ok(())
    }

    /// Copy every host buffer into its device tensor, in `stream` order (waited for).
    pub fn push(&mut self, stream: Stream) -> Result<(), GpuError> {
        for (t, h) in self.tensors.iter().zip(&self.host) {
            // SAFETY: as in `pull`; the device tensor is written by nothing else while the syncer's operation
            // on it runs (the API's contract).
            unsafe { self.gpu.write(t.addr, h.bytes(), stream) }?;
        }
        Ok(())
    }
}
