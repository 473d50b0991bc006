//! The ordered config tree (OmegaConf's DictConfig/ListConfig) that every stage of composition works on.
//!
//! A [`Node`] is a value plus where it came from ([`Origin`]), so errors can name `file:line:col`.
//! Dicts keep insertion order ([`indexmap::IndexMap`]) and may have non-string keys, as OmegaConf allows.
//! Strings are stored raw: a string containing `${...}` is an interpolation and is only resolved by
//! `config::interpolate`. `???` is [`Value::Missing`]. Leaves are Python
//! scalars ([`Scalar`]), with Python's rules written once in [`crate::scalar`].

use std::fmt;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use indexmap::IndexMap;

use crate::scalar::{Scalar, float_to_exact_int};

/// Where a node was read from: a YAML file position, or a command-line override.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    /// `line` and `col` are 1-based.
    File { file: Arc<str>, line: u32, col: u32 },
    /// The override as the user typed it.
    Override(Arc<str>),
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Origin::File { file, line, col } => write!(f, "{file}:{line}:{col}"),
            Origin::Override(text) => write!(f, "override '{text}'"),
        }
    }
}

/// A dict key: a Python scalar (OmegaConf allows str, int, float, bool and None keys: YAML `1: a`,
/// `true: b`, `null: c`; and `bytes` from `!!binary`). Keys are equal and hash by their exact value (a
/// float by its bits), so `1` and `1.0` are two keys of the tree; [`Key::python_canonical`] gives
/// Python's `==` for building dicts the way Python does.
#[derive(Debug, Clone)]
pub struct Key(pub Scalar);

impl Key {
    pub fn int(i: i64) -> Key {
        Key(Scalar::Int(i))
    }

    pub fn float(v: f64) -> Key {
        Key(Scalar::Float(v))
    }

    pub fn scalar(&self) -> &Scalar {
        &self.0
    }

    pub fn as_str(&self) -> Option<&str> {
        self.0.as_str()
    }

    /// The one key that every key equal to this one under Python's `==` shares (`true`, `1` and `1.0` are
    /// all `1`; `1e20` is `10**20`; `-0.0` is `0`), so a Python dict can be built by hashing it; `None`
    /// for NaN, which equals nothing.
    pub fn python_canonical(&self) -> Option<Key> {
        match &self.0 {
            Scalar::Bool(b) => Some(Key::int(i64::from(*b))),
            Scalar::Float(f) if f.is_nan() => None,
            Scalar::Float(f) => match float_to_exact_int(*f) {
                Some(i) => Some(Key(Scalar::int(i))),
                None => Some(self.clone()),
            },
            _ => Some(self.clone()),
        }
    }
}

impl PartialEq for Key {
    fn eq(&self, other: &Key) -> bool {
        match (&self.0, &other.0) {
            (Scalar::Float(a), Scalar::Float(b)) => a.to_bits() == b.to_bits(),
            (a, b) => a == b,
        }
    }
}

impl Eq for Key {}

impl Hash for Key {
    fn hash<H: Hasher>(&self, state: &mut H) {
        std::mem::discriminant(&self.0).hash(state);
        match &self.0 {
            Scalar::None => {}
            Scalar::Bool(b) => b.hash(state),
            Scalar::Int(i) => i.hash(state),
            Scalar::BigInt(i) => i.hash(state),
            Scalar::Float(f) => f.to_bits().hash(state),
            Scalar::Str(s) => s.hash(state),
            Scalar::Bytes(b) => b.hash(state),
        }
    }
}

impl From<&str> for Key {
    fn from(s: &str) -> Key {
        Key::from(s.to_owned())
    }
}

impl From<String> for Key {
    fn from(s: String) -> Key {
        Key(Scalar::Str(s))
    }
}

impl fmt::Display for Key {
    /// The key as OmegaConf prints it in a dotted path (`a.1.true`): Python's `str()`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            Scalar::Str(s) => f.write_str(s),
            other => f.write_str(&other.repr()),
        }
    }
}

/// An ordered mapping, as OmegaConf's DictConfig.
pub type Dict = IndexMap<Key, Node>;

/// A config value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// A leaf; a string containing `${` is (or contains) an interpolation.
    Scalar(Scalar),
    /// `???`: mandatory value not yet set.
    Missing,
    List(Vec<Node>),
    Dict(Dict),
}

impl From<Scalar> for Value {
    fn from(s: Scalar) -> Value {
        Value::Scalar(s)
    }
}

/// A value and its provenance.
#[derive(Debug, Clone, PartialEq)]
pub struct Node {
    pub value: Value,
    pub origin: Option<Origin>,
}

impl Node {
    pub fn new(value: Value) -> Node {
        Node {
            value,
            origin: None,
        }
    }

    pub fn with_origin(value: Value, origin: Option<Origin>) -> Node {
        Node { value, origin }
    }

    /// The plain-data view of a resolved tree that workers outside Rust read (Python workers get it as a
    /// dict): keys as their Python `str()`, big ints and `!!binary` as strings (decimal digits, base64),
    /// non-finite floats and `???` as null (JSON has neither).
    pub fn to_json(&self) -> serde_json::Value {
        use base64::Engine as _;
        use serde_json::Value as J;
        match &self.value {
            Value::Scalar(Scalar::None) | Value::Missing => J::Null,
            Value::Scalar(Scalar::Bool(b)) => J::Bool(*b),
            Value::Scalar(Scalar::Int(i)) => J::from(*i),
            Value::Scalar(Scalar::BigInt(i)) => J::String(i.to_string()),
            Value::Scalar(Scalar::Float(f)) => {
                serde_json::Number::from_f64(*f).map_or(J::Null, J::Number)
            }
            Value::Scalar(Scalar::Str(s)) => J::String(s.clone()),
            Value::Scalar(Scalar::Bytes(b)) => {
                J::String(base64::engine::general_purpose::STANDARD.encode(b))
            }
            Value::List(items) => J::Array(items.iter().map(Node::to_json).collect()),
            Value::Dict(d) => J::Object(
                d.iter()
                    .map(|(k, v)| (k.to_string(), v.to_json()))
                    .collect(),
            ),
        }
    }

    pub fn empty_dict() -> Node {
        Node::new(Value::Dict(Dict::new()))
    }

    pub fn str(s: impl Into<String>) -> Node {
        Node::new(Value::str(s))
    }

    pub fn as_dict(&self) -> Option<&Dict> {
        match &self.value {
            Value::Dict(d) => Some(d),
            _ => None,
        }
    }

    pub fn as_dict_mut(&mut self) -> Option<&mut Dict> {
        match &mut self.value {
            Value::Dict(d) => Some(d),
            _ => None,
        }
    }

    pub fn as_list(&self) -> Option<&[Node]> {
        match &self.value {
            Value::List(l) => Some(l),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        self.value.as_str()
    }

    /// Child of a dict by string key.
    pub fn get(&self, key: &str) -> Option<&Node> {
        self.as_dict().and_then(|d| d.get(&Key::from(key)))
    }

    /// Follow a dotted path of string keys / list indices (`a.b.0.c`). No interpolation is resolved.
    pub fn get_path(&self, dotted: &str) -> Option<&Node> {
        if dotted.is_empty() {
            return Some(self);
        }
        let mut cur = self;
        for part in dotted.split('.') {
            cur = match &cur.value {
                Value::Dict(d) => d.get(&Key::from(part))?,
                Value::List(l) => l.get(part.parse::<usize>().ok()?)?,
                _ => return None,
            };
        }
        Some(cur)
    }
}

impl Value {
    /// Python's `None`.
    pub const NULL: Value = Value::Scalar(Scalar::None);

    pub fn bool(b: bool) -> Value {
        Value::Scalar(Scalar::Bool(b))
    }

    pub fn int(i: i64) -> Value {
        Value::Scalar(Scalar::Int(i))
    }

    pub fn float(f: f64) -> Value {
        Value::Scalar(Scalar::Float(f))
    }

    pub fn str(s: impl Into<String>) -> Value {
        Value::Scalar(Scalar::Str(s.into()))
    }

    /// The scalar of a leaf; `None` for `???` and containers.
    pub fn as_scalar(&self) -> Option<&Scalar> {
        match self {
            Value::Scalar(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        self.as_scalar().and_then(Scalar::as_str)
    }

    pub fn is_null(&self) -> bool {
        matches!(self, Value::Scalar(Scalar::None))
    }

    /// Python's `type(x).__name__` of the value OmegaConf holds (`missing` for `???`).
    pub fn type_name(&self) -> &'static str {
        match self {
            Value::Scalar(s) => s.type_name(),
            Value::Missing => "missing",
            Value::List(_) => "list",
            Value::Dict(_) => "dict",
        }
    }

    /// True for dicts and lists (OmegaConf "containers").
    pub fn is_container(&self) -> bool {
        matches!(self, Value::List(_) | Value::Dict(_))
    }

    /// Python's `repr()` of the value as OmegaConf holds it (a container prints as its content, `???` as
    /// the string `'???'`, also in `str()`).
    pub fn python_repr(&self) -> String {
        match self {
            Value::Scalar(s) => s.repr(),
            Value::Missing => crate::scalar::python_repr_str("???"),
            Value::List(items) => format!(
                "[{}]",
                items
                    .iter()
                    .map(|n| n.value.python_repr())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            Value::Dict(d) => {
                let items: Vec<String> = d
                    .iter()
                    .map(|(k, v)| format!("{}: {}", k.0.repr(), v.value.python_repr()))
                    .collect();
                format!("{{{}}}", items.join(", "))
            }
        }
    }

    /// Python's `str()` of the value, as Hydra's messages show values.
    pub fn python_str(&self) -> String {
        match self {
            Value::Scalar(Scalar::Str(s)) => s.clone(),
            other => other.python_repr(),
        }
    }

    /// A leaf as the Python object OmegaConf hands out (`???` is the string `'???'`); `None` for
    /// containers.
    pub fn to_py_scalar(&self) -> Option<Scalar> {
        match self {
            Value::Scalar(s) => Some(s.clone()),
            Value::Missing => Some(Scalar::Str("???".into())),
            Value::List(_) | Value::Dict(_) => None,
        }
    }
}

pub use crate::scalar::{python_float_repr, python_repr_str};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_str_of_values() {
        let list = Value::List(vec![
            Node::new(Value::int(1)),
            Node::str("a"),
            Node::new(Value::NULL),
        ]);
        assert_eq!(list.python_str(), "[1, 'a', None]");
        assert_eq!(Value::bool(true).python_str(), "True");
        assert_eq!(Value::str("x").python_str(), "x");
        assert_eq!(Value::Missing.python_str(), "'???'");
        assert_eq!(Value::Missing.python_repr(), "'???'");
        let mut dict = Dict::new();
        dict.insert(Key::int(1), Node::str("it's"));
        dict.insert(
            Key::from("b"),
            Node::new(Value::Scalar(Scalar::Bytes(vec![0]))),
        );
        dict.insert(Key(Scalar::None), Node::new(Value::float(1e-7)));
        assert_eq!(
            Value::Dict(dict).python_str(),
            r#"{1: "it's", 'b': b'\x00', None: 1e-07}"#
        );
    }

    #[test]
    fn keys_are_exact_and_python_canonical_follows_python_equality() {
        use std::collections::HashSet;
        let keys = [
            Key::int(1),
            Key::float(1.0),
            Key(Scalar::Bool(true)),
            Key::float(0.0),
            Key::float(-0.0),
            Key::from("1"),
        ];
        // Exact: six different keys of the tree.
        assert_eq!(keys.iter().collect::<HashSet<_>>().len(), 6);
        let canonical: HashSet<Key> = keys.iter().filter_map(Key::python_canonical).collect();
        assert_eq!(
            canonical,
            HashSet::from([Key::int(1), Key::int(0), Key::from("1")])
        );
        let big = Key::float(1e20).python_canonical();
        assert_eq!(
            big.map(|k| k.to_string()).as_deref(),
            Some("100000000000000000000")
        );
        assert_eq!(Key::float(f64::NAN).python_canonical(), None);
        assert_eq!(Key::float(1.5).python_canonical(), Some(Key::float(1.5)));
        assert_eq!(Key(Scalar::Bool(false)).to_string(), "False");
        assert_eq!(Key(Scalar::Bytes(b"hi".to_vec())).to_string(), "b'hi'");
        assert_eq!(Key::float(1e-5).to_string(), "1e-05");
    }

    #[test]
    fn get_path_walks_dicts_and_lists() {
        let mut inner = Dict::new();
        inner.insert(Key::from("c"), Node::new(Value::int(3)));
        let list = Node::new(Value::List(vec![Node::new(Value::Dict(inner))]));
        let mut root = Dict::new();
        root.insert(Key::from("a"), list);
        let root = Node::new(Value::Dict(root));
        assert_eq!(
            root.get_path("a.0.c").map(|n| &n.value),
            Some(&Value::int(3))
        );
        assert!(root.get_path("a.1.c").is_none());
        assert!(root.get_path("a.x").is_none());
    }
}
