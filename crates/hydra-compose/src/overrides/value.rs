//! Values as Hydra's override visitor holds them while evaluating functions, with Python's semantics.
//!
//! Unlike the public [`Element`], a [`Val`] may hold sweeps inside lists (Hydra only notices when it
//! merges) and remembers quoted strings inside containers (`sort(['b','a'])` fails in Hydra because
//! `QuotedString` has no ordering).

use std::collections::BTreeSet;

use num_bigint::BigInt;

use super::OverrideValue;
use super::element::{Element, Quote};
use super::sweep::{ChoiceSweep, GlobSweep, IntervalSweep, RangeSweep, Sweep};
use crate::node::Key;
use crate::scalar::Scalar;

/// Not an [`Element`] (nor a config `Value`): it may hold sweeps and quoted strings inside containers
/// (see the module comment); its scalars are [`Scalar`]s, with Python's `repr` and type names.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Val {
    Scalar(Scalar),
    Quoted(String, Quote),
    List(Vec<Val>),
    Dict(Vec<(Key, Val)>),
    Choice(Choice),
    Range(RangeSweep),
    Interval(IntervalSweep),
    Glob(GlobSweep),
}

/// Hydra's `ChoiceSweep` while its items may still be any value.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Choice {
    pub items: Vec<Val>,
    pub simple_form: bool,
    pub shuffle: bool,
    pub tags: BTreeSet<String>,
}

impl Choice {
    pub fn new(items: Vec<Val>, simple_form: bool) -> Choice {
        Choice {
            items,
            simple_form,
            shuffle: false,
            tags: BTreeSet::new(),
        }
    }
}

impl Val {
    pub const NONE: Val = Val::Scalar(Scalar::None);

    pub fn str(s: impl Into<String>) -> Val {
        Val::Scalar(Scalar::Str(s.into()))
    }

    /// An exact int: an `i64` when it fits, else a big int.
    pub fn int(v: BigInt) -> Val {
        Val::Scalar(Scalar::int(v))
    }

    /// Python's `type(v).__name__`.
    pub fn type_name(&self) -> &'static str {
        match self {
            Val::Scalar(s) => s.type_name(),
            Val::Quoted(..) => "QuotedString",
            Val::List(_) => "list",
            Val::Dict(_) => "dict",
            Val::Choice(_) => "ChoiceSweep",
            Val::Range(_) => "RangeSweep",
            Val::Interval(_) => "IntervalSweep",
            Val::Glob(_) => "Glob",
        }
    }

    /// The Python scalar this is; `None` for quoted strings, containers and sweeps.
    pub fn as_scalar(&self) -> Option<&Scalar> {
        match self {
            Val::Scalar(s) => Some(s),
            _ => None,
        }
    }

    /// True for bool, int and float.
    pub fn is_number(&self) -> bool {
        self.as_scalar().is_some_and(Scalar::is_number)
    }

    pub fn is_sweep(&self) -> bool {
        matches!(self, Val::Choice(_) | Val::Range(_) | Val::Interval(_))
    }
}

/// Python `a == b` (`1 == 1.0 == True`, `QuotedString` equal only to an equal `QuotedString`).
pub(super) fn py_eq(a: &Val, b: &Val) -> bool {
    match (a, b) {
        (Val::Scalar(x), Val::Scalar(y)) => x.num_eq(y).unwrap_or(x == y),
        (Val::Quoted(x, qx), Val::Quoted(y, qy)) => x == y && qx == qy,
        (Val::List(x), Val::List(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(p, q)| py_eq(p, q))
        }
        (Val::Dict(x), Val::Dict(y)) => {
            x.len() == y.len()
                && x.iter()
                    .all(|(k, v)| y.iter().any(|(k2, v2)| key_eq(k, k2) && py_eq(v, v2)))
        }
        _ => a == b,
    }
}

/// Python dict-key equality (`{1: a, 1.0: b, true: c}` has one key).
pub(super) fn key_eq(a: &Key, b: &Key) -> bool {
    a.0.num_eq(&b.0).unwrap_or_else(|| a == b)
}

/// Python `a < b`; `Err` is Python's TypeError message for unorderable types.
pub(super) fn py_lt(a: &Val, b: &Val) -> Result<bool, String> {
    let (sa, sb) = (a.as_scalar(), b.as_scalar());
    if let (Some(x), Some(y)) = (
        sa.and_then(Scalar::exact_int),
        sb.and_then(Scalar::exact_int),
    ) {
        return Ok(x < y);
    }
    if let (Some(x), Some(y)) = (sa.and_then(Scalar::as_f64), sb.and_then(Scalar::as_f64)) {
        return Ok(x < y);
    }
    match (a, b) {
        (Val::Scalar(Scalar::Str(x)), Val::Scalar(Scalar::Str(y))) => Ok(x < y),
        (Val::List(x), Val::List(y)) => {
            for (p, q) in x.iter().zip(y) {
                if !py_eq(p, q) {
                    return py_lt(p, q);
                }
            }
            Ok(x.len() < y.len())
        }
        _ => Err(format!(
            "'<' not supported between instances of '{}' and '{}'",
            a.type_name(),
            b.type_name()
        )),
    }
}

/// Python's `sorted(items, reverse=...)`: stable, and failing on the first unorderable pair it compares.
pub(super) fn py_sorted(items: &[Val], reverse: bool) -> Result<Vec<Val>, String> {
    // A merge sort using only `<`, as Python's sort does; `reverse` keeps equal items in input order.
    if items.len() <= 1 {
        return Ok(items.to_vec());
    }
    let (left, right) = items.split_at(items.len() / 2);
    let (left, right) = (py_sorted(left, reverse)?, py_sorted(right, reverse)?);
    let mut out = Vec::with_capacity(items.len());
    let (mut i, mut j) = (0, 0);
    while i < left.len() && j < right.len() {
        let take_right = if reverse {
            py_lt(&left[i], &right[j])?
        } else {
            py_lt(&right[j], &left[i])?
        };
        if take_right {
            out.push(right[j].clone());
            j += 1;
        } else {
            out.push(left[i].clone());
            i += 1;
        }
    }
    out.extend_from_slice(&left[i..]);
    out.extend_from_slice(&right[j..]);
    Ok(out)
}

pub(super) use crate::scalar::python_repr_str as py_repr_str;

/// Python's `repr()` of a value, for error messages.
pub(super) fn py_repr(v: &Val) -> String {
    match v {
        Val::Scalar(s) => s.repr(),
        Val::Quoted(s, q) => format!(
            "QuotedString(text={}, quote=<Quote.{}>)",
            py_repr_str(s),
            q.python_name()
        ),
        Val::List(items) => format!(
            "[{}]",
            items.iter().map(py_repr).collect::<Vec<_>>().join(", ")
        ),
        Val::Dict(pairs) => {
            let inner: Vec<String> = pairs
                .iter()
                .map(|(k, v)| format!("{}: {}", k.0.repr(), py_repr(v)))
                .collect();
            format!("{{{}}}", inner.join(", "))
        }
        other => other.type_name().to_owned(),
    }
}

/// Why a parsed value cannot become an override value.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Nested {
    /// A sweep inside a list or dict; the payload is its Python type name.
    Sweep(&'static str),
}

/// The visitor's result as an [`OverrideValue`]: top-level sweeps stay sweeps, everything else an element.
pub(super) fn into_override_value(v: Val) -> Result<OverrideValue, Nested> {
    Ok(match v {
        Val::Choice(c) => {
            // Hydra parses `1,choice(2,3)` and fails only when a sweeper formats the inner sweep.
            let nested_sweep = c.items.iter().find_map(nested_sweep_type);
            let items = c
                .items
                .into_iter()
                .filter(|v| nested_sweep_type(v).is_none());
            OverrideValue::Sweep(Sweep::Choice(ChoiceSweep {
                items: items.map(into_element).collect::<Result<_, _>>()?,
                simple_form: c.simple_form,
                shuffle: c.shuffle,
                tags: c.tags,
                nested_sweep,
            }))
        }
        Val::Range(r) => OverrideValue::Sweep(Sweep::Range(r)),
        Val::Interval(i) => OverrideValue::Sweep(Sweep::Interval(i)),
        Val::Glob(g) => OverrideValue::Sweep(Sweep::Glob(g)),
        other => OverrideValue::Element(into_element(other)?),
    })
}

/// The Python type name of the first sweep in `v`, itself included.
fn nested_sweep_type(v: &Val) -> Option<&'static str> {
    match v {
        Val::Choice(_) | Val::Range(_) | Val::Interval(_) | Val::Glob(_) => Some(v.type_name()),
        Val::List(items) => items.iter().find_map(nested_sweep_type),
        Val::Dict(pairs) => pairs.iter().find_map(|(_, v)| nested_sweep_type(v)),
        _ => None,
    }
}

pub(super) fn into_element(v: Val) -> Result<Element, Nested> {
    Ok(match v {
        Val::Scalar(s) => Element::Scalar(s),
        Val::Quoted(s, q) => Element::Quoted(s, q),
        Val::List(items) => Element::List(
            items
                .into_iter()
                .map(into_element)
                .collect::<Result<_, _>>()?,
        ),
        Val::Dict(pairs) => Element::Dict(
            pairs
                .into_iter()
                .map(|(k, v)| Ok((k, into_element(v)?)))
                .collect::<Result<_, Nested>>()?,
        ),
        sweep @ (Val::Choice(_) | Val::Range(_) | Val::Interval(_) | Val::Glob(_)) => {
            return Err(Nested::Sweep(sweep.type_name()));
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(x: &str) -> Val {
        Val::Scalar(Scalar::Str(x.into()))
    }

    #[test]
    fn equality_follows_python() {
        assert!(py_eq(
            &Val::Scalar(Scalar::Int(1)),
            &Val::Scalar(Scalar::Float(1.0))
        ));
        assert!(py_eq(
            &Val::Scalar(Scalar::Bool(true)),
            &Val::Scalar(Scalar::Int(1))
        ));
        assert!(!py_eq(
            &Val::Scalar(Scalar::Str("1".into())),
            &Val::Scalar(Scalar::Int(1))
        ));
        assert!(!py_eq(
            &Val::Scalar(Scalar::Float(f64::NAN)),
            &Val::Scalar(Scalar::Float(f64::NAN))
        ));
        assert!(key_eq(&Key::int(1), &Key::float(1.0)));
        assert!(!key_eq(&Key(Scalar::Str("1".into())), &Key(Scalar::Int(1))));
    }

    #[test]
    fn sorting_is_stable_and_fails_on_mixed_types() {
        let items = [
            Val::Scalar(Scalar::Int(2)),
            Val::Scalar(Scalar::Float(1.0)),
            Val::Scalar(Scalar::Bool(true)),
            Val::Scalar(Scalar::Int(0)),
        ];
        let sorted = py_sorted(&items, false).unwrap_or_default();
        assert_eq!(
            sorted,
            vec![
                Val::Scalar(Scalar::Int(0)),
                Val::Scalar(Scalar::Float(1.0)),
                Val::Scalar(Scalar::Bool(true)),
                Val::Scalar(Scalar::Int(2))
            ]
        );
        let sorted = py_sorted(&items, true).unwrap_or_default();
        assert_eq!(
            sorted,
            vec![
                Val::Scalar(Scalar::Int(2)),
                Val::Scalar(Scalar::Float(1.0)),
                Val::Scalar(Scalar::Bool(true)),
                Val::Scalar(Scalar::Int(0))
            ]
        );
        let err = py_sorted(&[Val::Scalar(Scalar::Int(1)), s("a")], false);
        assert_eq!(
            err,
            Err("'<' not supported between instances of 'str' and 'int'".to_owned())
        );
        let lists = [
            Val::List(vec![Val::Scalar(Scalar::Int(1)), s("b")]),
            Val::List(vec![Val::Scalar(Scalar::Int(1)), s("a")]),
        ];
        assert_eq!(
            py_sorted(&lists, false).map(|v| v[0].clone()),
            Ok(lists[1].clone())
        );
    }

    #[test]
    fn repr_matches_python() {
        assert_eq!(py_repr_str("a'b"), "\"a'b\"");
        assert_eq!(py_repr_str("a\\b"), "'a\\\\b'");
        assert_eq!(
            py_repr(&Val::List(vec![
                Val::Scalar(Scalar::Int(1)),
                s("x"),
                Val::NONE
            ])),
            "[1, 'x', None]"
        );
    }
}
