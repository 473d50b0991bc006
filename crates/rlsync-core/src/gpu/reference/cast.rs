//! CPU reference of `cast_gather` (kernels/rlsync.cu, "Bucket casts"): the same bit operations per element,
//! over a [`Memory`], so the bucket device path is checked bit for bit against `tensor::cast_bytes` here.

use super::{Elements as _, Memory, ReferenceError};
use crate::gpu::bucket::{CastJob, DT_BF16, DT_F16, DT_F64, code_width};

/// f32 → bf16 (`cast_f32_bf16`).
pub fn f32_bf16(b: u32) -> u32 {
    let rounded = b.wrapping_add(0x7FFF + ((b >> 16) & 1)) >> 16;
    if (b & 0x7FFF_FFFF) > 0x7F80_0000 {
        0xFFFF
    } else {
        rounded & 0xFFFF
    }
}

/// f16 → f32 (`cast_f16_f32`).
pub fn f16_f32(h: u32) -> u32 {
    let sign = (h & 0x8000) << 16;
    let exp = h & 0x7C00;
    let man = h & 0x03FF;
    if h & 0x7FFF == 0 {
        return sign;
    }
    if exp == 0x7C00 {
        return if man == 0 {
            sign | 0x7F80_0000
        } else {
            sign | 0x7FC0_0000 | (man << 13)
        };
    }
    if exp == 0 {
        let p = 31 - man.leading_zeros();
        return sign | ((p + 103) << 23) | ((man << (23 - p)) & 0x7F_FFFF);
    }
    sign | (((exp >> 10) + 112) << 23) | (man << 13)
}

/// f32 → f16 (`cast_f32_f16`).
pub fn f32_f16(x: u32) -> u32 {
    let sign = (x & 0x8000_0000) >> 16;
    let exp = x & 0x7F80_0000;
    let man = x & 0x007F_FFFF;
    if exp == 0x7F80_0000 {
        return sign | 0x7C00 | if man != 0 { 0x0200 } else { 0 } | (man >> 13);
    }
    let half_exp = (exp >> 23) as i32 - 127 + 15;
    if half_exp >= 0x1F {
        return sign | 0x7C00;
    }
    if half_exp <= 0 {
        if 14 - half_exp > 24 {
            return sign;
        }
        let m = man | 0x0080_0000;
        let mut half_man = m >> (14 - half_exp);
        let round_bit = 1u32 << (13 - half_exp);
        if (m & round_bit) != 0 && (m & (3 * round_bit - 1)) != 0 {
            half_man += 1;
        }
        return sign | half_man;
    }
    let v = sign | ((half_exp as u32) << 10) | (man >> 13);
    let round_bit = 0x0000_1000u32;
    if (man & round_bit) != 0 && (man & (3 * round_bit - 1)) != 0 {
        v + 1
    } else {
        v
    }
}

/// Round-to-nearest-even right shift of `m` by `s` (1..63) (`cast_rne_shift`).
fn rne_shift(m: u64, s: u32) -> u64 {
    let r = m >> s;
    let rem = m & ((1u64 << s) - 1);
    let half = 1u64 << (s - 1);
    if rem > half || (rem == half && (r & 1) != 0) {
        r + 1
    } else {
        r
    }
}

/// f64 → f32 (`cast_f64_f32`).
pub fn f64_f32(x: u64) -> u32 {
    let sign = (x >> 32) as u32 & 0x8000_0000;
    let exp = (x >> 52) as u32 & 0x7FF;
    let man = x & 0x000F_FFFF_FFFF_FFFF;
    if exp == 0x7FF {
        return if man == 0 {
            sign | 0x7F80_0000
        } else {
            sign | 0x7FC0_0000 | (man >> 29) as u32
        };
    }
    if exp == 0 {
        return sign;
    }
    let e = exp as i32 - 1023 + 127;
    let m = man | (1u64 << 52);
    if e >= 0xFF {
        return sign | 0x7F80_0000;
    }
    if e >= 1 {
        return sign + (((e - 1) as u32) << 23) + rne_shift(m, 29) as u32;
    }
    let s = 29 + (1 - e) as u32;
    if s >= 54 {
        return sign;
    }
    sign | rne_shift(m, s) as u32
}

/// f32 → f64 (`cast_f32_f64`).
pub fn f32_f64(x: u32) -> u64 {
    let sign = u64::from(x & 0x8000_0000) << 32;
    let exp = (x >> 23) & 0xFF;
    let man = x & 0x7F_FFFF;
    if exp == 0xFF {
        return if man == 0 {
            sign | 0x7FF0_0000_0000_0000
        } else {
            sign | 0x7FF8_0000_0000_0000 | (u64::from(man) << 29)
        };
    }
    if exp == 0 {
        if man == 0 {
            return sign;
        }
        let p = 31 - man.leading_zeros();
        return sign
            | (u64::from(p + 874) << 52)
            | ((u64::from(man) << (52 - p)) & 0x000F_FFFF_FFFF_FFFF);
    }
    sign | (u64::from(exp + 896) << 52) | (u64::from(man) << 29)
}

/// One element's bits from floating code `from` to floating code `to` (`cast_convert`).
pub fn convert(from: u32, to: u32, bits: u64) -> u64 {
    if from == DT_F16 && to == DT_BF16 && bits & 0x7C00 == 0x7C00 && bits & 0x03FF != 0 {
        return 0x7FC0;
    }
    let f = match from {
        DT_F64 => f64_f32(bits),
        DT_F16 => f16_f32(bits as u32),
        DT_BF16 => (bits as u32) << 16,
        _ => bits as u32,
    };
    match to {
        DT_F64 => f32_f64(f),
        DT_F16 => u64::from(f32_f16(f)),
        DT_BF16 => u64::from(f32_bf16(f)),
        _ => u64::from(f),
    }
}

/// `cast_gather` over `jobs` (addresses in `mem`), elements `0..total` of the launch's element space.
pub fn cast_gather(mem: &mut Memory, jobs: &[CastJob], total: u64) -> Result<(), ReferenceError> {
    if jobs.is_empty() {
        return Ok(());
    }
    for g in 0..total {
        // The kernel's hinted search finds the same job: the table is sorted by `first`.
        let job = jobs[super::find_job(|k| jobs[k].first, jobs.len(), g)];
        if g < job.first || g - job.first >= job.numel {
            continue;
        }
        let i = g - job.first;
        let (from, to) = (job.codes & 0xFF, (job.codes >> 8) & 0xFF);
        let (sw, dw) = (code_width(from), code_width(to));
        let v = mem.load(job.src, i, sw)?;
        let out = if from == to || from > DT_BF16 || to > DT_BF16 {
            v
        } else {
            convert(from, to, v)
        };
        mem.store(job.dst, i, dw, out)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests;
