//! rlsync: Hydra-compatible configuration, process orchestration and weight synchronisation for embodied RL.
//!
//! # Layout
//! - [`cli`]: entry points (`train_embodied`, `train_async`, `bench_sync`, hidden `worker`) and Hydra's flags.
//! - [`config`]: the Hydra 1.3 compatible engine (YAML, defaults lists, overrides, interpolation) and the
//!   typed, validated run configuration. Knows nothing of processes or tensors.
//! - [`tensor`]: named CPU tensors with dtype, shape and role (trainable | buffer | frozen); checksums.
//! - [`syncer`]: the `WeightSyncer` (patch | bucket) on top of a [`transport`] channel; never imports tch.
//! - [`transport`]: byte channels from one sender to N receivers (in-process, shared memory + Unix sockets).
//! - [`protocol`]: the control protocol shared by orchestrator and workers (framing, messages, launch file,
//!   trajectory codec); documented for other implementations in `docs/protocol.md`.
//! - [`bytes`]: the one little-endian byte reader and varint of the crate.
//! - [`orchestrator`]: supervisor, the synchronous and asynchronous training loops, metrics.
//! - [`cluster`]: multi-node runs: node rank / count / rendezvous from the scheduler's environment, placement
//!   of workers over nodes (RLinf's `cluster.component_placement`).
//! - [`worker`]: the trainer and rollout worker processes and the `Workload` trait (synthetic workload).
//! - [`env`]: built-in vectorised embodied tasks (reach, cartpole).
//! - [`rl`]: the real learner (policies, PPO, GRPO) on libtorch; a dummy without the `torch` feature.
//! - [`logging`]: console logging set-up (tracing) for the orchestrator and the workers.
//! - [`dry_run`]: the `--dry-run` report (process plan, sync volume, pre-flight checks).
//! - [`plot`]: `rlsync plot`, learning curves from runs' `metrics.jsonl` as PNG.
//! - [`bench`]: `rlsync bench_sync`, the weight-sync benchmark entry point.
//! - [`stdio`]: stdout/stderr writes that end quietly on a closed pipe instead of panicking.

pub mod bench;
pub mod bytes;
pub mod cli;
pub mod cluster;
pub mod config;
pub mod dry_run;
pub mod env;
pub mod logging;
pub mod orchestrator;
pub mod plot;
pub mod protocol;
pub mod rl;
pub mod stdio;
pub mod syncer;
pub mod tensor;
pub mod transport;
pub mod worker;
