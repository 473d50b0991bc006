//! The patch sender's snapshot checksum: hashed on a low-priority thread after a sync, finished by whoever needs
//! it first without waiting for that thread.
//!
//! The checksum is [`state_checksum`](crate::tensor::state_checksum)'s: each tensor's layout and the digests of
//! its [`CHECKSUM_CHUNK`]-byte chunks. The background thread claims chunks one at a time and publishes each
//! digest; [`BackgroundSum::finish`] stops it and digests every chunk not yet published on the caller's
//! threads (a chunk the thread is still on is hashed again: the same value). A nice-19 thread on a busy host
//! may not run for milliseconds, so the caller never waits for it to see the stop: only
//! [`BackgroundSum::join`], before the snapshot is written again, does, by which time it has long stopped.

use std::num::NonZeroUsize;
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::thread::JoinHandle;

use xxhash_rust::xxh3::xxh3_64;

use crate::tensor::checksum::{Piece, digest_chunks};
use crate::tensor::{CHECKSUM_CHUNK, StateHasher};

use super::patch::SnapTensor;
use super::wire::KeyMeta;

/// One chunk of the snapshot: its tensor and byte range.
struct Chunk {
    tensor: usize,
    bytes: Range<usize>,
}

/// The chunks of a snapshot and their digests as far as they are known.
struct Digests {
    chunks: Vec<Chunk>,
    digests: Vec<AtomicU64>,
    /// Whether `digests[i]` holds chunk `i`'s digest (set after it, with release ordering).
    ready: Vec<AtomicBool>,
    /// The next chunk the background thread claims.
    next: AtomicUsize,
    stop: AtomicBool,
}

impl Digests {
    fn new(snap: &[SnapTensor]) -> Digests {
        let chunks: Vec<Chunk> = snap
            .iter()
            .enumerate()
            .flat_map(|(tensor, st)| {
                let len = st.storage.len();
                (0..len.div_ceil(CHECKSUM_CHUNK)).map(move |k| Chunk {
                    tensor,
                    bytes: k * CHECKSUM_CHUNK..((k + 1) * CHECKSUM_CHUNK).min(len),
                })
            })
            .collect();
        let n = chunks.len();
        Digests {
            chunks,
            digests: (0..n).map(|_| AtomicU64::new(0)).collect(),
            ready: (0..n).map(|_| AtomicBool::new(false)).collect(),
            next: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
        }
    }

    fn bytes<'a>(snap: &'a [SnapTensor], chunk: &Chunk) -> &'a [u8] {
        snap.get(chunk.tensor)
            .and_then(|st| st.storage.bytes().get(chunk.bytes.clone()))
            .unwrap_or_default()
    }

    /// Claim the next chunk and publish its digest; `false` once stopped or out of chunks.
    fn digest_next(&self, snap: &[SnapTensor]) -> bool {
        if self.stop.load(Ordering::Relaxed) {
            return false;
        }
        let i = self.next.fetch_add(1, Ordering::Relaxed);
        let Some(chunk) = self.chunks.get(i) else {
            return false;
        };
        self.digests[i].store(xxh3_64(Digests::bytes(snap, chunk)), Ordering::Relaxed);
        self.ready[i].store(true, Ordering::Release);
        true
    }

    /// Stop the background thread and compute the checksum of `snap` (the snapshot these are the chunks of):
    /// the published digests, the others on up to `threads` threads here.
    fn finish(&self, snap: &[SnapTensor], meta: &[KeyMeta], threads: NonZeroUsize) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        let mut digests: Vec<Option<u64>> = self
            .ready
            .iter()
            .zip(&self.digests)
            .map(|(ready, d)| {
                ready
                    .load(Ordering::Acquire)
                    .then(|| d.load(Ordering::Relaxed))
            })
            .collect();
        let missing: Vec<usize> = (0..digests.len())
            .filter(|&i| digests[i].is_none())
            .collect();
        let bytes = missing
            .iter()
            .map(|&i| Digests::bytes(snap, &self.chunks[i]))
            .collect();
        for (i, d) in missing.iter().zip(digest_chunks(bytes, threads)) {
            digests[*i] = Some(d);
        }
        let digests: Vec<u64> = digests.into_iter().map(Option::unwrap_or_default).collect();
        // Each tensor's layout, then its chunks' digests in order.
        let mut at = 0;
        let pieces: Vec<Piece<'_>> = snap
            .iter()
            .map(|st| {
                let n = st.storage.len().div_ceil(CHECKSUM_CHUNK);
                let shape = meta
                    .get(st.ordinal as usize)
                    .map(|m| m.shape.as_slice())
                    .unwrap_or_default();
                let piece = Piece::Digests {
                    layout: (st.key.as_str(), st.dtype, shape),
                    digests: &digests[at..at + n],
                };
                at += n;
                piece
            })
            .collect();
        let mut h = StateHasher::new();
        h.pieces(&pieces, threads);
        h.finish()
    }
}

/// The checksum of `snap` (the receivers' [`state_checksum`](crate::tensor::state_checksum) of the same
/// tensors), on up to `threads` threads.
pub(super) fn snapshot_checksum(
    snap: &[SnapTensor],
    meta: &[KeyMeta],
    threads: NonZeroUsize,
) -> u64 {
    Digests::new(snap).finish(snap, meta, threads)
}

/// The checksum of the snapshot at a sequence, being hashed on a background thread.
pub(super) struct BackgroundSum {
    /// The sequence the snapshot is at.
    pub sequence: u64,
    work: Arc<Digests>,
    snap: Arc<Vec<SnapTensor>>,
    thread: Option<JoinHandle<()>>,
    finished: bool,
}

impl BackgroundSum {
    /// Start hashing `snap` on a thread that first runs `before` (lowers its priority), or say why no thread
    /// could be started.
    pub fn start(
        sequence: u64,
        snap: &Arc<Vec<SnapTensor>>,
        before: impl FnOnce() + Send + 'static,
    ) -> std::io::Result<BackgroundSum> {
        let work = Arc::new(Digests::new(snap));
        let (shared, held) = (Arc::clone(&work), Arc::clone(snap));
        let thread = std::thread::Builder::new()
            .name("rlsync-snapsum".into())
            .spawn(move || {
                before();
                while shared.digest_next(&held) {}
            })?;
        Ok(BackgroundSum {
            sequence,
            work,
            snap: Arc::clone(snap),
            thread: Some(thread),
            finished: false,
        })
    }

    /// Whether [`BackgroundSum::finish`] ran.
    pub fn finished(&self) -> bool {
        self.finished
    }

    /// The checksum, now: the thread is told to stop and what it has not hashed is hashed here on up to
    /// `threads` threads (never waiting for it).
    pub fn finish(&mut self, meta: &[KeyMeta], threads: NonZeroUsize) -> u64 {
        self.finished = true;
        self.work.finish(&self.snap, meta, threads)
    }

    /// Stop the thread and wait until it ended, so that neither it nor this holds the snapshot any more.
    pub fn join(mut self) {
        self.work.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            // A thread that panicked holds nothing either.
            let _ = thread.join();
        }
    }
}

impl Drop for BackgroundSum {
    /// A sum dropped unjoined (its syncer dropped) stops its thread after the chunk it is on, without waiting.
    fn drop(&mut self) {
        self.work.stop.store(true, Ordering::Relaxed);
    }
}

/// A test snapshot: tensors of several chunks (one ending mid-chunk), none, a few bytes and exactly one chunk.
#[cfg(test)]
pub(super) fn test_snapshot() -> (Arc<Vec<SnapTensor>>, Vec<KeyMeta>) {
    use crate::tensor::{DType, Storage};
    let sizes = [2 * CHECKSUM_CHUNK + 5, 0, 3, CHECKSUM_CHUNK];
    let snap: Vec<SnapTensor> = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            let mut storage = Storage::zeroed(n);
            for (j, b) in storage.bytes_mut().iter_mut().enumerate() {
                *b = (j * 31 + i) as u8;
            }
            SnapTensor {
                key: format!("t{i}"),
                ordinal: i as u32,
                dtype: DType::U8,
                cols: n.max(1),
                storage,
            }
        })
        .collect();
    let meta = snap
        .iter()
        .map(|st| KeyMeta {
            name: st.key.clone(),
            dtype: DType::U8,
            shape: vec![st.storage.len()],
        })
        .collect();
    (Arc::new(snap), meta)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::{DType, StateDict, Tensor, state_checksum};

    use super::test_snapshot as snapshot;

    #[test]
    fn the_snapshot_checksum_is_the_receivers_state_checksum() {
        let (snap, meta) = snapshot();
        let whole = snapshot_checksum(&snap, &meta, NonZeroUsize::MIN);
        assert_eq!(
            whole,
            snapshot_checksum(&snap, &meta, NonZeroUsize::new(3).unwrap())
        );
        let mut sd = StateDict::new();
        for st in snap.iter() {
            let t = Tensor::from_bytes(
                DType::U8,
                &[st.storage.len()],
                crate::tensor::Class::Trainable,
                st.storage.bytes(),
            )
            .unwrap();
            sd.insert(st.key.clone(), t);
        }
        let keys: Vec<String> = snap.iter().map(|st| st.key.clone()).collect();
        assert_eq!(whole, state_checksum(&sd, &keys));
    }

    #[test]
    fn finished_after_any_number_of_background_chunks_the_value_is_the_same() {
        let (snap, meta) = snapshot();
        let whole = snapshot_checksum(&snap, &meta, NonZeroUsize::MIN);
        let chunks = Digests::new(&snap).chunks.len();
        assert_eq!(chunks, 3 + 1 + 1, "chunks of the test snapshot");
        for done in 0..=chunks + 1 {
            let work = Digests::new(&snap);
            for _ in 0..done {
                work.digest_next(&snap);
            }
            // A chunk claimed but not yet published (a thread descheduled mid-chunk) is hashed here too.
            work.next.fetch_add(1, Ordering::Relaxed);
            for threads in [1, 2] {
                let threads = NonZeroUsize::new(threads).unwrap();
                assert_eq!(
                    work.finish(&snap, &meta, threads),
                    whole,
                    "{done} chunks done"
                );
            }
            assert!(!work.digest_next(&snap), "a finished sum stops its thread");
        }
    }

    #[test]
    fn finishing_never_waits_for_the_background_thread() {
        let (snap, meta) = snapshot();
        let whole = snapshot_checksum(&snap, &meta, NonZeroUsize::MIN);
        // The thread cannot start hashing until the test lets it (as a nice-19 thread on a busy host).
        let (go, wait) = std::sync::mpsc::channel::<()>();
        let mut sum = BackgroundSum::start(7, &snap, move || {
            let _ = wait.recv();
        })
        .unwrap();
        assert!(!sum.finished());
        assert_eq!(sum.finish(&meta, NonZeroUsize::MIN), whole);
        assert!(sum.finished());
        assert!(Arc::strong_count(&snap) > 1, "the thread still holds it");
        go.send(()).unwrap();
        sum.join();
        assert_eq!(Arc::strong_count(&snap), 1, "no thread holds the snapshot");
    }

    #[test]
    fn a_background_sum_left_to_run_publishes_every_chunk() {
        let (snap, meta) = snapshot();
        let whole = snapshot_checksum(&snap, &meta, NonZeroUsize::MIN);
        let work = Arc::new(Digests::new(&snap));
        let (shared, held) = (Arc::clone(&work), Arc::clone(&snap));
        std::thread::spawn(move || while shared.digest_next(&held) {})
            .join()
            .unwrap();
        assert!(work.ready.iter().all(|r| r.load(Ordering::Acquire)));
        assert_eq!(work.finish(&snap, &meta, NonZeroUsize::MIN), whole);
    }
}
