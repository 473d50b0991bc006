//! Criterion benches of the weight-sync kernels: patch build (diff + gather + snapshot update), patch encode
//! (coding + optional lz4), patch decode (validate), install and the CUDA installer's host decode (alone, and
//! with the stream check: validate then decode, or one checked walk), on a 2^24-element bf16 state after one
//! Adam step at lr 1e-6 (≈1–3 % of elements changed); the build also on an fp32 state (Adam at lr 3e-11,
//! ≈1.5 % changed). `RLSYNC_BENCH_PARAMS` sets the element count (e.g. 268435456: the 512 MiB of issue 26).
//!
//! Single-thread figures use the measuring thread's CPU time (`CLOCK_THREAD_CPUTIME_ID`), so a shared,
//! overloaded machine does not charge other processes' time to the kernel; all-thread figures use wall time.

use std::hint::black_box;
use std::num::NonZeroUsize;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use rlsync_core::syncer::patch::{self, SnapTensor};
use rlsync_core::syncer::wire::{self, Codec, KeyMeta};
use rlsync_core::tensor::synthetic::{ModelSpec, SyntheticModel, UpdateMode};
use rlsync_core::tensor::{DType, StateDict, Storage};

/// Elements of the synthetic states: `RLSYNC_BENCH_PARAMS`, else 2^24.
fn params() -> u64 {
    std::env::var("RLSYNC_BENCH_PARAMS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1 << 24)
}

fn thread_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into the timespec we own.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// Time `f` with the thread's CPU clock (1 thread) or the wall clock (all threads).
fn timed(cpu: bool, f: impl FnOnce()) -> Duration {
    if cpu {
        let t = thread_cpu();
        f();
        thread_cpu() - t
    } else {
        let t = Instant::now();
        f();
        t.elapsed()
    }
}

struct Fixture {
    before: StateDict,
    after: StateDict,
    changed: u64,
}

fn fixture(dtype: DType, lr: f64) -> Fixture {
    let mut m = SyntheticModel::new(ModelSpec {
        params: params(),
        tensors: 64,
        dtype,
        frozen_fraction: 0.0,
        seed: 1,
    })
    .unwrap();
    let mut after = m.state_dict().unwrap();
    // Warm the optimizer up so the changed fraction is the steady-state one, then take one measured step.
    for _ in 0..3 {
        m.step(
            UpdateMode::Adam { lr },
            &mut after,
            NonZeroUsize::new(2).unwrap(),
        )
        .unwrap();
    }
    let before = after.duplicate();
    let changed = m
        .step(
            UpdateMode::Adam { lr },
            &mut after,
            NonZeroUsize::new(2).unwrap(),
        )
        .unwrap();
    Fixture {
        before,
        after,
        changed,
    }
}

fn snapshot(state: &StateDict) -> Vec<SnapTensor> {
    state
        .iter()
        .enumerate()
        .map(|(i, (k, t))| SnapTensor {
            key: k.to_string(),
            ordinal: i as u32,
            dtype: t.dtype(),
            cols: t.layout().coo_view().unwrap().1,
            storage: Storage::from_bytes(t.bytes()),
        })
        .collect()
}

fn restore(snap: &mut [SnapTensor], from: &StateDict) {
    for (s, (_, t)) in snap.iter_mut().zip(from.iter()) {
        s.storage.bytes_mut().copy_from_slice(t.bytes());
    }
}

fn all_threads() -> NonZeroUsize {
    std::thread::available_parallelism().unwrap_or(NonZeroUsize::MIN)
}

fn kernels(c: &mut Criterion) {
    let fx = fixture(DType::Bf16, 1e-6);
    let state_bytes = fx.after.total_bytes() as u64;
    eprintln!(
        "fixture: {} elements, {} changed ({:.2} %)",
        params(),
        fx.changed,
        fx.changed as f64 * 100.0 / params() as f64
    );
    let mut snap = snapshot(&fx.before);
    let mut built = patch::Built::default();

    let mut g = c.benchmark_group("patch_build");
    g.throughput(Throughput::Bytes(state_bytes))
        .sample_size(10)
        .measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_millis(500));
    for (name, threads, cpu) in [
        ("1thread_cpu", NonZeroUsize::MIN, true),
        ("all_threads_wall", all_threads(), false),
    ] {
        g.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    restore(&mut snap, &fx.before);
                    total += timed(cpu, || {
                        patch::build(&mut snap, &fx.after, threads, &mut built).unwrap();
                        black_box(&built);
                    });
                }
                total
            })
        });
    }
    {
        let f32x = fixture(DType::F32, 3e-11);
        eprintln!(
            "fp32 fixture: {} changed ({:.2} %)",
            f32x.changed,
            f32x.changed as f64 * 100.0 / params() as f64
        );
        let mut snap = snapshot(&f32x.before);
        let mut built = patch::Built::default();
        g.throughput(Throughput::Bytes(f32x.after.total_bytes() as u64));
        g.bench_function("f32_1thread_cpu", |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    restore(&mut snap, &f32x.before);
                    total += timed(true, || {
                        patch::build(&mut snap, &f32x.after, NonZeroUsize::MIN, &mut built)
                            .unwrap();
                        black_box(&built);
                    });
                }
                total
            })
        });
    }
    g.finish();

    restore(&mut snap, &fx.before);
    patch::build(&mut snap, &fx.after, NonZeroUsize::MIN, &mut built).unwrap();
    let mut g = c.benchmark_group("patch_encode");
    g.throughput(Throughput::Elements(built.changed))
        .sample_size(10)
        .measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_millis(500));
    for (name, delta, codec) in [
        ("delta_none", true, Codec::Plain),
        ("delta_lz4", true, Codec::Lz4),
        ("coo_none", false, Codec::Plain),
    ] {
        let body = patch::encode(&built, &snap, delta, NonZeroUsize::MIN);
        let enc = wire::encode_patch_body(&body, codec);
        eprintln!(
            "{name}: {} bytes, {:.3} bytes per changed element",
            enc.body.len() + wire::HEADER_LEN,
            (enc.body.len() + wire::HEADER_LEN) as f64 / built.changed as f64
        );
        g.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    total += timed(true, || {
                        let body = patch::encode(&built, &snap, delta, NonZeroUsize::MIN);
                        black_box(wire::encode_patch_body(&body, codec));
                    });
                }
                total
            })
        });
    }
    g.finish();

    let meta: Vec<KeyMeta> = fx
        .before
        .iter()
        .map(|(k, t)| KeyMeta {
            name: k.to_string(),
            dtype: t.dtype(),
            shape: t.shape().to_vec(),
        })
        .collect();
    let synced = vec![true; meta.len()];
    let mut receiver = fx.before.duplicate();
    let mut g = c.benchmark_group("patch_apply");
    g.throughput(Throughput::Elements(built.changed))
        .sample_size(10)
        .measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_millis(500));
    for (name, delta) in [("delta", true), ("coo", false)] {
        let body = wire::decode_patch_body(
            &wire::encode_patch_body(
                &patch::encode(&built, &snap, delta, NonZeroUsize::MIN),
                Codec::Plain,
            )
            .body,
            usize::MAX,
        )
        .unwrap();
        g.bench_function(format!("{name}_validate_1thread_cpu"), |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let body = body.clone();
                    total += timed(true, || {
                        black_box(
                            patch::validate(body, &meta, &synced, &receiver, NonZeroUsize::MIN)
                                .unwrap(),
                        );
                    });
                }
                total
            })
        });
        let valid =
            patch::validate(body.clone(), &meta, &synced, &receiver, NonZeroUsize::MIN).unwrap();
        // A CUDA receiver's host work (gpu/installer.rs): decode into per-width lists that are then staged
        // for the device. `plan_then_stage`: into new vectors, then copied to (reused) staging buffers;
        // `decode_into_staging`: straight into the reused staging buffers (what the installer does).
        let shape = patch::ScatterShape::of(&valid).unwrap();
        let mut staging: Vec<(Vec<u32>, Vec<u64>)> = (0..4)
            .map(|s| (vec![0; shape.changes(s)], vec![0; shape.changes(s)]))
            .collect();
        g.bench_function(format!("{name}_scatter_plan_then_stage_1thread_cpu"), |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    total += timed(true, || {
                        let plan = patch::scatter_plan(&valid, NonZeroUsize::MIN);
                        for (l, (i, v)) in plan.widths.iter().zip(staging.iter_mut()) {
                            i.copy_from_slice(&l.idx);
                            v.copy_from_slice(&l.vals);
                        }
                    });
                }
                total
            })
        });
        g.bench_function(
            format!("{name}_scatter_decode_into_staging_1thread_cpu"),
            |b| {
                b.iter_custom(|iters| {
                    let mut total = Duration::ZERO;
                    for _ in 0..iters {
                        total += timed(true, || {
                            let [a, b, c, d] = &mut staging[..] else {
                                return;
                            };
                            shape.decode_into(
                                &valid,
                                [
                                    (&mut a.0, &mut a.1),
                                    (&mut b.0, &mut b.1),
                                    (&mut c.0, &mut c.1),
                                    (&mut d.0, &mut d.1),
                                ],
                                NonZeroUsize::MIN,
                            );
                        });
                    }
                    total
                })
            },
        );
        // The whole host check and decode of a CUDA install. `validate_then_decode`: validate (one walk of the
        // streams), then decode into the staging (a second); `checked_decode`: the entry table (`plan`), then
        // one walk that checks and decodes into the staging (what the installer's `check_install` does).
        g.bench_function(
            format!("{name}_scatter_validate_then_decode_1thread_cpu"),
            |b| {
                b.iter_custom(|iters| {
                    let mut total = Duration::ZERO;
                    for _ in 0..iters {
                        let body = body.clone();
                        total += timed(true, || {
                            let valid =
                                patch::validate(body, &meta, &synced, &receiver, NonZeroUsize::MIN)
                                    .unwrap();
                            let [a, b, c, d] = &mut staging[..] else {
                                return;
                            };
                            shape.decode_into(
                                &valid,
                                [
                                    (&mut a.0, &mut a.1),
                                    (&mut b.0, &mut b.1),
                                    (&mut c.0, &mut c.1),
                                    (&mut d.0, &mut d.1),
                                ],
                                NonZeroUsize::MIN,
                            );
                            black_box(valid);
                        });
                    }
                    total
                })
            },
        );
        g.bench_function(format!("{name}_scatter_checked_decode_1thread_cpu"), |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let body = body.clone();
                    total += timed(true, || {
                        let planned = patch::plan(body, &meta, &synced, &receiver).unwrap();
                        let [a, b, c, d] = &mut staging[..] else {
                            return;
                        };
                        let valid = shape
                            .decode_checked_into(
                                planned,
                                [
                                    (&mut a.0, &mut a.1),
                                    (&mut b.0, &mut b.1),
                                    (&mut c.0, &mut c.1),
                                    (&mut d.0, &mut d.1),
                                ],
                                NonZeroUsize::MIN,
                            )
                            .unwrap();
                        black_box(valid);
                    });
                }
                total
            })
        });
        for (tname, threads, cpu) in [
            ("1thread_cpu", NonZeroUsize::MIN, true),
            ("all_threads_wall", all_threads(), false),
        ] {
            g.bench_function(format!("{name}_install_{tname}"), |b| {
                b.iter_custom(|iters| {
                    let mut total = Duration::ZERO;
                    for _ in 0..iters {
                        total += timed(cpu, || patch::install(&valid, &mut receiver, threads));
                    }
                    total
                })
            });
        }
    }
    g.finish();

    // Rooflines on the same data: what the build and the install could at best reach on this machine.
    // `scan` reads the snapshot and the state once each (the diff without recording anything): the memory
    // bound of a build. `touch` increments exactly the changed elements in place (no decoding): the memory bound
    // of an install, which must read and write back every cache line holding a change.
    let mut g = c.benchmark_group("roofline");
    g.throughput(Throughput::Bytes(state_bytes))
        .sample_size(10)
        .measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_millis(500));
    g.bench_function("scan_state_and_snapshot_1thread_cpu", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                total += timed(true, || {
                    let mut acc = 0u64;
                    for ((_, t), s) in fx.after.iter().zip(&snap) {
                        for (x, y) in t
                            .bytes()
                            .chunks_exact(64)
                            .zip(s.storage.bytes().chunks_exact(64))
                        {
                            let mut v = 0u8;
                            for j in 0..64 {
                                v |= x[j] ^ y[j];
                            }
                            acc += u64::from(v);
                        }
                    }
                    black_box(acc);
                });
            }
            total
        })
    });
    let positions: Vec<Vec<usize>> = {
        let mut per = vec![Vec::new(); fx.after.len()];
        for seg in built.segments() {
            per[seg.tensor].extend(seg.idx.iter().map(|&i| seg.base + i as usize));
        }
        per
    };
    g.throughput(Throughput::Elements(built.changed));
    g.bench_function("touch_changed_elements_1thread_cpu", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                total += timed(true, || {
                    for ((_, t), pos) in receiver.iter_mut().zip(&positions) {
                        let Ok(x) = t.as_mut_slice::<half::bf16>() else {
                            continue;
                        };
                        for &i in pos {
                            x[i] = half::bf16::from_bits(x[i].to_bits().wrapping_add(1));
                        }
                    }
                    black_box(&receiver);
                });
            }
            total
        })
    });
    g.finish();

    let mut g = c.benchmark_group("memcpy");
    g.throughput(Throughput::Bytes(state_bytes))
        .sample_size(10)
        .measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_millis(500));
    let mut dst = Storage::zeroed(state_bytes as usize);
    g.bench_function("state_copy_1thread_cpu", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                total += timed(true, || {
                    let mut off = 0;
                    for (_, t) in fx.after.iter() {
                        dst.bytes_mut()[off..off + t.bytes().len()].copy_from_slice(t.bytes());
                        off += t.bytes().len();
                    }
                    black_box(&dst);
                });
            }
            total
        })
    });
    g.finish();
}

criterion_group!(benches, kernels);
criterion_main!(benches);
