//! Bucket syncs staged on a device (`bucket_device: cuda`): the sender packs each bucket's device tensors
//! on the GPU (cast to the wire dtype there) into a pinned host buffer and sends the same wire bytes as the
//! host path; the receiver unpacks verified bucket bodies into device tensors (cast on the GPU).
//!
//! Sender: bucket k + 1 is packed (one `cast_gather` launch and one device-to-host copy, queued on the
//! caller's stream) while bucket k is hashed and sent from its pinned buffer; nothing else of the state is
//! copied to the host. Host tensors of a mixed state dict are read from the state dict in the same bucket,
//! as the host path reads them, so a bucket may hold both. The table, the padding and the checksums are
//! written by the host fill ([`super::send_bucket`]), so the wire bytes are the host path's exactly
//! (`cast_gather` is bit-identical to `cast_bytes`).
//!
//! Receiver: "no reader sees a half-applied version" is kept by verifying before writing: every bucket of
//! a version is received and verified on the host (checksums, manifest) first, then the bodies are unpacked
//! into the tensors. A failure of a later bucket therefore writes nothing on the device, with
//! `load_instant` true or false: no device undo copy (which would cost the model's size in device memory
//! and a device copy per bucket) is needed, at the price of host memory for one version in the wire dtype
//! (what `load_instant: false` holds anyway).

use std::num::NonZeroUsize;

use super::super::SyncError;
use super::super::offload::BucketStager;
use super::super::wire::{BucketEntry, Kind, Stamp, bucket_layout};
use super::{Outgoing, Planned, SendStats, bucket_count, check_sources, send_bucket};
use crate::gpu::bucket::{BucketDeviceError, BucketJob};
use crate::tensor::{DType, StateDict};
use crate::transport;

impl From<BucketDeviceError> for SyncError {
    fn from(e: BucketDeviceError) -> SyncError {
        match e {
            BucketDeviceError::Gpu(g) => SyncError::Gpu(g),
            other => SyncError::BucketDevice(other),
        }
    }
}

/// The device jobs of one bucket (its tensors that `stager` places on the device) and its body length.
fn pack_jobs(stager: &dyn BucketStager, bucket: &[Planned]) -> (Vec<BucketJob>, usize) {
    let entries: Vec<BucketEntry> = bucket.iter().map(|p| p.entry).collect();
    let (body_len, offsets) = bucket_layout(&entries);
    let jobs = bucket
        .iter()
        .zip(offsets)
        .filter_map(|(p, off)| {
            let addr = stager.addr(&p.key)?;
            let numel = p.entry.byte_len / p.entry.dtype.size_bytes();
            Some(BucketJob {
                tensor: addr,
                tensor_dtype: p.src,
                offset: off as u64,
                wire_dtype: p.entry.dtype,
                numel: numel as u64,
            })
        })
        .collect();
    (jobs, body_len)
}

/// Send every bucket of one version (as [`super::send`]) with the device tensors packed by `stager`'s
/// device: two staging slots, bucket k + 1 packed while bucket k is sent.
pub(crate) async fn send_device(
    ch: &mut transport::Sender,
    stager: &mut dyn BucketStager,
    state: &StateDict,
    buckets: &[Vec<Planned>],
    kind: Kind,
    stamp: Stamp,
    part_bytes: usize,
) -> Result<SendStats, SyncError> {
    // Keys, dtypes and sizes are checked on the host view before anything is published.
    let host = check_sources(state, buckets)?;
    let count = bucket_count(buckets)?;
    let mut stats = SendStats::default();
    let queue = |stager: &mut dyn BucketStager, seq: usize| -> Result<(), SyncError> {
        if let Some(bucket) = buckets.get(seq) {
            let (jobs, body_len) = pack_jobs(stager, bucket);
            stager.device().begin_pack(seq % 2, &jobs, body_len)?;
        }
        Ok(())
    };
    queue(stager, 0)?;
    for (seq, (bucket, host_srcs)) in buckets.iter().zip(&host).enumerate() {
        let t0 = std::time::Instant::now();
        let body = stager.device().finish_pack(seq % 2)?;
        queue(stager, seq + 1)?;
        stats.fill += t0.elapsed();
        let entries: Vec<BucketEntry> = bucket.iter().map(|p| p.entry).collect();
        let (_, offsets) = bucket_layout(&entries);
        let mut srcs: Vec<&[u8]> = Vec::with_capacity(bucket.len());
        let mut src_dtypes: Vec<DType> = Vec::with_capacity(bucket.len());
        for ((p, off), h) in bucket.iter().zip(offsets).zip(host_srcs) {
            if stager.addr(&p.key).is_some() {
                srcs.push(body.get(off..off + p.entry.byte_len).unwrap_or_default());
                src_dtypes.push(p.entry.dtype);
            } else {
                srcs.push(h);
                src_dtypes.push(p.src);
            }
        }
        let one = Outgoing {
            seq: seq as u32,
            count,
            bucket,
            srcs: &srcs,
            src_dtypes,
        };
        let sent = send_bucket(ch, None, &one, kind, stamp, part_bytes, &mut stats).await;
        drop(srcs);
        stager.device().recycle(seq % 2, body);
        sent?;
    }
    Ok(stats)
}

/// A verified bucket ready to be written: its entries (the receiver's ordinals), the body, and for each
/// entry the device address and dtype of the tensor it goes to (`None`: a host tensor, left to the host).
// The receiver's device install is not wired into `receiver.rs` yet (it stages on the host and the binding
// pushes its host copies); these are the pieces it will call, tested here.
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) struct VerifiedBucket<'a> {
    pub entries: &'a [BucketEntry],
    pub body: &'a [u8],
    pub targets: Vec<Option<(u64, DType)>>,
}

/// Unpack a whole verified version into its device tensors, bucket by bucket, casting each tensor from
/// the wire dtype to its own on the device. Called only once every bucket of the version has verified.
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) fn unpack_version(
    stager: &mut dyn BucketStager,
    buckets: &[VerifiedBucket<'_>],
    _threads: NonZeroUsize,
) -> Result<(), SyncError> {
    for b in buckets {
        let (_, offsets) = bucket_layout(b.entries);
        let jobs: Vec<BucketJob> = b
            .entries
            .iter()
            .zip(offsets)
            .zip(&b.targets)
            .filter_map(|((e, off), t)| {
                let (tensor, tensor_dtype) = (*t)?;
                Some(BucketJob {
                    tensor,
                    tensor_dtype,
                    offset: off as u64,
                    wire_dtype: e.dtype,
                    numel: (e.byte_len / e.dtype.size_bytes()) as u64,
                })
            })
            .collect();
        stager.device().unpack(b.body, &jobs)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests;
