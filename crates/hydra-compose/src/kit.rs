//! Test-only reader of the Hydra conformance kit: where it lives, its case files, and its JSON value encoding.
//!
//! The kit (`/work/shared/conformance`, README there) encodes what JSON cannot express as one-key objects:
//! `{"$float": "inf"}`, `{"$dict": [[key, value], …]}` (non-string keys), `{"$bytes": "base64"}`; `???` is
//! a missing value. Expected errors are Python regexes that are `re.escape`d literals.

use std::path::{Path, PathBuf};

use base64::Engine;
use serde_json::Value as Json;

use crate::node::{Dict, Key, Node, Value};
use crate::scalar::Scalar;

/// The kit's directory: `$RLSYNC_CONFORMANCE`, `$RLSYNC_SHARED/conformance`, or `shared/conformance` in the
/// nearest directory above this crate that has one (beside the main checkout or a worktree).
pub fn dir() -> PathBuf {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let env = [
        std::env::var_os("RLSYNC_CONFORMANCE").map(PathBuf::from),
        std::env::var_os("RLSYNC_SHARED").map(|s| PathBuf::from(s).join("conformance")),
    ];
    env.into_iter()
        .flatten()
        .chain(manifest.ancestors().map(|d| d.join("shared/conformance")))
        .find(|p| p.join("cases").is_dir())
        .unwrap_or_else(|| {
            panic!("conformance kit not found; set RLSYNC_CONFORMANCE to its directory")
        })
}

/// Every `cases/*.jsonl` file of the kit, sorted.
pub(crate) fn case_files() -> Vec<PathBuf> {
    let cases = dir().join("cases");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&cases)
        .unwrap_or_else(|e| panic!("{}: {e}", cases.display()))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "jsonl"))
        .collect();
    files.sort();
    files
}

/// The cases of one suite (`cases/{suite}.jsonl`).
pub(crate) fn suite(suite: &str) -> Vec<Json> {
    read_cases(&dir().join("cases").join(format!("{suite}.jsonl")))
}

/// The cases of one `.jsonl` file, big ints kept exact (see [`wrap_big_ints`]).
pub(crate) fn read_cases(path: &Path) -> Vec<Json> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(n, line)| {
            serde_json::from_str(&wrap_big_ints(line))
                .unwrap_or_else(|e| panic!("{}:{}: bad case line: {e}", path.display(), n + 1))
        })
        .collect()
}

/// serde_json (without `arbitrary_precision`) rounds integers beyond 64 bits to floats, so the
/// kit's big ints are rewritten as `{"$bigint": "digits"}` objects before parsing.
pub(crate) fn wrap_big_ints(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let (mut in_string, mut escaped) = (false, false);
    let mut chars = line.char_indices().peekable();
    while let Some((at, c)) = chars.next() {
        if in_string {
            out.push(c);
            (in_string, escaped) = (escaped || c != '"', !escaped && c == '\\');
            continue;
        }
        if c == '"' {
            in_string = true;
            out.push(c);
            continue;
        }
        if !(c == '-' || c.is_ascii_digit()) {
            out.push(c);
            continue;
        }
        let mut end = at + c.len_utf8();
        while let Some(&(i, d)) = chars.peek() {
            if !(d.is_ascii_digit() || matches!(d, '.' | 'e' | 'E' | '+' | '-')) {
                break;
            }
            end = i + d.len_utf8();
            chars.next();
        }
        let token = &line[at..end];
        let is_int = token
            .trim_start_matches('-')
            .bytes()
            .all(|b| b.is_ascii_digit());
        if is_int && token.parse::<i64>().is_err() {
            out.push_str(&format!("{{\"$bigint\": \"{token}\"}}"));
        } else {
            out.push_str(token);
        }
    }
    out
}

/// The kit's JSON encoding back to a value.
pub fn decode(j: &Json) -> Value {
    match j {
        Json::Null => Value::NULL,
        Json::Bool(b) => Value::bool(*b),
        Json::Number(n) => match n.as_i64() {
            Some(i) => Value::int(i),
            None => Value::float(n.as_f64().unwrap_or(f64::NAN)),
        },
        Json::String(s) if s == "???" => Value::Missing,
        Json::String(s) => Value::str(s.clone()),
        Json::Array(items) => Value::List(items.iter().map(|i| Node::new(decode(i))).collect()),
        Json::Object(map) => {
            let tagged = |tag: &str| map.get(tag).filter(|_| map.len() == 1);
            if let Some(Json::String(f)) = tagged("$float") {
                return Value::float(match f.as_str() {
                    "inf" => f64::INFINITY,
                    "-inf" => f64::NEG_INFINITY,
                    _ => f64::NAN,
                });
            }
            if let Some(Json::String(digits)) = tagged("$bigint") {
                return Value::Scalar(Scalar::int(digits.parse().unwrap_or_else(|_| {
                    panic!("the kit encodes a big int that is not one: {digits}")
                })));
            }
            if let Some(Json::String(b)) = tagged("$bytes") {
                return Value::Scalar(Scalar::Bytes(
                    base64::engine::general_purpose::STANDARD
                        .decode(b)
                        .unwrap_or_default(),
                ));
            }
            if let Some(Json::Array(pairs)) = tagged("$dict") {
                let mut dict = Dict::new();
                for pair in pairs {
                    if let Some([k, v]) = pair.as_array().map(Vec::as_slice) {
                        dict.insert(decode_key(k), Node::new(decode(v)));
                    }
                }
                return Value::Dict(dict);
            }
            Value::Dict(
                map.iter()
                    .map(|(k, v)| (Key::from(k.as_str()), Node::new(decode(v))))
                    .collect(),
            )
        }
    }
}

fn decode_key(j: &Json) -> Key {
    match decode(j) {
        Value::Missing => Key::from("???"),
        Value::Scalar(s) => Key(s),
        other => panic!("the kit encodes a key OmegaConf cannot have: {other:?}"),
    }
}

/// Equality as the kit's harness checks it: types, key order and the sign of zero count, NaN equals
/// NaN, origins do not.
pub fn same(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Scalar(Scalar::Float(x)), Value::Scalar(Scalar::Float(y))) => {
            x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan())
        }
        (Value::List(x), Value::List(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(p, q)| same(&p.value, &q.value))
        }
        (Value::Dict(x), Value::Dict(y)) => {
            x.len() == y.len()
                && x.iter()
                    .zip(y)
                    .all(|((k1, v1), (k2, v2))| k1 == k2 && same(&v1.value, &v2.value))
        }
        _ => a == b,
    }
}

/// Undo Python's `re.escape` on a regex that is a plain literal; `None` if it has real metacharacters.
pub(crate) fn regex_literal(re: &str) -> Option<String> {
    let mut out = String::new();
    let mut chars = re.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => {
                let next = chars.next()?;
                if next.is_ascii_alphanumeric() {
                    return None;
                }
                out.push(next);
            }
            '.' | '*' | '+' | '?' | '(' | ')' | '[' | ']' | '{' | '}' | '|' | '^' | '$' => {
                return None;
            }
            c => out.push(c),
        }
    }
    Some(out)
}

#[test]
fn wrap_big_ints_only_touches_big_ints() {
    assert_eq!(
        wrap_big_ints(
            r#"{"a": 9223372036854775808, "b": "99999999999999999999", "c": [1, -1.5e300, -9223372036854775809]}"#
        ),
        r#"{"a": {"$bigint": "9223372036854775808"}, "b": "99999999999999999999", "c": [1, -1.5e300, {"$bigint": "-9223372036854775809"}]}"#
    );
}

#[test]
fn decodes_the_kit_encoding() {
    let j = |s: &str| serde_json::from_str::<Json>(&wrap_big_ints(s)).unwrap_or(Json::Null);
    let check = |text: &str, want: Value| {
        let got = decode(&j(text));
        assert!(same(&got, &want), "{text}: got {got:?}, want {want:?}");
    };
    check("1", Value::int(1));
    check("1.0", Value::float(1.0));
    check(r#"{"$float": "-inf"}"#, Value::float(f64::NEG_INFINITY));
    check(r#"{"$float": "nan"}"#, Value::float(f64::NAN));
    check(
        "99999999999999999999",
        Value::Scalar(crate::scalar::big("99999999999999999999")),
    );
    check(
        r#"{"$bytes": "aGk="}"#,
        Value::Scalar(Scalar::Bytes(b"hi".to_vec())),
    );
    check(r#""???""#, Value::Missing);
    let mut dict = Dict::new();
    dict.insert(Key::int(1), Node::new(Value::NULL));
    dict.insert(Key(Scalar::None), Node::new(Value::bool(true)));
    check(r#"{"$dict": [[1, null], [null, true]]}"#, Value::Dict(dict));
    assert!(!same(&Value::float(0.0), &Value::float(-0.0)));
    assert!(!same(&Value::int(1), &Value::float(1.0)));
}

#[test]
fn regex_literals_are_unescaped_or_refused() {
    assert_eq!(regex_literal(r"a\.b\ c"), Some("a.b c".into()));
    assert_eq!(regex_literal(r"a.b"), None);
    assert_eq!(regex_literal(r"\d"), None);
    assert_eq!(regex_literal("a\\"), None);
}
