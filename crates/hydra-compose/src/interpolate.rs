//! OmegaConf ${...} interpolation: grammar, resolution and resolvers.
//!
//! Semantics are OmegaConf 2.3.1's (checked against the real library through the conformance oracle):
//! - [`resolve_tree`] is `OmegaConf.resolve` on a copy, which is what Hydra's `--cfg job --resolve`
//!   prints: nodes are rewritten in document order, an interpolation that reaches a `???` value becomes
//!   `???`, and a referenced container is copied in already resolved.
//! - [`resolve_at`] and [`resolve_str`] are lookups (`cfg.a.b`, `OmegaConf.to_container(resolve=True)` of
//!   what is found): reaching `???` is an error there.
//! - Error messages reproduce OmegaConf's first line exactly (`Interpolation key 'x' not found`, ...);
//!   they are not lowercase because users and the conformance kit match them against real Hydra.
//!
//! Layout: `grammar` (lexer + parser), `tree` (parent-linked working copy), `py` (Python values and
//! operators), `eval` (OmegaConf's resolution algorithm), `resolvers` (the built-in resolvers),
//! `conformance_tests` (the conformance kit's interpolation suite).

#[cfg(test)]
mod conformance_tests;
mod diagnose;
mod eval;
mod grammar;
mod py;
mod resolvers;
mod tree;

use std::fmt;

use crate::node::{Node, Origin, Value};
use eval::Engine;
pub use grammar::GrammarError;
pub use py::PyErr;
use tree::Id;

/// Looks up an environment variable (`None` when unset).
type EnvLookup<'a> = Box<dyn Fn(&str) -> Option<String> + 'a>;

/// What resolution may consult besides the config: Hydra's own node, the environment, and the clock.
pub struct ResolveContext<'a> {
    /// The `hydra` node of the composed config, for `${hydra:runtime.cwd}` and friends.
    hydra: Option<&'a Node>,
    /// Where the `hydra` node hangs: `None`, a hidden child of the config being resolved (Hydra's
    /// `--cfg job`, which deletes `hydra` from the config it resolves); `Some(full)`, a child of the full
    /// config given to [`ResolveContext::with_full_config`] (a running job).
    hydra_in_full: Option<&'a Node>,
    /// Environment lookup for `oc.env` (injectable so tests do not touch the process environment).
    env: EnvLookup<'a>,
    /// Local wall-clock time for `${now:...}`; fixed per context, as Hydra caches `now` per pattern.
    now: chrono::NaiveDateTime,
    /// The program resolving, as an error names it where only Python code could help.
    program: &'static str,
}

/// How messages name the program when it did not give its name ([`ResolveContext::with_program`]).
pub const UNNAMED_PROGRAM: &str = "this program";

impl Default for ResolveContext<'_> {
    fn default() -> Self {
        ResolveContext::new()
    }
}

impl<'a> ResolveContext<'a> {
    /// No hydra node, the process environment, and the current local time.
    pub fn new() -> ResolveContext<'a> {
        ResolveContext {
            hydra: None,
            hydra_in_full: None,
            env: Box::new(|key| std::env::var_os(key).map(|v| v.to_string_lossy().into_owned())),
            now: chrono::Local::now().naive_local(),
            program: UNNAMED_PROGRAM,
        }
    }

    /// The program's name for its errors (see `search_path::EmbeddedTree::program`).
    pub fn with_program(mut self, program: &'static str) -> ResolveContext<'a> {
        self.program = program;
        self
    }

    pub fn with_hydra(mut self, hydra: &'a Node) -> ResolveContext<'a> {
        self.hydra = Some(hydra);
        self
    }

    /// `${hydra:...}` reads the `hydra` node of `full`, and absolute keys inside it resolve in `full`
    /// (Hydra's `HydraConfig` during a run).
    pub fn with_full_config(mut self, full: &'a Node) -> ResolveContext<'a> {
        self.hydra = full.get("hydra");
        self.hydra_in_full = self.hydra.map(|_| full);
        self
    }

    pub fn with_env(mut self, env: impl Fn(&str) -> Option<String> + 'a) -> ResolveContext<'a> {
        self.env = Box::new(env);
        self
    }

    pub fn with_now(mut self, now: chrono::NaiveDateTime) -> ResolveContext<'a> {
        self.now = now;
        self
    }
}

/// Why an interpolation failed; the texts are OmegaConf's.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ErrorKind {
    /// The value is not valid interpolation syntax (OmegaConf reports ANTLR's wording).
    #[error("{detail}")]
    Grammar { detail: String },
    #[error("Interpolation key '{key}' not found")]
    KeyNotFound { key: String },
    #[error("ConfigKeyError while resolving interpolation: Error resolving key '{key}'")]
    BadRelativeKey { key: String },
    #[error(
        "Error trying to access {key}: node `{parent_key}` is not a container and thus cannot contain `{child_key}`"
    )]
    NotAContainer {
        key: String,
        parent_key: String,
        child_key: String,
    },
    #[error("Recursive interpolation detected")]
    Recursive,
    #[error("Interpolation to parent node detected")]
    ToParent,
    #[error("MissingMandatoryValue while resolving interpolation: Missing mandatory value: {key}")]
    ToMissing { key: String },
    /// A `???` value was read directly.
    #[error("Missing mandatory value: {key}")]
    Missing { key: String },
    #[error("Unsupported interpolation type {name}")]
    UnsupportedResolver { name: String },
    #[error(
        "The following interpolation is used to denote a config key and thus should return a string, \
         but instead returned `{value}` of type `{class}`: {text}"
    )]
    KeyNotString {
        value: String,
        class: String,
        text: String,
    },
    #[error(
        "The name of a resolver must be a string, but the interpolation {text} resolved to `{value}` which is of type {class}"
    )]
    ResolverNameNotString {
        text: String,
        value: String,
        class: String,
    },
    /// A Python exception raised by a resolver or a lookup, before OmegaConf wraps it.
    #[error("{}", .0.message)]
    Python(PyErr),
    /// `<Class> raised while resolving interpolation: <msg>`.
    #[error("{class} raised while resolving interpolation: {message}")]
    Raised { class: String, message: String },
    /// `OmegaConf.resolve` cannot store a plain list/dict produced by a resolver in a value node.
    #[error("Value '{type_name}' is not a supported primitive type")]
    UnsupportedValueType { type_name: &'static str },
    /// Not an OmegaConf error: OmegaConf would keep going (for hours) on exponentially self-referencing configs.
    #[error(
        "resolving interpolations took more than {limit} steps; the config references itself exponentially"
    )]
    TooMuchWork { limit: usize },
    #[error("Cannot resolve interpolation for a node without a parent")]
    NoParent,
    /// [`resolve_at`] was given a path that names nothing.
    #[error("Key '{path}' not found")]
    PathNotFound { path: String },
}

impl ErrorKind {
    /// OmegaConf's `resolve_parse_tree` wraps every exception that is not an `InterpolationResolutionError`.
    fn wrap(self) -> ErrorKind {
        let (class, message) = match self {
            ErrorKind::Grammar { detail } => ("GrammarParseError", detail),
            e @ ErrorKind::NotAContainer { .. } => ("ConfigTypeError", e.to_string()),
            e @ ErrorKind::Missing { .. } => ("MissingMandatoryValue", e.to_string()),
            e @ ErrorKind::UnsupportedValueType { .. } => ("UnsupportedValueType", e.to_string()),
            e @ ErrorKind::PathNotFound { .. } => ("ConfigKeyError", e.to_string()),
            ErrorKind::Python(PyErr { class, message }) => (class, message),
            resolution_error => return resolution_error,
        };
        ErrorKind::Raised {
            class: class.to_owned(),
            message,
        }
    }
}

/// An interpolation error and the config node it happened at (boxed: errors are rare, results are not).
#[derive(Debug, Clone, PartialEq)]
pub struct InterpolationError(Box<Located>);

#[derive(Debug, Clone, PartialEq)]
struct Located {
    kind: ErrorKind,
    full_key: String,
    origin: Option<Origin>,
    /// The program resolving, named where only Python code could help.
    program: &'static str,
}

impl InterpolationError {
    pub fn new(kind: ErrorKind, full_key: String, origin: Option<Origin>) -> InterpolationError {
        InterpolationError(Box::new(Located {
            kind,
            full_key,
            origin,
            program: UNNAMED_PROGRAM,
        }))
    }

    /// The error as `program` reports it (see [`ResolveContext::with_program`]).
    pub fn with_program(mut self, program: &'static str) -> InterpolationError {
        self.0.program = program;
        self
    }

    pub fn kind(&self) -> &ErrorKind {
        &self.0.kind
    }

    /// OmegaConf's dotted key of the node being resolved (`a.b`, `list[0]`); empty for the root or a
    /// standalone template.
    pub fn full_key(&self) -> &str {
        &self.0.full_key
    }

    /// Where the failing value was written, when known.
    pub fn origin(&self) -> Option<&Origin> {
        self.0.origin.as_ref()
    }
}

impl fmt::Display for InterpolationError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0.kind)?;
        if !self.0.full_key.is_empty() {
            write!(f, "\n    full_key: {}", self.0.full_key)?;
        }
        if let Some(origin) = &self.0.origin {
            write!(f, "\n    at {origin}")?;
        }
        // OmegaConf's own text comes first (it is what Hydra prints); the last line says why the program cannot
        // do better: a resolver that OmegaConf does not know can only be registered by the app's Python code.
        if let ErrorKind::UnsupportedResolver { name } = &self.0.kind
            && !name.starts_with("oc.")
        {
            write!(
                f,
                "\n    needs Python: a resolver named '{name}' is registered by Python code \
                 (OmegaConf.register_new_resolver), which {} does not run",
                self.0.program
            )?;
        }
        Ok(())
    }
}

impl std::error::Error for InterpolationError {}

fn locate(engine: &Engine<'_, '_>, kind: ErrorKind, id: Id) -> InterpolationError {
    InterpolationError::new(
        kind,
        engine.tree.full_key(id),
        engine.tree.slot(id).origin.clone(),
    )
    .with_program(engine.ctx.program)
}

/// A fully resolved copy of `root`: `OmegaConf.resolve` semantics, so values that are (or reach) `???`
/// stay `???`. Strings that still contain `${` afterwards came from escapes (`\${x}`) and are plain text.
pub fn resolve_tree(root: &Node, ctx: &ResolveContext) -> Result<Node, InterpolationError> {
    let (mut engine, id) = Engine::new(root, ctx);
    engine
        .resolve_in_place(id)
        .map_err(|(kind, at)| locate(&engine, kind, at))?;
    Ok(engine.tree.to_node(id))
}

/// Resolve the node at `path` (`a.b`, `a.list.0`, `a.list[0]`) as OmegaConf's access would; a container
/// comes back with its content resolved (`to_container(resolve=True)`, `???` kept where unreferenced).
pub fn resolve_at(
    root: &Node,
    path: &str,
    ctx: &ResolveContext,
) -> Result<Node, InterpolationError> {
    let (mut engine, id) = Engine::new(root, ctx);
    let at_path = |kind| {
        InterpolationError::new(
            kind,
            path.to_owned(),
            root.get_path(path).and_then(|n| n.origin.clone()),
        )
        .with_program(ctx.program)
    };
    let found = engine
        .select_impl(id, path, true, &mut eval::Memo::off())
        .map_err(at_path)?;
    let Some((raw, res)) = found else {
        return Err(at_path(ErrorKind::PathNotFound {
            path: path.to_owned(),
        }));
    };
    let origin = engine.tree.slot(raw).origin.clone();
    engine
        .res_to_node(res, origin)
        .map_err(|kind| locate(&engine, kind, raw))
}

/// Resolve a standalone string as if it were a value stored at the root of `root` (relative keys start
/// there). A string without `${` is returned as is.
pub fn resolve_str(
    template: &str,
    root: &Node,
    ctx: &ResolveContext,
) -> Result<Node, InterpolationError> {
    if !is_interpolation(template) {
        return Ok(Node::new(Value::str(template.to_owned())));
    }
    let (mut engine, id) = Engine::new(root, ctx);
    let leaf = engine.tree.add(
        Some(id),
        None,
        tree::Body::Leaf(Value::str(template.to_owned())),
        None,
    );
    let res = engine
        .dereference(leaf)
        .map_err(|kind| locate(&engine, kind, leaf))?;
    engine
        .res_to_node(res, None)
        .map_err(|kind| locate(&engine, kind, leaf))
}

/// OmegaConf's cheap test: a string is an interpolation when it contains `${` (escaped ones included,
/// since they still need unescaping).
pub fn is_interpolation(s: &str) -> bool {
    s.contains("${")
}

/// Check one value the way OmegaConf does when it stores it: a string with `${` must parse, unless it
/// matches OmegaConf's fast pattern for common interpolations (which lets a few invalid ones, like
/// `${:x}`, through until they are resolved).
pub fn check_syntax(s: &str) -> Result<(), GrammarError> {
    grammar::validate_value(s)
}

/// Check every interpolation in `root`, as OmegaConf does when a config is created: the first invalid
/// one is reported with its key (`full_key: a.b`), even when the config is never resolved.
pub fn validate_tree(root: &Node) -> Result<(), InterpolationError> {
    let mut t = tree::Tree::default();
    let id = t.insert_node(root, None, None);
    validate_slot(&t, id)
}

fn validate_slot(t: &tree::Tree, id: Id) -> Result<(), InterpolationError> {
    match t.body(id) {
        tree::Body::Dict(d) => d.values().try_for_each(|&c| validate_slot(t, c)),
        tree::Body::List(l) => l.iter().try_for_each(|&c| validate_slot(t, c)),
        tree::Body::Leaf(_) => match t.interpolation(id) {
            Some(s) => check_syntax(s).map_err(|e| {
                InterpolationError::new(
                    ErrorKind::Grammar { detail: e.detail },
                    t.full_key(id),
                    t.slot(id).origin.clone(),
                )
            }),
            None => Ok(()),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kit;
    use crate::node::{Dict, Key};

    fn parse(text: &str) -> Node {
        // The conformance kit's encoding: plain JSON, and the string `???` is a missing value, as in YAML.
        Node::new(kit::decode(
            &serde_json::from_str(text).unwrap_or_else(|e| panic!("bad test JSON {text}: {e}")),
        ))
    }

    fn test_ctx() -> ResolveContext<'static> {
        ResolveContext::new()
            .with_env(|k| (k == "RLSYNC_T_SET").then(|| "from_env".to_owned()))
            .with_now(
                chrono::NaiveDate::from_ymd_opt(2024, 5, 6)
                    .and_then(|d| d.and_hms_opt(7, 8, 9))
                    .unwrap_or_default(),
            )
    }

    fn first_line(e: &InterpolationError) -> String {
        e.to_string().lines().next().unwrap_or_default().to_owned()
    }

    /// Expectations come from OmegaConf 2.3.1 itself (`OmegaConf.resolve`, then `to_container`); an error
    /// is the first line of its message.
    #[test]
    fn resolve_tree_matches_omegaconf() {
        let cases: &[(&str, &str, Result<&str, &str>)] = &[
            (
                "node_keeps_type",
                r#"{"a": 1, "b": "${a}", "c": "${d}", "d": {"e": [1.5, null, true]}}"#,
                Ok(
                    r#"{"a": 1, "b": 1, "c": {"e": [1.5, null, true]}, "d": {"e": [1.5, null, true]}}"#,
                ),
            ),
            (
                "string_interpolation_is_str",
                r#"{"a": 1, "b": "x_${a}_${c}", "c": null}"#,
                Ok(r#"{"a": 1, "b": "x_1_None", "c": null}"#),
            ),
            (
                "relative_keys",
                r#"{"x": 0, "a": {"b": 1, "c": "${.b}", "d": "${..x}", "e": {"f": "${..b}"}}}"#,
                Ok(r#"{"x": 0, "a": {"b": 1, "c": 1, "d": 0, "e": {"f": 1}}}"#),
            ),
            (
                "list_index_forms",
                r#"{"l": [10, {"k": "v"}], "a": "${l.0}", "b": "${l[1].k}", "c": "${l[0]}"}"#,
                Ok(r#"{"l": [10, {"k": "v"}], "a": 10, "b": "v", "c": 10}"#),
            ),
            (
                "nested_key_interpolation",
                r#"{"opt": {"a": "A", "b": "B"}, "choice": "b", "x": "${opt.${choice}}", "y": "${opt[${choice}]}"}"#,
                Ok(r#"{"opt": {"a": "A", "b": "B"}, "choice": "b", "x": "B", "y": "B"}"#),
            ),
            (
                "escapes",
                r#"{"a": 1, "b": "\\${a}", "c": "\\\\${a}", "d": "x\\y${a}", "e": "${a}\\\\"}"#,
                Ok(r#"{"a": 1, "b": "${a}", "c": "\\1", "d": "x\\y1", "e": "1\\\\"}"#),
            ),
            (
                "escaped_then_referenced",
                r#"{"a": 1, "x": "\\${a}", "y": "${x}"}"#,
                Ok(r#"{"a": 1, "x": "${a}", "y": 1}"#),
            ),
            (
                "missing_stays_missing",
                r#"{"m": "???", "a": "${m}", "b": "s_${m}", "c": "${oc.select:m,dflt}"}"#,
                Ok(r#"{"m": "???", "a": "???", "b": "???", "c": "dflt"}"#),
            ),
            (
                "referenced_dict_is_resolved_copy",
                r#"{"d": {"p": 1, "q": "${.p}"}, "e": "${d}", "s": "${d} and ${l}", "l": [1, "${d.p}", "???"]}"#,
                Ok(
                    r#"{"d": {"p": 1, "q": 1}, "e": {"p": 1, "q": 1}, "s": "{'p': 1, 'q': 1} and [1, '${d.p}', '???']", "l": [1, 1, "???"]}"#,
                ),
            ),
            (
                "oc_env",
                r#"{"a": "${oc.env:RLSYNC_T_SET}", "b": "${oc.env:RLSYNC_T_UNSET,5}", "c": "${oc.env:RLSYNC_T_UNSET,null}", "d": "${oc.env:RLSYNC_T_UNSET,}", "e": "${oc.env:RLSYNC_T_UNSET,[1, 2]}"}"#,
                Ok(r#"{"a": "from_env", "b": "5", "c": null, "d": "", "e": "[1, 2]"}"#),
            ),
            (
                "oc_env_unset_fails",
                r#"{"a": "${oc.env:RLSYNC_T_UNSET}"}"#,
                Err(
                    r#"KeyError raised while resolving interpolation: "Environment variable 'RLSYNC_T_UNSET' not found""#,
                ),
            ),
            (
                "oc_select",
                r#"{"a": {"b": 2}, "s": "x", "x1": "${oc.select:a.b}", "x2": "${oc.select:nope,7}", "x3": "${oc.select:s.t,deflt}", "x4": "${oc.select:a}", "x5": "${oc.select:nope}"}"#,
                Ok(
                    r#"{"a": {"b": 2}, "s": "x", "x1": 2, "x2": 7, "x3": "deflt", "x4": {"b": 2}, "x5": null}"#,
                ),
            ),
            (
                "oc_decode",
                r#"{"s": "[1, 0.5, hi, null, {k: 'v'}]", "n": "-1_000", "x": "${oc.decode:${n}}", "y": "${oc.decode:'  3.5e1 '}", "z": "${oc.decode:null}", "w": "x ${oc.decode:${s}}"}"#,
                Ok(
                    r#"{"s": "[1, 0.5, hi, null, {k: 'v'}]", "n": "-1_000", "x": -1000, "y": "  3.5e1 ", "z": null, "w": "x [1, 0.5, 'hi', None, {'k': 'v'}]"}"#,
                ),
            ),
            (
                "oc_decode_list_cannot_be_stored",
                r#"{"x": "${oc.decode:'[1, 2]'}"}"#,
                Err(r#"Value 'list' is not a supported primitive type"#),
            ),
            (
                "oc_decode_rejects_numbers",
                r#"{"x": "${oc.decode:5}"}"#,
                Err(
                    r#"TypeError raised while resolving interpolation: `oc.decode` can only take strings or None as input, but `5` is of type int"#,
                ),
            ),
            (
                "oc_create",
                r#"{"y": 3, "a": "${oc.create:{k: 1, l: [a, '${y}']}}", "b": "${oc.create:${a}}", "c": "${oc.create:[1, {z: '${.y}', y: 2}]}"}"#,
                Ok(
                    r#"{"y": 3, "a": {"k": 1, "l": ["a", "3"]}, "b": {"k": 1, "l": ["a", "3"]}, "c": [1, {"z": "3", "y": 2}]}"#,
                ),
            ),
            (
                "oc_create_rejects_scalars",
                r#"{"x": "${oc.create:0}"}"#,
                Err(
                    r#"ValidationError raised while resolving interpolation: Object of unsupported type: 'int'"#,
                ),
            ),
            (
                "oc_dict",
                r#"{"d": {"a": 1, "b": "${x}"}, "x": 7, "k": "${oc.dict.keys:d}", "v": "${oc.dict.values:d}", "r": {"v": "${oc.dict.values:..d}"}}"#,
                Ok(
                    r#"{"d": {"a": 1, "b": 7}, "x": 7, "k": ["a", "b"], "v": [1, 7], "r": {"v": [1, 7]}}"#,
                ),
            ),
            (
                "oc_dict_needs_a_dict",
                r#"{"x": "${oc.dict.keys:i}", "i": 0}"#,
                Err(
                    r#"TypeError raised while resolving interpolation: `oc.dict.keys` cannot be applied to objects of type: int"#,
                ),
            ),
            (
                "oc_dict_key_not_found",
                r#"{"x": "${oc.dict.values:nosuch}"}"#,
                Err(
                    r#"ConfigKeyError raised while resolving interpolation: Key not found: 'nosuch'"#,
                ),
            ),
            (
                "oc_deprecated",
                r#"{"new": {"k": 1}, "old": "${oc.deprecated:new.k}"}"#,
                Ok(r#"{"new": {"k": 1}, "old": 1}"#),
            ),
            (
                "oc_deprecated_missing_target",
                r#"{"old": "${oc.deprecated:nosuch}"}"#,
                Err(
                    r#"ConfigKeyError raised while resolving interpolation: In oc.deprecated resolver at 'old': Key not found: 'nosuch'"#,
                ),
            ),
            (
                "rlinf_resolvers",
                r#"{"a": 6, "b": 4, "m": "${multiply:${a},${b}}", "mf": "${multiply:2.5,${a}}", "ms": "${multiply:ab,3}", "d": "${int_div:${a},${b}}", "df": "${int_div:-7.5,2}", "s": "${subtract:${a},0.5}", "n": "${not:${a}}", "n2": "${not:''}", "n3": "${not:[]}"}"#,
                Ok(
                    r#"{"a": 6, "b": 4, "m": 24, "mf": 15.0, "ms": "ababab", "d": 1, "df": -4.0, "s": 5.5, "n": false, "n2": true, "n3": true}"#,
                ),
            ),
            (
                "int_div_by_zero",
                r#"{"x": "${int_div:1,0}"}"#,
                Err(
                    r#"ZeroDivisionError raised while resolving interpolation: integer division or modulo by zero"#,
                ),
            ),
            (
                "multiply_wrong_arity",
                r#"{"x": "${multiply:1}"}"#,
                Err(
                    r#"TypeError raised while resolving interpolation: <lambda>() missing 1 required positional argument: 'y'"#,
                ),
            ),
            (
                "unknown_resolver",
                r#"{"x": "${nosuch:1}"}"#,
                Err(r#"Unsupported interpolation type nosuch"#),
            ),
            (
                "key_not_found",
                r#"{"a": {"b": 1}, "x": "${a.c}"}"#,
                Err(r#"Interpolation key 'a.c' not found"#),
            ),
            (
                "relative_past_root",
                r#"{"a": "${..y}"}"#,
                Err(r#"ConfigKeyError while resolving interpolation: Error resolving key '..y'"#),
            ),
            (
                "not_a_container",
                r#"{"a": 1, "c": "${a.b}"}"#,
                Err(
                    r#"ConfigTypeError raised while resolving interpolation: Error trying to access a.b: node `a` is not a container and thus cannot contain `b`"#,
                ),
            ),
            (
                "list_index_not_int",
                r#"{"l": [1], "c": "${l.x}"}"#,
                Err(
                    r#"TypeError raised while resolving interpolation: Index 'x' (str) is not an int"#,
                ),
            ),
            (
                "list_index_out_of_range",
                r#"{"l": [1], "c": "${l.5}"}"#,
                Err(r#"Interpolation key 'l.5' not found"#),
            ),
            (
                "cycle",
                r#"{"a": "${b}", "b": "${a}"}"#,
                Err(r#"Recursive interpolation detected"#),
            ),
            (
                "self_cycle_in_string",
                r#"{"a": "x ${a}"}"#,
                Err(r#"Recursive interpolation detected"#),
            ),
            (
                "points_at_parent",
                r#"{"a": {"b": "${a}"}}"#,
                Err(r#"Interpolation to parent node detected"#),
            ),
            (
                "key_must_be_string",
                r#"{"f": 1.5, "d": {}, "x": "${d.${f}}"}"#,
                Err(
                    r#"The following interpolation is used to denote a config key and thus should return a string, but instead returned `1.5` of type `<class 'float'>`: ${f}"#,
                ),
            ),
            (
                "whitespace_in_interpolation",
                r#"{"a": {"b": 1}, "x": "${ a.b }", "y": "${oc.select: a.b , 0 }"}"#,
                Ok(r#"{"a": {"b": 1}, "x": 1, "y": 1}"#),
            ),
            (
                "resolver_args_are_typed",
                r#"{"x": "${oc.select:nope,[1, 'two', {k: null}]} end", "y": "${oc.select:nope,'a,b'}", "z": "${oc.select:nope,1_0.5}", "w": "${oc.select:nope,\\,x}"}"#,
                Ok(r#"{"x": "[1, 'two', {'k': None}] end", "y": "a,b", "z": 10.5, "w": ",x"}"#),
            ),
            (
                "list_result_cannot_be_stored",
                r#"{"x": "${oc.select:nope,[1]}"}"#,
                Err(r#"Value 'list' is not a supported primitive type"#),
            ),
            (
                "escaped_string_is_revalidated",
                r#"{"a": 1, "x": "\\${a\\}"}"#,
                Err(r#"token recognition error at: '\'"#),
            ),
            (
                "oc_decode_syntax_0",
                r#"{"s": " }", "x": "${oc.decode:${s}}"}"#,
                Err(r#"Exception raised while resolving interpolation: Empty Stack"#),
            ),
            (
                "oc_decode_syntax_1",
                r#"{"s": "1 }", "x": "${oc.decode:${s}}"}"#,
                Err(r#"GrammarParseError raised while resolving interpolation: Empty Stack"#),
            ),
            (
                "oc_decode_syntax_2",
                r#"{"s": "\t", "x": "${oc.decode:${s}}"}"#,
                Err(
                    r#"AssertionError raised while resolving interpolation: WS should never be reached"#,
                ),
            ),
            (
                "oc_decode_syntax_3",
                r#"{"s": "[1,2", "x": "${oc.decode:${s}}"}"#,
                Err(
                    r#"GrammarParseError raised while resolving interpolation: missing BRACKET_CLOSE at '<EOF>'"#,
                ),
            ),
            (
                "oc_decode_syntax_4",
                r#"{"s": "{a:1,}", "x": "${oc.decode:${s}}"}"#,
                Err(
                    r#"GrammarParseError raised while resolving interpolation: mismatched input '}' expecting {FLOAT, INT, BOOL, NULL, UNQUOTED_CHAR, ID, ESC, WS}"#,
                ),
            ),
            (
                "oc_decode_syntax_5",
                r#"{"s": "a=b", "x": "${oc.decode:${s}}"}"#,
                Err(
                    r#"GrammarParseError raised while resolving interpolation: token recognition error at: '='"#,
                ),
            ),
            (
                "recursion_through_resolvers_is_bounded",
                r#"{"x": "${oc.select:x}"}"#,
                Err(
                    r#"RecursionError raised while resolving interpolation: maximum recursion depth exceeded"#,
                ),
            ),
        ];
        let ctx = test_ctx();
        for (name, input, want) in cases {
            let got = resolve_tree(&parse(input), &ctx);
            match (want, got) {
                (Ok(want), Ok(got)) => assert_eq!(got, parse(want), "{name}"),
                (Err(want), Err(got)) => assert_eq!(&first_line(&got), want, "{name}"),
                (want, got) => panic!("{name}: want {want:?}, got {got:?}"),
            }
        }
    }

    #[test]
    fn errors_name_the_failing_key_and_origin() {
        let origin = Origin::File {
            file: "conf.yaml".into(),
            line: 3,
            col: 5,
        };
        let mut inner = Dict::new();
        inner.insert(
            Key::from("b"),
            Node::with_origin(Value::str("${nope}"), Some(origin.clone())),
        );
        let mut root = Dict::new();
        root.insert(
            Key::from("a"),
            Node::new(Value::List(vec![Node::new(Value::Dict(inner))])),
        );
        let err = resolve_tree(&Node::new(Value::Dict(root)), &test_ctx())
            .expect_err("nope is not defined");
        assert_eq!(err.kind(), &ErrorKind::KeyNotFound { key: "nope".into() });
        assert_eq!(err.full_key(), "a[0].b");
        assert_eq!(err.origin(), Some(&origin));
        assert_eq!(
            err.to_string(),
            "Interpolation key 'nope' not found\n    full_key: a[0].b\n    at conf.yaml:3:5"
        );
    }

    #[test]
    fn resolve_at_is_a_lookup() {
        let cfg = parse(
            r#"{"a": {"b": "${c}", "m": "???", "r": "${.m}"}, "c": [1, "${a.b}"], "m": "???", "p": "${m}"}"#,
        );
        let ctx = test_ctx();
        let check =
            |path: &str, want: Result<&str, &str>| match (want, resolve_at(&cfg, path, &ctx)) {
                (Ok(want), Ok(got)) => assert_eq!(got, parse(want), "{path}"),
                (Err(want), Err(got)) => assert_eq!(first_line(&got), want, "{path}"),
                (want, got) => panic!("{path}: want {want:?}, got {got:?}"),
            };
        check("c.0", Ok("1"));
        check("c[0]", Ok("1"));
        check("m", Err("Missing mandatory value: m"));
        check(
            "p",
            Err("MissingMandatoryValue while resolving interpolation: Missing mandatory value: m"),
        );
        check(
            "a.r",
            Err(
                "MissingMandatoryValue while resolving interpolation: Missing mandatory value: a.m",
            ),
        );
        check("nope.x", Err("Key 'nope.x' not found"));
        check("c.1", Err("Interpolation to parent node detected"));
    }

    #[test]
    fn resolve_at_resolves_containers_and_keeps_unreferenced_missing() {
        let cfg = parse(r#"{"d": {"x": "${v}", "m": "???", "s": "n_${v}"}, "v": 2}"#);
        assert_eq!(
            resolve_at(&cfg, "d", &test_ctx()),
            Ok(parse(r#"{"x": 2, "m": "???", "s": "n_2"}"#))
        );
    }

    #[test]
    fn resolve_str_uses_the_root_as_parent() {
        let cfg = parse(r#"{"db": {"name": "pg"}, "n": 3}"#);
        let ctx = test_ctx();
        assert_eq!(
            resolve_str("db/${db.name}", &cfg, &ctx),
            Ok(Node::str("db/pg"))
        );
        assert_eq!(
            resolve_str("${n}", &cfg, &ctx),
            Ok(Node::new(Value::int(3)))
        );
        assert_eq!(
            resolve_str("${.db}", &cfg, &ctx),
            Ok(parse(r#"{"name": "pg"}"#))
        );
        assert_eq!(
            resolve_str("plain $n {x} \\", &cfg, &ctx),
            Ok(Node::str("plain $n {x} \\"))
        );
        assert_eq!(
            resolve_str("esc \\${n}", &cfg, &ctx),
            Ok(Node::str("esc ${n}"))
        );
        let err = resolve_str("${nope}", &cfg, &ctx).expect_err("nope is not defined");
        assert_eq!(err.to_string(), "Interpolation key 'nope' not found");
    }

    #[test]
    fn hydra_and_now_resolvers() {
        let hydra = parse(
            r#"{"job": {"name": "train", "dir": "out/${hydra.job.name}"}, "runtime": {"cwd": "/w"}, "m": "???"}"#,
        );
        let full = Node::new(Value::Dict(
            [(Key::from("hydra"), hydra.clone())].into_iter().collect(),
        ));
        let ctx = test_ctx().with_full_config(&full);
        let cfg = parse(
            r#"{"a": "${hydra:runtime.cwd}", "b": "${hydra:job.dir}", "c": "${hydra:nope}", "d": "${hydra:m}",
                "e": "${now:%Y-%m-%d_%H-%M-%S}", "f": "${hydra:job}"}"#,
        );
        let want = parse(
            r#"{"a": "/w", "b": "out/train", "c": null, "d": null, "e": "2024-05-06_07-08-09",
                "f": {"name": "train", "dir": "out/train"}}"#,
        );
        assert_eq!(resolve_tree(&cfg, &ctx), Ok(want));
        // `--cfg job`: the hydra node hangs below the job config, so its `${a}` reads the job's `a` and its
        // `${hydra.job.name}` finds nothing (as in Hydra 1.3.8).
        let hidden = parse(r#"{"job": {"name": "n=${a}", "dir": "out/${hydra.job.name}"}}"#);
        let ctx = test_ctx().with_hydra(&hidden);
        let cfg = parse(r#"{"a": 10, "b": "${hydra:job.name}"}"#);
        assert_eq!(
            resolve_tree(&cfg, &ctx),
            Ok(parse(r#"{"a": 10, "b": "n=10"}"#))
        );
        let err = resolve_tree(&parse(r#"{"b": "${hydra:job.dir}"}"#), &ctx).expect_err("hidden");
        assert_eq!(
            first_line(&err),
            "Interpolation key 'hydra.job.name' not found"
        );
        let without = resolve_tree(&parse(r#"{"a": "${hydra:job.name}"}"#), &test_ctx())
            .expect_err("no hydra node");
        assert_eq!(
            first_line(&without),
            "ValueError raised while resolving interpolation: HydraConfig was not set"
        );
    }

    #[test]
    fn validate_tree_reports_grammar_errors_with_their_key() {
        for (input, key) in [
            (r#"{"a": "${}"}"#, "a"),
            (r#"{"a": {"b": ["ok ${x}", "${d i c t.a}"]}}"#, "a.b[1]"),
            (r#"{"a": "${some_${resolver}:a, b, c}"}"#, "a"),
            (r#"{"a": "${1e1:1,2,3}"}"#, "a"),
        ] {
            let err = validate_tree(&parse(input)).expect_err(input);
            assert!(
                matches!(err.kind(), ErrorKind::Grammar { .. }),
                "{input}: {err}"
            );
            assert_eq!(err.full_key(), key, "{input}");
            assert!(
                err.to_string().contains(&format!("full_key: {key}")),
                "{input}: {err}"
            );
        }
        assert_eq!(
            validate_tree(&parse(
                r#"{"a": "\\${not an interpolation\\}", "b": "${x.y[0]}", "c": "${f:[1, {a: b}]}"}"#
            )),
            Ok(())
        );
    }

    #[test]
    fn long_reference_chains_fail_cleanly() {
        let chain = |n: usize| {
            let mut root = Dict::new();
            for i in 0..n {
                root.insert(
                    Key::from(format!("a{i}")),
                    Node::str(format!("${{a{}}}", i + 1)),
                );
            }
            root.insert(Key::from(format!("a{n}")), Node::new(Value::int(7)));
            Node::new(Value::Dict(root))
        };
        let ok = resolve_tree(&chain(20), &test_ctx()).expect("a short chain resolves");
        assert_eq!(ok.get("a0").map(|n| &n.value), Some(&Value::int(7)));
        // Far deeper than Python's recursion limit allows: an error, not a stack overflow.
        let err = resolve_at(&chain(5000), "a0", &test_ctx()).expect_err("too deep");
        assert!(
            first_line(&err).starts_with("RecursionError raised while resolving interpolation"),
            "{err}"
        );
    }

    #[test]
    fn exponential_self_reference_is_cut_off() {
        let mut root = Dict::new();
        for level in 0..40 {
            let next = format!("${{l{}}}", level + 1);
            root.insert(
                Key::from(format!("l{level}")),
                Node::new(kit::decode(&serde_json::json!([next, next]))),
            );
        }
        root.insert(Key::from("l40"), Node::new(Value::int(1)));
        let err =
            resolve_at(&Node::new(Value::Dict(root)), "l0", &test_ctx()).expect_err("2^40 leaves");
        assert_eq!(
            err.kind(),
            &ErrorKind::TooMuchWork {
                limit: eval::MAX_STEPS
            }
        );
    }

    /// An unknown resolver fails with OmegaConf's text first, then says it needs Python; OmegaConf's own
    /// `oc.` namespace does not.
    #[test]
    fn unknown_resolvers_say_they_need_python() {
        let ctx = test_ctx();
        let Err(e) = resolve_tree(&parse(r#"{"x": "${my_custom_resolver:1}"}"#), &ctx) else {
            panic!("an unknown resolver resolved");
        };
        let text = e.to_string();
        assert_eq!(
            first_line(&e),
            "Unsupported interpolation type my_custom_resolver"
        );
        assert!(
            text.lines().last().is_some_and(|l| l.starts_with(
                "    needs Python: a resolver named 'my_custom_resolver' is registered by Python code"
            )),
            "{text}"
        );
        assert!(
            text.ends_with("which this program does not run"),
            "a program that gave no name: {text}"
        );
        let named = test_ctx().with_program("myapp");
        let Err(e) = resolve_tree(&parse(r#"{"x": "${my_custom_resolver:1}"}"#), &named) else {
            panic!("an unknown resolver resolved");
        };
        assert!(e.to_string().ends_with("which myapp does not run"), "{e}");
        let Err(e) = resolve_at(&parse(r#"{"x": "${my_custom_resolver:1}"}"#), "x", &named) else {
            panic!("an unknown resolver resolved");
        };
        assert!(e.to_string().ends_with("which myapp does not run"), "{e}");
        let Err(e) = resolve_tree(&parse(r#"{"x": "${oc.nosuch:1}"}"#), &ctx) else {
            panic!("oc.nosuch resolved");
        };
        assert!(!e.to_string().contains("needs Python"), "{e}");
    }

    #[test]
    fn is_interpolation_is_the_cheap_test() {
        assert!(is_interpolation("a ${b}"));
        assert!(is_interpolation("\\${b}"));
        assert!(!is_interpolation("$b {c}"));
        assert!(check_syntax("${a.b}").is_ok());
        assert!(check_syntax("${a.b").is_err());
        assert!(check_syntax("${:lenient}").is_ok());
    }
}
