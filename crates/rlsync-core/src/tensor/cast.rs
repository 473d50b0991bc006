//! Dtype conversion of tensor bytes with PyTorch's CPU semantics (what `tensor.to(dtype)` gives).
//!
//! Measured against torch 2.13 on CPU (1-D tensors, the vectorised kernels weights go through):
//! - f32 → bf16: round to nearest even; every NaN becomes `0xFFFF`.
//! - f64 → bf16: f64 → f32 (hardware rounding), then as f32 → bf16 (NaN → `0xFFFF`).
//! - f16 → bf16: exact widening to f32, round to nearest even; NaN → `0x7FC0`.
//! - → f16 from f32 / f64 / bf16: through f32, round to nearest even; NaN → sign | `0x7E00` | top payload bits.
//! - → f32 / f64: exact widening (bf16 / f16 / f32) or hardware rounding (f64 → f32), NaN payloads kept.
//!
//! Only floating dtypes convert; integer and bool tensors keep their dtype everywhere in rlsync.

use half::f16;

use super::dtype::DType;
use super::storage::{Pod, pod_slice, pod_slice_mut};

#[derive(Debug, thiserror::Error)]
pub enum CastError {
    #[error("cannot convert {from} to {to}: only floating dtypes convert")]
    NotFloating { from: DType, to: DType },
    #[error("cast of {elements} elements: source has {src_bytes} bytes, destination {dst_bytes}")]
    Length {
        elements: usize,
        src_bytes: usize,
        dst_bytes: usize,
    },
    #[error("cast buffers are not aligned for their dtypes")]
    Misaligned,
}

/// f32 → bf16 bits exactly as torch's CPU tensor cast does it.
#[inline(always)]
pub fn cast_f32_to_bf16(x: f32) -> u16 {
    let bits = x.to_bits();
    let rounded = (bits.wrapping_add(0x7FFF + ((bits >> 16) & 1)) >> 16) as u16;
    // Written as a select so the slice loop stays branch-free and vectorises.
    if (bits & 0x7FFF_FFFF) > 0x7F80_0000 {
        0xFFFF
    } else {
        rounded
    }
}

#[inline(always)]
fn f16_to_bf16(x: f16) -> u16 {
    if x.is_nan() {
        0x7FC0
    } else {
        cast_f32_to_bf16(x.to_f32())
    }
}

#[inline(always)]
fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits(u32::from(b) << 16)
}

fn map<S: Pod, D: Pod>(src: &[u8], dst: &mut [u8], f: impl Fn(S) -> D) -> Result<(), CastError> {
    let s = pod_slice::<S>(src).ok_or(CastError::Misaligned)?;
    let d = pod_slice_mut::<D>(dst).ok_or(CastError::Misaligned)?;
    for (o, &i) in d.iter_mut().zip(s) {
        *o = f(i);
    }
    Ok(())
}

/// Convert `src` (elements of `from`) into `dst` (elements of `to`); same dtype is a copy.
pub fn cast_bytes(src: &[u8], from: DType, dst: &mut [u8], to: DType) -> Result<(), CastError> {
    let elements = src.len() / from.size_bytes();
    if !src.len().is_multiple_of(from.size_bytes()) || dst.len() != elements * to.size_bytes() {
        return Err(CastError::Length {
            elements,
            src_bytes: src.len(),
            dst_bytes: dst.len(),
        });
    }
    if from == to {
        dst.copy_from_slice(src);
        return Ok(());
    }
    use DType::*;
    match (from, to) {
        (F32, Bf16) => map::<f32, u16>(src, dst, cast_f32_to_bf16),
        (F64, Bf16) => map::<f64, u16>(src, dst, |x| cast_f32_to_bf16(x as f32)),
        (F16, Bf16) => map::<f16, u16>(src, dst, f16_to_bf16),
        (F32, F16) => map::<f32, f16>(src, dst, f16::from_f32),
        (F64, F16) => map::<f64, f16>(src, dst, |x| f16::from_f32(x as f32)),
        (Bf16, F16) => map::<u16, f16>(src, dst, |b| f16::from_f32(bf16_to_f32(b))),
        (Bf16, F32) => map::<u16, f32>(src, dst, bf16_to_f32),
        (F16, F32) => map::<f16, f32>(src, dst, f16::to_f32),
        (F64, F32) => map::<f64, f32>(src, dst, |x| x as f32),
        (Bf16, F64) => map::<u16, f64>(src, dst, |b| f64::from(bf16_to_f32(b))),
        (F16, F64) => map::<f16, f64>(src, dst, |x| f64::from(x.to_f32())),
        (F32, F64) => map::<f32, f64>(src, dst, f64::from),
        _ => Err(CastError::NotFloating { from, to }),
    }
}

/// Copies shorter than this go through the ordinary `copy_from_slice` (streaming pays off only when the
/// destination would otherwise push useful data out of the cache).
const STREAM_MIN: usize = 4096;

/// Copy `src` into `dst` (equal lengths) with non-temporal stores where the CPU has them (x86-64: SSE2,
/// always present): the destination lines are written straight to memory instead of being read first
/// and kept in cache. For the transfer paths (shm slots the sender never reads back, staging buffers read
/// only much later) this saves the read-for-ownership traffic and leaves the cache to the data still
/// being hashed. The stores are fenced before returning, so the bytes are visible like after a plain copy.
pub fn copy_streaming(dst: &mut [u8], src: &[u8]) -> Result<(), CastError> {
    if dst.len() != src.len() {
        return Err(CastError::Length {
            elements: src.len(),
            src_bytes: src.len(),
            dst_bytes: dst.len(),
        });
    }
    #[cfg(target_arch = "x86_64")]
    if src.len() >= STREAM_MIN {
        stream_x86(dst, src);
        return Ok(());
    }
    dst.copy_from_slice(src);
    Ok(())
}

#[cfg(target_arch = "x86_64")]
fn stream_x86(dst: &mut [u8], src: &[u8]) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
    // Plain copy up to the first 16-byte aligned destination address (streaming stores need alignment).
    let head = dst.as_ptr().align_offset(16).min(dst.len());
    let (dst_head, dst_rest) = dst.split_at_mut(head);
    let (src_head, src_rest) = src.split_at(head);
    dst_head.copy_from_slice(src_head);
    let body = dst_rest.len() / 64 * 64;
    let (dst_body, dst_tail) = dst_rest.split_at_mut(body);
    let (src_body, src_tail) = src_rest.split_at(body);
    for (d, s) in dst_body.chunks_exact_mut(64).zip(src_body.chunks_exact(64)) {
        let (dp, sp) = (
            d.as_mut_ptr().cast::<__m128i>(),
            s.as_ptr().cast::<__m128i>(),
        );
        // SAFETY: `d` and `s` are 64-byte slices, so the four 16-byte lanes are in bounds; loads are
        // unaligned loads, and `d` starts 16-byte aligned (after `head`, in steps of 64), as the
        // streaming stores require. SSE2 is part of the x86-64 baseline.
        unsafe {
            let a = _mm_loadu_si128(sp);
            let b = _mm_loadu_si128(sp.add(1));
            let c = _mm_loadu_si128(sp.add(2));
            let e = _mm_loadu_si128(sp.add(3));
            _mm_stream_si128(dp, a);
            _mm_stream_si128(dp.add(1), b);
            _mm_stream_si128(dp.add(2), c);
            _mm_stream_si128(dp.add(3), e);
        }
    }
    dst_tail.copy_from_slice(src_tail);
    // SAFETY: a store fence has no memory-safety preconditions; it orders the streaming stores before
    // any later store (such as publishing the payload to another process).
    unsafe { _mm_sfence() };
}

/// Whether `from` can be converted to `to` by [`cast_bytes`].
pub fn can_cast(from: DType, to: DType) -> bool {
    from == to || (from.is_floating() && to.is_floating())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f32_to(bits: &[u32], to: DType) -> Vec<u16> {
        let src: Vec<u8> = bits.iter().flat_map(|b| b.to_ne_bytes()).collect();
        let mut aligned_src = super::super::Storage::from_bytes(&src);
        let mut dst = super::super::Storage::zeroed(bits.len() * 2);
        cast_bytes(aligned_src.bytes_mut(), DType::F32, dst.bytes_mut(), to).unwrap();
        dst.bytes()
            .chunks(2)
            .map(|c| u16::from_ne_bytes([c[0], c[1]]))
            .collect()
    }

    // Expected values printed by torch 2.13 (CPU): torch.tensor(bits, dtype=int32).view(float32).to(dtype).
    const BITS: [u32; 11] = [
        0x7fc0_0000,
        0xffc0_0000,
        0x7f80_0001,
        0xff81_2345,
        0x7fa0_0000,
        0x7fff_ffff,
        0x3f80_8000,
        0x3f81_8000,
        0x7f7f_ffff,
        0x0000_0001,
        0x8000_8000,
    ];

    #[test]
    fn f32_to_bf16_matches_torch() {
        let expect = [
            0xffff, 0xffff, 0xffff, 0xffff, 0xffff, 0xffff, 0x3f80, 0x3f82, 0x7f80, 0x0, 0x8000,
        ];
        assert_eq!(f32_to(&BITS, DType::Bf16), expect);
    }

    #[test]
    fn f32_to_f16_matches_torch() {
        let expect = [
            0x7e00, 0xfe00, 0x7e00, 0xfe09, 0x7f00, 0x7fff, 0x3c04, 0x3c0c, 0x7c00, 0x0, 0x8000,
        ];
        assert_eq!(f32_to(&BITS, DType::F16), expect);
    }

    #[test]
    fn f64_to_bf16_rounds_through_f32_like_torch() {
        // torch: tensor([1 + 2**-8 + 2**-30], float64).to(bfloat16) == 0x3f80 (double rounding via f32).
        let x = 1.0f64 + 2f64.powi(-8) + 2f64.powi(-30);
        let src = super::super::Storage::from_bytes(&x.to_ne_bytes());
        let mut dst = [0u8; 2];
        cast_bytes(src.bytes(), DType::F64, &mut dst, DType::Bf16).unwrap();
        assert_eq!(u16::from_ne_bytes(dst), 0x3f80);
    }

    #[test]
    fn f16_nan_to_bf16_is_canonical() {
        let src = super::super::Storage::from_bytes(&0x7e01u16.to_ne_bytes());
        let mut dst = [0u8; 2];
        cast_bytes(src.bytes(), DType::F16, &mut dst, DType::Bf16).unwrap();
        assert_eq!(u16::from_ne_bytes(dst), 0x7fc0);
    }

    #[test]
    fn integers_do_not_convert() {
        let mut dst = [0u8; 4];
        let err = cast_bytes(&[0u8; 8], DType::I64, &mut dst, DType::I32).unwrap_err();
        assert!(matches!(err, CastError::NotFloating { .. }));
        assert!(can_cast(DType::I32, DType::I32));
        assert!(!can_cast(DType::Bool, DType::U8));
    }

    #[test]
    fn streaming_copy_equals_plain_copy_at_every_alignment() {
        let src: Vec<u8> = (0..20_000u32).map(|i| (i * 7 + i / 251) as u8).collect();
        for (so, dof, len) in [
            (0, 0, 20_000 - 64),
            (1, 3, 9_999),
            (5, 0, 4096),
            (0, 15, 4095),
            (3, 1, 17),
            (0, 0, 0),
        ] {
            let mut dst = vec![0xAAu8; len + 32];
            copy_streaming(&mut dst[dof..dof + len], &src[so..so + len]).unwrap();
            assert_eq!(
                &dst[dof..dof + len],
                &src[so..so + len],
                "src offset {so}, dst offset {dof}, {len} bytes"
            );
            assert!(
                dst[..dof]
                    .iter()
                    .chain(&dst[dof + len..])
                    .all(|&b| b == 0xAA),
                "bytes outside the destination were touched"
            );
        }
        assert!(matches!(
            copy_streaming(&mut [0u8; 3], &[0u8; 4]),
            Err(CastError::Length { .. })
        ));
    }

    #[test]
    fn length_mismatch_is_an_error() {
        let mut dst = [0u8; 3];
        assert!(matches!(
            cast_bytes(&[0u8; 4], DType::F32, &mut dst, DType::Bf16),
            Err(CastError::Length { .. })
        ));
    }
}
