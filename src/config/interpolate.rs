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
//! operators), `eval` (OmegaConf's resolution algorithm), `resolvers` (the built-in resolvers).

mod eval;
mod grammar;
mod py;
mod resolvers;
mod tree;

use std::fmt;

use crate::config::node::{Node, Origin, Value};
use eval::Engine;
pub use grammar::GrammarError;
use py::PyErr;
use tree::Id;

/// What resolution may consult besides the config: Hydra's own node, the environment, and the clock.
pub struct ResolveContext<'a> {
    /// The `hydra` node of the composed config, for `${hydra:runtime.cwd}` and friends.
    hydra: Option<&'a Node>,
    /// Environment lookup for `oc.env` (injectable so tests do not touch the process environment).
    env: Box<dyn Fn(&str) -> Option<String> + 'a>,
    /// Local wall-clock time for `${now:...}`; fixed per context, as Hydra caches `now` per pattern.
    now: chrono::NaiveDateTime,
}

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
            env: Box::new(|key| std::env::var_os(key).map(|v| v.to_string_lossy().into_owned())),
            now: chrono::Local::now().naive_local(),
        }
    }

    pub fn with_hydra(mut self, hydra: &'a Node) -> ResolveContext<'a> {
        self.hydra = Some(hydra);
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
    #[error("Error trying to access {key}: node `{parent_key}` is not a container and thus cannot contain `{child_key}`")]
    NotAContainer { key: String, parent_key: String, child_key: String },
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
    KeyNotString { value: String, class: String, text: String },
    #[error("The name of a resolver must be a string, but the interpolation {text} resolved to `{value}` which is of type {class}")]
    ResolverNameNotString { text: String, value: String, class: String },
    /// A Python exception raised by a resolver or a lookup, before OmegaConf wraps it.
    #[error("{}", .0.message)]
    Python(PyErr),
    /// `<Class> raised while resolving interpolation: <msg>`.
    #[error("{class} raised while resolving interpolation: {message}")]
    Raised { class: String, message: String },
    /// `OmegaConf.resolve` cannot store a plain list/dict produced by a resolver in a value node.
    #[error("Value '{type_name}' is not a supported primitive type")]
    UnsupportedValueType { type_name: &'static str },
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
        ErrorKind::Raised { class: class.to_owned(), message }
    }
}

/// An interpolation error and the config node it happened at.
#[derive(Debug, Clone, PartialEq)]
pub struct InterpolationError {
    pub kind: ErrorKind,
    /// OmegaConf's dotted key of the node being resolved (`a.b`, `list[0]`); empty for the root.
    pub full_key: String,
    pub origin: Option<Origin>,
}

impl fmt::Display for InterpolationError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}\n    full_key: {}", self.kind, self.full_key)?;
        if let Some(origin) = &self.origin {
            write!(f, "\n    at {origin}")?;
        }
        Ok(())
    }
}

impl std::error::Error for InterpolationError {}

fn locate(engine: &Engine<'_, '_>, kind: ErrorKind, id: Id) -> InterpolationError {
    InterpolationError { kind, full_key: engine.tree.full_key(id), origin: engine.tree.slot(id).origin.clone() }
}

/// A fully resolved copy of `root`: `OmegaConf.resolve` semantics, so values that are (or reach) `???`
/// stay `???`. Strings that still contain `${` afterwards came from escapes (`\${x}`) and are plain text.
pub fn resolve_tree(root: &Node, ctx: &ResolveContext) -> Result<Node, InterpolationError> {
    let (mut engine, id) = Engine::new(root, ctx);
    engine.resolve_in_place(id).map_err(|(kind, at)| locate(&engine, kind, at))?;
    Ok(engine.tree.to_node(id))
}

/// Resolve the node at `path` (`a.b`, `a.list.0`, `a.list[0]`) as OmegaConf's access would; a container
/// comes back with its content resolved (`to_container(resolve=True)`, `???` kept where unreferenced).
pub fn resolve_at(root: &Node, path: &str, ctx: &ResolveContext) -> Result<Node, InterpolationError> {
    let (mut engine, id) = Engine::new(root, ctx);
    let at_path = |kind| InterpolationError { kind, full_key: path.to_owned(), origin: root.get_path(path).and_then(|n| n.origin.clone()) };
    let found = engine.select_impl(id, path, true, &mut eval::Memo::off()).map_err(at_path)?;
    let Some((raw, res)) = found else {
        return Err(at_path(ErrorKind::PathNotFound { path: path.to_owned() }));
    };
    let origin = engine.tree.slot(raw).origin.clone();
    engine.res_to_node(res, origin).map_err(|kind| locate(&engine, kind, raw))
}

/// Resolve a standalone string as if it were a value stored at the root of `root` (relative keys start
/// there). A string without `${` is returned as is.
pub fn resolve_str(template: &str, root: &Node, ctx: &ResolveContext) -> Result<Node, InterpolationError> {
    if !is_interpolation(template) {
        return Ok(Node::new(Value::Str(template.to_owned())));
    }
    let (mut engine, id) = Engine::new(root, ctx);
    let leaf = engine.tree.add(Some(id), None, tree::Body::Leaf(tree::Scalar::Str(template.to_owned())), None);
    let res = engine.dereference(leaf).map_err(|kind| locate(&engine, kind, leaf))?;
    engine.res_to_node(res, None).map_err(|kind| locate(&engine, kind, leaf))
}

/// OmegaConf's cheap test: a string is an interpolation when it contains `${` (escaped ones included,
/// since they still need unescaping).
pub fn is_interpolation(s: &str) -> bool {
    s.contains("${")
}

/// Check the syntax of one interpolation string without resolving it.
pub fn check_syntax(s: &str) -> Result<(), GrammarError> {
    grammar::parse_value(s).map(|_| ())
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
            Some(s) => check_syntax(s).map_err(|e| InterpolationError {
                kind: ErrorKind::Grammar { detail: e.detail },
                full_key: t.full_key(id),
                origin: t.slot(id).origin.clone(),
            }),
            None => Ok(()),
        },
    }
}
