//! The bucket strategy's device side (`bucket_device: cuda`): `cast_gather`'s job table, the
//! [`BucketDevice`] that packs buckets of CUDA tensors into pinned host buffers (sender) and unpacks verified
//! bucket bodies into the tensors (receiver), on CUDA ([`CudaBucketDevice`]) or the reference memory.
//!
//! A bucket body is laid out by `syncer::wire::bucket_layout` (the entry table, then each tensor at its
//! offset in the wire dtype). The sender's device packs the tensors into a device buffer at those offsets,
//! casting floating tensors to the wire dtype in the same launch (integer and bool tensors are copied,
//! never cast), and copies the buffer into a pinned host buffer; two slots, so bucket k + 1 is packed while
//! bucket k is hashed and on the wire. The host then sends exactly what the host path sends for the same
//! state (the table and padding are written by the host fill, the tensor bytes are the device's), so the
//! wire bytes are the same. The receiver verifies a whole version on the host first (checksums, manifest),
//! staging each device tensor in the wire dtype, then [`BucketDevice::unpack`] uploads them on the caller's
//! stream: a tensor staged in its own dtype is copied straight into it; the others are gathered into an
//! upload buffer (batches of [`UNPACK_BATCH`] bytes) and cast into their tensors by one `cast_gather`
//! launch per batch.

use super::reference::{Memory, ReferenceError};
use super::{Arg, Gpu, GpuError, Kernel, Stream};
use crate::tensor::DType;

/// `cast_gather`'s dtype codes (kernels/rlsync.cu `RLSYNC_DT_*`): the floating dtypes, then raw widths.
pub const DT_F64: u32 = 0;
pub const DT_F32: u32 = 1;
pub const DT_F16: u32 = 2;
pub const DT_BF16: u32 = 3;
pub const DT_RAW1: u32 = 4;
pub const DT_RAW2: u32 = 5;
pub const DT_RAW4: u32 = 6;
pub const DT_RAW8: u32 = 7;

/// Threads per block of a `cast_gather` launch.
pub const CAST_BLOCK: u32 = 256;

/// Queue one `cast_gather` launch on `stream` over the table of `njobs` jobs at `jobs` (device memory, already
/// written or queued before on the stream), `total` elements in all: a grid of at most one wave of resident
/// blocks, striding.
///
/// # Safety
/// The table and every address in it must stay valid until the stream has run the launch.
pub(crate) unsafe fn queue_cast_gather(
    gpu: &super::Gpu,
    jobs: u64,
    njobs: usize,
    total: u64,
    stream: super::Stream,
) -> Result<(), GpuError> {
    let resident = gpu.sm_count() * gpu.blocks_per_sm(Kernel::CastGather, 1, CAST_BLOCK);
    let grid = total
        .div_ceil(u64::from(CAST_BLOCK))
        .min(resident as u64)
        .max(1) as u32;
    let args = [Arg::U64(jobs), Arg::U32(njobs as u32), Arg::U64(total)];
    // SAFETY: the arguments follow cast_gather's signature; the caller keeps the table and its addresses valid.
    unsafe { gpu.launch(Kernel::CastGather, 1, grid, CAST_BLOCK, &args, stream) }
}

/// One `cast_gather` job (`CastJob` in the kernel source): `numel` elements from `src` to `dst`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, bytemuck::Zeroable, bytemuck::Pod)]
pub struct CastJob {
    pub src: u64,
    pub dst: u64,
    /// The job's first element in the launch's element space (prefix sum of the jobs' `numel`).
    pub first: u64,
    pub numel: u64,
    /// Source code | destination code << 8.
    pub codes: u32,
    pub pad: u32,
}

const _: () = assert!(size_of::<CastJob>() == 40);

/// The kernel's code of a floating dtype, or the raw code of its width.
pub fn code(d: DType) -> u32 {
    match d {
        DType::F64 => DT_F64,
        DType::F32 => DT_F32,
        DType::F16 => DT_F16,
        DType::Bf16 => DT_BF16,
        other => match other.size_bytes() {
            1 => DT_RAW1,
            2 => DT_RAW2,
            4 => DT_RAW4,
            _ => DT_RAW8,
        },
    }
}

/// Bytes per element of `code` (`cast_width`).
pub fn code_width(code: u32) -> usize {
    match code {
        DT_F64 | DT_RAW8 => 8,
        DT_F32 | DT_RAW4 => 4,
        DT_F16 | DT_BF16 | DT_RAW2 => 2,
        _ => 1,
    }
}

/// Bytes of staged tensors that need a cast gathered into one upload and one `cast_gather` launch (a larger
/// tensor gets a batch of its own): bounds the device upload buffer, amortises the launch.
pub const UNPACK_BATCH: usize = 64 << 20;

/// Why a bucket could not be packed or unpacked on the device.
#[derive(Debug, thiserror::Error)]
pub enum BucketDeviceError {
    #[error("cannot convert {from} to {to} on the device: only floating dtypes convert")]
    NotFloating { from: DType, to: DType },
    #[error(
        "bucket staging slot {slot} is not packed (slots are 0 and 1, each packed before it is read)"
    )]
    Slot { slot: usize },
    #[error(
        "a job of {numel} elements at bucket offset {offset} runs past the bucket body of {body_len} bytes"
    )]
    Range {
        offset: u64,
        numel: u64,
        body_len: usize,
    },
    #[error("a staged tensor of {bytes} bytes is not a whole number of {dtype} elements")]
    Ragged { bytes: usize, dtype: DType },
    #[error(transparent)]
    Gpu(#[from] GpuError),
    #[error(transparent)]
    Reference(#[from] ReferenceError),
}

/// One tensor of a bucket: its device memory and dtype, and where it lies in the bucket body in which dtype.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BucketJob {
    /// Device address of the tensor's first element.
    pub tensor: u64,
    pub tensor_dtype: DType,
    /// Bucket-body offset of the tensor's wire bytes.
    pub offset: u64,
    pub wire_dtype: DType,
    pub numel: u64,
}

/// One verified tensor to write into a device tensor: its staged bytes in `dtype` (the tensor's own, or a
/// floating dtype it is cast from on the device).
#[derive(Debug, Clone, Copy)]
pub struct Upload<'a> {
    pub bytes: &'a [u8],
    pub dtype: DType,
    /// Device address of the tensor's first element (`bytes.len() / dtype size` elements of `tensor_dtype`).
    pub tensor: u64,
    pub tensor_dtype: DType,
}

/// How an unpack moves its uploads: straight copies, and batches gathered into the upload buffer.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct UnpackPlan {
    /// Uploads (indices) copied as they are: staged in their tensor's dtype.
    pub direct: Vec<usize>,
    pub batches: Vec<UnpackBatch>,
}

/// Uploads gathered into the upload buffer (each at an 8-byte aligned offset) and cast by one launch.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct UnpackBatch {
    /// (upload index, offset in the buffer).
    pub pieces: Vec<(usize, u64)>,
    /// The buffer bytes the batch uses.
    pub len: usize,
    /// The cast jobs, offsets relative to the buffer.
    pub jobs: Vec<BucketJob>,
}

/// Plan `uploads` (checked: whole elements, convertible dtypes) into direct copies and batches of at most
/// `batch` bytes (a larger upload gets a batch of its own).
pub fn unpack_plan(uploads: &[Upload<'_>], batch: usize) -> Result<UnpackPlan, BucketDeviceError> {
    let mut plan = UnpackPlan::default();
    let mut cur = UnpackBatch::default();
    for (i, u) in uploads.iter().enumerate() {
        let width = u.dtype.size_bytes();
        if width == 0 || u.bytes.len() % width != 0 {
            return Err(BucketDeviceError::Ragged {
                bytes: u.bytes.len(),
                dtype: u.dtype,
            });
        }
        if u.bytes.is_empty() {
            continue;
        }
        if u.dtype == u.tensor_dtype {
            plan.direct.push(i);
            continue;
        }
        if !crate::tensor::can_cast(u.dtype, u.tensor_dtype) {
            return Err(BucketDeviceError::NotFloating {
                from: u.dtype,
                to: u.tensor_dtype,
            });
        }
        let offset = cur.len.next_multiple_of(8);
        if !cur.pieces.is_empty() && offset + u.bytes.len() > batch {
            plan.batches.push(std::mem::take(&mut cur));
        }
        let offset = cur.len.next_multiple_of(8);
        cur.pieces.push((i, offset as u64));
        cur.jobs.push(BucketJob {
            tensor: u.tensor,
            tensor_dtype: u.tensor_dtype,
            offset: offset as u64,
            wire_dtype: u.dtype,
            numel: (u.bytes.len() / width) as u64,
        });
        cur.len = offset + u.bytes.len();
    }
    if !cur.pieces.is_empty() {
        plan.batches.push(cur);
    }
    Ok(plan)
}

/// Which way a job table moves the bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// Tensors → bucket buffer, cast to the wire dtype.
    Pack,
    /// Bucket buffer → tensors, cast to the tensors' dtypes.
    Unpack,
}

/// The `cast_gather` table moving `jobs` between their tensors and the bucket buffer at `buffer`
/// (`body_len` bytes); the launch's element count.
pub fn table(
    jobs: &[BucketJob],
    buffer: u64,
    body_len: usize,
    dir: Direction,
) -> Result<(Vec<CastJob>, u64), BucketDeviceError> {
    let mut out = Vec::with_capacity(jobs.len());
    let mut first = 0u64;
    for j in jobs {
        let (from, to) = match dir {
            Direction::Pack => (j.tensor_dtype, j.wire_dtype),
            Direction::Unpack => (j.wire_dtype, j.tensor_dtype),
        };
        if !crate::tensor::can_cast(from, to) {
            return Err(BucketDeviceError::NotFloating { from, to });
        }
        let end = (j.wire_dtype.size_bytes() as u64)
            .checked_mul(j.numel)
            .and_then(|b| b.checked_add(j.offset));
        if end.is_none_or(|e| e > body_len as u64) {
            return Err(BucketDeviceError::Range {
                offset: j.offset,
                numel: j.numel,
                body_len,
            });
        }
        if j.numel == 0 {
            continue;
        }
        let slot = buffer + j.offset;
        let (src, dst) = match dir {
            Direction::Pack => (j.tensor, slot),
            Direction::Unpack => (slot, j.tensor),
        };
        out.push(CastJob {
            src,
            dst,
            first,
            numel: j.numel,
            codes: code(from) | code(to) << 8,
            pad: 0,
        });
        first += j.numel;
    }
    Ok((out, first))
}

/// Packs buckets of device tensors into host memory and unpacks bucket bodies into device tensors.
pub trait BucketDevice: Send {
    /// Queue the pack of one bucket into staging slot `slot` (0 or 1): every job's tensor, cast to its wire
    /// dtype, into the slot's device buffer at its offset, then that buffer (`body_len` bytes) into the slot's
    /// pinned host buffer. Ordered after the work already queued on the caller's stream; not waited for.
    fn begin_pack(
        &mut self,
        slot: usize,
        jobs: &[BucketJob],
        body_len: usize,
    ) -> Result<(), BucketDeviceError>;
    /// Wait for slot `slot`'s pack; the bucket body's bytes (tensors at their offsets; the table and the
    /// padding are not the device's to write, the host fill writes them). Hand the body back with
    /// [`BucketDevice::recycle`] once sent, so the slot's pinned buffer is reused.
    fn finish_pack(&mut self, slot: usize) -> Result<HostBody, BucketDeviceError>;
    /// Give a body [`BucketDevice::finish_pack`] returned back to slot `slot`.
    fn recycle(&mut self, slot: usize, body: HostBody);
    /// Write verified staged tensors into their device tensors ([`unpack_plan`]: straight copies, casts in
    /// batches) on the caller's stream, waited for: the staged bytes may be reused when this returns. Checked
    /// before anything is written.
    fn unpack(&mut self, uploads: &[Upload<'_>]) -> Result<(), BucketDeviceError>;
}

/// A packed bucket body in host memory: a pinned buffer (CUDA) or a vector (reference), `len` bytes used.
pub struct HostBody {
    buf: HostBuf,
    len: usize,
}

enum HostBuf {
    Pinned(super::PinnedBuf),
    Vec(Vec<u8>),
}

impl std::ops::Deref for HostBody {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        let all: &[u8] = match &self.buf {
            HostBuf::Pinned(p) => p,
            HostBuf::Vec(v) => v,
        };
        all.get(..self.len).unwrap_or(all)
    }
}

/// A staging slot on the reference memory.
#[derive(Default)]
struct RefSlot {
    buffer: Option<(u64, usize)>,
    host: Option<Vec<u8>>,
    packed: bool,
}

/// [`BucketDevice`] on the reference [`Memory`] (`cast_gather` run by its CPU reference): what the bucket
/// device path is tested with on machines without a GPU. Tensors are buffers of its memory.
#[derive(Default)]
pub struct ReferenceBucketDevice {
    pub mem: Memory,
    slots: [RefSlot; 2],
    upload: Option<(u64, usize)>,
    /// Launches run (pack and unpack), for tests.
    pub launches: usize,
}

/// A buffer of at least `len` bytes in `mem`, reusing `cur` when it is big enough.
fn ref_buffer(mem: &mut Memory, cur: &mut Option<(u64, usize)>, len: usize) -> u64 {
    match *cur {
        Some((addr, cap)) if cap >= len => addr,
        _ => {
            let addr = mem.alloc(&vec![0u8; len.max(1)]);
            *cur = Some((addr, len.max(1)));
            addr
        }
    }
}

impl BucketDevice for ReferenceBucketDevice {
    fn begin_pack(
        &mut self,
        slot: usize,
        jobs: &[BucketJob],
        body_len: usize,
    ) -> Result<(), BucketDeviceError> {
        let s = self
            .slots
            .get_mut(slot)
            .ok_or(BucketDeviceError::Slot { slot })?;
        let addr = ref_buffer(&mut self.mem, &mut s.buffer, body_len);
        let (cast, total) = table(jobs, addr, body_len, Direction::Pack)?;
        super::reference::cast::cast_gather(&mut self.mem, &cast, total)?;
        self.launches += 1;
        let host = s.host.get_or_insert_default();
        host.clear();
        host.extend_from_slice(self.mem.read(addr, body_len as u64)?);
        s.packed = true;
        Ok(())
    }

    fn finish_pack(&mut self, slot: usize) -> Result<HostBody, BucketDeviceError> {
        match self.slots.get_mut(slot) {
            Some(s) if s.packed => {
                s.packed = false;
                let v = s.host.take().unwrap_or_default();
                Ok(HostBody {
                    len: v.len(),
                    buf: HostBuf::Vec(v),
                })
            }
            _ => Err(BucketDeviceError::Slot { slot }),
        }
    }

    fn recycle(&mut self, slot: usize, body: HostBody) {
        if let (Some(s), HostBuf::Vec(v)) = (self.slots.get_mut(slot), body.buf) {
            s.host = Some(v);
        }
    }

    fn unpack(&mut self, uploads: &[Upload<'_>]) -> Result<(), BucketDeviceError> {
        let plan = unpack_plan(uploads, UNPACK_BATCH)?;
        for &i in &plan.direct {
            let u = uploads[i];
            self.mem
                .write(u.tensor, u.bytes.len() as u64)?
                .copy_from_slice(u.bytes);
        }
        for b in &plan.batches {
            let addr = ref_buffer(&mut self.mem, &mut self.upload, b.len);
            for &(i, off) in &b.pieces {
                let u = uploads[i];
                self.mem
                    .write(addr + off, u.bytes.len() as u64)?
                    .copy_from_slice(u.bytes);
            }
            let (cast, total) = table(&b.jobs, addr, b.len, Direction::Unpack)?;
            super::reference::cast::cast_gather(&mut self.mem, &cast, total)?;
            self.launches += 1;
        }
        Ok(())
    }
}

/// A staging slot on the GPU: a device buffer, a pinned host buffer and the job table.
#[derive(Default)]
struct CudaSlot {
    buffer: Option<super::DeviceBuf>,
    host: Option<super::PinnedBuf>,
    jobs: Option<super::DeviceBuf>,
    /// Bytes of the packed body in `host` while a pack is queued.
    packed: Option<usize>,
}

/// [`BucketDevice`] on a CUDA device: buffers grow to the largest bucket and are kept between syncs.
pub struct CudaBucketDevice {
    gpu: Gpu,
    /// The caller's stream (`torch.cuda.current_stream()`), refreshed before each operation.
    pub stream: Stream,
    slots: [CudaSlot; 2],
    upload: CudaSlot,
}

impl CudaBucketDevice {
    pub fn new(gpu: &Gpu, stream: Stream) -> CudaBucketDevice {
        CudaBucketDevice {
            gpu: gpu.clone(),
            stream,
            slots: Default::default(),
            upload: CudaSlot::default(),
        }
    }

    /// Grow `slot`'s buffers to `body_len` bytes and `njobs` jobs (its pinned host buffer too, if `pinned`).
    /// Nothing queued may still use a buffer this replaces.
    fn reserve(
        gpu: &Gpu,
        slot: &mut CudaSlot,
        body_len: usize,
        njobs: usize,
        pinned: bool,
    ) -> Result<(), GpuError> {
        if slot.buffer.as_ref().is_none_or(|b| b.len() < body_len) {
            slot.buffer = Some(gpu.alloc(body_len.max(1))?);
        }
        if pinned && slot.host.as_ref().is_none_or(|h| h.len() < body_len) {
            slot.host = Some(gpu.pinned(body_len.max(1))?);
        }
        let job_bytes = njobs * size_of::<CastJob>();
        if slot.jobs.as_ref().is_none_or(|j| j.len() < job_bytes) {
            slot.jobs = Some(gpu.alloc(job_bytes.max(1))?);
        }
        Ok(())
    }

    /// Queue `cast` (a table for `total` elements) on the stream: the table upload, then the launch. The
    /// table is copied from pageable memory, which the driver stages before the call returns.
    fn launch(
        &self,
        jobs_buf: &super::DeviceBuf,
        cast: &[CastJob],
        total: u64,
    ) -> Result<(), GpuError> {
        if cast.is_empty() {
            return Ok(());
        }
        let bytes: &[u8] = bytemuck::cast_slice(cast);
        // SAFETY: `jobs_buf` is rlsync's allocation of at least `bytes.len()` bytes (reserve), used by nothing
        // else until the launch below has run (each slot has its own table).
        unsafe { self.gpu.write(jobs_buf.addr(), bytes, self.stream) }?;
        // SAFETY: the table names the caller's live tensors and rlsync's buffers, sized by `table` (checked
        // against the body length) and `reserve`.
        unsafe { queue_cast_gather(&self.gpu, jobs_buf.addr(), cast.len(), total, self.stream) }
    }
}

impl BucketDevice for CudaBucketDevice {
    fn begin_pack(
        &mut self,
        slot: usize,
        jobs: &[BucketJob],
        body_len: usize,
    ) -> Result<(), BucketDeviceError> {
        let mut s = std::mem::take(
            self.slots
                .get_mut(slot)
                .ok_or(BucketDeviceError::Slot { slot })?,
        );
        let queued = (|| {
            Self::reserve(&self.gpu, &mut s, body_len, jobs.len(), true)?;
            let (Some(buffer), Some(host), Some(jobs_buf)) = (&s.buffer, &mut s.host, &s.jobs)
            else {
                return Err(BucketDeviceError::Slot { slot });
            };
            let (cast, total) = table(jobs, buffer.addr(), body_len, Direction::Pack)?;
            self.launch(jobs_buf, &cast, total)?;
            // SAFETY: `buffer` holds `body_len` bytes written by the launch before it on the stream; `host` is
            // pinned and at least as long, and is read only after `finish_pack` synchronised the stream.
            unsafe {
                self.gpu
                    .read_async(host.as_mut_ptr(), buffer.addr(), body_len, self.stream)
            }?;
            Ok(())
        })();
        s.packed = queued.is_ok().then_some(body_len);
        if let Some(dst) = self.slots.get_mut(slot) {
            *dst = s;
        }
        queued
    }

    fn finish_pack(&mut self, slot: usize) -> Result<HostBody, BucketDeviceError> {
        let s = self
            .slots
            .get_mut(slot)
            .ok_or(BucketDeviceError::Slot { slot })?;
        let len = s.packed.ok_or(BucketDeviceError::Slot { slot })?;
        // Waits for this slot's pack and copy (and nothing queued after them: the next bucket's pack is
        // queued only after this returns, so it runs while this body is hashed and sent).
        self.gpu.sync(self.stream)?;
        s.packed = None;
        match s.host.take() {
            Some(h) => Ok(HostBody {
                buf: HostBuf::Pinned(h),
                len,
            }),
            None => Err(BucketDeviceError::Slot { slot }),
        }
    }

    fn recycle(&mut self, slot: usize, body: HostBody) {
        if let (Some(s), HostBuf::Pinned(p)) = (self.slots.get_mut(slot), body.buf) {
            s.host = Some(p);
        }
    }

    fn unpack(&mut self, uploads: &[Upload<'_>]) -> Result<(), BucketDeviceError> {
        let plan = unpack_plan(uploads, UNPACK_BATCH)?;
        for &i in &plan.direct {
            let u = uploads[i];
            // SAFETY: `u.tensor` is the caller's live device tensor of `u.bytes.len()` bytes (its dtype, same
            // element count), written by nothing else during the install (the API's contract).
            unsafe { self.gpu.write(u.tensor, u.bytes, self.stream) }?;
        }
        let mut s = std::mem::take(&mut self.upload);
        let done = (|| {
            // Sized once for the largest batch, before any launch: no buffer is replaced while a launch may
            // still read it. The batches reuse it in stream order.
            if plan.batches.is_empty() {
                return self.gpu.sync(self.stream).map_err(Into::into);
            }
            let len = plan.batches.iter().map(|b| b.len).max().unwrap_or(0);
            let njobs = plan.batches.iter().map(|b| b.jobs.len()).max().unwrap_or(0);
            Self::reserve(&self.gpu, &mut s, len, njobs, false)?;
            let (Some(buffer), Some(jobs_buf)) = (&s.buffer, &s.jobs) else {
                return Err(BucketDeviceError::Slot { slot: 2 });
            };
            for b in &plan.batches {
                for &(i, off) in &b.pieces {
                    let u = uploads[i];
                    // SAFETY: `buffer` is rlsync's allocation of at least `b.len` bytes (reserve), the piece
                    // lies within it (`unpack_plan`); the copy is ordered after the previous batch's launch
                    // on the same stream, so that launch has read the buffer before it is overwritten.
                    unsafe { self.gpu.write(buffer.addr() + off, u.bytes, self.stream) }?;
                }
                let (cast, total) = table(&b.jobs, buffer.addr(), b.len, Direction::Unpack)?;
                self.launch(jobs_buf, &cast, total)?;
            }
            self.gpu.sync(self.stream)?;
            Ok(())
        })();
        self.upload = s;
        done
    }
}

#[cfg(test)]
mod tests;
