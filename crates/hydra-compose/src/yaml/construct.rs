//! Type a raw YAML graph into a config [`Node`] tree the way PyYAML's SafeConstructor and OmegaConf's
//! loader do: tags, merge keys `<<`, duplicate-key rejection, Python key equality, `???` as missing.

use std::collections::{HashMap, HashSet};
use std::rc::Rc;
use std::sync::Arc;

use saphyr_parser::ScalarStyle;

use super::compose::{Raw, RawKind};
use super::scalar::{self, Implicit, ScalarError};
use super::{MAX_DEPTH, MAX_NODES, Pos, YamlErrorKind};
use crate::node::{Dict, Key, Node, Origin, Value};
use crate::scalar::Scalar;

/// The prefix of YAML's core tags (`!!int` is `tag:yaml.org,2002:int`).
const CORE: &str = "tag:yaml.org,2002:";

type Fail = (Pos, YamlErrorKind);
type Pairs = Vec<(Rc<Raw>, Rc<Raw>)>;

/// How a node's tag reads.
enum TagClass<'a> {
    /// No tag, or the non-specific `!`: the node's kind (and for plain scalars, its text) decides.
    Untagged,
    /// A core tag, by its short name (`int`, `map`, `python/tuple`, ...).
    Core(&'a str),
    Unknown,
}

fn classify(tag: Option<&str>) -> TagClass<'_> {
    match tag {
        None | Some("!") => TagClass::Untagged,
        Some(t) => t
            .strip_prefix(CORE)
            .map_or(TagClass::Unknown, TagClass::Core),
    }
}

const SCALAR_TAGS: &[&str] = &["str", "int", "float", "bool", "null", "binary", "timestamp"];

/// Builds nodes, counting work so alias/merge explosions fail instead of exhausting memory.
pub(super) struct Constructor {
    file: Arc<str>,
    spent: usize,
}

impl Constructor {
    pub(super) fn new(file: Arc<str>) -> Self {
        Constructor { file, spent: 0 }
    }

    pub(super) fn origin(&self, pos: Pos) -> Option<Origin> {
        Some(Origin::File {
            file: Arc::clone(&self.file),
            line: pos.line,
            col: pos.col,
        })
    }

    fn spend(&mut self, pos: Pos, units: usize) -> Result<(), Fail> {
        self.spent = self.spent.saturating_add(units);
        if self.spent > MAX_NODES {
            return Err((pos, YamlErrorKind::TooLarge { limit: MAX_NODES }));
        }
        Ok(())
    }

    /// A node in value position: as [`Self::node`], and the string `???` becomes [`Value::Missing`]
    /// (OmegaConf treats it so however it was quoted).
    fn value(&mut self, raw: &Raw, depth: usize) -> Result<Node, Fail> {
        let mut node = self.node(raw, depth)?;
        if matches!(&node.value, Value::Scalar(Scalar::Str(s)) if s == "???") {
            node.value = Value::Missing;
        }
        Ok(node)
    }

    /// Any node, strings kept as they are (PyYAML's `construct_object`).
    pub(super) fn node(&mut self, raw: &Raw, depth: usize) -> Result<Node, Fail> {
        if depth > MAX_DEPTH {
            return Err((raw.pos, YamlErrorKind::TooDeep { limit: MAX_DEPTH }));
        }
        self.spend(raw.pos, 1)?;
        let value = match &raw.kind {
            RawKind::Scalar { text, style } => {
                scalar_value(raw, text, *style).map_err(|kind| (raw.pos, kind))?
            }
            RawKind::Seq(items) => self.sequence(raw, items, depth)?,
            RawKind::Map(pairs) => self.mapping(raw, pairs, depth)?,
        };
        Ok(Node::with_origin(value, self.origin(raw.pos)))
    }

    fn sequence(&mut self, raw: &Raw, items: &[Rc<Raw>], depth: usize) -> Result<Value, Fail> {
        let tag = raw.tag.as_deref().unwrap_or_default();
        match classify(raw.tag.as_deref()) {
            TagClass::Untagged | TagClass::Core("seq") => {
                let list = items
                    .iter()
                    .map(|item| self.value(item, depth + 1))
                    .collect::<Result<_, _>>()?;
                Ok(Value::List(list))
            }
            TagClass::Core("omap" | "pairs") => self.pairs(raw, items, depth),
            TagClass::Core("set" | "map") => Err(wrong_kind(raw, "mapping", "sequence")),
            TagClass::Core(name) if SCALAR_TAGS.contains(&name) => {
                Err(wrong_kind(raw, "scalar", "sequence"))
            }
            TagClass::Core(_) | TagClass::Unknown => Err((
                raw.pos,
                YamlErrorKind::UnknownTag {
                    tag: tag.to_owned(),
                },
            )),
        }
    }

    /// `!!omap` / `!!pairs`: a sequence of one-pair mappings, which OmegaConf keeps as `[key, value]` lists.
    fn pairs(&mut self, raw: &Raw, items: &[Rc<Raw>], depth: usize) -> Result<Value, Fail> {
        let mut list = Vec::with_capacity(items.len());
        for item in items {
            let (key, value) = match &item.kind {
                RawKind::Map(pairs) if pairs.len() == 1 => &pairs[0],
                _ => {
                    return Err((
                        item.pos,
                        YamlErrorKind::BadPairs {
                            tag: raw.tag.clone().unwrap_or_default(),
                        },
                    ));
                }
            };
            self.spend(item.pos, 1)?;
            let pair = vec![self.value(key, depth + 2)?, self.value(value, depth + 2)?];
            list.push(Node::with_origin(Value::List(pair), self.origin(item.pos)));
        }
        Ok(Value::List(list))
    }

    fn mapping(
        &mut self,
        raw: &Raw,
        pairs: &[(Rc<Raw>, Rc<Raw>)],
        depth: usize,
    ) -> Result<Value, Fail> {
        let tag = raw.tag.as_deref().unwrap_or_default();
        match classify(raw.tag.as_deref()) {
            TagClass::Untagged | TagClass::Core("map") => self.dict(pairs, depth).map(Value::Dict),
            // PyYAML builds a Python set, which OmegaConf then refuses.
            TagClass::Core("set") => Err((
                raw.pos,
                YamlErrorKind::UnsupportedValue { type_name: "set" },
            )),
            TagClass::Core("omap" | "pairs" | "seq") => Err(wrong_kind(raw, "sequence", "mapping")),
            TagClass::Core(name) if SCALAR_TAGS.contains(&name) => {
                Err(wrong_kind(raw, "scalar", "mapping"))
            }
            TagClass::Core(_) | TagClass::Unknown => Err((
                raw.pos,
                YamlErrorKind::UnknownTag {
                    tag: tag.to_owned(),
                },
            )),
        }
    }

    fn dict(&mut self, pairs: &[(Rc<Raw>, Rc<Raw>)], depth: usize) -> Result<Dict, Fail> {
        check_duplicates(pairs)?;
        let flat = self.flatten(pairs, depth)?;
        let mut dict = Dict::with_capacity(flat.len());
        // Python dict semantics: `1`, `1.0` and `true` are one key; the first spelling is kept.
        let mut first_spelling: HashMap<Key, Key> = HashMap::new();
        for (k, v) in &flat {
            let key = self.key(k, depth + 1)?;
            let value = self.value(v, depth + 1)?;
            let key = match key.python_canonical() {
                Some(canon) => first_spelling.entry(canon).or_insert(key).clone(),
                None => key,
            };
            dict.insert(key, value);
        }
        Ok(dict)
    }

    /// PyYAML's `flatten_mapping`: merge keys (`<<: map` or `<<: [maps]`) are replaced by the pairs they
    /// bring, placed before the mapping's own pairs; with a list, earlier maps win.
    fn flatten(&mut self, pairs: &[(Rc<Raw>, Rc<Raw>)], depth: usize) -> Result<Pairs, Fail> {
        let mut merged: Pairs = Vec::new();
        let mut own: Pairs = Vec::new();
        for (k, v) in pairs {
            if !is_merge_key(k) {
                own.push((Rc::clone(k), Rc::clone(v)));
                continue;
            }
            if depth > MAX_DEPTH {
                return Err((v.pos, YamlErrorKind::TooDeep { limit: MAX_DEPTH }));
            }
            match &v.kind {
                RawKind::Map(sub) => merged.extend(self.flatten(sub, depth + 1)?),
                RawKind::Seq(items) => {
                    let mut subs = Vec::with_capacity(items.len());
                    for item in items {
                        match &item.kind {
                            RawKind::Map(sub) => subs.push(self.flatten(sub, depth + 1)?),
                            _ => return Err((item.pos, YamlErrorKind::BadMerge)),
                        }
                    }
                    for sub in subs.into_iter().rev() {
                        merged.extend(sub);
                    }
                }
                RawKind::Scalar { .. } => return Err((v.pos, YamlErrorKind::BadMerge)),
            }
            self.spend(v.pos, merged.len())?;
        }
        merged.extend(own);
        Ok(merged)
    }

    fn key(&mut self, raw: &Raw, depth: usize) -> Result<Key, Fail> {
        if let RawKind::Scalar { text, style } = &raw.kind {
            // PyYAML turns a `=` key ("value" tag) into a plain string key.
            if scalar_is(raw.tag.as_deref(), text, *style, "value", Implicit::Value) {
                return Ok(Key::from(text.clone()));
            }
        }
        let node = self.node(raw, depth)?;
        let fail = |kind| Err((raw.pos, kind));
        match node.value {
            // A null key: PyYAML accepts it; OmegaConf refuses it once the whole document is built (see
            // reject_null_keys).
            Value::Scalar(s) => Ok(Key(s)),
            Value::List(_) => fail(YamlErrorKind::UnhashableKey { type_name: "list" }),
            Value::Dict(_) => fail(YamlErrorKind::UnhashableKey { type_name: "dict" }),
            Value::Missing => Ok(Key::from("???".to_owned())),
        }
    }
}

fn wrong_kind(raw: &Raw, expected: &'static str, found: &'static str) -> Fail {
    (
        raw.pos,
        YamlErrorKind::WrongNodeKind {
            tag: raw.tag.clone().unwrap_or_default(),
            expected,
            found,
        },
    )
}

/// A scalar's value from its tag, style and text.
fn scalar_value(raw: &Raw, text: &str, style: ScalarStyle) -> Result<Value, YamlErrorKind> {
    let tag = raw.tag.as_deref();
    let name = match classify(tag) {
        TagClass::Untagged if style == ScalarStyle::Plain || tag == Some("!") => {
            implicit_name(scalar::resolve_plain(text))
        }
        TagClass::Untagged => "str",
        TagClass::Core(name) => name,
        TagClass::Unknown => "",
    };
    let full_tag = || tag.map_or_else(|| format!("{CORE}{name}"), str::to_owned);
    let bad = |e: ScalarError| match e {
        ScalarError::Invalid => YamlErrorKind::BadScalar {
            tag: full_tag(),
            text: text.to_owned(),
        },
    };
    match name {
        "str" => Ok(Value::str(text.to_owned())),
        "null" => Ok(Value::NULL),
        "bool" => scalar::construct_bool(text).map(Value::bool).map_err(bad),
        "int" => scalar::construct_int(text).map_err(bad),
        "float" => scalar::construct_float(text).map(Value::float).map_err(bad),
        "binary" => scalar::construct_binary(text)
            .map(|b| Value::Scalar(Scalar::Bytes(b)))
            .map_err(bad),
        // PyYAML builds a date, which OmegaConf then refuses.
        "timestamp" => Err(YamlErrorKind::UnsupportedValue { type_name: "date" }),
        "map" | "omap" | "pairs" | "set" | "seq" => Err(YamlErrorKind::WrongNodeKind {
            tag: full_tag(),
            expected: if matches!(name, "map" | "set") {
                "mapping"
            } else {
                "sequence"
            },
            found: "scalar",
        }),
        _ => Err(YamlErrorKind::UnknownTag { tag: full_tag() }),
    }
}

/// The core tag name an implicit resolution stands for (`merge`/`value` have no constructor).
fn implicit_name(implicit: Implicit) -> &'static str {
    match implicit {
        Implicit::Null => "null",
        Implicit::Bool(_) => "bool",
        Implicit::Int => "int",
        Implicit::Float => "float",
        Implicit::Merge => "merge",
        Implicit::Value => "value",
        Implicit::Str => "str",
    }
}

/// The scalar carries core tag `name`, explicitly or by implicit resolution to `implicit`.
fn scalar_is(
    tag: Option<&str>,
    text: &str,
    style: ScalarStyle,
    name: &str,
    implicit: Implicit,
) -> bool {
    match classify(tag) {
        TagClass::Untagged if style == ScalarStyle::Plain || tag == Some("!") => {
            scalar::resolve_plain(text) == implicit
        }
        TagClass::Untagged => implicit == Implicit::Str,
        TagClass::Core(n) => n == name,
        TagClass::Unknown => false,
    }
}

fn is_merge_key(raw: &Raw) -> bool {
    match &raw.kind {
        RawKind::Scalar { text, style } => {
            scalar_is(raw.tag.as_deref(), text, *style, "merge", Implicit::Merge)
        }
        _ => matches!(classify(raw.tag.as_deref()), TagClass::Core("merge")),
    }
}

/// OmegaConf's loader rejects a mapping whose string keys (as written) repeat; non-string keys and
/// keys brought by `<<` are not checked, as there.
fn check_duplicates(pairs: &[(Rc<Raw>, Rc<Raw>)]) -> Result<(), Fail> {
    let mut seen: HashSet<&str> = HashSet::new();
    for (k, _) in pairs {
        if let RawKind::Scalar { text, style } = &k.kind
            && scalar_is(k.tag.as_deref(), text, *style, "str", Implicit::Str)
            && !seen.insert(text)
        {
            return Err((k.pos, YamlErrorKind::DuplicateKey { key: text.clone() }));
        }
    }
    Ok(())
}

/// OmegaConf refuses `None` keys when it creates the config from PyYAML's finished document, so a
/// null key that a later duplicate replaced away is no error. Reported at the key's value.
pub(super) fn reject_null_keys(node: &Node) -> Result<(), Fail> {
    match &node.value {
        Value::List(items) => items.iter().try_for_each(reject_null_keys),
        Value::Dict(dict) => dict.iter().try_for_each(|(key, value)| {
            if *key == Key(Scalar::None) {
                let pos = match &value.origin {
                    Some(Origin::File { line, col, .. }) => Pos {
                        line: *line,
                        col: *col,
                    },
                    _ => Pos { line: 1, col: 1 },
                };
                return Err((
                    pos,
                    YamlErrorKind::KeyType {
                        type_name: "NoneType",
                    },
                ));
            }
            reject_null_keys(value)
        }),
        _ => Ok(()),
    }
}
