//! rlsync: the launcher of embodied-RL runs — Hydra-compatible configuration, process orchestration, and
//! weight synchronisation driven end to end from one trainer to N rollout workers.
//!
//! The app on top of two libraries: `hydra_compose` (the Hydra/OmegaConf engine) and `rlsync_core` (tensors,
//! syncers, transports, the control protocol). The learner on libtorch is the `rlsync-learner` crate, which
//! builds on this one; so does the Python binding.
//!
//! # Layout
//! - [`cli`]: entry points (`train_embodied`, `train_async`, `bench_sync`, hidden `worker`) and Hydra's flags.
//! - [`config`]: the typed, validated run configuration read from the composed tree; placement over nodes.
//! - [`orchestrator`]: supervisor, the synchronous and asynchronous training loops, metrics, node agents.
//! - [`cluster`]: which node this process is, from the scheduler's environment.
//! - [`worker`]: the trainer and rollout worker processes and the `Workload` trait (synthetic workload).
//! - [`protocol`]: the app's formats on top of the core's protocol: launch file, node link.
//! - [`checkpoint`]: a checkpoint directory's layout, metadata and weights (no libtorch needed).
//! - [`learner_exe`]: which executable runs a run's built-in workers (this one, or `rlsync-learner`).
//! - [`logging`]: console logging set-up (tracing) for the orchestrator and the workers.
//! - [`dry_run`]: the `--dry-run` report (process plan, sync volume, pre-flight checks).
//! - [`plot`]: `rlsync plot`, learning curves from runs' `metrics.jsonl` as PNG.
//! - [`bench`](mod@bench): `rlsync bench_sync`, the weight-sync benchmark entry point.

pub mod bench;
pub mod checkpoint;
pub mod cli;
pub mod cluster;
pub mod config;
pub mod dry_run;
pub mod learner_exe;
pub mod logging;
pub mod orchestrator;
pub mod plot;
pub mod protocol;
pub mod worker;
