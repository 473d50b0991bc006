//! Composition speed: an RLinf config with `--cfg job`, end to end through the binary (process start included),
//! against the goal of ≤ 10 ms (Hydra: ~240 ms on this machine class).
//!
//! `cargo bench --bench compose`. Needs `../shared/conformance/data/rlinf/config` (the kit's copy of RLinf's tree);
//! set `RLSYNC_RLINF_CONFIG` to point elsewhere.

use std::path::PathBuf;
use std::process::{Command, Stdio};

use criterion::{Criterion, criterion_group, criterion_main};

fn rlinf_config_dir() -> PathBuf {
    std::env::var_os("RLSYNC_RLINF_CONFIG")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../shared/conformance/data/rlinf/config")
        })
}

fn compose(c: &mut Criterion) {
    let bin = env!("CARGO_BIN_EXE_rlsync");
    let dir = rlinf_config_dir();
    if !dir.is_dir() {
        eprintln!(
            "skipping: no RLinf config tree at {} (set RLSYNC_RLINF_CONFIG)",
            dir.display()
        );
        return;
    }
    let run = |extra: &[&str]| {
        let status = Command::new(bin)
            .args(["train_embodied", "-cp"])
            .arg(&dir)
            .args(["-cn", "maniskill_ppo_openvlaoft", "--cfg", "job"])
            .args(extra)
            .env("EMBODIED_PATH", "/nonexistent/embodied")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("run rlsync");
        assert!(status.success(), "composition failed");
    };
    let mut group = c.benchmark_group("compose_rlinf_process");
    group.bench_function("cfg_job", |b| b.iter(|| run(&[])));
    group.bench_function("cfg_job_resolve", |b| b.iter(|| run(&["--resolve"])));
    group.finish();
}

criterion_group!(benches, compose);
criterion_main!(benches);
