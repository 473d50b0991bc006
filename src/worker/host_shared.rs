//! A rollout's end of the host-shared mode (`weight_syncer.host_shared`): the host's applier receives into the
//! arena, every local rollout acts on the arena's held buffer and flips only between chunks.
//!
//! The host's lowest rollout rank is the applier (`LaunchSpec::host_shared`): it creates the arena from its
//! workload's initial state (or, restarted, reopens it and rejoins the weight channel) and is the host's only
//! receiver. The others are readers: they attach to the arena, never touch the weight channel, and a restarted
//! one just attaches again. Every rollout, the applier included, holds one buffer through its own reader slot;
//! `Applied { version, checksum }` carries the checksum the applier published for that buffer.
//!
//! The workload is handed the held buffer's state for each chunk or evaluation, and told once, after the
//! first hold, that it acts on shared memory (`Workload::act_on_shared`): a libtorch policy then points its
//! weights at the handed buffer for the length of each call instead of importing each version. The buffer is
//! flipped (`refresh`) only between those calls, while nothing of the workload reads it.

use std::path::Path;
use std::time::{Duration, Instant};

use crate::protocol::launch::{HostShared, LoopKind};
use crate::worker::background::Background;
use crate::worker::rollout::{evaluate, generate};
use crate::worker::workload::{SharedWeights, Workload};
use crate::worker::{WorkerContext, WorkerError, install_phases, kernel_threads};
use rlsync_core::host_shared::{Applier, Held, HostSharedError, Published, Reader};
use rlsync_core::protocol::messages::{Command, InstallPhases, Report};
use rlsync_core::syncer::{SyncOptions, SyncReport, WeightSyncer};
use rlsync_core::tensor::StateDict;
use rlsync_core::transport::ShmReceiver;

/// How often an idle rollout of the no-wait mode looks for a newer published version (the applier may not
/// write a buffer a reader still holds, so readers must not hold an old one for long).
const IDLE_REFRESH: Duration = Duration::from_millis(5);

/// Reader slots of an arena beyond the host's rollouts: successors of killed ones, whose dead slots are cleared
/// when the applier next looks.
const SPARE_SLOTS: usize = 4;

/// The applier's half: blocking (`Apply` installs) or background (a task receives and installs).
// One per rollout worker: boxing the applier would buy nothing.
#[allow(clippy::large_enum_variant)]
enum Installer {
    /// Not the applier, or not bootstrapped yet.
    None,
    Blocking(Applier),
    /// The task, and its outcomes: each installed version, or the failure that ended it.
    Background(Background<Result<Published, HostSharedError>>),
}

struct Shared {
    spec: HostShared,
    reader: Option<Reader>,
    installer: Installer,
    /// Rejoined without a version of the trainer's (bucket syncer): no rollout before the next version.
    deferred: bool,
    verify: bool,
    /// Bound of every wait on the arena (the applier's for readers, a reader's for a version).
    wait: Duration,
}

impl Shared {
    fn reader(&self) -> Result<&Reader, WorkerError> {
        self.reader.as_ref().ok_or(WorkerError::UnexpectedCommand {
            role: "rollout",
            command: "a rollout or evaluation before InitWeights".into(),
        })
    }

    fn held(&self) -> Option<Held> {
        self.reader.as_ref().map(Reader::held)
    }

    /// The held version (0 before `InitWeights`).
    fn version(&self) -> u64 {
        self.held().map_or(0, |h| h.version)
    }

    /// The checksum the orchestrator verifies: the one the applier published for the held buffer (0 when
    /// `runner.verify_sync` is off).
    fn checksum(&self) -> u64 {
        match self.held() {
            Some(held) if self.verify => held.checksum.unwrap_or(0),
            _ => 0,
        }
    }

    /// The report of an install started at `started`, with where its time went (a flip between chunks has
    /// no phases).
    fn applied(&self, started: Instant, phases: Option<InstallPhases>) -> Report {
        Report::Applied {
            version: self.version(),
            checksum: self.checksum(),
            seconds: started.elapsed().as_secs_f64(),
            phases,
        }
    }

    /// Between chunks: flip to the newest published version; the report to send when it did.
    fn refresh(&mut self) -> Option<Report> {
        let started = Instant::now();
        let flipped = self.reader.as_mut()?.refresh()?;
        self.deferred = false;
        tracing::debug!(
            "holding version {} (buffer {})",
            flipped.version,
            flipped.buffer
        );
        Some(self.applied(started, None))
    }
}

/// The phases of the applier's install (`report`, its receiver's): the workload reads the arena in place (no
/// load), and the checksum is part of the decode.
fn applier_phases(report: &SyncReport) -> InstallPhases {
    install_phases(report, None, None)
}

/// The phases of a reader's install: its wait for the applier to publish the version (the first: to create
/// the arena too); it then only flips to the published buffer (nothing decoded or written, no load, the
/// applier's checksum).
fn reader_phases(waited: Duration) -> InstallPhases {
    InstallPhases {
        wait_s: waited.as_secs_f64(),
        decode_s: 0.0,
        write_s: 0.0,
        load_s: None,
        checksum_s: None,
    }
}

/// Run a host-shared rollout's command loop until `Stop` (`workload` built, `template` its initial state).
pub(crate) async fn run(
    ctx: &mut WorkerContext,
    mut workload: Box<dyn Workload>,
    template: StateDict,
    spec: HostShared,
) -> Result<(), WorkerError> {
    let cfg = ctx.config().clone();
    let no_wait = cfg.actor.sync_weight_no_wait && ctx.launch.loop_kind == LoopKind::Async;
    let mut me = Shared {
        spec,
        reader: None,
        installer: Installer::None,
        deferred: false,
        verify: cfg.runner.verify_sync,
        wait: ctx.transport_timeout(),
    };
    let is_applier = me.spec.applier == ctx.args.rank;
    // The applier's arena layout, dropped once the arena exists; a reader never holds weights of its own.
    let mut template = is_applier.then_some(template);
    let mut background = false;
    loop {
        let frame = if background {
            tokio::select! {
                frame = ctx.control.next() => frame?,
                installed = next_installed(&mut me.installer) => {
                    installed?;
                    if let Some(report) = me.refresh() {
                        ctx.control.report(&report, &[]).await?;
                    }
                    continue;
                }
                () = tokio::time::sleep(IDLE_REFRESH) => {
                    if let Some(report) = me.refresh() {
                        ctx.control.report(&report, &[]).await?;
                    }
                    continue;
                }
            }
        } else {
            ctx.control.next().await?
        };
        match frame.header {
            Command::InitWeights => {
                let started = Instant::now();
                if is_applier {
                    let template = template.take().ok_or(WorkerError::UnexpectedCommand {
                        role: "rollout",
                        command: "InitWeights (the arena exists already)".into(),
                    })?;
                    init_applier(ctx, &mut me, &template, started).await?;
                } else {
                    // A reader (first or restarted): attach and hold the newest published version.
                    let reader = Reader::attach(&me.spec.arena, me.wait).await?;
                    me.reader = Some(reader);
                    tracing::info!(
                        "attached to the host's weights {}: version {} (rollout-{} applies)",
                        me.spec.arena,
                        me.version(),
                        me.spec.applier
                    );
                    // Its install is the wait for the applier's arena and first publish.
                    let phases = reader_phases(started.elapsed());
                    ctx.control
                        .report(&me.applied(started, Some(phases)), &[])
                        .await?;
                }
                let shared = workload.act_on_shared(me.reader()?.state())?;
                log_shared(&shared, &me.spec.arena);
            }
            Command::Apply => {
                let started = Instant::now();
                let phases;
                match std::mem::replace(&mut me.installer, Installer::None) {
                    Installer::Blocking(mut applier) => {
                        let published = applier.apply(me.wait).await;
                        me.installer = Installer::Blocking(applier);
                        phases = applier_phases(&published?.report);
                        me.refresh();
                    }
                    Installer::None if !is_applier => {
                        let than = me.version();
                        let wait = me.wait;
                        let reader = me.reader.as_mut().ok_or(WorkerError::UnexpectedCommand {
                            role: "rollout",
                            command: "Apply (before InitWeights)".into(),
                        })?;
                        reader.wait_newer(than, wait).await?;
                        phases = reader_phases(started.elapsed());
                    }
                    other => {
                        me.installer = other;
                        return Err(WorkerError::UnexpectedCommand {
                            role: "rollout",
                            command: "Apply (not in blocking mode)".into(),
                        });
                    }
                }
                me.deferred = false;
                ctx.control
                    .report(&me.applied(started, Some(phases)), &[])
                    .await?;
                if no_wait {
                    background = true;
                    start_background(&mut me);
                }
            }
            Command::Rollout {
                first_chunk,
                chunks,
                steps,
                background: in_background,
            } => {
                if me.deferred {
                    return Err(WorkerError::UnexpectedCommand {
                        role: "rollout",
                        command: "Rollout (before the first version after a rejoin)".into(),
                    });
                }
                if in_background && !background {
                    background = true;
                    start_background(&mut me);
                }
                for chunk in first_chunk..first_chunk + u64::from(chunks) {
                    // Between chunks: hold the newest published version, never flip in the middle of one.
                    if background {
                        if let Installer::Background(task) = &mut me.installer {
                            while let Ok(installed) = task.results.try_recv() {
                                installed?;
                            }
                        }
                        if let Some(report) = me.refresh() {
                            ctx.control.report(&report, &[]).await?;
                        }
                    }
                    let reader = me.reader()?;
                    let version = reader.held().version;
                    let (report, data) =
                        generate(workload.as_mut(), reader.state(), version, chunk, steps)?;
                    ctx.control.report(&report, &data).await?;
                }
            }
            Command::Eval => {
                let reader = me.reader()?;
                let report = evaluate(workload.as_mut(), reader.state(), reader.held().version)?;
                ctx.control.report(&report, &[]).await?;
            }
            Command::Stop => {
                if let Installer::Background(task) = &mut me.installer {
                    // The task may be waiting for the back buffer this process's own reader holds (it leaves
                    // it only at a chunk boundary, and none comes now): that wait yields to tokio's timer, so
                    // the abort ends it.
                    task.stop().await;
                }
                if let Some(bytes) = workload.imported_weight_bytes() {
                    tracing::info!(
                        "copied {bytes} bytes of weights out of the host's shared buffers in this run"
                    );
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

/// Says once how this rollout acts on the host's weights.
fn log_shared(shared: &SharedWeights, arena: &str) {
    match shared {
        SharedWeights::InPlace => {
            tracing::info!("acts on the host's shared weights {arena} in place (no copy)");
        }
        SharedWeights::Views => tracing::info!(
            "acts on the host's shared weights {arena} in place: the policy's weights are views of the held \
             buffer, re-pointed for every chunk and evaluation (no copy per version)"
        ),
        SharedWeights::Imports { why } => tracing::warn!(
            "copies each version of the host's shared weights {arena} into its own: {}",
            rlsync_core::error_chain(why.as_ref())
        ),
    }
}

/// The applier's `InitWeights`: create the arena and take the init bootstrap into it, or (restarted: the
/// arena exists, the channel says it joined late) reopen it and rejoin; then hold a buffer like every reader.
async fn init_applier(
    ctx: &mut WorkerContext,
    me: &mut Shared,
    template: &StateDict,
    started: Instant,
) -> Result<(), WorkerError> {
    let cfg = ctx.config().clone();
    let rx = ShmReceiver::connect(&ctx.launch.weight_socket, 0, ctx.transport_timeout()).await?;
    let threads = kernel_threads(1);
    let syncer = WeightSyncer::from_config(&cfg.weight_syncer, SyncOptions { threads })?;
    let name = me.spec.arena.clone();
    // The arena outlives its applier: a successor reopens it (the readers keep the active version meanwhile).
    let mut applier = if Path::new("/dev/shm").join(&name).exists() {
        Applier::reopen(&name, template)?
    } else {
        Applier::create(&name, template, ctx.launch.local_rollouts() + SPARE_SLOTS)?
    };
    // The supervisor owns the name (it unlinks it however the run ends); a successor of this applier reopens it.
    applier.set_unlink_on_drop(false);
    if rx.joined_late() {
        // Restarted after the bootstrap: the trainer catches this one up once the orchestrator asks it to.
        ctx.control.report(&Report::Joined, &[]).await?;
        let (published, caught) = applier.rejoin(syncer, rx, me.verify, me.wait).await?;
        me.reader = Some(Reader::attach(&name, me.wait).await?);
        me.installer = Installer::Blocking(applier);
        me.deferred = caught.deferred;
        tracing::info!(
            "rejoined the weight channel into the host's weights {name}: {} from version {} to {}, {} bytes in {:.1} ms",
            caught.kind.name(),
            caught.from,
            caught.to,
            caught.payload_bytes,
            caught.elapsed.as_secs_f64() * 1e3
        );
        let rejoined = Report::Rejoined {
            version: published.version.max(me.version()),
            checksum: me.checksum(),
            deferred: caught.deferred,
            seconds: started.elapsed().as_secs_f64(),
        };
        return ctx.control.report(&rejoined, &[]).await;
    }
    let published = applier
        .init(syncer, rx, ctx.launch.start.version, me.verify)
        .await?;
    tracing::info!(
        "weights received into the host's arena {name}: version {}, {} tensors ({} synced), shared by {} rollouts",
        published.version,
        template.iter().count(),
        applier.synced_keys().len(),
        ctx.launch.local_rollouts()
    );
    me.reader = Some(Reader::attach(&name, me.wait).await?);
    me.installer = Installer::Blocking(applier);
    ctx.control
        .report(
            &me.applied(started, Some(applier_phases(&published.report))),
            &[],
        )
        .await
}

/// No-wait installs: the applier's task streams every update into the back buffer (it is nobody's), one at a
/// time, as its parts arrive; readers only flip. Before each it waits for the back buffer (see
/// [`back_buffer_free`]). A reader has nothing to start.
fn start_background(me: &mut Shared) {
    let Installer::Blocking(applier) = std::mem::replace(&mut me.installer, Installer::None) else {
        return;
    };
    let wait = me.wait;
    me.installer = Installer::Background(Background::spawn(4, move |tx| async move {
        let mut applier = applier;
        loop {
            let installed = match back_buffer_free(&applier, wait).await {
                Ok(()) => applier.apply(wait).await,
                Err(e) => Err(e),
            };
            let failed = installed.is_err();
            if tx.send(installed).await.is_err() || failed {
                break;
            }
        }
    }));
}

/// Wait until no reader holds the back buffer. Readers leave it at their next chunk boundary, which may take
/// longer than one `wait`: the wait starts again while they do (fewer hold it after each), and fails
/// ([`HostSharedError::BackBufferHeld`]) once the same readers held it for a whole `wait`, so at most one
/// `wait` per holder and one more. The waits yield (an abort of the task ends them).
async fn back_buffer_free(applier: &Applier, wait: Duration) -> Result<(), HostSharedError> {
    let mut holders = applier.back_buffer_holders().len();
    loop {
        match applier.back_buffer_released(wait).await {
            Err(HostSharedError::BackBufferHeld { pids, .. }) if pids.len() < holders => {
                tracing::debug!(
                    "the host's weights: {} reader(s) still hold the back buffer, waiting on",
                    pids.len()
                );
                holders = pids.len();
            }
            done => return done,
        }
    }
}

/// The next outcome of the background installer; never ready for a rollout without one.
async fn next_installed(installer: &mut Installer) -> Result<(), WorkerError> {
    match installer {
        Installer::Background(task) => match task.results.recv().await {
            Some(installed) => installed.map(|_| ()).map_err(WorkerError::from),
            None => std::future::pending().await,
        },
        _ => std::future::pending().await,
    }
}
