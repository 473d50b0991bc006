//! The receiving end [`SyncReceiver`] (a rollout's): the handshake and init bootstrap that make it
//! ([`WeightSyncer::init_receiver`], [`WeightSyncer::rejoin_receiver`]), `apply` (receive, verify, install)
//! and `receive` → [`PendingUpdate::install`] for background no-wait installs (or [`SyncReceiver::commit`] /
//! [`SyncReceiver::decline`], which also report to the sender when [`SyncReceiver::set_reports`] is on). A
//! bucket receiver may also skip the handshake ([`WeightSyncer::init_receiver_described`], RLinf's bucket
//! syncer): then it reads each version's manifest first and maps the buckets onto its keys by name, checking
//! every key before anything is written.

use super::bucket::PartError;
use super::*;

/// The receiving end of a weight channel (a rollout's), made by [`WeightSyncer::init_receiver`] or
/// [`WeightSyncer::rejoin_receiver`].
pub struct SyncReceiver {
    ch: transport::Receiver,
    strategy: Strategy,
    /// Bucket: install each verified bucket as it arrives (`load_instant`).
    load_instant: bool,
    /// Bucket: where a version is staged for its install (`bucket_device`; `cuda` takes effect once a device
    /// backend's stager is set, [`SyncReceiver::set_bucket_stager`]).
    bucket_device: Device,
    synced_keys: Vec<String>,
    /// Highest sequence received and validated (≥ applied).
    received: u64,
    /// The sequence of a bucket or patch version this receiver gave up on midway: its remaining parts are
    /// skipped.
    interrupted: Option<u64>,
    /// The parts of a patch version received before a wait for the next part timed out (taken back out of
    /// the weights): the next `apply` / `receive` goes on from there.
    partial: Option<Partial>,
    /// Made without a handshake: every version starts with its manifest (see `syncer/wire.rs`).
    described: bool,
    /// Tell the sender of every installed version and every declined update ([`SyncReceiver::set_reports`]).
    reports: bool,
    shared: Arc<ReceiverShared>,
}

/// Receiver-side facts shared with [`PendingUpdate`]s.
struct ReceiverShared {
    meta: Vec<KeyMeta>,
    synced: Vec<bool>,
    /// The caller's version and the sender's sequence of the last installed payload.
    applied: Mutex<Stamp>,
    pool: Mutex<Pool>,
    threads: NonZeroUsize,
    /// A device backend's install (CUDA tensors), in place of `patch::install`.
    installer: Mutex<Option<Arc<dyn PatchInstaller>>>,
    /// A device backend's bucket install (`bucket_device: cuda`), in place of the host install: each
    /// version is staged whole, verified, then unpacked on the device (`syncer/bucket/device.rs`).
    stager: Mutex<Option<Box<dyn BucketStager>>>,
}

impl ReceiverShared {
    fn new(meta: Vec<KeyMeta>, synced: Vec<bool>, applied: Stamp, threads: NonZeroUsize) -> Self {
        ReceiverShared {
            meta,
            synced,
            applied: Mutex::new(applied),
            pool: Mutex::new(Pool::default()),
            threads,
            installer: Mutex::new(None),
            stager: Mutex::new(None),
        }
    }

    /// The bucket stager, if a device backend set one.
    fn stager(&self) -> std::sync::MutexGuard<'_, Option<Box<dyn BucketStager>>> {
        self.stager.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Which receiver keys (by ordinal) the bucket stager installs on its device: they are staged in the wire
    /// dtype and cast there. Empty without a stager.
    fn on_device(&self) -> Vec<bool> {
        match self.stager().as_ref() {
            Some(st) => self
                .meta
                .iter()
                .map(|m| st.addr(&m.name).is_some())
                .collect(),
            None => Vec::new(),
        }
    }

    /// The version and sequence installed last.
    fn applied(&self) -> Stamp {
        *self.applied.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn set_applied(&self, stamp: Stamp) {
        *self.applied.lock().unwrap_or_else(|p| p.into_inner()) = stamp;
    }

    /// The staging pool (a panic elsewhere cannot leave it inconsistent: it only holds free storages).
    fn pool(&self) -> std::sync::MutexGuard<'_, Pool> {
        self.pool.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Bytes of the synced tensors in the receiver's dtypes.
    fn synced_bytes(&self) -> u64 {
        self.synced
            .iter()
            .zip(&self.meta)
            .filter(|(s, _)| **s)
            .map(|(_, m)| {
                m.shape
                    .iter()
                    .product::<usize>()
                    .saturating_mul(m.dtype.size_bytes()) as u64
            })
            .sum()
    }
}

impl WeightSyncer {
    /// Receiver side of the handshake, which makes this syncer the receiving end: send metadata of `state`,
    /// receive the plan and (patch) install the init bootstrap into `state`.
    pub async fn init_receiver(
        mut self,
        state: &mut StateDict,
        mut ch: transport::Receiver,
    ) -> Result<(SyncReceiver, SyncReport), SyncError> {
        self.fit_threads(state);
        let meta = metadata(state);
        ch.send(&wire::encode_metadata(&meta)).await?;
        let t_wait = Instant::now();
        let plan = read_plan(&mut ch).await?;
        let mut report = SyncReport {
            kind: SyncKind::Init,
            transfer: t_wait.elapsed(),
            compression_ratio: 1.0,
            ..Default::default()
        };
        let handshake = |reason: String| SyncError::Handshake { reason };
        let synced_keys = synced_keys(&plan, &meta).map_err(handshake)?;
        check_strategy(&self.settings, plan.strategy).map_err(handshake)?;
        let synced = synced(&plan, meta.len());
        let shared = Arc::new(ReceiverShared::new(
            meta,
            synced,
            Stamp::default(),
            self.settings.threads,
        ));
        self.reach(HoldPoint::Bootstrap).await;
        if plan.init_buckets > 0 {
            let got = receive_init_buckets(&mut ch, plan.init_buckets, &shared.meta, state).await?;
            report.payload_bytes += got.payload_bytes;
            report.messages += got.messages;
            report.decode += got.decode;
            report.apply += got.apply;
            report.tensors = got.tensors;
            report.changed = got.changed;
        }
        report.state_bytes = plan
            .synced
            .iter()
            .map(|&o| {
                state
                    .get_index(o as usize)
                    .map_or(0, |(_, t)| t.bytes().len()) as u64
            })
            .sum();
        let receiver = SyncReceiver {
            ch,
            strategy: plan.strategy,
            load_instant: self.settings.load_instant,
            bucket_device: self.settings.bucket_device,
            synced_keys,
            received: 0,
            interrupted: None,
            partial: None,
            described: false,
            reports: false,
            shared,
        };
        Ok((receiver, report))
    }

    /// A bucket receiver without a handshake, for a sender made by [`WeightSyncer::init_sender_described`]
    /// (RLinf's bucket syncer: its `init_receiver` needs no `send`): nothing is exchanged now. Each version's
    /// manifest names its keys; a key `state` lacks, another shape or a dtype that does not convert is a
    /// rejection naming the key, before anything is written; keys of `state` the sender does not send keep
    /// their values (RLinf's `strict=False`). Patch syncers need the handshake ([`SyncError::Config`]).
    pub async fn init_receiver_described(
        mut self,
        state: &StateDict,
        ch: transport::Receiver,
    ) -> Result<(SyncReceiver, SyncReport), SyncError> {
        self.fit_threads(state);
        if self.settings.kind != SyncerKind::Bucket {
            return Err(SyncError::Config {
                reason: "only the bucket syncer can run without a handshake (the patch syncer's receiver needs the sender's plan)".into(),
            });
        }
        let meta = metadata(state);
        let synced = vec![true; meta.len()];
        let receiver = SyncReceiver {
            ch,
            strategy: Strategy::Bucket,
            load_instant: self.settings.load_instant,
            bucket_device: self.settings.bucket_device,
            // Known once a version arrived: the keys its manifest named.
            synced_keys: Vec::new(),
            received: 0,
            interrupted: None,
            partial: None,
            described: true,
            reports: false,
            shared: Arc::new(ReceiverShared::new(
                meta,
                synced,
                Stamp::default(),
                self.settings.threads,
            )),
        };
        let report = SyncReport {
            kind: SyncKind::Init,
            compression_ratio: 1.0,
            ..Default::default()
        };
        Ok((receiver, report))
    }

    /// Receiver side of a rejoin (a restarted rollout on an elastic channel), which makes this syncer the
    /// receiving end: report the metadata of `state` and the version `held` it holds (0 after a fresh start: its
    /// own init weights), then install the catch-up the sender chose (see `syncer/rejoin.rs`). Afterwards this
    /// is a receiver like any other, at `report.to` (0 for a deferred catch-up: the next version, a full
    /// transfer, makes it current).
    pub async fn rejoin_receiver(
        mut self,
        state: &mut StateDict,
        mut ch: transport::Receiver,
        held: u64,
    ) -> Result<(SyncReceiver, CatchUpReport), SyncError> {
        self.fit_threads(state);
        let started = Instant::now();
        let meta = metadata(state);
        let msg = wire::encode_rejoin(&meta, held);
        let mut report = CatchUpReport {
            rank: ch.rank(),
            from: held,
            payload_bytes: msg.len() as u64,
            ..CatchUpReport::default()
        };
        // 1. the request, and the plan it gets
        ch.send(&msg).await?;
        let (plan, boot_only, len) = read_rejoin_plan(&mut ch).await?;
        report.payload_bytes += len as u64;
        let handshake = |reason: String| SyncError::Handshake {
            reason: format!("rejoin: {reason}"),
        };
        check_strategy(&self.settings, plan.strategy).map_err(handshake)?;
        let synced_keys = synced_keys(&plan, &meta).map_err(handshake)?;
        let boot_keys = names(&boot_only, &meta).map_err(handshake)?;
        // 2. the checksums of what it holds, and the catch-up the sender chose
        let hashed: &[String] = if self.settings.synced_elsewhere {
            &[]
        } else {
            &synced_keys
        };
        let held_now = blocking(|| rejoin::held(state, held, hashed, &boot_keys));
        let msg = wire::encode_held(&held_now);
        report.payload_bytes += msg.len() as u64;
        ch.send(&msg).await?;
        let (catch_up, len) = read_catch_up(&mut ch).await?;
        report.payload_bytes += len as u64;
        self.reach(HoldPoint::CatchUp).await;
        // 3. bootstrap-only keys, if its copy differed
        if catch_up.boot_buckets > 0 {
            let got = receive_init_buckets(&mut ch, catch_up.boot_buckets, &meta, state).await?;
            report.boot_bytes = got.payload_bytes;
            report.payload_bytes += got.payload_bytes;
        }
        // 4. the catch-up: replay starts from the held version; a full or deferred catch-up replaces everything
        let start = match catch_up.mode {
            wire::CatchUpMode::Replay => Stamp {
                version: held,
                sequence: catch_up.base_sequence,
            },
            wire::CatchUpMode::Full => Stamp::default(),
            // It holds none of the sender's versions and takes the next sync with the others.
            wire::CatchUpMode::Deferred => catch_up.to,
        };
        let synced = synced(&plan, meta.len());
        let mut receiver = SyncReceiver {
            ch,
            strategy: plan.strategy,
            load_instant: self.settings.load_instant,
            bucket_device: self.settings.bucket_device,
            synced_keys,
            received: start.sequence,
            interrupted: None,
            partial: None,
            described: false,
            reports: false,
            shared: Arc::new(ReceiverShared::new(
                meta,
                synced,
                start,
                self.settings.threads,
            )),
        };
        receiver.catch_up(&catch_up, state, &mut report).await?;
        report.to = receiver.version();
        report.elapsed = started.elapsed();
        Ok((receiver, report))
    }
}

/// The sender's plan (or its refusal) at init.
async fn read_plan(ch: &mut transport::Receiver) -> Result<Plan, SyncError> {
    let unreadable = |e: WireError| SyncError::HandshakeMessage {
        message: "plan from the sender".into(),
        source: e.into(),
    };
    ch.recv_with(|msg| -> Result<Plan, SyncError> {
        // Verify what is used: the checksum and the decoding read one private copy, never the slot twice.
        let msg = msg.to_vec();
        let (h, body) = Header::parse(&msg).map_err(unreadable)?;
        match h.kind {
            Kind::Abort => Err(SyncError::Handshake {
                reason: format!("the sender refused: {}", wire::decode_abort(body)),
            }),
            Kind::Plan => wire::decode_plan(&h, body).map_err(unreadable),
            Kind::Manifest => Err(SyncError::Handshake {
                reason: "the sender runs without a handshake (its init had no receivers' metadata): make this receiver without one too".into(),
            }),
            k => Err(SyncError::Handshake {
                reason: format!("expected the sender's plan, got a {} message", k.name()),
            }),
        }
    })
    .await?
}

/// The sender's rejoin plan (or its refusal): the plan, the bootstrap-only ordinals, the message's length.
async fn read_rejoin_plan(
    ch: &mut transport::Receiver,
) -> Result<(Plan, Vec<u32>, usize), SyncError> {
    let unreadable = |e: WireError| SyncError::HandshakeMessage {
        message: "rejoin: the sender's rejoin plan".into(),
        source: e.into(),
    };
    ch.recv_with(|msg| -> Result<(Plan, Vec<u32>, usize), SyncError> {
        let (h, body) = Header::parse(msg).map_err(unreadable)?;
        match h.kind {
            Kind::Abort => Err(SyncError::Handshake {
                reason: format!("rejoin: the sender refused: {}", wire::decode_abort(body)),
            }),
            Kind::RejoinPlan => wire::decode_rejoin_plan(body)
                .map(|(p, b)| (p, b, msg.len()))
                .map_err(unreadable),
            k => Err(SyncError::Handshake {
                reason: format!(
                    "rejoin: expected the sender's rejoin plan, got a {} message",
                    k.name()
                ),
            }),
        }
    })
    .await?
}

/// The catch-up the sender chose for a rejoin, and the message's length.
async fn read_catch_up(
    ch: &mut transport::Receiver,
) -> Result<(wire::CatchUpPlan, usize), SyncError> {
    ch.recv_with(|msg| -> Result<(wire::CatchUpPlan, usize), WireError> {
        let (h, body) = Header::parse(msg)?;
        h.expect(Kind::CatchUp)?;
        Ok((wire::decode_catch_up(&h, body)?, msg.len()))
    })
    .await?
    .map_err(|e| SyncError::HandshakeMessage {
        message: "rejoin: the sender's catch-up".into(),
        source: e.into(),
    })
}

/// The plan's strategy must be the one this receiver is configured for.
fn check_strategy(settings: &Settings, strategy: Strategy) -> Result<(), String> {
    let expected = settings.strategy();
    if strategy == expected {
        Ok(())
    } else {
        Err(format!(
            "sender uses {strategy:?}, this receiver is configured for {expected:?}"
        ))
    }
}

/// The receiver's names of `ordinals` (an ordinal it does not have is an error naming it).
fn names(ordinals: &[u32], meta: &[KeyMeta]) -> Result<Vec<String>, String> {
    ordinals
        .iter()
        .map(|&o| {
            meta.get(o as usize).map(|m| m.name.clone()).ok_or_else(|| {
                format!(
                    "plan names ordinal {o}, the receiver has {} keys",
                    meta.len()
                )
            })
        })
        .collect()
}

/// The synced keys the plan names, in its order.
fn synced_keys(plan: &Plan, meta: &[KeyMeta]) -> Result<Vec<String>, String> {
    names(&plan.synced, meta)
}

/// Which of the receiver's `keys` (by ordinal) the plan syncs.
fn synced(plan: &Plan, keys: usize) -> Vec<bool> {
    let mut synced = vec![false; keys];
    for &o in &plan.synced {
        if let Some(s) = synced.get_mut(o as usize) {
            *s = true;
        }
    }
    synced
}

impl SyncReceiver {
    /// Receive the next version and install it into `state`; `report.version` is the applied version.
    pub async fn apply(&mut self, state: &mut StateDict) -> Result<SyncReport, SyncError> {
        let host_install = self
            .shared
            .installer
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_none();
        let device_buckets = self.shared.stager().is_some();
        let report = if self.strategy == Strategy::Bucket && self.load_instant && !device_buckets {
            receive_buckets(self, Some(state), None).await?.1
        } else if self.strategy == Strategy::Patch && host_install {
            apply_patch(self, state, None).await?.0
        } else {
            let pending = receive(self).await?;
            pending.install(state)?
        };
        self.report_applied().await;
        Ok(report)
    }

    /// Report to the sender (upstream, between payloads) every version this receiver installs and every
    /// update it declines ([`SyncReceiver::decline`]), so the sender knows each receiver's version
    /// ([`SyncSender::acked`]). Only for channels whose sender reads them: rlsync's shm and in-process
    /// channels ([`SyncSender::poll_reports`]); off by default (the runtime's channels carry no reports).
    pub fn set_reports(&mut self, on: bool) {
        self.reports = on;
    }

    /// Install an update this receiver received ([`SyncReceiver::receive`]) into `state`, and report it.
    pub async fn commit(
        &mut self,
        pending: PendingUpdate,
        state: &mut StateDict,
    ) -> Result<SyncReport, SyncError> {
        let report = pending.install(state)?;
        self.report_applied().await;
        Ok(report)
    }

    /// Drop an update this receiver received without installing it (weights and version untouched), and
    /// tell the sender why (with reports on). A patch syncer's next patch builds on the dropped version, so
    /// it is rejected ("a full resync is needed"); a bucket syncer installs the next version as usual.
    pub async fn decline(&mut self, pending: PendingUpdate, reason: &str) {
        let stamp = pending.stamp;
        if let PendingBody::Bucket(staged) = pending.body {
            give_back(&self.shared, staged);
        }
        if self.reports {
            self.report(&wire::encode_declined(stamp, reason)).await;
        }
    }

    /// Tell the sender (reports on) which version this receiver holds now.
    async fn report_applied(&mut self) {
        if self.reports {
            let msg = wire::encode_applied(self.shared.applied());
            self.report(&msg).await;
        }
    }

    /// Best effort: the update is installed (or declined) whatever happens to its report; a sender that is
    /// gone, or a channel that broke, is reported by the next wait on it.
    async fn report(&mut self, msg: &[u8]) {
        if let Err(e) = self.ch.send(msg).await {
            tracing::warn!(error = %crate::error_chain(&e), "could not report to the sender");
        }
    }

    /// Bound every wait of the calls that follow by `now + bound` as well as by the channel's own timeout
    /// (`None`: the channel's timeout only): an `apply` / `receive` that runs out returns
    /// `SyncError::Transport(Timeout)`. A wait for a payload that runs out consumes nothing, so the receiver
    /// stays usable; a bucket version cut short is dropped whole (weights untouched; its remaining parts are
    /// skipped by the next call), and so is a patch version cut short (any parts installed are taken back
    /// out). The caller's own bridge ignores it (its caller bounds `recv`).
    pub fn set_bound(&mut self, bound: Option<Duration>) {
        self.ch.set_bound(bound);
    }

    /// Background (no-wait) receive: read and validate the next update without touching the weights; install
    /// it later with [`PendingUpdate::install`] (between rollout chunks, never mid-forward).
    pub async fn receive(&mut self) -> Result<PendingUpdate, SyncError> {
        receive(self).await
    }

    /// Receive the next version and install it into `state` as it arrives, as [`SyncReceiver::apply`] does on
    /// the host (patch parts and buckets each checked before they are written and taken back out when a later
    /// one fails, whatever `load_instant` says), calling `on_part` after each part is installed with the
    /// ordinals it wrote (a later part may still take it back out). Also returns a patch's validated parts, in
    /// order, so the host-shared applier can replay them into its other buffer. Nothing is reported to the
    /// sender.
    pub(crate) async fn apply_streamed(
        &mut self,
        state: &mut StateDict,
        on_part: OnPart<'_>,
    ) -> Result<(SyncReport, Vec<ValidPatch>), SyncError> {
        match self.strategy {
            Strategy::Patch => apply_patch(self, state, Some(on_part)).await,
            Strategy::Bucket => Ok((
                receive_buckets(self, Some(state), Some(on_part)).await?.1,
                Vec::new(),
            )),
        }
    }

    /// Threads of the installs (and of replaying a patch part elsewhere).
    pub(crate) fn threads(&self) -> NonZeroUsize {
        self.shared.threads
    }

    /// The payload strategy this receiver takes (patch | bucket).
    pub fn kind(&self) -> SyncerKind {
        match self.strategy {
            Strategy::Patch => SyncerKind::Patch,
            Strategy::Bucket => SyncerKind::Bucket,
        }
    }

    /// Install patches with `installer` (a device backend's) instead of the host install; also for updates
    /// already received and pending.
    pub fn set_patch_installer(&self, installer: Arc<dyn PatchInstaller>) {
        *self
            .shared
            .installer
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some(installer);
    }

    /// Install bucket versions through `stager` (a device backend's, `bucket_device: cuda`): each version is
    /// received and verified whole on the host (whatever `load_instant` says), then its device tensors are
    /// unpacked on the device and its host tensors installed on the host; also for updates already received
    /// and pending. Returns whether it took effect (a bucket receiver with `bucket_device: cuda`).
    pub fn set_bucket_stager(&self, stager: Box<dyn BucketStager>) -> bool {
        if self.strategy != Strategy::Bucket || self.bucket_device != Device::Cuda {
            return false;
        }
        *self.shared.stager() = Some(stager);
        true
    }

    /// Where bucket versions are staged for their install (`bucket_device`).
    pub fn bucket_device(&self) -> Device {
        self.bucket_device
    }

    /// The caller's version applied last (0 before the first sync).
    pub fn version(&self) -> u64 {
        self.shared.applied().version
    }

    /// The sender's sequence number of the payload applied last (0 before the first sync).
    pub fn sequence(&self) -> u64 {
        self.shared.applied().sequence
    }

    /// The synced keys, in sync order.
    pub fn synced_keys(&self) -> &[String] {
        &self.synced_keys
    }

    /// [`state_checksum`] of the synced keys of `state`: equal to the sender's [`SyncSender::checksum`] after
    /// every applied version.
    pub fn checksum(&self, state: &StateDict) -> u64 {
        state_checksum(state, &self.synced_keys)
    }

    /// A rejoin's catch-up: the replayed patches, the full transfer, or nothing (deferred); it must reach the
    /// version the sender announced.
    async fn catch_up(
        &mut self,
        plan: &wire::CatchUpPlan,
        state: &mut StateDict,
        report: &mut CatchUpReport,
    ) -> Result<(), SyncError> {
        match plan.mode {
            wire::CatchUpMode::Replay => {
                report.kind = CatchUpKind::Replay;
                for _ in 0..plan.patches {
                    let pending = receive_patch(self).await?;
                    let got = pending.install(state)?;
                    report.payload_bytes += got.payload_bytes;
                    report.patches += 1;
                }
            }
            wire::CatchUpMode::Full => {
                report.kind = CatchUpKind::Full;
                if plan.to.sequence == 0 {
                    // Version 0 (no sync yet): the snapshot travels as init buckets, like the bootstrap.
                    let got = receive_init_buckets(
                        &mut self.ch,
                        plan.full_buckets,
                        &self.shared.meta,
                        state,
                    )
                    .await?;
                    report.payload_bytes += got.payload_bytes;
                } else if plan.full_buckets > 0 {
                    let (_, got) = receive_buckets(self, Some(state), None).await?;
                    report.payload_bytes += got.payload_bytes;
                }
            }
            wire::CatchUpMode::Deferred => {
                report.kind = CatchUpKind::Full;
                report.deferred = true;
            }
        }
        let now = self.shared.applied();
        if now != plan.to {
            return Err(rejected(
                Some(plan.to.version),
                now.version,
                format!(
                    "the catch-up was announced to reach version {} (sync #{}), it reached {} (sync #{})",
                    plan.to.version, plan.to.sequence, now.version, now.sequence
                ),
            ));
        }
        Ok(())
    }
}

/// Receive `count` init buckets (any receiver key) and install them into `state` once all arrived and fit.
async fn receive_init_buckets(
    ch: &mut transport::Receiver,
    count: u32,
    meta: &[KeyMeta],
    state: &mut StateDict,
) -> Result<SyncReport, SyncError> {
    let mut report = SyncReport::default();
    let all = vec![true; meta.len()];
    let mut staged: Staged = Vec::new();
    let mut pool = Pool::default();
    for seq in 0..count {
        let mut asm: Option<Assembly> = None;
        loop {
            let t0 = Instant::now();
            let done = ch
                .recv_with(|msg| -> Result<bool, PartError> {
                    let (h, body) = Header::parse_unverified(msg)?;
                    h.expect(Kind::InitBucket)?;
                    if h.seq != seq || h.count != count || h.version != 0 || h.sequence != 0 {
                        return Err(PartError::Invalid(format!(
                            "init bucket {}/{} (version {}) out of sequence, expected {seq}/{count}",
                            h.seq, h.count, h.version
                        )));
                    }
                    match asm.as_mut() {
                        None => {
                            asm = Some(blocking(|| {
                                Assembly::start(&h, body, meta, &all, &[], &mut pool)
                            })?)
                        }
                        Some(a) => blocking(|| a.add_part(&h, body))?,
                    }
                    Ok(asm.as_ref().is_some_and(Assembly::is_complete))
                })
                .await?
                .map_err(|e| match e {
                    PartError::Invalid(reason) => SyncError::Handshake {
                        reason: format!("init bootstrap: {reason}"),
                    },
                    PartError::Message(source) => SyncError::HandshakeMessage {
                        message: "init bootstrap".into(),
                        source,
                    },
                })?;
            report.decode += t0.elapsed();
            if done {
                break;
            }
        }
        if let Some(a) = asm {
            report.payload_bytes += a.bytes() as u64;
            report.messages += 1;
            staged.extend(a.finish());
        }
    }
    let t0 = Instant::now();
    bucket::check_fits(&staged, meta, state, false)
        .map_err(|reason| SyncError::Handshake { reason })?;
    report.tensors = staged.len();
    report.changed = staged.iter().map(staged_numel).sum();
    let _ = bucket::swap_in(staged, state);
    report.apply = t0.elapsed();
    Ok(report)
}

/// A received, verified update waiting to be installed.
pub struct PendingUpdate {
    stamp: Stamp,
    body: PendingBody,
    shared: Arc<ReceiverShared>,
    report: SyncReport,
}

enum PendingBody {
    Patch { base: u64, body: wire::PatchBody },
    Bucket(Staged),
}

impl PendingUpdate {
    /// The caller's version this update carries.
    pub fn version(&self) -> u64 {
        self.stamp.version
    }

    /// Sizes and timings of receiving it (the install adds its own when it runs).
    pub fn report(&self) -> &SyncReport {
        &self.report
    }

    /// Install into `state` (the receiver's state dict from init). Rejected — state and version untouched —
    /// when the version is no longer newer than the applied one, a patch's base is not the applied version,
    /// or the payload does not fit the state dict.
    pub fn install(self, state: &mut StateDict) -> Result<SyncReport, SyncError> {
        let PendingUpdate {
            stamp,
            body,
            shared,
            mut report,
        } = self;
        let version = stamp.version;
        let applied = shared.applied();
        let current = applied.version;
        if stamp.sequence <= applied.sequence {
            if let PendingBody::Bucket(staged) = body {
                give_back(&shared, staged);
            }
            return Err(rejected(
                Some(version),
                current,
                format!(
                    "sync #{} is not newer than the applied sync #{} (a stale update)",
                    stamp.sequence, applied.sequence
                ),
            ));
        }
        match body {
            PendingBody::Patch { base, body } => {
                if base != applied.sequence {
                    return Err(rejected(
                        Some(version),
                        current,
                        format!(
                            "patch is based on sync #{base}, this receiver holds sync #{} (a full resync is needed)",
                            applied.sequence
                        ),
                    ));
                }
                let installer = shared
                    .installer
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .clone();
                let t0 = Instant::now();
                let valid: ValidPatch = match installer {
                    // A device installer checks the streams as it decodes them (its install time).
                    Some(i) => {
                        let planned =
                            blocking(|| patch::plan(body, &shared.meta, &shared.synced, state))
                                .map_err(|r| rejected(Some(version), current, r))?;
                        report.decode += t0.elapsed();
                        let t1 = Instant::now();
                        let valid = blocking(|| i.check_install(planned, state, shared.threads))
                            .map_err(|e| match e {
                                CheckInstallError::Rejected { reason } => {
                                    rejected(Some(version), current, reason)
                                }
                                CheckInstallError::Install(e) => e,
                            })?;
                        report.apply = t1.elapsed();
                        valid
                    }
                    None => {
                        let valid = blocking(|| {
                            patch::validate(
                                body,
                                &shared.meta,
                                &shared.synced,
                                state,
                                shared.threads,
                            )
                        })
                        .map_err(|r| rejected(Some(version), current, r))?;
                        report.decode += t0.elapsed();
                        let t1 = Instant::now();
                        blocking(|| patch::install(&valid, state, shared.threads));
                        report.apply = t1.elapsed();
                        valid
                    }
                };
                report.changed = valid.changed;
            }
            PendingBody::Bucket(staged) => {
                let mut stager = shared.stager();
                if let Err(r) = bucket::check_fits(&staged, &shared.meta, state, stager.is_some()) {
                    drop(stager);
                    give_back(&shared, staged);
                    return Err(rejected(Some(version), current, r));
                }
                let t1 = Instant::now();
                let spare = match stager.as_deref_mut() {
                    Some(st) => blocking(|| {
                        bucket::device::install_version(
                            st,
                            staged,
                            &shared.meta,
                            state,
                            shared.threads,
                        )
                    }),
                    None => Ok(blocking(|| bucket::install(staged, state, shared.threads))),
                };
                drop(stager);
                report.apply = t1.elapsed();
                give_back(&shared, spare?);
            }
        }
        shared.set_applied(stamp);
        report.version = version;
        Ok(report)
    }
}

/// Told after each part of a version is installed (patch part or bucket), with the ordinals of the tensors it
/// wrote and the state it wrote them into; runs on the receiving task (as blocking work).
pub(crate) type OnPart<'a> = &'a mut (dyn FnMut(&[usize], &StateDict) + Send);

fn give_back(shared: &ReceiverShared, staged: Staged) {
    shared.pool().give_all(staged);
}

/// Elements of a staged tensor.
fn staged_numel(t: &bucket::StagedTensor) -> u64 {
    (t.storage.len() / t.dtype.size_bytes().max(1)) as u64
}

/// Read the next update (patch: one message; bucket: all buckets of a version, staged).
async fn receive(r: &mut SyncReceiver) -> Result<PendingUpdate, SyncError> {
    match r.strategy {
        Strategy::Patch => receive_patch(r).await,
        Strategy::Bucket => match receive_buckets(r, None, None).await? {
            (Some(p), _) => Ok(p),
            (None, _) => Err(rejected(
                None,
                r.shared.applied().version,
                "bucket version produced no staged update",
            )),
        },
    }
}

/// The header facts every part of one patch version shares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct PatchVersion {
    stamp: Stamp,
    /// The sequence the patch is based on.
    base: u64,
    /// Its parts.
    count: u32,
}

/// A patch version whose wait for its next part timed out: its parts so far (and their message lengths).
struct Partial {
    version: PatchVersion,
    parts: std::collections::VecDeque<(wire::PatchBody, usize)>,
}

/// Whether `e` is a wait that ran out (the channel is fine and the version may still come whole).
fn is_timeout(e: &SyncError) -> bool {
    matches!(e, SyncError::Transport(TransportError::Timeout { .. }))
}

/// One read of the patch channel.
enum PatchRead {
    /// A leftover part of a version this receiver gave up on.
    Skip,
    /// The expected part of `version`, decoded (not yet validated against the state).
    Part {
        version: PatchVersion,
        body: wire::PatchBody,
        len: usize,
        decode: Duration,
    },
}

/// Read the next patch part: the first part of a newer version (`expect` None), or part `seq` of `version`. A
/// part of another version, out of order, stale or not reading is an error, with the stamp it carried.
async fn read_patch_part(
    r: &mut SyncReceiver,
    expect: Option<(PatchVersion, u32)>,
) -> Result<PatchRead, (Option<Stamp>, SyncError)> {
    let current = r.shared.applied().version;
    let (received, interrupted) = (r.received, r.interrupted);
    let max_stream = r
        .shared
        .meta
        .iter()
        .map(|m| m.shape.iter().product::<usize>().saturating_mul(10))
        .sum::<usize>()
        .saturating_add(1 << 16);
    r.ch.recv_with(|msg| -> Result<PatchRead, (Option<Stamp>, SyncError)> {
        let t0 = Instant::now();
        // Verify what is installed: the slot may be shared memory another process can write, so the
        // checksum and the decoding both read one private copy, never the slot twice.
        let msg = blocking(|| msg.to_vec());
        let (h, body) = Header::parse(&msg).map_err(|e| {
            // The stamp as it reads (unverified) only tells which version's leftovers to skip next.
            let stamp = Header::parse_unverified(&msg).ok().map(|(h, _)| h.stamp());
            (stamp, unreadable(None, current, e))
        })?;
        let at = |e: SyncError| (Some(h.stamp()), e);
        h.expect(Kind::Patch)
            .map_err(|e| at(unreadable(Some(h.version), current, e)))?;
        let version = PatchVersion {
            stamp: h.stamp(),
            base: h.aux,
            count: h.count,
        };
        match expect {
            None if h.seq != 0 && interrupted == Some(h.sequence) => return Ok(PatchRead::Skip),
            None if h.seq != 0 => {
                return Err(at(rejected(
                    Some(h.version),
                    current,
                    format!(
                        "part {}/{} of sync #{} (version {}) arrived without the parts before it (replayed or out of order)",
                        h.seq, h.count, h.sequence, h.version
                    ),
                )));
            }
            None if h.sequence <= received => {
                return Err(at(rejected(
                    Some(h.version),
                    current,
                    format!(
                        "sync #{} (version {}) is not newer than sync #{received} (replayed or stale)",
                        h.sequence, h.version
                    ),
                )));
            }
            None => {}
            Some((v, seq)) if version != v || h.seq != seq => {
                return Err(at(rejected(
                    Some(h.version),
                    current,
                    format!(
                        "part {}/{} of sync #{} (version {}) arrived while expecting part {seq}/{} of sync #{} (version {})",
                        h.seq, h.count, h.sequence, h.version, v.count, v.stamp.sequence, v.stamp.version
                    ),
                )));
            }
            Some(_) => {}
        }
        let body = blocking(|| wire::decode_patch_body(body, max_stream))
            .map_err(|e| at(unreadable(Some(h.version), current, e)))?;
        Ok(PatchRead::Part {
            version,
            body,
            len: msg.len(),
            decode: t0.elapsed(),
        })
    })
    .await
    .map_err(|e| (None, e.into()))?
}

/// Receive every part of the next patch without touching the weights (a background install's receive).
async fn receive_patch(r: &mut SyncReceiver) -> Result<PendingUpdate, SyncError> {
    let t_wait = Instant::now();
    let mut report = SyncReport {
        kind: SyncKind::Patch,
        compression_ratio: 1.0,
        state_bytes: r.shared.synced_bytes(),
        ..Default::default()
    };
    let mut parts = Vec::new();
    let mut lens = Vec::new();
    let mut version: Option<PatchVersion> = None;
    if let Some(partial) = r.partial.take() {
        version = Some(partial.version);
        for (body, len) in partial.parts {
            parts.push(body);
            lens.push(len);
        }
    }
    while version.is_none_or(|v| (parts.len() as u32) < v.count) {
        let expect = version.map(|v| (v, parts.len() as u32));
        match read_patch_part(r, expect).await {
            Ok(PatchRead::Skip) => report.skipped += 1,
            Ok(PatchRead::Part {
                version: v,
                body,
                len,
                decode,
                ..
            }) => {
                version = Some(v);
                report.decode += decode;
                parts.push(body);
                lens.push(len);
            }
            Err((_, e)) if is_timeout(&e) => {
                if let Some(version) = version {
                    r.partial = Some(Partial {
                        version,
                        parts: parts.into_iter().zip(lens).collect(),
                    });
                }
                return Err(e);
            }
            Err((stamp, e)) => {
                // The version being received (its remaining parts follow), else the part's own.
                r.interrupted = version.map(|v| v.stamp).or(stamp).map(|s| s.sequence);
                return Err(e);
            }
        }
    }
    report.payload_bytes = lens.iter().map(|&l| l as u64).sum();
    report.messages = parts.len() as u32;
    report.tensors = parts.iter().map(|b| b.entries.len()).sum();
    let Some(v) = version else {
        return Err(rejected(
            None,
            r.shared.applied().version,
            "a patch without parts",
        ));
    };
    // One body, as a single message would have carried it: validated whole before any of it is written.
    let t0 = Instant::now();
    let body = blocking(|| wire::PatchBody::join(parts)).map_err(|e| {
        r.interrupted = Some(v.stamp.sequence);
        unreadable(Some(v.stamp.version), r.shared.applied().version, e)
    })?;
    report.decode += t0.elapsed();
    r.received = v.stamp.sequence;
    report.transfer = t_wait.elapsed().saturating_sub(report.decode);
    Ok(PendingUpdate {
        stamp: v.stamp,
        body: PendingBody::Patch { base: v.base, body },
        shared: r.shared.clone(),
        report,
    })
}

/// Receive the next patch and install it part by part as the parts arrive (while the sender still builds the
/// later ones): each part is validated before it is written, and what it overwrote is kept until the version
/// is whole; a part that fails (corrupt, truncated, out of order, or the channel failing) takes every part of
/// the version back out, so state and version stay bitwise as they were. The version is applied only once
/// every part verified and was installed. `on_part`, if any, runs after each part is installed; the validated parts
/// come back in order (the undo of each already holds its part: keeping them costs nothing more).
async fn apply_patch(
    r: &mut SyncReceiver,
    state: &mut StateDict,
    mut on_part: Option<OnPart<'_>>,
) -> Result<(SyncReport, Vec<ValidPatch>), SyncError> {
    let shared = r.shared.clone();
    let applied = shared.applied();
    let current = applied.version;
    let t_wait = Instant::now();
    let mut report = SyncReport {
        kind: SyncKind::Patch,
        compression_ratio: 1.0,
        state_bytes: shared.synced_bytes(),
        ..Default::default()
    };
    let mut undo: Vec<(patch::Undo, usize)> = Vec::new();
    let mut last: Option<ValidPatch> = None;
    let mut version: Option<PatchVersion> = None;
    let mut resumed = std::collections::VecDeque::new();
    if let Some(partial) = r.partial.take() {
        version = Some(partial.version);
        resumed = partial.parts;
    }
    let mut seq = 0u32;
    let roll_back = |undo: Vec<(patch::Undo, usize)>, state: &mut StateDict| {
        for (u, _) in undo.iter().rev() {
            blocking(|| patch::roll_back(u, state, shared.threads));
        }
        undo.into_iter()
            .map(|(u, len)| (u.into_body(), len))
            .collect::<std::collections::VecDeque<_>>()
    };
    loop {
        let next = match (resumed.pop_front(), version) {
            (Some((body, len)), Some(v)) => Ok(PatchRead::Part {
                version: v,
                body,
                len,
                decode: Duration::ZERO,
            }),
            _ => read_patch_part(r, version.map(|v| (v, seq))).await,
        };
        let (v, body, len) = match next {
            Ok(PatchRead::Skip) => {
                report.skipped += 1;
                continue;
            }
            Ok(PatchRead::Part {
                version: v,
                body,
                len,
                decode,
                ..
            }) => {
                report.decode += decode;
                (v, body, len)
            }
            Err((_, e)) if is_timeout(&e) => {
                // Taken back out of the weights, kept for the next call: the version may still come whole.
                let parts = roll_back(undo, state);
                if let Some(version) = version.filter(|_| !parts.is_empty()) {
                    r.partial = Some(Partial { version, parts });
                }
                return Err(e);
            }
            Err((stamp, e)) => {
                // The version being received (its remaining parts follow), else the part's own.
                r.interrupted = version.map(|v| v.stamp).or(stamp).map(|s| s.sequence);
                roll_back(undo, state);
                return Err(e);
            }
        };
        report.payload_bytes += len as u64;
        report.messages += 1;
        report.tensors += body.entries.len();
        let fail = |reason: String| rejected(Some(v.stamp.version), current, reason);
        let refused = if seq == 0 && v.base != applied.sequence {
            Some(format!(
                "patch is based on sync #{}, this receiver holds sync #{} (a full resync is needed)",
                v.base, applied.sequence
            ))
        } else {
            None
        };
        let t0 = Instant::now();
        let valid = match refused {
            Some(reason) => Err(reason),
            None => blocking(|| {
                patch::validate(body, &shared.meta, &shared.synced, state, shared.threads)
            }),
        };
        report.decode += t0.elapsed();
        let valid = match valid {
            Ok(valid) => valid,
            Err(reason) => {
                r.interrupted = Some(v.stamp.sequence);
                roll_back(undo, state);
                return Err(fail(reason));
            }
        };
        report.changed += valid.changed;
        let touched: Vec<usize> = match on_part {
            Some(_) => valid.ordinals().collect(),
            None => Vec::new(),
        };
        let t1 = Instant::now();
        if seq + 1 == v.count {
            // The last part: nothing after it can fail, so no undo needs its old values.
            blocking(|| patch::install(&valid, state, shared.threads));
            last = Some(valid);
        } else {
            undo.push((
                blocking(|| patch::install_logged(valid, state, shared.threads)),
                len,
            ));
        }
        report.apply += t1.elapsed();
        if let Some(on_part) = on_part.as_deref_mut() {
            let t2 = Instant::now();
            blocking(|| on_part(&touched, state));
            report.decode += t2.elapsed();
        }
        version = Some(v);
        seq += 1;
        if seq == v.count {
            break;
        }
    }
    let Some(v) = version else {
        return Err(rejected(None, current, "a patch without parts"));
    };
    r.received = v.stamp.sequence;
    shared.set_applied(v.stamp);
    report.version = v.stamp.version;
    report.transfer = t_wait
        .elapsed()
        .saturating_sub(report.decode + report.apply);
    let parts = undo
        .into_iter()
        .map(|(u, _)| u.into_patch())
        .chain(last)
        .collect();
    Ok((report, parts))
}

enum BucketStep {
    /// A leftover part of an earlier (rejected or interrupted) version.
    Skip,
    /// A part was staged; the bucket is complete when this is true.
    Staged { complete: bool, decode: Duration },
}

/// Receive every bucket of one version, part by part. With `install = Some(state)` (load_instant) each
/// verified bucket is swapped into the state at once (then `on_part`, if any, runs) and undone if a later
/// bucket fails (or the channel fails mid-version); otherwise everything is staged and returned as a pending
/// update.
async fn receive_buckets(
    r: &mut SyncReceiver,
    mut install: Option<&mut StateDict>,
    mut on_part: Option<OnPart<'_>>,
) -> Result<(Option<PendingUpdate>, SyncReport), SyncError> {
    let shared = r.shared.clone();
    let current = shared.applied().version;
    let mut report = SyncReport {
        kind: SyncKind::Bucket,
        compression_ratio: 1.0,
        ..Default::default()
    };
    let mut staged_all: Staged = Vec::new();
    let mut undo: Staged = Vec::new();
    let mut asm: Option<Assembly> = None;
    let mut version: Option<Stamp> = None;
    let mut count = 0u32;
    let mut seq = 0u32;
    let t_start = Instant::now();
    // Self-describing: the version's manifest first; its keys are checked against the state dict's before any
    // bucket is read, and the buckets' ordinals index it.
    let mapped = match r.described {
        true => {
            let (m, skipped) = read_manifest(r).await?;
            report.skipped += skipped;
            report.payload_bytes += m.bytes;
            report.messages += 1;
            version = Some(m.stamp);
            count = m.count;
            Some(m)
        }
        false => None,
    };
    let all = vec![true; mapped.as_ref().map_or(0, |m| m.meta.len())];
    let (asm_meta, asm_allowed): (&[KeyMeta], &[bool]) = match &mapped {
        Some(m) => (&m.meta, &all),
        None => (&shared.meta, &shared.synced),
    };
    // A version staged for a device install keeps its device tensors in the wire dtype (cast on the device).
    let on_device = match install {
        Some(_) => Vec::new(),
        None => shared.on_device(),
    };
    let keep_wire: Vec<bool> = match &mapped {
        Some(m) if !on_device.is_empty() => m
            .ordinals
            .iter()
            .map(|&o| on_device.get(o as usize).copied().unwrap_or(false))
            .collect(),
        _ => on_device,
    };
    // Undo what was installed, return every staging storage, and report why.
    let fail = |err: SyncError,
                asm: Option<Assembly>,
                staged_all: Staged,
                undo: Staged,
                state: Option<&mut StateDict>| {
        if let Some(state) = state {
            let displaced = bucket::swap_in(undo, state);
            give_back(&shared, displaced);
        }
        give_back(&shared, staged_all);
        if let Some(a) = asm {
            let mut pool = shared.pool();
            a.abandon(&mut pool);
        }
        err
    };
    loop {
        let received = r.received;
        let interrupted = r.interrupted;
        let v_now = version;
        let step = r
            .ch
            .recv_with(|msg| -> Result<BucketStep, (Option<Stamp>, PartError)> {
                let t0 = Instant::now();
                let (h, body) = Header::parse_unverified(msg).map_err(|e| (None, e.into()))?;
                h.expect(Kind::Bucket).map_err(|e| (Some(h.stamp()), e.into()))?;
                if let Some(a) = asm.as_mut() {
                    blocking(|| a.add_part(&h, body)).map_err(|e| (Some(h.stamp()), e))?;
                    return Ok(BucketStep::Staged { complete: a.is_complete(), decode: t0.elapsed() });
                }
                let starts_version = h.seq == 0 && h.aux == 0;
                match v_now {
                    // Later buckets, or later parts of a bucket this receiver gave up on, of an earlier version.
                    None if h.seq != 0 || (!starts_version && interrupted == Some(h.sequence)) => {
                        // Skip only a genuine leftover: a corrupted header must not make a part look like one.
                        Header::parse(msg).map_err(|e| (Some(h.stamp()), e.into()))?;
                        return Ok(BucketStep::Skip);
                    }
                    None if !starts_version => {
                        return Err((Some(h.stamp()), PartError::Invalid(format!("version {} starts at byte {} of bucket {}/{}, not at its beginning", h.version, h.aux, h.seq, h.count))));
                    }
                    None if h.sequence <= received => {
                        return Err((Some(h.stamp()), PartError::Invalid(format!("sync #{} (version {}) is not newer than sync #{received} (replayed or stale)", h.sequence, h.version))));
                    }
                    None => {}
                    Some(v) if h.stamp() != v || h.seq != seq || h.count != count => {
                        return Err((Some(h.stamp()), PartError::Invalid(format!("bucket {}/{} of version {} (sync #{}) arrived while expecting {seq}/{count} of version {} (sync #{})", h.seq, h.count, h.version, h.sequence, v.version, v.sequence))));
                    }
                    Some(_) => {}
                }
                let mut pool = shared.pool();
                let a = blocking(|| Assembly::start(&h, body, asm_meta, asm_allowed, &keep_wire, &mut pool)).map_err(|e| (Some(h.stamp()), e))?;
                let complete = a.is_complete();
                if v_now.is_none() {
                    version = Some(h.stamp());
                    count = h.count;
                }
                asm = Some(a);
                Ok(BucketStep::Staged { complete, decode: t0.elapsed() })
            })
            .await;
        let step = match step {
            Ok(step) => step,
            Err(e) => {
                r.interrupted = version.map(|s| s.sequence);
                return Err(fail(e.into(), asm, staged_all, undo, install));
            }
        };
        match step {
            Ok(BucketStep::Skip) => report.skipped += 1,
            Ok(BucketStep::Staged { complete, decode }) => {
                report.decode += decode;
                if !complete {
                    continue;
                }
                let Some(done) = asm.take() else { continue };
                report.payload_bytes += done.bytes() as u64;
                report.messages += 1;
                let mut staged = done.finish();
                if let Some(m) = &mapped {
                    // Manifest indices → the receiver's ordinals (`Assembly::start` checked each index).
                    for t in staged.iter_mut() {
                        if let Some(&ordinal) = m.ordinals.get(t.ordinal as usize) {
                            t.ordinal = ordinal;
                        }
                    }
                }
                report.tensors += staged.len();
                report.changed += staged.iter().map(staged_numel).sum::<u64>();
                match install.as_deref_mut() {
                    Some(state) => {
                        if let Err(reason) = bucket::check_fits(&staged, &shared.meta, state, false)
                        {
                            give_back(&shared, staged);
                            r.interrupted = version.map(|s| s.sequence);
                            return Err(fail(
                                rejected(version.map(|s| s.version), current, reason),
                                None,
                                staged_all,
                                undo,
                                Some(state),
                            ));
                        }
                        let touched: Vec<usize> = match on_part {
                            Some(_) => staged.iter().map(|t| t.ordinal as usize).collect(),
                            None => Vec::new(),
                        };
                        let t1 = Instant::now();
                        if seq + 1 == count {
                            // The last bucket: nothing after it can fail, so no undo needs its old values.
                            let spare = blocking(|| bucket::install(staged, state, shared.threads));
                            give_back(&shared, spare);
                        } else {
                            undo.extend(bucket::swap_in(staged, state));
                        }
                        report.apply += t1.elapsed();
                        if let Some(on_part) = on_part.as_deref_mut() {
                            let t2 = Instant::now();
                            blocking(|| on_part(&touched, state));
                            report.decode += t2.elapsed();
                        }
                    }
                    None => staged_all.extend(staged),
                }
                seq += 1;
                if seq == count {
                    break;
                }
            }
            Err((v, e)) => {
                let v = v.or(version);
                r.interrupted = v.map(|s| s.sequence);
                return Err(fail(
                    rejection(v.map(|s| s.version), current, e),
                    asm,
                    staged_all,
                    undo,
                    install,
                ));
            }
        }
    }
    let stamp = version.unwrap_or_default();
    let version = stamp.version;
    r.received = stamp.sequence;
    if let Some(m) = mapped {
        r.synced_keys = m.meta.into_iter().map(|k| k.name).collect();
    }
    report.transfer = t_start
        .elapsed()
        .saturating_sub(report.decode + report.apply);
    report.version = version;
    report.state_bytes = shared.synced_bytes();
    match install {
        Some(_) => {
            give_back(&shared, undo);
            shared.set_applied(stamp);
            Ok((None, report))
        }
        None => Ok((
            Some(PendingUpdate {
                stamp,
                body: PendingBody::Bucket(staged_all),
                shared: shared.clone(),
                report: report.clone(),
            }),
            report,
        )),
    }
}

/// A self-describing version's manifest, mapped onto the receiver's keys.
struct Mapped {
    stamp: Stamp,
    /// The buckets that follow.
    count: u32,
    /// Per manifest index: the receiver's key as a bucket is checked against it (name, receiver dtype, shape).
    meta: Vec<KeyMeta>,
    /// Per manifest index: the receiver's ordinal.
    ordinals: Vec<u32>,
    /// The manifest message's length.
    bytes: u64,
}

/// Read the next version's manifest (self-describing receiver), skipping leftover parts of a version given up
/// on; also returns how many were skipped. A bucket without its manifest, a manifest whose sequence is not
/// newer, or one that does not fit the state dict is rejected (the rest of that version is skipped next time).
async fn read_manifest(r: &mut SyncReceiver) -> Result<(Mapped, u32), SyncError> {
    let current = r.shared.applied().version;
    let mut skipped = 0;
    loop {
        let (received, interrupted) = (r.received, r.interrupted);
        let meta = &r.shared.meta;
        let step = r
            .ch
            .recv_with(|msg| -> Result<Option<Mapped>, (Option<Stamp>, SyncError)> {
                let (h, _) = Header::parse_unverified(msg).map_err(|e| (None, unreadable(None, current, e)))?;
                let at = |e: SyncError| (Some(h.stamp()), e);
                if h.kind == Kind::Bucket {
                    // Skip only a genuine leftover: a corrupted header must not make a part look like one.
                    Header::parse(msg).map_err(|e| at(unreadable(Some(h.version), current, e)))?;
                    if interrupted == Some(h.sequence) {
                        return Ok(None);
                    }
                    return Err(at(rejected(Some(h.version), current, format!(
                        "bucket {}/{} of sync #{} (version {}) arrived without its version's manifest (replayed or out of order)",
                        h.seq, h.count, h.sequence, h.version
                    ))));
                }
                // Verify what is used: the checksum and the decoding read one private copy.
                let msg = msg.to_vec();
                let (h, body) = Header::parse(&msg).map_err(|e| at(unreadable(Some(h.version), current, e)))?;
                h.expect(Kind::Manifest).map_err(|e| at(unreadable(Some(h.version), current, e)))?;
                if h.sequence <= received {
                    return Err(at(rejected(Some(h.version), current, format!(
                        "sync #{} (version {}) is not newer than sync #{received} (replayed or stale)",
                        h.sequence, h.version
                    ))));
                }
                if h.count == 0 {
                    return Err(at(rejected(Some(h.version), current, "the manifest announces no buckets")));
                }
                let keys = wire::decode_manifest(body).map_err(|e| at(unreadable(Some(h.version), current, e)))?;
                let (meta, ordinals) = map_manifest(&keys, meta).map_err(|reason| at(rejected(Some(h.version), current, reason)))?;
                Ok(Some(Mapped {
                    stamp: h.stamp(),
                    count: h.count,
                    meta,
                    ordinals,
                    bytes: msg.len() as u64,
                }))
            })
            .await?;
        match step {
            Ok(Some(mapped)) => return Ok((mapped, skipped)),
            Ok(None) => skipped += 1,
            Err((stamp, e)) => {
                if let Some(stamp) = stamp {
                    r.interrupted = Some(stamp.sequence);
                }
                return Err(e);
            }
        }
    }
}

/// The manifest's keys as the receiver holds them (`meta`: its metadata) and their ordinals there; a key it
/// lacks, one listed twice, another shape or a wire dtype that does not convert to its dtype is an error naming
/// the key.
fn map_manifest(
    keys: &[wire::ManifestKey],
    meta: &[KeyMeta],
) -> Result<(Vec<KeyMeta>, Vec<u32>), String> {
    let index: std::collections::HashMap<&str, usize> = meta
        .iter()
        .enumerate()
        .map(|(i, m)| (m.name.as_str(), i))
        .collect();
    let mut seen = std::collections::HashSet::with_capacity(keys.len());
    let mut mapped = Vec::with_capacity(keys.len());
    let mut ordinals = Vec::with_capacity(keys.len());
    for k in keys {
        let Some(&o) = index.get(k.name.as_str()) else {
            return Err(format!(
                "key '{}' sent by the sender is not in this receiver's state dict",
                k.name
            ));
        };
        if !seen.insert(o) {
            return Err(format!("key '{}' appears twice in the manifest", k.name));
        }
        let m = &meta[o];
        if m.shape != k.shape {
            return Err(format!(
                "key '{}': the sender's shape {:?} differs from this receiver's {:?}",
                k.name, k.shape, m.shape
            ));
        }
        if k.wire != m.dtype && !(k.wire.is_floating() && m.dtype.is_floating()) {
            return Err(format!(
                "key '{}': {} on the wire does not convert to this receiver's {}",
                k.name, k.wire, m.dtype
            ));
        }
        mapped.push(m.clone());
        ordinals.push(o as u32);
    }
    Ok((mapped, ordinals))
}
