//! Which executable runs a run's built-in workers: `rlsync` itself (or `$RLSYNC_WORKER`) for the synthetic
//! workload, the learner executable `rlsync-learner` (the `rlsync-learner` crate, the only one linked with
//! libtorch) for learner models.
//!
//! `make build` puts `rlsync-learner` next to `rlsync`, so only learner workers load libtorch and every other
//! command starts in milliseconds. The orchestrator and `--dry-run` call [`preflight`] before anything starts,
//! so a missing learner fails once, with what to do, rather than in every worker.

use std::path::{Path, PathBuf};

use crate::config::schema::ModelType;

/// File name of the learner executable, next to `rlsync`.
pub const LEARNER_EXE: &str = "rlsync-learner";

/// Environment variable that names the learner executable instead of the one next to `rlsync`.
pub const LEARNER_ENV: &str = "RLSYNC_LEARNER";

/// Environment variable naming the executable that runs the synthetic workload's built-in workers instead of
/// this one, as `<exe> worker --role … --rank … --run-dir …`: a wrapper script, a profiler, a test's worker
/// (the integration tests' `held_worker` example, which can hold a worker at a stage of its start-up).
pub const WORKER_ENV: &str = "RLSYNC_WORKER";

/// The executable of the synthetic workload's workers: `$RLSYNC_WORKER`, else `this` (the running rlsync).
pub fn worker_exe(this: &Path) -> PathBuf {
    match std::env::var_os(WORKER_ENV) {
        Some(path) if !path.is_empty() => PathBuf::from(path),
        _ => this.to_owned(),
    }
}

/// Why the built-in workers started from `exe` cannot use the same-host GPU channel
/// (`weight_syncer.patch.transport_device: cuda`), if they cannot: the synthetic workload in `this` rlsync and
/// the learner's in `learner` keep their weights in host memory. A worker executable of one's own
/// (`$RLSYNC_WORKER`) answers for itself when the channel opens.
pub fn gpu_channel_refusal(exe: &Path, this: &Path, learner: &Path) -> Option<String> {
    (exe == this || exe == learner).then(|| {
        "weight_syncer.patch.transport_device=cuda moves the weights between CUDA tensors, and the built-in \
         workers (actor.worker.kind=builtin) keep theirs in host memory: run Python workers with their models on \
         a GPU (worker@actor.worker=python worker@rollout.worker=python, actor.worker.device=cuda, \
         rollout.worker.device=cuda), or set weight_syncer.patch.transport_device=cpu"
            .to_owned()
    })
}

/// A learner model without a learner executable to run it.
#[derive(Debug, thiserror::Error)]
#[error(
    "model `{model}` needs the libtorch learner: there is no learner executable at {path} (set RLSYNC_LEARNER \
     to name another): build both with `make build`, or run the synthetic workload instead by adding the \
     overrides `model@actor.model=synthetic_small env@env.train=synthetic env@env.eval=synthetic`",
    path = path.display()
)]
pub struct NoLearner {
    pub model: &'static str,
    pub path: PathBuf,
}

/// Where this executable (`exe`) looks for the learner executable: `$RLSYNC_LEARNER`, else `rlsync-learner`
/// in the same directory.
pub fn learner_exe(exe: &Path) -> PathBuf {
    match std::env::var_os(LEARNER_ENV) {
        Some(path) if !path.is_empty() => PathBuf::from(path),
        _ => exe.with_file_name(LEARNER_EXE),
    }
}

/// The executable the built-in workers of `model` (`actor.model.model_type`) start from: `exe` for the
/// synthetic workload, else `learner`, which must exist.
pub fn preflight(model: ModelType, exe: &Path, learner: &Path) -> Result<PathBuf, NoLearner> {
    match model {
        ModelType::Synthetic => Ok(exe.to_owned()),
        _ if learner.is_file() => Ok(learner.to_owned()),
        model => Err(NoLearner {
            model: model.name(),
            path: learner.to_owned(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn synthetic_runs_here_and_learner_models_need_the_learner() {
        let dir = tempfile::tempdir().unwrap();
        let exe = dir.path().join("rlsync");
        let learner = dir.path().join(LEARNER_EXE);
        assert_eq!(
            preflight(ModelType::Synthetic, &exe, &learner).unwrap(),
            exe
        );
        let err = preflight(ModelType::MlpPolicy, &exe, &learner).unwrap_err();
        assert_eq!(err.path, learner);
        assert!(
            err.to_string()
                .contains("model `mlp_policy` needs the libtorch learner"),
            "{err}"
        );
        std::fs::write(&learner, b"").unwrap();
        assert_eq!(
            preflight(ModelType::VlaTiny, &exe, &learner).unwrap(),
            learner
        );
    }
}
