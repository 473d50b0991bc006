//! Evaluation of parsed interpolations against the working tree, following OmegaConf 2.3.1 step by step.
//!
//! The functions mirror OmegaConf's call chain so that edge cases agree: `_dereference_node`,
//! `_maybe_resolve_interpolation`, `resolve_parse_tree` (which wraps foreign exceptions),
//! `_resolve_node_interpolation`, `_select_impl`/`_select_one`, and the two ways a whole config is resolved:
//! in place (`OmegaConf.resolve`, what Hydra's `--cfg job --resolve` prints) and by copy
//! (`OmegaConf.container_content(resolve=True)`, used for single lookups).

use super::ErrorKind;
use super::ResolveContext;
use super::grammar::{self, DictKey, Element, Interp, InterpKind, KeyPiece, Part, Text};
use super::py::{Py, PyErr};
use super::tree::{Body, Id, SlotKey, Tree};
use crate::node::{Dict, Key, Node, Value};
use crate::scalar::{Scalar, parse_int_digits};

/// How deep interpolations may nest before resolution gives up (Python's recursion limit, in spirit).
const MAX_DEPTH: usize = 96;

/// How many interpolations one resolution may evaluate in total.
pub const MAX_STEPS: usize = 1_000_000;

/// The outcome of resolving an interpolation: a node of the tree, or a value a resolver produced.
#[derive(Debug, Clone)]
pub enum Res {
    Node(Id),
    Val(Py),
}

/// OmegaConf's `memo`: the nodes being resolved along the current chain, for cycle detection.
/// `on == false` is OmegaConf's `memo=None` (top-level dereference and resolver-initiated lookups).
pub struct Memo {
    ids: Vec<Id>,
    on: bool,
}

impl Memo {
    pub fn off() -> Memo {
        Memo {
            ids: Vec::new(),
            on: false,
        }
    }

    fn fresh() -> Memo {
        Memo {
            ids: Vec::new(),
            on: true,
        }
    }
}

pub struct Engine<'c, 'a> {
    pub tree: Tree,
    pub ctx: &'c ResolveContext<'a>,
    /// The `hydra` node inside a detached `{hydra: ...}` root, for `${hydra:...}`.
    pub hydra: Option<Id>,
    depth: usize,
    /// Evaluation steps so far; bounded because a config can reference itself exponentially
    /// (`a: [${b}, ${b}]`, `b: [${c}, ${c}]`, ...), which would otherwise never finish.
    steps: usize,
}

impl<'c, 'a> Engine<'c, 'a> {
    /// Load `root` into a fresh tree; returns the engine and the root's id.
    pub fn new(root: &Node, ctx: &'c ResolveContext<'a>) -> (Engine<'c, 'a>, Id) {
        let mut tree = Tree::default();
        let root_id = tree.insert_node(root, None, None);
        // Hydra's `HydraConfig` node is a hidden child of the config being resolved: its parent is that
        // config (with `--cfg job`, the job config without `hydra`), so `${a}` inside a `hydra.*` value
        // resolves against the user's keys, while the root itself does not list it.
        let hydra = match ctx.hydra_in_full {
            Some(full) => {
                let full_id = tree.insert_node(full, None, None);
                tree.child(full_id, &SlotKey::Key(Key::from("hydra")))
            }
            None => ctx.hydra.map(|h| {
                tree.insert_node(h, Some(root_id), Some(SlotKey::Key(Key::from("hydra"))))
            }),
        };
        (
            Engine {
                tree,
                ctx,
                hydra,
                depth: 0,
                steps: 0,
            },
            root_id,
        )
    }

    fn enter(&mut self) -> Result<(), ErrorKind> {
        if self.depth >= MAX_DEPTH {
            return Err(ErrorKind::Python(PyErr::new(
                "RecursionError",
                "maximum recursion depth exceeded",
            )));
        }
        self.steps += 1;
        if self.steps > MAX_STEPS {
            return Err(ErrorKind::TooMuchWork { limit: MAX_STEPS });
        }
        self.depth += 1;
        Ok(())
    }

    fn leave(&mut self) {
        self.depth = self.depth.saturating_sub(1);
    }

    // ------------------------------------------------------------ values

    /// OmegaConf's `_get_value`: a leaf's value, a container itself, or a resolver's value.
    pub fn value_of(&self, r: &Res) -> Py {
        match r {
            Res::Node(id) => match self.tree.leaf(*id) {
                Some(v) => Py::from_leaf(v),
                None => Py::Config(*id),
            },
            Res::Val(p) => p.clone(),
        }
    }

    /// Python's `str()` of a resolution result, as string interpolation uses it.
    pub fn str_of(&self, r: &Res) -> String {
        self.value_of(r).str(&self.tree)
    }

    pub fn res_of(p: Py) -> Res {
        match p {
            Py::Config(id) => Res::Node(id),
            other => Res::Val(other),
        }
    }

    // ------------------------------------------------------------ dereferencing

    /// `_dereference_node`: resolve node `id` if it holds an interpolation.
    pub fn dereference(&mut self, id: Id) -> Result<Res, ErrorKind> {
        let Some(s) = self.tree.interpolation(id).map(str::to_owned) else {
            return Ok(Res::Node(id));
        };
        let Some(owner) = self.tree.parent(id) else {
            return Err(ErrorKind::NoParent);
        };
        self.resolve_string(owner, id, &s, &mut Memo::off())
    }

    /// `_maybe_resolve_interpolation` + `resolve_parse_tree`: parse `s` (a value of node `node`, whose
    /// container is `owner`) and evaluate it. Errors other than resolution errors are wrapped here.
    pub fn resolve_string(
        &mut self,
        owner: Id,
        node: Id,
        s: &str,
        memo: &mut Memo,
    ) -> Result<Res, ErrorKind> {
        let text = grammar::parse_value(s).map_err(|e| ErrorKind::Grammar { detail: e.detail })?;
        self.visit_text(owner, node, &text, memo)
            .map_err(ErrorKind::wrap)
    }

    pub fn visit_text(
        &mut self,
        owner: Id,
        node: Id,
        text: &Text,
        memo: &mut Memo,
    ) -> Result<Res, ErrorKind> {
        if let [Part::Interp(i)] = text.parts.as_slice() {
            return self.visit_interp(owner, node, i, memo);
        }
        let mut out = String::new();
        for part in &text.parts {
            match part {
                Part::Lit(s) => out.push_str(s),
                Part::Interp(i) => {
                    let r = self.visit_interp(owner, node, i, memo)?;
                    out.push_str(&self.str_of(&r));
                }
            }
        }
        Ok(Res::Val(Py::string(out)))
    }

    fn visit_interp(
        &mut self,
        owner: Id,
        node: Id,
        interp: &Interp,
        memo: &mut Memo,
    ) -> Result<Res, ErrorKind> {
        self.enter()?;
        let out = self.visit_interp_inner(owner, node, interp, memo);
        self.leave();
        out
    }

    fn visit_interp_inner(
        &mut self,
        owner: Id,
        node: Id,
        interp: &Interp,
        memo: &mut Memo,
    ) -> Result<Res, ErrorKind> {
        match &interp.kind {
            InterpKind::Node(pieces) => {
                let mut key = String::new();
                for piece in pieces {
                    match piece {
                        KeyPiece::Lit(s) => key.push_str(s),
                        KeyPiece::Interp(inner) => {
                            let r = self.visit_interp(owner, node, inner, memo)?;
                            match self.value_of(&r) {
                                Py::Scalar(Scalar::Str(s)) => key.push_str(&s),
                                other => {
                                    return Err(ErrorKind::KeyNotString {
                                        value: other.str(&self.tree),
                                        class: python_class(&other, &self.tree),
                                        text: inner.text.clone(),
                                    });
                                }
                            }
                        }
                    }
                }
                self.node_interpolation(owner, &key, memo)
            }
            InterpKind::Resolver { name, args } => {
                let mut parts = Vec::new();
                for piece in name {
                    match piece {
                        KeyPiece::Lit(s) => parts.push(s.clone()),
                        KeyPiece::Interp(inner) => {
                            let r = self.visit_interp(owner, node, inner, memo)?;
                            match self.value_of(&r) {
                                Py::Scalar(Scalar::Str(s)) => parts.push(s),
                                other => {
                                    return Err(ErrorKind::ResolverNameNotString {
                                        text: inner.text.clone(),
                                        value: other.str(&self.tree),
                                        class: python_class(&other, &self.tree),
                                    });
                                }
                            }
                        }
                    }
                }
                let name = parts.join(".");
                let mut values = Vec::with_capacity(args.len());
                for arg in args {
                    values.push(self.visit_element(owner, node, arg, memo)?);
                }
                let out = self.call_resolver(&name, owner, node, values)?;
                Ok(Engine::res_of(out))
            }
        }
    }

    /// `visitElement` followed by `_get_value`, as every caller applies it.
    pub fn visit_element(
        &mut self,
        owner: Id,
        node: Id,
        el: &Element,
        memo: &mut Memo,
    ) -> Result<Py, ErrorKind> {
        Ok(match el {
            Element::Empty => Py::string(String::new()),
            Element::Null => Py::NONE,
            Element::Bool(b) => Py::Scalar(Scalar::Bool(*b)),
            Element::Int(s) => parse_int_literal(s)?,
            Element::Float(s) => Py::Scalar(Scalar::Float(parse_float_literal(s))),
            Element::Str(s) => Py::string(s.clone()),
            Element::Interp(i) => {
                let r = self.visit_interp(owner, node, i, memo)?;
                self.value_of(&r)
            }
            Element::Concat(parts) => {
                let text = Text {
                    parts: parts.clone(),
                };
                let r = self.visit_text(owner, node, &text, memo)?;
                match r {
                    // A concatenation always yields a string, even with one interpolation part.
                    Res::Val(Py::Scalar(Scalar::Str(s))) if parts.len() != 1 => Py::string(s),
                    other => Py::string(self.str_of(&other)),
                }
            }
            Element::Quoted(text) => {
                if text.parts.is_empty() {
                    Py::string(String::new())
                } else {
                    let r = self.visit_text(owner, node, text, memo)?;
                    Py::string(self.str_of(&r))
                }
            }
            Element::List(items) => {
                let mut out = Vec::with_capacity(items.len());
                for item in items {
                    out.push(self.visit_element(owner, node, item, memo)?);
                }
                Py::List(out)
            }
            Element::Dict(pairs) => {
                let mut out: Vec<(Py, Py)> = Vec::with_capacity(pairs.len());
                for (k, v) in pairs {
                    let key = dict_key_value(k)?;
                    let value = self.visit_element(owner, node, v, memo)?;
                    match out.iter_mut().find(|(existing, _)| existing.key_eq(&key)) {
                        Some(slot) => slot.1 = value,
                        None => out.push((key, value)),
                    }
                }
                Py::Dict(out)
            }
        })
    }

    // ------------------------------------------------------------ node interpolation

    /// `_resolve_node_interpolation`.
    fn node_interpolation(
        &mut self,
        owner: Id,
        key: &str,
        memo: &mut Memo,
    ) -> Result<Res, ErrorKind> {
        let (root, rest) = self.key_and_root(owner, key)?;
        let found = match self.select_impl(root, &rest, true, memo) {
            Err(ErrorKind::Missing { key }) => return Err(ErrorKind::ToMissing { key }),
            other => other?,
        };
        let Some((_, res)) = found else {
            return Err(ErrorKind::KeyNotFound { key: rest });
        };
        if let Res::Node(target) = res {
            let mut cur = Some(owner);
            while let Some(c) = cur {
                if c == target {
                    return Err(ErrorKind::ToParent);
                }
                cur = self.tree.parent(c);
            }
        }
        Ok(res)
    }

    /// `_resolve_key_and_root`: absolute keys start at the root, each leading dot climbs one container.
    pub fn key_and_root(&self, owner: Id, key: &str) -> Result<(Id, String), ErrorKind> {
        if !key.starts_with('.') {
            return Ok((self.tree.root_of(owner), key.to_owned()));
        }
        let mut root = owner;
        let mut rest = key;
        loop {
            rest = &rest[1..];
            if !rest.starts_with('.') {
                break;
            }
            root = self
                .tree
                .parent(root)
                .ok_or_else(|| ErrorKind::BadRelativeKey {
                    key: key.to_owned(),
                })?;
        }
        Ok((root, rest.to_owned()))
    }

    /// `_select_impl`: walk `key` from container `root`, dereferencing intermediate nodes; returns the raw
    /// node found and its resolved value, or `None` when a key is absent.
    pub fn select_impl(
        &mut self,
        root: Id,
        key: &str,
        throw_on_missing: bool,
        memo: &mut Memo,
    ) -> Result<Option<(Id, Res)>, ErrorKind> {
        if key.is_empty() {
            return Ok(Some((root, Res::Node(root))));
        }
        let parts = split_key(key);
        let Some((last, init)) = parts.split_last() else {
            return Ok(Some((root, Res::Node(root))));
        };
        let mut cur = root;
        for (i, part) in init.iter().enumerate() {
            let Some(child) = self.select_one(cur, part, throw_on_missing)? else {
                return Ok(None);
            };
            let r = match self.tree.interpolation(child).map(str::to_owned) {
                Some(s) => self.resolve_string(cur, child, &s, memo)?,
                None => Res::Node(child),
            };
            match r {
                Res::Node(c) if self.tree.is_container(c) => cur = c,
                _ => {
                    return Err(ErrorKind::NotAContainer {
                        key: key.to_owned(),
                        parent_key: parts[..=i].join("."),
                        child_key: parts.get(i + 1).cloned().unwrap_or_default(),
                    });
                }
            }
        }
        let Some(value) = self.select_one(cur, last, throw_on_missing)? else {
            return Ok(None);
        };
        let res = if memo.on {
            if memo.ids.contains(&value) {
                return Err(ErrorKind::Recursive);
            }
            memo.ids.push(value);
            let r = self.maybe_resolve(cur, value, memo);
            memo.ids.pop();
            r?
        } else {
            self.maybe_resolve(cur, value, &mut Memo::fresh())?
        };
        Ok(Some((value, res)))
    }

    fn maybe_resolve(&mut self, owner: Id, id: Id, memo: &mut Memo) -> Result<Res, ErrorKind> {
        match self.tree.interpolation(id).map(str::to_owned) {
            Some(s) => {
                self.enter()?;
                let r = self.resolve_string(owner, id, &s, memo);
                self.leave();
                r
            }
            None => Ok(Res::Node(id)),
        }
    }

    /// `_select_one`: one step of a key path.
    fn select_one(
        &self,
        c: Id,
        key: &str,
        throw_on_missing: bool,
    ) -> Result<Option<Id>, ErrorKind> {
        let (found, shown_key) = match self.tree.body(c) {
            Body::Dict(d) => (d.get(&Key::from(key.to_owned())).copied(), key.to_owned()),
            Body::List(items) => {
                let Some(index) = python_int(key) else {
                    return Err(ErrorKind::Python(PyErr::type_error(format!(
                        "Index '{key}' (str) is not an int"
                    ))));
                };
                let found = usize::try_from(index)
                    .ok()
                    .and_then(|i| items.get(i).copied());
                (found, index.to_string())
            }
            Body::Leaf(_) => (None, key.to_owned()),
        };
        if let Some(id) = found
            && throw_on_missing
            && matches!(self.tree.leaf(id), Some(Value::Missing))
        {
            return Err(ErrorKind::Missing {
                key: self.tree.child_full_key(c, &shown_key),
            });
        }
        Ok(found)
    }

    // ------------------------------------------------------------ whole-config resolution

    /// `OmegaConf.resolve`: rewrite every interpolation in place, in document order.
    pub fn resolve_in_place(&mut self, id: Id) -> Result<(), (ErrorKind, Id)> {
        self.enter().map_err(|e| (e, id))?;
        let out = self.resolve_children(id);
        self.leave();
        out
    }

    fn resolve_children(&mut self, id: Id) -> Result<(), (ErrorKind, Id)> {
        let keys: Vec<SlotKey> = match self.tree.body(id) {
            Body::Dict(d) => d.keys().cloned().map(SlotKey::Key).collect(),
            Body::List(l) => (0..l.len()).map(SlotKey::Index).collect(),
            Body::Leaf(_) => return Ok(()),
        };
        for key in keys {
            let Some(child) = self.tree.child(id, &key) else {
                continue;
            };
            if self.tree.interpolation(child).is_none() {
                self.resolve_in_place(child)?;
                continue;
            }
            match self.dereference(child) {
                Err(ErrorKind::ToMissing { .. }) => self.tree.set_leaf(child, Value::Missing),
                Err(e) => return Err((e, child)),
                Ok(Res::Node(c)) if self.tree.is_container(c) => {
                    self.resolve_in_place(c)?;
                    let copy = self.tree.deep_copy(c, Some(id), Some(key.clone()));
                    self.tree.replace_child(id, &key, copy);
                }
                Ok(r) => {
                    let v = self.value_of(&r);
                    let scalar = self.assignable(v).map_err(|e| (e, child))?;
                    self.tree.set_leaf(child, scalar);
                }
            }
        }
        Ok(())
    }

    /// What `AnyNode._set_value` accepts: primitives; `???` becomes missing; interpolations are re-validated.
    fn assignable(&self, v: Py) -> Result<Value, ErrorKind> {
        Ok(match v {
            Py::Scalar(Scalar::Str(s)) if s == "???" => Value::Missing,
            Py::Scalar(Scalar::Str(s)) => {
                grammar::validate_value(&s).map_err(|e| ErrorKind::Grammar { detail: e.detail })?;
                Value::str(s)
            }
            Py::Scalar(s) => Value::Scalar(s),
            other => {
                return Err(ErrorKind::UnsupportedValueType {
                    type_name: other.type_name(&self.tree),
                });
            }
        })
    }

    /// `OmegaConf.to_container(resolve=True)` of a node (missing values stay `???`).
    pub fn container_content(&mut self, id: Id) -> Result<Node, (ErrorKind, Id)> {
        self.enter().map_err(|e| (e, id))?;
        let out = self.container_content_inner(id);
        self.leave();
        out
    }

    fn container_content_inner(&mut self, id: Id) -> Result<Node, (ErrorKind, Id)> {
        let origin = self.tree.slot(id).origin.clone();
        let value = match self.tree.body(id).clone() {
            Body::Leaf(v) => v,
            Body::List(items) => {
                let mut out = Vec::with_capacity(items.len());
                for child in items {
                    out.push(self.child_content(child)?);
                }
                Value::List(out)
            }
            Body::Dict(d) => {
                let mut out = Dict::new();
                for (k, child) in d {
                    let v = self.child_content(child)?;
                    out.insert(k, v);
                }
                Value::Dict(out)
            }
        };
        Ok(Node::with_origin(value, origin))
    }

    fn child_content(&mut self, child: Id) -> Result<Node, (ErrorKind, Id)> {
        let r = self.dereference(child).map_err(|e| (e, child))?;
        let origin = self.tree.slot(child).origin.clone();
        self.res_to_node(r, origin).map_err(|e| (e, child))
    }

    /// A resolution result as a plain [`Node`] (containers converted recursively).
    pub fn res_to_node(
        &mut self,
        r: Res,
        origin: Option<crate::node::Origin>,
    ) -> Result<Node, ErrorKind> {
        match r {
            Res::Node(id) if self.tree.is_container(id) => {
                self.container_content(id).map_err(|(e, _)| e)
            }
            Res::Node(id) => Ok(self.tree.to_node(id)),
            Res::Val(p) => self.py_to_node(p, origin),
        }
    }

    fn py_to_node(
        &mut self,
        p: Py,
        origin: Option<crate::node::Origin>,
    ) -> Result<Node, ErrorKind> {
        let value = match p {
            Py::Scalar(s) => Value::Scalar(s),
            Py::List(items) => {
                let mut out = Vec::with_capacity(items.len());
                for item in items {
                    out.push(self.py_to_node(item, origin.clone())?);
                }
                Value::List(out)
            }
            Py::Dict(pairs) => {
                let mut out = Dict::new();
                for (k, v) in pairs {
                    let key = k.to_key().ok_or_else(|| {
                        ErrorKind::Python(PyErr::type_error("unhashable dict key"))
                    })?;
                    let v = self.py_to_node(v, origin.clone())?;
                    out.insert(key, v);
                }
                Value::Dict(out)
            }
            Py::Config(id) => return self.container_content(id).map_err(|(e, _)| e),
        };
        Ok(Node::with_origin(value, origin))
    }

    /// Build a config subtree from a Python value (`_node_wrap` / `OmegaConf.create`), parented at `parent`.
    pub fn build(
        &mut self,
        p: &Py,
        parent: Option<Id>,
        key: Option<SlotKey>,
    ) -> Result<Id, ErrorKind> {
        let body = match p {
            Py::Config(src) => return Ok(self.tree.deep_copy(*src, parent, key)),
            Py::List(_) => Body::List(Vec::new()),
            Py::Dict(_) => Body::Dict(Default::default()),
            scalar => Body::Leaf(self.assignable(scalar.clone())?),
        };
        let id = self.tree.add(parent, key, body, None);
        match p {
            Py::List(items) => {
                let mut ids = Vec::with_capacity(items.len());
                for (i, item) in items.iter().enumerate() {
                    ids.push(self.build(item, Some(id), Some(SlotKey::Index(i)))?);
                }
                self.tree.replace_body(id, Body::List(ids));
            }
            Py::Dict(pairs) => {
                let mut d = indexmap::IndexMap::new();
                for (k, v) in pairs {
                    let key = k.to_key().ok_or_else(|| {
                        ErrorKind::Python(PyErr::new(
                            "KeyValidationError",
                            format!("Incompatible key type '{}'", k.type_name(&self.tree)),
                        ))
                    })?;
                    let child = self.build(v, Some(id), Some(SlotKey::Key(key.clone())))?;
                    d.insert(key, child);
                }
                self.tree.replace_body(id, Body::Dict(d));
            }
            _ => {}
        }
        Ok(id)
    }
}

/// `<class 'float'>`, as `type(x)` prints in OmegaConf's messages.
pub fn python_class(p: &Py, tree: &Tree) -> String {
    match p {
        Py::Config(_) => {
            let name = p.type_name(tree);
            let module = if name == "ListConfig" {
                "listconfig"
            } else {
                "dictconfig"
            };
            format!("<class 'omegaconf.{module}.{name}'>")
        }
        other => format!("<class '{}'>", other.type_name(tree)),
    }
}

fn dict_key_value(k: &DictKey) -> Result<Py, ErrorKind> {
    Ok(match k {
        DictKey::Null => Py::NONE,
        DictKey::Bool(b) => Py::Scalar(Scalar::Bool(*b)),
        DictKey::Int(s) => parse_int_literal(s)?,
        DictKey::Float(s) => Py::Scalar(Scalar::Float(parse_float_literal(s))),
        DictKey::Str(s) => Py::string(s.clone()),
    })
}

/// `int(text)` for an INT token (`-1_000`).
fn parse_int_literal(s: &str) -> Result<Py, ErrorKind> {
    let clean: String = s.chars().filter(|&c| c != '_').collect();
    let (negative, digits) = match clean.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, clean.strip_prefix('+').unwrap_or(&clean)),
    };
    let magnitude = parse_int_digits(digits, 10).ok_or_else(|| {
        ErrorKind::Python(PyErr::new(
            "ValueError",
            format!("invalid literal for int() with base 10: '{s}'"),
        ))
    })?;
    Ok(Py::int(if negative { -magnitude } else { magnitude }))
}

/// `float(text)` for a FLOAT token (`1_0.5e-3`, `-inf`, `NaN`, `1.`, `.5`).
fn parse_float_literal(s: &str) -> f64 {
    let clean: String = s
        .chars()
        .filter(|&c| c != '_')
        .collect::<String>()
        .to_ascii_lowercase();
    let (neg, body) = match clean.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, clean.strip_prefix('+').unwrap_or(&clean)),
    };
    let v = match body {
        "inf" => f64::INFINITY,
        "nan" => f64::NAN,
        _ => {
            // Rust does not accept a bare trailing `.` before an exponent (`1.e5`); Python does.
            let fixed = body.replace(".e", ".0e");
            let fixed = if fixed.ends_with('.') {
                format!("{fixed}0")
            } else {
                fixed
            };
            fixed.parse::<f64>().unwrap_or(f64::NAN)
        }
    };
    if neg { -v } else { v }
}

/// Python's `int(str)` for list indices: surrounding whitespace, a sign, and `_` between digits.
pub fn python_int(s: &str) -> Option<i64> {
    let t = s.trim();
    let (neg, digits) = match t.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, t.strip_prefix('+').unwrap_or(t)),
    };
    if digits.is_empty()
        || digits.starts_with('_')
        || digits.ends_with('_')
        || digits.contains("__")
    {
        return None;
    }
    if !digits.chars().all(|c| c.is_ascii_digit() || c == '_') {
        return None;
    }
    let clean: String = digits.chars().filter(|&c| c != '_').collect();
    let v: i64 = clean.parse().ok()?;
    Some(if neg { -v } else { v })
}

/// OmegaConf's `split_key`: `a.b` → [a, b]; `a[b]` → [a, b]; `..a` → ["", "", a]; `[a].b` → [a, b].
pub fn split_key(key: &str) -> Vec<String> {
    let chars: Vec<char> = key.chars().collect();
    let mut head_end = 0;
    while chars.get(head_end) == Some(&'.') {
        head_end += 1;
    }
    while chars.get(head_end).is_some_and(|&c| c != '.' && c != '[') {
        head_end += 1;
    }
    let head: String = chars[..head_end].iter().collect();
    let mut tokens: Vec<String> = head.split('.').map(str::to_owned).collect();
    if head_end == chars.len() {
        return tokens;
    }
    if chars[head_end] == '[' && tokens.last().is_some_and(|t| t.is_empty()) {
        tokens.pop();
    }
    let rest = &chars[head_end..];
    let mut i = 0;
    while i < rest.len() {
        match rest[i] {
            '.' => {
                let mut j = i + 1;
                while j < rest.len() && rest[j] != '.' && rest[j] != '[' {
                    j += 1;
                }
                tokens.push(rest[i + 1..j].iter().collect());
                i = j;
            }
            '[' => match rest[i + 1..].iter().position(|&c| c == ']') {
                Some(off) => {
                    tokens.push(rest[i + 1..i + 1 + off].iter().collect());
                    i = i + 2 + off;
                }
                None => i += 1,
            },
            _ => i += 1,
        }
    }
    tokens
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_key_matches_omegaconf() {
        let cases: &[(&str, &[&str])] = &[
            ("a.b", &["a", "b"]),
            ("a[b]", &["a", "b"]),
            (".a.b[c].d", &["", "a", "b", "c", "d"]),
            ("[a].b", &["a", "b"]),
            ("..[a]", &["", "", "a"]),
            ("list.-1", &["list", "-1"]),
            ("a", &["a"]),
        ];
        for (input, want) in cases {
            assert_eq!(
                split_key(input),
                want.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
                "{input}"
            );
        }
    }

    #[test]
    fn literals_parse_like_python() {
        assert_eq!(python_int(" 1_0 "), Some(10));
        assert_eq!(python_int("-1"), Some(-1));
        assert_eq!(python_int("1__0"), None);
        assert_eq!(python_int("x"), None);
        for (text, want) in [
            ("1.", 1.0),
            (".5", 0.5),
            ("1.e2", 100.0),
            ("1_000.5", 1000.5),
            ("-INF", f64::NEG_INFINITY),
            ("2E-1", 0.2),
        ] {
            assert_eq!(parse_float_literal(text), want, "{text}");
        }
        assert!(parse_float_literal("NaN").is_nan());
        assert_eq!(
            parse_int_literal("-1_000").ok(),
            Some(Py::Scalar(Scalar::Int(-1000)))
        );
        assert_eq!(
            parse_int_literal("+9_223_372_036_854_775_807").ok(),
            Some(Py::Scalar(Scalar::Int(i64::MAX)))
        );
        assert_eq!(
            parse_int_literal("99999999999999999999").ok(),
            Some(Py::Scalar(crate::scalar::big("99999999999999999999")))
        );
        assert_eq!(
            parse_int_literal("-9223372036854775809").ok(),
            Some(Py::Scalar(crate::scalar::big("-9223372036854775809")))
        );
    }
}
