//! The overlapped `train_async` loop: rollouts generate chunks continuously into a bounded buffer while the
//! trainer trains; stale data is dropped; rollouts are held back when they are too far ahead.
//!
//! Staleness: a chunk produced by weights `v` and trained at trainer version `T` has lag `T - v`; chunks with
//! lag above `algorithm.staleness_threshold` are discarded (counted). Back-pressure makes that rare: a rollout
//! only gets the next chunk when, consumed in FIFO order, it would be trained at a version within the
//! threshold of the rollout's weights; otherwise it idles until newer weights arrive.

use std::collections::VecDeque;
use std::time::Instant;

use crate::orchestrator::checkpoint::Checkpoints;
use crate::orchestrator::eval::{self, EvalTally};
use crate::orchestrator::metrics::{MetricsSink, Staleness, StepRecord, staleness};
use crate::orchestrator::plan::RunPlan;
use crate::orchestrator::supervisor::{Supervisor, WorkerId};
use crate::orchestrator::weights::{self, Fleet, Handled, Install, SyncOutcome, Verifier, slowest};
use crate::orchestrator::{LoopTotals, OrchestratorError};
use rlsync_core::protocol::messages::{Command, Report, SyncStats};

/// Settings of the loop taken from the config.
#[derive(Debug, Clone, Copy)]
pub struct AsyncSettings {
    pub staleness_threshold: u64,
    pub sync_interval: u64,
    /// `actor.sync_weight_no_wait`: rollouts install in the background; the trainer never waits for them.
    pub no_wait: bool,
    pub verify: bool,
    /// `rollout.buffer_chunks` (raised to one batch if smaller).
    pub buffer_chunks: usize,
    /// `runner.val_check_interval`: after this many steps the rollouts evaluate the weights they hold.
    pub val_check_interval: i64,
}

struct Buffered {
    version: u64,
    env_steps: u64,
    mean_return: f64,
    data: Vec<u8>,
}

#[derive(Clone, Copy, Default)]
struct Slot {
    version: u64,
    in_flight: bool,
}

/// What the record of the step in progress needs once its sync is done.
struct StepInfo {
    step: u64,
    wait_s: f64,
    train_s: f64,
    loss: f64,
    stale: Staleness,
    env_steps: u64,
    mean_return: f64,
    discarded: u64,
    /// The workload's own metrics from the trainer's report.
    metrics: Vec<(String, Option<f64>)>,
}

enum Trainer {
    Idle {
        since: Instant,
    },
    Training {
        started: Instant,
        info: StepInfo,
    },
    Syncing {
        started: Instant,
        info: StepInfo,
        /// The trainer's report of it, and its seconds.
        stats: Option<(SyncStats, f64)>,
        /// Rollouts whose apply the sync waits for (blocking mode; a lost one is no longer waited for).
        waiting: Vec<bool>,
        /// The slowest of those applies so far.
        apply_max: Option<Install>,
    },
}

struct Loop<'a> {
    sup: &'a mut Supervisor,
    checkpoints: &'a mut Checkpoints,
    /// An evaluation the rollouts are running (reports so far), and a finished one not yet in a row.
    eval_running: Option<EvalTally>,
    eval_done: Option<EvalTally>,
    /// The rollouts the running evaluation still waits for (those ready when it started, until they report
    /// or are lost).
    eval_pending: Vec<bool>,
    plan: &'a RunPlan,
    set: AsyncSettings,
    verifier: Verifier,
    fleet: Fleet,
    trainer: Trainer,
    trainer_version: u64,
    steps_started: u64,
    buffer: VecDeque<Buffered>,
    slots: Vec<Slot>,
    next_chunk: u64,
    discarded: u64,
    rollout_busy_s: f64,
    last_row: Instant,
    totals: LoopTotals,
}

impl Loop<'_> {
    fn batch(&self) -> usize {
        (self.plan.rollouts * self.plan.chunks_per_rollout) as usize
    }

    fn in_flight(&self) -> usize {
        self.slots.iter().filter(|s| s.in_flight).count()
    }

    /// Whether rollout `rank` may start one more chunk now.
    fn may_grant(&self, rank: usize) -> bool {
        let Some(slot) = self.slots.get(rank) else {
            return false;
        };
        // Lost, rejoining, or holding no version of the trainer's yet.
        if !self.sup.lifecycle().is_ready(rank as u32) {
            return false;
        }
        let queued = self.buffer.len() + self.in_flight();
        // Discarded chunks do not count: only what steps still to start will train on.
        let needed =
            self.batch() as u64 * (self.plan.steps - self.steps_started.min(self.plan.steps));
        if slot.in_flight
            || queued as u64 >= needed
            || queued >= self.set.buffer_chunks.max(self.batch())
        {
            return false;
        }
        let training = u64::from(matches!(self.trainer, Trainer::Training { .. }));
        let consumed_at = self.trainer_version + training + (queued / self.batch().max(1)) as u64;
        consumed_at <= slot.version + self.set.staleness_threshold
    }

    async fn grant(&mut self) -> Result<(), OrchestratorError> {
        for rank in 0..self.slots.len() {
            if self.may_grant(rank) {
                let cmd = Command::Rollout {
                    first_chunk: self.next_chunk,
                    chunks: 1,
                    steps: self.plan.chunk_steps,
                    background: self.set.no_wait,
                };
                self.sup
                    .send(WorkerId::rollout(rank as u32), &cmd, &[])
                    .await?;
                self.next_chunk += 1;
                if let Some(slot) = self.slots.get_mut(rank) {
                    slot.in_flight = true;
                }
            }
        }
        Ok(())
    }

    /// Start a train step when the trainer is idle and a batch of fresh data is buffered.
    async fn try_train(&mut self) -> Result<(), OrchestratorError> {
        let Trainer::Idle { since } = self.trainer else {
            return Ok(());
        };
        if self.steps_started >= self.plan.steps {
            return Ok(());
        }
        let oldest = self
            .trainer_version
            .saturating_sub(self.set.staleness_threshold);
        let before = self.buffer.len();
        self.buffer.retain(|c| c.version >= oldest);
        self.discarded += (before - self.buffer.len()) as u64;
        if self.buffer.len() < self.batch() {
            return Ok(());
        }
        let chunks: Vec<Buffered> = self.buffer.drain(..self.batch()).collect();
        let samples: Vec<(u64, u64)> = chunks.iter().map(|c| (c.version, c.env_steps)).collect();
        let env_steps: u64 = chunks.iter().map(|c| c.env_steps).sum();
        let mean_return =
            chunks.iter().map(|c| c.mean_return).sum::<f64>() / chunks.len().max(1) as f64;
        let data: Vec<u8> = chunks.iter().flat_map(|c| c.data.iter().copied()).collect();
        let step = self.steps_started;
        self.sup.begin_step();
        let cmd = Command::Train {
            step,
            chunks: chunks.len() as u32,
            env_steps,
        };
        self.sup.send(WorkerId::TRAINER, &cmd, &data).await?;
        let info = StepInfo {
            step,
            wait_s: since.elapsed().as_secs_f64(),
            train_s: 0.0,
            loss: 0.0,
            stale: staleness(self.trainer_version, &samples),
            env_steps,
            mean_return,
            discarded: std::mem::take(&mut self.discarded),
            metrics: Vec::new(),
        };
        self.steps_started += 1;
        self.trainer = Trainer::Training {
            started: Instant::now(),
            info,
        };
        Ok(())
    }

    fn emit(
        &mut self,
        info: StepInfo,
        sync: Option<SyncOutcome>,
        sink: &mut MetricsSink,
    ) -> Result<(), OrchestratorError> {
        let step_s = self.last_row.elapsed().as_secs_f64().max(1e-12);
        self.last_row = Instant::now();
        let sync_s = sync.as_ref().map(|s| s.seconds).unwrap_or(0.0);
        let mut rec = StepRecord::new(info.step);
        rec.float("time/step", step_s);
        rec.float("time/sync_weights", sync_s);
        rec.float("time/rollout", info.wait_s);
        rec.float("time/train", info.train_s);
        if let Some(sync) = &sync {
            sync.record(&mut rec);
        }
        rec.int("actor/current_version", self.trainer_version as i64);
        info.stale.record(&mut rec, self.set.staleness_threshold);
        rec.int("rollout/discarded_unused_trajs", info.discarded as i64);
        self.fleet.record(self.sup, &mut rec);
        rec.float("trainer/idle_ratio", (info.wait_s / step_s).clamp(0.0, 1.0));
        let capacity = f64::from(self.plan.rollouts) * step_s;
        rec.float(
            "rollout/idle_ratio",
            (1.0 - std::mem::take(&mut self.rollout_busy_s) / capacity).clamp(0.0, 1.0),
        );
        rec.float("throughput/env_steps_per_s", info.env_steps as f64 / step_s);
        rec.float("rollout/return", info.mean_return);
        rec.int("rollout/env_steps", info.env_steps as i64);
        rec.float("train/loss", info.loss);
        for (key, value) in &info.metrics {
            rec.float(key, value.unwrap_or(f64::NAN));
        }
        if let Some(tally) = self.eval_done.take() {
            tally.record(&mut rec);
        }
        sink.record(rec)?;
        self.totals.steps += 1;
        self.totals.env_steps += info.env_steps;
        self.trainer = Trainer::Idle {
            since: Instant::now(),
        };
        Ok(())
    }

    /// A rollout's restart and rejoin traffic, and its installs; the rest goes to [`Loop::on_report`].
    async fn on_incoming(
        &mut self,
        incoming: crate::orchestrator::supervisor::Incoming,
        sink: &mut MetricsSink,
    ) -> Result<(), OrchestratorError> {
        match self
            .fleet
            .handle(self.sup, &mut self.verifier, incoming)
            .await?
        {
            Handled::Nothing => Ok(()),
            Handled::Report(id, frame) => self.on_report(id, frame.header, frame.blob, sink).await,
            Handled::Lost(rank) => {
                if let Some(p) = self.eval_pending.get_mut(rank as usize) {
                    *p = false;
                }
                self.eval_settle();
                if let Some(slot) = self.slots.get_mut(rank as usize)
                    && slot.in_flight
                {
                    slot.in_flight = false;
                    self.fleet.lost_trajs(1);
                    tracing::warn!(
                        "rollout-{rank} was lost while generating a chunk: dropped, granted anew"
                    );
                }
                self.applied(rank, None, sink)
            }
            Handled::Ready { rank, version } => {
                if let Some(slot) = self.slots.get_mut(rank as usize) {
                    *slot = Slot {
                        version,
                        in_flight: false,
                    };
                }
                Ok(())
            }
            Handled::Applied {
                rank,
                version,
                install,
            } => self.applied(rank, Some((version, install)), sink),
        }
    }

    /// The running evaluation is done once no rollout it waits for is left.
    fn eval_settle(&mut self) {
        if self.eval_running.is_some() && !self.eval_pending.iter().any(|p| *p) {
            self.eval_done = self.eval_running.take();
        }
    }

    /// Rollout `rank` installed a version (or, `None`, was lost): the sync no longer waits for it.
    fn applied(
        &mut self,
        rank: u32,
        installed: Option<(u64, Install)>,
        sink: &mut MetricsSink,
    ) -> Result<(), OrchestratorError> {
        if let (Some((v, _)), Some(slot)) = (installed, self.slots.get_mut(rank as usize)) {
            slot.version = slot.version.max(v);
        }
        if let Trainer::Syncing {
            waiting, apply_max, ..
        } = &mut self.trainer
            && let Some(w) = waiting.get_mut(rank as usize)
            && std::mem::take(w)
            && let Some((_, install)) = installed
        {
            slowest(apply_max, install);
        }
        self.finish_sync(sink)
    }

    fn unexpected(id: WorkerId, report: &Report) -> OrchestratorError {
        OrchestratorError::Unexpected {
            worker: id.to_string(),
            report: format!("{report:?}"),
        }
    }

    async fn on_report(
        &mut self,
        id: WorkerId,
        report: Report,
        blob: Vec<u8>,
        sink: &mut MetricsSink,
    ) -> Result<(), OrchestratorError> {
        let rank = id.rank as usize;
        match report {
            Report::Chunk {
                version,
                env_steps,
                mean_return,
                busy_s,
                ..
            } if id != WorkerId::TRAINER => {
                if let Some(slot) = self.slots.get_mut(rank) {
                    slot.in_flight = false;
                    slot.version = slot.version.max(version);
                }
                self.rollout_busy_s += busy_s;
                self.buffer.push_back(Buffered {
                    version,
                    env_steps,
                    mean_return,
                    data: blob,
                });
            }

            Report::Trained {
                version,
                loss,
                metrics,
                ..
            } if id == WorkerId::TRAINER => {
                let Trainer::Training { started, mut info } = std::mem::replace(
                    &mut self.trainer,
                    Trainer::Idle {
                        since: Instant::now(),
                    },
                ) else {
                    return Err(Self::unexpected(
                        id,
                        &Report::Trained {
                            step: 0,
                            version,
                            loss,
                            busy_s: 0.0,
                            metrics,
                        },
                    ));
                };
                info.train_s = started.elapsed().as_secs_f64();
                info.loss = loss;
                info.metrics = metrics;
                self.trainer_version = version;
                // Commands run in order on the trainer: the checkpoint holds exactly this step's weights.
                if self.checkpoints.due(info.step + 1) {
                    self.checkpoints.request(self.sup).await?;
                }
                // The rollouts evaluate the versions they hold (recorded as eval/version): in the overlapped
                // loop they are not stopped to install this step's weights first.
                if eval::due(self.set.val_check_interval, info.step + 1, self.plan.steps)
                    && self.eval_running.is_none()
                {
                    let ready: Vec<u32> = (0..self.plan.rollouts)
                        .filter(|&r| self.sup.lifecycle().is_ready(r))
                        .collect();
                    self.eval_pending = vec![false; self.plan.rollouts as usize];
                    for rank in ready {
                        self.sup
                            .send(WorkerId::rollout(rank), &Command::Eval, &[])
                            .await?;
                        self.eval_pending[rank as usize] = true;
                    }
                    self.eval_running = Some(EvalTally::default());
                    self.eval_settle();
                }
                if version % self.set.sync_interval == 0 {
                    // The sync's time starts as its command goes out (the trainer starts on it at once).
                    let started = Instant::now();
                    self.sup
                        .send(WorkerId::TRAINER, &Command::Sync { version }, &[])
                        .await?;
                    let mut waiting = vec![false; self.plan.rollouts as usize];
                    // No-wait: rollouts install in the background while they generate, except those that
                    // wait for a version before any work (they apply it at once).
                    let apply = if self.set.no_wait {
                        self.sup.lifecycle().deferred()
                    } else {
                        self.sup.lifecycle().attached()
                    };
                    for rank in apply {
                        self.sup
                            .send(WorkerId::rollout(rank), &Command::Apply, &[])
                            .await?;
                        if !self.set.no_wait
                            && let Some(w) = waiting.get_mut(rank as usize)
                        {
                            *w = true;
                        }
                    }
                    self.trainer = Trainer::Syncing {
                        started,
                        info,
                        stats: None,
                        waiting,
                        apply_max: None,
                    };
                } else {
                    self.emit(info, None, sink)?;
                }
            }
            Report::Synced {
                stats,
                checksum,
                seconds,
            } if id == WorkerId::TRAINER => {
                self.verifier.trainer(stats.version, checksum)?;
                match &mut self.trainer {
                    Trainer::Syncing {
                        stats: slot @ None, ..
                    } => *slot = Some((stats, seconds)),
                    _ => {
                        return Err(Self::unexpected(
                            id,
                            &Report::Synced {
                                stats,
                                checksum,
                                seconds,
                            },
                        ));
                    }
                }
                self.finish_sync(sink)?;
            }
            Report::Checkpointed { step, version, dir } if id == WorkerId::TRAINER => {
                self.checkpoints.saved(step, version, dir);
            }
            Report::Evaluated {
                version,
                episodes,
                mean_return,
                success_rate,
                episode_len,
            } if id != WorkerId::TRAINER && self.eval_running.is_some() => {
                if let Some(tally) = &mut self.eval_running {
                    tally.add(version, episodes, mean_return, success_rate, episode_len);
                }
                if let Some(p) = self.eval_pending.get_mut(id.rank as usize) {
                    *p = false;
                }
                self.eval_settle();
            }
            other => return Err(Self::unexpected(id, &other)),
        }
        Ok(())
    }

    /// Emit the step's record once its sync is published (and, when blocking, applied everywhere).
    fn finish_sync(&mut self, sink: &mut MetricsSink) -> Result<(), OrchestratorError> {
        let done = matches!(
            &self.trainer,
            Trainer::Syncing {
                stats: Some(_),
                waiting,
                ..
            } if !waiting.iter().any(|w| *w)
        );
        if !done {
            return Ok(());
        }
        let Trainer::Syncing {
            started,
            info,
            stats: Some((stats, trainer_s)),
            apply_max,
            ..
        } = std::mem::replace(
            &mut self.trainer,
            Trainer::Idle {
                since: Instant::now(),
            },
        )
        else {
            return Ok(());
        };
        let outcome = SyncOutcome {
            stats,
            seconds: started.elapsed().as_secs_f64(),
            verified: self.verifier.all_matched(),
            trainer_s,
            apply_max,
        };
        self.emit(info, Some(outcome), sink)
    }
}

pub async fn run(
    sup: &mut Supervisor,
    plan: &RunPlan,
    set: AsyncSettings,
    sink: &mut MetricsSink,
    checkpoints: &mut Checkpoints,
) -> Result<LoopTotals, OrchestratorError> {
    let mut verifier = Verifier::new(set.verify);
    let mut fleet = Fleet::default();
    let weights::Bootstrap {
        ready_s,
        sync: init,
    } = weights::bootstrap(sup, &mut verifier, &mut fleet).await?;
    let started = Instant::now();
    let slots = vec![
        Slot {
            version: plan.start.version,
            ..Slot::default()
        };
        plan.rollouts as usize
    ];
    let mut lp = Loop {
        sup,
        plan,
        set,
        verifier,
        fleet,
        trainer: Trainer::Idle { since: started },
        trainer_version: plan.start.version,
        steps_started: plan.start.step,
        checkpoints,
        eval_running: None,
        eval_done: None,
        eval_pending: Vec::new(),
        buffer: VecDeque::new(),
        slots,
        next_chunk: 0,
        discarded: 0,
        rollout_busy_s: 0.0,
        last_row: started,
        totals: LoopTotals::default(),
    };
    lp.sup.begin_step();
    let to_train = plan.steps - plan.start.step.min(plan.steps);
    while lp.totals.steps < to_train || lp.checkpoints.pending > 0 || lp.eval_running.is_some() {
        // Training first: discarding stale chunks can make room for new grants.
        lp.try_train().await?;
        lp.grant().await?;
        let incoming = lp.sup.recv("trajectories, training or weight sync").await?;
        lp.on_incoming(incoming, sink).await?;
    }
    // An evaluation that finished after the last row goes into a row of its own at the final step.
    if let Some(tally) = lp.eval_done.take() {
        let mut rec = StepRecord::new(plan.steps.saturating_sub(1));
        tally.record(&mut rec);
        sink.record(rec)?;
    }
    let mut totals = lp.totals;
    totals.loop_s = started.elapsed().as_secs_f64();
    totals.ready_s = ready_s;
    totals.bootstrap_s = init.seconds;
    totals.bootstrap_bytes = init.stats.payload_bytes;
    totals.unused_at_end =
        (lp.buffer.len() + lp.slots.iter().filter(|s| s.in_flight).count()) as u64;
    Ok(totals)
}
