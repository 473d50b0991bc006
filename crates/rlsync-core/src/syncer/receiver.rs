//! The receiving half of [`WeightSyncer`] (a rollout's end): the handshake and init bootstrap
//! (`init_receiver`, `rejoin_receiver`), `apply` (receive, verify, install) and `receive` →
//! [`PendingUpdate::install`] for background no-wait installs.

use super::*;

impl WeightSyncer {
    /// Receiver side of the handshake: send metadata of `state`, receive the plan and (patch) install the
    /// init bootstrap into `state`.
    pub async fn init_receiver(
        &mut self,
        state: &mut StateDict,
        mut ch: transport::Receiver,
    ) -> Result<SyncReport, SyncError> {
        if !matches!(self.side, Side::Uninit) {
            return Err(SyncError::AlreadyInitialized);
        }
        let meta: Vec<KeyMeta> = state
            .iter()
            .map(|(k, t)| KeyMeta {
                name: k.to_string(),
                dtype: t.dtype(),
                shape: t.shape().to_vec(),
            })
            .collect();
        ch.send(&wire::encode_metadata(&meta)).await?;
        let t_wait = Instant::now();
        let plan = ch
            .recv_with(|msg| -> Result<Plan, SyncError> {
                // Verify what is used: the checksum and the decoding read one private copy, never the slot twice.
                let msg = msg.to_vec();
                let (h, body) = Header::parse(&msg).map_err(|e| SyncError::Handshake {
                    reason: format!("plan from the sender: {e}"),
                })?;
                match h.kind {
                    Kind::Abort => Err(SyncError::Handshake {
                        reason: format!("the sender refused: {}", wire::decode_abort(body)),
                    }),
                    Kind::Plan => wire::decode_plan(&h, body).map_err(|e| SyncError::Handshake {
                        reason: e.to_string(),
                    }),
                    k => Err(SyncError::Handshake {
                        reason: format!("expected the sender's plan, got a {} message", k.name()),
                    }),
                }
            })
            .await??;
        let mut report = SyncReport {
            kind: SyncKind::Init,
            transfer: t_wait.elapsed(),
            compression_ratio: 1.0,
            ..Default::default()
        };
        let mut synced = vec![false; meta.len()];
        for &o in &plan.synced {
            match synced.get_mut(o as usize) {
                Some(s) => *s = true,
                None => {
                    return Err(SyncError::Handshake {
                        reason: format!(
                            "plan names ordinal {o}, the receiver has {} keys",
                            meta.len()
                        ),
                    });
                }
            }
        }
        let synced_keys: Vec<String> = plan
            .synced
            .iter()
            .map(|&o| meta[o as usize].name.clone())
            .collect();
        let expected_strategy = match self.settings.kind {
            SyncerKind::Patch => Strategy::Patch,
            SyncerKind::Bucket => Strategy::Bucket,
        };
        if plan.strategy != expected_strategy {
            return Err(SyncError::Handshake {
                reason: format!(
                    "sender uses {:?}, this receiver is configured for {:?}",
                    plan.strategy, expected_strategy
                ),
            });
        }
        let shared = Arc::new(ReceiverShared {
            meta,
            synced,
            applied: AtomicU64::new(0),
            pool: Mutex::new(Pool::default()),
            threads: self.settings.threads,
        });
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
        self.side = Side::Receiver(ReceiverSide {
            ch,
            strategy: plan.strategy,
            synced_keys,
            received: 0,
            interrupted: None,
            shared,
        });
        Ok(report)
    }

    /// Receiver side of a rejoin (a restarted rollout on an elastic channel): report the metadata of `state`
    /// and the version `held` it holds (0 after a fresh start: its own init weights), then install the
    /// catch-up the sender chose (see `syncer/rejoin.rs`). Afterwards this is a receiver like any other, at
    /// `report.to` (0 for a deferred catch-up: the next version, a full transfer, makes it current).
    pub async fn rejoin_receiver(
        &mut self,
        state: &mut StateDict,
        mut ch: transport::Receiver,
        held: u64,
    ) -> Result<CatchUpReport, SyncError> {
        if !matches!(self.side, Side::Uninit) {
            return Err(SyncError::AlreadyInitialized);
        }
        let started = Instant::now();
        let rank = ch.rank();
        let meta: Vec<KeyMeta> = state
            .iter()
            .map(|(k, t)| KeyMeta {
                name: k.to_string(),
                dtype: t.dtype(),
                shape: t.shape().to_vec(),
            })
            .collect();
        let handshake = |reason: String| SyncError::Handshake {
            reason: format!("rejoin: {reason}"),
        };
        let msg = wire::encode_rejoin(&meta, held);
        let mut report = CatchUpReport {
            rank,
            from: held,
            payload_bytes: msg.len() as u64,
            ..CatchUpReport::default()
        };
        ch.send(&msg).await?;
        let (plan, boot_only, len) = ch
            .recv_with(|msg| -> Result<(Plan, Vec<u32>, usize), SyncError> {
                let (h, body) = Header::parse(msg).map_err(|e| handshake(e.to_string()))?;
                match h.kind {
                    Kind::Abort => Err(handshake(format!(
                        "the sender refused: {}",
                        wire::decode_abort(body)
                    ))),
                    Kind::RejoinPlan => wire::decode_rejoin_plan(body)
                        .map(|(p, b)| (p, b, msg.len()))
                        .map_err(|e| handshake(e.to_string())),
                    k => Err(handshake(format!(
                        "expected the sender's rejoin plan, got a {} message",
                        k.name()
                    ))),
                }
            })
            .await??;
        report.payload_bytes += len as u64;
        let expected_strategy = match self.settings.kind {
            SyncerKind::Patch => Strategy::Patch,
            SyncerKind::Bucket => Strategy::Bucket,
        };
        if plan.strategy != expected_strategy {
            return Err(handshake(format!(
                "sender uses {:?}, this receiver is configured for {:?}",
                plan.strategy, expected_strategy
            )));
        }
        let name = |o: &u32| {
            meta.get(*o as usize)
                .map(|m| m.name.clone())
                .ok_or_else(|| {
                    handshake(format!(
                        "plan names ordinal {o}, the receiver has {} keys",
                        meta.len()
                    ))
                })
        };
        let synced_keys = plan
            .synced
            .iter()
            .map(name)
            .collect::<Result<Vec<_>, _>>()?;
        let boot_keys = boot_only.iter().map(name).collect::<Result<Vec<_>, _>>()?;
        let mut synced = vec![false; meta.len()];
        for &o in &plan.synced {
            if let Some(s) = synced.get_mut(o as usize) {
                *s = true;
            }
        }
        let held_now = blocking(|| rejoin::held(state, held, &synced_keys, &boot_keys));
        let msg = wire::encode_held(&held_now);
        report.payload_bytes += msg.len() as u64;
        ch.send(&msg).await?;
        let (catch_up, len) = ch
            .recv_with(|msg| -> Result<(wire::CatchUpPlan, usize), SyncError> {
                let (h, body) = Header::parse(msg).map_err(|e| handshake(e.to_string()))?;
                h.expect(Kind::CatchUp)
                    .and_then(|_| wire::decode_catch_up(&h, body))
                    .map(|c| (c, msg.len()))
                    .map_err(|e| handshake(e.to_string()))
            })
            .await??;
        report.payload_bytes += len as u64;
        self.reach(HoldPoint::CatchUp).await;
        if catch_up.boot_buckets > 0 {
            let got = receive_init_buckets(&mut ch, catch_up.boot_buckets, &meta, state).await?;
            report.boot_bytes = got.payload_bytes;
            report.payload_bytes += got.payload_bytes;
        }
        // Replay starts from the held version; a full or deferred catch-up replaces everything.
        let start = match catch_up.mode {
            wire::CatchUpMode::Replay => held,
            wire::CatchUpMode::Full | wire::CatchUpMode::Deferred => 0,
        };
        let shared = Arc::new(ReceiverShared {
            meta,
            synced,
            applied: AtomicU64::new(start),
            pool: Mutex::new(Pool::default()),
            threads: self.settings.threads,
        });
        let mut r = ReceiverSide {
            ch,
            strategy: plan.strategy,
            synced_keys,
            received: start,
            interrupted: None,
            shared,
        };
        match catch_up.mode {
            wire::CatchUpMode::Replay => {
                report.kind = CatchUpKind::Replay;
                for _ in 0..catch_up.patches {
                    let pending = receive_patch(&mut r).await?;
                    let got = pending.install(state)?;
                    report.payload_bytes += got.payload_bytes;
                    report.patches += 1;
                }
            }
            wire::CatchUpMode::Full => {
                report.kind = CatchUpKind::Full;
                if catch_up.version == 0 {
                    // Version 0 (no sync yet): the snapshot travels as init buckets, like the bootstrap.
                    let got = receive_init_buckets(
                        &mut r.ch,
                        catch_up.full_buckets,
                        &r.shared.meta,
                        state,
                    )
                    .await?;
                    report.payload_bytes += got.payload_bytes;
                } else if catch_up.full_buckets > 0 {
                    let (_, got) = receive_buckets(&mut r, Some(state)).await?;
                    report.payload_bytes += got.payload_bytes;
                }
            }
            wire::CatchUpMode::Deferred => {
                report.kind = CatchUpKind::Full;
                report.deferred = true;
            }
        }
        let now = r.shared.applied.load(Ordering::SeqCst);
        if now != catch_up.version {
            return Err(rejected(
                Some(catch_up.version),
                now,
                format!(
                    "the catch-up was announced to reach version {}, it reached {now}",
                    catch_up.version
                ),
            ));
        }
        report.to = now;
        report.elapsed = started.elapsed();
        self.side = Side::Receiver(r);
        Ok(report)
    }

    // -----------------------------------------------------------------------------------------------------
    // receiver

    /// Receive the next version and install it into `state`; `report.version` is the applied version.
    pub async fn apply(&mut self, state: &mut StateDict) -> Result<SyncReport, SyncError> {
        let instant = self.settings.load_instant;
        let Side::Receiver(r) = &mut self.side else {
            return Err(SyncError::NotInitialized {
                expected: "receiver",
            });
        };
        if r.strategy == Strategy::Bucket && instant {
            return receive_buckets(r, Some(state))
                .await
                .map(|(_, report)| report);
        }
        let pending = receive(r).await?;
        pending.install(state)
    }

    /// Background (no-wait) receive: read and validate the next update without touching the weights; install
    /// it later with [`PendingUpdate::install`] (between rollout chunks, never mid-forward).
    pub async fn receive(&mut self) -> Result<PendingUpdate, SyncError> {
        let Side::Receiver(r) = &mut self.side else {
            return Err(SyncError::NotInitialized {
                expected: "receiver",
            });
        };
        receive(r).await
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
                .recv_with(|msg| -> Result<bool, String> {
                    let (h, body) = Header::parse_unverified(msg).map_err(|e| e.to_string())?;
                    h.expect(Kind::InitBucket).map_err(|e| e.to_string())?;
                    if h.seq != seq || h.count != count || h.version != 0 {
                        return Err(format!(
                            "init bucket {}/{} (version {}) out of sequence, expected {seq}/{count}",
                            h.seq, h.count, h.version
                        ));
                    }
                    match asm.as_mut() {
                        None => {
                            asm = Some(blocking(|| {
                                Assembly::start(&h, body, meta, &all, &mut pool)
                            })?)
                        }
                        Some(a) => blocking(|| a.add_part(&h, body))?,
                    }
                    Ok(asm.as_ref().is_some_and(Assembly::is_complete))
                })
                .await?
                .map_err(|reason| SyncError::Handshake {
                    reason: format!("init bootstrap: {reason}"),
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
    bucket::check_fits(&staged, meta, state).map_err(|reason| SyncError::Handshake { reason })?;
    report.tensors = staged.len();
    report.changed = staged
        .iter()
        .map(|(o, s)| (s.len() / meta.get(*o as usize).map_or(1, |m| m.dtype.size_bytes())) as u64)
        .sum();
    let _ = bucket::swap_in(staged, state);
    report.apply = t0.elapsed();
    Ok(report)
}

/// A received, verified update waiting to be installed.
pub struct PendingUpdate {
    version: u64,
    body: PendingBody,
    shared: Arc<ReceiverShared>,
    report: SyncReport,
}

enum PendingBody {
    Patch { base: u64, body: wire::PatchBody },
    Bucket(Staged),
}

impl PendingUpdate {
    pub fn version(&self) -> u64 {
        self.version
    }

    /// Install into `state` (the receiver's state dict from init). Rejected — state and version untouched —
    /// when the version is no longer newer than the applied one, a patch's base is not the applied version,
    /// or the payload does not fit the state dict.
    pub fn install(self, state: &mut StateDict) -> Result<SyncReport, SyncError> {
        let PendingUpdate {
            version,
            body,
            shared,
            mut report,
        } = self;
        let current = shared.applied.load(Ordering::SeqCst);
        if version <= current {
            if let PendingBody::Bucket(staged) = body {
                give_back(&shared, staged);
            }
            return Err(rejected(
                Some(version),
                current,
                format!("version {version} is not newer than the applied version {current}"),
            ));
        }
        match body {
            PendingBody::Patch { base, body } => {
                if base != current {
                    return Err(rejected(
                        Some(version),
                        current,
                        format!(
                            "patch is based on version {base}, this receiver holds {current} (a full resync is needed)"
                        ),
                    ));
                }
                let t0 = Instant::now();
                let valid: ValidPatch = blocking(|| {
                    patch::validate(body, &shared.meta, &shared.synced, state, shared.threads)
                })
                .map_err(|r| rejected(Some(version), current, r))?;
                report.decode += t0.elapsed();
                let t1 = Instant::now();
                blocking(|| patch::install(&valid, state, shared.threads));
                report.apply = t1.elapsed();
                report.changed = valid.changed;
            }
            PendingBody::Bucket(staged) => {
                if let Err(r) = bucket::check_fits(&staged, &shared.meta, state) {
                    give_back(&shared, staged);
                    return Err(rejected(Some(version), current, r));
                }
                let t1 = Instant::now();
                let old = blocking(|| bucket::install(staged, state, shared.threads));
                report.apply = t1.elapsed();
                give_back(&shared, old);
            }
        }
        shared.applied.store(version, Ordering::SeqCst);
        report.version = version;
        Ok(report)
    }
}

fn give_back(shared: &ReceiverShared, staged: Staged) {
    shared.pool().give_all(staged);
}

/// Read the next update (patch: one message; bucket: all buckets of a version, staged).
async fn receive(r: &mut ReceiverSide) -> Result<PendingUpdate, SyncError> {
    match r.strategy {
        Strategy::Patch => receive_patch(r).await,
        Strategy::Bucket => match receive_buckets(r, None).await? {
            (Some(p), _) => Ok(p),
            (None, _) => Err(rejected(
                None,
                r.shared.applied.load(Ordering::SeqCst),
                "bucket version produced no staged update",
            )),
        },
    }
}

async fn receive_patch(r: &mut ReceiverSide) -> Result<PendingUpdate, SyncError> {
    let current = r.shared.applied.load(Ordering::SeqCst);
    let received = r.received;
    let t_wait = Instant::now();
    let max_stream = r
        .shared
        .meta
        .iter()
        .map(|m| m.shape.iter().product::<usize>().saturating_mul(10))
        .sum::<usize>()
        .saturating_add(1 << 16);
    let mut decode = Duration::ZERO;
    let out =
        r.ch.recv_with(
            |msg| -> Result<(u64, u64, wire::PatchBody, usize, Duration), SyncError> {
                let t0 = Instant::now();
                // Verify what is installed: the slot may be shared memory another process can write, so the
                // checksum and the decoding both read one private copy, never the slot twice.
                let msg = blocking(|| msg.to_vec());
                let (h, body) =
                    Header::parse(&msg).map_err(|e| rejected(None, current, e.to_string()))?;
                h.expect(Kind::Patch)
                    .map_err(|e| rejected(Some(h.version), current, e.to_string()))?;
                if h.version <= received {
                    return Err(rejected(
                        Some(h.version),
                        current,
                        format!(
                            "version {} is not newer than {received} (replayed or stale)",
                            h.version
                        ),
                    ));
                }
                let pb = blocking(|| wire::decode_patch_body(body, max_stream))
                    .map_err(|e: WireError| rejected(Some(h.version), current, e.to_string()))?;
                Ok((h.version, h.aux, pb, msg.len(), t0.elapsed()))
            },
        )
        .await?;
    let (version, base, body, len, d) = out?;
    decode += d;
    r.received = version;
    let report = SyncReport {
        kind: SyncKind::Patch,
        payload_bytes: len as u64,
        messages: 1,
        tensors: body.entries.len(),
        transfer: t_wait.elapsed().saturating_sub(decode),
        decode,
        compression_ratio: 1.0,
        state_bytes: r.shared.synced_bytes(),
        ..Default::default()
    };
    Ok(PendingUpdate {
        version,
        body: PendingBody::Patch { base, body },
        shared: r.shared.clone(),
        report,
    })
}

enum BucketStep {
    /// A leftover part of an earlier (rejected or interrupted) version.
    Skip,
    /// A part was staged; the bucket is complete when this is true.
    Staged { complete: bool, decode: Duration },
}

/// Receive every bucket of one version, part by part. With `install = Some(state)` (load_instant) each
/// verified bucket is swapped into the state at once and undone if a later bucket fails (or the channel
/// fails mid-version); otherwise everything is staged and returned as a pending update.
async fn receive_buckets(
    r: &mut ReceiverSide,
    mut install: Option<&mut StateDict>,
) -> Result<(Option<PendingUpdate>, SyncReport), SyncError> {
    let shared = r.shared.clone();
    let current = shared.applied.load(Ordering::SeqCst);
    let mut report = SyncReport {
        kind: SyncKind::Bucket,
        compression_ratio: 1.0,
        ..Default::default()
    };
    let mut staged_all: Staged = Vec::new();
    let mut undo: Staged = Vec::new();
    let mut asm: Option<Assembly> = None;
    let mut version: Option<u64> = None;
    let mut count = 0u32;
    let mut seq = 0u32;
    let t_start = Instant::now();
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
            .recv_with(|msg| -> Result<BucketStep, (Option<u64>, String)> {
                let t0 = Instant::now();
                let (h, body) = Header::parse_unverified(msg).map_err(|e| (None, e.to_string()))?;
                h.expect(Kind::Bucket).map_err(|e| (Some(h.version), e.to_string()))?;
                if let Some(a) = asm.as_mut() {
                    blocking(|| a.add_part(&h, body)).map_err(|e| (Some(h.version), e))?;
                    return Ok(BucketStep::Staged { complete: a.is_complete(), decode: t0.elapsed() });
                }
                let starts_version = h.seq == 0 && h.aux == 0;
                match v_now {
                    // Later buckets, or later parts of a bucket this receiver gave up on, of an earlier version.
                    None if h.seq != 0 || (!starts_version && interrupted == Some(h.version)) => {
                        // Skip only a genuine leftover: a corrupted header must not make a part look like one.
                        Header::parse(msg).map_err(|e| (Some(h.version), e.to_string()))?;
                        return Ok(BucketStep::Skip);
                    }
                    None if !starts_version => {
                        return Err((Some(h.version), format!("version {} starts at byte {} of bucket {}/{}, not at its beginning", h.version, h.aux, h.seq, h.count)));
                    }
                    None if h.version <= received => {
                        return Err((Some(h.version), format!("version {} is not newer than {received} (replayed or stale)", h.version)));
                    }
                    None => {}
                    Some(v) if h.version != v || h.seq != seq || h.count != count => {
                        return Err((Some(h.version), format!("bucket {}/{} of version {} arrived while expecting {seq}/{count} of version {v}", h.seq, h.count, h.version)));
                    }
                    Some(_) => {}
                }
                let mut pool = shared.pool();
                let a = blocking(|| Assembly::start(&h, body, &shared.meta, &shared.synced, &mut pool)).map_err(|e| (Some(h.version), e))?;
                let complete = a.is_complete();
                if v_now.is_none() {
                    version = Some(h.version);
                    count = h.count;
                }
                asm = Some(a);
                Ok(BucketStep::Staged { complete, decode: t0.elapsed() })
            })
            .await;
        let step = match step {
            Ok(step) => step,
            Err(e) => {
                r.interrupted = version;
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
                let staged = done.finish();
                report.tensors += staged.len();
                report.changed += staged
                    .iter()
                    .map(|(o, s)| {
                        (s.len()
                            / shared
                                .meta
                                .get(*o as usize)
                                .map_or(1, |m| m.dtype.size_bytes())) as u64
                    })
                    .sum::<u64>();
                match install.as_deref_mut() {
                    Some(state) => {
                        if let Err(reason) = bucket::check_fits(&staged, &shared.meta, state) {
                            give_back(&shared, staged);
                            r.interrupted = version;
                            return Err(fail(
                                rejected(version, current, reason),
                                None,
                                staged_all,
                                undo,
                                Some(state),
                            ));
                        }
                        let t1 = Instant::now();
                        if seq + 1 == count {
                            // The last bucket: nothing after it can fail, so no undo needs its old values.
                            let spare = blocking(|| bucket::install(staged, state, shared.threads));
                            give_back(&shared, spare);
                        } else {
                            undo.extend(bucket::swap_in(staged, state));
                        }
                        report.apply += t1.elapsed();
                    }
                    None => staged_all.extend(staged),
                }
                seq += 1;
                if seq == count {
                    break;
                }
            }
            Err((v, reason)) => {
                r.interrupted = v.or(version);
                return Err(fail(
                    rejected(v.or(version), current, reason),
                    asm,
                    staged_all,
                    undo,
                    install,
                ));
            }
        }
    }
    let version = version.unwrap_or(0);
    r.received = version;
    report.transfer = t_start
        .elapsed()
        .saturating_sub(report.decode + report.apply);
    report.version = version;
    report.state_bytes = shared.synced_bytes();
    match install {
        Some(_) => {
            give_back(&shared, undo);
            shared.applied.store(version, Ordering::SeqCst);
            Ok((None, report))
        }
        None => Ok((
            Some(PendingUpdate {
                version,
                body: PendingBody::Bucket(staged_all),
                shared: shared.clone(),
                report: report.clone(),
            }),
            report,
        )),
    }
}
