//! Scalar typing as OmegaConf's YAML loader does it: PyYAML's YAML 1.1 implicit resolvers plus OmegaConf's
//! float rule (no timestamps), and PyYAML's constructors for explicitly tagged `!!int`/`!!float`/`!!bool`/
//! `!!binary` scalars (which follow Python's `int()`/`float()`).
//!
//! The resolvers are hand-written matchers for PyYAML's regular expressions; each alternative is written
//! the way the regex reads, so the two can be compared line by line.

use num_bigint::BigInt;

use crate::node::Value;
use crate::scalar::{Scalar, parse_int_digits};

/// What a plain (unquoted, untagged) scalar resolves to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Implicit {
    Null,
    Bool(bool),
    Int,
    Float,
    /// `<<`: a merge key.
    Merge,
    /// `=`: PyYAML's "value" tag, which has no constructor.
    Value,
    Str,
}

/// Why a scalar could not be turned into the value its tag asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ScalarError {
    /// Not a valid literal for the type.
    Invalid,
}

/// Resolve a plain scalar the way OmegaConf's loader does. Order matters only where PyYAML's resolvers
/// for one first character overlap, and it is theirs: YAML 1.1 float, int, then OmegaConf's float.
pub(crate) fn resolve_plain(text: &str) -> Implicit {
    let Some(&first) = text.as_bytes().first() else {
        return Implicit::Null;
    };
    if b"yYnNtTfFoO".contains(&first)
        && let Some(b) = yaml11_bool(text)
    {
        return Implicit::Bool(b);
    }
    if b"-+0123456789.".contains(&first) {
        if yaml11_float(text) {
            return Implicit::Float;
        }
        if yaml11_int(text) {
            return Implicit::Int;
        }
        if omegaconf_float(text) {
            return Implicit::Float;
        }
    }
    match text {
        "<<" => Implicit::Merge,
        "~" | "null" | "Null" | "NULL" => Implicit::Null,
        "=" => Implicit::Value,
        _ => Implicit::Str,
    }
}

fn yaml11_bool(text: &str) -> Option<bool> {
    match text {
        "yes" | "Yes" | "YES" | "true" | "True" | "TRUE" | "on" | "On" | "ON" => Some(true),
        "no" | "No" | "NO" | "false" | "False" | "FALSE" | "off" | "Off" | "OFF" => Some(false),
        _ => None,
    }
}

/// A cursor over ASCII bytes for the resolver matchers. Every `eat*` only advances on success.
#[derive(Clone, Copy)]
struct Cur<'a> {
    b: &'a [u8],
    i: usize,
}

impl<'a> Cur<'a> {
    fn new(text: &'a str) -> Self {
        Cur {
            b: text.as_bytes(),
            i: 0,
        }
    }
    fn peek(&self) -> Option<u8> {
        self.b.get(self.i).copied()
    }
    fn peek_at(&self, k: usize) -> Option<u8> {
        self.b.get(self.i + k).copied()
    }
    fn done(&self) -> bool {
        self.i >= self.b.len()
    }
    fn eat(&mut self, f: impl Fn(u8) -> bool) -> bool {
        match self.peek() {
            Some(c) if f(c) => {
                self.i += 1;
                true
            }
            _ => false,
        }
    }
    fn eat_byte(&mut self, c: u8) -> bool {
        self.eat(|x| x == c)
    }
    fn eat_str(&mut self, s: &str) -> bool {
        if self.b[self.i..].starts_with(s.as_bytes()) {
            self.i += s.len();
            true
        } else {
            false
        }
    }
    fn eat_while(&mut self, f: impl Fn(u8) -> bool) -> usize {
        let start = self.i;
        while self.eat(&f) {}
        self.i - start
    }
    /// `[-+]?`
    fn sign(&mut self) {
        self.eat(|c| c == b'-' || c == b'+');
    }
    /// `[0-9][0-9_]*`
    fn digit_then_digits_or_underscores(&mut self) -> bool {
        self.eat(is_digit) && {
            self.eat_while(digit_or_underscore);
            true
        }
    }
    /// `[0-9]+(?:_[0-9]+)*`
    fn grouped_digits(&mut self) -> bool {
        if self.eat_while(is_digit) == 0 {
            return false;
        }
        while self.peek() == Some(b'_') && self.peek_at(1).is_some_and(is_digit) {
            self.i += 1;
            self.eat_while(is_digit);
        }
        true
    }
    /// `(?::[0-5]?[0-9])+`, greedy: what follows is never a digit, so greedy needs no backtracking.
    fn sexagesimal_groups(&mut self) -> bool {
        let mut groups = 0;
        while self.peek() == Some(b':') {
            let two = self.peek_at(1).is_some_and(|c| (b'0'..=b'5').contains(&c))
                && self.peek_at(2).is_some_and(is_digit);
            if two {
                self.i += 3;
            } else if self.peek_at(1).is_some_and(is_digit) {
                self.i += 2;
            } else {
                break;
            }
            groups += 1;
        }
        groups > 0
    }
    /// `(?:[eE][-+][0-9]+)?` (sign required) or, with `sign_optional`, `(?:[eE][-+]?[0-9]+)?`, then end.
    fn optional_exponent_then_end(&mut self, sign_optional: bool) -> bool {
        if self.eat(|c| c == b'e' || c == b'E') {
            let signed = self.eat(|c| c == b'-' || c == b'+');
            if !signed && !sign_optional {
                return false;
            }
            if self.eat_while(is_digit) == 0 {
                return false;
            }
        }
        self.done()
    }
}

fn is_digit(c: u8) -> bool {
    c.is_ascii_digit()
}

fn digit_or_underscore(c: u8) -> bool {
    c.is_ascii_digit() || c == b'_'
}

/// Any of the alternatives matches the whole text.
fn any_alt(text: &str, alts: &[fn(&mut Cur) -> bool]) -> bool {
    alts.iter().any(|alt| {
        let mut c = Cur::new(text);
        alt(&mut c) && c.done()
    })
}

/// `[-+]?\.(?:inf|Inf|INF)` and `\.(?:nan|NaN|NAN)`, shared by both float resolvers.
fn special_float(c: &mut Cur) -> bool {
    let mut signed = *c;
    signed.sign();
    if signed.eat_byte(b'.')
        && (signed.eat_str("inf") || signed.eat_str("Inf") || signed.eat_str("INF"))
    {
        *c = signed;
        return true;
    }
    c.eat_byte(b'.') && (c.eat_str("nan") || c.eat_str("NaN") || c.eat_str("NAN"))
}

/// PyYAML's YAML 1.1 float regex.
pub(crate) fn yaml11_float(text: &str) -> bool {
    any_alt(
        text,
        &[
            // [-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+][0-9]+)?
            |c| {
                c.sign();
                c.digit_then_digits_or_underscores() && c.eat_byte(b'.') && {
                    c.eat_while(digit_or_underscore);
                    c.optional_exponent_then_end(false)
                }
            },
            // \.[0-9][0-9_]*(?:[eE][-+][0-9]+)?
            |c| {
                c.eat_byte(b'.')
                    && c.digit_then_digits_or_underscores()
                    && c.optional_exponent_then_end(false)
            },
            // [-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+\.[0-9_]*
            |c| {
                c.sign();
                c.digit_then_digits_or_underscores()
                    && c.sexagesimal_groups()
                    && c.eat_byte(b'.')
                    && {
                        c.eat_while(digit_or_underscore);
                        true
                    }
            },
            special_float,
        ],
    )
}

/// The float regex OmegaConf adds to its loader (accepts `1e-4`, `1e5`, `1_000.5`).
pub(crate) fn omegaconf_float(text: &str) -> bool {
    any_alt(
        text,
        &[
            // [-+]?[0-9]+(?:_[0-9]+)*\.[0-9_]*(?:[eE][-+]?[0-9]+)?
            |c| {
                c.sign();
                c.grouped_digits() && c.eat_byte(b'.') && {
                    c.eat_while(digit_or_underscore);
                    c.optional_exponent_then_end(true)
                }
            },
            // [-+]?[0-9]+(?:_[0-9]+)*(?:[eE][-+]?[0-9]+)
            |c| {
                c.sign();
                c.grouped_digits()
                    && c.peek().is_some_and(|x| x == b'e' || x == b'E')
                    && c.optional_exponent_then_end(true)
            },
            // \.[0-9]+(?:_[0-9]+)*(?:[eE][-+][0-9]+)?
            |c| c.eat_byte(b'.') && c.grouped_digits() && c.optional_exponent_then_end(false),
            // [-+]?[0-9]+(?:_[0-9]+)*(?::[0-5]?[0-9])+\.[0-9_]*
            |c| {
                c.sign();
                c.grouped_digits() && c.sexagesimal_groups() && c.eat_byte(b'.') && {
                    c.eat_while(digit_or_underscore);
                    true
                }
            },
            special_float,
        ],
    )
}

/// PyYAML's YAML 1.1 int regex.
pub(crate) fn yaml11_int(text: &str) -> bool {
    any_alt(
        text,
        &[
            // [-+]?0b[0-1_]+
            |c| {
                c.sign();
                c.eat_str("0b") && c.eat_while(|x| x == b'0' || x == b'1' || x == b'_') > 0
            },
            // [-+]?0[0-7_]+
            |c| {
                c.sign();
                c.eat_byte(b'0') && c.eat_while(|x| (b'0'..=b'7').contains(&x) || x == b'_') > 0
            },
            // [-+]?(?:0|[1-9][0-9_]*)
            |c| {
                c.sign();
                c.eat_byte(b'0')
                    || (c.eat(|x| (b'1'..=b'9').contains(&x)) && {
                        c.eat_while(digit_or_underscore);
                        true
                    })
            },
            // [-+]?0x[0-9a-fA-F_]+
            |c| {
                c.sign();
                c.eat_str("0x") && c.eat_while(|x| x.is_ascii_hexdigit() || x == b'_') > 0
            },
            // [-+]?[1-9][0-9_]*(?::[0-5]?[0-9])+
            |c| {
                c.sign();
                c.eat(|x| (b'1'..=b'9').contains(&x)) && {
                    c.eat_while(digit_or_underscore);
                    c.sexagesimal_groups()
                }
            },
        ],
    )
}

/// PyYAML's timestamp regex. OmegaConf's loader drops it (dates stay strings), but PyYAML's dumper
/// still quotes such strings, so the emitter asks.
pub(crate) fn yaml11_timestamp(text: &str) -> bool {
    fn digits(c: &mut Cur, min: usize, max: usize) -> bool {
        let mut n = 0;
        while n < max && c.eat(is_digit) {
            n += 1;
        }
        n >= min
    }
    any_alt(
        text,
        &[
            // [0-9]{4}-[0-9]{2}-[0-9]{2}
            |c| {
                digits(c, 4, 4)
                    && c.eat_byte(b'-')
                    && digits(c, 2, 2)
                    && c.eat_byte(b'-')
                    && digits(c, 2, 2)
            },
            // [0-9]{4}-[0-9]{1,2}-[0-9]{1,2}(?:[Tt]|[ \t]+)[0-9]{1,2}:[0-9]{2}:[0-9]{2}(?:\.[0-9]*)?
            //   (?:[ \t]*(?:Z|[-+][0-9]{1,2}(?::[0-9]{2})?))?
            |c| {
                let date = digits(c, 4, 4)
                    && c.eat_byte(b'-')
                    && digits(c, 1, 2)
                    && c.eat_byte(b'-')
                    && digits(c, 1, 2)
                    && (c.eat(|x| x == b'T' || x == b't')
                        || c.eat_while(|x| x == b' ' || x == b'\t') > 0);
                let time = date
                    && digits(c, 1, 2)
                    && c.eat_byte(b':')
                    && digits(c, 2, 2)
                    && c.eat_byte(b':')
                    && digits(c, 2, 2);
                if !time {
                    return false;
                }
                if c.eat_byte(b'.') {
                    c.eat_while(is_digit);
                }
                if c.done() {
                    return true;
                }
                c.eat_while(|x| x == b' ' || x == b'\t');
                if c.eat_byte(b'Z') {
                    return true;
                }
                c.eat(|x| x == b'-' || x == b'+') && digits(c, 1, 2) && {
                    if c.eat_byte(b':') {
                        digits(c, 2, 2)
                    } else {
                        true
                    }
                }
            },
        ],
    )
}

/// PyYAML's `construct_yaml_int`: strips `_`, takes the sign, then `0b`/`0x`/leading-`0` octal/`a:b`
/// sexagesimal/decimal, each through Python's `int(text, base)`. Python ints are unbounded, so a
/// value outside `i64` becomes [`Scalar::BigInt`].
pub(crate) fn construct_int(text: &str) -> Result<Value, ScalarError> {
    let value: String = text.chars().filter(|&c| c != '_').collect();
    let (negative, body) = split_sign(&value);
    if body.is_empty() {
        return Err(ScalarError::Invalid);
    }
    let magnitude = if body == "0" {
        BigInt::ZERO
    } else if let Some(bin) = body.strip_prefix("0b") {
        python_int(bin, 2)?
    } else if let Some(hex) = body.strip_prefix("0x") {
        python_int(hex, 16)?
    } else if body.starts_with('0') {
        python_int(body, 8)?
    } else if body.contains(':') {
        let mut total = BigInt::ZERO;
        for part in body.split(':') {
            total = total * 60 + python_int(part, 10)?;
        }
        total
    } else {
        python_int(body, 10)?
    };
    Ok(Value::Scalar(Scalar::int(if negative {
        -magnitude
    } else {
        magnitude
    })))
}

/// Split a leading `-`/`+` the way PyYAML does (`value[0] in '+-'`).
fn split_sign(value: &str) -> (bool, &str) {
    if let Some(rest) = value.strip_prefix('-') {
        (true, rest)
    } else if let Some(rest) = value.strip_prefix('+') {
        (false, rest)
    } else {
        (false, value)
    }
}

/// Python's `int(text, base)` for the bases PyYAML uses, on text without underscores: surrounding
/// whitespace, an optional sign and the base's `0x`/`0o`/`0b` prefix are accepted.
fn python_int(text: &str, base: u32) -> Result<BigInt, ScalarError> {
    let t = text.trim();
    let (negative, t) = split_sign(t);
    let prefix = match base {
        16 => Some(["0x", "0X"]),
        8 => Some(["0o", "0O"]),
        2 => Some(["0b", "0B"]),
        _ => None,
    };
    let digits = prefix
        .and_then(|ps| ps.iter().find_map(|p| t.strip_prefix(p)))
        .unwrap_or(t);
    let magnitude = parse_int_digits(digits, base).ok_or(ScalarError::Invalid)?;
    Ok(if negative { -magnitude } else { magnitude })
}

/// PyYAML's `construct_yaml_float`: strips `_`, lowercases, takes the sign, then `.inf`/`.nan`/`a:b.c`
/// sexagesimal/Python `float()`.
pub(crate) fn construct_float(text: &str) -> Result<f64, ScalarError> {
    let value: String = text
        .chars()
        .filter(|&c| c != '_')
        .collect::<String>()
        .to_lowercase();
    let sign = if value.starts_with('-') { -1.0 } else { 1.0 };
    let (_, body) = split_sign(&value);
    if value.is_empty() {
        return Err(ScalarError::Invalid);
    }
    if body == ".inf" {
        return Ok(sign * f64::INFINITY);
    }
    if body == ".nan" {
        return Ok(f64::NAN);
    }
    if body.contains(':') {
        let mut total = 0.0_f64;
        let mut base = 1.0_f64;
        for part in body.split(':').rev() {
            total += python_float(part)? * base;
            base *= 60.0;
        }
        return Ok(sign * total);
    }
    Ok(sign * python_float(body)?)
}

/// Python's `float(text)` on text without underscores. Rust's parser accepts the same literal forms
/// (`1.`, `.5`, `1e5`, `inf`, `infinity`, `nan`, signs) once surrounding whitespace is trimmed.
fn python_float(text: &str) -> Result<f64, ScalarError> {
    text.trim().parse::<f64>().map_err(|_| ScalarError::Invalid)
}

/// PyYAML's `construct_yaml_bool` for an explicit `!!bool`: case-insensitive yes/no/true/false/on/off.
pub(crate) fn construct_bool(text: &str) -> Result<bool, ScalarError> {
    match text.to_lowercase().as_str() {
        "yes" | "true" | "on" => Ok(true),
        "no" | "false" | "off" => Ok(false),
        _ => Err(ScalarError::Invalid),
    }
}

/// PyYAML's `construct_yaml_binary`: ASCII only, then Python's lenient `binascii.a2b_base64`, which
/// skips characters outside the alphabet and stops at a complete padding sequence.
pub(crate) fn construct_binary(text: &str) -> Result<Vec<u8>, ScalarError> {
    if !text.is_ascii() {
        return Err(ScalarError::Invalid);
    }
    let mut out = Vec::with_capacity(text.len() / 4 * 3);
    let mut quad_pos = 0u8;
    let mut pads = 0u8;
    let mut left: u32 = 0;
    for c in text.bytes() {
        if c == b'=' {
            if quad_pos >= 2 {
                pads += 1;
                if quad_pos + pads >= 4 {
                    return Ok(out);
                }
            }
            continue;
        }
        let Some(v) = base64_value(c) else { continue };
        match quad_pos {
            0 => {
                left = v;
                quad_pos = 1;
            }
            1 => {
                out.push(((left << 2) | (v >> 4)) as u8);
                left = v & 0x0f;
                quad_pos = 2;
            }
            2 => {
                out.push(((left << 4) | (v >> 2)) as u8);
                left = v & 0x03;
                quad_pos = 3;
            }
            _ => {
                out.push(((left << 6) | v) as u8);
                left = 0;
                quad_pos = 0;
            }
        }
    }
    if quad_pos == 0 {
        Ok(out)
    } else {
        Err(ScalarError::Invalid)
    }
}

fn base64_value(c: u8) -> Option<u32> {
    let v = match c {
        b'A'..=b'Z' => c - b'A',
        b'a'..=b'z' => c - b'a' + 26,
        b'0'..=b'9' => c - b'0' + 52,
        b'+' => 62,
        b'/' => 63,
        _ => return None,
    };
    Some(u32::from(v))
}

/// Python's `int(text)` succeeds (base 10, whitespace, sign, `_` between digits). OmegaConf's dumper
/// single-quotes such strings.
pub(crate) fn python_is_int(text: &str) -> bool {
    let t = text.trim();
    let (_, body) = split_sign(t);
    let mut c = Cur::new(body);
    c.grouped_digits() && c.done()
}

/// Python's `float(text)` succeeds. OmegaConf's dumper single-quotes such strings.
pub(crate) fn python_is_float(text: &str) -> bool {
    let t = text.trim();
    let (_, body) = split_sign(t);
    let lower = body.to_ascii_lowercase();
    if matches!(lower.as_str(), "inf" | "infinity" | "nan") {
        return true;
    }
    let mut c = Cur::new(body);
    let int_part = c.grouped_digits();
    let frac_part = if c.eat_byte(b'.') {
        c.grouped_digits()
    } else {
        false
    };
    if !(int_part || frac_part) {
        return false;
    }
    if c.eat(|x| x == b'e' || x == b'E') {
        c.sign();
        if !c.grouped_digits() {
            return false;
        }
    }
    c.done()
}

/// OmegaConf's `YAML_BOOL_TYPES`: the strings its dumper quotes as bool-like (including `y`/`n`,
/// which its loader reads as strings).
pub(crate) fn omegaconf_bool_like(text: &str) -> bool {
    matches!(text, "y" | "Y" | "n" | "N") || yaml11_bool(text).is_some()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check_resolve(cases: &[(&str, Implicit)]) {
        for (text, want) in cases {
            assert_eq!(resolve_plain(text), *want, "resolve_plain({text:?})");
        }
    }

    #[test]
    fn bools_are_yaml11_without_y_n() {
        use Implicit::*;
        check_resolve(&[
            ("yes", Bool(true)),
            ("Yes", Bool(true)),
            ("YES", Bool(true)),
            ("on", Bool(true)),
            ("On", Bool(true)),
            ("ON", Bool(true)),
            ("true", Bool(true)),
            ("True", Bool(true)),
            ("TRUE", Bool(true)),
            ("no", Bool(false)),
            ("NO", Bool(false)),
            ("off", Bool(false)),
            ("OFF", Bool(false)),
            ("false", Bool(false)),
            ("False", Bool(false)),
            ("FALSE", Bool(false)),
            ("y", Str),
            ("Y", Str),
            ("n", Str),
            ("N", Str),
            ("tRUE", Str),
            ("yES", Str),
            ("oN", Str),
        ]);
    }

    #[test]
    fn nulls() {
        use Implicit::*;
        check_resolve(&[
            ("", Null),
            ("~", Null),
            ("null", Null),
            ("Null", Null),
            ("NULL", Null),
            ("nULL", Str),
            ("none", Str),
            ("None", Str),
        ]);
    }

    #[test]
    fn ints_resolve() {
        use Implicit::*;
        check_resolve(&[
            ("0", Int),
            ("-0", Int),
            ("+7", Int),
            ("0755", Int),
            ("0_7", Int),
            ("0_", Int),
            ("00", Int),
            ("08", Str),
            ("019", Str),
            ("0o755", Str),
            ("0x1F", Int),
            ("0x_1F", Int),
            ("0X1f", Str),
            ("0xG1", Str),
            ("0x", Str),
            ("0b101", Int),
            ("0B11", Str),
            ("0b", Str),
            ("0b2", Str),
            ("1_000", Int),
            ("1__000", Int),
            ("1_", Int),
            ("_1", Str),
            ("1:30", Int),
            ("-1:30:00", Int),
            ("1:5", Int),
            ("1:60", Str),
            ("0:30", Str),
            ("10:00", Int),
            ("1:30:", Str),
            ("0755x", Str),
        ]);
    }

    #[test]
    fn floats_resolve() {
        use Implicit::*;
        check_resolve(&[
            ("1.", Float),
            ("-1.5", Float),
            (".5", Float),
            ("+.5", Str),
            ("1e-4", Float),
            ("1E5", Float),
            ("1e+5", Float),
            ("6.8523015e+5", Float),
            ("1_000.5", Float),
            ("1__0.0", Float),
            ("1._5", Float),
            ("1.5_", Float),
            ("1_.5", Float),
            ("1_.5e5", Str),
            ("1.5e", Str),
            ("12e", Str),
            ("e5", Str),
            ("1_e5", Str),
            ("1e_5", Str),
            (".5_", Float),
            ("._5", Str),
            (".5e5", Str),
            (".5e+5", Float),
            ("1:30.5", Float),
            ("190:20:30.15", Float),
            ("1:30.5e3", Str),
            (".", Str),
            ("-", Str),
            ("+", Str),
            (".inf", Float),
            ("-.inf", Float),
            ("+.Inf", Float),
            (".INF", Float),
            (".iNF", Str),
            ("inf", Str),
            ("-inf", Str),
            (".nan", Float),
            (".NaN", Float),
            (".NAN", Float),
            (".nAN", Str),
            ("-.nan", Str),
            ("nan", Str),
            ("1.0.0", Str),
            ("1e-4x", Str),
            ("0.", Float),
            ("0e0", Float),
        ]);
    }

    #[test]
    fn other_plain_scalars() {
        use Implicit::*;
        check_resolve(&[
            ("<<", Merge),
            ("=", Value),
            ("abc", Str),
            ("2024-01-01", Str),
            ("${a}", Str),
            ("???", Str),
        ]);
    }

    #[test]
    fn ints_construct_like_pyyaml() {
        let big = |digits: &str| Ok(Value::Scalar(crate::scalar::big(digits)));
        let cases: &[(&str, Result<Value, ScalarError>)] = &[
            ("7", Ok(Value::Scalar(Scalar::Int(7)))),
            ("-7", Ok(Value::Scalar(Scalar::Int(-7)))),
            ("+0", Ok(Value::Scalar(Scalar::Int(0)))),
            ("0755", Ok(Value::Scalar(Scalar::Int(493)))),
            ("+0755", Ok(Value::Scalar(Scalar::Int(493)))),
            ("0o755", Ok(Value::Scalar(Scalar::Int(493)))),
            ("0x1F", Ok(Value::Scalar(Scalar::Int(31)))),
            ("-0x1F", Ok(Value::Scalar(Scalar::Int(-31)))),
            ("0x_1F", Ok(Value::Scalar(Scalar::Int(31)))),
            ("0b101", Ok(Value::Scalar(Scalar::Int(5)))),
            ("-0b11", Ok(Value::Scalar(Scalar::Int(-3)))),
            ("1_000", Ok(Value::Scalar(Scalar::Int(1000)))),
            ("1:30", Ok(Value::Scalar(Scalar::Int(90)))),
            ("-1:30:00", Ok(Value::Scalar(Scalar::Int(-5400)))),
            ("42", Ok(Value::Scalar(Scalar::Int(42)))),
            (
                "9223372036854775807",
                Ok(Value::Scalar(Scalar::Int(i64::MAX))),
            ),
            (
                "-9223372036854775808",
                Ok(Value::Scalar(Scalar::Int(i64::MIN))),
            ),
            // Beyond i64, with Python's values (checked against PyYAML).
            ("9223372036854775808", big("9223372036854775808")),
            ("-9223372036854775809", big("-9223372036854775809")),
            (
                "123456789012345678901234567890123456789012",
                big("123456789012345678901234567890123456789012"),
            ),
            ("0x8000000000000000", big("9223372036854775808")),
            ("-0x8000000000000001", big("-9223372036854775809")),
            (
                "0b1111111111111111111111111111111111111111111111111111111111111111",
                big("18446744073709551615"),
            ),
            ("01000000000000000000000", big("9223372036854775808")),
            (
                "1_000_000_000_000_000_000_000",
                big("1000000000000000000000"),
            ),
            ("1:0:0:0:0:0:0:0:0:0:0:0", big("36279705600000000000")),
            (
                "0x_FFFF_FFFF_FFFF_FFFF_FFFF",
                big("1208925819614629174706175"),
            ),
            ("abc", Err(ScalarError::Invalid)),
            ("", Err(ScalarError::Invalid)),
            ("-", Err(ScalarError::Invalid)),
            ("0b", Err(ScalarError::Invalid)),
            ("08", Err(ScalarError::Invalid)),
        ];
        for (text, want) in cases {
            assert_eq!(construct_int(text), *want, "construct_int({text:?})");
        }
    }

    #[test]
    fn floats_construct_like_pyyaml() {
        let cases: &[(&str, f64)] = &[
            ("1.", 1.0),
            (".5", 0.5),
            ("1e-4", 1e-4),
            ("1_000.5", 1000.5),
            ("1:30.5", 90.5),
            ("190:20:30.15", 685230.15),
            ("-.inf", f64::NEG_INFINITY),
            ("+.Inf", f64::INFINITY),
            ("1e400", f64::INFINITY),
            ("-1e400", f64::NEG_INFINITY),
            ("1", 1.0),
            ("-0.0", -0.0),
            ("0.30000000000000004", 0.30000000000000004),
        ];
        for (text, want) in cases {
            let got = construct_float(text);
            assert_eq!(
                got.map(f64::to_bits),
                Ok(want.to_bits()),
                "construct_float({text:?})"
            );
        }
        assert!(construct_float(".NaN").is_ok_and(f64::is_nan));
        assert_eq!(construct_float("abc"), Err(ScalarError::Invalid));
        assert_eq!(construct_float(""), Err(ScalarError::Invalid));
    }

    #[test]
    fn explicit_bools() {
        assert_eq!(construct_bool("yes"), Ok(true));
        assert_eq!(construct_bool("TRUE"), Ok(true));
        assert_eq!(construct_bool("Off"), Ok(false));
        assert_eq!(construct_bool("y"), Err(ScalarError::Invalid));
        assert_eq!(construct_bool(""), Err(ScalarError::Invalid));
    }

    #[test]
    fn binary_is_lenient_like_binascii() {
        let cases: &[(&str, Result<&[u8], ScalarError>)] = &[
            ("aGVsbG8=", Ok(b"hello")),
            ("aGVs\nbG8=\n", Ok(b"hello")),
            ("aGVs bG8=", Ok(b"hello")),
            ("aG=Vs", Ok(b"hel")),
            ("", Ok(b"")),
            ("aGVsbG8", Err(ScalarError::Invalid)),
            ("é", Err(ScalarError::Invalid)),
        ];
        for (text, want) in cases {
            assert_eq!(
                construct_binary(text).as_deref(),
                want.as_deref(),
                "construct_binary({text:?})"
            );
        }
    }

    #[test]
    fn timestamps_match_pyyaml() {
        for yes in [
            "2024-01-01",
            "2024-1-1 10:00:00",
            "2024-01-01T10:00:00Z",
            "2001-12-14t21:59:43.10-05:00",
            "2001-12-14 21:59:43.10 -5",
        ] {
            assert!(yaml11_timestamp(yes), "{yes}");
        }
        for no in ["2024-1-1", "2024-01-01T", "24-01-01", "2024-01-01 10:00"] {
            assert!(!yaml11_timestamp(no), "{no}");
        }
    }

    #[test]
    fn python_number_predicates() {
        for yes in ["1", " 1 ", "-1", "+1", "1_0"] {
            assert!(python_is_int(yes), "{yes}");
        }
        for no in ["", "1.0", "1__0", "_1", "0x1", "a"] {
            assert!(!python_is_int(no), "{no}");
        }
        for yes in [
            "1",
            "1.",
            ".5",
            "1e5",
            "1E-5",
            "inf",
            "-Infinity",
            "nan",
            "1_0.5",
        ] {
            assert!(python_is_float(yes), "{yes}");
        }
        for no in ["", ".", "e5", "1e", "1.5e", "infx", "1__0", ".inf"] {
            assert!(!python_is_float(no), "{no}");
        }
    }
}
