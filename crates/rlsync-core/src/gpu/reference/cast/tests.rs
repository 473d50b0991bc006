//! The reference `cast_gather` against `tensor::cast_bytes`, bit for bit: every f16 / bf16 pattern, random
//! and special f32 / f64 values, and gathers of mixed tensors.

use proptest::prelude::*;

use super::*;
use crate::gpu::bucket::{BucketJob, Direction, code, table};
use crate::tensor::{DType, Storage, cast_bytes};

const FLOATS: [DType; 4] = [DType::F64, DType::F32, DType::F16, DType::Bf16];

/// `values` (each the bits of one `from` element) through `cast_bytes` and through `convert`; the first
/// mismatch, if any.
fn compare(from: DType, values: &[u64]) -> Result<(), String> {
    let w = from.size_bytes();
    let src: Vec<u8> = values
        .iter()
        .flat_map(|v| v.to_le_bytes()[..w].to_vec())
        .collect();
    let src = Storage::from_bytes(&src);
    for to in FLOATS {
        if to == from {
            continue;
        }
        let dw = to.size_bytes();
        let mut dst = Storage::zeroed(values.len() * dw);
        cast_bytes(src.bytes(), from, dst.bytes_mut(), to).map_err(|e| e.to_string())?;
        for (i, &v) in values.iter().enumerate() {
            let host = crate::bytes::read_uint(&dst.bytes()[i * dw..(i + 1) * dw]);
            let dev = convert(code(from), code(to), v);
            if host != dev {
                return Err(format!(
                    "{from} {v:#x} -> {to}: cast_bytes {host:#x}, reference kernel {dev:#x}"
                ));
            }
        }
    }
    Ok(())
}

#[test]
fn every_f16_and_bf16_pattern_converts_like_the_host() {
    let all: Vec<u64> = (0..=u16::MAX).map(u64::from).collect();
    compare(DType::F16, &all).unwrap();
    compare(DType::Bf16, &all).unwrap();
}

/// f32 values at every edge the conversions have: zeros, subnormals, the f16 / bf16 rounding and
/// subnormal boundaries, max, inf, NaN payloads (quiet and signalling, both signs).
fn f32_specials() -> Vec<u64> {
    let mut v = vec![
        0x0000_0000,
        0x8000_0000,
        0x0000_0001,
        0x8000_0001,
        0x007F_FFFF,
        0x0080_0000,
        0x7F7F_FFFF,
        0xFF7F_FFFF,
        0x7F80_0000,
        0xFF80_0000,
        0x7F80_0001,
        0x7FBF_FFFF,
        0x7FC0_0000,
        0xFFC0_0001,
        0x7FFF_FFFF,
        0xFFFF_E000,
        0x7F80_1000,
        0x3F80_8000,
        0x3F81_8000,
        0x477F_E000, // 65504, f16 max
        0x477F_F000, // 65520: rounds to inf in f16
        0x477F_EFFF,
        0x3300_0000, // 2^-25: halfway to f16's smallest subnormal
        0x3300_0001,
        0x3380_0000, // 2^-24
        0x3380_0001,
        0x387F_C000, // around f16's smallest normal
        0x3880_0000,
        0x387F_E000,
        0x387F_F000,
        0x3F80_1000, // f16 round-to-even ties
        0x3F80_3000,
    ];
    for e in 0..=255u64 {
        for m in [
            0u64, 1, 0x1000, 0x1FFF, 0x2000, 0x3000, 0x7FFF, 0x8000, 0x18000, 0x7F_FFFF,
        ] {
            v.push(e << 23 | m);
            v.push(0x8000_0000 | e << 23 | m);
        }
    }
    v
}

/// f64 values at the f32 narrowing's edges (and the f16 / bf16 ones reached through f32).
fn f64_specials() -> Vec<u64> {
    let mut v: Vec<u64> = vec![
        0,
        0x8000_0000_0000_0000,
        1,
        0x000F_FFFF_FFFF_FFFF,
        0x7FEF_FFFF_FFFF_FFFF,
        0x7FF0_0000_0000_0000,
        0xFFF0_0000_0000_0000,
        0x7FF0_0000_0000_0001,
        0x7FF0_0000_2000_0000,
        0x7FF7_FFFF_FFFF_FFFF,
        0x7FF8_0000_0000_0000,
        0xFFF8_0000_0000_0001,
        0x7FFF_FFFF_FFFF_FFFF,
        (1.0f64 + 2f64.powi(-8) + 2f64.powi(-30)).to_bits(),
        f64::from(f32::MAX).to_bits(),
        (f64::from(f32::MAX) * (1.0 + 2f64.powi(-25))).to_bits(), // rounds to f32::MAX... or inf at the tie
        (f64::from(f32::MAX) + 2f64.powi(103)).to_bits(),         // the tie above f32::MAX: inf
        2f64.powi(-149).to_bits(),
        2f64.powi(-150).to_bits(), // tie to 0
        (2f64.powi(-150) * 1.000001).to_bits(),
        (2f64.powi(-149) * 1.5).to_bits(), // tie to 2 * 2^-149
        (2f64.powi(-149) * 2.5).to_bits(), // tie to 2 * 2^-149
        2f64.powi(-126).to_bits(),
        (2f64.powi(-126) * (1.0 - 2f64.powi(-24))).to_bits(), // rounds up to f32's smallest normal
        2f64.powi(-1074).to_bits(),
        1e300f64.to_bits(),
        65504.0f64.to_bits(),
        65520.0f64.to_bits(),
    ];
    for e in (0..=0x7FFu64).step_by(1) {
        if !(0..8).contains(&e) && !(0x360..0x480).contains(&e) && e < 0x7F8 {
            continue;
        }
        for m in [
            0u64,
            1,
            0x1000_0000,
            0x1FFF_FFFF,
            0x2000_0000,
            0x3000_0000,
            0x6000_0000,
            0x000F_FFFF_FFFF_FFFF,
            0x0008_0000_0000_0000,
            0x0000_0200_0000_0000,
        ] {
            v.push(e << 52 | m);
            v.push(0x8000_0000_0000_0000 | e << 52 | m);
        }
    }
    v
}

#[test]
fn special_f32_and_f64_values_convert_like_the_host() {
    compare(DType::F32, &f32_specials()).unwrap();
    compare(DType::F64, &f64_specials()).unwrap();
}

proptest! {
    #[test]
    fn random_f32_values_convert_like_the_host(v in prop::collection::vec(any::<u32>(), 1..512)) {
        let v: Vec<u64> = v.into_iter().map(u64::from).collect();
        prop_assert_eq!(compare(DType::F32, &v), Ok(()));
    }

    #[test]
    fn random_f64_values_convert_like_the_host(v in prop::collection::vec(any::<u64>(), 1..512)) {
        prop_assert_eq!(compare(DType::F64, &v), Ok(()));
    }

    #[test]
    fn f64_values_near_f32_range_convert_like_the_host(
        v in prop::collection::vec((0x360u64..0x480, any::<u64>(), any::<bool>()), 1..512),
    ) {
        // Exponents from f32's subnormals to past its max: every narrowing path.
        let v: Vec<u64> = v
            .into_iter()
            .map(|(e, m, s)| u64::from(s) << 63 | e << 52 | (m & 0x000F_FFFF_FFFF_FFFF))
            .collect();
        prop_assert_eq!(compare(DType::F64, &v), Ok(()));
    }
}

/// Random bytes of `n` elements of `d`.
fn bytes(d: DType, n: usize, seed: u64) -> Vec<u8> {
    crate::gpu::reference::rng::bytes(n * d.size_bytes(), seed)
}

#[test]
fn a_gather_packs_and_unpacks_mixed_tensors_like_cast_bytes() {
    // (tensor dtype, wire dtype, elements): casts both ways, same-dtype copies, integers and bool copied.
    let specs = [
        (DType::F32, DType::Bf16, 1000),
        (DType::Bf16, DType::Bf16, 37),
        (DType::I64, DType::I64, 5),
        (DType::F64, DType::F16, 300),
        (DType::Bool, DType::Bool, 3),
        (DType::F16, DType::F32, 0),
        (DType::Bf16, DType::F64, 129),
        (DType::U8, DType::U8, 11),
    ];
    let mut mem = Memory::default();
    let mut jobs = Vec::new();
    let mut srcs = Vec::new();
    let mut offset = 24u64; // the body starts with a table the kernel never writes
    for (k, &(t, w, n)) in specs.iter().enumerate() {
        let b = bytes(t, n, k as u64 + 7);
        let addr = mem.alloc(&b);
        offset = offset.next_multiple_of(8);
        jobs.push(BucketJob {
            tensor: addr,
            tensor_dtype: t,
            offset,
            wire_dtype: w,
            numel: n as u64,
        });
        offset += (n * w.size_bytes()) as u64;
        srcs.push(b);
    }
    let body_len = offset as usize + 5;
    let buffer = mem.alloc(&vec![0xAB; body_len]);
    let (cast, total) = table(&jobs, buffer, body_len, Direction::Pack).unwrap();
    cast_gather(&mut mem, &cast, total).unwrap();
    let body = mem.buffer(buffer).unwrap().to_vec();
    let mut covered = vec![false; body_len];
    for (j, src) in jobs.iter().zip(&srcs) {
        let len = j.numel as usize * j.wire_dtype.size_bytes();
        let src = Storage::from_bytes(src);
        let mut want = Storage::zeroed(len);
        cast_bytes(src.bytes(), j.tensor_dtype, want.bytes_mut(), j.wire_dtype).unwrap();
        let at = j.offset as usize;
        assert_eq!(&body[at..at + len], want.bytes(), "{j:?}");
        covered[at..at + len].iter_mut().for_each(|c| *c = true);
    }
    for (i, c) in covered.iter().enumerate() {
        assert!(
            *c || body[i] == 0xAB,
            "byte {i} outside every job was written"
        );
    }
    // Unpack into fresh tensors: the wire bytes cast back to each tensor's dtype.
    let mut back = Vec::new();
    for j in &jobs {
        let addr = mem.alloc(&vec![0u8; j.numel as usize * j.tensor_dtype.size_bytes()]);
        back.push(BucketJob { tensor: addr, ..*j });
    }
    let (cast, total) = table(&back, buffer, body_len, Direction::Unpack).unwrap();
    cast_gather(&mut mem, &cast, total).unwrap();
    for j in &back {
        let len = j.numel as usize * j.wire_dtype.size_bytes();
        let wire = Storage::from_bytes(&body[j.offset as usize..j.offset as usize + len]);
        let mut want = Storage::zeroed(j.numel as usize * j.tensor_dtype.size_bytes());
        cast_bytes(wire.bytes(), j.wire_dtype, want.bytes_mut(), j.tensor_dtype).unwrap();
        assert_eq!(
            mem.read(j.tensor, want.len() as u64).unwrap(),
            want.bytes(),
            "{j:?}"
        );
    }
}

#[test]
fn a_table_refuses_integer_casts_and_jobs_past_the_body() {
    let job = BucketJob {
        tensor: 1 << 40,
        tensor_dtype: DType::I32,
        offset: 0,
        wire_dtype: DType::F32,
        numel: 4,
    };
    assert!(matches!(
        table(&[job], 2 << 40, 64, Direction::Pack),
        Err(crate::gpu::bucket::BucketDeviceError::NotFloating { .. })
    ));
    let job = BucketJob {
        tensor_dtype: DType::F32,
        offset: 60,
        ..job
    };
    assert!(matches!(
        table(&[job], 2 << 40, 64, Direction::Pack),
        Err(crate::gpu::bucket::BucketDeviceError::Range { .. })
    ));
    let job = BucketJob { offset: 48, ..job };
    let (t, total) = table(&[job], 2 << 40, 64, Direction::Pack).unwrap();
    assert_eq!((t.len(), total, t[0].dst), (1, 4, (2 << 40) + 48));
}
