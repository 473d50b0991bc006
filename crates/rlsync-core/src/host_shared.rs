//! Host-shared receivers: one double-buffered copy of the weights in shared memory for every rollout of a host.
//!
//! An arena (one POSIX shm segment, 0600, created with O_EXCL, named by the caller) holds a header, reader
//! slots, a layout table and two whole-state buffers A/B (every tensor, frozen ones included, 64-byte aligned).
//! The [`Applier`] (one per host) is the host's only receiver on the weight channel and the only writer. For
//! each version it waits (bounded) until no live reader names the back buffer (clearing the slots of dead
//! pids), catches the back buffer up to the active version as a step of its own (it is two versions old:
//! replay the previous, already validated patch, or copy the active buffer whole) and records that in the
//! back buffer's facts, then streams the version into it as it arrives — patch parts and buckets each
//! validated before they are written and taken back out when a later one fails — while hashing the synced
//! tensors that are final in sync order, so the checksum is ready shortly after the last part. Then it
//! publishes the buffer's version, sequence and checksum and flips the active index. [`Reader`]s (every
//! rollout, the applier's process included) hold a buffer through a slot (pid + buffer) and flip only between
//! their steps. So no reader ever sees a half-applied version, and a rejected update changes nothing a reader
//! can observe (the active index, the generation, the active buffer and its facts); the back buffer, nobody's,
//! is left holding the active version (a patch receiver's) or as it was (a bucket receiver's). This layer sits
//! above [`crate::syncer`] and [`crate::transport`]; the arena's format is `host_shared/layout.rs`, its shared
//! memory and slot protocol `host_shared/arena.rs`.

mod arena;
pub mod layout;

use std::time::{Duration, Instant};

use arena::{BufferMeta, Segment, SegmentError};
use layout::{FormatError, Plan};

use crate::syncer::patch::{self, ValidPatch};
use crate::syncer::settings::SyncerKind;
use crate::syncer::{CatchUpReport, SyncError, SyncReceiver, SyncReport, WeightSyncer, blocking};
use crate::tensor::{StateDict, StateHasher, state_checksum};
use crate::transport;

/// Errors of the host-shared arena.
#[derive(Debug, thiserror::Error)]
pub enum HostSharedError {
    #[error("arena name {name:?}: use 1..=255 characters of [A-Za-z0-9_.-], not starting with '.'")]
    Name { name: String },
    #[error("arena {name}: {max_readers} reader slots (1..={max})", max = layout::MAX_READERS)]
    Readers { name: String, max_readers: usize },
    #[error("arena {name}: the state's tensors are too large to lay out")]
    TooLarge { name: String },
    #[error(
        "arena {name} already exists (another run or applier owns it, or a crash left it: unlink it)"
    )]
    Exists { name: String },
    #[error("arena {name}: shared memory {op}")]
    Segment {
        name: String,
        op: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("arena {name} did not appear within {waited:?}")]
    NotCreated { name: String, waited: Duration },
    #[error("arena {name}: no version was published within {waited:?}")]
    NotPublished { name: String, waited: Duration },
    /// The segment is not an arena this build reads (another program's, another format version, damaged).
    #[error("shared memory segment {name} is not a usable rlsync arena")]
    Foreign {
        name: String,
        #[source]
        source: FormatError,
    },
    /// The arena holds other tensors than the state it is opened for.
    #[error("arena {name} does not hold the model's tensors: {reason}")]
    Layout { name: String, reason: String },
    /// The template's values do not fit the arena laid out from it (cannot happen for a `StateDict`'s own).
    #[error("arena {name}: the template does not fill it")]
    Template {
        name: String,
        #[source]
        source: crate::tensor::LayoutMismatch,
    },
    #[error("arena {name}: all {max_readers} reader slots are taken")]
    NoSlot { name: String, max_readers: usize },
    /// The back buffer stayed held by live readers (pids named) for the whole wait.
    #[error(
        "arena {name}: buffer {buffer} is still held by reader pid(s) {pids:?} after {waited:?}"
    )]
    BackBufferHeld {
        name: String,
        buffer: u8,
        pids: Vec<u32>,
        waited: Duration,
    },
    #[error(
        "arena {name}: no version newer than {than} was published within {waited:?} (holding {held})"
    )]
    NotNewer {
        name: String,
        than: u64,
        held: u64,
        waited: Duration,
    },
    /// A call that needs another state of the applier (`apply` before `init`, `init` on a published arena).
    #[error("arena {name}: {reason}")]
    State { name: String, reason: String },
    /// The weight channel's receiver failed or rejected the update (the parts written into the back buffer
    /// were taken back out: nothing a reader can observe changed).
    #[error("arena {name}: weight sync")]
    Sync {
        name: String,
        #[source]
        source: SyncError,
    },
}

impl HostSharedError {
    /// Whether the weight channel refused an update (nothing a reader can observe changed).
    pub fn is_rejection(&self) -> bool {
        matches!(self, HostSharedError::Sync { source, .. } if source.is_rejection())
    }
}

fn segment_error(name: &str, e: SegmentError) -> HostSharedError {
    let name = name.to_owned();
    match e {
        SegmentError::NotFound => HostSharedError::NotCreated {
            name,
            waited: Duration::ZERO,
        },
        SegmentError::Exists => HostSharedError::Exists { name },
        SegmentError::Incomplete => HostSharedError::Foreign {
            name,
            source: FormatError::Incomplete,
        },
        SegmentError::Io { op, source } => HostSharedError::Segment { name, op, source },
        SegmentError::Format(source) => HostSharedError::Foreign { name, source },
    }
}

fn check_name(name: &str) -> Result<(), HostSharedError> {
    if crate::transport::shm::validate_name(name) {
        Ok(())
    } else {
        Err(HostSharedError::Name {
            name: name.to_owned(),
        })
    }
}

/// A version the applier published.
#[derive(Debug, Clone)]
pub struct Published {
    /// The caller's version (the sender's label).
    pub version: u64,
    /// The sender's sequence number of the installed payload (0: the init bootstrap).
    pub sequence: u64,
    /// The state checksum of the synced keys in this buffer, when the applier verifies.
    pub checksum: Option<u64>,
    /// The buffer now active (0 = A, 1 = B).
    pub buffer: u8,
    /// Sizes and timings of the install.
    pub report: SyncReport,
}

/// The version a reader holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Held {
    pub version: u64,
    pub sequence: u64,
    /// The checksum the applier published for this buffer (`None` when it does not verify).
    pub checksum: Option<u64>,
    /// 0 = A, 1 = B.
    pub buffer: u8,
    /// The arena's publish counter when this buffer was published (strictly increasing).
    pub generation: u64,
}

/// The previous version's validated patch parts, which turn the back buffer (their base) into the active
/// version. Kept as the streaming install validated them (each part's undo owned it already), so replaying
/// them costs only the install: no copy, no second validation.
struct Kept {
    base: u64,
    parts: Vec<ValidPatch>,
}

/// The state checksum of the synced keys of the back buffer, hashed in sync order while a version's parts
/// land: once a part is installed, the synced tensors up to the last one it wrote are final (a version's parts
/// and buckets hold whole tensors, in sync order), so they are hashed then. A part that writes a tensor already
/// hashed (a sender out of that order) makes the fold hash everything again at the end: correct first.
struct Fold<'a> {
    keys: &'a [String],
    /// Per ordinal of the state: its position in sync order, if synced.
    position: &'a [Option<usize>],
    hasher: StateHasher,
    /// The sync positions `..next` are hashed.
    next: usize,
    stale: bool,
}

impl<'a> Fold<'a> {
    fn new(keys: &'a [String], position: &'a [Option<usize>]) -> Fold<'a> {
        Fold {
            keys,
            position,
            hasher: StateHasher::new(),
            next: 0,
            stale: false,
        }
    }

    /// Part installed: it wrote the tensors of `ordinals`.
    fn part(&mut self, ordinals: &[usize], state: &StateDict) {
        if self.stale {
            return;
        }
        let positions = ordinals
            .iter()
            .filter_map(|&o| self.position.get(o).copied().flatten());
        let (mut first, mut last) = (usize::MAX, None::<usize>);
        for p in positions {
            first = first.min(p);
            last = Some(last.map_or(p, |l| l.max(p)));
        }
        if first < self.next {
            self.stale = true;
            return;
        }
        if let Some(last) = last {
            self.hash_to(last + 1, state);
        }
    }

    fn hash_to(&mut self, end: usize, state: &StateDict) {
        let end = end.min(self.keys.len());
        for key in self.keys.get(self.next..end).unwrap_or_default() {
            match state.get(key) {
                Some(t) => {
                    self.hasher.begin_tensor(key, t.dtype(), t.shape());
                    self.hasher.bytes(t.bytes());
                }
                None => self.hasher.missing(key),
            }
        }
        self.next = self.next.max(end);
    }

    /// The version is whole: hash what is left (everything, when a part went out of sync order).
    fn finish(mut self, state: &StateDict) -> u64 {
        if self.stale {
            return state_checksum(state, self.keys);
        }
        self.hash_to(self.keys.len(), state);
        self.hasher.finish()
    }
}

/// The host's only writer of an arena: a receiver on the weight channel installing into the back buffer.
pub struct Applier {
    /// Views of buffers A and B (declared before `seg`, so they go first).
    views: [StateDict; 2],
    seg: Segment,
    name: String,
    receiver: Option<SyncReceiver>,
    kept: Option<Kept>,
    /// The back buffer may differ from the active one outside the synced keys (after a rejoin): copy it whole
    /// before the next install.
    copy_next: bool,
    verify: bool,
    unlink_on_drop: bool,
    synced_keys: Vec<String>,
    /// Per ordinal of the arena's state: its position in `synced_keys`.
    sync_position: Vec<Option<usize>>,
}

/// Between polls of a bounded wait: from 100 µs, doubling, at most 5 ms.
struct Backoff(Duration);

impl Backoff {
    fn new() -> Backoff {
        Backoff(Duration::from_micros(100))
    }

    fn next(&mut self) -> Duration {
        let d = self.0;
        self.0 = (self.0 * 2).min(Duration::from_millis(5));
        d
    }
}

impl Applier {
    /// Create arena `name` laid out like `template` (names, dtypes, shapes, classes, in its order), both buffers
    /// filled with the template's values; nothing published yet (readers wait for [`Applier::init`]). The
    /// arena is unlinked when the applier is dropped unless [`Applier::set_unlink_on_drop`] says otherwise.
    pub fn create(
        name: &str,
        template: &StateDict,
        max_readers: usize,
    ) -> Result<Applier, HostSharedError> {
        check_name(name)?;
        if max_readers == 0 || max_readers > layout::MAX_READERS {
            return Err(HostSharedError::Readers {
                name: name.to_owned(),
                max_readers,
            });
        }
        let plan = Plan::of(template, max_readers).ok_or_else(|| HostSharedError::TooLarge {
            name: name.to_owned(),
        })?;
        let seg = Segment::create(name, plan).map_err(|e| segment_error(name, e))?;
        let mut applier = Applier::over(seg, name);
        for view in &mut applier.views {
            view.copy_values_from(template)
                .map_err(|source| HostSharedError::Template {
                    name: name.to_owned(),
                    source,
                })?;
        }
        Ok(applier)
    }

    /// A restarted applier: reopen the existing arena `name` (its layout must equal `template`'s); then
    /// [`Applier::rejoin`]. The arena stays when this applier is dropped (set [`Applier::set_unlink_on_drop`]).
    pub fn reopen(name: &str, template: &StateDict) -> Result<Applier, HostSharedError> {
        check_name(name)?;
        let seg = Segment::open(name, true).map_err(|e| segment_error(name, e))?;
        let want = Plan::of(template, seg.plan().max_readers).ok_or_else(|| {
            HostSharedError::TooLarge {
                name: name.to_owned(),
            }
        })?;
        if let Some(reason) = layout_difference(&want, seg.plan()) {
            return Err(HostSharedError::Layout {
                name: name.to_owned(),
                reason,
            });
        }
        let mut applier = Applier::over(seg, name);
        applier.unlink_on_drop = false;
        applier.copy_next = true;
        Ok(applier)
    }

    fn over(seg: Segment, name: &str) -> Applier {
        // SAFETY: the views live in the applier beside the segment and are dropped before it; the applier
        // writes only the back buffer, after the slot protocol says no reader holds it.
        let views = unsafe { [seg.buffer_state(0), seg.buffer_state(1)] };
        Applier {
            views,
            seg,
            name: name.to_owned(),
            receiver: None,
            kept: None,
            copy_next: false,
            verify: false,
            unlink_on_drop: true,
            synced_keys: Vec::new(),
            sync_position: Vec::new(),
        }
    }

    /// Take the receiver's synced keys (after init or rejoin) and where each lies in the arena's state.
    fn set_synced_keys(&mut self, keys: Vec<String>) {
        let state = &self.views[0];
        let mut position = vec![None; state.len()];
        for (p, key) in keys.iter().enumerate() {
            if let Some(o) = state.index_of(key)
                && let Some(slot) = position.get_mut(o)
            {
                *slot = Some(p);
            }
        }
        self.synced_keys = keys;
        self.sync_position = position;
    }

    fn err_state(&self, reason: &str) -> HostSharedError {
        HostSharedError::State {
            name: self.name.clone(),
            reason: reason.to_owned(),
        }
    }

    fn sync_err(&self, source: SyncError) -> HostSharedError {
        HostSharedError::Sync {
            name: self.name.clone(),
            source,
        }
    }

    /// Whether dropping this applier unlinks the arena's name (default: yes after `create`, no after `reopen`).
    /// An app whose supervisor owns the name (and unlinks it on every exit path) turns it off.
    pub fn set_unlink_on_drop(&mut self, on: bool) {
        self.unlink_on_drop = on;
    }

    /// The init bootstrap into the arena: `init_receiver` into buffer A, copied to B, published as `version`.
    /// `verify`: compute and publish the state checksum of the synced keys, now and after every install.
    pub async fn init(
        &mut self,
        syncer: WeightSyncer,
        rx: transport::Receiver,
        version: u64,
        verify: bool,
    ) -> Result<Published, HostSharedError> {
        if self.receiver.is_some() || self.seg.published() {
            return Err(self.err_state(
                "init needs a new arena (a reopened one rejoins, an initialised one applies)",
            ));
        }
        let [a, b] = &mut self.views;
        let (receiver, report) =
            syncer
                .init_receiver(a, rx)
                .await
                .map_err(|e| HostSharedError::Sync {
                    name: self.name.clone(),
                    source: e,
                })?;
        // Nothing is published, so no reader holds either buffer.
        let _ = b.copy_values_from(a);
        self.verify = verify;
        self.set_synced_keys(receiver.synced_keys().to_vec());
        let checksum = verify.then(|| state_checksum(&self.views[0], &self.synced_keys));
        let generation = self.seg.generation() + 1;
        let meta = BufferMeta {
            version,
            sequence: receiver.sequence(),
            checksum,
            generation,
        };
        self.seg.set_meta(1, meta);
        self.seg.set_meta(0, meta);
        self.seg.flip(0, generation);
        self.receiver = Some(receiver);
        self.copy_next = false;
        Ok(Published {
            version,
            sequence: meta.sequence,
            checksum,
            buffer: 0,
            report,
        })
    }

    /// Rejoin after a restart ([`Applier::reopen`]): copy the active version into the back buffer (waiting up
    /// to `wait` for readers to leave it), `rejoin_receiver` there holding the active version, publish.
    pub async fn rejoin(
        &mut self,
        syncer: WeightSyncer,
        rx: transport::Receiver,
        verify: bool,
        wait: Duration,
    ) -> Result<(Published, CatchUpReport), HostSharedError> {
        if self.receiver.is_some() || !self.seg.published() {
            return Err(self.err_state(
                "rejoin needs a reopened arena holding a published version (a new one inits)",
            ));
        }
        let active = self.seg.active();
        let back = 1 - active;
        blocking(|| self.wait_back(back, wait))?;
        let held = self.seg.meta(active);
        self.copy_next = true;
        let (front, back_view) = self.split(active);
        let _ = back_view.copy_values_from(front);
        let (receiver, catch_up) = syncer
            .rejoin_receiver(back_view, rx, held.version)
            .await
            .map_err(|e| HostSharedError::Sync {
                name: self.name.clone(),
                source: e,
            })?;
        self.verify = verify;
        self.set_synced_keys(receiver.synced_keys().to_vec());
        let version = receiver.version();
        let sequence = receiver.sequence();
        self.receiver = Some(receiver);
        let report = SyncReport {
            version,
            payload_bytes: catch_up.payload_bytes,
            ..SyncReport::default()
        };
        let checksum = self
            .verify
            .then(|| state_checksum(&self.views[usize::from(back)], &self.synced_keys));
        let published = self.publish(back, version, sequence, checksum, report);
        Ok((published, catch_up))
    }

    /// The active buffer's view and the back buffer's (mutable).
    fn split(&mut self, active: u8) -> (&StateDict, &mut StateDict) {
        let [a, b] = &mut self.views;
        if active == 0 { (a, b) } else { (b, a) }
    }

    /// Wait (bounded) until no live reader names `back`; dead readers' slots are cleared on the way. It polls
    /// on the calling thread (readers leave between their steps, so it is short; the Python binding drives
    /// the applier's futures without a tokio timer).
    fn wait_back(&self, back: u8, wait: Duration) -> Result<(), HostSharedError> {
        let started = Instant::now();
        let mut backoff = Backoff::new();
        while let Some(pause) = self.back_pending(back, started, wait, &mut backoff)? {
            std::thread::sleep(pause);
        }
        Ok(())
    }

    /// One poll of a wait for `back` that began at `started`: `None` once no live reader names it, else how
    /// long to sleep before the next poll; an error once the wait ran out.
    fn back_pending(
        &self,
        back: u8,
        started: Instant,
        wait: Duration,
        backoff: &mut Backoff,
    ) -> Result<Option<Duration>, HostSharedError> {
        let pids = self.seg.holders(back);
        if pids.is_empty() {
            return Ok(None);
        }
        let waited = started.elapsed();
        if waited >= wait {
            return Err(HostSharedError::BackBufferHeld {
                name: self.name.clone(),
                buffer: back,
                pids,
                waited,
            });
        }
        Ok(Some(backoff.next().min(wait - waited)))
    }

    /// Publish `buffer` (its contents complete, `checksum` its synced keys' when verifying): its facts, then
    /// the flip.
    fn publish(
        &mut self,
        buffer: u8,
        version: u64,
        sequence: u64,
        checksum: Option<u64>,
        report: SyncReport,
    ) -> Published {
        let generation = self.seg.generation() + 1;
        self.seg.set_meta(
            buffer,
            BufferMeta {
                version,
                sequence,
                checksum,
                generation,
            },
        );
        self.seg.flip(buffer, generation);
        Published {
            version,
            sequence,
            checksum,
            buffer,
            report,
        }
    }

    /// Wait (up to `wait`) for the back buffer, catch it up to the active version, then receive the next
    /// version into it as it arrives (each part validated before it is written; the checksum folded in as the
    /// parts land) and publish it. A wait that runs out consumes nothing: `apply` may be called again. A
    /// rejected update (stale, another base, corrupt, does not fit) or a channel wait that runs out between
    /// parts changes nothing a reader can observe: the parts written are taken back out (a patch version's
    /// are kept for the next call, which goes on from there), so the back buffer holds the active version (a
    /// patch receiver's, after the catch-up) or what it held before (a bucket receiver's).
    pub async fn apply(&mut self, wait: Duration) -> Result<Published, HostSharedError> {
        if self.receiver.is_none() {
            return Err(self.err_state("apply before init or rejoin"));
        }
        let active = self.seg.active();
        let back = 1 - active;
        blocking(|| self.wait_back(back, wait))?;
        blocking(|| self.catch_up(active));
        let base = self.seg.meta(active).sequence;
        let Applier {
            views,
            receiver,
            verify,
            synced_keys,
            sync_position,
            ..
        } = self;
        let Some(receiver) = receiver.as_mut() else {
            return Err(self.err_state("apply before init or rejoin"));
        };
        let back_view = &mut views[usize::from(back)];
        let mut fold = verify.then(|| Fold::new(synced_keys, sync_position));
        let streamed = receiver
            .apply_streamed(back_view, &mut |ordinals, state| {
                if let Some(f) = fold.as_mut() {
                    f.part(ordinals, state);
                }
            })
            .await;
        let (mut report, parts) = match streamed {
            Ok(done) => done,
            Err(e) => return Err(self.sync_err(e)),
        };
        let (version, sequence) = (receiver.version(), receiver.sequence());
        let t0 = Instant::now();
        let checksum = fold.map(|f| blocking(|| f.finish(back_view)));
        report.decode += t0.elapsed();
        self.kept = (!parts.is_empty()).then_some(Kept { base, parts });
        Ok(self.publish(back, version, sequence, checksum, report))
    }

    /// Make the back buffer (free of readers) hold the active version, and record that in its facts: nothing
    /// when it does already; replay the kept patch when the back buffer is its base; else copy the active
    /// buffer whole (after a rejoin, or without a kept patch that fits). A bucket receiver's next version
    /// rewrites every synced tensor, so its back buffer is copied only after a rejoin (the keys it does not
    /// sync may differ there).
    fn catch_up(&mut self, active: u8) {
        let back = 1 - active;
        let front_meta = self.seg.meta(active);
        let back_meta = self.seg.meta(back);
        let kept = self.kept.take();
        let (bucket, threads) = match &self.receiver {
            Some(r) => (r.kind() == SyncerKind::Bucket, r.threads()),
            None => return,
        };
        let copy_next = self.copy_next;
        let (front, back_view) = self.split(active);
        match &kept {
            _ if copy_next => {
                let _ = back_view.copy_values_from(front);
            }
            _ if bucket => return,
            _ if back_meta.sequence == front_meta.sequence => return,
            Some(k) if k.base == back_meta.sequence => {
                for part in &k.parts {
                    patch::install(part, back_view, threads);
                }
            }
            _ => {
                let _ = back_view.copy_values_from(front);
            }
        }
        self.copy_next = false;
        self.seg.set_meta(back, front_meta);
    }

    /// The pids of the live readers holding the back buffer now (dead readers' slots are cleared).
    pub fn back_buffer_holders(&self) -> Vec<u32> {
        self.seg.holders(1 - self.seg.active())
    }

    /// Wait (up to `wait`) until no live reader holds the back buffer (clearing dead readers' slots); a
    /// [`HostSharedError::BackBufferHeld`] names the pids still holding it. Readers only ever take the active
    /// buffer, so once this returns the back buffer stays free until the next publish.
    pub fn wait_back_buffer(&self, wait: Duration) -> Result<(), HostSharedError> {
        self.wait_back(1 - self.seg.active(), wait)
    }

    /// [`Applier::wait_back_buffer`] for a tokio task: the same bounded wait, with tokio's timer between the
    /// polls, so dropping the future (the task aborted at a worker's `Stop`) ends it at once, where the
    /// blocking wait would run on for up to `wait`. Needs a tokio runtime with its timer (the Python binding,
    /// which drives the applier without one, uses the blocking wait).
    pub async fn back_buffer_released(&self, wait: Duration) -> Result<(), HostSharedError> {
        let back = 1 - self.seg.active();
        let started = Instant::now();
        let mut backoff = Backoff::new();
        while let Some(pause) = self.back_pending(back, started, wait, &mut backoff)? {
            tokio::time::sleep(pause).await;
        }
        Ok(())
    }

    /// The weight channel's receiver (after init or rejoin): its version, bounds, reports.
    pub fn receiver_mut(&mut self) -> Option<&mut SyncReceiver> {
        self.receiver.as_mut()
    }

    /// The synced keys, in sync order (known after init or rejoin).
    pub fn synced_keys(&self) -> &[String] {
        &self.synced_keys
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The version active now, if one was published.
    pub fn active(&self) -> Option<Held> {
        self.seg.published().then(|| {
            let buffer = self.seg.active();
            held(buffer, self.seg.meta(buffer))
        })
    }

    /// Unlink arena `name` (the owner — the app's supervisor — does on every exit path; mappings live on).
    /// `false` when there was none.
    pub fn unlink(name: &str) -> Result<bool, HostSharedError> {
        check_name(name)?;
        arena::unlink(name).map_err(|e| segment_error(name, e))
    }
}

impl Drop for Applier {
    fn drop(&mut self) {
        if self.unlink_on_drop
            && let Err(e) = arena::unlink(&self.name)
        {
            tracing::warn!(arena = %self.name, error = ?e, "could not unlink the host-shared arena");
        }
    }
}

fn held(buffer: u8, m: BufferMeta) -> Held {
    Held {
        version: m.version,
        sequence: m.sequence,
        checksum: m.checksum,
        buffer,
        generation: m.generation,
    }
}

/// The first way `found` lays out other tensors than `want` (names, dtypes, shapes, classes, order).
fn layout_difference(want: &Plan, found: &Plan) -> Option<String> {
    if want.entries.len() != found.entries.len() {
        return Some(format!(
            "it has {} tensors, the model has {}",
            found.entries.len(),
            want.entries.len()
        ));
    }
    want.entries.iter().zip(&found.entries).find_map(|(w, f)| {
        (w != f).then(|| {
            format!(
                "it has `{}` {} {:?} ({}) where the model has `{}` {} {:?} ({})",
                f.name,
                f.layout.dtype(),
                f.layout.shape(),
                f.class.name(),
                w.name,
                w.layout.dtype(),
                w.layout.shape(),
                w.class.name()
            )
        })
    })
}

/// A process's hold on an arena: one slot, one buffer at a time, flipped only between its steps. Dropping it
/// clears the slot.
pub struct Reader {
    views: [StateDict; 2],
    seg: Segment,
    name: String,
    slot: usize,
    pid: u32,
    held: Held,
}

impl Reader {
    /// Open arena `name` — waiting up to `wait` for it to be created and a first version published — take a
    /// slot and hold the active buffer.
    pub async fn attach(name: &str, wait: Duration) -> Result<Reader, HostSharedError> {
        check_name(name)?;
        let started = Instant::now();
        let mut backoff = Backoff::new();
        let seg = loop {
            match Segment::open(name, false) {
                Ok(seg) => break seg,
                Err(SegmentError::NotFound | SegmentError::Incomplete)
                    if started.elapsed() < wait =>
                {
                    tokio::time::sleep(backoff.next()).await;
                }
                Err(SegmentError::NotFound) => {
                    return Err(HostSharedError::NotCreated {
                        name: name.to_owned(),
                        waited: started.elapsed(),
                    });
                }
                Err(e) => return Err(segment_error(name, e)),
            }
        };
        while !seg.published() {
            if started.elapsed() >= wait {
                return Err(HostSharedError::NotPublished {
                    name: name.to_owned(),
                    waited: started.elapsed(),
                });
            }
            tokio::time::sleep(backoff.next()).await;
        }
        let pid = std::process::id();
        let slot = seg.claim_slot(pid).ok_or_else(|| HostSharedError::NoSlot {
            name: name.to_owned(),
            max_readers: seg.plan().max_readers,
        })?;
        // SAFETY: the views live in the reader beside the segment and are dropped before it; the buffers are
        // mapped read-only and handed out only as shared references.
        let views = unsafe { [seg.buffer_state(0), seg.buffer_state(1)] };
        let mut reader = Reader {
            views,
            seg,
            name: name.to_owned(),
            slot,
            pid,
            held: Held {
                version: 0,
                sequence: 0,
                checksum: None,
                buffer: 0,
                generation: 0,
            },
        };
        reader.take_active();
        Ok(reader)
    }

    /// Hold the active buffer: name it in the slot, then re-read the active index until both agree.
    fn take_active(&mut self) -> Held {
        let mut buffer = self.seg.active();
        loop {
            self.seg.hold(self.slot, self.pid, buffer);
            let now = self.seg.active();
            if now == buffer {
                break;
            }
            buffer = now;
        }
        self.held = held(buffer, self.seg.meta(buffer));
        self.held
    }

    /// The held buffer's weights as a state dict over the shared memory (never written while held).
    pub fn state(&self) -> &StateDict {
        &self.views[usize::from(self.held.buffer)]
    }

    /// A buffer's view (0 = A, 1 = B; anything else is B), for bindings that build their tensor views once.
    /// Only the held buffer's is stable: the applier may write the other one.
    pub fn buffer_state(&self, buffer: u8) -> &StateDict {
        &self.views[usize::from(buffer.min(1))]
    }

    pub fn held(&self) -> Held {
        self.held
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Between steps: flip to the newest published version when it is not the held one (never blocks).
    pub fn refresh(&mut self) -> Option<Held> {
        let active = self.seg.active();
        if self.seg.meta(active).generation == self.held.generation {
            return None;
        }
        Some(self.take_active())
    }

    /// Wait (up to `timeout`) until a version newer than `than` is published, then hold it.
    pub async fn wait_newer(
        &mut self,
        than: u64,
        timeout: Duration,
    ) -> Result<Held, HostSharedError> {
        let started = Instant::now();
        let mut backoff = Backoff::new();
        loop {
            self.refresh();
            if self.held.version > than {
                return Ok(self.held);
            }
            let waited = started.elapsed();
            if waited >= timeout {
                return Err(HostSharedError::NotNewer {
                    name: self.name.clone(),
                    than,
                    held: self.held.version,
                    waited,
                });
            }
            tokio::time::sleep(backoff.next().min(timeout - waited)).await;
        }
    }
}

impl std::fmt::Debug for Reader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reader")
            .field("name", &self.name)
            .field("slot", &self.slot)
            .field("held", &self.held)
            .finish()
    }
}

impl std::fmt::Debug for Applier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Applier")
            .field("name", &self.name)
            .field("active", &self.active())
            .finish()
    }
}

impl Drop for Reader {
    fn drop(&mut self) {
        self.seg.release_slot(self.slot);
    }
}

#[cfg(test)]
mod tests;
