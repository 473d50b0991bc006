//! The rollout worker: holds a copy of the weights, generates trajectory chunks, installs weight updates
//! only between chunks (blocking `Apply`, or received in the background with `sync_weight_no_wait`).

use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot};

use crate::config::schema::SyncerKind;
use crate::protocol::launch::rollout_copy_file;
use crate::worker::Stage;
use crate::worker::background::Background;
use crate::worker::gpu_channel::{self, ChannelReceiver};
use crate::worker::local_copy::LocalCopy;
use crate::worker::workload::{Workload, WorkloadError};
use crate::worker::{WorkerContext, WorkerError, WorkloadBuilder, install_phases, kernel_threads};
use rlsync_core::gpu::ipc::{Incoming, IpcError};
use rlsync_core::protocol::messages::{Command, Frame, Report};
use rlsync_core::syncer::HoldPoint;
use rlsync_core::syncer::{
    PendingUpdate, SyncError, SyncOptions, SyncReceiver, SyncReport, WeightSyncer,
};
use rlsync_core::tensor::{StateDict, state_checksum};
use rlsync_core::transport::ShmReceiver;

/// An update received in the background, and the signal that lets the receiver fetch the next one.
type Received = (Result<PendingUpdate, SyncError>, oneshot::Sender<()>);

/// A sync the GPU channel received in the background (validated, not yet installed), with the channel's end
/// to install it and wait for the next one.
type GpuArrival = Result<(ChannelReceiver, Incoming), IpcError>;

/// What a rollout waits for: the orchestrator's next command, or a version received in the background.
enum Event {
    Command(Frame<Command>),
    Update(Box<Arrival>),
}

/// A version received in the background, on either path (boxed in [`Event`]; one per version).
#[allow(clippy::large_enum_variant)]
enum Arrival {
    Host(Received),
    Gpu(GpuArrival),
}

/// How updates reach this rollout.
// One per rollout worker: boxing the large blocking variant would buy nothing.
#[allow(clippy::large_enum_variant)]
enum Weights {
    /// Not bootstrapped yet.
    None,
    /// Blocking mode: the syncer is used in place on `Apply`.
    Blocking(SyncReceiver),
    /// Background mode: a task owns the syncer and hands over one validated update at a time.
    Background(Background<Received>),
    /// The same-host GPU channel (`weight_syncer.patch.transport_device: cuda`): installed on `Apply`, into
    /// the workload's device tensors.
    Gpu(ChannelReceiver),
    /// The GPU channel in the background: a thread waits for the next sync and hands it over with the
    /// channel's end; it is installed between chunks (or at once while idle).
    GpuBackground(GpuWaiter),
}

struct Rollout {
    state: StateDict,
    keys: Vec<String>,
    version: u64,
    verify: bool,
    /// Rejoined without a version of the trainer's (bucket syncer): no rollout before the next version.
    deferred: bool,
    workload: Box<dyn Workload>,
    /// The local weights copy a restarted successor rejoins from (`runner.rollout_weights_copy_interval`).
    local: Option<LocalCopy>,
    /// Versions are installed into the workload's device tensors, not into `state` ([`Workload::attach_receiver`]).
    device_install: bool,
    /// Over the GPU channel with restartable rollouts: the host channel's end, idle, kept open so the trainer's
    /// end sees this rollout live until it dies (its bootstrap stops waiting for a rollout gone there).
    host_link: Option<SyncReceiver>,
}

impl Rollout {
    /// The checksum the orchestrator verifies (0 when `runner.verify_sync` is off): of the weights as the
    /// workload holds them (on its device where it can hash them there, else `state` after the host view).
    fn checksum(&mut self) -> Result<u64, WorkerError> {
        if !self.verify {
            return Ok(0);
        }
        tokio::task::block_in_place(|| {
            if let Some(c) = self.workload.weights_checksum(&self.state, &self.keys)? {
                return Ok(c);
            }
            self.workload.host_view()?;
            Ok(state_checksum(&self.state, &self.keys))
        })
    }

    /// The report of an install started at `started`; `host`: the host receiver's report of it and how long
    /// the workload took to load the written weights ([`Rollout::installed`]).
    fn applied(
        &mut self,
        started: Instant,
        host: Option<(&SyncReport, Duration)>,
    ) -> Result<Report, WorkerError> {
        let hashing = Instant::now();
        let checksum = self.checksum()?;
        let checksum_s = hashing.elapsed().as_secs_f64();
        Ok(Report::Applied {
            version: self.version,
            checksum,
            seconds: started.elapsed().as_secs_f64(),
            phases: host.map(|(report, load)| {
                install_phases(report, Some(load), self.verify.then_some(checksum_s))
            }),
        })
    }

    /// After an install: keep the local copy up to date (its own cadence; never weights of no version).
    fn keep_copy(&mut self) -> Result<(), WorkerError> {
        if !self.deferred
            && let Some(local) = &mut self.local
            && local.wants(self.version)
        {
            tokio::task::block_in_place(|| self.workload.host_view())?;
            local.after_install(&self.state, self.version);
        }
        Ok(())
    }

    /// The receiver is set up (init or rejoin): it wrote `state`, which the workload takes (how long that
    /// took); from now on versions may go to the device.
    fn received_on_host(&mut self, syncer: &SyncReceiver) -> Result<Duration, WorkerError> {
        let started = Instant::now();
        tokio::task::block_in_place(|| self.workload.weights_written(false))?;
        let load = started.elapsed();
        self.device_install = match self.workload.attach_receiver(syncer) {
            Some(what) => {
                tracing::info!("weights installed on the device from now on: {what}");
                true
            }
            None => false,
        };
        Ok(load)
    }

    /// Open the same-host GPU channel at `socket` as weight receiver `rank` once the host channel wrote
    /// `state` (pushed to the device first) and install its first copy; the channel's end and that copy's
    /// version. Every version from now on is installed on the device.
    fn open_gpu(
        &mut self,
        socket: &std::path::Path,
        rank: u32,
        timeout: std::time::Duration,
    ) -> Result<(ChannelReceiver, u64), WorkerError> {
        let opened = tokio::task::block_in_place(|| {
            self.workload.weights_written(false)?;
            gpu_channel::open_receiver(
                self.workload.as_mut(),
                &self.state,
                &self.keys,
                socket,
                rank,
                timeout,
            )
        })?;
        self.device_install = true;
        self.installed()?;
        tracing::info!(
            "weights installed on the device from now on: the same-host GPU channel, device to device"
        );
        Ok(opened)
    }

    /// The host channel's end once the GPU channel takes over: kept open (idle) when rollouts restart, so the
    /// trainer sees this one's death there; else closed.
    fn keep_host_link(&mut self, syncer: SyncReceiver, restartable: bool) {
        self.host_link = restartable.then_some(syncer);
    }

    /// After an install of the receiver's (device or host, as attached): the workload takes the weights; how
    /// long that took.
    fn installed(&mut self) -> Result<Duration, WorkerError> {
        let started = Instant::now();
        let on_device = self.device_install;
        tokio::task::block_in_place(|| self.workload.weights_written(on_device))?;
        Ok(started.elapsed())
    }

    /// A restarted worker: load the local copy, if there is a sound one, and return the version it holds
    /// (0: its own initial weights).
    fn load_copy(&mut self) -> u64 {
        let Some(local) = &self.local else {
            return self.version;
        };
        let loaded = tokio::task::block_in_place(|| local.load_into(&mut self.state));
        match loaded {
            Ok(Some(version)) => {
                tracing::info!(
                    "loaded the local weights copy of version {version} ({}): rejoining from it",
                    local.path().display()
                );
                self.version = version;
            }
            Ok(None) => tracing::info!(
                "no local weights copy ({}): rejoining from the initial weights",
                local.path().display()
            ),
            Err(e) => tracing::warn!(
                "{}; rejoining from the initial weights (version {})",
                rlsync_core::error_chain(&e),
                self.version
            ),
        }
        self.version
    }

    /// Install a version received in the background (only ever called between chunks); a GPU channel's end
    /// goes back to waiting in `weights`.
    fn take(
        &mut self,
        arrival: Arrival,
        weights: &mut Weights,
        ctx: &WorkerContext,
    ) -> Result<Report, WorkerError> {
        match arrival {
            Arrival::Host(received) => self.install(received),
            Arrival::Gpu(arrival) => {
                let started = Instant::now();
                let (mut channel, incoming) = arrival?;
                let version = tokio::task::block_in_place(|| channel.install(incoming))?;
                self.installed()?;
                self.version = version;
                self.deferred = false;
                *weights =
                    Weights::GpuBackground(spawn_gpu_waiter(channel, ctx.transport_timeout())?);
                self.applied(started, None)
            }
        }
    }

    /// Install a background update (only ever called between chunks).
    fn install(&mut self, received: Received) -> Result<Report, WorkerError> {
        let started = Instant::now();
        let (update, next) = received;
        let report = update?.install(&mut self.state)?;
        let load = self.installed()?;
        self.version = report.version;
        self.deferred = false;
        // The receiver task may now fetch the following update.
        let _ = next.send(());
        let applied = self.applied(started, Some((&report, load)))?;
        self.keep_copy()?;
        Ok(applied)
    }
}

/// Run the rollout's command loop until `Stop`.
pub async fn run(ctx: &mut WorkerContext, build: WorkloadBuilder) -> Result<(), WorkerError> {
    let cfg = ctx.config().clone();
    let building = Instant::now();
    let mut workload = tokio::task::block_in_place(|| build(ctx))?;
    let state = tokio::task::block_in_place(|| workload.init_state())?;
    if let Some(spec) = ctx.launch.host_shared.clone() {
        // One copy of the weights per host (`weight_syncer.host_shared`): no local copies, no own state.
        crate::worker::report_built(ctx, building).await?;
        return crate::worker::host_shared::run(ctx, workload, state, spec).await;
    }
    // Replaced by the syncer's own list after init (it decides what is synced).
    let keys = state.synced_keys();
    // A copy only helps a restarted worker catch up by replay: restartable runs with the patch syncer's log.
    // (Not over the GPU channel: it rejoins by a full copy from the trainer's device.)
    let restartable = cfg.runner.rollout_restarts > 0;
    let copies = restartable
        && ctx.launch.gpu_socket.is_none()
        && cfg.runner.rollout_weights_copy_interval > 0
        && cfg.weight_syncer.kind == SyncerKind::Patch
        && cfg.weight_syncer.patch.replay_versions > 0;
    let local = copies.then(|| {
        LocalCopy::new(
            rollout_copy_file(&ctx.args.run_dir, ctx.args.rank),
            u64::from(cfg.runner.rollout_weights_copy_interval),
        )
    });
    let mut me = Rollout {
        state,
        keys,
        version: 0,
        verify: cfg.runner.verify_sync,
        deferred: false,
        workload,
        local,
        device_install: false,
        host_link: None,
    };
    let mut weights = Weights::None;
    // `train_async` with no-wait installs: updates are received in the background, also while idle.
    let no_wait = cfg.actor.sync_weight_no_wait
        && ctx.launch.loop_kind == crate::protocol::launch::LoopKind::Async;
    crate::worker::report_built(ctx, building).await?;
    loop {
        let event = match &mut weights {
            Weights::Background(bg) => tokio::select! {
                frame = ctx.control.next() => Event::Command(frame?),
                Some(received) = bg.results.recv() => Event::Update(Box::new(Arrival::Host(received))),
            },
            Weights::GpuBackground(waiter) => tokio::select! {
                frame = ctx.control.next() => Event::Command(frame?),
                Some(arrival) = waiter.recv() => Event::Update(Box::new(Arrival::Gpu(arrival))),
            },
            _ => Event::Command(ctx.control.next().await?),
        };
        let frame = match event {
            Event::Command(frame) => frame,
            Event::Update(arrival) => {
                let report = me.take(*arrival, &mut weights, ctx)?;
                ctx.control.report(&report, &[]).await?;
                continue;
            }
        };
        match frame.header {
            Command::InitWeights => {
                let started = Instant::now();
                let Some(channel_rank) = ctx.launch.weight_rank(ctx.args.rank) else {
                    return Err(WorkerError::Usage {
                        reason: format!(
                            "rollout rank {} is not on this node's weight channel",
                            ctx.args.rank
                        ),
                    });
                };
                let rx = ShmReceiver::connect(
                    &ctx.launch.weight_socket,
                    channel_rank,
                    ctx.transport_timeout(),
                )
                .await?;
                let threads = kernel_threads(ctx.launch.rollouts);
                let mut syncer =
                    WeightSyncer::from_config(&cfg.host_syncer(), SyncOptions { threads })?;
                if let Some(probe) = &ctx.probe {
                    let holds = [
                        (HoldPoint::Bootstrap, Stage::Bootstrap),
                        (HoldPoint::CatchUp, Stage::CatchUp),
                    ];
                    if let Some((point, hold)) = holds
                        .into_iter()
                        .find_map(|(point, stage)| Some((point, probe.at(stage)?)))
                    {
                        syncer.hold_at(point, hold);
                    }
                }
                if rx.joined_late()
                    && let Some(socket) = ctx.launch.gpu_socket.clone()
                {
                    // A restarted worker over the GPU channel: the host channel checks its tensors and sends
                    // the frozen keys it lacks, then the channel gives it a full copy of the current version.
                    ctx.control.report(&Report::Joined, &[]).await?;
                    // Its synced tensors come over the channel: the host rejoin does not hash them.
                    syncer.synced_elsewhere(true);
                    let (syncer, on_host) = syncer.rejoin_receiver(&mut me.state, rx, 0).await?;
                    me.keys = syncer.synced_keys().to_vec();
                    me.keep_host_link(syncer, restartable);
                    let timeout = ctx.transport_timeout();
                    let (channel, version) = me.open_gpu(&socket, channel_rank as u32, timeout)?;
                    me.version = version;
                    me.deferred = false;
                    // No-wait: wait for the next version in the background at once, as after a host rejoin.
                    weights = if no_wait {
                        Weights::GpuBackground(spawn_gpu_waiter(channel, timeout)?)
                    } else {
                        Weights::Gpu(channel)
                    };
                    tracing::info!(
                        "rejoined: the handshake{} on the host ({} bytes), then a full copy of version {version} over the same-host GPU channel, in {:.1} ms",
                        if on_host.boot_bytes > 0 {
                            " and frozen keys"
                        } else {
                            ""
                        },
                        on_host.payload_bytes,
                        started.elapsed().as_secs_f64() * 1e3
                    );
                    let rejoined = Report::Rejoined {
                        version,
                        checksum: me.checksum()?,
                        deferred: false,
                        seconds: started.elapsed().as_secs_f64(),
                    };
                    ctx.control.report(&rejoined, &[]).await?;
                    continue;
                }
                if rx.joined_late() {
                    // A restarted worker: the trainer catches it up once the orchestrator asks it to.
                    ctx.control.report(&Report::Joined, &[]).await?;
                    let held = me.load_copy();
                    let (syncer, caught) = syncer.rejoin_receiver(&mut me.state, rx, held).await?;
                    me.received_on_host(&syncer)?;
                    me.version = caught.to;
                    me.keys = syncer.synced_keys().to_vec();
                    me.deferred = caught.deferred;
                    // No-wait: receive in the background at once (the trainer publishes while this worker waits
                    // for work); a deferred one first takes its next version with a blocking `apply`.
                    weights = if no_wait && !me.deferred {
                        Weights::Background(spawn_receiver(syncer))
                    } else {
                        Weights::Blocking(syncer)
                    };
                    tracing::info!(
                        "rejoined the weight channel: {} from version {} to {}{}, {} bytes in {:.1} ms",
                        caught.kind.name(),
                        caught.from,
                        caught.to,
                        if caught.deferred {
                            " (deferred: the next version is a full transfer)"
                        } else {
                            ""
                        },
                        caught.payload_bytes,
                        caught.elapsed.as_secs_f64() * 1e3
                    );
                    let rejoined = Report::Rejoined {
                        version: me.version,
                        checksum: me.checksum()?,
                        deferred: caught.deferred,
                        seconds: started.elapsed().as_secs_f64(),
                    };
                    ctx.control.report(&rejoined, &[]).await?;
                    me.keep_copy()?;
                    continue;
                }
                if let Some(hold) = ctx.probe.as_ref().and_then(|p| p.at(Stage::Handshake)) {
                    hold.await;
                }
                let (syncer, boot) = syncer.init_receiver(&mut me.state, rx).await?;
                // The bootstrap holds the weights of the run's start version (the checkpoint's on a resume).
                me.version = ctx.launch.start.version;
                me.keys = syncer.synced_keys().to_vec();
                // The bootstrap's phases, when the host receiver installed it whole.
                let mut host = None;
                weights = match &ctx.launch.gpu_socket {
                    None => {
                        host = Some(me.received_on_host(&syncer)?);
                        Weights::Blocking(syncer)
                    }
                    Some(socket) => {
                        // Checked and bootstrapped on the host; every version from now on arrives device to
                        // device, starting with a full copy of the trainer's (the host syncer goes).
                        me.keep_host_link(syncer, restartable);
                        let (channel, version) =
                            me.open_gpu(socket, channel_rank as u32, ctx.transport_timeout())?;
                        if version != me.version {
                            return Err(WorkerError::Workload(WorkloadError::GpuChannel {
                                reason: format!(
                                    "the trainer's first copy over the channel is version {version}, the run starts at {}",
                                    me.version
                                ),
                            }));
                        }
                        Weights::Gpu(channel)
                    }
                };
                tracing::info!(
                    "weights received: version {}, {} tensors ({} synced), {} envs",
                    me.version,
                    me.state.iter().count(),
                    me.keys.len(),
                    ctx.launch.envs_per_rollout
                );
                let applied = me.applied(started, host.map(|load| (&boot, load)))?;
                ctx.control.report(&applied, &[]).await?;
                me.keep_copy()?;
            }
            Command::Apply => {
                if let Weights::Gpu(channel) = &mut weights {
                    let started = Instant::now();
                    let timeout = ctx.transport_timeout();
                    let version = tokio::task::block_in_place(|| channel.apply(timeout))?;
                    me.installed()?;
                    me.version = version;
                    let applied = me.applied(started, None)?;
                    ctx.control.report(&applied, &[]).await?;
                    if no_wait
                        && let Weights::Gpu(channel) =
                            std::mem::replace(&mut weights, Weights::None)
                    {
                        weights = Weights::GpuBackground(spawn_gpu_waiter(channel, timeout)?);
                    }
                    continue;
                }
                let Weights::Blocking(syncer) = &mut weights else {
                    return Err(WorkerError::UnexpectedCommand {
                        role: "rollout",
                        command: "Apply (not in blocking mode)".into(),
                    });
                };
                let started = Instant::now();
                let report = syncer.apply(&mut me.state).await?;
                let load = me.installed()?;
                me.version = report.version;
                me.deferred = false;
                let applied = me.applied(started, Some((&report, load)))?;
                ctx.control.report(&applied, &[]).await?;
                me.keep_copy()?;
                if no_wait
                    && let Weights::Blocking(syncer) =
                        std::mem::replace(&mut weights, Weights::None)
                {
                    weights = Weights::Background(spawn_receiver(syncer));
                }
            }
            Command::Rollout {
                first_chunk,
                chunks,
                steps,
                background,
            } => {
                if me.deferred {
                    // Its weights are its own, not a version of the trainer's: never generate from them.
                    return Err(WorkerError::UnexpectedCommand {
                        role: "rollout",
                        command: "Rollout (before the first version after a rejoin)".into(),
                    });
                }
                if background
                    && matches!(weights, Weights::Gpu(_))
                    && let Weights::Gpu(channel) = std::mem::replace(&mut weights, Weights::None)
                {
                    weights =
                        Weights::GpuBackground(spawn_gpu_waiter(channel, ctx.transport_timeout())?);
                }
                if background
                    && matches!(weights, Weights::Blocking(_))
                    && let Weights::Blocking(syncer) =
                        std::mem::replace(&mut weights, Weights::None)
                {
                    weights = Weights::Background(spawn_receiver(syncer));
                }
                for chunk in first_chunk..first_chunk + u64::from(chunks) {
                    // Between chunks: install whatever arrived, never in the middle of one.
                    loop {
                        let arrival = match &mut weights {
                            Weights::Background(bg) => {
                                bg.results.try_recv().ok().map(Arrival::Host)
                            }
                            Weights::GpuBackground(waiter) => waiter.try_recv().map(Arrival::Gpu),
                            _ => None,
                        };
                        let Some(arrival) = arrival else {
                            break;
                        };
                        let report = me.take(arrival, &mut weights, ctx)?;
                        ctx.control.report(&report, &[]).await?;
                    }
                    let (report, data) =
                        generate(me.workload.as_mut(), &me.state, me.version, chunk, steps)?;
                    ctx.control.report(&report, &data).await?;
                }
            }
            Command::Eval => {
                let report = evaluate(me.workload.as_mut(), &me.state, me.version)?;
                ctx.control.report(&report, &[]).await?;
            }
            Command::Stop => {
                match &mut weights {
                    Weights::Background(bg) => bg.stop().await,
                    Weights::GpuBackground(waiter) => tokio::task::block_in_place(|| waiter.stop()),
                    _ => {}
                }
                if let Some(local) = &mut me.local {
                    tokio::task::block_in_place(|| local.finish());
                }
                return Ok(());
            }
            other @ (Command::Sync { .. }
            | Command::Train { .. }
            | Command::Rejoin { .. }
            | Command::Checkpoint) => {
                return Err(WorkerError::UnexpectedCommand {
                    role: "rollout",
                    command: format!("{other:?}"),
                });
            }
        }
    }
}

/// One chunk of `steps` env steps from `state` (weights of `version`): its report and its trajectory data.
pub(crate) fn generate(
    workload: &mut dyn Workload,
    state: &StateDict,
    version: u64,
    chunk: u64,
    steps: u32,
) -> Result<(Report, Vec<u8>), WorkerError> {
    let started = Instant::now();
    let out = tokio::task::block_in_place(|| workload.rollout(state, version, steps))?;
    let report = Report::Chunk {
        chunk,
        version,
        env_steps: out.env_steps,
        mean_return: out.mean_return,
        busy_s: started.elapsed().as_secs_f64(),
    };
    Ok((report, out.data))
}

/// An evaluation of `state` (weights of `version`) and its report.
pub(crate) fn evaluate(
    workload: &mut dyn Workload,
    state: &StateDict,
    version: u64,
) -> Result<Report, WorkerError> {
    let eval =
        tokio::task::block_in_place(|| workload.evaluate(state, version))?.unwrap_or_default();
    Ok(Report::Evaluated {
        version,
        episodes: eval.episodes,
        mean_return: eval.ret,
        success_rate: eval.success_rate,
        episode_len: eval.episode_len,
    })
}

/// Receive updates in the background: one at a time, the next only after the previous one is installed.
fn spawn_receiver(mut syncer: SyncReceiver) -> Background<Received> {
    Background::spawn(1, |tx| async move {
        loop {
            let update = syncer.receive().await;
            let failed = update.is_err();
            let (next_tx, next_rx) = oneshot::channel();
            if tx.send((update, next_tx)).await.is_err() || failed || next_rx.await.is_err() {
                break;
            }
        }
    })
}

/// Wait for the GPU channel's next sync on a thread of its own (the wait blocks until the trainer sends,
/// however long that takes) and hand it over, validated, with the channel's end.
fn spawn_gpu_waiter(
    mut channel: ChannelReceiver,
    timeout: std::time::Duration,
) -> Result<GpuWaiter, WorkerError> {
    let socket = channel.shutdown_handle().map_err(WorkerError::Runtime)?;
    let (tx, rx) = mpsc::channel(1);
    let thread = std::thread::Builder::new()
        .name("rlsync-gpu-channel".into())
        .spawn(move || {
            let arrival = channel
                .wait()
                .and_then(|()| channel.receive(timeout))
                .map(|incoming| (channel, incoming));
            let _ = tx.blocking_send(arrival);
        })
        .map_err(WorkerError::Runtime)?;
    Ok(GpuWaiter {
        arrivals: rx,
        socket: Some(socket),
        thread: Some(thread),
    })
}

/// The GPU channel's waiter thread ([`spawn_gpu_waiter`]) and what it hands over. Stopped (at `Stop`, or
/// dropped before it handed the channel over), it shuts the channel's socket down, which ends the thread's
/// wait as the trainer's end would (the channel closes the trainer's buffers), and joins the thread.
struct GpuWaiter {
    arrivals: mpsc::Receiver<GpuArrival>,
    /// A second handle on the channel's socket while the thread holds the channel (`None` once handed over:
    /// the channel is the rollout's again and must not be shut down).
    socket: Option<std::os::unix::net::UnixStream>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl GpuWaiter {
    async fn recv(&mut self) -> Option<GpuArrival> {
        let arrival = self.arrivals.recv().await;
        self.handed(arrival)
    }

    fn try_recv(&mut self) -> Option<GpuArrival> {
        let arrival = self.arrivals.try_recv().ok();
        self.handed(arrival)
    }

    fn handed(&mut self, arrival: Option<GpuArrival>) -> Option<GpuArrival> {
        if arrival.is_some() {
            self.socket = None;
        }
        arrival
    }

    /// End the thread's wait (if it still holds the channel) and join it.
    fn stop(&mut self) {
        if let Some(socket) = self.socket.take() {
            let _ = socket.shutdown(std::net::Shutdown::Both);
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for GpuWaiter {
    fn drop(&mut self) {
        self.stop();
    }
}
