//! Bucket transfers (the bucket strategy and the init bootstrap): plan buckets, fill them straight into the
//! transport's buffer, and stage / install them on the receiver without ever exposing a partial version.
//!
//! Tensors are visited in order and a bucket closes once its bytes reach the bucket size (a tensor is never
//! split, so a bucket may exceed it). The sender casts floating tensors to the wire dtype while copying into
//! the transport buffer and hashes each chunk while it is still in cache; the receiver copies (or casts)
//! each chunk into a staging storage and hashes it the same way, then verifies before anything is installed.
//! Installing swaps staged storages into the state dict; the displaced storages become the next staging
//! buffers, so steady-state syncs allocate nothing.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use xxhash_rust::xxh3::Xxh3;

use crate::tensor::{cast_bytes, DType, StateDict, Storage};
use crate::transport;

use super::wire::{bucket_layout, read_bucket, write_bucket_table, BucketEntry, Header, KeyMeta, Kind, HEADER_LEN};

/// Bytes copied (and hashed) at a time; a multiple of every element size.
const CHUNK: usize = 256 << 10;

/// One tensor of a planned bucket: the sender's key and what goes on the wire.
#[derive(Debug, Clone)]
pub struct Planned {
    pub key: String,
    pub src: DType,
    pub entry: BucketEntry,
}

/// Split `items` (in order) into buckets closing once they reach `bucket_size` bytes.
pub fn plan(items: Vec<Planned>, bucket_size: u64) -> Vec<Vec<Planned>> {
    let mut buckets = Vec::new();
    let mut cur = Vec::new();
    let mut bytes = 0u64;
    for p in items {
        bytes += p.entry.byte_len as u64;
        cur.push(p);
        if bytes >= bucket_size {
            buckets.push(std::mem::take(&mut cur));
            bytes = 0;
        }
    }
    if !cur.is_empty() {
        buckets.push(cur);
    }
    buckets
}

/// Sizes and times of one bucketed send.
#[derive(Debug, Default, Clone, Copy)]
pub struct SendStats {
    pub payload_bytes: u64,
    /// Time spent casting/copying/hashing into transport buffers.
    pub fill: Duration,
    /// Time spent waiting on the transport (slots, publication).
    pub wait: Duration,
}

/// Send every bucket of one version. All keys must exist in `state` with the planned element counts
/// (checked before anything is published).
pub async fn send(
    ch: &mut transport::Sender,
    state: &StateDict,
    buckets: &[Vec<Planned>],
    kind: Kind,
    version: u64,
    mut tap: Option<&mut Vec<Vec<u8>>>,
) -> Result<SendStats, super::SyncError> {
    for p in buckets.iter().flatten() {
        let t = state.get(&p.key).ok_or_else(|| super::SyncError::StateMismatch { key: p.key.clone(), reason: "missing from the state dict".into() })?;
        if t.dtype() != p.src || t.numel() * p.entry.dtype.size_bytes() != p.entry.byte_len {
            return Err(super::SyncError::StateMismatch { key: p.key.clone(), reason: format!("now {} {:?}, different at init", t.dtype(), t.shape()) });
        }
    }
    let mut stats = SendStats::default();
    let count = u32::try_from(buckets.len()).map_err(|_| super::SyncError::Config { reason: "more than 2^32 buckets".into() })?;
    for (seq, bucket) in buckets.iter().enumerate() {
        let entries: Vec<BucketEntry> = bucket.iter().map(|p| p.entry).collect();
        let (body_len, offsets) = bucket_layout(&entries);
        let mut header = Header::new(kind, version, body_len);
        header.seq = seq as u32;
        header.count = count;
        let start = Instant::now();
        let fill_time = ch
            .send_with(HEADER_LEN + body_len, |buf| {
                let t0 = Instant::now();
                fill(buf, header, bucket, &entries, &offsets, state);
                if let Some(tap) = tap.as_deref_mut() {
                    tap.push(buf.to_vec());
                }
                t0.elapsed()
            })
            .await?;
        stats.fill += fill_time;
        stats.wait += start.elapsed().saturating_sub(fill_time);
        stats.payload_bytes += (HEADER_LEN + body_len) as u64;
    }
    Ok(stats)
}

fn fill(buf: &mut [u8], mut header: Header, bucket: &[Planned], entries: &[BucketEntry], offsets: &[usize], state: &StateDict) {
    let (head, body) = buf.split_at_mut(HEADER_LEN.min(buf.len()));
    let mut h = Xxh3::with_seed(header.checksum_seed());
    let table_end = offsets.first().copied().unwrap_or(body.len());
    body[..table_end].fill(0);
    // The table fits: `bucket_layout` sized the body for it.
    let _ = write_bucket_table(entries, body);
    h.update(&body[..table_end]);
    let mut end_prev = table_end;
    for (p, &off) in bucket.iter().zip(offsets) {
        if off > end_prev {
            body[end_prev..off].fill(0);
            h.update(&body[end_prev..off]);
        }
        let dst = &mut body[off..off + p.entry.byte_len];
        if let Some(t) = state.get(&p.key) {
            let (sw, dw) = (p.src.size_bytes(), p.entry.dtype.size_bytes());
            let elems = CHUNK / 8;
            for (s, d) in t.bytes().chunks(elems * sw).zip(dst.chunks_mut(elems * dw)) {
                // Checked before sending: same element count, castable dtypes.
                let _ = cast_bytes(s, p.src, d, p.entry.dtype);
                h.update(d);
            }
        }
        end_prev = off + p.entry.byte_len;
    }
    if body.len() > end_prev {
        body[end_prev..].fill(0);
        h.update(&body[end_prev..]);
    }
    header.checksum = h.digest();
    let _ = header.write(head);
}

/// Reusable staging storages, keyed by receiver ordinal.
#[derive(Default)]
pub struct Pool {
    free: HashMap<u32, Storage>,
}

impl Pool {
    fn take(&mut self, ordinal: u32, len: usize) -> Storage {
        match self.free.remove(&ordinal) {
            Some(s) if s.len() == len => s,
            _ => Storage::zeroed(len),
        }
    }

    pub fn give(&mut self, ordinal: u32, s: Storage) {
        self.free.insert(ordinal, s);
    }
}

/// A verified bucket's tensors in the receiver's dtypes.
pub type Staged = Vec<(u32, Storage)>;

/// Copy (casting to receiver dtypes) and verify one bucket body. `allowed[ordinal]` says which receiver keys
/// this message kind may carry. Nothing outside `pool` is touched; on error the storages go back to the pool.
pub fn stage(header: &Header, body: &[u8], meta: &[KeyMeta], allowed: &[bool], pool: &mut Pool) -> Result<Staged, String> {
    let entries = read_bucket(body).map_err(|e| e.to_string())?;
    let mut h = Xxh3::with_seed(header.checksum_seed());
    let table_end = entries.first().map_or(body.len(), |(_, r)| r.start);
    h.update(&body[..table_end]);
    let mut staged: Staged = Vec::with_capacity(entries.len());
    let fail = |msg: String, staged: Staged, pool: &mut Pool| {
        for (o, s) in staged {
            pool.give(o, s);
        }
        Err(msg)
    };
    let mut end_prev = table_end;
    for (e, range) in &entries {
        let m = match meta.get(e.ordinal as usize) {
            Some(m) if allowed.get(e.ordinal as usize).copied().unwrap_or(false) => m,
            Some(m) => return fail(format!("key '{}' is not expected in this {}", m.name, header.kind.name()), staged, pool),
            None => return fail(format!("ordinal {} is not a key of the receiver", e.ordinal), staged, pool),
        };
        if staged.iter().any(|(o, _)| *o == e.ordinal) {
            return fail(format!("key '{}' appears twice", m.name), staged, pool);
        }
        let numel = m.shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
        let ok_len = numel.and_then(|n| n.checked_mul(e.dtype.size_bytes())) == Some(e.byte_len);
        let castable = e.dtype == m.dtype || (e.dtype.is_floating() && m.dtype.is_floating());
        if !ok_len || !castable {
            return fail(format!("key '{}': {} bytes of {} do not fit a {} tensor of shape {:?}", m.name, e.byte_len, e.dtype, m.dtype, m.shape), staged, pool);
        }
        h.update(&body[end_prev..range.start]);
        let n = numel.unwrap_or(0);
        let mut dst = pool.take(e.ordinal, n * m.dtype.size_bytes());
        let elems = CHUNK / 8;
        let (sw, dw) = (e.dtype.size_bytes(), m.dtype.size_bytes());
        for (s, d) in body[range.clone()].chunks(elems * sw).zip(dst.bytes_mut().chunks_mut(elems * dw)) {
            h.update(s);
            let _ = cast_bytes(s, e.dtype, d, m.dtype);
        }
        staged.push((e.ordinal, dst));
        end_prev = range.end;
    }
    h.update(&body[end_prev..]);
    if let Err(e) = header.verify_digest(h.digest()) {
        return fail(e.to_string(), staged, pool);
    }
    Ok(staged)
}

/// Check that every staged tensor fits its slot in `state` (before any swap).
pub fn check_fits(staged: &Staged, meta: &[KeyMeta], state: &StateDict) -> Result<(), String> {
    for (o, s) in staged {
        let m = meta.get(*o as usize).ok_or_else(|| format!("ordinal {o} unknown"))?;
        let (name, t) = state.get_index(*o as usize).ok_or_else(|| format!("key '{}' is missing from the state dict", m.name))?;
        if name != m.name || t.dtype() != m.dtype || t.shape() != m.shape.as_slice() || t.bytes().len() != s.len() {
            return Err(format!("state dict entry {o} ('{name}') does not match the metadata sent at init ('{}')", m.name));
        }
    }
    Ok(())
}

/// Swap staged storages into `state` (after [`check_fits`]); returns the displaced storages.
pub fn swap_in(staged: Staged, state: &mut StateDict) -> Staged {
    let mut old = Vec::with_capacity(staged.len());
    for (o, s) in staged {
        if let Some((_, t)) = state.get_index_mut(o as usize) {
            match t.replace_storage(s) {
                Ok(prev) => old.push((o, prev)),
                Err(_) => {}
            }
        }
    }
    old
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(n: usize) -> Planned {
        Planned { key: format!("k{n}"), src: DType::U8, entry: BucketEntry { ordinal: n as u32, dtype: DType::U8, byte_len: n } }
    }

    #[test]
    fn buckets_close_at_size_and_never_split() {
        let sizes = |b: &Vec<Vec<Planned>>| b.iter().map(|v| v.iter().map(|p| p.entry.byte_len).collect::<Vec<_>>()).collect::<Vec<_>>();
        let b = plan(vec![p(3), p(4), p(10), p(1), p(2)], 5);
        assert_eq!(sizes(&b), vec![vec![3, 4], vec![10], vec![1, 2]]);
        let b = plan(vec![p(3), p(4)], 1);
        assert_eq!(sizes(&b), vec![vec![3], vec![4]]);
        assert!(plan(vec![], 5).is_empty());
    }
}
