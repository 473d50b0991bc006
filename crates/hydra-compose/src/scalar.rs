//! Python's scalar values (None, bool, int, float, str, bytes) and Python's rules for them, in one place.
//!
//! Config values ([`crate::node::Value`]), dict keys ([`crate::node::Key`]), resolver values
//! (`interpolate::py::Py`) and override values (`overrides::Element` and the visitor's `Val`) all hold
//! their scalars as a [`Scalar`]; each keeps only its own containers (config children, Python lists,
//! sweeps). Python's `repr`/`str`, type names, truthiness, number equality (`1 == 1.0 == True`, exact
//! across ints and floats) and unbounded ints ([`num_bigint::BigInt`]) are written here once.

/// Python's unbounded int, as [`Scalar::BigInt`] holds it (re-exported so users need not name the crate).
pub use num_bigint::BigInt;
use num_traits::{FromPrimitive, ToPrimitive};

/// A Python scalar.
#[derive(Debug, Clone, PartialEq)]
pub enum Scalar {
    None,
    Bool(bool),
    Int(i64),
    /// An int outside `i64`, never one that fits (build ints with [`Scalar::int`]).
    BigInt(BigInt),
    Float(f64),
    /// A string; in a config value, one containing `${` is (or contains) an interpolation.
    Str(String),
    /// YAML `!!binary` (PyYAML loads it as Python `bytes`).
    Bytes(Vec<u8>),
}

impl Scalar {
    /// An exact int: [`Scalar::Int`] when it fits in `i64`, else [`Scalar::BigInt`].
    pub fn int(v: BigInt) -> Scalar {
        match v.to_i64() {
            Some(i) => Scalar::Int(i),
            None => Scalar::BigInt(v),
        }
    }

    /// Python's `type(x).__name__`.
    pub fn type_name(&self) -> &'static str {
        match self {
            Scalar::None => "NoneType",
            Scalar::Bool(_) => "bool",
            Scalar::Int(_) | Scalar::BigInt(_) => "int",
            Scalar::Float(_) => "float",
            Scalar::Str(_) => "str",
            Scalar::Bytes(_) => "bytes",
        }
    }

    /// Python's `repr(x)`.
    pub fn repr(&self) -> String {
        match self {
            Scalar::None => "None".into(),
            Scalar::Bool(true) => "True".into(),
            Scalar::Bool(false) => "False".into(),
            Scalar::Int(i) => i.to_string(),
            Scalar::BigInt(i) => i.to_string(),
            Scalar::Float(f) => python_float_repr(*f),
            Scalar::Str(s) => python_repr_str(s),
            Scalar::Bytes(b) => python_repr_bytes(b),
        }
    }

    /// Python's `str(x)`: a string as it is, anything else as its `repr`.
    pub fn str(&self) -> String {
        match self {
            Scalar::Str(s) => s.clone(),
            other => other.repr(),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Scalar::Str(s) => Some(s),
            _ => None,
        }
    }

    /// Python's `bool(x)`.
    pub fn truthy(&self) -> bool {
        match self {
            Scalar::None => false,
            Scalar::Bool(b) => *b,
            Scalar::Int(i) => *i != 0,
            // Never zero: zero fits in i64.
            Scalar::BigInt(_) => true,
            Scalar::Float(f) => *f != 0.0,
            Scalar::Str(s) => !s.is_empty(),
            Scalar::Bytes(b) => !b.is_empty(),
        }
    }

    /// True for bool, int and float: what Python's arithmetic and `==` treat as numbers.
    pub fn is_number(&self) -> bool {
        matches!(
            self,
            Scalar::Bool(_) | Scalar::Int(_) | Scalar::BigInt(_) | Scalar::Float(_)
        )
    }

    /// Python's exact int value of a bool or int; `None` for anything else.
    pub fn exact_int(&self) -> Option<BigInt> {
        match self {
            Scalar::Bool(b) => Some(BigInt::from(u8::from(*b))),
            Scalar::Int(i) => Some(BigInt::from(*i)),
            Scalar::BigInt(i) => Some(i.clone()),
            _ => None,
        }
    }

    /// A number as an `f64`, correctly rounded (ints beyond the float range become infinite; Python's
    /// `float(x)` refuses them: [`int_to_f64`]); `None` for anything else.
    pub fn as_f64(&self) -> Option<f64> {
        match self {
            Scalar::Bool(b) => Some(f64::from(u8::from(*b))),
            Scalar::Int(i) => Some(*i as f64),
            // Decimal text parses correctly rounded (to infinity beyond the float range).
            Scalar::BigInt(i) => i.to_string().parse().ok(),
            Scalar::Float(f) => Some(*f),
            _ => None,
        }
    }

    /// Python `==` between two numbers (bool, int, float; an int and a float compare exactly, as in
    /// Python: `2**63 - 1 != 2.0**63`); `None` when either is not a number.
    pub fn num_eq(&self, other: &Scalar) -> Option<bool> {
        Some(match (self, other) {
            (Scalar::Float(x), Scalar::Float(y)) => x == y,
            (Scalar::Float(f), i) | (i, Scalar::Float(f)) => {
                let i = i.exact_int()?;
                float_to_exact_int(*f).is_some_and(|f| f == i)
            }
            (a, b) => a.exact_int()? == b.exact_int()?,
        })
    }
}

/// Unsigned `digits` (no sign, prefix or `_`) in `radix` (2..=36), as Python's `int(text, radix)` reads
/// them once its own syntax is stripped; `None` if empty or a digit is invalid.
pub fn parse_int_digits(digits: &str, radix: u32) -> Option<BigInt> {
    if digits.is_empty() || !(2..=36).contains(&radix) || !digits.chars().all(|c| c.is_digit(radix))
    {
        return None;
    }
    BigInt::parse_bytes(digits.as_bytes(), radix)
}

/// Python's `float(int)`, which is correctly rounded and refuses ints beyond the float range (`None`).
pub fn int_to_f64(i: &BigInt) -> Option<f64> {
    // The decimal text parses correctly rounded, as CPython converts.
    i.to_string().parse::<f64>().ok().filter(|f| f.is_finite())
}

/// The exact int an integral, finite float equals (`1e20` is `10**20`); `None` otherwise.
pub fn float_to_exact_int(f: f64) -> Option<BigInt> {
    if f.is_finite() && f.fract() == 0.0 {
        BigInt::from_f64(f)
    } else {
        None
    }
}

/// Python's `repr(bytes)`: `b'…'`, quoted as `repr(str)` is, non-printable bytes as `\xNN`.
pub fn python_repr_bytes(b: &[u8]) -> String {
    let quote = if b.contains(&b'\'') && !b.contains(&b'"') {
        b'"'
    } else {
        b'\''
    };
    let mut out = String::from("b");
    out.push(quote as char);
    for &c in b {
        match c {
            b'\\' => out.push_str("\\\\"),
            b'\n' => out.push_str("\\n"),
            b'\r' => out.push_str("\\r"),
            b'\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c as char);
            }
            0x20..=0x7e => out.push(c as char),
            c => out.push_str(&format!("\\x{c:02x}")),
        }
    }
    out.push(quote as char);
    out
}

/// Python's `repr(str)`: single quotes unless the text has `'` and no `"`.
pub fn python_repr_str(s: &str) -> String {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    let mut out = String::with_capacity(s.len() + 2);
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                out.push_str(&format!("\\x{:02x}", c as u32))
            }
            c => out.push(c),
        }
    }
    out.push(quote);
    out
}

/// Python's `repr(float)`: shortest round-trip digits, `1e-05` style exponents, `inf`/`nan`.
pub fn python_float_repr(v: f64) -> String {
    if v.is_nan() {
        return "nan".into();
    }
    if v.is_infinite() {
        return if v > 0.0 { "inf".into() } else { "-inf".into() };
    }
    if v == 0.0 {
        return if v.is_sign_negative() {
            "-0.0".into()
        } else {
            "0.0".into()
        };
    }
    // Rust's `{:e}` gives the shortest round-trip mantissa; re-layout it the way Python does:
    // positional for 1e-4 <= |v| < 1e16, scientific otherwise.
    let sci = format!("{v:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let negative = mantissa.starts_with('-');
    let digits: String = mantissa.chars().filter(|c| c.is_ascii_digit()).collect();
    let sign = if negative { "-" } else { "" };
    if (-4..16).contains(&exp) {
        let point = exp + 1; // digits before the decimal point
        let s = if point <= 0 {
            format!("0.{}{}", "0".repeat((-point) as usize), digits)
        } else if (point as usize) >= digits.len() {
            format!("{}{}.0", digits, "0".repeat(point as usize - digits.len()))
        } else {
            format!(
                "{}.{}",
                &digits[..point as usize],
                &digits[point as usize..]
            )
        };
        format!("{sign}{s}")
    } else {
        let (first, rest) = digits.split_at(1);
        let mant = if rest.is_empty() {
            first.to_owned()
        } else {
            format!("{first}.{rest}")
        };
        let esign = if exp < 0 { '-' } else { '+' };
        format!("{sign}{mant}e{esign}{:02}", exp.abs())
    }
}

/// Tests only: the int a decimal literal stands for (an `i64` when it fits).
#[cfg(test)]
pub(crate) fn big(digits: &str) -> Scalar {
    Scalar::int(
        digits
            .parse()
            .unwrap_or_else(|_| panic!("bad test literal {digits}")),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[allow(clippy::approx_constant)] // 3.14 is a repr case, not an approximation of pi
    fn float_repr_matches_python() {
        let cases = [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (1e-4, "0.0001"),
            (1e-5, "1e-05"),
            (1.5e-7, "1.5e-07"),
            (1e16, "1e+16"),
            (123456789012345.0, "123456789012345.0"),
            (-2.5, "-2.5"),
            (3.14, "3.14"),
            (1e300, "1e+300"),
            (-0.0, "-0.0"),
            (f64::INFINITY, "inf"),
        ];
        for (v, want) in cases {
            assert_eq!(python_float_repr(v), want, "repr of {v:e}");
        }
    }

    #[test]
    fn numbers_compare_exactly_as_python() {
        use Scalar::{Bool, Float, Int, Str};
        let cases = [
            (Int(1), Float(1.0), Some(true)),
            (Bool(true), Int(1), Some(true)),
            (
                Int(i64::MAX),
                Float(9_223_372_036_854_775_808.0),
                Some(false),
            ),
            (
                big("9223372036854775808"),
                Float(9_223_372_036_854_775_808.0),
                Some(true),
            ),
            (big("100000000000000000000"), Float(1e20), Some(true)),
            (big("100000000000000000001"), Float(1e20), Some(false)),
            (big("9223372036854775808"), Int(i64::MAX), Some(false)),
            // An f64 conversion would call these equal; Python compares exactly.
            (
                Int(9_007_199_254_740_993),
                Float(9_007_199_254_740_992.0),
                Some(false),
            ),
            (Float(f64::NAN), Float(f64::NAN), Some(false)),
            (
                Float(f64::INFINITY),
                big("100000000000000000000"),
                Some(false),
            ),
            (Str("1".into()), Int(1), None),
            (Scalar::None, Int(0), None),
        ];
        for (a, b, want) in cases {
            assert_eq!(a.num_eq(&b), want, "{a:?} == {b:?}");
            assert_eq!(b.num_eq(&a), want, "{b:?} == {a:?}");
        }
    }

    #[test]
    fn repr_str_and_type_names_follow_python() {
        let repr = [
            (Scalar::None, "None"),
            (Scalar::Bool(false), "False"),
            (Scalar::Float(1e-7), "1e-07"),
            (Scalar::Str("it's".into()), "\"it's\""),
            (Scalar::Str("a\\b".into()), "'a\\\\b'"),
            (Scalar::Bytes(b"a'\x00".to_vec()), "b\"a'\\x00\""),
            (big("-99999999999999999999"), "-99999999999999999999"),
        ];
        for (v, want) in repr {
            assert_eq!(v.repr(), want);
        }
        assert_eq!(Scalar::Str("it's".into()).str(), "it's");
        assert_eq!(Scalar::Bool(true).str(), "True");
        assert_eq!(big("99999999999999999999").type_name(), "int");
        assert_eq!(Scalar::None.type_name(), "NoneType");
        assert!(!Scalar::Str(String::new()).truthy());
        assert!(Scalar::Float(f64::NAN).truthy());
        assert!(big("-99999999999999999999").truthy());
    }

    #[test]
    fn ints_stay_in_i64_when_they_fit_and_parse_strictly() {
        for v in [0, 1, -1, 999_999_999, 1_000_000_000, i64::MAX, i64::MIN] {
            assert_eq!(Scalar::int(BigInt::from(v)), Scalar::Int(v));
        }
        assert!(matches!(big("9223372036854775808"), Scalar::BigInt(_)));
        assert!(matches!(big("-9223372036854775809"), Scalar::BigInt(_)));
        let cases = [
            ("9223372036854775808", 10, "9223372036854775808"),
            ("10000000000000000", 16, "18446744073709551616"),
            ("1000000000000000000000", 8, "9223372036854775808"),
            ("000000000000000000000000001", 10, "1"),
            ("zz", 36, "1295"),
        ];
        for (digits, radix, want) in cases {
            let got = parse_int_digits(digits, radix).map(|b| b.to_string());
            assert_eq!(got.as_deref(), Some(want), "{digits} in base {radix}");
        }
        for bad in ["12a", "", "-1", "+1", "1_0", " 1"] {
            assert_eq!(parse_int_digits(bad, 10), None, "{bad:?}");
        }
        assert_eq!(
            float_to_exact_int(1e20).map(|b| b.to_string()).as_deref(),
            Some("100000000000000000000")
        );
        assert_eq!(float_to_exact_int(1.5), None);
        assert_eq!(float_to_exact_int(f64::INFINITY), None);
        let huge: BigInt = "9".repeat(400).parse().unwrap_or_default();
        assert_eq!(int_to_f64(&huge), None);
        assert_eq!(
            int_to_f64(&(BigInt::from(1u8) << 64u32)),
            Some(18446744073709551616.0)
        );
    }
}
