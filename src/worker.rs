//! Worker processes (trainer, rollout) and the `Workload` trait they run; the synthetic workload.
