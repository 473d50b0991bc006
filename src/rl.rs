//! The real learner on libtorch (policies, PPO, GRPO, TorchScript); a dummy without the `torch` feature.
