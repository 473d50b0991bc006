//! A casting build on the reference kernels: `cast_gather` by the [`CastPlan`]'s table into the scratch,
//! `diff_compact` over the plan's addresses, `collect` — the same patch bytes as the host build, which casts
//! with `cast_bytes` (fp32 / f16 / f64 states against bf16 / f32 snapshots, NaNs and subnormals included).

use std::num::NonZeroUsize;

use super::*;
use crate::gpu::reference::cast::cast_gather;
use crate::gpu::reference::rng::Rng;
use crate::gpu::reference::{Memory, Pool, diff_compact};
use crate::syncer::patch;
use crate::syncer::wire::{Codec, encode_patch_body};
use crate::tensor::{Class, DType, Storage, Tensor, cast_bytes};

const THREADS: NonZeroUsize = NonZeroUsize::new(2).unwrap();

/// One synced tensor: the state's dtype, the receivers' dtype, the elements.
struct Spec {
    from: DType,
    to: DType,
    numel: usize,
}

/// Random bits in `dtype` (every pattern: NaNs with payloads, subnormals, infinities).
fn bits(dtype: DType, numel: usize, r: &mut Rng) -> Vec<u8> {
    (0..numel * dtype.size_bytes())
        .map(|_| r.next() as u8)
        .collect()
}

fn tensor(dtype: DType, bytes: &[u8]) -> Tensor {
    let numel = bytes.len() / dtype.size_bytes();
    Tensor::from_bytes(dtype, &[numel], Class::Trainable, bytes).unwrap()
}

/// The receivers' view of `bytes` (`from`) in `to`, as the host casts (through aligned storage).
fn cast(bytes: &[u8], from: DType, to: DType) -> Vec<u8> {
    let mut src = Storage::zeroed(bytes.len());
    src.bytes_mut().copy_from_slice(bytes);
    let mut out = Storage::zeroed(bytes.len() / from.size_bytes() * to.size_bytes());
    cast_bytes(src.bytes(), from, out.bytes_mut(), to).unwrap();
    out.bytes().to_vec()
}

#[test]
fn a_casting_build_on_the_reference_kernels_codes_the_host_builds_bytes() {
    let specs = [
        Spec {
            from: DType::F32,
            to: DType::Bf16,
            numel: 70_001,
        },
        Spec {
            from: DType::Bf16,
            to: DType::Bf16,
            numel: 9_000,
        },
        Spec {
            from: DType::F16,
            to: DType::Bf16,
            numel: 4_097,
        },
        Spec {
            from: DType::F64,
            to: DType::F32,
            numel: 5_000,
        },
        Spec {
            from: DType::F32,
            to: DType::F16,
            numel: 0,
        },
    ];
    let mut r = Rng(0x5eed);
    // The state before (what the snapshot holds, cast) and after a step that changed ~3 % of the elements.
    let mut state = StateDict::new();
    let mut snap = Vec::new();
    for (i, s) in specs.iter().enumerate() {
        let w = s.from.size_bytes();
        let old = bits(s.from, s.numel, &mut r);
        let mut new = old.clone();
        for e in 0..s.numel {
            if r.next() % 100 < 3 {
                new[e * w + (r.next() as usize % w)] ^= 1 << (r.next() % 8);
            }
        }
        let held = cast(&old, s.from, s.to);
        let mut storage = Storage::zeroed(held.len());
        storage.bytes_mut().copy_from_slice(&held);
        let t = tensor(s.to, &held);
        snap.push(patch::SnapTensor {
            key: format!("t{i}"),
            ordinal: i as u32,
            dtype: s.to,
            cols: t.layout().coo_view().unwrap().1,
            storage,
        });
        state.insert(format!("t{i}"), tensor(s.from, &new));
    }
    let plan = CastPlan::new(&snap, &state).unwrap();
    assert_eq!(
        plan.casts.iter().map(Option::is_some).collect::<Vec<_>>(),
        [true, false, true, true, true]
    );
    assert!(
        plan.casts
            .iter()
            .flatten()
            .all(|c| c.offset % CAST_ALIGN == 0)
    );

    // The host build (casts with cast_bytes).
    let mut host_snap: Vec<patch::SnapTensor> = snap.iter().map(duplicate).collect();
    let mut want = Built::default();
    patch::build(&mut host_snap, &state, THREADS, &mut want).unwrap();

    // The device build on the reference kernels.
    let mut mem = Memory::default();
    let state_addrs: Vec<u64> = snap
        .iter()
        .map(|st| mem.alloc(state.get(&st.key).unwrap().bytes()))
        .collect();
    let snap_addrs: Vec<u64> = snap
        .iter()
        .map(|st| mem.alloc(st.storage.bytes()))
        .collect();
    let scratch = mem.alloc(&vec![0u8; plan.scratch_bytes as usize]);
    let (jobs, total) = plan.jobs(&state_addrs, scratch);
    assert_eq!(jobs.len(), 3, "the empty tensor has no job");
    cast_gather(&mut mem, &jobs, total).unwrap();
    let diff_addrs = plan.diff_state(&state_addrs, scratch);
    assert_eq!(
        diff_addrs[1], state_addrs[1],
        "a tensor in the receivers' dtype is read in place"
    );
    let layout = Layout::from_snapshot(&snap).unwrap();
    let mut got = Built::default();
    layout.prepare(&mut got);
    for width in layout.widths().collect::<Vec<_>>() {
        let jobs = layout.diff_jobs(width, |p| (diff_addrs[p], snap_addrs[p]));
        let ntiles = layout.ntiles(width);
        let numel: u64 = layout.tensors_of(width).map(|t| t.numel).sum();
        let cap = numel.max(1) as usize;
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
        diff_compact(&mut mem, width, &jobs, ntiles, pool, &mut dir, 7).unwrap();
        compact::collect(&layout, width, &dir, &idx, &vals, &mut got, THREADS).unwrap();
    }
    assert_eq!(got.changed, want.changed);
    assert!(
        want.changed > 1000,
        "the step changed elements after the cast"
    );
    for delta in [true, false] {
        let a = patch::encode(&got, &snap, delta, THREADS);
        let b = patch::encode(&want, &host_snap, delta, THREADS);
        assert_eq!(
            encode_patch_body(&a, Codec::Plain).body,
            encode_patch_body(&b, Codec::Plain).body,
            "delta={delta}"
        );
    }
    // The device snapshot copies took the cast state, as the host snapshot did.
    for (st, &a) in host_snap.iter().zip(&snap_addrs) {
        assert_eq!(mem.buffer(a).unwrap(), st.storage.bytes(), "{}", st.key);
    }
}

#[test]
fn a_dtype_pair_without_a_device_cast_is_refused_by_name() {
    let t = tensor(DType::I32, &[0u8; 16]);
    let mut state = StateDict::new();
    state.insert("steps", t);
    let snap = vec![patch::SnapTensor {
        key: "steps".into(),
        ordinal: 0,
        dtype: DType::I64,
        cols: 4,
        storage: Storage::zeroed(32),
    }];
    let err = CastPlan::new(&snap, &state).unwrap_err();
    assert!(err.contains("'steps'") && err.contains("floating"), "{err}");
    let same = CastPlan::new(&snap[..0], &state).unwrap();
    assert!(same.is_empty() && same.scratch_bytes == 0);
}

fn duplicate(st: &patch::SnapTensor) -> patch::SnapTensor {
    let mut storage = Storage::zeroed(st.storage.len());
    storage.bytes_mut().copy_from_slice(st.storage.bytes());
    patch::SnapTensor {
        key: st.key.clone(),
        ordinal: st.ordinal,
        dtype: st.dtype,
        cols: st.cols,
        storage,
    }
}
