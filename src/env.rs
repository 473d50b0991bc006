//! Built-in vectorised embodied tasks (reach, cartpole), deterministic under a seed.
