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
use crate::orchestrator::weights::{self, SyncOutcome, Verifier};
use crate::orchestrator::{LoopTotals, OrchestratorError};
use crate::protocol::messages::{Command, Report, SyncStats};

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

/// Collect the sync reports (when `syncing`) and `chunks` trajectory chunks, in whatever order they come.
async fn gather(
    sup: &mut Supervisor,
    verifier: &mut Verifier,
    syncing: bool,
    chunks: u64,
) -> Result<(Gathered, Option<SyncOutcome>), OrchestratorError> {
    let started = Instant::now();
    let mut got = Gathered::default();
    let mut received = 0u64;
    let mut stats: Option<SyncStats> = None;
    let mut applied = 0u32;
    let applies = if syncing { sup.rollouts() } else { 0 };
    let mut sync_s = 0.0;
    while received < chunks || applied < applies || (syncing && stats.is_none()) {
        let (id, frame) = sup.recv("weight sync and rollout chunks").await?;
        match frame.header {
            Report::Chunk {
                version,
                env_steps,
                mean_return,
                busy_s,
                ..
            } if id != WorkerId::TRAINER => {
                received += 1;
                got.samples.push((version, env_steps));
                got.env_steps += env_steps;
                got.return_sum += mean_return;
                got.busy_s += busy_s;
                got.data.extend_from_slice(&frame.blob);
            }
            Report::Synced {
                stats: s, checksum, ..
            } if id == WorkerId::TRAINER && syncing && stats.is_none() => {
                verifier.trainer(s.version, checksum)?;
                stats = Some(s);
            }
            Report::Applied {
                version, checksum, ..
            } if id != WorkerId::TRAINER && applied < applies => {
                verifier.rollout(id, version, checksum)?;
                applied += 1;
            }
            other => {
                return Err(OrchestratorError::Unexpected {
                    worker: id.to_string(),
                    report: format!("{other:?}"),
                });
            }
        }
        if syncing && sync_s == 0.0 && stats.is_some() && applied == applies {
            sync_s = started.elapsed().as_secs_f64();
        }
    }
    let outcome = stats.map(|stats| SyncOutcome {
        stats,
        seconds: sync_s,
        verified: verifier.all_matched(),
    });
    Ok((got, outcome))
}

/// Evaluate the trainer's weights `version` on every rollout (one deterministic episode per eval env), after
/// syncing them when the rollouts hold an older version (as RLinf updates the rollout weights before it
/// evaluates). Returns the pooled reports and that sync, if one was needed.
pub async fn evaluate(
    sup: &mut Supervisor,
    verifier: &mut Verifier,
    version: u64,
    rollout_version: &mut u64,
) -> Result<(EvalTally, Option<SyncOutcome>), OrchestratorError> {
    let started = Instant::now();
    let syncing = *rollout_version < version;
    if syncing {
        sup.send(WorkerId::TRAINER, &Command::Sync { version }, &[])
            .await?;
        sup.send_rollouts(&Command::Apply).await?;
    }
    sup.send_rollouts(&Command::Eval).await?;
    let rollouts = sup.rollouts();
    let mut tally = EvalTally::default();
    let (mut stats, mut applied, mut sync_s) = (None, 0u32, 0.0);
    while tally.reports < rollouts || (syncing && (stats.is_none() || applied < rollouts)) {
        let (id, frame) = sup.recv("the rollouts' evaluation").await?;
        match frame.header {
            Report::Synced {
                stats: s, checksum, ..
            } if id == WorkerId::TRAINER && syncing && stats.is_none() => {
                verifier.trainer(s.version, checksum)?;
                stats = Some(s);
            }
            Report::Applied {
                version, checksum, ..
            } if id != WorkerId::TRAINER && applied < rollouts => {
                verifier.rollout(id, version, checksum)?;
                applied += 1;
                if applied == rollouts {
                    sync_s = started.elapsed().as_secs_f64();
                }
            }
            Report::Evaluated {
                version,
                episodes,
                mean_return,
                success_rate,
                episode_len,
            } if id != WorkerId::TRAINER => {
                tally.add(version, episodes, mean_return, success_rate, episode_len);
            }
            other => {
                return Err(OrchestratorError::Unexpected {
                    worker: id.to_string(),
                    report: format!("{other:?}"),
                });
            }
        }
    }
    *rollout_version = version;
    let outcome = stats.map(|stats| SyncOutcome {
        stats,
        seconds: sync_s,
        verified: verifier.all_matched(),
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
    let init = weights::bootstrap(sup, &mut verifier).await?;
    let started = Instant::now();
    sup.begin_step();
    let mut held = plan.start.version;
    let (tally, _) = evaluate(sup, &mut verifier, plan.start.version, &mut held).await?;
    let mut rec = StepRecord::new(plan.start.step);
    rec.float("time/eval", started.elapsed().as_secs_f64());
    init.record(&mut rec);
    rec.int("actor/current_version", plan.start.version as i64);
    tally.record(&mut rec);
    sink.record(rec)?;
    Ok(LoopTotals {
        wall_s: started.elapsed().as_secs_f64(),
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
    let init = weights::bootstrap(sup, &mut verifier).await?;
    let started = Instant::now();
    let mut totals = LoopTotals::default();
    let first = plan.start.step;
    let mut version = plan.start.version;
    // The version the rollouts hold, and a sync an evaluation made that the next step's rollouts use.
    let mut rollout_version = version;
    let mut carried: Option<SyncOutcome> = None;
    let chunks = u64::from(plan.rollouts) * u64::from(plan.chunks_per_rollout);
    for step in first..plan.steps {
        sup.begin_step();
        let step_start = Instant::now();
        // The first step's weights are the bootstrap's.
        let syncing = step % interval == 0 && step > first && rollout_version < version;
        if syncing {
            rollout_version = version;
        }
        if syncing {
            sup.send(WorkerId::TRAINER, &Command::Sync { version }, &[])
                .await?;
            sup.send_rollouts(&Command::Apply).await?;
        }
        let cmd = Command::Rollout {
            first_chunk: step * u64::from(plan.chunks_per_rollout),
            chunks: plan.chunks_per_rollout,
            steps: plan.chunk_steps,
            background: false,
        };
        sup.send_rollouts(&cmd).await?;
        let (got, synced) = gather(sup, &mut verifier, syncing, chunks).await?;
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
        let (id, frame) = sup.recv("the trainer's step").await?;
        let (loss, trained_version, train_busy, metrics) = match frame.header {
            Report::Trained {
                version,
                loss,
                busy_s,
                metrics,
                ..
            } if id == WorkerId::TRAINER => (loss, version, busy_s, metrics),
            other => {
                return Err(OrchestratorError::Unexpected {
                    worker: id.to_string(),
                    report: format!("{other:?}"),
                });
            }
        };
        let train_s = train_start.elapsed().as_secs_f64();
        let stale = staleness(version, &got.samples);
        version = trained_version;
        let eval_start = Instant::now();
        let eval = if eval::due(val_check_interval, step + 1, plan.steps) {
            let (tally, sync) = evaluate(sup, &mut verifier, version, &mut rollout_version).await?;
            carried = sync;
            Some((tally, eval_start.elapsed().as_secs_f64()))
        } else {
            None
        };

        let step_s = step_start.elapsed().as_secs_f64();
        let sync_s = sync.as_ref().map(|s| s.seconds).unwrap_or(0.0);
        let mut rec = StepRecord::new(step);
        rec.float("time/step", step_s);
        rec.float("time/sync_weights", sync_s);
        rec.float("time/rollout", rollout_s);
        rec.float("time/train", train_s);
        if let Some(sync) = &sync {
            sync.record(&mut rec);
        }
        rec.int("actor/current_version", version as i64);
        stale.record(&mut rec, 0);
        rec.int("rollout/discarded_unused_trajs", 0);
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
            checkpoints.save_now(sup).await?;
        }
    }
    totals.wall_s = started.elapsed().as_secs_f64();
    Ok(totals)
}
