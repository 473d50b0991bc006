//! The trainer worker: holds the model, trains on trajectory batches, publishes weights to every rollout.

mod remote;

use std::time::Instant;

use crate::config::schema::RunConfig;
use crate::worker::gpu_channel::{self, ChannelSender};
use crate::worker::workload::{Batch, Workload};
use crate::worker::{WorkerContext, WorkerError, WorkloadBuilder, kernel_threads};
use rlsync_core::protocol::messages::{Command, Report, SyncStats};
use rlsync_core::syncer::settings::WeightSyncerConfig;
use rlsync_core::syncer::{
    HostRejoin, SyncError, SyncOptions, SyncReport, SyncSender, WeightSyncer,
};
use rlsync_core::tensor::StateDict;
use rlsync_core::transport::{
    ChainConfig, ChainSender, Peer, Sender, ShmConfig, ShmSender, TransportError,
};

/// Run the trainer's command loop until `Stop`.
pub async fn run(ctx: &mut WorkerContext, build: WorkloadBuilder) -> Result<(), WorkerError> {
    let cfg = ctx.config().clone();
    // A resumed run continues the checkpoint's steps and versions; the bootstrap carries its weights.
    let start = ctx.launch.start;
    let building = Instant::now();
    let mut workload = tokio::task::block_in_place(|| build(ctx))?;
    let mut state = tokio::task::block_in_place(|| workload.init_state())?;
    if let Some(dir) = &cfg.runner.resume_dir {
        tokio::task::block_in_place(|| workload.restore(&mut state, dir))?;
    }
    let keys = state.synced_keys();
    let threads = kernel_threads(1);
    // The syncer until `InitWeights` makes it the sending end.
    let mut unready = Some(new_syncer(&cfg, cfg.host_syncer(), threads)?);
    let mut sender: Option<Publisher> = None;
    let mut version = start.version;
    let mut steps_done = start.step;
    // The trained version the rollouts were last sent (the state is exactly that version while equal).
    let mut synced_at = start.version;
    tracing::info!(
        "trainer ready: {} tensors ({} synced), {:.1} MB, starting at step {} (version {})",
        state.iter().count(),
        keys.len(),
        state.total_bytes() as f64 / 1e6,
        start.step,
        start.version
    );
    crate::worker::report_built(ctx, building).await?;
    loop {
        let frame = ctx.control.next().await?;
        match frame.header {
            Command::InitWeights => {
                let started = Instant::now();
                let Some(syncer) = unready.take() else {
                    return Err(unexpected(
                        "InitWeights (the weights were initialised already)",
                    ));
                };
                if let Some(socket) = ctx.launch.gpu_socket.clone() {
                    // The handshake and the init bootstrap run on the host; every version from now on goes
                    // device to device to this host's rollouts (the host syncer's snapshot goes; its channel
                    // stays for rejoins), and over the TCP chain to other hosts' (`remote`).
                    let (end, mut report, remote) =
                        init_split(ctx, syncer, workload.as_mut(), &state, &keys, threads).await?;
                    report.version = start.version;
                    let (publisher, checksum) =
                        gpu_publisher(ctx, workload.as_mut(), &state, end, remote, &socket)?;
                    let synced = Report::Synced {
                        stats: sync_stats(&report),
                        checksum,
                        seconds: started.elapsed().as_secs_f64(),
                    };
                    sender = Some(publisher);
                    ctx.control.report(&synced, &[]).await?;
                    continue;
                }
                let channel = open_sender(ctx).await?;
                tokio::task::block_in_place(|| workload.host_view())?;
                let (mut end, mut report) = syncer.init_sender(&state, &keys, channel).await?;
                // The syncer numbers its bootstrap 0; the run's version of those weights is `start.version`.
                report.version = start.version;
                if let Some(what) = workload.attach_sender(&mut end, &state) {
                    tracing::info!("weights synced from the device from now on: {what}");
                }
                let synced = synced_report(
                    &end,
                    workload.as_mut(),
                    &state,
                    &report,
                    started,
                    cfg.runner.verify_sync,
                )?;
                sender = Some(Publisher::Host(end));
                ctx.control.report(&synced, &[]).await?;
            }
            Command::Sync { version: wanted } => {
                let started = Instant::now();
                let synced = match sender.as_mut() {
                    None => return Err(unexpected("Sync (before InitWeights)")),
                    Some(Publisher::Host(syncer)) => {
                        if syncer.needs_host_view() {
                            tokio::task::block_in_place(|| workload.host_view())?;
                        }
                        let report = syncer.sync(&state, wanted).await?;
                        synced_report(
                            syncer,
                            workload.as_mut(),
                            &state,
                            &report,
                            started,
                            cfg.runner.verify_sync,
                        )?
                    }
                    Some(Publisher::Gpu {
                        channel,
                        names,
                        remote,
                        ..
                    }) => {
                        let report = tokio::task::block_in_place(|| channel.sync(wanted))?;
                        tracing::debug!("{}", gpu_channel::describe(&report));
                        let mut stats =
                            gpu_channel::stats(&report, gpu_channel::state_bytes(names));
                        if let Some(remote) = remote {
                            if remote.syncer.needs_host_view() {
                                tokio::task::block_in_place(|| workload.host_view())?;
                            }
                            let far = remote.syncer.sync(&state, wanted).await?;
                            stats = remote::stats(&stats, &sync_stats(&far));
                        }
                        // Every rollout, on this host or another, holds what the channel's rollouts hold.
                        let checksum = if cfg.runner.verify_sync {
                            gpu_channel::checksum(channel, names)?
                        } else {
                            0
                        };
                        Report::Synced {
                            stats,
                            checksum,
                            seconds: started.elapsed().as_secs_f64(),
                        }
                    }
                };
                synced_at = version;
                ctx.control.report(&synced, &[]).await?;
            }
            Command::Train {
                step,
                chunks,
                env_steps,
            } => {
                let started = Instant::now();
                let batch = Batch {
                    chunks,
                    env_steps,
                    data: &frame.blob,
                };
                let stats =
                    tokio::task::block_in_place(|| workload.train_step(&mut state, &batch))?;
                version += 1;
                steps_done += 1;
                let busy_s = started.elapsed().as_secs_f64();
                ctx.control
                    .report(
                        &Report::Trained {
                            step,
                            version,
                            loss: stats.loss,
                            busy_s,
                            metrics: finite_or_none(stats.metrics),
                        },
                        &[],
                    )
                    .await?;
            }
            Command::Rejoin { rank, receiver } => {
                let syncer = match sender.as_mut() {
                    None => return Err(unexpected("Rejoin (before InitWeights)")),
                    Some(Publisher::Gpu {
                        remote: Some(remote),
                        ..
                    }) if receiver >= remote.first => {
                        // A rollout of another host: the TCP chain's receiver, caught up by its syncer.
                        tokio::task::block_in_place(|| workload.host_view())?;
                        let last = version == synced_at;
                        let report = catch_up(
                            &mut remote.syncer,
                            &state,
                            Rejoiner {
                                rank,
                                receiver,
                                first: remote.first,
                            },
                            last,
                        )
                        .await?;
                        ctx.control.report(&report, &[]).await?;
                        continue;
                    }
                    Some(Publisher::Gpu {
                        channel,
                        names,
                        rejoins,
                        ..
                    }) => {
                        let Some(host) = rejoins.as_mut() else {
                            return Err(unexpected(
                                "Rejoin (runner.rollout_restarts=0: no rollout is restarted)",
                            ));
                        };
                        let report = gpu_channel::catch_up(
                            host,
                            channel,
                            gpu_channel::state_bytes(names),
                            &state,
                            rank,
                            receiver,
                        )
                        .await?;
                        ctx.control.report(&report, &[]).await?;
                        continue;
                    }
                    Some(Publisher::Host(syncer)) => syncer,
                };
                let last = version == synced_at;
                // A rejoin reads the state (the bootstrap-only keys, a bucket syncer's last version): rare.
                tokio::task::block_in_place(|| workload.host_view())?;
                let rejoiner = Rejoiner {
                    rank,
                    receiver,
                    first: 0,
                };
                let report = catch_up(syncer, &state, rejoiner, last).await?;
                ctx.control.report(&report, &[]).await?;
            }
            Command::Checkpoint => {
                let dir = tokio::task::block_in_place(|| {
                    workload.host_view()?;
                    workload.save_checkpoint(&state, &ctx.args.run_dir, steps_done, version)
                })?;
                tracing::info!("checkpoint at step {steps_done}: {}", dir.display());
                let report = Report::Checkpointed {
                    step: steps_done,
                    version,
                    dir,
                };
                ctx.control.report(&report, &[]).await?;
            }
            Command::Stop => return Ok(()),
            other @ (Command::Apply | Command::Rollout { .. } | Command::Eval) => {
                return Err(unexpected(&format!("{other:?}")));
            }
        }
    }
}

/// Where the versions go after the init bootstrap.
// One per trainer: boxing the large host variant would buy nothing.
#[allow(clippy::large_enum_variant)]
enum Publisher {
    /// The weight syncer over the host channels (shared memory, TCP).
    Host(SyncSender),
    /// The same-host GPU channel (`weight_syncer.patch.transport_device: cuda`), over the synced tensors as
    /// the rollouts hold them (`names`: their checksum is hashed on the device, the cast copies where the
    /// channel casts).
    Gpu {
        channel: ChannelSender,
        names: gpu_channel::Names,
        /// Restartable rollouts (`runner.rollout_restarts` > 0): the host channel's half of their rejoins
        /// (handshake, frozen keys); the channel gives them the full copy.
        rejoins: Option<HostRejoin>,
        /// Several hosts: the rollouts of the other hosts, over the TCP chain.
        remote: Option<remote::Remote>,
    },
}

/// A new host syncer of `settings` for this run.
fn new_syncer(
    cfg: &RunConfig,
    settings: WeightSyncerConfig,
    threads: usize,
) -> Result<WeightSyncer, WorkerError> {
    let mut syncer = WeightSyncer::from_config(&settings, SyncOptions { threads })?;
    // Restartable rollouts: a bucket syncer keeps the last version sent, so a restarted rollout is caught up to
    // it at once, however far training moved on since (`runner.weight_sync_interval` > 1), instead of waiting
    // for the next sync.
    syncer.keep_last_version(cfg.runner.rollout_restarts > 0);
    // The run's versions only increase: its replay log and rejoins name states by version.
    syncer.require_increasing_versions(true);
    Ok(syncer)
}

/// The init over the GPU channel's host channel: the handshake and bootstrap of this host's rollouts by
/// `syncer` (the end the channel takes over), and on several hosts, at the same time, of the other hosts'
/// rollouts by a second syncer over the TCP chain, which keeps serving them (its patches built from the device
/// against a pinned host snapshot, `RunConfig::chain_syncer`).
async fn init_split(
    ctx: &WorkerContext,
    syncer: WeightSyncer,
    workload: &mut dyn Workload,
    state: &StateDict,
    keys: &[String],
    threads: usize,
) -> Result<(SyncSender, SyncReport, Option<remote::Remote>), WorkerError> {
    let cfg = ctx.config();
    let local = open_local(ctx).await?.ok_or_else(|| {
        WorkerError::Transport(TransportError::Config {
            reason: "the same-host GPU channel, but no rollout on the trainer's host".into(),
        })
    })?;
    let chain = match &ctx.launch.chain_next {
        Some(next) => {
            Some(ChainSender::connect(None, Some(next.as_str()), chain_config(ctx)).await?)
        }
        None => None,
    };
    tokio::task::block_in_place(|| workload.host_view())?;
    let Some(chain) = chain else {
        let (end, report) = syncer.init_sender(state, keys, local).await?;
        return Ok((end, report, None));
    };
    let far = new_syncer(cfg, cfg.chain_syncer(), threads)?;
    let ((end, report), (mut far, far_report)) = tokio::try_join!(
        syncer.init_sender(state, keys, local),
        far.init_sender(state, keys, chain)
    )?;
    if let Some(what) = workload.attach_sender(&mut far, state) {
        tracing::info!(
            "weights synced to the other hosts from the device, over the TCP chain (their snapshot copy in \
             pinned host memory whatever weight_syncer.patch.snapshot_device says: the GPU keeps the channel's): \
             {what}"
        );
    }
    let remote = remote::Remote::new(&end, far, ctx.launch.weight_receivers())?;
    Ok((end, remote::init_report(&report, far_report), Some(remote)))
}

/// After the host handshake and bootstrap by `end`: the same-host GPU channel at `socket` over the
/// workload's device tensors, every rollout given a full copy at the run's start version; and the checksum
/// of what they now hold (0 when `runner.verify_sync` is off).
fn gpu_publisher(
    ctx: &WorkerContext,
    workload: &mut dyn Workload,
    state: &StateDict,
    mut end: SyncSender,
    remote: Option<remote::Remote>,
    socket: &std::path::Path,
) -> Result<(Publisher, u64), WorkerError> {
    let cfg = ctx.config();
    let keys = end.synced_keys().to_vec();
    let dtypes = end.synced_dtypes().to_vec();
    let names = gpu_channel::names(state, &keys, &dtypes)?;
    let receivers = ctx.launch.weight_receivers();
    // Restartable rollouts: a dead one is dropped from the channel, not the sync's failure, and its successor
    // rejoins (the host channel checks it and sends the frozen keys; the channel, a full copy). The bootstrap
    // stops waiting for a rollout the host channel says is gone or replaced by a successor not caught up yet
    // (which connects only once it rejoined), and waits as long as a handshake at most. Otherwise the host
    // syncer, and its snapshot, go.
    let restarts = cfg.runner.rollout_restarts > 0;
    let mut away = || match end.ranks_gone() {
        Ok(ranks) => ranks
            .into_iter()
            .filter_map(|r| u32::try_from(r).ok())
            .collect(),
        Err(e) => {
            tracing::warn!("the host channel: {}", rlsync_core::error_chain(&e));
            Vec::new()
        }
    };
    let spec = gpu_channel::SenderSpec {
        socket,
        receivers,
        timeout: ctx.transport_timeout(),
        elastic: restarts.then(|| gpu_channel::Elastic {
            away: &mut away,
            // Well inside the step deadline, which the rollouts already connected wait under.
            wait: cfg
                .runner
                .step_timeout_s
                .get()
                .map_or(cfg.runner.handshake_timeout_s.get(), |step| {
                    cfg.runner.handshake_timeout_s.get().min(step / 2)
                }),
        }),
    };
    let (mut channel, boot) = tokio::task::block_in_place(|| {
        gpu_channel::open_sender(
            workload,
            state,
            &keys,
            &dtypes,
            spec,
            ctx.launch.start.version,
        )
    })?;
    tracing::info!("{}", gpu_channel::describe(&boot));
    let rejoins = restarts.then(|| end.into_host_rejoin());
    // No-wait installs: the rollouts install between their chunks, so a sync returns once sent and its acks
    // are collected by the next one (one version in flight).
    if cfg.actor.sync_weight_no_wait
        && ctx.launch.loop_kind == crate::protocol::launch::LoopKind::Async
    {
        channel.detach_acks(true);
    }
    let casts = names
        .iter()
        .filter(|(k, d, _)| state.get(k).is_some_and(|t| t.dtype() != *d))
        .count();
    tracing::info!(
        "weights synced from the device from now on: the same-host GPU channel, device to device ({} tensors to {receivers} rollout(s){})",
        keys.len(),
        if casts > 0 {
            format!(", {casts} cast to the rollouts' dtypes on the GPU")
        } else {
            String::new()
        }
    );
    let checksum = if cfg.runner.verify_sync {
        gpu_channel::checksum(&mut channel, &names)?
    } else {
        0
    };
    Ok((
        Publisher::Gpu {
            channel,
            names,
            rejoins,
            remote,
        },
        checksum,
    ))
}

/// A command the trainer cannot take (now).
fn unexpected(command: &str) -> WorkerError {
    WorkerError::UnexpectedCommand {
        role: "trainer",
        command: command.to_owned(),
    }
}

/// The weight sender: shared memory to this node's rollouts and, in a multi-node run, the head of the TCP
/// chain to the other nodes (`chain_next` in the launch file).
async fn open_sender(ctx: &WorkerContext) -> Result<Sender, WorkerError> {
    let shm = open_local(ctx).await?;
    let Some(next) = &ctx.launch.chain_next else {
        return shm.ok_or_else(|| {
            WorkerError::Transport(TransportError::Config {
                reason: "no rollout on this node and no next node of a weight chain".into(),
            })
        });
    };
    Ok(ChainSender::connect(shm, Some(next.as_str()), chain_config(ctx)).await?)
}

/// The shared-memory channel to this host's rollouts (`None`: there is none here).
async fn open_local(ctx: &WorkerContext) -> Result<Option<Sender>, WorkerError> {
    let local = ctx.launch.weight_receivers();
    if local == 0 {
        return Ok(None);
    }
    let shm = ShmSender::bind(ShmConfig {
        socket_path: ctx.launch.weight_socket.clone(),
        segment_prefix: ctx.launch.segment_prefix.clone(),
        receivers: local,
        timeout: ctx.transport_timeout(),
        // Restartable rollouts: a dead one is detached and its successor rejoins.
        elastic: ctx.config().runner.rollout_restarts > 0,
        ..ShmConfig::default()
    })
    .await?;
    Ok(Some(shm))
}

/// The head of the TCP weight chain's settings.
fn chain_config(ctx: &WorkerContext) -> ChainConfig {
    let cfg = ctx.config();
    ChainConfig {
        token: ctx.launch.token.as_bytes().to_vec(),
        name: format!("node 0 ({})", crate::cluster::host_name()),
        part_bytes: usize::try_from(cfg.cluster.network.part_bytes.get()).unwrap_or(usize::MAX),
        timeout: ctx.transport_timeout(),
    }
}

/// A restarted rollout to catch up: its rank, and its receiver in the run's numbering (node by node in chain
/// order), the syncer's receiver `receiver - first` (`first`: the run's receivers the syncer does not serve).
struct Rejoiner {
    rank: u32,
    receiver: u32,
    first: u32,
}

/// Serve the rejoin of a restarted rollout (the reports name it by its rank). The rollout going away
/// meanwhile (gone, or silent past the channel's timeout) is not this worker's failure: the report says so and
/// the orchestrator restarts it again.
async fn catch_up(
    syncer: &mut SyncSender,
    state: &StateDict,
    Rejoiner {
        rank,
        receiver,
        first,
    }: Rejoiner,
    state_is_last: bool,
) -> Result<Report, WorkerError> {
    let started = Instant::now();
    let served = receiver.saturating_sub(first) as usize;
    let outcome = syncer.rejoin_at(state, served, state_is_last).await;
    let seconds = started.elapsed().as_secs_f64();
    match outcome {
        Ok(r) => {
            tracing::info!(
                "caught up rollout-{rank} (weight receiver {receiver}): {} from version {} to {}{}, {} patches, {} bytes in {:.1} ms{}",
                r.kind.name(),
                r.from,
                r.to,
                if r.deferred {
                    " (deferred: the next version is a full transfer)"
                } else {
                    ""
                },
                r.patches,
                r.payload_bytes,
                seconds * 1e3,
                if r.reason.is_empty() {
                    String::new()
                } else {
                    format!("; not a replay: {}", r.reason)
                },
            );
            Ok(Report::CaughtUp {
                rank,
                ok: true,
                kind: r.kind.name().into(),
                from: r.from,
                to: r.to,
                patches: r.patches,
                payload_bytes: r.payload_bytes,
                seconds,
                reason: r.reason,
            })
        }
        Err(e) => match went_away(&e, served) {
            Some(gone) => {
                tracing::warn!("rejoin of rollout-{rank} failed: {gone}");
                Ok(Report::rejoin_failed(rank, seconds, gone.to_string()))
            }
            None => Err(e.into()),
        },
    }
}

/// Whether a rejoin's error is only that its rollout, weight receiver `receiver`, went away meanwhile (gone,
/// or silent past the channel's timeout): not the trainer's failure. The transport's words for it.
pub(crate) fn went_away(e: &SyncError, receiver: usize) -> Option<&TransportError> {
    match e {
        SyncError::Transport(
            t @ (TransportError::PeerGone { peer, .. } | TransportError::Timeout { peer, .. }),
        ) if *peer == Peer::Receiver(receiver) => Some(t),
        _ => None,
    }
}

/// Undefined metrics (NaN, e.g. no sample from the behaviour version) travel as `None`.
fn finite_or_none(metrics: Vec<(String, f64)>) -> Vec<(String, Option<f64>)> {
    metrics
        .into_iter()
        .map(|(key, value)| (key, value.is_finite().then_some(value)))
        .collect()
}

/// The `Synced` report; its checksum is of the weights as every rollout must now hold them.
fn synced_report(
    syncer: &SyncSender,
    workload: &mut dyn Workload,
    state: &StateDict,
    report: &SyncReport,
    started: Instant,
    verify: bool,
) -> Result<Report, WorkerError> {
    let checksum = if verify {
        tokio::task::block_in_place(|| {
            if let Some(keys) = syncer.checksum_as_state(state)
                && let Some(c) = workload.weights_checksum(state, keys)?
            {
                return Ok(c);
            }
            if syncer.checksum_reads_state() {
                workload.host_view()?;
            }
            Ok::<_, WorkerError>(syncer.checksum(state)?)
        })?
    } else {
        0
    };
    Ok(Report::Synced {
        stats: sync_stats(report),
        checksum,
        seconds: started.elapsed().as_secs_f64(),
    })
}

fn sync_stats(report: &SyncReport) -> SyncStats {
    SyncStats {
        version: report.version,
        kind: report.kind.name().into(),
        payload_bytes: report.payload_bytes,
        changed: report.changed,
        state_bytes: report.state_bytes,
        compression_ratio: report.compression_ratio,
        dense_segments: report.dense_segments,
        build_s: report.build.as_secs_f64(),
        encode_s: report.encode.as_secs_f64(),
        seconds: report.transfer.as_secs_f64(),
    }
}
