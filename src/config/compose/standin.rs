//! Temporary private stand-ins for the YAML loader/emitter and the override parser, used until the real
//! modules (branches h/yaml, h/overrides) are merged; each mirrors the documented signature, minimally.

pub mod yaml {
    use std::collections::HashMap;
    use std::sync::Arc;

    use saphyr_parser::{Event, Parser, ScalarStyle};

    use crate::config::node::{Dict, Key, Node, Origin, Value};

    #[derive(Debug, thiserror::Error)]
    #[error("{file}:{line}:{col}: {message}")]
    pub struct YamlError {
        pub file: String,
        pub line: usize,
        pub col: usize,
        pub message: String,
    }

    pub fn load_str(text: &str, file: &str) -> Result<Node, YamlError> {
        let file_arc: Arc<str> = Arc::from(file);
        let mut parser = Parser::new_from_str(text);
        let mut stack: Vec<(Node, Option<Key>)> = Vec::new();
        let mut anchors: HashMap<usize, Node> = HashMap::new();
        let mut anchor_stack: Vec<usize> = Vec::new();
        let mut root: Option<Node> = None;
        let err = |line: usize, col: usize, message: String| YamlError { file: file.to_owned(), line, col, message };
        loop {
            let Some(next) = parser.next() else { break };
            let (event, span) = next.map_err(|e| err(e.marker().line(), e.marker().col() + 1, e.info().to_owned()))?;
            let origin = Some(Origin::File { file: file_arc.clone(), line: span.start.line() as u32, col: span.start.col() as u32 + 1 });
            let value_node = match event {
                Event::Scalar(text, style, anchor, tag) => {
                    let value = if tag.is_some_and(|t| t.suffix == "str") || style != ScalarStyle::Plain {
                        Value::Str(text.into_owned())
                    } else {
                        type_plain(&text)
                    };
                    let node = Node::with_origin(value, origin);
                    if anchor > 0 {
                        anchors.insert(anchor, node.clone());
                    }
                    Some(node)
                }
                Event::Alias(id) => Some(anchors.get(&id).cloned().ok_or_else(|| err(span.start.line(), 0, "unknown alias".into()))?),
                Event::MappingStart(anchor, _) => {
                    stack.push((Node::with_origin(Value::Dict(Dict::new()), origin), None));
                    anchor_stack.push(anchor);
                    None
                }
                Event::SequenceStart(anchor, _) => {
                    stack.push((Node::with_origin(Value::List(Vec::new()), origin), None));
                    anchor_stack.push(anchor);
                    None
                }
                Event::MappingEnd | Event::SequenceEnd => {
                    let (node, _) = stack.pop().ok_or_else(|| err(0, 0, "unbalanced".into()))?;
                    let anchor = anchor_stack.pop().unwrap_or(0);
                    if anchor > 0 {
                        anchors.insert(anchor, node.clone());
                    }
                    Some(node)
                }
                _ => None,
            };
            let Some(node) = value_node else { continue };
            match stack.last_mut() {
                None => root = Some(node),
                Some((parent, pending_key)) => match &mut parent.value {
                    Value::List(items) => items.push(node),
                    Value::Dict(dict) => match pending_key.take() {
                        None => {
                            let key = match node.value {
                                Value::Str(s) => Key::Str(s),
                                Value::Int(i) => Key::Int(i),
                                Value::Bool(b) => Key::Bool(b),
                                Value::Null => Key::Null,
                                Value::Float(f) => Key::float(f),
                                _ => return Err(err(span.start.line(), 0, "unsupported key".into())),
                            };
                            *pending_key = Some(key);
                        }
                        Some(key) => {
                            if dict.contains_key(&key) {
                                return Err(err(span.start.line(), span.start.col() + 1, format!("duplicate key {key}")));
                            }
                            dict.insert(key, node);
                        }
                    },
                    _ => {}
                },
            }
        }
        Ok(match root {
            Some(Node { value: Value::Null, .. }) | None => Node::empty_dict(),
            Some(node) => node,
        })
    }

    fn type_plain(text: &str) -> Value {
        match text {
            "" | "~" | "null" | "Null" | "NULL" => return Value::Null,
            "true" | "True" | "TRUE" | "yes" | "Yes" | "YES" | "on" | "On" | "ON" => return Value::Bool(true),
            "false" | "False" | "FALSE" | "no" | "No" | "NO" | "off" | "Off" | "OFF" => return Value::Bool(false),
            "???" => return Value::Missing,
            ".inf" | ".Inf" | ".INF" | "+.inf" => return Value::Float(f64::INFINITY),
            "-.inf" | "-.Inf" | "-.INF" => return Value::Float(f64::NEG_INFINITY),
            ".nan" | ".NaN" | ".NAN" => return Value::Float(f64::NAN),
            _ => {}
        }
        let clean = text.replace('_', "");
        if clean.chars().enumerate().all(|(i, c)| c.is_ascii_digit() || (i == 0 && (c == '-' || c == '+')))
            && clean.chars().any(|c| c.is_ascii_digit())
        {
            if let Ok(i) = clean.parse::<i64>() {
                return Value::Int(i);
            }
        }
        if clean.chars().any(|c| c.is_ascii_digit())
            && clean.chars().all(|c| c.is_ascii_digit() || "+-.eE".contains(c))
            && (clean.contains('.') || clean.contains('e') || clean.contains('E'))
        {
            if let Ok(f) = clean.parse::<f64>() {
                return Value::Float(f);
            }
        }
        Value::Str(text.to_owned())
    }
}

pub mod emit {
    use crate::config::node::{Key, Node, Value};

    /// JSON is YAML; good enough until the real emitter lands.
    pub fn to_yaml(node: &Node) -> String {
        let mut out = serde_json::to_string_pretty(&to_json(node)).unwrap_or_default();
        out.push('\n');
        out
    }

    fn to_json(node: &Node) -> serde_json::Value {
        match &node.value {
            Value::Null => serde_json::Value::Null,
            Value::Bool(b) => (*b).into(),
            Value::Int(i) => (*i).into(),
            Value::Float(f) => serde_json::Number::from_f64(*f).map_or_else(|| serde_json::Value::String(f.to_string()), serde_json::Value::Number),
            Value::Str(s) => s.clone().into(),
            Value::Bytes(_) => serde_json::Value::Null,
            Value::Missing => "???".into(),
            Value::List(items) => items.iter().map(to_json).collect(),
            Value::Dict(d) => d
                .iter()
                .map(|(k, v)| {
                    let key = match k {
                        Key::Str(s) => s.clone(),
                        other => other.to_string(),
                    };
                    (key, to_json(v))
                })
                .collect::<serde_json::Map<_, _>>()
                .into(),
        }
    }
}

pub mod overrides {
    use crate::config::node::{Node, Origin, Value};

    #[derive(Debug, Clone, PartialEq)]
    pub enum OverrideKind {
        Change,
        Add,
        ForceAdd,
        Delete,
    }

    #[derive(Debug, Clone, PartialEq)]
    pub enum Element {
        Null,
        Bool(bool),
        Int(i64),
        Float(f64),
        Str { value: String, quoted: bool },
        List(Vec<Element>),
    }

    #[derive(Debug, Clone, PartialEq)]
    pub struct Sweep {
        pub items: Vec<Element>,
        pub simple: bool,
    }

    #[derive(Debug, Clone, PartialEq)]
    pub enum OverrideValue {
        Element(Element),
        Sweep(Sweep),
    }

    #[derive(Debug, Clone, PartialEq)]
    pub struct Override {
        pub kind: OverrideKind,
        pub key_or_group: String,
        pub package: Option<String>,
        pub value: Option<OverrideValue>,
        pub input: String,
    }

    #[derive(Debug, thiserror::Error)]
    #[error("Error parsing override '{input}'\n{message}\nSee https://hydra.cc/docs/1.2/advanced/override_grammar/basic for details")]
    pub struct OverrideError {
        pub input: String,
        pub message: String,
    }

    impl Element {
        pub fn to_node(&self, origin: Option<Origin>) -> Node {
            let value = match self {
                Element::Null => Value::Null,
                Element::Bool(b) => Value::Bool(*b),
                Element::Int(i) => Value::Int(*i),
                Element::Float(f) => Value::Float(*f),
                Element::Str { value, .. } => Value::Str(value.clone()),
                Element::List(items) => Value::List(items.iter().map(|e| e.to_node(origin.clone())).collect()),
            };
            Node::with_origin(value, origin)
        }
    }

    fn element(text: &str) -> Element {
        let t = text.trim();
        if let Some(inner) = t.strip_prefix('[').and_then(|r| r.strip_suffix(']')) {
            if inner.trim().is_empty() {
                return Element::List(Vec::new());
            }
            return Element::List(inner.split(',').map(element).collect());
        }
        if t.len() >= 2 && (t.starts_with('\'') && t.ends_with('\'') || t.starts_with('"') && t.ends_with('"')) {
            return Element::Str { value: t[1..t.len() - 1].to_owned(), quoted: true };
        }
        match t.to_ascii_lowercase().as_str() {
            "null" => return Element::Null,
            "true" => return Element::Bool(true),
            "false" => return Element::Bool(false),
            _ => {}
        }
        if let Ok(i) = t.replace('_', "").parse::<i64>() {
            return Element::Int(i);
        }
        if t.contains(['.', 'e', 'E']) || matches!(t, "inf" | "-inf" | "nan") {
            if let Ok(f) = t.parse::<f64>() {
                return Element::Float(f);
            }
        }
        Element::Str { value: t.to_owned(), quoted: false }
    }

    pub fn parse_override(text: &str) -> Result<Override, OverrideError> {
        let (kind, rest) = if let Some(r) = text.strip_prefix("++") {
            (OverrideKind::ForceAdd, r)
        } else if let Some(r) = text.strip_prefix('+') {
            (OverrideKind::Add, r)
        } else if let Some(r) = text.strip_prefix('~') {
            (OverrideKind::Delete, r)
        } else {
            (OverrideKind::Change, text)
        };
        let (key, value) = match rest.split_once('=') {
            Some((k, v)) => (k, Some(v)),
            None if kind == OverrideKind::Delete => (rest, None),
            None => return Err(OverrideError { input: text.into(), message: "missing '='".into() }),
        };
        let (key_or_group, package) = match key.split_once('@') {
            Some((k, p)) => (k.to_owned(), Some(p.to_owned())),
            None => (key.to_owned(), None),
        };
        if key_or_group.is_empty() {
            return Err(OverrideError { input: text.into(), message: "empty key".into() });
        }
        let value = value.map(|v| {
            let depth_zero_comma = {
                let mut depth = 0i32;
                v.chars().any(|c| {
                    match c {
                        '[' | '{' | '(' => depth += 1,
                        ']' | '}' | ')' => depth -= 1,
                        ',' if depth == 0 => return true,
                        _ => {}
                    }
                    false
                })
            };
            if depth_zero_comma {
                OverrideValue::Sweep(Sweep { items: v.split(',').map(element).collect(), simple: true })
            } else if v.is_empty() {
                OverrideValue::Element(Element::Str { value: String::new(), quoted: false })
            } else {
                OverrideValue::Element(element(v))
            }
        });
        Ok(Override { kind, key_or_group, package, value, input: text.to_owned() })
    }
}
