//! Python values as OmegaConf's resolvers see them, with Python's `str`/`repr`, truthiness and arithmetic.
//!
//! Resolver arguments and results are Python objects: primitives, plain lists/dicts, or config containers
//! (`DictConfig`/`ListConfig`, here [`Py::Config`]). String interpolation uses `str()`, error messages use
//! `repr()`, and RLinf's `multiply`/`int_div`/`subtract`/`not` follow Python's operators exactly.

use num_bigint::BigInt;
use num_integer::Integer;
use num_traits::{Signed, ToPrimitive, Zero};

use super::tree::{Body, Id, Tree};
use crate::node::{Key, Value};
use crate::scalar::{Scalar, int_to_f64};

/// A Python object. Not a [`Value`]: Python lists and dicts hold Python objects (any hashable key, no
/// origins), a config container is a reference into the working tree, and there is no missing value.
#[derive(Debug, Clone, PartialEq)]
pub enum Py {
    Scalar(Scalar),
    List(Vec<Py>),
    Dict(Vec<(Py, Py)>),
    /// A config container (a node of the working tree).
    Config(Id),
}

impl From<Scalar> for Py {
    fn from(s: Scalar) -> Py {
        Py::Scalar(s)
    }
}

/// A Python exception raised inside a resolver: class name and `str(exc)`.
#[derive(Debug, Clone, PartialEq)]
pub struct PyErr {
    pub class: &'static str,
    pub message: String,
}

impl PyErr {
    pub fn new(class: &'static str, message: impl Into<String>) -> PyErr {
        PyErr {
            class,
            message: message.into(),
        }
    }

    pub fn type_error(message: impl Into<String>) -> PyErr {
        PyErr::new("TypeError", message)
    }
}

/// Longest string/list a repetition may build; Python would try and run out of memory.
const MAX_REPEAT: usize = 1 << 26;

impl Py {
    pub const NONE: Py = Py::Scalar(Scalar::None);

    pub fn string(s: impl Into<String>) -> Py {
        Py::Scalar(Scalar::Str(s.into()))
    }

    /// An exact int: an `i64` when it fits, else a big int.
    pub fn int(v: BigInt) -> Py {
        Py::Scalar(Scalar::int(v))
    }

    /// A tree leaf as resolvers see it (`???` is the string `'???'`).
    pub fn from_leaf(v: &Value) -> Py {
        // The tree keeps containers as slots, never as leaves.
        v.to_py_scalar().map_or(Py::NONE, Py::Scalar)
    }

    pub fn from_key(k: &Key) -> Py {
        Py::Scalar(k.0.clone())
    }

    /// The scalar this is; `None` for lists, dicts and configs.
    pub fn as_scalar(&self) -> Option<&Scalar> {
        match self {
            Py::Scalar(s) => Some(s),
            _ => None,
        }
    }

    /// The dict key for this value, when Python allows it as an OmegaConf key.
    pub fn to_key(&self) -> Option<Key> {
        match self {
            Py::Scalar(Scalar::Bytes(_)) => None,
            Py::Scalar(s) => Some(Key(s.clone())),
            _ => None,
        }
    }

    pub fn type_name(&self, tree: &Tree) -> &'static str {
        match self {
            Py::Scalar(s) => s.type_name(),
            Py::List(_) => "list",
            Py::Dict(_) => "dict",
            Py::Config(id) => match tree.body(*id) {
                Body::List(_) => "ListConfig",
                _ => "DictConfig",
            },
        }
    }

    /// Python's `str(x)`.
    pub fn str(&self, tree: &Tree) -> String {
        match self {
            Py::Scalar(s) => s.str(),
            other => other.repr(tree),
        }
    }

    /// Python's `repr(x)`; a config container prints as its content, with leaves unresolved.
    pub fn repr(&self, tree: &Tree) -> String {
        match self {
            Py::Scalar(s) => s.repr(),
            Py::List(items) => format!(
                "[{}]",
                items
                    .iter()
                    .map(|x| x.repr(tree))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            Py::Dict(pairs) => format!(
                "{{{}}}",
                pairs
                    .iter()
                    .map(|(k, v)| format!("{}: {}", k.repr(tree), v.repr(tree)))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            Py::Config(id) => config_repr(tree, *id),
        }
    }

    /// Python's `bool(x)` (a container is true when it has entries).
    pub fn truthy(&self, tree: &Tree) -> bool {
        match self {
            Py::Scalar(s) => s.truthy(),
            Py::List(l) => !l.is_empty(),
            Py::Dict(d) => !d.is_empty(),
            Py::Config(id) => match tree.body(*id) {
                Body::List(l) => !l.is_empty(),
                Body::Dict(d) => !d.is_empty(),
                Body::Leaf(_) => true,
            },
        }
    }

    /// Python `==` for dict keys (`1 == 1.0 == True`).
    pub fn key_eq(&self, other: &Py) -> bool {
        match (self, other) {
            (Py::Scalar(a), Py::Scalar(b)) => a.num_eq(b).unwrap_or_else(|| a == b),
            _ => self == other,
        }
    }

    fn as_number(&self) -> Option<Num> {
        match self.as_scalar()? {
            Scalar::Float(f) => Some(Num::Float(*f)),
            other => other.exact_int().map(Num::Int),
        }
    }
}

fn config_repr(tree: &Tree, id: Id) -> String {
    match tree.body(id) {
        Body::Leaf(v) => Py::from_leaf(v).repr(tree),
        Body::List(items) => format!(
            "[{}]",
            items
                .iter()
                .map(|&c| config_repr(tree, c))
                .collect::<Vec<_>>()
                .join(", ")
        ),
        Body::Dict(d) => format!(
            "{{{}}}",
            d.iter()
                .map(|(k, &c)| format!("{}: {}", k.0.repr(), config_repr(tree, c)))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

/// A Python number: ints are exact at any size, as in Python.
#[derive(Debug, Clone)]
enum Num {
    Int(BigInt),
    Float(f64),
}

impl Num {
    /// Python's `float(x)`, which refuses ints beyond the float range.
    fn as_f64(&self) -> Result<f64, PyErr> {
        match self {
            Num::Int(i) => int_to_f64(i)
                .ok_or_else(|| PyErr::new("OverflowError", "int too large to convert to float")),
            Num::Float(f) => Ok(*f),
        }
    }
}

fn unsupported(op: &str, a: &Py, b: &Py, tree: &Tree) -> PyErr {
    PyErr::type_error(format!(
        "unsupported operand type(s) for {op}: '{}' and '{}'",
        a.type_name(tree),
        b.type_name(tree)
    ))
}

/// The repeat count of `seq * n`; Python refuses counts beyond `Py_ssize_t`.
fn repeat_count(n: &BigInt, unit: usize) -> Result<usize, PyErr> {
    if n.is_negative() {
        return Ok(0);
    }
    let n = n
        .to_i64()
        .and_then(|n| usize::try_from(n).ok())
        .ok_or_else(|| {
            PyErr::new(
                "OverflowError",
                "cannot fit 'int' into an index-sized integer",
            )
        })?;
    if n.saturating_mul(unit.max(1)) > MAX_REPEAT {
        return Err(PyErr::new("MemoryError", "repetition result is too large"));
    }
    Ok(n)
}

/// Python `a * b`.
pub fn multiply(a: &Py, b: &Py, tree: &Tree) -> Result<Py, PyErr> {
    if let (Some(x), Some(y)) = (a.as_number(), b.as_number()) {
        return Ok(match (x, y) {
            (Num::Int(x), Num::Int(y)) => Py::int(x * y),
            (x, y) => Py::Scalar(Scalar::Float(x.as_f64()? * y.as_f64()?)),
        });
    }
    let (seq, n) = match (a, b) {
        (Py::Scalar(Scalar::Str(_)) | Py::List(_) | Py::Scalar(Scalar::Bytes(_)), _) => (a, b),
        (_, Py::Scalar(Scalar::Str(_)) | Py::List(_) | Py::Scalar(Scalar::Bytes(_))) => (b, a),
        _ => return Err(unsupported("*", a, b, tree)),
    };
    let count = match n.as_number() {
        Some(Num::Int(i)) => i,
        _ => {
            return Err(PyErr::type_error(format!(
                "can't multiply sequence by non-int of type '{}'",
                n.type_name(tree)
            )));
        }
    };
    Ok(match seq {
        Py::Scalar(Scalar::Str(s)) => Py::string(s.repeat(repeat_count(&count, s.len())?)),
        Py::Scalar(Scalar::Bytes(v)) => {
            Py::Scalar(Scalar::Bytes(v.repeat(repeat_count(&count, v.len())?)))
        }
        Py::List(l) => {
            let n = repeat_count(&count, l.len())?;
            Py::List(
                std::iter::repeat_n(l.iter().cloned(), n)
                    .flatten()
                    .collect(),
            )
        }
        _ => return Err(unsupported("*", a, b, tree)),
    })
}

/// Python `a - b`.
pub fn subtract(a: &Py, b: &Py, tree: &Tree) -> Result<Py, PyErr> {
    match (a.as_number(), b.as_number()) {
        (Some(Num::Int(x)), Some(Num::Int(y))) => Ok(Py::int(x - y)),
        (Some(x), Some(y)) => Ok(Py::Scalar(Scalar::Float(x.as_f64()? - y.as_f64()?))),
        _ => Err(unsupported("-", a, b, tree)),
    }
}

/// Python `a // b`.
pub fn floor_div(a: &Py, b: &Py, tree: &Tree) -> Result<Py, PyErr> {
    match (a.as_number(), b.as_number()) {
        (Some(Num::Int(_)), Some(Num::Int(y))) if y.is_zero() => Err(PyErr::new(
            "ZeroDivisionError",
            "integer division or modulo by zero",
        )),
        (Some(Num::Int(x)), Some(Num::Int(y))) => Ok(Py::int(x.div_floor(&y))),
        (Some(x), Some(y)) => {
            let (x, y) = (x.as_f64()?, y.as_f64()?);
            if y == 0.0 {
                return Err(PyErr::new(
                    "ZeroDivisionError",
                    "float floor division by zero",
                ));
            }
            Ok(Py::Scalar(Scalar::Float(float_floor_div(x, y))))
        }
        _ => Err(unsupported("//", a, b, tree)),
    }
}

/// CPython's `float_floor_div` (via `_float_div_mod`), so rounding matches exactly.
fn float_floor_div(vx: f64, wx: f64) -> f64 {
    let m = vx % wx;
    let mut div = (vx - m) / wx;
    // The remainder must take the sign of the divisor.
    if m != 0.0 && ((wx < 0.0) != (m < 0.0)) {
        div -= 1.0;
    }
    if div != 0.0 {
        // Snap the quotient to the nearest integral value.
        let mut floordiv = div.floor();
        if div - floordiv > 0.5 {
            floordiv += 1.0;
        }
        floordiv
    } else {
        0.0_f64.copysign(vx / wx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(x: &str) -> Py {
        Py::string(x)
    }

    fn int(i: i64) -> Py {
        Py::Scalar(Scalar::Int(i))
    }

    fn float(f: f64) -> Py {
        Py::Scalar(Scalar::Float(f))
    }

    fn big(digits: &str) -> Py {
        Py::int(
            digits
                .parse()
                .unwrap_or_else(|_| panic!("bad test literal {digits}")),
        )
    }

    #[test]
    fn str_and_repr_follow_python() {
        let t = Tree::default();
        let cases = [
            (Py::NONE, "None"),
            (Py::Scalar(Scalar::Bool(true)), "True"),
            (float(1e-7), "1e-07"),
            (float(1.0), "1.0"),
            (s("it's"), "it's"),
            (
                Py::List(vec![
                    int(1),
                    s("a"),
                    s("it's"),
                    Py::NONE,
                    float(f64::INFINITY),
                ]),
                "[1, 'a', \"it's\", None, inf]",
            ),
            (
                Py::Dict(vec![(s("a"), Py::List(vec![])), (int(1), s("x\\y"))]),
                "{'a': [], 1: 'x\\\\y'}",
            ),
            (Py::Scalar(Scalar::Bytes(b"a\x00".to_vec())), "b'a\\x00'"),
        ];
        for (v, want) in cases {
            assert_eq!(v.str(&t), want);
        }
    }

    #[test]
    fn arithmetic_matches_python() {
        let t = Tree::default();
        let cases: Vec<(Result<Py, PyErr>, Py)> = vec![
            (multiply(&int(3), &int(4), &t), int(12)),
            (multiply(&float(2.5), &int(3), &t), float(7.5)),
            (multiply(&s("a"), &int(3), &t), s("aaa")),
            (
                multiply(&Py::Scalar(Scalar::Bool(true)), &s("ab"), &t),
                s("ab"),
            ),
            (multiply(&s("a"), &int(-2), &t), s("")),
            (
                multiply(&Py::List(vec![int(1)]), &int(2), &t),
                Py::List(vec![int(1), int(1)]),
            ),
            (floor_div(&int(-7), &int(2), &t), int(-4)),
            (floor_div(&int(7), &int(-2), &t), int(-4)),
            (floor_div(&float(7.5), &int(2), &t), float(3.0)),
            (floor_div(&float(-7.5), &int(2), &t), float(-4.0)),
            (floor_div(&int(1), &float(0.1), &t), float(9.0)),
            (
                subtract(&Py::Scalar(Scalar::Bool(true)), &int(2), &t),
                int(-1),
            ),
            (subtract(&int(1), &float(0.5), &t), float(0.5)),
        ];
        for (got, want) in cases {
            assert_eq!(got, Ok(want));
        }
        assert_eq!(
            floor_div(&int(1), &int(0), &t).map_err(|e| e.class),
            Err("ZeroDivisionError")
        );
        assert_eq!(
            multiply(&s("a"), &s("b"), &t).map_err(|e| e.class),
            Err("TypeError")
        );
        assert_eq!(
            multiply(&s("a"), &float(2.0), &t).map_err(|e| e.class),
            Err("TypeError")
        );
        assert_eq!(
            subtract(&s("a"), &int(1), &t).map_err(|e| e.class),
            Err("TypeError")
        );
    }

    /// Expected values computed with CPython.
    #[test]
    fn int_arithmetic_is_exact_beyond_64_bits() {
        let t = Tree::default();
        let cases: Vec<(Result<Py, PyErr>, Py)> = vec![
            (
                multiply(&int(i64::MAX), &int(2), &t),
                big("18446744073709551614"),
            ),
            (
                multiply(&big("99999999999999999999"), &int(-3), &t),
                big("-299999999999999999997"),
            ),
            (
                multiply(&big("99999999999999999999"), &float(0.5), &t),
                float(5e19),
            ),
            (multiply(&s("ab"), &big("-99999999999999999999"), &t), s("")),
            (
                subtract(&int(i64::MIN), &int(1), &t),
                big("-9223372036854775809"),
            ),
            (
                subtract(&big("9223372036854775808"), &int(1), &t),
                int(i64::MAX),
            ),
            (
                floor_div(&big("-99999999999999999999"), &int(7), &t),
                big("-14285714285714285715"),
            ),
            (
                floor_div(&int(i64::MIN), &int(-1), &t),
                big("9223372036854775808"),
            ),
            (
                floor_div(&big("18446744073709551616"), &big("4294967296"), &t),
                int(4294967296),
            ),
            (
                floor_div(&big("10000000000000000000"), &float(4.0), &t),
                float(2.5e18),
            ),
        ];
        for (got, want) in cases {
            assert_eq!(got, Ok(want));
        }
        assert_eq!(
            floor_div(&big("99999999999999999999"), &int(0), &t).map_err(|e| e.class),
            Err("ZeroDivisionError")
        );
        assert_eq!(
            multiply(&s("a"), &big("99999999999999999999"), &t).map_err(|e| e.class),
            Err("OverflowError")
        );
        let huge = big(&"9".repeat(400));
        assert_eq!(
            multiply(&huge, &float(1.0), &t).map_err(|e| e.class),
            Err("OverflowError")
        );
        assert_eq!(big("99999999999999999999").str(&t), "99999999999999999999");
        assert!(big("-99999999999999999999").truthy(&t));
        assert!(big("100000000000000000000").key_eq(&float(1e20)));
        assert!(!big("100000000000000000001").key_eq(&float(1e20)));
    }

    #[test]
    fn truthiness_and_key_equality() {
        let t = Tree::default();
        assert!(!s("").truthy(&t));
        assert!(float(f64::NAN).truthy(&t));
        assert!(!Py::List(vec![]).truthy(&t));
        assert!(int(1).key_eq(&Py::Scalar(Scalar::Bool(true))));
        assert!(float(1.0).key_eq(&int(1)));
        assert!(!s("1").key_eq(&int(1)));
    }
}
