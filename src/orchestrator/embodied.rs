//! The synchronous `train_embodied` loop: per step, sync (every `runner.weight_sync_interval` steps) →
//! every rollout generates its share → the trainer trains on all of it → one metrics record.
//!
//! The sync and rollout commands go out together: each rollout applies the new version and then generates,
//! without a round trip through the orchestrator in between (commands run in order on a rollout, so every
//! chunk of the step still comes from the new version).

use std::time::Instant;

use crate::orchestrator::checkpoint::Checkpoints;
use crate::orchestrator::eval::{self, EvalTally};
use crate::orchestrator::metrics::{MetricsSink, StepRecord, staleness};
use crate::orchestrator::plan::RunPlan;
use crate::orchestrator::supervisor::{Supervisor, WorkerId};
use crate::orchestrator::weights::{self, Fleet, Handled, SyncOutcome, Verifier, slowest};
use crate::orchestrator::{LoopTotals, OrchestratorError};
use rlsync_core::protocol::messages::{Command, Report, SyncStats};

/// What the rollout phase of one step produced.
#[derive(Default)]
struct Gathered {
    /// (version, env steps) per chunk.
    samples: Vec<(u64, u64)>,
    data: Vec<u8>,
    env_steps: u64,
    return_sum: f64,
    busy_s: f64,
}

/// The step's chunks: handed out to rollouts that hold the step's weights; a lost rollout's unfinished
/// chunks go back to the pool (and are counted lost), for the others or its caught-up successor.
struct Work {
    /// Chunks not handed out yet.
    pool: u64,
    /// Chunks each rank owes.
    owed: Vec<u64>,
    /// Ranks that hold (or, commands running in order, will hold before they generate) the step's weights.
    eligible: Vec<bool>,
    next_chunk: u64,
    chunks_per_rollout: u32,
    steps: u32,
}

impl Work {
    /// Hand out pooled chunks: a full share to an eligible rank that owes none, one at a time after that.
    async fn hand_out(&mut self, sup: &mut Supervisor) -> Result<(), OrchestratorError> {
        for rank in 0..self.owed.len() {
            if self.pool == 0 {
                break;
            }
            if !self.eligible[rank] || self.owed[rank] > 0 {
                continue;
            }
            let n = self.pool.min(u64::from(self.chunks_per_rollout));
            let cmd = Command::Rollout {
                first_chunk: self.next_chunk,
                chunks: n as u32,
                steps: self.steps,
                background: false,
            };
            sup.send(WorkerId::rollout(rank as u32), &cmd, &[]).await?;
            self.next_chunk += n;
            self.pool -= n;
            self.owed[rank] += n;
        }
        Ok(())
    }

    /// Rank `rank` is gone: what it owed goes back to the pool. Returns the chunks lost.
    fn lose(&mut self, rank: u32) -> u64 {
        let rank = rank as usize;
        let owed = self.owed.get(rank).copied().unwrap_or(0);
        if let Some(o) = self.owed.get_mut(rank) {
            *o = 0;
        }
        if let Some(e) = self.eligible.get_mut(rank) {
            *e = false;
        }
        self.pool += owed;
        owed
    }
}

/// Collect the sync reports (when `syncing`: its commands went out at `started`) and the step's `chunks`
/// trajectory chunks, in whatever order they come, while rollouts are lost and rejoin.
#[allow(clippy::too_many_arguments)]
async fn gather(
    sup: &mut Supervisor,
    verifier: &mut Verifier,
    fleet: &mut Fleet,
    syncing: bool,
    started: Instant,
    version: u64,
    chunks: u64,
    mut work: Work,
    mut applies: Vec<bool>,
) -> Result<(Gathered, Option<SyncOutcome>), OrchestratorError> {
    let mut got = Gathered::default();
    let mut received = 0u64;
    let mut stats: Option<SyncStats> = None;
    let mut sync_s = 0.0;
    let (mut trainer_s, mut apply_max) = (0.0, None);
    work.hand_out(sup).await?;
    while received < chunks || applies.iter().any(|a| *a) || (syncing && stats.is_none()) {
        let incoming = sup.recv("weight sync and rollout chunks").await?;
        match fleet.handle(sup, verifier, incoming).await? {
            Handled::Nothing => {}
            Handled::Lost(rank) => {
                let lost = work.lose(rank);
                fleet.lost_trajs(lost);
                if let Some(a) = applies.get_mut(rank as usize) {
                    *a = false;
                }
                if lost > 0 {
                    tracing::warn!(
                        "rollout-{rank} was lost with {lost} unfinished chunk(s) of step version {version}: dropped, handed to the others"
                    );
                }
            }
            Handled::Ready { rank, version: v } => {
                // Caught up to the step's weights (a later version cannot exist before this step trains).
                if v == version
                    && let Some(e) = work.eligible.get_mut(rank as usize)
                {
                    *e = true;
                }
            }
            Handled::Applied {
                rank,
                version: v,
                install,
            } => {
                if let Some(a) = applies.get_mut(rank as usize)
                    && std::mem::take(a)
                {
                    slowest(&mut apply_max, install);
                }
                if v == version
                    && let Some(e) = work.eligible.get_mut(rank as usize)
                {
                    *e = true;
                }
            }
            Handled::Report(id, frame) => match frame.header {
                Report::Chunk {
                    version,
                    env_steps,
                    mean_return,
                    busy_s,
                    ..
                } if id != WorkerId::TRAINER => {
                    received += 1;
                    if let Some(o) = work.owed.get_mut(id.rank as usize) {
                        *o = o.saturating_sub(1);
                    }
                    got.samples.push((version, env_steps));
                    got.env_steps += env_steps;
                    got.return_sum += mean_return;
                    got.busy_s += busy_s;
                    got.data.extend_from_slice(&frame.blob);
                }
                Report::Synced {
                    stats: s,
                    checksum,
                    seconds,
                } if id == WorkerId::TRAINER && syncing && stats.is_none() => {
                    verifier.trainer(s.version, checksum)?;
                    stats = Some(s);
                    trainer_s = seconds;
                }
                other => {
                    return Err(OrchestratorError::Unexpected {
                        worker: id.to_string(),
                        report: format!("{other:?}"),
                    });
                }
            },
        }
        work.hand_out(sup).await?;
        if syncing && sync_s == 0.0 && stats.is_some() && !applies.iter().any(|a| *a) {
            sync_s = started.elapsed().as_secs_f64();
        }
    }
    let outcome = stats.map(|stats| SyncOutcome {
        stats,
        seconds: sync_s,
        verified: verifier.all_matched(),
        trainer_s,
        apply_max,
    });
    Ok((got, outcome))
}

/// Evaluate the trainer's weights `version` on the rollouts (one deterministic episode per eval env), after
/// syncing them when the rollouts hold an older version (as RLinf updates the rollout weights before it
/// evaluates). Rollouts that are down or still catching up after a restart are not waited for. Returns the
/// pooled reports and that sync, if one was needed; `published` becomes `version`.
pub async fn evaluate(
    sup: &mut Supervisor,
    verifier: &mut Verifier,
    fleet: &mut Fleet,
    version: u64,
    published: &mut u64,
) -> Result<(EvalTally, Option<SyncOutcome>), OrchestratorError> {
    let started = Instant::now();
    let rollouts = sup.rollouts() as usize;
    let syncing = *published < version;
    let mut applies = vec![false; rollouts];
    if syncing {
        *published = version;
        sup.send(WorkerId::TRAINER, &Command::Sync { version }, &[])
            .await?;
        for rank in sup.lifecycle().attached() {
            sup.send(WorkerId::rollout(rank), &Command::Apply, &[])
                .await?;
            applies[rank as usize] = true;
        }
    }
    // A worker runs its commands in order: those applying the sync evaluate what they installed.
    let mut evaluating = vec![false; rollouts];
    for rank in 0..rollouts as u32 {
        if applies[rank as usize]
            || (sup.lifecycle().is_ready(rank) && sup.lifecycle().version(rank) == *published)
        {
            sup.send(WorkerId::rollout(rank), &Command::Eval, &[])
                .await?;
            evaluating[rank as usize] = true;
        }
    }
    let mut tally = EvalTally::default();
    let (mut stats, mut sync_s, mut trainer_s, mut apply_max) = (None, 0.0, 0.0, None);
    while evaluating.iter().any(|e| *e)
        || applies.iter().any(|a| *a)
        || (syncing && stats.is_none())
    {
        let incoming = sup.recv("the rollouts' evaluation").await?;
        match fleet.handle(sup, verifier, incoming).await? {
            Handled::Nothing | Handled::Ready { .. } => {}
            Handled::Lost(rank) => {
                for pending in [&mut evaluating, &mut applies] {
                    if let Some(p) = pending.get_mut(rank as usize) {
                        *p = false;
                    }
                }
            }
            Handled::Applied { rank, install, .. } => {
                if let Some(a) = applies.get_mut(rank as usize)
                    && std::mem::take(a)
                {
                    slowest(&mut apply_max, install);
                }
            }
            Handled::Report(id, frame) => match frame.header {
                Report::Synced {
                    stats: s,
                    checksum,
                    seconds,
                } if id == WorkerId::TRAINER && syncing && stats.is_none() => {
                    verifier.trainer(s.version, checksum)?;
                    stats = Some(s);
                    trainer_s = seconds;
                }
                Report::Evaluated {
                    version,
                    episodes,
                    mean_return,
                    success_rate,
                    episode_len,
                } if id != WorkerId::TRAINER => {
                    if let Some(e) = evaluating.get_mut(id.rank as usize) {
                        *e = false;
                    }
                    tally.add(version, episodes, mean_return, success_rate, episode_len);
                }
                other => {
                    return Err(OrchestratorError::Unexpected {
                        worker: id.to_string(),
                        report: format!("{other:?}"),
                    });
                }
            },
        }
        if syncing && sync_s == 0.0 && stats.is_some() && !applies.iter().any(|a| *a) {
            sync_s = started.elapsed().as_secs_f64();
        }
    }
    let outcome = stats.map(|stats| SyncOutcome {
        stats,
        seconds: sync_s,
        verified: verifier.all_matched(),
        trainer_s,
        apply_max,
    });
    Ok((tally, outcome))
}

/// `runner.only_eval`: evaluate the weights the run starts with (the checkpoint of `runner.resume_dir`, or
/// the initial ones) on the rollouts, record one row at the start step, and train nothing.
pub async fn eval_only(
    sup: &mut Supervisor,
    plan: &RunPlan,
    verify: bool,
    sink: &mut MetricsSink,
) -> Result<LoopTotals, OrchestratorError> {
    let mut verifier = Verifier::new(verify);
    let mut fleet = Fleet::default();
    let weights::Bootstrap {
        ready_s,
        sync: init,
    } = weights::bootstrap(sup, &mut verifier, &mut fleet).await?;
    let started = Instant::now();
    sup.begin_step();
    let mut held = plan.start.version;
    let (tally, _) = evaluate(
        sup,
        &mut verifier,
        &mut fleet,
        plan.start.version,
        &mut held,
    )
    .await?;
    let mut rec = StepRecord::new(plan.start.step);
    rec.float("time/eval", started.elapsed().as_secs_f64());
    rec.float("time/init_weights", init.seconds);
    init.record(&mut rec);
    rec.int("actor/current_version", plan.start.version as i64);
    tally.record(&mut rec);
    sink.record(rec)?;
    Ok(LoopTotals {
        loop_s: started.elapsed().as_secs_f64(),
        ready_s,
        bootstrap_s: init.seconds,
        bootstrap_bytes: init.stats.payload_bytes,
        ..LoopTotals::default()
    })
}

#[allow(clippy::too_many_arguments)]
pub async fn run(
    sup: &mut Supervisor,
    plan: &RunPlan,
    interval: u64,
    verify: bool,
    val_check_interval: i64,
    sink: &mut MetricsSink,
    checkpoints: &mut Checkpoints,
) -> Result<LoopTotals, OrchestratorError> {
    let mut verifier = Verifier::new(verify);
    let mut fleet = Fleet::default();
    let weights::Bootstrap {
        ready_s,
        sync: init,
    } = weights::bootstrap(sup, &mut verifier, &mut fleet).await?;
    let started = Instant::now();
    let mut totals = LoopTotals {
        ready_s,
        bootstrap_s: init.seconds,
        bootstrap_bytes: init.stats.payload_bytes,
        ..LoopTotals::default()
    };
    let first = plan.start.step;
    let mut version = plan.start.version;
    // The version the rollouts hold (the last one synced, by a step or by an evaluation), and a sync an
    // evaluation made that the next step's rollouts use.
    let mut published = version;
    let mut carried: Option<SyncOutcome> = None;
    let chunks = u64::from(plan.rollouts) * u64::from(plan.chunks_per_rollout);
    for step in first..plan.steps {
        sup.begin_step();
        let step_start = Instant::now();
        // The first step's weights are the bootstrap's (or an evaluation's sync).
        let syncing = step % interval == 0 && step > first && published < version;
        let rollouts = plan.rollouts as usize;
        let mut applies = vec![false; rollouts];
        if syncing {
            published = version;
            sup.send(WorkerId::TRAINER, &Command::Sync { version }, &[])
                .await?;
            for rank in sup.lifecycle().attached() {
                sup.send(WorkerId::rollout(rank), &Command::Apply, &[])
                    .await?;
                applies[rank as usize] = true;
            }
        }
        // Who generates the step: rollouts holding its weights, or about to (their apply runs first).
        let eligible: Vec<bool> = (0..plan.rollouts)
            .map(|r| {
                applies[r as usize]
                    || (sup.lifecycle().is_ready(r) && sup.lifecycle().version(r) == published)
            })
            .collect();
        let work = Work {
            pool: chunks,
            owed: vec![0; rollouts],
            eligible,
            next_chunk: step * chunks,
            chunks_per_rollout: plan.chunks_per_rollout,
            steps: plan.chunk_steps,
        };
        let (got, synced) = gather(
            sup,
            &mut verifier,
            &mut fleet,
            syncing,
            step_start,
            published,
            chunks,
            work,
            applies,
        )
        .await?;
        // Rollouts start generating right after applying: their phase is what remains of the gather.
        let rollout_s =
            step_start.elapsed().as_secs_f64() - synced.as_ref().map(|s| s.seconds).unwrap_or(0.0);
        let sync = if step == first {
            Some(init.clone())
        } else {
            synced.or(carried.take())
        };

        let train_start = Instant::now();
        let train = Command::Train {
            step,
            chunks: chunks as u32,
            env_steps: got.env_steps,
        };
        sup.send(WorkerId::TRAINER, &train, &got.data).await?;
        let (loss, trained_version, train_busy, metrics) = loop {
            let incoming = sup.recv("the trainer's step").await?;
            let (id, frame) = match fleet.handle(sup, &mut verifier, incoming).await? {
                Handled::Report(id, frame) => (id, frame),
                // Losses and rejoins between rollout phases: nothing of this step is owed any more.
                _ => continue,
            };
            match frame.header {
                Report::Trained {
                    version,
                    loss,
                    busy_s,
                    metrics,
                    ..
                } if id == WorkerId::TRAINER => {
                    break (loss, version, busy_s, metrics);
                }
                other => {
                    return Err(OrchestratorError::Unexpected {
                        worker: id.to_string(),
                        report: format!("{other:?}"),
                    });
                }
            }
        };
        let train_s = train_start.elapsed().as_secs_f64();
        let stale = staleness(version, &got.samples);
        version = trained_version;
        let eval_start = Instant::now();
        let eval = if eval::due(val_check_interval, step + 1, plan.steps) {
            let (tally, sync) =
                evaluate(sup, &mut verifier, &mut fleet, version, &mut published).await?;
            carried = sync;
            Some((tally, eval_start.elapsed().as_secs_f64()))
        } else {
            None
        };

        let step_s = step_start.elapsed().as_secs_f64();
        // The first step's weights came with the init bootstrap, before the step: its time is no step's sync
        // time (`time/init_weights` holds it).
        let bootstrapped = step == first;
        let sync_s = match &sync {
            Some(s) if !bootstrapped => s.seconds,
            _ => 0.0,
        };
        let mut rec = StepRecord::new(step);
        rec.float("time/step", step_s);
        rec.float("time/sync_weights", sync_s);
        if bootstrapped {
            rec.float("time/init_weights", init.seconds);
        }
        rec.float("time/rollout", rollout_s);
        rec.float("time/train", train_s);
        if let Some(sync) = &sync {
            sync.record(&mut rec);
        }
        rec.int("actor/current_version", version as i64);
        stale.record(&mut rec, 0);
        rec.int("rollout/discarded_unused_trajs", 0);
        fleet.record(sup, &mut rec);
        rec.float(
            "trainer/idle_ratio",
            (1.0 - (train_busy + sync_s) / step_s.max(1e-12)).clamp(0.0, 1.0),
        );
        let rollout_capacity = f64::from(plan.rollouts) * step_s;
        rec.float(
            "rollout/idle_ratio",
            (1.0 - got.busy_s / rollout_capacity.max(1e-12)).clamp(0.0, 1.0),
        );
        rec.float(
            "throughput/env_steps_per_s",
            got.env_steps as f64 / step_s.max(1e-12),
        );
        rec.float("rollout/return", got.return_sum / chunks.max(1) as f64);
        rec.int("rollout/env_steps", got.env_steps as i64);
        rec.float("train/loss", loss);
        for (key, value) in &metrics {
            rec.float(key, value.unwrap_or(f64::NAN));
        }
        if let Some((tally, seconds)) = &eval {
            rec.float("time/eval", *seconds);
            tally.record(&mut rec);
        }
        sink.record(rec)?;
        totals.env_steps += got.env_steps;
        totals.steps += 1;
        if checkpoints.due(step + 1) {
            checkpoints.save_now(sup, &mut fleet, &mut verifier).await?;
        }
    }
    totals.loop_s = started.elapsed().as_secs_f64();
    Ok(totals)
}
