//! Orchestrator benches over real worker processes: control-plane cost per step with a no-op workload, and
//! env-step throughput of train_embodied vs train_async with emulated compute.
//!
//! Each criterion iteration is one train step of a real run (`iter_custom` runs `iters` steps and returns the
//! loop's wall time, excluding process start and the init bootstrap).
//! Run: `cargo bench --bench orchestrator` (needs the release binary: `cargo build --release` first).

use std::num::NonZeroU32;
use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use rlsync::config::schema::{Placement, RunConfig};
use rlsync::orchestrator::{self, Entry, RunOptions, ShutdownHandle, ShutdownSource};

fn nz(n: u32) -> NonZeroU32 {
    NonZeroU32::new(n).unwrap_or(NonZeroU32::MIN)
}

/// `rollouts` workers, one env each, one chunk of `chunk` env steps per rollout per train step.
fn config(rollouts: u32, chunk: u32, rollout_ms_per_step: f64, train_ms: f64) -> RunConfig {
    let mut cfg = RunConfig::default();
    cfg.cluster.component_placement.insert(
        "rollout".into(),
        Placement::Ranges(format!("0-{}", rollouts - 1)),
    );
    cfg.env.train.total_num_envs = nz(rollouts);
    cfg.env.train.max_steps_per_rollout_epoch = nz(chunk);
    cfg.rollout.chunk_steps = nz(chunk);
    cfg.actor.model.params = 4096;
    cfg.actor.model.tensors = nz(4);
    cfg.actor.model.traj_bytes_per_step = 64;
    cfg.actor.model.rollout_ms_per_step = rollout_ms_per_step;
    cfg.actor.model.train_ms = train_ms;
    cfg.runner.logger.logger_backends.clear();
    cfg
}

/// Run `steps` train steps; the loop's wall time (process start and bootstrap excluded).
fn run_steps(entry: Entry, cfg: &RunConfig, steps: u64) -> Duration {
    let mut cfg = cfg.clone();
    cfg.runner.max_steps = steps.max(1) as i64;
    let dir = match tempfile::tempdir() {
        Ok(dir) => dir,
        Err(e) => panic!("temp dir: {e}"),
    };
    let opts = RunOptions {
        worker_exe: Some(env!("CARGO_BIN_EXE_rlsync").into()),
        learner_exe: None,
        shutdown: ShutdownSource::Manual(ShutdownHandle::new()),
        print_summary: false,
        ..RunOptions::default()
    };
    match orchestrator::run(entry, &cfg, dir.path(), opts) {
        Ok(summary) => Duration::from_secs_f64(summary.times.loop_s),
        Err(e) => panic!("bench run failed: {e}"),
    }
}

fn control_plane(c: &mut Criterion) {
    let mut group = c.benchmark_group("control_plane_noop");
    group
        .sample_size(10)
        .measurement_time(Duration::from_secs(10));
    let cfg = config(4, 1, 0.0, 0.0);
    group.bench_function("embodied_step_4_rollouts", |b| {
        b.iter_custom(|iters| run_steps(Entry::Embodied, &cfg, iters))
    });
    group.finish();
}

fn overlap(c: &mut Criterion) {
    let mut group = c.benchmark_group("emulated_compute");
    group
        .sample_size(10)
        .measurement_time(Duration::from_secs(20));
    // Rollout share (16 steps x 2 ms) and train step (32 ms) of similar size.
    let mut cfg = config(2, 16, 2.0, 32.0);
    cfg.algorithm.staleness_threshold = 1;
    cfg.actor.sync_weight_no_wait = true;
    let env_steps_per_step = 2 * 16;
    group.throughput(Throughput::Elements(env_steps_per_step));
    group.bench_function("train_embodied", |b| {
        b.iter_custom(|iters| run_steps(Entry::Embodied, &cfg, iters))
    });
    group.bench_function("train_async_staleness_1", |b| {
        b.iter_custom(|iters| run_steps(Entry::Async, &cfg, iters))
    });
    group.finish();
}

criterion_group!(benches, control_plane, overlap);
criterion_main!(benches);
