//! Element types of tensors (`DType`) and the Rust types that may view a tensor's bytes (`Element`).

use half::{bf16, f16};

/// The element type of a tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    Bf16,
    F16,
    F32,
    F64,
    I8,
    I16,
    I32,
    I64,
    U8,
    Bool,
}

impl DType {
    /// Every dtype, in wire-code order.
    pub(crate) const ALL: [DType; 10] = [
        DType::Bf16,
        DType::F16,
        DType::F32,
        DType::F64,
        DType::I8,
        DType::I16,
        DType::I32,
        DType::I64,
        DType::U8,
        DType::Bool,
    ];

    pub const fn size_bytes(self) -> usize {
        match self {
            DType::I8 | DType::U8 | DType::Bool => 1,
            DType::Bf16 | DType::F16 | DType::I16 => 2,
            DType::F32 | DType::I32 => 4,
            DType::F64 | DType::I64 => 8,
        }
    }

    pub const fn is_floating(self) -> bool {
        matches!(self, DType::Bf16 | DType::F16 | DType::F32 | DType::F64)
    }

    /// PyTorch's name (`bfloat16`, `float32`, `int64`, `bool`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            DType::Bf16 => "bfloat16",
            DType::F16 => "float16",
            DType::F32 => "float32",
            DType::F64 => "float64",
            DType::I8 => "int8",
            DType::I16 => "int16",
            DType::I32 => "int32",
            DType::I64 => "int64",
            DType::U8 => "uint8",
            DType::Bool => "bool",
        }
    }

    /// Stable one-byte code used by the wire format and checksums.
    pub const fn code(self) -> u8 {
        match self {
            DType::Bf16 => 0,
            DType::F16 => 1,
            DType::F32 => 2,
            DType::F64 => 3,
            DType::I8 => 4,
            DType::I16 => 5,
            DType::I32 => 6,
            DType::I64 => 7,
            DType::U8 => 8,
            DType::Bool => 9,
        }
    }

    /// The dtype with PyTorch's name [`DType::name`] (`"bfloat16"`, `"float32"`, ...).
    pub fn from_name(name: &str) -> Option<DType> {
        DType::ALL.iter().copied().find(|d| d.name() == name)
    }

    pub(crate) fn from_code(code: u8) -> Option<DType> {
        DType::ALL.get(usize::from(code)).copied()
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

mod sealed {
    pub trait Sealed {}
}

/// A plain-old-data Rust type that can view a tensor's bytes: every bit pattern is a valid value, alignment is
/// at most 8 (storage alignment). `bool` is deliberately absent (not every byte is a valid `bool`): view a
/// `Bool` tensor as `u8`.
pub trait Element: sealed::Sealed + bytemuck::Pod + Send + Sync {
    /// Whether a tensor of dtype `d` may be viewed as `[Self]`.
    fn matches(d: DType) -> bool;
}

macro_rules! element {
    ($t:ty, $($d:path),+) => {
        impl sealed::Sealed for $t {}
        impl Element for $t {
            fn matches(d: DType) -> bool {
                matches!(d, $($d)|+)
            }
        }
    };
}

element!(bf16, DType::Bf16);
element!(f16, DType::F16);
element!(f32, DType::F32);
element!(f64, DType::F64);
element!(i8, DType::I8);
element!(i16, DType::I16);
element!(i32, DType::I32);
element!(i64, DType::I64);
element!(u8, DType::U8, DType::Bool);
