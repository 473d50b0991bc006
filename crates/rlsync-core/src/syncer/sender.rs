//! The sending half of [`WeightSyncer`] (the trainer's end): the handshake and init bootstrap
//! (`init_sender`), one version per `sync` (patch or buckets), a rejoining receiver's catch-up (`rejoin`),
//! and `flush`.

use super::*;

impl WeightSyncer {
    // -----------------------------------------------------------------------------------------------------
    // init

    /// Sender side of the handshake (+ init bootstrap for patch). `keys_to_sync` are the keys every later
    /// `sync` covers (typically `state.synced_keys()`: trainable parameters and persistent buffers).
    pub async fn init_sender(
        &mut self,
        state: &StateDict,
        keys_to_sync: &[String],
        mut ch: transport::Sender,
    ) -> Result<SyncReport, SyncError> {
        if !matches!(self.side, Side::Uninit) {
            return Err(SyncError::AlreadyInitialized);
        }
        // 1. every receiver's metadata
        let mut meta: Option<Vec<KeyMeta>> = None;
        for rank in 0..ch.receivers() {
            let msg = match ch.recv_from(rank).await {
                Ok(msg) => msg,
                // Elastic: a receiver that died during the bootstrap is detached; its successor rejoins.
                Err(TransportError::PeerGone { .. }) if ch.is_elastic() => {
                    tracing::warn!(
                        rank,
                        "receiver went away during the bootstrap; it may rejoin"
                    );
                    continue;
                }
                Err(e) => return Err(e.into()),
            };
            let m = Header::parse(&msg)
                .and_then(|(h, body)| {
                    h.expect(Kind::Metadata)
                        .and_then(|_| wire::decode_metadata(body))
                })
                .map_err(|e| SyncError::Handshake {
                    reason: format!("metadata from receiver rank {rank}: {e}"),
                })?;
            match &meta {
                Some(first) if *first != m => {
                    let reason = format!(
                        "receiver rank {rank} reports different keys/shapes/dtypes than rank 0"
                    );
                    abort(&mut ch, &reason).await;
                    return Err(SyncError::Handshake { reason });
                }
                Some(_) => {}
                None => meta = Some(m),
            }
        }
        let meta = match meta {
            Some(meta) => meta,
            None if ch.receivers() == 0 => Vec::new(),
            None => {
                return Err(SyncError::Handshake {
                    reason: "every receiver went away before sending its metadata".into(),
                });
            }
        };
        if self.settings.same_keys
            && let Some(diff) = bootstrap::first_difference(&meta, state)
        {
            let reason = format!("trainer and rollout state dicts differ: {diff}");
            abort(&mut ch, &reason).await;
            return Err(SyncError::Handshake { reason });
        }
        // 2. key selection and checks
        let patch_init = self.settings.kind == SyncerKind::Patch && self.settings.init_sync;
        let boot_keys: Vec<String> = match (patch_init, &self.settings.init_prefixes) {
            (false, _) => Vec::new(),
            (true, None) => state.keys().map(str::to_string).collect(),
            (true, Some(p)) => match bootstrap::select_prefixed(state, p) {
                Ok(k) => k,
                Err(reason) => {
                    abort(&mut ch, &reason).await;
                    return Err(SyncError::Config { reason });
                }
            },
        };
        let mut all: Vec<&str> = keys_to_sync.iter().map(String::as_str).collect();
        for k in &boot_keys {
            if !keys_to_sync.contains(k) {
                all.push(k);
            }
        }
        let full_state = patch_init && self.settings.init_prefixes.is_none();
        let ordinals = match bootstrap::check_metadata(&meta, state, &all, full_state) {
            Ok(o) => o,
            Err(reason) => {
                abort(&mut ch, &reason).await;
                return Err(SyncError::Handshake { reason });
            }
        };
        if let Some(dup) = keys_to_sync
            .iter()
            .enumerate()
            .find(|(i, k)| keys_to_sync[..*i].contains(k))
        {
            let reason = format!("keys_to_sync lists '{}' twice", dup.1);
            abort(&mut ch, &reason).await;
            return Err(SyncError::Handshake { reason });
        }
        // From here on the keys go in the state dict's order (ordinal order), whatever order the caller listed
        // them in: patch entries and buckets are laid out in that order, and receivers validate it.
        let mut keys_to_sync = keys_to_sync.to_vec();
        keys_to_sync.sort_by_key(|k| ordinals.get(k).copied().unwrap_or(u32::MAX));
        let keys_to_sync = keys_to_sync.as_slice();
        let synced_ordinals: Vec<u32> = keys_to_sync
            .iter()
            .filter_map(|k| ordinals.get(k).copied())
            .collect();
        let recv_dtypes: Vec<DType> = synced_ordinals
            .iter()
            .map(|&o| meta[o as usize].dtype)
            .collect();
        // 3. plan + bootstrap
        let boot_refs: Vec<&str> = boot_keys.iter().map(String::as_str).collect();
        let boot_items =
            bootstrap::plan_items(state, &boot_refs, &meta, &ordinals, |_, receiver| receiver);
        let boot_buckets = bucket::plan(boot_items, self.settings.init_bucket_size);
        let strategy = match self.settings.kind {
            SyncerKind::Patch => Strategy::Patch,
            SyncerKind::Bucket => Strategy::Bucket,
        };
        let plan = Plan {
            strategy,
            synced: synced_ordinals.clone(),
            init_buckets: boot_buckets.len() as u32,
        };
        ch.send(&wire::encode_plan(&plan)).await?;
        let mut report = SyncReport {
            kind: SyncKind::Init,
            messages: boot_buckets.len() as u32,
            compression_ratio: 1.0,
            ..Default::default()
        };
        if !boot_buckets.is_empty() {
            let part_bytes = self.settings.part_bytes;
            let stats = bucket::send(
                &mut ch,
                state,
                &boot_buckets,
                Kind::InitBucket,
                0,
                part_bytes,
            )
            .await?;
            report.payload_bytes = stats.payload_bytes;
            report.encode = stats.fill;
            report.changed = boot_buckets
                .iter()
                .flatten()
                .map(|p| (p.entry.byte_len / p.entry.dtype.size_bytes()) as u64)
                .sum();
            report.tensors = boot_buckets.iter().map(Vec::len).sum();
        }
        // 4. the strategy's own state
        let t_build = Instant::now();
        let strategy = match self.settings.kind {
            SyncerKind::Patch => {
                let mut snap = Vec::with_capacity(keys_to_sync.len());
                for ((key, &o), &rd) in keys_to_sync.iter().zip(&synced_ordinals).zip(&recv_dtypes)
                {
                    let t = state.get(key).ok_or_else(|| SyncError::StateMismatch {
                        key: key.clone(),
                        reason: "missing from the state dict".into(),
                    })?;
                    let mut storage = Storage::zeroed(t.numel() * rd.size_bytes());
                    blocking(|| cast_bytes(t.bytes(), t.dtype(), storage.bytes_mut(), rd))
                        .map_err(|e| SyncError::StateMismatch {
                            key: key.clone(),
                            reason: e.to_string(),
                        })?;
                    let cols = t.layout().coo_view().map_or(t.numel(), |(_, c)| c);
                    snap.push(SnapTensor {
                        key: key.clone(),
                        ordinal: o,
                        dtype: rd,
                        cols,
                        storage,
                    });
                }
                SenderStrategy::Patch {
                    snap: Arc::new(snap),
                    built: patch::Built::default(),
                }
            }
            SyncerKind::Bucket => {
                let refs: Vec<&str> = keys_to_sync.iter().map(String::as_str).collect();
                let bucket_dtype = self.settings.bucket_dtype;
                let items = bootstrap::plan_items(state, &refs, &meta, &ordinals, |src, _| {
                    match bucket_dtype {
                        Some(d) if src.is_floating() => d,
                        _ => src,
                    }
                });
                let mut buckets = bucket::plan(items, self.settings.bucket_size);
                if buckets.is_empty() {
                    // Nothing selected: one empty bucket per version still carries the version.
                    buckets.push(Vec::new());
                }
                SenderStrategy::Bucket {
                    buckets,
                    last: Vec::new(),
                }
            }
        };
        report.build = t_build.elapsed();
        report.state_bytes = synced_ordinals
            .iter()
            .zip(keys_to_sync)
            .map(|(&o, k)| {
                state
                    .get(k)
                    .map_or(0, |t| t.numel() * meta[o as usize].dtype.size_bytes())
                    as u64
            })
            .sum();
        let t_flush = Instant::now();
        ch.flush().await?;
        report.transfer = t_flush.elapsed();
        let boot_only: Vec<(String, u32)> = boot_keys
            .iter()
            .filter(|k| !keys_to_sync.contains(k))
            .filter_map(|k| ordinals.get(k).map(|&o| (k.clone(), o)))
            .collect();
        let boot_typed: Vec<(String, DType)> = boot_only
            .iter()
            .map(|(k, o)| (k.clone(), meta[*o as usize].dtype))
            .collect();
        let boot_checksum = blocking(|| rejoin::cast_checksum(state, &boot_typed))?;
        self.side = Side::Sender(SenderSide {
            ch,
            synced_keys: keys_to_sync.to_vec(),
            recv_dtypes,
            last_version: 0,
            strategy,
            rejoin: rejoin::RejoinInfo {
                meta,
                synced_ordinals,
                boot_only,
                init_bucket_size: self.settings.init_bucket_size,
                boot_checksum,
                log: ReplayLog::new(
                    self.settings.replay_versions,
                    self.settings.replay_max_bytes,
                ),
                checksum: Mutex::new(None),
                hashing: Mutex::new(None),
            },
        });
        if let Side::Sender(s) = &self.side
            && let SenderStrategy::Patch { snap, .. } = &s.strategy
            && s.rejoin.log.is_enabled()
        {
            s.rejoin.checksum_in_background(0, snap);
        }
        Ok(report)
    }

    // -----------------------------------------------------------------------------------------------------
    // sender

    /// Send version `version` (must be greater than the last one sent) of the synced keys of `state`.
    pub async fn sync(&mut self, state: &StateDict, version: u64) -> Result<SyncReport, SyncError> {
        let settings = self.settings.clone();
        let Side::Sender(s) = &mut self.side else {
            return Err(SyncError::NotInitialized { expected: "sender" });
        };
        if version <= s.last_version {
            return Err(SyncError::VersionNotNewer {
                version,
                last: s.last_version,
            });
        }
        let mut report = match &mut s.strategy {
            SenderStrategy::Patch {
                snap: shared,
                built,
            } => {
                // The log needs the checksum of the base (the snapshot before this build): normally computed in
                // the background since the last sync (waited for here), else now.
                s.rejoin.settle();
                let base_checksum = s.rejoin.log.is_enabled().then(|| {
                    s.rejoin.cached_checksum(s.last_version).unwrap_or_else(|| {
                        let c = blocking(|| rejoin::snapshot_checksum(shared, &s.rejoin.meta));
                        s.rejoin.cache_checksum(s.last_version, c);
                        c
                    })
                });
                // No background checksum holds the snapshot any more (settled above).
                let snap = Arc::get_mut(shared).ok_or_else(|| SyncError::StateMismatch {
                    key: "(snapshot)".into(),
                    reason: "the snapshot is still being read by a checksum thread".into(),
                })?;
                let t0 = Instant::now();
                blocking(|| patch::build(snap, state, settings.threads, built)).map_err(
                    |reason| SyncError::StateMismatch {
                        key: "(synced keys)".into(),
                        reason,
                    },
                )?;
                let build = t0.elapsed();
                let t1 = Instant::now();
                let (msg, ratio, tensors, dense) = blocking(|| {
                    let mut h = Header::new(Kind::Patch, version, 0);
                    h.aux = s.last_version;
                    let (enc, tensors, dense) = patch::encode_message(
                        built,
                        snap,
                        settings.delta,
                        settings.threads,
                        h,
                        settings.codec,
                    );
                    let ratio = if enc.stored_stream_bytes == 0 {
                        1.0
                    } else {
                        enc.raw_stream_bytes as f64 / enc.stored_stream_bytes as f64
                    };
                    (enc.msg, ratio, tensors, dense)
                });
                let encode = t1.elapsed();
                let state_bytes = snap.iter().map(|t| t.storage.len() as u64).sum();
                let t2 = Instant::now();
                s.ch.send(&msg).await?;
                let payload_bytes = msg.len() as u64;
                if let Some(c) = base_checksum {
                    s.rejoin.log.push(s.last_version, version, c, msg);
                    // The next sync's base: hashed while the caller goes on (its next training step).
                    s.rejoin.checksum_in_background(version, shared);
                }
                SyncReport {
                    kind: SyncKind::Patch,
                    payload_bytes,
                    changed: built.changed,
                    state_bytes,
                    tensors,
                    messages: 1,
                    build,
                    encode,
                    transfer: t2.elapsed(),
                    compression_ratio: ratio,
                    dense_segments: dense,
                    ..Default::default()
                }
            }
            SenderStrategy::Bucket { buckets, last } => {
                let stats = bucket::send(
                    &mut s.ch,
                    state,
                    buckets,
                    Kind::Bucket,
                    version,
                    settings.part_bytes,
                )
                .await?;
                if settings.keep_last {
                    blocking(|| keep_copy(last, buckets, state))?;
                }
                SyncReport {
                    kind: SyncKind::Bucket,
                    payload_bytes: stats.payload_bytes,
                    changed: buckets
                        .iter()
                        .flatten()
                        .map(|p| (p.entry.byte_len / p.entry.dtype.size_bytes()) as u64)
                        .sum(),
                    state_bytes: s
                        .synced_keys
                        .iter()
                        .zip(&s.recv_dtypes)
                        .map(|(k, d)| state.get(k).map_or(0, |t| t.numel() * d.size_bytes()) as u64)
                        .sum(),
                    tensors: buckets.iter().map(Vec::len).sum(),
                    messages: stats.messages,
                    encode: stats.fill,
                    transfer: stats.wait,
                    compression_ratio: 1.0,
                    ..Default::default()
                }
            }
        };
        s.last_version = version;
        report.version = version;
        Ok(report)
    }

    /// Sender: catch up receiver `rank`, which joined the (elastic) channel late and called
    /// [`WeightSyncer::rejoin_receiver`]: replay of logged patches when sound, else a full transfer (see
    /// `syncer/rejoin.rs`). Only that receiver sees these messages. Waits (bounded by the channel's timeout)
    /// for the receiver to join.
    pub async fn rejoin(
        &mut self,
        state: &StateDict,
        rank: usize,
    ) -> Result<CatchUpReport, SyncError> {
        self.rejoin_at(state, rank, false).await
    }

    /// [`WeightSyncer::rejoin`], where the caller says whether `state` is still exactly the last version sent
    /// (nothing trained since): the bucket syncer, which keeps no copy of it, then sends `state` as that version
    /// instead of deferring the receiver to the next one.
    pub async fn rejoin_at(
        &mut self,
        state: &StateDict,
        rank: usize,
        state_is_last: bool,
    ) -> Result<CatchUpReport, SyncError> {
        let part_bytes = self.settings.part_bytes;
        let Side::Sender(s) = &mut self.side else {
            return Err(SyncError::NotInitialized { expected: "sender" });
        };
        let (snap, bucket_full, strategy) = match &s.strategy {
            SenderStrategy::Patch { snap, .. } => {
                s.rejoin.settle();
                (Some(snap.as_slice()), None, Strategy::Patch)
            }
            SenderStrategy::Bucket { buckets, last } => {
                let source = if state_is_last {
                    Some(rejoin::BucketSource::State(buckets.as_slice()))
                } else if !last.is_empty() {
                    Some(rejoin::BucketSource::Copy(
                        buckets.as_slice(),
                        last.as_slice(),
                    ))
                } else {
                    None
                };
                (None, source, Strategy::Bucket)
            }
        };
        rejoin::serve(
            &mut s.ch,
            rank,
            &s.rejoin,
            state,
            snap,
            bucket_full,
            s.last_version,
            strategy,
            part_bytes,
        )
        .await
    }

    /// Sender: bytes held by the replay log.
    pub fn replay_log_bytes(&self) -> u64 {
        match &self.side {
            Side::Sender(s) => s.rejoin.log.bytes(),
            _ => 0,
        }
    }

    /// Sender: receiver ranks attached to the channel now.
    pub fn live_receivers(&self) -> Vec<usize> {
        match &self.side {
            Side::Sender(s) => s.ch.live(),
            _ => Vec::new(),
        }
    }

    /// Wait until every receiver has released every published payload.
    pub async fn flush(&mut self) -> Result<(), SyncError> {
        let Side::Sender(s) = &mut self.side else {
            return Err(SyncError::NotInitialized { expected: "sender" });
        };
        Ok(s.ch.flush().await?)
    }
}

/// Copy the bytes of every planned tensor of `state` into `last` (buffers reused from the previous version).
fn keep_copy(
    last: &mut Vec<Vec<Vec<u8>>>,
    buckets: &[Vec<Planned>],
    state: &StateDict,
) -> Result<(), SyncError> {
    last.resize_with(buckets.len(), Vec::new);
    for (bucket, copies) in buckets.iter().zip(last.iter_mut()) {
        copies.resize_with(bucket.len(), Vec::new);
        for (p, copy) in bucket.iter().zip(copies.iter_mut()) {
            let t = state.get(&p.key).ok_or_else(|| SyncError::StateMismatch {
                key: p.key.clone(),
                reason: "missing from the state dict".into(),
            })?;
            copy.clear();
            copy.extend_from_slice(t.bytes());
        }
    }
    Ok(())
}

async fn abort(ch: &mut transport::Sender, reason: &str) {
    // Best effort: receivers that cannot be told will time out on their own.
    let _ = ch.send(&wire::encode_abort(reason)).await;
}
