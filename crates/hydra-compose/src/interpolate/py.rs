//! Python values as OmegaConf's resolvers see them, with Python's `str`/`repr`, truthiness and arithmetic.
//!
//! Resolver arguments and results are Python objects: primitives, plain lists/dicts, or config containers
//! (`DictConfig`/`ListConfig`, here [`Py::Config`]). String interpolation uses `str()`, error messages use
//! `repr()`, and RLinf's `multiply`/`int_div`/`subtract`/`not` follow Python's operators exactly.

use super::tree::{Body, Id, Tree};
use crate::bigint::BigInt;
use crate::node::{Key, PyScalar, Value};

/// A Python object. Not a [`Value`]: Python lists and dicts hold Python objects (any hashable key, no
/// origins), a config container is a reference into the working tree, and there is no missing value.
#[derive(Debug, Clone, PartialEq)]
pub enum Py {
    None,
    Bool(bool),
    Int(i64),
    /// An int outside `i64`, as canonical decimal digits (never one that fits `i64`).
    BigInt(String),
    Float(f64),
    Str(String),
    Bytes(Vec<u8>),
    List(Vec<Py>),
    Dict(Vec<(Py, Py)>),
    /// A config container (a node of the working tree).
    Config(Id),
}

impl From<PyScalar<'_>> for Py {
    fn from(s: PyScalar<'_>) -> Py {
        match s {
            PyScalar::None => Py::None,
            PyScalar::Bool(b) => Py::Bool(b),
            PyScalar::Int(i) => Py::Int(i),
            PyScalar::BigInt(digits) => Py::BigInt(digits.to_owned()),
            PyScalar::Float(f) => Py::Float(f),
            PyScalar::Str(s) => Py::Str(s.to_owned()),
            PyScalar::Bytes(b) => Py::Bytes(b.to_vec()),
        }
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
    /// An exact int: `Py::Int` when it fits in `i64`, else `Py::BigInt`.
    pub fn int(v: BigInt) -> Py {
        match v.to_i64() {
            Some(i) => Py::Int(i),
            None => Py::BigInt(v.to_string()),
        }
    }

    /// A tree leaf as resolvers see it (`???` is the string `'???'`).
    pub fn from_leaf(v: &Value) -> Py {
        // The tree keeps containers as slots, never as leaves.
        v.as_py().map_or(Py::None, Py::from)
    }

    pub fn from_key(k: &Key) -> Py {
        Py::from(k.as_py())
    }

    /// The scalar this is; `None` for lists, dicts and configs.
    fn as_scalar(&self) -> Option<PyScalar<'_>> {
        Some(match self {
            Py::None => PyScalar::None,
            Py::Bool(b) => PyScalar::Bool(*b),
            Py::Int(i) => PyScalar::Int(*i),
            Py::BigInt(digits) => PyScalar::BigInt(digits),
            Py::Float(f) => PyScalar::Float(*f),
            Py::Str(s) => PyScalar::Str(s),
            Py::Bytes(b) => PyScalar::Bytes(b),
            Py::List(_) | Py::Dict(_) | Py::Config(_) => return None,
        })
    }

    /// The dict key for this value, when Python allows it as an OmegaConf key.
    pub fn to_key(&self) -> Option<Key> {
        Some(match self {
            Py::None => Key::Null,
            Py::Bool(b) => Key::Bool(*b),
            Py::Int(i) => Key::Int(*i),
            Py::BigInt(digits) => Key::BigInt(digits.clone()),
            Py::Float(f) => Key::float(*f),
            Py::Str(s) => Key::Str(s.clone()),
            _ => return None,
        })
    }

    pub fn type_name(&self, tree: &Tree) -> &'static str {
        match self {
            Py::List(_) => "list",
            Py::Dict(_) => "dict",
            Py::Config(id) => match tree.body(*id) {
                Body::List(_) => "ListConfig",
                _ => "DictConfig",
            },
            leaf => leaf.as_scalar().map_or("object", PyScalar::type_name),
        }
    }

    /// Python's `str(x)`.
    pub fn str(&self, tree: &Tree) -> String {
        match self {
            Py::Str(s) => s.clone(),
            other => other.repr(tree),
        }
    }

    /// Python's `repr(x)`; a config container prints as its content, with leaves unresolved.
    pub fn repr(&self, tree: &Tree) -> String {
        match self {
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
            leaf => leaf.as_scalar().map(PyScalar::repr).unwrap_or_default(),
        }
    }

    /// Python's `bool(x)` (a container is true when it has entries).
    pub fn truthy(&self, tree: &Tree) -> bool {
        match self {
            Py::None => false,
            Py::Bool(b) => *b,
            Py::Int(i) => *i != 0,
            // Never zero: zero fits in i64.
            Py::BigInt(_) => true,
            Py::Float(f) => *f != 0.0,
            Py::Str(s) => !s.is_empty(),
            Py::Bytes(b) => !b.is_empty(),
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
        match (self.as_scalar(), other.as_scalar()) {
            (Some(a), Some(b)) => a.num_eq(b).unwrap_or_else(|| self == other),
            _ => self == other,
        }
    }

    fn as_number(&self) -> Option<Num> {
        match self {
            Py::Bool(b) => Some(Num::Int(BigInt::from_i64(i64::from(*b)))),
            Py::Int(i) => Some(Num::Int(BigInt::from_i64(*i))),
            Py::BigInt(digits) => BigInt::parse_decimal(digits).map(Num::Int),
            Py::Float(f) => Some(Num::Float(*f)),
            _ => None,
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
                .map(|(k, &c)| format!("{}: {}", k.as_py().repr(), config_repr(tree, c)))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

pub use crate::node::python_repr_str as repr_str;

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
            Num::Int(i) => {
                let f = i.to_string().parse::<f64>().unwrap_or(f64::NAN);
                if f.is_finite() {
                    Ok(f)
                } else {
                    Err(PyErr::new(
                        "OverflowError",
                        "int too large to convert to float",
                    ))
                }
            }
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
            (Num::Int(x), Num::Int(y)) => Py::int(x.mul(&y)),
            (x, y) => Py::Float(x.as_f64()? * y.as_f64()?),
        });
    }
    let (seq, n) = match (a, b) {
        (Py::Str(_) | Py::List(_) | Py::Bytes(_), _) => (a, b),
        (_, Py::Str(_) | Py::List(_) | Py::Bytes(_)) => (b, a),
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
        Py::Str(s) => Py::Str(s.repeat(repeat_count(&count, s.len())?)),
        Py::Bytes(v) => Py::Bytes(v.repeat(repeat_count(&count, v.len())?)),
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
        (Some(Num::Int(x)), Some(Num::Int(y))) => Ok(Py::int(x.sub(&y))),
        (Some(x), Some(y)) => Ok(Py::Float(x.as_f64()? - y.as_f64()?)),
        _ => Err(unsupported("-", a, b, tree)),
    }
}

/// Python `a // b`.
pub fn floor_div(a: &Py, b: &Py, tree: &Tree) -> Result<Py, PyErr> {
    match (a.as_number(), b.as_number()) {
        (Some(Num::Int(x)), Some(Num::Int(y))) => match x.div_mod_floor(&y) {
            Some((q, _)) => Ok(Py::int(q)),
            None => Err(PyErr::new(
                "ZeroDivisionError",
                "integer division or modulo by zero",
            )),
        },
        (Some(x), Some(y)) => {
            let (x, y) = (x.as_f64()?, y.as_f64()?);
            if y == 0.0 {
                return Err(PyErr::new(
                    "ZeroDivisionError",
                    "float floor division by zero",
                ));
            }
            Ok(Py::Float(float_floor_div(x, y)))
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
        Py::Str(x.into())
    }

    #[test]
    fn str_and_repr_follow_python() {
        let t = Tree::default();
        let cases = [
            (Py::None, "None"),
            (Py::Bool(true), "True"),
            (Py::Float(1e-7), "1e-07"),
            (Py::Float(1.0), "1.0"),
            (s("it's"), "it's"),
            (
                Py::List(vec![
                    Py::Int(1),
                    s("a"),
                    s("it's"),
                    Py::None,
                    Py::Float(f64::INFINITY),
                ]),
                "[1, 'a', \"it's\", None, inf]",
            ),
            (
                Py::Dict(vec![(s("a"), Py::List(vec![])), (Py::Int(1), s("x\\y"))]),
                "{'a': [], 1: 'x\\\\y'}",
            ),
            (Py::Bytes(b"a\x00".to_vec()), "b'a\\x00'"),
        ];
        for (v, want) in cases {
            assert_eq!(v.str(&t), want);
        }
    }

    #[test]
    fn arithmetic_matches_python() {
        let t = Tree::default();
        let cases: Vec<(Result<Py, PyErr>, Py)> = vec![
            (multiply(&Py::Int(3), &Py::Int(4), &t), Py::Int(12)),
            (multiply(&Py::Float(2.5), &Py::Int(3), &t), Py::Float(7.5)),
            (multiply(&s("a"), &Py::Int(3), &t), s("aaa")),
            (multiply(&Py::Bool(true), &s("ab"), &t), s("ab")),
            (multiply(&s("a"), &Py::Int(-2), &t), s("")),
            (
                multiply(&Py::List(vec![Py::Int(1)]), &Py::Int(2), &t),
                Py::List(vec![Py::Int(1), Py::Int(1)]),
            ),
            (floor_div(&Py::Int(-7), &Py::Int(2), &t), Py::Int(-4)),
            (floor_div(&Py::Int(7), &Py::Int(-2), &t), Py::Int(-4)),
            (floor_div(&Py::Float(7.5), &Py::Int(2), &t), Py::Float(3.0)),
            (
                floor_div(&Py::Float(-7.5), &Py::Int(2), &t),
                Py::Float(-4.0),
            ),
            (floor_div(&Py::Int(1), &Py::Float(0.1), &t), Py::Float(9.0)),
            (subtract(&Py::Bool(true), &Py::Int(2), &t), Py::Int(-1)),
            (subtract(&Py::Int(1), &Py::Float(0.5), &t), Py::Float(0.5)),
        ];
        for (got, want) in cases {
            assert_eq!(got, Ok(want));
        }
        assert_eq!(
            floor_div(&Py::Int(1), &Py::Int(0), &t).map_err(|e| e.class),
            Err("ZeroDivisionError")
        );
        assert_eq!(
            multiply(&s("a"), &s("b"), &t).map_err(|e| e.class),
            Err("TypeError")
        );
        assert_eq!(
            multiply(&s("a"), &Py::Float(2.0), &t).map_err(|e| e.class),
            Err("TypeError")
        );
        assert_eq!(
            subtract(&s("a"), &Py::Int(1), &t).map_err(|e| e.class),
            Err("TypeError")
        );
    }

    /// Expected values computed with CPython.
    #[test]
    fn int_arithmetic_is_exact_beyond_64_bits() {
        let t = Tree::default();
        let big = |d: &str| Py::BigInt(d.into());
        let cases: Vec<(Result<Py, PyErr>, Py)> = vec![
            (
                multiply(&Py::Int(i64::MAX), &Py::Int(2), &t),
                big("18446744073709551614"),
            ),
            (
                multiply(&big("99999999999999999999"), &Py::Int(-3), &t),
                big("-299999999999999999997"),
            ),
            (
                multiply(&big("99999999999999999999"), &Py::Float(0.5), &t),
                Py::Float(5e19),
            ),
            (multiply(&s("ab"), &big("-99999999999999999999"), &t), s("")),
            (
                subtract(&Py::Int(i64::MIN), &Py::Int(1), &t),
                big("-9223372036854775809"),
            ),
            (
                subtract(&big("9223372036854775808"), &Py::Int(1), &t),
                Py::Int(i64::MAX),
            ),
            (
                floor_div(&big("-99999999999999999999"), &Py::Int(7), &t),
                big("-14285714285714285715"),
            ),
            (
                floor_div(&Py::Int(i64::MIN), &Py::Int(-1), &t),
                big("9223372036854775808"),
            ),
            (
                floor_div(&big("18446744073709551616"), &big("4294967296"), &t),
                Py::Int(4294967296),
            ),
            (
                floor_div(&big("10000000000000000000"), &Py::Float(4.0), &t),
                Py::Float(2.5e18),
            ),
        ];
        for (got, want) in cases {
            assert_eq!(got, Ok(want));
        }
        assert_eq!(
            floor_div(&big("99999999999999999999"), &Py::Int(0), &t).map_err(|e| e.class),
            Err("ZeroDivisionError")
        );
        assert_eq!(
            multiply(&s("a"), &big("99999999999999999999"), &t).map_err(|e| e.class),
            Err("OverflowError")
        );
        let huge = big(&"9".repeat(400));
        assert_eq!(
            multiply(&huge, &Py::Float(1.0), &t).map_err(|e| e.class),
            Err("OverflowError")
        );
        assert_eq!(big("99999999999999999999").str(&t), "99999999999999999999");
        assert!(big("-99999999999999999999").truthy(&t));
        assert!(big("100000000000000000000").key_eq(&Py::Float(1e20)));
        assert!(!big("100000000000000000001").key_eq(&Py::Float(1e20)));
    }

    #[test]
    fn truthiness_and_key_equality() {
        let t = Tree::default();
        assert!(!s("").truthy(&t));
        assert!(Py::Float(f64::NAN).truthy(&t));
        assert!(!Py::List(vec![]).truthy(&t));
        assert!(Py::Int(1).key_eq(&Py::Bool(true)));
        assert!(Py::Float(1.0).key_eq(&Py::Int(1)));
        assert!(!s("1").key_eq(&Py::Int(1)));
    }
}
