//! The conformance kit's `interpolation` suite, run through the YAML loader and this module.
//!
//! Each case names a config file and a mode: `cfg` (composed, unresolved: the syntax check must pass or
//! fail like OmegaConf's) or `resolve` (`--cfg job --resolve`). Expected configs and error regexes were
//! produced by real Hydra 1.3.8 / OmegaConf 2.3.1; the regexes are escaped literals, matched as substrings.

use std::path::PathBuf;

use serde_json::Value as Json;

use super::{ResolveContext, resolve_tree, validate_tree};
use crate::config::node::{Dict, Key, Node, Value};
use crate::config::yaml;

fn kit_dir() -> PathBuf {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    [
        std::env::var_os("RLSYNC_CONFORMANCE").map(PathBuf::from),
        Some(manifest.join("../shared/conformance")),
        Some(manifest.join("../../shared/conformance")),
    ]
    .into_iter()
    .flatten()
    .find(|p| p.join("cases/interpolation.jsonl").is_file())
    .unwrap_or_else(|| panic!("conformance kit not found; set RLSYNC_CONFORMANCE to its directory"))
}

/// The kit's JSON encoding (`$float`, `$dict`) back to a value; `???` is a missing value.
fn decode(j: &Json) -> Value {
    match j {
        Json::Null => Value::Null,
        Json::Bool(b) => Value::Bool(*b),
        Json::Number(n) => match n.as_i64() {
            Some(i) if !n.is_f64() => Value::Int(i),
            _ => Value::Float(n.as_f64().unwrap_or(f64::NAN)),
        },
        Json::String(s) if s == "???" => Value::Missing,
        Json::String(s) => Value::Str(s.clone()),
        Json::Array(items) => Value::List(items.iter().map(|i| Node::new(decode(i))).collect()),
        Json::Object(map) => {
            if let (1, Some(Json::String(f))) = (map.len(), map.get("$float")) {
                return Value::Float(match f.as_str() {
                    "inf" => f64::INFINITY,
                    "-inf" => f64::NEG_INFINITY,
                    _ => f64::NAN,
                });
            }
            let mut dict = Dict::new();
            if let (1, Some(Json::Array(pairs))) = (map.len(), map.get("$dict")) {
                for pair in pairs {
                    if let Some([k, v]) = pair.as_array().map(Vec::as_slice) {
                        dict.insert(decode_key(k), Node::new(decode(v)));
                    }
                }
                return Value::Dict(dict);
            }
            for (k, v) in map {
                dict.insert(Key::from(k.as_str()), Node::new(decode(v)));
            }
            Value::Dict(dict)
        }
    }
}

fn decode_key(j: &Json) -> Key {
    match decode(j) {
        Value::Int(i) => Key::Int(i),
        Value::Float(f) => Key::float(f),
        Value::Bool(b) => Key::Bool(b),
        Value::Str(s) => Key::Str(s),
        _ => Key::Null,
    }
}

/// Equality as the harness checks it: types and key order count, NaN equals NaN, origins do not.
fn same(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Float(x), Value::Float(y)) => x == y || (x.is_nan() && y.is_nan()),
        (Value::List(x), Value::List(y)) => x.len() == y.len() && x.iter().zip(y).all(|(p, q)| same(&p.value, &q.value)),
        (Value::Dict(x), Value::Dict(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|((k1, v1), (k2, v2))| k1 == k2 && same(&v1.value, &v2.value))
        }
        _ => a == b,
    }
}

/// Undo Python's `re.escape`: every regex of this suite is an escaped literal.
fn regex_literal(re: &str) -> String {
    let mut out = String::new();
    let mut chars = re.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => out.extend(chars.next()),
            c => out.push(c),
        }
    }
    out
}

/// Run one case; `Err` describes the mismatch.
fn run_case(kit: &std::path::Path, case: &Json) -> Result<(), String> {
    let name = case["config_name"].as_str().ok_or("case without config_name")?;
    let path = kit.join("data/interpolation").join(format!("{name}.yaml"));
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let env: Vec<(String, Option<String>)> = case["env"]
        .as_object()
        .map(|m| m.iter().map(|(k, v)| (k.clone(), v.as_str().map(str::to_owned))).collect())
        .unwrap_or_default();
    // Hermetic: only the variables the case sets exist.
    let ctx = ResolveContext::new().with_env(move |key| env.iter().find(|(k, _)| k == key).and_then(|(_, v)| v.clone()));
    let outcome = yaml::load_str(&text, name).map_err(|e| e.to_string()).and_then(|node| {
        validate_tree(&node).map_err(|e| e.to_string())?;
        match case["mode"].as_str() {
            Some("resolve") => resolve_tree(&node, &ctx).map_err(|e| e.to_string()),
            _ => Ok(node),
        }
    });
    let expect = &case["expect"];
    match (expect.get("config"), expect.get("error").and_then(Json::as_str), outcome) {
        (Some(want), _, Ok(got)) if same(&decode(want), &got.value) => Ok(()),
        (Some(want), _, Ok(got)) => Err(format!("want {want}, got {got:?}")),
        (Some(_), _, Err(e)) => Err(format!("unexpected error: {e}")),
        (None, Some(re), Err(e)) if e.contains(&regex_literal(re)) => Ok(()),
        (None, Some(re), Err(e)) => Err(format!("error {e:?} does not match /{re}/")),
        (None, _, Ok(got)) => Err(format!("expected an error, got {got:?}")),
        (None, None, Err(e)) => Err(format!("case without expectation; got error {e}")),
    }
}

#[test]
fn conformance_interpolation_suite() {
    let kit = kit_dir();
    let cases = std::fs::read_to_string(kit.join("cases/interpolation.jsonl")).unwrap_or_default();
    let mut failures = Vec::new();
    let mut count = 0;
    for line in cases.lines().filter(|l| !l.trim().is_empty()) {
        let case: Json = serde_json::from_str(line).unwrap_or_else(|e| panic!("bad case line: {e}"));
        count += 1;
        if let Err(why) = run_case(&kit, &case) {
            failures.push(format!("{}: {why}", case["id"]));
        }
    }
    assert!(count > 500, "only {count} cases read");
    assert!(failures.is_empty(), "{} of {count} cases failed:\n{}", failures.len(), failures.join("\n"));
}
