//! Hydra's override functions (`int() float() str() bool() choice() range() interval() tag() sort()
//! shuffle() glob()`), with Python's argument binding, type checks and exceptions.

use std::collections::{BTreeSet, HashMap};

use num_bigint::BigInt;
use rand::seq::SliceRandom;

use super::GrammarError;
use super::sweep::{GlobSweep, IntervalSweep, Number, RangeSweep};
use super::value::{Choice, Val, py_repr, py_sorted};
use crate::scalar::{Scalar, float_to_exact_int, int_to_f64, parse_int_digits, python_float_repr};

/// A call as the visitor collected it: positional args, then keyword args (a later duplicate wins).
pub(super) struct Call<'a> {
    pub name: &'a str,
    /// The call's source text, as Hydra prints it in errors.
    pub text: &'a str,
    pub args: Vec<Val>,
    pub kwargs: Vec<(String, Val)>,
}

/// A Python exception raised by a function: its class name and message.
struct Raise {
    exception: &'static str,
    message: String,
}

fn type_error(message: impl Into<String>) -> Raise {
    Raise {
        exception: "TypeError",
        message: message.into(),
    }
}

fn value_error(message: impl Into<String>) -> Raise {
    Raise {
        exception: "ValueError",
        message: message.into(),
    }
}

fn assertion_error() -> Raise {
    Raise {
        exception: "AssertionError",
        message: String::new(),
    }
}

const AVAILABLE: &str = "bool,choice,float,glob,int,interval,range,shuffle,sort,str,tag";

/// Evaluate a function call the way Hydra's `Functions.eval` does.
pub(super) fn eval(call: Call<'_>) -> Result<Val, GrammarError> {
    let text = call.text.to_owned();
    eval_inner(call).map_err(|r| GrammarError::Function {
        call: text,
        exception: r.exception,
        message: r.message,
    })
}

fn eval_inner(call: Call<'_>) -> Result<Val, Raise> {
    let Some(sig) = signature(call.name) else {
        return Err(Raise {
            exception: "HydraException",
            message: format!("Unknown function '{}'\nAvailable: {AVAILABLE}\n", call.name),
        });
    };
    // Hydra strips the quotes of top-level string arguments before binding.
    let unquote = |v: Val| match v {
        Val::Quoted(s, _) => Val::str(s),
        other => other,
    };
    let args: Vec<Val> = call.args.into_iter().map(unquote).collect();
    // Hydra collects keyword arguments in a dict: a repeated name keeps its first place, the last value.
    let mut kwargs: Vec<(String, Val)> = Vec::new();
    let mut seen: HashMap<String, usize> = HashMap::new();
    for (name, v) in call.kwargs {
        let v = unquote(v);
        match seen.get(&name) {
            Some(&i) => {
                if let Some(slot) = kwargs.get_mut(i) {
                    slot.1 = v;
                }
            }
            None => {
                seen.insert(name.clone(), kwargs.len());
                kwargs.push((name, v));
            }
        }
    }
    let bound = bind(&sig, args, kwargs)?;
    check_types(&sig, &bound)?;
    (sig.body)(bound)
}

/// What a parameter accepts, as Hydra's `is_type_matching` checks it (a `Union` uses `isinstance`, so
/// `bool` passes for `int`; a bare `bool` must be exactly `bool`).
#[derive(Clone, Copy)]
enum Accept {
    /// `CastType`: anything but a `Glob`.
    Castable,
    /// `Union[str, int, float, bool, Dict, List, ChoiceSweep]`
    ChoiceArg,
    /// `Union[int, float]`, optionally `None`.
    Number { optional: bool },
    /// `Union[str, Sweep]`
    TagArg,
    /// `Optional[Sweep]`
    OptSweep,
    /// `Union[ElementType, ChoiceSweep, RangeSweep]`
    SortArg,
    /// `Optional[Union[ChoiceSweep, RangeSweep]]`
    OptChoiceOrRange,
    /// `Optional[List[Any]]`
    OptList,
    /// `bool`
    ExactBool,
    /// `Union[List[str], str]`, optionally `None`.
    StrOrList { optional: bool },
}

impl Accept {
    fn accepts(self, v: &Val) -> bool {
        use Val as V;
        let number = v.is_number();
        let null = matches!(v, V::Scalar(Scalar::None));
        let str = matches!(v, V::Scalar(Scalar::Str(_)));
        match self {
            Accept::Castable => !matches!(v, V::Glob(_)),
            Accept::ChoiceArg => {
                number || str || matches!(v, V::Dict(_) | V::List(_) | V::Choice(_))
            }
            Accept::Number { optional } => number || (optional && null),
            Accept::TagArg => str || v.is_sweep(),
            Accept::OptSweep => null || v.is_sweep(),
            Accept::SortArg => {
                number || str || matches!(v, V::List(_) | V::Dict(_) | V::Choice(_) | V::Range(_))
            }
            Accept::OptChoiceOrRange => null || matches!(v, V::Choice(_) | V::Range(_)),
            Accept::OptList => null || matches!(v, V::List(_)),
            Accept::ExactBool => matches!(v, V::Scalar(Scalar::Bool(_))),
            Accept::StrOrList { optional } => str || matches!(v, V::List(_)) || (optional && null),
        }
    }

    fn python_name(self) -> &'static str {
        match self {
            Accept::Castable => {
                "Optional[Union[str, int, float, bool, List[Any], Dict[str, Any], QuotedString, Sweep]]"
            }
            Accept::ChoiceArg => {
                "Union[str, int, float, bool, Dict[Any, Any], List[Any], ChoiceSweep]"
            }
            Accept::Number { optional: false } => "Union[int, float]",
            Accept::Number { optional: true } => "Optional[Union[int, float]]",
            Accept::TagArg => "Union[str, Sweep]",
            Accept::OptSweep => "Optional[Sweep]",
            Accept::SortArg => "Union[str, int, bool, float, list, dict, ChoiceSweep, RangeSweep]",
            Accept::OptChoiceOrRange => "Optional[Union[ChoiceSweep, RangeSweep]]",
            Accept::OptList => "Optional[List[Any]]",
            Accept::ExactBool => "bool",
            Accept::StrOrList { optional: false } => "Union[List[str], str]",
            Accept::StrOrList { optional: true } => "Optional[Union[str, List[str]]]",
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// Positional-or-keyword without default.
    Required,
    /// Positional-or-keyword with a default.
    Optional,
    /// `*args`
    Var,
    /// After `*args`, with a default.
    KeywordOnly,
}

struct Param {
    name: &'static str,
    kind: Kind,
    accept: Accept,
}

const fn p(name: &'static str, kind: Kind, accept: Accept) -> Param {
    Param { name, kind, accept }
}

/// A function's implementation, called with its bound and type-checked arguments.
type Body = fn(Bound) -> Result<Val, Raise>;

struct Signature {
    params: &'static [Param],
    body: Body,
}

/// Bound arguments: `*args` and the named parameters that were given.
struct Bound {
    var: Vec<Val>,
    named: Vec<(&'static str, Val)>,
}

impl Bound {
    /// A named argument; an explicit `None` counts as not given, as the Python bodies treat it.
    fn take(&mut self, name: &str) -> Option<Val> {
        let i = self.named.iter().position(|(n, _)| *n == name)?;
        match self.named.remove(i).1 {
            Val::NONE => None,
            v => Some(v),
        }
    }
}

const NUM: Accept = Accept::Number { optional: false };
const CAST: &[Param] = &[
    p("args", Kind::Var, Accept::Castable),
    p("value", Kind::KeywordOnly, Accept::Castable),
];
const CHOICE: &[Param] = &[p("args", Kind::Var, Accept::ChoiceArg)];
const RANGE: &[Param] = &[
    p("start", Kind::Required, NUM),
    p("stop", Kind::Optional, Accept::Number { optional: true }),
    p("step", Kind::Optional, NUM),
];
const INTERVAL: &[Param] = &[
    p("start", Kind::Required, NUM),
    p("end", Kind::Required, NUM),
];
const TAG: &[Param] = &[
    p("args", Kind::Var, Accept::TagArg),
    p("sweep", Kind::KeywordOnly, Accept::OptSweep),
];
const SHUFFLE: &[Param] = &[
    p("args", Kind::Var, Accept::SortArg),
    p("sweep", Kind::KeywordOnly, Accept::OptChoiceOrRange),
    p("list", Kind::KeywordOnly, Accept::OptList),
];
const SORT: &[Param] = &[
    p("args", Kind::Var, Accept::SortArg),
    p("sweep", Kind::KeywordOnly, Accept::OptChoiceOrRange),
    p("list", Kind::KeywordOnly, Accept::OptList),
    p("reverse", Kind::KeywordOnly, Accept::ExactBool),
];
const GLOB: &[Param] = &[
    p(
        "include",
        Kind::Required,
        Accept::StrOrList { optional: false },
    ),
    p(
        "exclude",
        Kind::Optional,
        Accept::StrOrList { optional: true },
    ),
];

fn signature(name: &str) -> Option<Signature> {
    let (params, body): (&'static [Param], Body) = match name {
        "int" => (CAST, |b| cast_call(Cast::Int, b)),
        "float" => (CAST, |b| cast_call(Cast::Float, b)),
        "str" => (CAST, |b| cast_call(Cast::Str, b)),
        "bool" => (CAST, |b| cast_call(Cast::Bool, b)),
        "choice" => (CHOICE, choice),
        "range" => (RANGE, range),
        "interval" => (INTERVAL, interval),
        "tag" => (TAG, tag),
        "shuffle" => (SHUFFLE, shuffle),
        "sort" => (SORT, sort),
        "glob" => (GLOB, glob),
        _ => return None,
    };
    Some(Signature { params, body })
}

/// Python's `inspect.Signature.bind`.
fn bind(sig: &Signature, args: Vec<Val>, kwargs: Vec<(String, Val)>) -> Result<Bound, Raise> {
    let mut bound = Bound {
        var: Vec::new(),
        named: Vec::new(),
    };
    let mut positional = sig
        .params
        .iter()
        .filter(|p| matches!(p.kind, Kind::Required | Kind::Optional));
    let has_var = sig.params.iter().any(|p| p.kind == Kind::Var);
    // While binding positionals Python refuses a keyword for a parameter already bound (keywords are
    // unique here, as in the visitor's dict); then each remaining parameter, in order, takes its keyword or
    // is missing; keywords left over are unexpected.
    for arg in args {
        match positional.next() {
            Some(param) => {
                if kwargs.iter().any(|(n, _)| n == param.name) {
                    return Err(type_error(format!(
                        "multiple values for argument '{}'",
                        param.name
                    )));
                }
                bound.named.push((param.name, arg));
            }
            None if has_var => bound.var.push(arg),
            None => return Err(type_error("too many positional arguments")),
        }
    }
    let mut kwargs = kwargs;
    for param in sig.params.iter().filter(|p| p.kind != Kind::Var) {
        if bound.named.iter().any(|(n, _)| *n == param.name) {
            continue;
        }
        match kwargs.iter().position(|(n, _)| n == param.name) {
            Some(i) => {
                let (_, v) = kwargs.remove(i);
                bound.named.push((param.name, v));
            }
            None if param.kind == Kind::Required => {
                return Err(type_error(format!(
                    "missing a required argument: '{}'",
                    param.name
                )));
            }
            None => {}
        }
    }
    if let Some((name, _)) = kwargs.first() {
        return Err(type_error(format!(
            "got an unexpected keyword argument '{name}'"
        )));
    }
    Ok(bound)
}

fn check_types(sig: &Signature, bound: &Bound) -> Result<(), Raise> {
    let mismatch = |name: String, v: &Val, accept: Accept| {
        type_error(format!(
            "mismatch type argument {name}: {} is incompatible with {}",
            v.type_name(),
            accept.python_name()
        ))
    };
    for param in sig.params {
        if param.kind == Kind::Var {
            if let Some((i, v)) = bound
                .var
                .iter()
                .enumerate()
                .find(|(_, v)| !param.accept.accepts(v))
            {
                return Err(mismatch(format!("{}[{i}]", param.name), v, param.accept));
            }
        } else if let Some((_, v)) = bound.named.iter().find(|(n, _)| *n == param.name)
            && !param.accept.accepts(v)
        {
            return Err(mismatch(param.name.to_owned(), v, param.accept));
        }
    }
    Ok(())
}

/// `_list_to_simple_choice`: several arguments become the simple form `a,b,c`.
fn simple_choice(items: Vec<Val>) -> Result<Choice, Raise> {
    if items
        .iter()
        .any(|v| v.is_sweep() || matches!(v, Val::Glob(_)))
    {
        return Err(assertion_error());
    }
    Ok(Choice::new(items, true))
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Cast {
    Int,
    Float,
    Str,
    Bool,
}

impl Cast {
    fn name(self) -> &'static str {
        match self {
            Cast::Int => "int",
            Cast::Float => "float",
            Cast::Str => "str",
            Cast::Bool => "bool",
        }
    }
}

fn cast_call(kind: Cast, mut b: Bound) -> Result<Val, Raise> {
    let value = b.take("value");
    let target = match (value, b.var.len()) {
        (Some(_), n) if n > 0 => {
            return Err(type_error("cannot use both position and named arguments"));
        }
        (Some(v), _) => v,
        (None, 0) => return Err(type_error("No positional args or value specified")),
        (None, 1) => b.var.remove(0),
        (None, _) => Val::Choice(simple_choice(b.var)?),
    };
    cast(kind, target)
}

fn cast(kind: Cast, v: Val) -> Result<Val, Raise> {
    match v {
        Val::Quoted(s, _) => cast(kind, Val::str(s)),
        Val::Dict(pairs) => Ok(Val::Dict(
            pairs
                .into_iter()
                .map(|(k, v)| Ok((k, cast(kind, v)?)))
                .collect::<Result<_, Raise>>()?,
        )),
        Val::List(items) => Ok(Val::List(
            items
                .into_iter()
                .map(|v| cast(kind, v))
                .collect::<Result<_, _>>()?,
        )),
        Val::Choice(c) => {
            let items = c
                .items
                .into_iter()
                .map(|v| cast(kind, v))
                .collect::<Result<_, _>>()?;
            Ok(Val::Choice(Choice::new(items, c.simple_form)))
        }
        Val::Range(r) => {
            if !matches!(kind, Cast::Int | Cast::Float) {
                return Err(value_error("Range can only be cast to int or float"));
            }
            Ok(Val::Range(RangeSweep {
                start: cast_number(kind, r.start)?,
                stop: cast_number(kind, r.stop)?,
                step: cast_number(kind, r.step)?,
                shuffle: false,
                tags: BTreeSet::new(),
            }))
        }
        Val::Interval(i) => match kind {
            Cast::Str | Cast::Bool => Err(value_error(format!(
                "Intervals cannot be cast to {}",
                kind.name()
            ))),
            Cast::Int | Cast::Float => Ok(Val::Interval(IntervalSweep {
                start: cast_number(kind, i.start)?,
                end: cast_number(kind, i.end)?,
                tags: i.tags,
            })),
        },
        // `cast_bool` ends in Python's `bool(value)`, which accepts None; the others assert a primitive.
        Val::NONE if kind == Cast::Bool => Ok(Val::Scalar(Scalar::Bool(false))),
        Val::Scalar(Scalar::None | Scalar::Bytes(_)) | Val::Glob(_) => Err(assertion_error()),
        Val::Scalar(_) => cast_primitive(kind, v),
    }
}

fn cast_number(kind: Cast, n: Number) -> Result<Number, Raise> {
    let v = match n {
        Number::Int(i) => Val::Scalar(Scalar::Int(i)),
        Number::Float(f) => Val::Scalar(Scalar::Float(f)),
    };
    match cast_primitive(kind, v)? {
        Val::Scalar(Scalar::Int(i)) => Ok(Number::Int(i)),
        Val::Scalar(Scalar::Float(f)) => Ok(Number::Float(f)),
        Val::Scalar(Scalar::BigInt(i)) => Err(sweep_bound_too_big(&i)),
        _ => Err(assertion_error()),
    }
}

/// Sweep bounds are `i64` here; Python's would be unbounded.
fn sweep_bound_too_big(digits: &BigInt) -> Raise {
    Raise {
        exception: "OverflowError",
        message: format!("sweep bound {digits} does not fit in 64 bits"),
    }
}

fn cast_primitive(kind: Cast, v: Val) -> Result<Val, Raise> {
    Ok(match (kind, v) {
        (Cast::Int, Val::Scalar(Scalar::Bool(b))) => Val::Scalar(Scalar::Int(i64::from(b))),
        (Cast::Int, Val::Scalar(Scalar::Int(i))) => Val::Scalar(Scalar::Int(i)),
        (Cast::Int, Val::Scalar(Scalar::Float(f))) => Val::int(float_to_int(f)?),
        (Cast::Int, Val::Scalar(Scalar::Str(s))) => Val::int(py_int_from_str(&s)?),
        (Cast::Int, Val::Scalar(Scalar::BigInt(i))) => Val::Scalar(Scalar::BigInt(i)),
        (Cast::Float, Val::Scalar(Scalar::BigInt(i))) => {
            Val::Scalar(Scalar::Float(big_to_float(&i)?))
        }
        (Cast::Str, Val::Scalar(Scalar::BigInt(i))) => Val::str(i.to_string()),
        // Never zero: zero fits in i64.
        (Cast::Bool, Val::Scalar(Scalar::BigInt(_))) => Val::Scalar(Scalar::Bool(true)),
        (Cast::Float, Val::Scalar(Scalar::Bool(b))) => {
            Val::Scalar(Scalar::Float(f64::from(u8::from(b))))
        }
        (Cast::Float, Val::Scalar(Scalar::Int(i))) => Val::Scalar(Scalar::Float(i as f64)),
        (Cast::Float, Val::Scalar(Scalar::Float(f))) => Val::Scalar(Scalar::Float(f)),
        (Cast::Float, Val::Scalar(Scalar::Str(s))) => {
            Val::Scalar(Scalar::Float(py_float_from_str(&s)?))
        }
        (Cast::Str, Val::Scalar(Scalar::Bool(b))) => Val::str(if b { "true" } else { "false" }),
        (Cast::Str, Val::Scalar(Scalar::Int(i))) => Val::str(i.to_string()),
        (Cast::Str, Val::Scalar(Scalar::Float(f))) => Val::str(python_float_repr(f)),
        (Cast::Str, Val::Scalar(Scalar::Str(s))) => Val::Scalar(Scalar::Str(s)),
        (Cast::Bool, Val::Scalar(Scalar::Str(s))) => match s.to_lowercase().as_str() {
            "false" => Val::Scalar(Scalar::Bool(false)),
            "true" => Val::Scalar(Scalar::Bool(true)),
            _ => return Err(value_error(format!("Cannot cast '{s}' to bool"))),
        },
        (Cast::Bool, Val::Scalar(Scalar::Bool(b))) => Val::Scalar(Scalar::Bool(b)),
        (Cast::Bool, Val::Scalar(Scalar::Int(i))) => Val::Scalar(Scalar::Bool(i != 0)),
        (Cast::Bool, Val::Scalar(Scalar::Float(f))) => Val::Scalar(Scalar::Bool(f != 0.0)),
        _ => return Err(assertion_error()),
    })
}

/// Python's `float(int)`, which refuses ints beyond the float range.
fn big_to_float(i: &BigInt) -> Result<f64, Raise> {
    int_to_f64(i).ok_or_else(|| Raise {
        exception: "OverflowError",
        message: "int too large to convert to float".into(),
    })
}

/// Python's `int(float)`: truncation, with Python's errors for inf and nan.
fn float_to_int(f: f64) -> Result<BigInt, Raise> {
    if f.is_nan() {
        return Err(value_error("cannot convert float NaN to integer"));
    }
    if f.is_infinite() {
        return Err(Raise {
            exception: "OverflowError",
            message: "cannot convert float infinity to integer".into(),
        });
    }
    // A finite float truncated is integral, so this always converts.
    float_to_exact_int(f.trunc())
        .ok_or_else(|| value_error(format!("cannot convert float {f} to integer")))
}

/// `DIGIT (('_')? DIGIT)*` over the whole of `s`.
fn is_underscored_digits(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b[0].is_ascii_digit()
        && b[b.len() - 1].is_ascii_digit()
        && b.iter().all(|c| c.is_ascii_digit() || *c == b'_')
        && !s.contains("__")
}

/// What Python's `int(str)` and `float(str)` both do first: drop surrounding whitespace, then split off a sign.
fn split_sign(s: &str) -> (bool, &str) {
    let t = s.trim();
    match t.as_bytes().first() {
        Some(b'-') => (true, &t[1..]),
        Some(b'+') => (false, &t[1..]),
        _ => (false, t),
    }
}

/// Python's `int(str)` in base 10: surrounding whitespace, a sign, digits with single underscores.
fn py_int_from_str(s: &str) -> Result<BigInt, Raise> {
    let invalid = || {
        value_error(format!(
            "invalid literal for int() with base 10: {}",
            super::value::py_repr_str(s)
        ))
    };
    let (negative, digits) = split_sign(s);
    if !is_underscored_digits(digits) {
        return Err(invalid());
    }
    let clean: String = digits.chars().filter(|c| *c != '_').collect();
    let magnitude = parse_int_digits(&clean, 10).ok_or_else(invalid)?;
    Ok(if negative { -magnitude } else { magnitude })
}

/// Python's `float(str)`: whitespace, sign, `inf`/`infinity`/`nan`, digits with single underscores.
fn py_float_from_str(s: &str) -> Result<f64, Raise> {
    let invalid = || {
        value_error(format!(
            "could not convert string to float: {}",
            super::value::py_repr_str(s)
        ))
    };
    let (negative, body) = split_sign(s);
    let magnitude = match body.to_ascii_lowercase().as_str() {
        "inf" | "infinity" => f64::INFINITY,
        "nan" => f64::NAN,
        _ => {
            let (mantissa, exponent) = match body.find(['e', 'E']) {
                Some(i) => (&body[..i], Some(&body[i + 1..])),
                None => (body, None),
            };
            let (int_part, frac_part) = match mantissa.split_once('.') {
                Some((i, f)) => (i, Some(f)),
                None => (mantissa, None),
            };
            let int_ok = int_part.is_empty() || is_underscored_digits(int_part);
            let frac_ok = frac_part.is_none_or(|f| f.is_empty() || is_underscored_digits(f));
            let has_digit = !int_part.is_empty() || frac_part.is_some_and(|f| !f.is_empty());
            let exp_ok = exponent.is_none_or(|e| {
                let e = e.strip_prefix(['+', '-']).unwrap_or(e);
                is_underscored_digits(e)
            });
            if !(int_ok && frac_ok && has_digit && exp_ok) {
                return Err(invalid());
            }
            let clean: String = body.chars().filter(|c| *c != '_').collect();
            clean.parse::<f64>().map_err(|_| invalid())?
        }
    };
    Ok(if negative { -magnitude } else { magnitude })
}

/// The value of a `FLOAT` token (the lexer guarantees Python's `float()` accepts it).
pub(super) fn parse_float_token(text: &str) -> f64 {
    py_float_from_str(text).unwrap_or(f64::NAN)
}

fn choice(b: Bound) -> Result<Val, Raise> {
    let mut args = b.var;
    if args.is_empty() {
        return Err(value_error("empty choice is not legal"));
    }
    if let [Val::Choice(c)] = args.as_mut_slice() {
        if !c.simple_form {
            return Err(value_error("nesting choices is not supported"));
        }
        c.simple_form = false;
        return Ok(args.remove(0));
    }
    Ok(Val::Choice(Choice::new(args, false)))
}

fn number(v: Val) -> Result<Number, Raise> {
    match v {
        Val::Scalar(Scalar::Bool(b)) => Ok(Number::Int(i64::from(b))),
        Val::Scalar(Scalar::Int(i)) => Ok(Number::Int(i)),
        Val::Scalar(Scalar::BigInt(i)) => Err(sweep_bound_too_big(&i)),
        Val::Scalar(Scalar::Float(f)) => Ok(Number::Float(f)),
        _ => Err(assertion_error()),
    }
}

fn range(mut b: Bound) -> Result<Val, Raise> {
    let start = b.take("start").map_or(Ok(Number::Int(0)), number)?;
    let stop = b.take("stop").map(number).transpose()?;
    let step = b.take("step").map_or(Ok(Number::Int(1)), number)?;
    let (start, stop) = match stop {
        Some(stop) => (start, stop),
        None => (Number::Int(0), start),
    };
    Ok(Val::Range(RangeSweep {
        start,
        stop,
        step,
        shuffle: false,
        tags: BTreeSet::new(),
    }))
}

fn interval(mut b: Bound) -> Result<Val, Raise> {
    let start = b.take("start").map_or(Ok(Number::Float(0.0)), number)?;
    let end = b.take("end").map_or(Ok(Number::Float(0.0)), number)?;
    Ok(Val::Interval(IntervalSweep {
        start: Number::Float(start.as_f64()),
        end: Number::Float(end.as_f64()),
        tags: BTreeSet::new(),
    }))
}

fn tag(mut b: Bound) -> Result<Val, Raise> {
    if b.var.is_empty() {
        return Err(value_error(
            "Not enough arguments to tag, must take at least a sweep",
        ));
    }
    let mut args = b.var;
    if let Some(sweep) = b
        .named
        .pop()
        .map(|(_, v)| v)
        .filter(|v| !matches!(v, Val::Scalar(Scalar::None)))
    {
        args.push(sweep);
    }
    let Some(mut last) = args.pop().filter(Val::is_sweep) else {
        return Err(value_error(
            "Last argument to tag() must be a choice(), range() or interval(), got NoneType",
        ));
    };
    let mut tags = BTreeSet::new();
    for t in args {
        match t {
            Val::Scalar(Scalar::Str(s)) => {
                tags.insert(s);
            }
            other => {
                return Err(value_error(format!(
                    "tag arguments type must be string, got {}",
                    other.type_name()
                )));
            }
        }
    }
    match &mut last {
        Val::Choice(c) => c.tags = tags,
        Val::Range(r) => r.tags = tags,
        Val::Interval(i) => i.tags = tags,
        _ => return Err(assertion_error()),
    }
    Ok(last)
}

fn shuffle(mut b: Bound) -> Result<Val, Raise> {
    if let Some(list) = b.take("list") {
        return Ok(shuffle_one(list));
    }
    if let Some(sweep) = b.take("sweep") {
        return Ok(shuffle_one(sweep));
    }
    if b.var.len() == 1 {
        return Ok(shuffle_one(b.var.remove(0)));
    }
    let mut c = simple_choice(b.var)?;
    c.shuffle = true;
    Ok(Val::Choice(c))
}

fn shuffle_one(v: Val) -> Val {
    match v {
        Val::Choice(mut c) => {
            c.shuffle = true;
            Val::Choice(c)
        }
        Val::Range(mut r) => {
            r.shuffle = true;
            Val::Range(r)
        }
        Val::List(mut items) => {
            items.shuffle(&mut rand::thread_rng());
            Val::List(items)
        }
        other => Val::List(vec![other]),
    }
}

fn sort(mut b: Bound) -> Result<Val, Raise> {
    let reverse = matches!(b.take("reverse"), Some(Val::Scalar(Scalar::Bool(true))));
    if let Some(list) = b.take("list") {
        return sort_one(list, reverse);
    }
    if let Some(sweep) = b.take("sweep") {
        return sort_sweep(sweep, reverse);
    }
    if b.var.len() == 1 {
        return sort_one(b.var.remove(0), reverse);
    }
    if !b
        .var
        .iter()
        .all(|v| v.is_number() || matches!(v, Val::Scalar(Scalar::Str(_))))
    {
        let reprs: Vec<String> = b.var.iter().map(py_repr).collect();
        return Err(type_error(format!(
            "Invalid arguments: ({})",
            reprs.join(", ")
        )));
    }
    if b.var.is_empty() {
        return Err(value_error("empty sort input"));
    }
    sort_sweep(Val::Choice(simple_choice(b.var)?), reverse)
}

fn sort_one(v: Val, reverse: bool) -> Result<Val, Raise> {
    match v {
        Val::Choice(_) | Val::Range(_) => sort_sweep(v, reverse),
        Val::List(items) => Ok(Val::List(py_sorted(&items, reverse).map_err(type_error)?)),
        other => Ok(other),
    }
}

/// Hydra's `_sort_sweep`: a choice sorts its items; a range flips its direction if needed.
fn sort_sweep(v: Val, reverse: bool) -> Result<Val, Raise> {
    match v {
        Val::Choice(mut c) => {
            c.items = py_sorted(&c.items, reverse).map_err(type_error)?;
            Ok(Val::Choice(c))
        }
        Val::Range(mut r) => {
            let flip = if reverse {
                r.start.lt(r.stop)
            } else {
                r.stop.lt(r.start)
            };
            if flip {
                let step = r.step.abs();
                let (start, stop) = if reverse {
                    (r.stop.sub(step), r.start.sub(step))
                } else {
                    (r.stop.add(step), r.start.add(step))
                };
                r.start = start;
                r.stop = stop;
                r.step = r.step.neg();
            }
            Ok(Val::Range(r))
        }
        _ => Err(assertion_error()),
    }
}

fn glob(mut b: Bound) -> Result<Val, Raise> {
    let patterns = |v: Option<Val>| -> Result<Vec<String>, Raise> {
        match v {
            None => Ok(Vec::new()),
            Some(Val::Scalar(Scalar::Str(s))) => Ok(vec![s]),
            // Hydra does not check the items; a non-string pattern is kept as its Python str().
            Some(Val::List(items)) => Ok(items
                .into_iter()
                .map(|item| match item {
                    Val::Scalar(Scalar::Str(s)) | Val::Quoted(s, _) => s,
                    other => py_repr(&other),
                })
                .collect()),
            Some(_) => Err(assertion_error()),
        }
    };
    let include = patterns(b.take("include"))?;
    let exclude = patterns(b.take("exclude"))?;
    Ok(Val::Glob(GlobSweep { include, exclude }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_int_and_float_parsing() {
        let ints = [
            (" 7 ", Some("7")),
            ("1_0", Some("10")),
            ("-0_1", Some("-1")),
            ("1__0", None),
            ("10.0", None),
            ("", None),
            ("+3", Some("3")),
            ("99_999_999_999_999_999_999", Some("99999999999999999999")),
            ("-9223372036854775809", Some("-9223372036854775809")),
        ];
        for (text, want) in ints {
            assert_eq!(
                py_int_from_str(text).ok().map(|b| b.to_string()).as_deref(),
                want,
                "int({text:?})"
            );
        }
        let floats = [
            (" 1.5 ", Some(1.5)),
            ("1e6", Some(1e6)),
            ("-iNf", Some(f64::NEG_INFINITY)),
            ("1_0.5", Some(10.5)),
            (".5", Some(0.5)),
            ("5.", Some(5.0)),
            ("e5", None),
            ("1e", None),
            ("true", None),
            ("1._5", None),
        ];
        for (text, want) in floats {
            assert_eq!(py_float_from_str(text).ok(), want, "float({text:?})");
        }
        assert!(py_float_from_str("nan").is_ok_and(f64::is_nan));
    }

    #[test]
    fn int_of_non_finite_float_raises_like_python() {
        assert!(matches!(
            float_to_int(f64::INFINITY),
            Err(Raise {
                exception: "OverflowError",
                ..
            })
        ));
        assert!(matches!(
            float_to_int(f64::NAN),
            Err(Raise {
                exception: "ValueError",
                ..
            })
        ));
        assert_eq!(float_to_int(-2.7).ok(), Some(BigInt::from(-2)));
        // Python: int(1e20) == 100000000000000000000, int(-1.5e19) == -15000000000000000000.
        assert_eq!(
            float_to_int(1e20).map(|b| b.to_string()).ok().as_deref(),
            Some("100000000000000000000")
        );
        assert_eq!(
            float_to_int(-1.5e19).map(|b| b.to_string()).ok().as_deref(),
            Some("-15000000000000000000")
        );
    }
}
