//! Python's unbounded `int` for the rare config integers beyond `i64`: parsing in any base, exact
//! `+ - * //`, and canonical decimal text (what [`Value::BigInt`] stores).
//!
//! Deliberately small: magnitudes are little-endian base-10⁹ limbs, and division is decimal long
//! division. Config integers are a few dozen digits at most, so simplicity beats speed here.

use std::cmp::Ordering;
use std::fmt;

#[cfg(test)]
use crate::node::Key;
use crate::node::Value;

const LIMB: u64 = 1_000_000_000;

/// A signed arbitrary-precision integer. Zero is never negative; `mag` has no high zero limbs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct BigInt {
    negative: bool,
    /// Little-endian base-10⁹ digits.
    mag: Vec<u32>,
}

impl BigInt {
    pub fn zero() -> BigInt {
        BigInt {
            negative: false,
            mag: Vec::new(),
        }
    }

    pub(crate) fn from_i64(v: i64) -> BigInt {
        let mut mag = Vec::new();
        let mut m = v.unsigned_abs();
        while m > 0 {
            mag.push((m % LIMB) as u32);
            m /= LIMB;
        }
        BigInt {
            negative: v < 0,
            mag,
        }
    }

    /// Unsigned `digits` (no sign, prefix or `_`) in `radix` (2..=36); `None` if empty or a digit is invalid.
    pub(crate) fn parse_radix(digits: &str, radix: u32) -> Option<BigInt> {
        if digits.is_empty() || !(2..=36).contains(&radix) {
            return None;
        }
        let mut n = BigInt::zero();
        for ch in digits.chars() {
            let d = ch.to_digit(radix)?;
            mul_small_add(&mut n.mag, radix, d);
        }
        Some(n)
    }

    /// Decimal text with an optional leading `-` (as [`Value::BigInt`] stores it).
    pub(crate) fn parse_decimal(text: &str) -> Option<BigInt> {
        let (negative, digits) = match text.strip_prefix('-') {
            Some(rest) => (true, rest),
            None => (false, text),
        };
        Some(BigInt::parse_radix(digits, 10)?.with_sign(negative))
    }

    /// The integer a config value holds, if it is one (`Int` or `BigInt`; Python bools are ints too,
    /// but callers decide that themselves).
    pub(crate) fn from_value(v: &Value) -> Option<BigInt> {
        match v {
            Value::Int(i) => Some(BigInt::from_i64(*i)),
            Value::BigInt(s) => BigInt::parse_decimal(s),
            _ => None,
        }
    }

    pub fn is_zero(&self) -> bool {
        self.mag.is_empty()
    }

    pub(crate) fn is_negative(&self) -> bool {
        self.negative
    }

    pub(crate) fn negated(self) -> BigInt {
        let negative = !self.negative;
        self.with_sign(negative)
    }

    fn with_sign(mut self, negative: bool) -> BigInt {
        trim(&mut self.mag);
        self.negative = negative && !self.mag.is_empty();
        self
    }

    pub(crate) fn to_i64(&self) -> Option<i64> {
        if self.mag.len() > 3 {
            return None;
        }
        let mut m: i128 = 0;
        for &limb in self.mag.iter().rev() {
            m = m * i128::from(LIMB as u32) + i128::from(limb);
        }
        i64::try_from(if self.negative { -m } else { m }).ok()
    }

    /// `Value::Int` when it fits in `i64`, else `Value::BigInt`: the one way big results enter the tree.
    pub(crate) fn into_value(self) -> Value {
        match self.to_i64() {
            Some(i) => Value::Int(i),
            None => Value::BigInt(self.to_string()),
        }
    }

    /// `Key::Int` when it fits in `i64`, else `Key::BigInt`.
    #[cfg(test)]
    pub(crate) fn into_key(self) -> Key {
        match self.to_i64() {
            Some(i) => Key::Int(i),
            None => Key::BigInt(self.to_string()),
        }
    }

    pub fn add(&self, other: &BigInt) -> BigInt {
        if self.negative == other.negative {
            return BigInt {
                negative: self.negative,
                mag: add_mag(&self.mag, &other.mag),
            }
            .with_sign(self.negative);
        }
        match cmp_mag(&self.mag, &other.mag) {
            Ordering::Equal => BigInt::zero(),
            Ordering::Greater => BigInt {
                negative: false,
                mag: sub_mag(&self.mag, &other.mag),
            }
            .with_sign(self.negative),
            Ordering::Less => BigInt {
                negative: false,
                mag: sub_mag(&other.mag, &self.mag),
            }
            .with_sign(other.negative),
        }
    }

    pub(crate) fn sub(&self, other: &BigInt) -> BigInt {
        self.add(&other.clone().negated())
    }

    pub(crate) fn mul(&self, other: &BigInt) -> BigInt {
        let mut out = vec![0u64; self.mag.len() + other.mag.len()];
        for (i, &a) in self.mag.iter().enumerate() {
            let mut carry = 0u64;
            for (j, &b) in other.mag.iter().enumerate() {
                let cur = out[i + j] + u64::from(a) * u64::from(b) + carry;
                out[i + j] = cur % LIMB;
                carry = cur / LIMB;
            }
            let mut k = i + other.mag.len();
            while carry > 0 {
                let cur = out[k] + carry;
                out[k] = cur % LIMB;
                carry = cur / LIMB;
                k += 1;
            }
        }
        let mag = out.into_iter().map(|l| l as u32).collect();
        BigInt {
            negative: false,
            mag,
        }
        .with_sign(self.negative != other.negative)
    }

    /// Python's `//` (floor division) and `%`; `None` when dividing by zero.
    pub(crate) fn div_mod_floor(&self, other: &BigInt) -> Option<(BigInt, BigInt)> {
        if other.is_zero() {
            return None;
        }
        let (q, r) = div_mag(&self.mag, &other.mag);
        let mut q = BigInt {
            negative: false,
            mag: q,
        }
        .with_sign(self.negative != other.negative);
        let mut r = BigInt {
            negative: false,
            mag: r,
        }
        .with_sign(self.negative);
        if !r.is_zero() && self.negative != other.negative {
            q = q.sub(&BigInt::from_i64(1));
            r = r.add(other);
        }
        Some((q, r))
    }
}

impl Ord for BigInt {
    fn cmp(&self, other: &BigInt) -> Ordering {
        match (self.negative, other.negative) {
            (false, true) => Ordering::Greater,
            (true, false) => Ordering::Less,
            (false, false) => cmp_mag(&self.mag, &other.mag),
            (true, true) => cmp_mag(&other.mag, &self.mag),
        }
    }
}

impl PartialOrd for BigInt {
    fn partial_cmp(&self, other: &BigInt) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl fmt::Display for BigInt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Some((top, rest)) = self.mag.split_last() else {
            return f.write_str("0");
        };
        if self.negative {
            f.write_str("-")?;
        }
        write!(f, "{top}")?;
        for limb in rest.iter().rev() {
            write!(f, "{limb:09}")?;
        }
        Ok(())
    }
}

/// Python `==` between numeric config values (bool, int, float), exact across ints and floats as
/// Python is (`2**63 - 1 != 2.0**63`); `None` when either side is not a number.
pub(crate) fn numbers_equal(a: &Value, b: &Value) -> Option<bool> {
    enum N {
        I(BigInt),
        F(f64),
    }
    let num = |v: &Value| match v {
        Value::Bool(b) => Some(N::I(BigInt::from_i64(i64::from(*b)))),
        Value::Float(f) => Some(N::F(*f)),
        other => BigInt::from_value(other).map(N::I),
    };
    Some(match (num(a)?, num(b)?) {
        (N::I(x), N::I(y)) => x == y,
        (N::F(x), N::F(y)) => x == y,
        (N::I(i), N::F(f)) | (N::F(f), N::I(i)) => {
            // `{:.0}` prints an integral f64's exact decimal value.
            f.is_finite()
                && f.fract() == 0.0
                && BigInt::parse_decimal(&format!("{f:.0}")) == Some(i)
        }
    })
}

fn trim(mag: &mut Vec<u32>) {
    while mag.last() == Some(&0) {
        mag.pop();
    }
}

fn mul_small_add(mag: &mut Vec<u32>, mul: u32, add: u32) {
    let mut carry = u64::from(add);
    for limb in mag.iter_mut() {
        let cur = u64::from(*limb) * u64::from(mul) + carry;
        *limb = (cur % LIMB) as u32;
        carry = cur / LIMB;
    }
    while carry > 0 {
        mag.push((carry % LIMB) as u32);
        carry /= LIMB;
    }
}

fn cmp_mag(a: &[u32], b: &[u32]) -> Ordering {
    a.len()
        .cmp(&b.len())
        .then_with(|| a.iter().rev().cmp(b.iter().rev()))
}

fn add_mag(a: &[u32], b: &[u32]) -> Vec<u32> {
    let mut out = Vec::with_capacity(a.len().max(b.len()) + 1);
    let mut carry = 0u64;
    for i in 0..a.len().max(b.len()) {
        let cur = u64::from(a.get(i).copied().unwrap_or(0))
            + u64::from(b.get(i).copied().unwrap_or(0))
            + carry;
        out.push((cur % LIMB) as u32);
        carry = cur / LIMB;
    }
    if carry > 0 {
        out.push(carry as u32);
    }
    out
}

/// `a - b` for `a >= b`.
fn sub_mag(a: &[u32], b: &[u32]) -> Vec<u32> {
    let mut out = Vec::with_capacity(a.len());
    let mut borrow = 0i64;
    for (i, &limb) in a.iter().enumerate() {
        let mut cur = i64::from(limb) - i64::from(b.get(i).copied().unwrap_or(0)) - borrow;
        borrow = 0;
        if cur < 0 {
            cur += LIMB as i64;
            borrow = 1;
        }
        out.push(cur as u32);
    }
    trim(&mut out);
    out
}

/// Truncating magnitude division, one decimal digit of the dividend at a time.
fn div_mag(a: &[u32], b: &[u32]) -> (Vec<u32>, Vec<u32>) {
    let digits = BigInt {
        negative: false,
        mag: a.to_vec(),
    }
    .to_string();
    let mut quotient = Vec::new();
    let mut rem: Vec<u32> = Vec::new();
    for ch in digits.chars() {
        mul_small_add(&mut rem, 10, ch.to_digit(10).unwrap_or(0));
        let mut q = 0;
        while cmp_mag(&rem, b) != Ordering::Less {
            rem = sub_mag(&rem, b);
            q += 1;
        }
        mul_small_add(&mut quotient, 10, q);
    }
    trim(&mut quotient);
    (quotient, rem)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn big(s: &str) -> BigInt {
        BigInt::parse_decimal(s).unwrap_or_else(|| panic!("bad test literal {s}"))
    }

    #[test]
    fn parses_every_base_to_python_values() {
        let cases = [
            ("9223372036854775808", 10, "9223372036854775808"),
            (
                "123456789012345678901234567890",
                10,
                "123456789012345678901234567890",
            ),
            ("10000000000000000", 16, "18446744073709551616"),
            ("1".repeat(70).as_str(), 2, "1180591620717411303423"),
            ("1000000000000000000000", 8, "9223372036854775808"),
            ("000000000000000000000000001", 10, "1"),
            ("0", 10, "0"),
        ]
        .map(|(d, r, w)| (d.to_owned(), r, w));
        for (digits, radix, want) in cases {
            let got = BigInt::parse_radix(&digits, radix).map(|b| b.to_string());
            assert_eq!(got.as_deref(), Some(want), "{digits} in base {radix}");
        }
        assert_eq!(BigInt::parse_radix("12a", 10), None);
        assert_eq!(BigInt::parse_radix("", 10), None);
        assert_eq!(BigInt::parse_decimal("-"), None);
        assert_eq!(big("-0").to_string(), "0");
    }

    #[test]
    fn i64_round_trips_and_boundaries() {
        for v in [0, 1, -1, 999_999_999, 1_000_000_000, i64::MAX, i64::MIN] {
            let b = BigInt::from_i64(v);
            assert_eq!(b.to_string(), v.to_string());
            assert_eq!(b.to_i64(), Some(v));
            assert_eq!(b.into_value(), Value::Int(v));
        }
        assert_eq!(big("9223372036854775808").to_i64(), None);
        assert_eq!(big("-9223372036854775809").to_i64(), None);
        assert_eq!(
            big("-9223372036854775809").into_value(),
            Value::BigInt("-9223372036854775809".into())
        );
        assert_eq!(
            big("99999999999999999999").into_key(),
            Key::BigInt("99999999999999999999".into())
        );
    }

    #[test]
    fn numbers_compare_exactly_as_python() {
        let big = |d: &str| Value::BigInt(d.into());
        let cases = [
            (Value::Int(1), Value::Float(1.0), Some(true)),
            (Value::Bool(true), Value::Int(1), Some(true)),
            (
                Value::Int(i64::MAX),
                Value::Float(9_223_372_036_854_775_808.0),
                Some(false),
            ),
            (
                big("9223372036854775808"),
                Value::Float(9_223_372_036_854_775_808.0),
                Some(true),
            ),
            (big("100000000000000000000"), Value::Float(1e20), Some(true)),
            (
                big("100000000000000000001"),
                Value::Float(1e20),
                Some(false),
            ),
            (
                big("9223372036854775808"),
                Value::Int(i64::MAX),
                Some(false),
            ),
            (Value::Float(f64::NAN), Value::Float(f64::NAN), Some(false)),
            (Value::Int(1), Value::Str("1".into()), None),
        ];
        for (a, b, want) in cases {
            assert_eq!(numbers_equal(&a, &b), want, "{a:?} == {b:?}");
            assert_eq!(numbers_equal(&b, &a), want, "{b:?} == {a:?}");
        }
    }

    /// Expected values computed with CPython.
    #[test]
    fn arithmetic_matches_python() {
        let max = BigInt::from_i64(i64::MAX);
        assert_eq!(
            max.add(&BigInt::from_i64(1)).to_string(),
            "9223372036854775808"
        );
        assert_eq!(
            max.mul(&max).to_string(),
            "85070591730234615847396907784232501249"
        );
        assert_eq!(
            BigInt::from_i64(i64::MIN)
                .sub(&BigInt::from_i64(1))
                .to_string(),
            "-9223372036854775809"
        );
        assert_eq!(
            big("-5").mul(&big("123456789012345678901")).to_string(),
            "-617283945061728394505"
        );
        assert_eq!(big("5").add(&big("-7")).to_string(), "-2");
        assert_eq!(big("-5").add(&big("5")).to_string(), "0");
        let floor = |a: &str, b: &str| {
            big(a)
                .div_mod_floor(&big(b))
                .map(|(q, r)| (q.to_string(), r.to_string()))
        };
        let s = |a: &str, b: &str| Some((a.to_owned(), b.to_owned()));
        assert_eq!(floor("7", "2"), s("3", "1"));
        assert_eq!(floor("-7", "2"), s("-4", "1"));
        assert_eq!(floor("7", "-2"), s("-4", "-1"));
        assert_eq!(floor("-7", "-2"), s("3", "-1"));
        assert_eq!(floor("6", "-3"), s("-2", "0"));
        assert_eq!(
            floor("123456789012345678901234567890", "987654321987"),
            s("124999998748520313", "645722545959")
        );
        assert_eq!(
            floor(
                "85070591730234615847396907784232501249",
                "9223372036854775807"
            ),
            s("9223372036854775807", "0")
        );
        assert_eq!(floor("1", "0"), None);
        assert!(big("-99999999999999999999") < big("-1"));
        assert!(big("99999999999999999999") > big("9223372036854775807"));
        assert!(big("-3") < big("2"));
        assert!(big("-3") > big("-4"));
    }
}
