//! The synchronous `train_embodied` loop: per step, sync (every `runner.weight_sync_interval` steps) →
//! every rollout generates its share → the trainer trains on all of it → one metrics record.

use std::time::Instant;

use crate::orchestrator::metrics::{MetricsSink, StepRecord, staleness};
use crate::orchestrator::plan::RunPlan;
use crate::orchestrator::protocol::{Command, Report};
use crate::orchestrator::supervisor::{Supervisor, WorkerId};
use crate::orchestrator::weights::{self, Verifier};
use crate::orchestrator::{LoopTotals, OrchestratorError};

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

async fn gather(sup: &mut Supervisor, chunks: u64) -> Result<Gathered, OrchestratorError> {
    let mut got = Gathered::default();
    for _ in 0..chunks {
        let (id, frame) = sup.recv("rollout chunks").await?;
        match frame.header {
            Report::Chunk { version, env_steps, mean_return, busy_s, .. } if id != WorkerId::TRAINER => {
                got.samples.push((version, env_steps));
                got.env_steps += env_steps;
                got.return_sum += mean_return;
                got.busy_s += busy_s;
                got.data.extend_from_slice(&frame.blob);
            }
            other => return Err(OrchestratorError::Unexpected { worker: id.to_string(), report: format!("{other:?}") }),
        }
    }
    Ok(got)
}

pub async fn run(
    sup: &mut Supervisor,
    plan: &RunPlan,
    interval: u64,
    verify: bool,
    sink: &mut MetricsSink,
) -> Result<LoopTotals, OrchestratorError> {
    let mut verifier = Verifier::new(verify);
    let init = weights::bootstrap(sup, &mut verifier).await?;
    let started = Instant::now();
    let mut totals = LoopTotals::default();
    let mut version = 0u64;
    let chunks = u64::from(plan.rollouts) * u64::from(plan.chunks_per_rollout);
    for step in 0..plan.steps {
        sup.begin_step();
        let step_start = Instant::now();
        let sync = match (step % interval == 0, step) {
            (false, _) => None,
            (true, 0) => Some(init.clone()),
            (true, _) => Some(weights::blocking_sync(sup, &mut verifier, version).await?),
        };

        let rollout_start = Instant::now();
        let cmd = Command::Rollout {
            first_chunk: step * u64::from(plan.chunks_per_rollout),
            chunks: plan.chunks_per_rollout,
            steps: plan.chunk_steps,
            background: false,
        };
        sup.send_rollouts(&cmd).await?;
        let got = gather(sup, chunks).await?;
        let rollout_s = rollout_start.elapsed().as_secs_f64();

        let train_start = Instant::now();
        let train = Command::Train { step, chunks: chunks as u32, env_steps: got.env_steps };
        sup.send(WorkerId::TRAINER, &train, &got.data).await?;
        let (loss, trained_version, train_busy) = loop {
            let (id, frame) = sup.recv("the trainer's step").await?;
            match frame.header {
                Report::Trained { version, loss, busy_s, .. } if id == WorkerId::TRAINER => break (loss, version, busy_s),
                other => return Err(OrchestratorError::Unexpected { worker: id.to_string(), report: format!("{other:?}") }),
            }
        };
        let train_s = train_start.elapsed().as_secs_f64();
        let stale = staleness(version, &got.samples);
        version = trained_version;

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
        rec.float("trainer/idle_ratio", (1.0 - (train_busy + sync_s) / step_s.max(1e-12)).clamp(0.0, 1.0));
        let rollout_capacity = f64::from(plan.rollouts) * step_s;
        rec.float("rollout/idle_ratio", (1.0 - got.busy_s / rollout_capacity.max(1e-12)).clamp(0.0, 1.0));
        rec.float("throughput/env_steps_per_s", got.env_steps as f64 / step_s.max(1e-12));
        rec.float("rollout/return", got.return_sum / chunks.max(1) as f64);
        rec.int("rollout/env_steps", got.env_steps as i64);
        rec.float("train/loss", loss);
        sink.record(rec)?;
        totals.env_steps += got.env_steps;
        totals.steps += 1;
    }
    totals.wall_s = started.elapsed().as_secs_f64();
    Ok(totals)
}
