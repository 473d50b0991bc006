//! A parsed override value (Hydra's `ParsedElementType`): its config node, its text, its Python rendering.

use std::sync::Arc;

use super::OverrideError;
use crate::node::{Dict, Key, Node, Origin, Value};
use crate::scalar::{Scalar, python_repr_str};

/// The quote a string was written with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Quote {
    Single,
    Double,
}

impl Quote {
    pub fn char(self) -> char {
        match self {
            Quote::Single => '\'',
            Quote::Double => '"',
        }
    }

    pub(super) fn python_name(self) -> &'static str {
        match self {
            Quote::Single => "single",
            Quote::Double => "double",
        }
    }
}

/// A value that is not a sweep: what `key=value` sets.
#[derive(Debug, Clone, PartialEq)]
pub enum Element {
    /// A scalar; a string here was written unquoted or made by a function such as `str()`.
    Scalar(Scalar),
    /// A string written `'...'` / `"..."` (already unescaped).
    Quoted(String, Quote),
    List(Vec<Element>),
    /// Keys as Hydra types them (`{1: a, true: b, x: c}`); duplicate keys are already merged the way a
    /// Python dict merges them.
    Dict(Vec<(Key, Element)>),
}

/// What a config group override selects: one option, or a list of options (`db=[a,b]`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GroupChoice {
    One(String),
    Many(Vec<String>),
}

impl Element {
    /// An unquoted string.
    pub fn str(s: impl Into<String>) -> Element {
        Element::Scalar(Scalar::Str(s.into()))
    }

    /// The config node OmegaConf builds from this value (strings stay raw; `???` is missing); every node
    /// of it gets `origin`.
    pub fn to_node(&self, origin: &Origin) -> Node {
        let value = match self {
            Element::Scalar(Scalar::Str(s)) | Element::Quoted(s, _) if s == "???" => Value::Missing,
            Element::Scalar(s) => Value::Scalar(s.clone()),
            Element::Quoted(s, _) => Value::str(s.clone()),
            Element::List(items) => Value::List(items.iter().map(|e| e.to_node(origin)).collect()),
            Element::Dict(pairs) => {
                let mut dict = Dict::with_capacity(pairs.len());
                for (k, v) in pairs {
                    dict.insert(k.clone(), v.to_node(origin));
                }
                Value::Dict(dict)
            }
        };
        Node::with_origin(value, Some(origin.clone()))
    }

    /// [`Element::to_node`] with the override itself as origin.
    pub fn to_node_from(&self, input: &str) -> Node {
        self.to_node(&Origin::Override(Arc::from(input)))
    }

    /// Python's type name of the value (`str`, `int`, `NoneType`, ...), as Hydra's messages print it.
    pub fn type_name(&self) -> &'static str {
        match self {
            Element::Scalar(s) => s.type_name(),
            Element::Quoted(..) => "str",
            Element::List(_) => "list",
            Element::Dict(_) => "dict",
        }
    }

    /// The text of a string, quoted or not.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Element::Scalar(Scalar::Str(s)) | Element::Quoted(s, _) => Some(s),
            _ => None,
        }
    }

    /// The option(s) a config group override selects (`db=mysql`), or Hydra's error for other values.
    pub fn group_choice(&self) -> Result<GroupChoice, OverrideError> {
        match self {
            Element::List(items) => Ok(GroupChoice::Many(
                items.iter().map(Element::python_str).collect(),
            )),
            other => match other.as_str() {
                Some(s) => Ok(GroupChoice::One(s.to_owned())),
                None => Err(OverrideError::GroupValueType {
                    type_name: other.type_name(),
                }),
            },
        }
    }

    /// Hydra's `Override._get_value_element_as_str`: the text that re-parses to this value. The sweeper
    /// builds each job's override as `key=<this>`, and Hydra records overrides in this form.
    pub fn to_override_text(&self) -> String {
        match self {
            Element::Scalar(Scalar::None) => "null".into(),
            Element::Scalar(Scalar::Str(s)) => escape_special_characters(s),
            Element::Scalar(s) => s.repr(),
            Element::Quoted(s, q) => with_quotes(s, *q),
            Element::List(items) => {
                format!(
                    "[{}]",
                    items
                        .iter()
                        .map(Element::to_override_text)
                        .collect::<Vec<_>>()
                        .join(",")
                )
            }
            Element::Dict(pairs) => {
                let inner: Vec<String> = pairs
                    .iter()
                    .map(|(k, v)| format!("{}:{}", key_override_text(k), v.to_override_text()))
                    .collect();
                format!("{{{}}}", inner.join(","))
            }
        }
    }

    /// Python's `str()` of the value Hydra hands to OmegaConf (used in messages such as
    /// `The value of 'a' is 1 and not <this>`).
    pub fn python_str(&self) -> String {
        match self.as_str() {
            Some(s) => s.to_owned(),
            None => self.python_repr(),
        }
    }

    /// Python's `repr()` of the value (quotes dropped from quoted strings, as `Override.value()` does).
    pub fn python_repr(&self) -> String {
        match self {
            Element::Scalar(s) => s.repr(),
            Element::Quoted(s, _) => python_repr_str(s),
            Element::List(items) => {
                format!(
                    "[{}]",
                    items
                        .iter()
                        .map(Element::python_repr)
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            }
            Element::Dict(pairs) => {
                let inner: Vec<String> = pairs
                    .iter()
                    .map(|(k, v)| format!("{}: {}", k.0.repr(), v.python_repr()))
                    .collect();
                format!("{{{}}}", inner.join(", "))
            }
        }
    }
}

fn key_override_text(k: &Key) -> String {
    match k {
        Key(Scalar::Str(s)) => escape_special_characters(s),
        Key(Scalar::None) => "null".into(),
        other => other.to_string(),
    }
}

/// Hydra's `escape_special_characters`: a backslash before each of `\()[]{}:=, \t`.
pub(super) fn escape_special_characters(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if "\\()[]{}:=, \t".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// Hydra's `QuotedString.with_quotes`: re-quote, escaping the quote and the backslashes before quotes.
fn with_quotes(text: &str, quote: Quote) -> String {
    let qc = quote.char();
    let mut out = String::with_capacity(text.len() + 2);
    out.push(qc);
    // Backslashes right before a quote (or before the closing quote) are doubled; others stay as they are.
    let chars: Vec<char> = text.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        if chars[i] == '\\' {
            let run = chars[i..].iter().take_while(|c| **c == '\\').count();
            let next = chars.get(i + run).copied();
            let doubled = next.is_none() || next == Some(qc);
            let n = if doubled { run * 2 } else { run };
            out.extend(std::iter::repeat_n('\\', n));
            i += run;
        } else {
            if chars[i] == qc {
                out.push('\\');
            }
            out.push(chars[i]);
            i += 1;
        }
    }
    out.push(qc);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(value: &str, quote: Option<Quote>) -> Element {
        match quote {
            Some(q) => Element::Quoted(value.into(), q),
            None => Element::str(value),
        }
    }

    #[test]
    fn override_text_matches_hydra() {
        let cases = [
            (Element::Scalar(Scalar::None), "null"),
            (Element::Scalar(Scalar::Bool(true)), "True"),
            (Element::Scalar(Scalar::Float(1e-5)), "1e-05"),
            (s("a b,c", None), "a\\ b\\,c"),
            (s("a'b", Some(Quote::Single)), "'a\\'b'"),
            (s("a\\", Some(Quote::Single)), "'a\\\\'"),
            (s("a\\'b", Some(Quote::Single)), "'a\\\\\\'b'"),
            (s("a\\b", Some(Quote::Double)), "\"a\\b\""),
            (
                Element::List(vec![
                    Element::Scalar(Scalar::Int(1)),
                    s("x", Some(Quote::Double)),
                ]),
                "[1,\"x\"]",
            ),
            (
                Element::Dict(vec![
                    (Key::from("a"), Element::Scalar(Scalar::Int(1))),
                    (Key::int(2), Element::Scalar(Scalar::None)),
                ]),
                "{a:1,2:null}",
            ),
        ];
        for (element, want) in cases {
            assert_eq!(element.to_override_text(), want, "text of {element:?}");
        }
    }

    #[test]
    fn python_rendering() {
        let list = Element::List(vec![
            Element::Scalar(Scalar::Int(1)),
            s("a", Some(Quote::Double)),
            Element::Scalar(Scalar::Bool(false)),
        ]);
        assert_eq!(list.python_str(), "[1, 'a', False]");
        assert_eq!(s("abc", None).python_str(), "abc");
        assert_eq!(Element::Scalar(Scalar::None).python_str(), "None");
    }

    #[test]
    fn group_choice_requires_string_or_list() {
        assert_eq!(
            s("mysql", None).group_choice(),
            Ok(GroupChoice::One("mysql".into()))
        );
        let err = Element::Scalar(Scalar::Int(1))
            .group_choice()
            .map_err(|e| e.to_string());
        assert_eq!(
            err,
            Err("Config group override must be a string or a list. Got int".to_owned())
        );
    }

    #[test]
    fn triple_question_mark_is_missing() {
        let node = s("???", None).to_node_from("a=???");
        assert_eq!(node.value, Value::Missing);
        let node = Element::List(vec![Element::Scalar(Scalar::Float(1.5))]).to_node_from("a=[1.5]");
        assert_eq!(
            node.as_list().map(|l| l[0].value.clone()),
            Some(Value::float(1.5))
        );
    }
}
