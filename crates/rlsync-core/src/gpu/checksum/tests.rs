//! The device checksum's plan, run with the kernel's CPU reference over a simulated device, gives the host's
//! `state_checksum` for the same weights: every dtype, chunk boundaries, tails, empty and misaligned tensors,
//! host tensors and missing keys in any order.

use std::collections::HashMap;
use std::num::NonZeroUsize;

use super::*;
use crate::gpu::reference::{Memory, rng};
use crate::tensor::{Class, Tensor, state_checksum};

const THREADS: NonZeroUsize = NonZeroUsize::new(2).unwrap();

fn tensor(dtype: DType, numel: usize, seed: u64) -> Tensor {
    let bytes = rng::bytes(numel * dtype.size_bytes(), seed);
    Tensor::from_bytes(dtype, &[numel], Class::Trainable, &bytes).unwrap()
}

/// Run `plan` with `mem` as the device.
fn run(plan: &Plan<'_>, mem: &Memory) -> u64 {
    plan.finish_on(mem, THREADS).unwrap()
}

/// `state`'s tensors named in `on_device` copied into a simulated device (at `offset` bytes into a buffer);
/// their host bytes then zeroed, so a checksum that read them instead would differ.
fn to_device(
    state: &mut StateDict,
    on_device: &[(&str, u64)],
    mem: &mut Memory,
) -> HashMap<String, u64> {
    let mut addrs = HashMap::new();
    for &(key, offset) in on_device {
        let t = state.get_mut(key).unwrap();
        let mut buf = vec![0u8; offset as usize];
        buf.extend_from_slice(t.bytes());
        addrs.insert(key.to_owned(), mem.alloc(&buf) + offset);
        t.bytes_mut().fill(0);
    }
    addrs
}

#[test]
fn a_device_checksum_is_the_host_checksum_of_the_same_weights() {
    let chunk = CHECKSUM_CHUNK / 2; // elements of 2 bytes per chunk
    let mut state = StateDict::new();
    state.insert("empty", tensor(DType::Bf16, 0, 1));
    state.insert("tail_only", tensor(DType::F32, 3, 2));
    state.insert("one_chunk", tensor(DType::Bf16, chunk, 3));
    state.insert("chunks_and_tail", tensor(DType::Bf16, 2 * chunk + 77, 4));
    state.insert("bytes", tensor(DType::U8, 2 * CHECKSUM_CHUNK + 5, 5));
    state.insert("f64", tensor(DType::F64, CHECKSUM_CHUNK / 8 + 1, 6));
    state.insert("misaligned", tensor(DType::U8, CHECKSUM_CHUNK + 9, 7));
    state.insert("on_host", tensor(DType::F32, CHECKSUM_CHUNK / 4 + 3, 8));
    let keys: Vec<String> = [
        "one_chunk",
        "on_host",
        "gone",
        "empty",
        "chunks_and_tail",
        "tail_only",
        "bytes",
        "misaligned",
        "f64",
    ]
    .map(String::from)
    .to_vec();
    let want = state_checksum(&state, &keys);

    let mut mem = Memory::default();
    let device = to_device(
        &mut state,
        &[
            ("empty", 0),
            ("tail_only", 0),
            ("one_chunk", 0),
            ("chunks_and_tail", 8),
            ("bytes", 0),
            ("f64", 0),
            ("misaligned", 3),
        ],
        &mut mem,
    );
    let plan = Plan::new(&state, &keys, &device);
    // Whole chunks of the aligned tensors go to the kernel: 1 + 2 + 2 + 1.
    assert_eq!(plan.chunks.len(), 6);
    // Tails, and the misaligned tensor whole.
    assert_eq!(
        plan.copied_bytes(),
        12 + 77 * 2 + 5 + 8 + CHECKSUM_CHUNK + 9
    );
    assert_eq!(run(&plan, &mem), want);
}

#[test]
fn a_device_checksum_sees_a_changed_element_anywhere_and_host_bytes_are_never_read_for_device_tensors()
 {
    let mut state = StateDict::new();
    state.insert("w", tensor(DType::Bf16, CHECKSUM_CHUNK + 100, 11));
    let keys = vec!["w".to_owned()];
    let want = state_checksum(&state, &keys);
    let mut mem = Memory::default();
    let device = to_device(&mut state, &[("w", 0)], &mut mem);
    assert_eq!(run(&Plan::new(&state, &keys, &device), &mem), want);
    // The host copy (zeroed) is not what was hashed: its own checksum differs.
    assert_ne!(state_checksum(&state, &keys), want);

    let addr = device["w"];
    for at in [0u64, CHECKSUM_CHUNK as u64 - 1, CHECKSUM_CHUNK as u64 + 150] {
        mem.write(addr + at, 1).unwrap()[0] ^= 0x40;
        assert_ne!(
            run(&Plan::new(&state, &keys, &device), &mem),
            want,
            "byte {at}"
        );
        mem.write(addr + at, 1).unwrap()[0] ^= 0x40;
    }
    assert_eq!(run(&Plan::new(&state, &keys, &device), &mem), want);
}

#[test]
fn without_device_tensors_the_plan_is_the_host_checksum() {
    let mut state = StateDict::new();
    state.insert("a", tensor(DType::F32, 1000, 21));
    state.insert("b", tensor(DType::I64, 3 * CHECKSUM_CHUNK / 8, 22));
    let keys = state.synced_keys();
    let plan = Plan::new(&state, &keys, &HashMap::new());
    assert!(plan.chunks.is_empty() && plan.copies.is_empty());
    assert_eq!(
        plan.finish(&[], &[], THREADS),
        state_checksum(&state, &keys)
    );
}

/// A plan of device tensors named apart from any state dict (a cast copy in the receivers' dtype) is the
/// host checksum of a state dict holding those bytes under those names, dtypes and shapes.
#[test]
fn a_plan_of_named_device_tensors_is_the_host_checksum_of_them() {
    let mut state = StateDict::new();
    let shapes: [(DType, Vec<usize>); 4] = [
        (DType::Bf16, vec![3, CHECKSUM_CHUNK / 2 + 7]),
        (DType::F32, vec![5]),
        (DType::F16, vec![0]),
        (DType::I64, vec![CHECKSUM_CHUNK / 8, 2]),
    ];
    for (k, (dtype, shape)) in shapes.iter().enumerate() {
        let numel: usize = shape.iter().product();
        let t = tensor(*dtype, numel, 11 + k as u64);
        let t = Tensor::from_bytes(*dtype, shape, Class::Trainable, t.bytes()).unwrap();
        state.insert(format!("t{k}"), t);
    }
    let keys: Vec<String> = (0..shapes.len()).map(|k| format!("t{k}")).collect();
    let mut mem = Memory::default();
    let addrs: Vec<u64> = keys
        .iter()
        .map(|k| mem.alloc(state.get(k).unwrap().bytes()))
        .collect();
    let names: Vec<(String, DType, Vec<usize>)> = keys
        .iter()
        .zip(&shapes)
        .map(|(k, (d, s))| (k.clone(), *d, s.clone()))
        .collect();
    let plan = Plan::of_device(&names, &addrs);
    assert!(!plan.chunks.is_empty(), "whole chunks are digested");
    assert_eq!(run(&plan, &mem), state_checksum(&state, &keys));
    // Another dtype under the same bytes is another checksum.
    let mut other = names.clone();
    other[1].1 = DType::I32;
    assert_ne!(
        run(&Plan::of_device(&other, &addrs), &mem),
        state_checksum(&state, &keys)
    );
}
