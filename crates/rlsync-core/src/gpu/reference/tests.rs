//! The reference kernels against the CPU path: diff_compact → collect → encode gives the bytes of
//! patch::build → encode; scatter_plan → scatter == install; apply_compact reproduces the sender.

use std::num::NonZeroUsize;

use proptest::strategy::Strategy as _;

use super::rng::Rng;
use super::*;
use crate::gpu::compact::{self, Layout};
use crate::syncer::patch::{self, Built, SnapTensor};
use crate::syncer::wire::{Codec, KeyMeta, PatchBody, encode_patch_body};
use crate::tensor::{Class, DType, StateDict, Storage, Tensor};

const THREADS: NonZeroUsize = NonZeroUsize::new(2).unwrap();

/// One synced tensor's bytes before and after a training step.
struct Pair {
    dtype: DType,
    shape: Vec<usize>,
    old: Vec<u8>,
    new: Vec<u8>,
}

/// A NaN of the element width with a random payload (sign random too), or `None` for integer dtypes.
fn nan_bits(dtype: DType, r: &mut Rng) -> Option<u64> {
    let (exp, man) = match dtype {
        DType::Bf16 => (0x7f80u64, 0x7fu64),
        DType::F32 => (0x7f80_0000, 0x7f_ffff),
        DType::F64 => (0x7ff0_0000_0000_0000, 0xf_ffff_ffff_ffff),
        _ => return None,
    };
    let sign = (exp << 1) & !exp & !man; // the bit above the exponent
    let payload = (r.next() & man).max(1);
    Some(exp | payload | if r.next().is_multiple_of(2) { sign } else { 0 })
}

/// A tensor of `numel` elements changed at `density` per mille (a random bit, or a NaN of a new payload;
/// a tenth of the NaNs stay the same NaN: unchanged).
fn pair(dtype: DType, numel: usize, density: u64, r: &mut Rng) -> Pair {
    let w = dtype.size_bytes();
    let mut old: Vec<u8> = (0..numel * w).map(|_| r.next() as u8).collect();
    let mut new = old.clone();
    for i in 0..numel {
        let roll = r.next() % 1000;
        if roll >= density {
            continue;
        }
        let e = i * w..(i + 1) * w;
        match nan_bits(dtype, r) {
            Some(a) if roll.is_multiple_of(3) => {
                let b = if r.next().is_multiple_of(10) {
                    a
                } else {
                    nan_bits(dtype, r).unwrap_or(a)
                };
                old[e.clone()].copy_from_slice(&a.to_le_bytes()[..w]);
                new[e].copy_from_slice(&b.to_le_bytes()[..w]);
            }
            _ => {
                let bit = r.next() as usize % (8 * w);
                new[i * w + bit / 8] ^= 1 << (bit % 8);
            }
        }
    }
    let shape = if numel > 0 && numel.is_multiple_of(64) {
        vec![numel / 64, 64]
    } else {
        vec![numel]
    };
    Pair {
        dtype,
        shape,
        old,
        new,
    }
}

fn state_of(pairs: &[Pair], new: bool) -> StateDict {
    let mut sd = StateDict::new();
    for (i, p) in pairs.iter().enumerate() {
        let bytes = if new { &p.new } else { &p.old };
        sd.insert(
            format!("t{i}"),
            Tensor::from_bytes(p.dtype, &p.shape, Class::Trainable, bytes).unwrap(),
        );
    }
    sd
}

fn snapshot_of(pairs: &[Pair]) -> Vec<SnapTensor> {
    let sd = state_of(pairs, false);
    sd.iter()
        .enumerate()
        .map(|(i, (k, t))| {
            let mut storage = Storage::zeroed(t.bytes().len());
            storage.bytes_mut().copy_from_slice(t.bytes());
            SnapTensor {
                key: k.into(),
                ordinal: i as u32,
                dtype: t.dtype(),
                cols: t.layout().coo_view().unwrap().1,
                storage,
            }
        })
        .collect()
}

fn wire(body: &PatchBody) -> Vec<u8> {
    encode_patch_body(body, Codec::Plain).body
}

/// One width's launch output: the width, the directory, the pool's indices and values.
type Output = (usize, Vec<TileDir>, Vec<u32>, Vec<u64>);

/// The GPU path on the reference: what the sender ends with.
struct GpuBuild {
    built: Built,
    /// The host snapshot, refreshed from the device for the segments collect said need it.
    host: Vec<SnapTensor>,
    mem: Memory,
    snap: Vec<u64>,
    layout: Layout,
    /// Per width: the directory and the pool.
    out: Vec<Output>,
    forced: Vec<usize>,
}

/// Run diff_compact (per width, the pool holding `capacity(changes)` entries) and collect.
fn gpu_build(pairs: &[Pair], capacity: impl Fn(usize) -> usize, seed: u64) -> GpuBuild {
    let mut host = snapshot_of(pairs);
    let layout = Layout::from_snapshot(&host).unwrap();
    let mut mem = Memory::default();
    let state: Vec<u64> = pairs.iter().map(|p| mem.alloc(&p.new)).collect();
    let snap: Vec<u64> = pairs.iter().map(|p| mem.alloc(&p.old)).collect();
    let mut built = Built::default();
    layout.prepare(&mut built);
    let mut out = Vec::new();
    let mut forced = Vec::new();
    let mut needs = Vec::new();
    let mut listed = 0u64;
    for width in layout.widths() {
        let jobs = layout.diff_jobs(width, |p| (state[p], snap[p]));
        let ntiles = layout.ntiles(width);
        let changes: usize = layout
            .tensors_of(width)
            .map(|t| {
                let p = &pairs[t.pos];
                p.old
                    .chunks(width)
                    .zip(p.new.chunks(width))
                    .filter(|(a, b)| a != b)
                    .count()
            })
            .sum();
        let cap = capacity(changes);
        let per = if width == 8 { 2 } else { 1 };
        let (mut idx, mut vals) = (vec![0u32; cap], vec![0u64; cap * per]);
        let mut dir = vec![TileDir::default(); ntiles as usize];
        let mut cursor = 0u64;
        let pool = Pool {
            idx: &mut idx,
            vals: &mut vals,
            capacity: cap as u64,
            cursor: &mut cursor,
        };
        diff_compact(
            &mut mem,
            width,
            &jobs,
            ntiles,
            pool,
            &mut dir,
            seed ^ width as u64,
        )
        .unwrap();
        assert_eq!(cursor, changes as u64, "the cursor counts every change");
        let r = compact::collect(&layout, width, &dir, &idx, &vals, &mut built, THREADS).unwrap();
        assert_eq!(r.changes, changes as u64);
        listed += r.listed;
        forced.extend(r.forced);
        needs.extend(r.needs_snapshot);
        out.push((width, dir, idx, vals));
    }
    forced.sort_unstable();
    needs.sort_unstable();
    assert!(forced.iter().all(|f| needs.binary_search(f).is_ok()));
    assert_eq!(
        listed
            + built
                .segments()
                .iter()
                .filter(|c| c.forced_dense())
                .map(|c| c.len() as u64)
                .sum::<u64>(),
        built.changed
    );
    // The caller's refresh: only the segments that may go dense get their new bytes on the host.
    for &s in &needs {
        let c = &built.segments()[s];
        let w = host[c.tensor].dtype.size_bytes();
        let dev = &mem.buffer(snap[c.tensor]).unwrap()[c.base * w..(c.base + c.span) * w];
        host[c.tensor].storage.bytes_mut()[c.base * w..(c.base + c.span) * w].copy_from_slice(dev);
    }
    GpuBuild {
        built,
        host,
        mem,
        snap,
        layout,
        out,
        forced,
    }
}

/// Every check of the three kernels on one set of tensors.
fn check_all(pairs: &[Pair], capacity: impl Fn(usize) -> usize, seed: u64) {
    let sender = state_of(pairs, true);
    let mut cpu_snap = snapshot_of(pairs);
    let mut cpu = Built::default();
    patch::build(&mut cpu_snap, &sender, THREADS, &mut cpu).unwrap();
    let g = gpu_build(pairs, capacity, seed);
    // The device snapshot took the state.
    for (p, &a) in pairs.iter().zip(&g.snap) {
        assert_eq!(
            g.mem.buffer(a).unwrap(),
            p.new.as_slice(),
            "device snapshot == state"
        );
    }
    // The CPU path with the same segments forced dense codes exactly the same bytes.
    for &s in &g.forced {
        let c = &mut cpu.segments_mut()[s];
        let n = c.len();
        c.force_dense(n);
    }
    assert_eq!(g.built.changed, cpu.changed);
    for delta in [true, false] {
        let want = patch::encode(&cpu, &cpu_snap, delta, THREADS);
        let got = patch::encode(&g.built, &g.host, delta, THREADS);
        assert_eq!(
            wire(&got),
            wire(&want),
            "delta={delta} forced={:?}",
            g.forced
        );
        // (b) The scatter plan installs what install installs, on a receiver holding the old state.
        check_scatter(pairs, got);
    }
    // (c) apply_compact from the diff's output reproduces the sender (overflowing tiles from its snapshot).
    let mut mem = g.mem.clone();
    let recv: Vec<u64> = pairs.iter().map(|p| mem.alloc(&p.old)).collect();
    for (width, dir, idx, vals) in &g.out {
        let jobs = g.layout.apply_jobs(*width, |p| (recv[p], g.snap[p]));
        apply_compact(
            &mut mem,
            *width,
            &jobs,
            g.layout.ntiles(*width),
            dir,
            idx,
            vals,
        )
        .unwrap();
    }
    for (p, &a) in pairs.iter().zip(&recv) {
        assert_eq!(
            mem.buffer(a).unwrap(),
            p.new.as_slice(),
            "apply_compact == sender"
        );
    }
}

/// scatter_plan + reference scatter + dense copies == patch::install, on the same validated patch.
fn check_scatter(pairs: &[Pair], body: PatchBody) {
    let mut receiver = state_of(pairs, false);
    let meta: Vec<KeyMeta> = receiver
        .iter()
        .map(|(k, t)| KeyMeta {
            name: k.into(),
            dtype: t.dtype(),
            shape: t.shape().to_vec(),
        })
        .collect();
    let v = patch::validate(body, &meta, &vec![true; pairs.len()], &receiver, THREADS).unwrap();
    let plan = patch::scatter_plan(&v, THREADS);
    let mut mem = Memory::default();
    let dst: Vec<u64> = pairs.iter().map(|p| mem.alloc(&p.old)).collect();
    for (width, lists) in WIDTHS.iter().zip(&plan.widths) {
        let jobs = compact::scatter_jobs(&lists.entries, |o| dst[o]);
        scatter(
            &mut mem,
            *width,
            &jobs,
            lists.idx.len() as u64,
            &lists.idx,
            &lists.vals,
        )
        .unwrap();
    }
    for d in &plan.dense {
        let bytes = &v.dense_stream()[d.bytes.clone()];
        let at = dst[d.ordinal] + (d.base * d.width) as u64;
        mem.write(at, bytes.len() as u64)
            .unwrap()
            .copy_from_slice(bytes);
    }
    patch::install(&v, &mut receiver, THREADS);
    for ((_, t), &a) in receiver.iter().zip(&dst) {
        assert_eq!(mem.buffer(a).unwrap(), t.bytes(), "scatter == install");
    }
    for (p, (_, t)) in pairs.iter().zip(receiver.iter()) {
        assert_eq!(t.bytes(), p.new.as_slice(), "install == sender");
    }
}

const DTYPES: [DType; 5] = [DType::U8, DType::Bf16, DType::F32, DType::F64, DType::I64];

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: 48, ..Default::default() })]

    /// Widths 1/2/4/8 mixed in one state, tails and sub-tile and empty tensors, densities from none to
    /// all, NaN payloads, pools that hold everything or overflow.
    #[test]
    fn reference_kernels_match_the_cpu_path(
        tensors in proptest::collection::vec(
            (
                proptest::sample::select(DTYPES.to_vec()),
                proptest::prop_oneof![
                    proptest::sample::select(vec![0usize, 1, 15, 16, 17, 4095, 4096, 4097, 8192 + 64]),
                    0usize..20_000,
                ],
                proptest::prop_oneof![
                    proptest::strategy::Just(0u64),
                    proptest::strategy::Just(1000u64),
                    0u64..40,
                    0u64..1000,
                ],
            ),
            1..5,
        ),
        pool in proptest::prop_oneof![
            proptest::strategy::Just(None),
            (0u64..100).prop_map(Some),
        ],
        seed in proptest::prelude::any::<u64>(),
    ) {
        let mut r = Rng(seed | 1);
        let pairs: Vec<Pair> = tensors.iter().map(|&(d, n, dens)| pair(d, n, dens, &mut r)).collect();
        // Some(p): the pool holds p % of the changes (overflow unless nothing changed).
        check_all(&pairs, |changes| pool.map_or(changes, |p| changes * p as usize / 100), seed);
    }
}

/// Several segments per tensor (SEGMENT = 4 Mi elements): segment-relative indices, a tensor whose last
/// segment is a few elements, overflow in one width only.
#[test]
fn reference_kernels_match_the_cpu_path_across_segments() {
    let mut r = Rng(0x5eed);
    let pairs = vec![
        pair(DType::U8, SEGMENT * 2 + 3, 5, &mut r),
        pair(DType::Bf16, SEGMENT + 4097, 20, &mut r),
        pair(DType::F32, 100, 500, &mut r),
    ];
    check_all(&pairs, |c| c, 1);
    // Half the pool: some tiles overflow, their segments go dense.
    check_all(&pairs, |c| c / 2, 2);
}

#[test]
fn overflow_forces_exactly_the_segments_of_overflowing_tiles() {
    let mut r = Rng(7);
    let pairs = vec![pair(DType::Bf16, SEGMENT + 10, 1000, &mut r)];
    // A pool of one entry: the first tile to reserve fits only if it has one change; every other overflows.
    let g = gpu_build(&pairs, |_| 1, 3);
    assert_eq!(g.forced, vec![0, 1], "both segments hold overflowing tiles");
    assert!(g.built.segments().iter().all(|c| c.forced_dense()));
    let (_, dir, _, _) = &g.out[0];
    assert!(
        dir.iter()
            .filter(|d| d.count > 0)
            .all(|d| d.flags == OVERFLOW || d.count == 1)
    );
}

#[test]
fn a_freed_buffer_is_gone_and_its_address_never_returns() {
    let mut mem = Memory::default();
    let a = mem.alloc(&[1u8; 32]);
    let b = mem.alloc(&[2u8; 32]);
    mem.free(a + 8); // not a buffer's start: nothing happens
    assert_eq!(mem.read(a, 32).unwrap(), &[1u8; 32]);
    mem.free(a);
    assert!(mem.read(a, 1).is_err() && mem.write(a, 1).is_err());
    assert_eq!(
        mem.read(b, 32).unwrap(),
        &[2u8; 32],
        "the other buffer stays"
    );
    let c = mem.alloc(&[3u8; 8]);
    assert!(c != a && c != b);
}

#[test]
fn reference_refuses_bad_tables_without_panicking() {
    let mut mem = Memory::default();
    let a = mem.alloc(&[0u8; 64]);
    let jobs = [DiffJob {
        state: a,
        snap: a + 8,
        numel: 64,
        first_tile: 0,
    }];
    let (mut idx, mut vals, mut cursor) = ([0u32; 4], [0u64; 4], 0u64);
    let mut dir = [TileDir::default(); 1];
    let pool = Pool {
        idx: &mut idx,
        vals: &mut vals,
        capacity: 4,
        cursor: &mut cursor,
    };
    assert_eq!(
        diff_compact(&mut mem, 1, &jobs, 1, pool, &mut dir, 0),
        Err(ReferenceError::Address {
            addr: a + 8 + 56,
            len: 1
        })
    );
    assert_eq!(
        scatter(&mut mem, 3, &[], 0, &[], &[]),
        Err(ReferenceError::Width { width: 3 })
    );
    let sj = [ScatterJob {
        dst: a,
        first: 0,
        count: 2,
        mode: 0,
    }];
    assert_eq!(
        scatter(&mut mem, 1, &sj, 2, &[0], &[1]),
        Err(ReferenceError::Pool { entry: 1 })
    );
    assert!(mem.buffer(a + 1).is_none());
}

// -- checksum_compact (s14/ipcsum) --

/// checksum_compact over one width's output of a build (`full`: over the snapshot copies), in `mem`.
fn pool_sum(b: &GpuBuild, mem: &Memory, o: &Output, seed: u64, full: bool) -> PoolSum {
    let (width, dir, idx, vals) = o;
    let jobs = b.layout.apply_jobs(*width, |p| (0, b.snap[p]));
    let ntiles = b.layout.ntiles(*width);
    let cap = idx.len() as u64;
    checksum_compact(mem, *width, &jobs, ntiles, dir, idx, vals, cap, seed, full).unwrap()
}

/// Where element `i` of the tile `tile` of one width lives: (snapshot address, element index), if the tile
/// holds an element at offset `k`.
fn tile_element(b: &GpuBuild, width: usize, tile: u64, k: u64) -> Option<(u64, u64)> {
    let t = b
        .layout
        .tensors_of(width)
        .filter(|t| t.first_tile <= tile)
        .last()?;
    let i = (tile - t.first_tile) * TILE as u64 + k;
    (i < t.numel).then_some((b.snap[t.pos], i))
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: 32, ..Default::default() })]

    /// The sum does not depend on the order the tiles took their places in the pool; it counts every
    /// change; any flipped bit of a used index or value entry, of an overflowing tile's snapshot bytes (or
    /// of any snapshot byte in full mode) changes it; another seed (a stale pool) changes it.
    #[test]
    fn the_pool_checksum_ignores_the_pool_order_and_catches_flips_and_stale_pools(
        tensors in proptest::collection::vec(
            (
                proptest::sample::select(DTYPES.to_vec()),
                proptest::prop_oneof![
                    proptest::sample::select(vec![1usize, 17, 4096, 4097, 8192 + 64]),
                    1usize..12_000,
                ],
                proptest::prop_oneof![proptest::strategy::Just(1000u64), 1u64..400],
            ),
            1..4,
        ),
        overflow in proptest::prelude::any::<bool>(),
        seed in proptest::prelude::any::<u64>(),
        pick in proptest::prelude::any::<u64>(),
    ) {
        let mut r = Rng(seed | 1);
        let pairs: Vec<Pair> = tensors.iter().map(|&(d, n, dens)| pair(d, n, dens, &mut r)).collect();
        let cap = |changes: usize| if overflow { changes / 2 } else { changes };
        let a = gpu_build(&pairs, cap, seed);
        let other = (!overflow).then(|| gpu_build(&pairs, cap, seed ^ 0x9e37_79b9_7f4a_7c15));
        let sseq = pick | 1;
        for (k, o) in a.out.iter().enumerate() {
            let (width, dir, ..) = o;
            let s = pool_sum(&a, &a.mem, o, sseq, false);
            let changes: u64 = dir.iter().map(|d| u64::from(d.count)).sum();
            proptest::prop_assert_eq!(s.count, changes);
            if let Some(b) = &other {
                // Another reservation order, the same changes: the same sum.
                proptest::prop_assert_eq!(pool_sum(b, &b.mem, &b.out[k], sseq, false), s);
            }
            if changes > 0 {
                proptest::prop_assert_ne!(pool_sum(&a, &a.mem, o, sseq + 1, false).sum, s.sum, "stale seed");
            }
            // A used entry (listed by a tile that did not overflow).
            let used: Vec<u64> = dir
                .iter()
                .filter(|d| d.flags & OVERFLOW == 0)
                .flat_map(|d| d.offset..d.offset + u64::from(d.count))
                .collect();
            if !used.is_empty() {
                let e = used[(pick % used.len() as u64) as usize] as usize;
                let mut bad = o.clone();
                bad.2[e] ^= 1 << ((pick >> 8) % 32);
                proptest::prop_assert_ne!(pool_sum(&a, &a.mem, &bad, sseq, false).sum, s.sum, "idx flip");
                let per = if *width == 8 { 2 } else { 1 };
                let mut bad = o.clone();
                bad.3[e * per + (pick >> 16) as usize % per] ^= 1 << ((pick >> 24) % 64);
                proptest::prop_assert_ne!(pool_sum(&a, &a.mem, &bad, sseq, false).sum, s.sum, "vals flip");
            }
            // A byte of the snapshot inside an overflowing tile.
            let over: Vec<u64> = (0..dir.len() as u64)
                .filter(|&t| dir[t as usize].flags & OVERFLOW != 0)
                .collect();
            if !over.is_empty() {
                let tile = over[(pick % over.len() as u64) as usize];
                let k = (pick >> 12) % TILE as u64;
                let at = tile_element(&a, *width, tile, k).or_else(|| tile_element(&a, *width, tile, 0));
                let (addr, i) = at.unwrap();
                let mut mem = a.mem.clone();
                let byte = (pick >> 40) % *width as u64;
                mem.write(addr + i * *width as u64 + byte, 1).unwrap()[0] ^= 1 << ((pick >> 48) % 8);
                proptest::prop_assert_ne!(pool_sum(&a, &mem, o, sseq, false).sum, s.sum, "snapshot flip");
            }
            // Full mode: every element counted; any snapshot byte flipped changes the sum.
            let f = pool_sum(&a, &a.mem, o, sseq, true);
            let elements: u64 = a.layout.tensors_of(*width).map(|t| t.numel).sum();
            proptest::prop_assert_eq!(f.count, elements);
            let tile = pick % a.layout.ntiles(*width);
            if let Some((addr, i)) = tile_element(&a, *width, tile, 0) {
                let mut mem = a.mem.clone();
                mem.write(addr + i * *width as u64, 1).unwrap()[0] ^= 1 << ((pick >> 56) % 8);
                proptest::prop_assert_ne!(pool_sum(&a, &mem, o, sseq, true).sum, f.sum, "full flip");
            }
        }
    }
}

/// The kernel's mix is splitmix64's finalizer (the constants the CUDA source names).
#[test]
fn the_checksum_mix_is_splitmix64s_finalizer() {
    assert_eq!(mix64(0), 0);
    // splitmix64's first output for state 0 is mix64(0x9e3779b97f4a7c15).
    assert_eq!(mix64(0x9e37_79b9_7f4a_7c15), 0xe220_a839_7b1d_cdaf);
    let jobs: [ApplyJob; 0] = [];
    let none = checksum_compact(&Memory::default(), 3, &jobs, 0, &[], &[], &[], 0, 1, false);
    assert_eq!(none, Err(ReferenceError::Width { width: 3 }));
}

/// A fixed case whose sums scripts/kernel_check.cpp's host model gives too (checked once by compiling its
/// `host_checksum` on the host): the reference, the host model and so the kernel agree on the bits.
#[test]
fn the_checksum_of_a_fixed_case_is_the_host_models() {
    let mut mem = Memory::default();
    let bytes: Vec<u8> = (0..5000u64)
        .flat_map(|i| ((i * 7) as u16).to_le_bytes())
        .collect();
    let snap = mem.alloc(&bytes);
    let jobs = [ApplyJob {
        dst: 0,
        dense_src: snap,
        numel: 5000,
        first_tile: 0,
    }];
    let dir = [
        TileDir {
            offset: 0,
            count: 2,
            flags: 0,
        },
        TileDir {
            offset: 0,
            count: 3,
            flags: OVERFLOW,
        },
    ];
    let (idx, vals) = ([5u32, 9], [1u64 | 2 << 32, 3 | 4 << 32]);
    let sum = |full| checksum_compact(&mem, 2, &jobs, 2, &dir, &idx, &vals, 2, 9, full).unwrap();
    assert_eq!(
        sum(false),
        PoolSum {
            sum: 16_238_565_130_935_273_433,
            count: 5
        }
    );
    assert_eq!(
        sum(true),
        PoolSum {
            sum: 690_631_777_124_157_587,
            count: 5000
        }
    );
}

// -- checksum_compact (end) --
