//! The conformance kit's `interpolation` suite, run through the YAML loader and this module.
//!
//! Each case names a config file and a mode: `cfg` (composed, unresolved: the syntax check must pass or
//! fail like OmegaConf's) or `resolve` (`--cfg job --resolve`). Expected configs and error regexes were
//! produced by real Hydra 1.3.8 / OmegaConf 2.3.1; the regexes are escaped literals, matched as substrings.

use serde_json::Value as Json;

use super::{ResolveContext, resolve_tree, validate_tree};
use crate::kit::{self, decode, regex_literal, same};
use crate::yaml;

/// Run one case; `Err` describes the mismatch.
fn run_case(kit: &std::path::Path, case: &Json) -> Result<(), String> {
    let name = case["config_name"]
        .as_str()
        .ok_or("case without config_name")?;
    let path = kit.join("data/interpolation").join(format!("{name}.yaml"));
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let env: Vec<(String, Option<String>)> = case["env"]
        .as_object()
        .map(|m| {
            m.iter()
                .map(|(k, v)| (k.clone(), v.as_str().map(str::to_owned)))
                .collect()
        })
        .unwrap_or_default();
    // Hermetic: only the variables the case sets exist.
    let ctx = ResolveContext::new().with_env(move |key| {
        env.iter()
            .find(|(k, _)| k == key)
            .and_then(|(_, v)| v.clone())
    });
    let outcome = yaml::load_str(&text, name)
        .map_err(|e| e.to_string())
        .and_then(|node| {
            validate_tree(&node).map_err(|e| e.to_string())?;
            match case["mode"].as_str() {
                Some("resolve") => resolve_tree(&node, &ctx).map_err(|e| e.to_string()),
                _ => Ok(node),
            }
        });
    let expect = &case["expect"];
    match (
        expect.get("config"),
        expect.get("error").and_then(Json::as_str),
        outcome,
    ) {
        (Some(want), _, Ok(got)) if same(&decode(want), &got.value) => Ok(()),
        (Some(want), _, Ok(got)) => Err(format!("want {want}, got {got:?}")),
        (Some(_), _, Err(e)) => Err(format!("unexpected error: {e}")),
        (None, Some(re), Err(e)) if regex_literal(re).is_some_and(|lit| e.contains(&lit)) => Ok(()),
        (None, Some(re), Err(e)) => Err(format!("error {e:?} does not match /{re}/")),
        (None, _, Ok(got)) => Err(format!("expected an error, got {got:?}")),
        (None, None, Err(e)) => Err(format!("case without expectation; got error {e}")),
    }
}

#[test]
fn conformance_interpolation_suite() {
    let dir = kit::dir();
    let cases = kit::suite("interpolation");
    let failures: Vec<String> = cases
        .iter()
        .filter_map(|case| {
            run_case(&dir, case)
                .err()
                .map(|why| format!("{}: {why}", case["id"]))
        })
        .collect();
    assert!(cases.len() > 500, "only {} cases read", cases.len());
    assert!(
        failures.is_empty(),
        "{} of {} cases failed:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}
