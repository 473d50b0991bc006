//! The ordered config tree (OmegaConf's DictConfig/ListConfig) that every stage of composition works on.
//!
//! A [`Node`] is a value plus where it came from ([`Origin`]), so errors can name `file:line:col`.
//! Dicts keep insertion order ([`indexmap::IndexMap`]) and may have non-string keys, as OmegaConf allows.
//! Strings are stored raw: a string containing `${...}` is an interpolation and is only resolved by
//! `config::interpolate`. `???` is [`Value::Missing`].

use std::fmt;
use std::sync::Arc;

use indexmap::IndexMap;

use crate::bigint::BigInt;

/// Where a node was read from: a YAML file position, or a command-line override.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    /// `line` and `col` are 1-based.
    File { file: Arc<str>, line: u32, col: u32 },
    /// The override as the user typed it.
    Override(Arc<str>),
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Origin::File { file, line, col } => write!(f, "{file}:{line}:{col}"),
            Origin::Override(text) => write!(f, "override '{text}'"),
        }
    }
}

/// A dict key. OmegaConf allows str, int, float, bool and None keys (YAML `1: a`, `true: b`, `null: c`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Key {
    Str(String),
    Int(i64),
    /// An int outside `i64`, as canonical decimal digits (see [`crate::bigint`]).
    BigInt(String),
    /// The bit pattern of an `f64` (so keys can be hashed); use [`Key::float`] / [`Key::as_f64`].
    Float(u64),
    Bool(bool),
    Null,
    /// YAML `!!binary` (PyYAML loads it as Python `bytes`, which OmegaConf accepts as a key).
    Bytes(Vec<u8>),
}

impl Key {
    pub fn float(v: f64) -> Key {
        Key::Float(v.to_bits())
    }

    pub fn as_f64(&self) -> Option<f64> {
        match self {
            Key::Float(bits) => Some(f64::from_bits(*bits)),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Key::Str(s) => Some(s),
            _ => None,
        }
    }
}

impl From<&str> for Key {
    fn from(s: &str) -> Key {
        Key::Str(s.to_owned())
    }
}

impl From<String> for Key {
    fn from(s: String) -> Key {
        Key::Str(s)
    }
}

impl fmt::Display for Key {
    /// The key as OmegaConf prints it in a dotted path (`a.1.true`).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Key::Str(s) => f.write_str(s),
            Key::Int(i) => write!(f, "{i}"),
            Key::BigInt(digits) => f.write_str(digits),
            Key::Float(bits) => write!(
                f,
                "{}",
                crate::node::python_float_repr(f64::from_bits(*bits))
            ),
            Key::Bool(true) => f.write_str("True"),
            Key::Bool(false) => f.write_str("False"),
            Key::Null => f.write_str("None"),
            Key::Bytes(b) => f.write_str(&python_repr_bytes(b)),
        }
    }
}

/// An ordered mapping, as OmegaConf's DictConfig.
pub type Dict = IndexMap<Key, Node>;

/// A config value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Null,
    Bool(bool),
    Int(i64),
    /// A Python int outside `i64`: canonical decimal digits with an optional `-`, never fitting `i64`
    /// (build it with [`crate::bigint::BigInt::into_value`]).
    BigInt(String),
    Float(f64),
    /// A string; if it contains `${` it is (or contains) an interpolation.
    Str(String),
    /// YAML `!!binary`.
    Bytes(Vec<u8>),
    /// `???`: mandatory value not yet set.
    Missing,
    List(Vec<Node>),
    Dict(Dict),
}

/// A value and its provenance.
#[derive(Debug, Clone, PartialEq)]
pub struct Node {
    pub value: Value,
    pub origin: Option<Origin>,
}

impl Node {
    pub fn new(value: Value) -> Node {
        Node {
            value,
            origin: None,
        }
    }

    pub fn with_origin(value: Value, origin: Option<Origin>) -> Node {
        Node { value, origin }
    }

    /// The plain-data view of a resolved tree that workers outside Rust read (Python workers get it as a
    /// dict): keys as their Python `str()`, big ints and `!!binary` as strings (decimal digits, base64),
    /// non-finite floats and `???` as null (JSON has neither).
    pub fn to_json(&self) -> serde_json::Value {
        use base64::Engine as _;
        use serde_json::Value as J;
        match &self.value {
            Value::Null | Value::Missing => J::Null,
            Value::Bool(b) => J::Bool(*b),
            Value::Int(i) => J::from(*i),
            Value::BigInt(digits) => J::String(digits.clone()),
            Value::Float(f) => serde_json::Number::from_f64(*f).map_or(J::Null, J::Number),
            Value::Str(s) => J::String(s.clone()),
            Value::Bytes(b) => J::String(base64::engine::general_purpose::STANDARD.encode(b)),
            Value::List(items) => J::Array(items.iter().map(Node::to_json).collect()),
            Value::Dict(d) => J::Object(
                d.iter()
                    .map(|(k, v)| (k.to_string(), v.to_json()))
                    .collect(),
            ),
        }
    }

    pub fn empty_dict() -> Node {
        Node::new(Value::Dict(Dict::new()))
    }

    pub fn str(s: impl Into<String>) -> Node {
        Node::new(Value::Str(s.into()))
    }

    pub fn as_dict(&self) -> Option<&Dict> {
        match &self.value {
            Value::Dict(d) => Some(d),
            _ => None,
        }
    }

    pub fn as_dict_mut(&mut self) -> Option<&mut Dict> {
        match &mut self.value {
            Value::Dict(d) => Some(d),
            _ => None,
        }
    }

    pub fn as_list(&self) -> Option<&[Node]> {
        match &self.value {
            Value::List(l) => Some(l),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match &self.value {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    /// Child of a dict by string key.
    pub fn get(&self, key: &str) -> Option<&Node> {
        self.as_dict()
            .and_then(|d| d.get(&Key::Str(key.to_owned())))
    }

    /// Follow a dotted path of string keys / list indices (`a.b.0.c`). No interpolation is resolved.
    pub fn get_path(&self, dotted: &str) -> Option<&Node> {
        if dotted.is_empty() {
            return Some(self);
        }
        let mut cur = self;
        for part in dotted.split('.') {
            cur = match &cur.value {
                Value::Dict(d) => d.get(&Key::Str(part.to_owned()))?,
                Value::List(l) => l.get(part.parse::<usize>().ok()?)?,
                _ => return None,
            };
        }
        Some(cur)
    }
}

impl Value {
    pub fn type_name(&self) -> &'static str {
        match self {
            Value::Null => "NoneType",
            Value::Bool(_) => "bool",
            Value::Int(_) | Value::BigInt(_) => "int",
            Value::Float(_) => "float",
            Value::Str(_) => "str",
            Value::Bytes(_) => "bytes",
            Value::Missing => "missing",
            Value::List(_) => "list",
            Value::Dict(_) => "dict",
        }
    }

    /// True for dicts and lists (OmegaConf "containers").
    pub fn is_container(&self) -> bool {
        matches!(self, Value::List(_) | Value::Dict(_))
    }
}

/// A borrowed Python scalar: the part that config values, the interpolation tree's leaves, resolver
/// values (`interpolate::py::Py`) and override values (`overrides::Element` and the visitor's `Val`)
/// have in common. Each of those types keeps its own containers (config children, Python lists, sweeps),
/// so only their scalars meet here, and their Python `repr`/`str` and type names are written once.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum PyScalar<'a> {
    None,
    Bool(bool),
    Int(i64),
    /// An int outside `i64`, as canonical decimal digits.
    BigInt(&'a str),
    Float(f64),
    Str(&'a str),
    Bytes(&'a [u8]),
}

impl PyScalar<'_> {
    /// Python's `type(x).__name__`.
    pub fn type_name(self) -> &'static str {
        match self {
            PyScalar::None => "NoneType",
            PyScalar::Bool(_) => "bool",
            PyScalar::Int(_) | PyScalar::BigInt(_) => "int",
            PyScalar::Float(_) => "float",
            PyScalar::Str(_) => "str",
            PyScalar::Bytes(_) => "bytes",
        }
    }

    /// Python's `repr(x)`.
    /// Python's `str(x)`: a string as it is, anything else as its `repr`.
    pub fn str(self) -> String {
        match self {
            PyScalar::Str(s) => s.to_owned(),
            other => other.repr(),
        }
    }

    pub fn repr(self) -> String {
        match self {
            PyScalar::None => "None".into(),
            PyScalar::Bool(true) => "True".into(),
            PyScalar::Bool(false) => "False".into(),
            PyScalar::Int(i) => i.to_string(),
            PyScalar::BigInt(digits) => digits.to_owned(),
            PyScalar::Float(f) => python_float_repr(f),
            PyScalar::Str(s) => python_repr_str(s),
            PyScalar::Bytes(b) => python_repr_bytes(b),
        }
    }

    /// Python `==` between two numbers (bool, int, float; an int and a float compare exactly, as in
    /// Python); `None` when either is not a number.
    pub fn num_eq(self, other: PyScalar<'_>) -> Option<bool> {
        let float = |s: PyScalar<'_>| match s {
            PyScalar::Float(f) => Some(f),
            _ => None,
        };
        Some(
            match (
                (self.exact_int(), float(self)),
                (other.exact_int(), float(other)),
            ) {
                ((Some(a), _), (Some(b), _)) => a == b,
                ((_, Some(x)), (_, Some(y))) => x == y,
                ((Some(i), _), (_, Some(f))) | ((_, Some(f)), (Some(i), _)) => {
                    // `{:.0}` prints an integral f64's exact decimal value.
                    f.is_finite()
                        && f.fract() == 0.0
                        && BigInt::parse_decimal(&format!("{f:.0}")).as_ref() == Some(&i)
                }
                _ => return None,
            },
        )
    }

    /// Python's exact int value of a bool or int.
    fn exact_int(self) -> Option<BigInt> {
        match self {
            PyScalar::Bool(b) => Some(BigInt::from_i64(i64::from(b))),
            PyScalar::Int(i) => Some(BigInt::from_i64(i)),
            PyScalar::BigInt(digits) => BigInt::parse_decimal(digits),
            _ => None,
        }
    }
}

impl Key {
    /// The key as the Python object OmegaConf holds.
    pub fn as_py(&self) -> PyScalar<'_> {
        match self {
            Key::Str(s) => PyScalar::Str(s),
            Key::Int(i) => PyScalar::Int(*i),
            Key::BigInt(digits) => PyScalar::BigInt(digits),
            Key::Float(bits) => PyScalar::Float(f64::from_bits(*bits)),
            Key::Bool(b) => PyScalar::Bool(*b),
            Key::Null => PyScalar::None,
            Key::Bytes(b) => PyScalar::Bytes(b),
        }
    }
}

impl Value {
    /// Python's `repr()` of the value as OmegaConf holds it (a container prints as its content).
    pub fn python_repr(&self) -> String {
        match self {
            Value::List(items) => format!(
                "[{}]",
                items
                    .iter()
                    .map(|n| n.value.python_repr())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            Value::Dict(d) => {
                let items: Vec<String> = d
                    .iter()
                    .map(|(k, v)| format!("{}: {}", k.as_py().repr(), v.value.python_repr()))
                    .collect();
                format!("{{{}}}", items.join(", "))
            }
            leaf => leaf.as_py().map(PyScalar::repr).unwrap_or_default(),
        }
    }

    /// Python's `str()` of the value, as Hydra's messages show values.
    pub fn python_str(&self) -> String {
        match self {
            Value::Str(s) => s.clone(),
            other => other.python_repr(),
        }
    }

    /// A leaf as the Python object OmegaConf hands out (`???` is the string `'???'`); `None` for containers.
    pub fn as_py(&self) -> Option<PyScalar<'_>> {
        Some(match self {
            Value::Null => PyScalar::None,
            Value::Bool(b) => PyScalar::Bool(*b),
            Value::Int(i) => PyScalar::Int(*i),
            Value::BigInt(digits) => PyScalar::BigInt(digits),
            Value::Float(f) => PyScalar::Float(*f),
            Value::Str(s) => PyScalar::Str(s),
            Value::Bytes(b) => PyScalar::Bytes(b),
            Value::Missing => PyScalar::Str("???"),
            Value::List(_) | Value::Dict(_) => return None,
        })
    }
}

/// Python's `repr(bytes)`: `b'…'`, quoted as `repr(str)` is, non-printable bytes as `\xNN`.
pub(crate) fn python_repr_bytes(b: &[u8]) -> String {
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
    let (mantissa, exp) = sci.split_once('e').expect("`{:e}` always has an exponent");
    let exp: i32 = exp.parse().expect("`{:e}` exponent is an integer");
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
    fn python_scalars_compare_and_print_like_python() {
        use PyScalar::{BigInt as Big, Bool, Float, Int, Str};
        let eq = [
            (Int(1), Float(1.0), Some(true)),
            (Bool(true), Int(1), Some(true)),
            (Big("100000000000000000000"), Float(1e20), Some(true)),
            (Big("100000000000000000001"), Float(1e20), Some(false)),
            // An f64 conversion would call these equal; Python compares exactly.
            (
                Int(9_007_199_254_740_993),
                Float(9_007_199_254_740_992.0),
                Some(false),
            ),
            (Float(f64::NAN), Float(f64::NAN), Some(false)),
            (Str("1"), Int(1), None),
        ];
        for (a, b, want) in eq {
            assert_eq!(a.num_eq(b), want, "{a:?} == {b:?}");
        }
        let repr = [
            (PyScalar::None, "None"),
            (Bool(false), "False"),
            (Float(1e-7), "1e-07"),
            (Str("it's"), "\"it's\""),
            (PyScalar::Bytes(b"a'\x00"), "b\"a'\\x00\""),
        ];
        for (v, want) in repr {
            assert_eq!(v.repr(), want);
        }
        assert_eq!(Key::Null.as_py().repr(), "None");
        assert_eq!(
            Value::Missing.as_py().map(PyScalar::str).as_deref(),
            Some("???")
        );
    }

    #[test]
    fn python_str_of_values() {
        let list = Value::List(vec![
            Node::new(Value::Int(1)),
            Node::str("a"),
            Node::new(Value::Null),
        ]);
        assert_eq!(list.python_str(), "[1, 'a', None]");
        assert_eq!(Value::Bool(true).python_str(), "True");
        assert_eq!(Value::Str("x".into()).python_str(), "x");
        let mut dict = Dict::new();
        dict.insert(Key::Int(1), Node::str("it's"));
        dict.insert(Key::from("b"), Node::new(Value::Bytes(vec![0])));
        assert_eq!(
            Value::Dict(dict).python_str(),
            r#"{1: "it's", 'b': b'\x00'}"#
        );
    }

    #[test]
    fn get_path_walks_dicts_and_lists() {
        let mut inner = Dict::new();
        inner.insert(Key::from("c"), Node::new(Value::Int(3)));
        let list = Node::new(Value::List(vec![Node::new(Value::Dict(inner))]));
        let mut root = Dict::new();
        root.insert(Key::from("a"), list);
        let root = Node::new(Value::Dict(root));
        assert_eq!(
            root.get_path("a.0.c").map(|n| &n.value),
            Some(&Value::Int(3))
        );
        assert!(root.get_path("a.1.c").is_none());
        assert!(root.get_path("a.x").is_none());
    }
}
