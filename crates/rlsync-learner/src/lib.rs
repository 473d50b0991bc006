//! rlsync-learner: the real learner on libtorch, the only crate of rlsync linked with tch.
//!
//! - [`rl`]: policies (MLP, VLA-style frozen backbone + adapters, TorchScript), PPO and GRPO, checkpoints with
//!   the optimizer's state.
//! - [`env`](mod@env): built-in vectorised embodied tasks (reach, cartpole), deterministic under a seed.
//! - [`workload`]: the learner as the app's `Workload` on the trainer and the rollouts, and the builder the
//!   `rlsync-learner` executable hands to the app's worker runtime.
//! - `trajectory_codec`: rollout chunks as they cross processes.
//!
//! The `rlsync-learner` executable (`src/bin/`) is the app's `worker` subcommand with this builder: the
//! supervisor of `rlsync train_embodied` starts learner workers from it, so only they load libtorch.

pub mod env;
pub mod rl;
mod trajectory_codec;
pub mod workload;
