//! The process plan of a run, computed from the config alone: workers, env split, chunking, state bytes and
//! the bytes a sync is expected to move. Used by the loops and by `--dry-run`.

use std::fmt;

use crate::config::schema::{Placement, RunConfig, SyncerKind};
use crate::orchestrator::{Entry, OrchestratorError};
use crate::worker::standin::tensor::Role;
use crate::worker::synthetic::{self, dtype_of};

/// Bytes of the model state by role.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StateBytes {
    pub tensors: u64,
    pub total: u64,
    /// Trainable + buffers: what every sync covers.
    pub synced: u64,
    pub frozen: u64,
}

#[derive(Debug, Clone, PartialEq)]
pub struct RunPlan {
    pub entry: Entry,
    pub rollouts: u32,
    pub envs_per_rollout: u32,
    /// Train steps to run.
    pub steps: u64,
    /// Env steps of every env of a rollout per chunk.
    pub chunk_steps: u32,
    /// Chunks each rollout contributes per train step (the batch is `rollouts * chunks_per_rollout`).
    pub chunks_per_rollout: u32,
    /// Env steps trained on per train step.
    pub env_steps_per_step: u64,
    pub state: StateBytes,
    pub syncer: SyncerKind,
    /// Upper bound of one weight update's payload (bucket: exact; patch: every element changed).
    pub bytes_per_sync: u64,
}

fn invalid(reason: impl Into<String>) -> OrchestratorError {
    OrchestratorError::Config { reason: reason.into() }
}

/// Number of worker slots a placement lists: `0-3` → 4, `0,2,4` → 3, `5` → 1.
pub fn placement_slots(placement: &Placement) -> Result<u32, OrchestratorError> {
    let text = match placement {
        Placement::Single(_) => return Ok(1),
        Placement::Ranges(text) => text,
    };
    let mut slots = 0u32;
    for part in text.split(',').map(str::trim) {
        let bad = || invalid(format!("placement '{text}': '{part}' is not a GPU index or range like 0-3"));
        let count = match part.split_once('-') {
            Some((a, b)) => {
                let (a, b) = (a.trim().parse::<u32>().map_err(|_| bad())?, b.trim().parse::<u32>().map_err(|_| bad())?);
                if b < a {
                    return Err(bad());
                }
                b - a + 1
            }
            None => {
                part.parse::<u32>().map_err(|_| bad())?;
                1
            }
        };
        slots = slots.saturating_add(count);
    }
    Ok(slots)
}

/// The rollout worker count from `cluster.component_placement` (a key naming `rollout`, possibly joined
/// with others as in `actor,rollout`).
pub fn rollout_workers(cfg: &RunConfig) -> Result<u32, OrchestratorError> {
    let placement = cfg
        .cluster
        .component_placement
        .iter()
        .find(|(key, _)| key.split(',').any(|part| part.trim() == "rollout"))
        .map(|(_, p)| p)
        .ok_or_else(|| invalid("cluster.component_placement has no 'rollout' entry (e.g. rollout: 0-1)"))?;
    let n = placement_slots(placement)?;
    if n == 0 {
        return Err(invalid("cluster.component_placement.rollout lists no slot"));
    }
    Ok(n)
}

pub fn plan(entry: Entry, cfg: &RunConfig) -> Result<RunPlan, OrchestratorError> {
    let rollouts = rollout_workers(cfg)?;
    let envs = cfg.env.train.total_num_envs.get();
    if envs % rollouts != 0 {
        return Err(invalid(format!(
            "env.train.total_num_envs={envs} does not split evenly over {rollouts} rollout workers"
        )));
    }
    let steps = if cfg.runner.max_steps >= 0 { cfg.runner.max_steps } else { cfg.runner.max_epochs };
    if steps <= 0 {
        return Err(invalid("runner.max_steps (or runner.max_epochs when max_steps is -1) must be positive"));
    }
    let per_step = u64::from(cfg.env.train.max_steps_per_rollout_epoch.get()) * u64::from(cfg.env.train.rollout_epoch.get());
    let chunk_steps = u64::from(cfg.rollout.chunk_steps.get()).min(per_step);
    let chunks_per_rollout = per_step.div_ceil(chunk_steps);
    let chunks_per_rollout = u32::try_from(chunks_per_rollout).map_err(|_| invalid("too many rollout chunks per step"))?;
    let interval = u64::from(cfg.runner.weight_sync_interval.get());
    if entry == Entry::Async && u64::from(cfg.algorithm.staleness_threshold) + 1 < interval {
        return Err(invalid(format!(
            "algorithm.staleness_threshold={} cannot be met when weights are synced only every {interval} steps \
             (runner.weight_sync_interval); use a threshold of at least {}",
            cfg.algorithm.staleness_threshold,
            interval - 1
        )));
    }
    let state = state_bytes(cfg)?;
    let elem = dtype_of(cfg.actor.model.precision).size_bytes() as u64;
    let synced_elems = state.synced / elem.max(1);
    let bytes_per_sync = match cfg.weight_syncer.kind {
        SyncerKind::Bucket => {
            let cast = cfg.weight_syncer.bucket.bucket_dtype.map(|d| match d {
                crate::config::schema::FloatDtype::Float32 => 4,
                _ => 2,
            });
            synced_elems * cast.unwrap_or(elem)
        }
        // A patch carries a 4-byte coordinate and the value of every changed element.
        SyncerKind::Patch => synced_elems * (4 + elem),
    };
    Ok(RunPlan {
        entry,
        rollouts,
        envs_per_rollout: envs / rollouts,
        steps: steps as u64,
        chunk_steps: chunk_steps as u32,
        chunks_per_rollout,
        env_steps_per_step: u64::from(rollouts) * u64::from(chunks_per_rollout) * chunk_steps * u64::from(envs / rollouts),
        state,
        syncer: cfg.weight_syncer.kind,
        bytes_per_sync,
    })
}

fn state_bytes(cfg: &RunConfig) -> Result<StateBytes, OrchestratorError> {
    let specs = synthetic::layout(&cfg.actor.model).map_err(|e| invalid(e.to_string()))?;
    let elem = dtype_of(cfg.actor.model.precision).size_bytes() as u64;
    let mut bytes = StateBytes { tensors: specs.len() as u64, ..StateBytes::default() };
    for spec in &specs {
        let n = spec.numel() * elem;
        bytes.total += n;
        match spec.role {
            Role::Frozen => bytes.frozen += n,
            Role::Trainable | Role::Buffer => bytes.synced += n,
        }
    }
    Ok(bytes)
}

fn mb(bytes: u64) -> String {
    format!("{:.2} MB", bytes as f64 / 1e6)
}

impl fmt::Display for RunPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "process plan ({:?} loop, {} steps):", self.entry, self.steps)?;
        writeln!(f, "  orchestrator  pid {} (this process), control over Unix sockets", std::process::id())?;
        writeln!(f, "  trainer-0     rlsync worker --role trainer --rank 0")?;
        for rank in 0..self.rollouts {
            writeln!(f, "  rollout-{rank:<5} rlsync worker --role rollout --rank {rank} ({} envs)", self.envs_per_rollout)?;
        }
        writeln!(f, "  weights       trainer-0 -> {} rollouts over shared memory (written once)", self.rollouts)?;
        writeln!(
            f,
            "  per step      {} chunks of {} steps per rollout, {} env steps trained",
            self.chunks_per_rollout, self.chunk_steps, self.env_steps_per_step
        )?;
        writeln!(
            f,
            "  state         {} tensors, {} total: {} synced, {} frozen",
            self.state.tensors,
            mb(self.state.total),
            mb(self.state.synced),
            mb(self.state.frozen)
        )?;
        let how = match self.syncer {
            SyncerKind::Bucket => "bucket, every synced byte",
            SyncerKind::Patch => "patch, upper bound: all elements changed; typically far less",
        };
        writeln!(f, "  per sync      <= {} ({how})", mb(self.bytes_per_sync))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check_slots(text: &str, expect: Result<u32, ()>) {
        let got = placement_slots(&Placement::Ranges(text.into())).map_err(|_| ());
        assert_eq!(got, expect, "placement '{text}'");
    }

    #[test]
    fn placements_count_slots() {
        check_slots("0-3", Ok(4));
        check_slots("0,2,4", Ok(3));
        check_slots("0-1, 4", Ok(3));
        check_slots("7", Ok(1));
        check_slots("3-1", Err(()));
        check_slots("0-", Err(()));
        check_slots("all", Err(()));
        assert_eq!(placement_slots(&Placement::Single(5)).unwrap(), 1);
    }

    #[test]
    fn default_plan_splits_envs_and_counts_bytes() {
        let cfg = RunConfig::default();
        let p = plan(Entry::Embodied, &cfg).unwrap();
        assert_eq!((p.rollouts, p.envs_per_rollout, p.steps), (2, 4, 10));
        assert_eq!((p.chunk_steps, p.chunks_per_rollout), (16, 2));
        assert_eq!(p.env_steps_per_step, 2 * 2 * 16 * 4);
        assert_eq!(p.state.synced + p.state.frozen, p.state.total);
        assert!(p.bytes_per_sync >= p.state.synced);
        assert!(p.to_string().contains("rollout-1"));
    }

    #[test]
    fn impossible_configs_are_named() {
        let mut cfg = RunConfig::default();
        cfg.env.train.total_num_envs = std::num::NonZeroU32::new(3).unwrap();
        assert!(plan(Entry::Embodied, &cfg).unwrap_err().to_string().contains("total_num_envs=3"));
        let mut cfg = RunConfig::default();
        cfg.runner.weight_sync_interval = std::num::NonZeroU32::new(3).unwrap();
        cfg.algorithm.staleness_threshold = 1;
        assert!(plan(Entry::Async, &cfg).unwrap_err().to_string().contains("staleness_threshold=1"));
        assert!(plan(Entry::Embodied, &cfg).is_ok());
        let mut cfg = RunConfig::default();
        cfg.cluster.component_placement.shift_remove("rollout");
        assert!(plan(Entry::Embodied, &cfg).unwrap_err().to_string().contains("no 'rollout' entry"));
    }
}
