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
//! a version is received and verified on the host (checksums, manifest) first, its device tensors staged in
//! the wire dtype (no host cast), then [`install_version`] uploads them and casts them into the tensors on
//! the device. A failure of a later bucket therefore writes nothing on the device, with `load_instant` true
//! or false: no device undo copy (which would cost the model's size in device memory and a device copy per
//! bucket) is needed, at the price of host memory for one version in the wire dtype (what `load_instant:
//! false` holds anyway). The device tensors' host copies are neither read nor written (the binding skips
//! its pull and push): they go stale until an operation that reads them pulls, as for a device patch
//! install.

use std::num::NonZeroUsize;

use super::super::SyncError;
use super::super::offload::BucketStager;
use super::super::wire::{BucketEntry, KeyMeta, Kind, Stamp, bucket_layout};
use super::{Outgoing, Planned, SendStats, Staged, bucket_count, check_sources, send_bucket};
use crate::gpu::bucket::{BucketDeviceError, BucketJob, Upload};
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

/// Install a whole verified version (after [`super::check_fits`] with device casts): the tensors `stager`
/// places on its device are uploaded and cast there (each staged in the wire dtype or the tensor's own),
/// the others are installed into `state` on the host. Returns the staging storages for the pool. The
/// version verified whole before this runs, so nothing here can reject it; a device failure may leave it
/// partly written (the receiver's version stays).
pub(crate) fn install_version(
    stager: &mut dyn BucketStager,
    staged: Staged,
    meta: &[KeyMeta],
    state: &mut StateDict,
    threads: NonZeroUsize,
) -> Result<Staged, SyncError> {
    // Each staged tensor with its device tensor (address, dtype), or none: a host tensor.
    let (mut device, mut host) = (Vec::new(), Vec::new());
    for t in staged {
        let target = meta
            .get(t.ordinal as usize)
            .and_then(|m| Some((stager.addr(&m.name)?, m.dtype)));
        match target {
            Some(target) => device.push((t, target)),
            None => host.push(t),
        }
    }
    let uploads: Vec<Upload<'_>> = device
        .iter()
        .map(|(t, (tensor, tensor_dtype))| Upload {
            bytes: t.storage.bytes(),
            dtype: t.dtype,
            tensor: *tensor,
            tensor_dtype: *tensor_dtype,
        })
        .collect();
    let unpacked = stager.device().unpack(&uploads);
    drop(uploads);
    let mut spare = super::install(host, state, threads);
    spare.extend(device.into_iter().map(|(t, _)| t));
    unpacked?;
    Ok(spare)
}

#[cfg(test)]
mod tests;
