//! When the trainer saves checkpoints, and the orchestrator's wait for them.
//!
//! `runner.save_interval = k > 0`: every `k` steps; always at the final step; `0`: never; `< 0` (the default,
//! `-1`): only at the final step. On an interrupt the run saves one more (see `orchestrator::run`).

use std::path::PathBuf;

use crate::orchestrator::OrchestratorError;
use crate::orchestrator::supervisor::{Supervisor, WorkerId};
use crate::orchestrator::weights::{Fleet, Handled, Verifier};
use rlsync_core::protocol::messages::{Command, Report};

/// A checkpoint the trainer wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Saved {
    pub step: u64,
    pub version: u64,
    pub dir: PathBuf,
}

/// The checkpoint schedule of a run and the checkpoints written so far.
#[derive(Debug, Clone, Default)]
pub struct Checkpoints {
    interval: i64,
    total: u64,
    /// Requested, not yet reported.
    pub pending: u32,
    pub last: Option<Saved>,
}

impl Checkpoints {
    pub fn new(save_interval: i64, total_steps: u64) -> Checkpoints {
        Checkpoints {
            interval: save_interval,
            total: total_steps,
            pending: 0,
            last: None,
        }
    }

    /// Whether a checkpoint is due once `steps_done` trainer steps are complete.
    pub fn due(&self, steps_done: u64) -> bool {
        match self.interval {
            0 => false,
            k if k > 0 => steps_done.is_multiple_of(k as u64) || steps_done == self.total,
            _ => steps_done == self.total,
        }
    }

    /// Ask the trainer for a checkpoint (answered by `Report::Checkpointed`, see [`Checkpoints::saved`]).
    pub async fn request(&mut self, sup: &mut Supervisor) -> Result<(), OrchestratorError> {
        sup.send(WorkerId::TRAINER, &Command::Checkpoint, &[])
            .await?;
        self.pending += 1;
        Ok(())
    }

    /// Record a `Checkpointed` report.
    pub fn saved(&mut self, step: u64, version: u64, dir: PathBuf) {
        self.pending = self.pending.saturating_sub(1);
        tracing::info!("checkpoint at step {step}: {}", dir.display());
        self.last = Some(Saved { step, version, dir });
    }

    /// Request a checkpoint and wait for it, when nothing else is in flight (the synchronous loop); rollouts
    /// lost or restarted meanwhile are the fleet's to handle.
    pub async fn save_now(
        &mut self,
        sup: &mut Supervisor,
        fleet: &mut Fleet,
        verifier: &mut Verifier,
    ) -> Result<(), OrchestratorError> {
        self.request(sup).await?;
        while self.pending > 0 {
            let incoming = sup.recv("the trainer's checkpoint").await?;
            let Handled::Report(id, frame) = fleet.handle(sup, verifier, incoming).await? else {
                continue;
            };
            match frame.header {
                Report::Checkpointed { step, version, dir } if id == WorkerId::TRAINER => {
                    self.saved(step, version, dir)
                }
                other => {
                    return Err(OrchestratorError::Unexpected {
                        worker: id.to_string(),
                        report: format!("{other:?}"),
                    });
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn due_steps(interval: i64, total: u64) -> Vec<u64> {
        let c = Checkpoints::new(interval, total);
        (1..=total).filter(|s| c.due(*s)).collect()
    }

    #[test]
    fn schedule_always_keeps_the_final_step_unless_disabled() {
        assert_eq!(due_steps(-1, 5), [5]);
        assert_eq!(due_steps(2, 5), [2, 4, 5]);
        assert_eq!(due_steps(5, 10), [5, 10]);
        assert_eq!(due_steps(0, 5), Vec::<u64>::new());
    }
}
