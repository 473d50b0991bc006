//! Turn saphyr's event stream into a graph of raw YAML nodes (PyYAML's "composer"): anchors resolved,
//! aliases shared, tags and source positions kept, nothing typed yet.

use std::borrow::Cow;
use std::collections::{HashMap, HashSet};
use std::rc::Rc;

use saphyr_parser::{Event, Parser, ScalarStyle, Tag};

use super::{MAX_DEPTH, Pos, YamlErrorKind as Invalid};

/// One YAML node before typing. Aliases are shared `Rc`s of the anchored node.
#[derive(Debug)]
pub(super) struct Raw {
    pub kind: RawKind,
    /// The full tag (`tag:yaml.org,2002:int`, `!custom`, or `!` for the non-specific tag), if any.
    pub tag: Option<String>,
    pub pos: Pos,
}

#[derive(Debug)]
pub(super) enum RawKind {
    Scalar { text: String, style: ScalarStyle },
    Seq(Vec<Rc<Raw>>),
    Map(Vec<(Rc<Raw>, Rc<Raw>)>),
}

/// A collection being read: its anchor id (0 = none), tag, position and children so far.
struct Open {
    anchor: usize,
    tag: Option<String>,
    pos: Pos,
    body: OpenBody,
}

enum OpenBody {
    Seq(Vec<Rc<Raw>>),
    Map { pairs: Vec<(Rc<Raw>, Rc<Raw>)>, key: Option<Rc<Raw>> },
}

/// Read the single document of `text`. `Ok(None)` for a stream without any document.
pub(super) fn compose(text: &str) -> Result<Option<Rc<Raw>>, (Pos, Invalid)> {
    let text = prepare(text)?;
    let mut parser = Parser::new_from_str(&text);
    let mut anchors: HashMap<usize, Rc<Raw>> = HashMap::new();
    let mut open_anchors: HashSet<usize> = HashSet::new();
    let mut stack: Vec<Open> = Vec::new();
    let mut root: Option<Rc<Raw>> = None;
    let mut documents = 0usize;
    while let Some(next) = parser.next_event() {
        let (event, span) = next.map_err(|e| {
            let m = e.marker();
            (Pos::from_marker(m.line(), m.col()), Invalid::Syntax { message: e.info().to_owned() })
        })?;
        let pos = Pos::from_marker(span.start.line(), span.start.col());
        let done: Rc<Raw> = match event {
            Event::StreamEnd => break,
            Event::DocumentStart(_) => {
                documents += 1;
                if documents > 1 {
                    return Err((pos, Invalid::MultipleDocuments));
                }
                continue;
            }
            Event::Nothing | Event::StreamStart | Event::DocumentEnd => continue,
            Event::Alias(id) => {
                if open_anchors.contains(&id) {
                    return Err((pos, Invalid::RecursiveAlias));
                }
                match anchors.get(&id) {
                    Some(node) => Rc::clone(node),
                    None => return Err((pos, Invalid::Syntax { message: "found undefined alias".into() })),
                }
            }
            Event::Scalar(text, style, anchor, tag) => {
                let node = Rc::new(Raw {
                    kind: RawKind::Scalar { text: text.into_owned(), style },
                    tag: tag.as_deref().map(full_tag),
                    pos,
                });
                if anchor != 0 {
                    anchors.insert(anchor, Rc::clone(&node));
                }
                node
            }
            Event::SequenceStart(anchor, tag) => {
                open(&mut stack, &mut open_anchors, anchor, tag.as_deref().map(full_tag), pos, OpenBody::Seq(Vec::new()))?;
                continue;
            }
            Event::MappingStart(anchor, tag) => {
                let body = OpenBody::Map { pairs: Vec::new(), key: None };
                open(&mut stack, &mut open_anchors, anchor, tag.as_deref().map(full_tag), pos, body)?;
                continue;
            }
            Event::SequenceEnd | Event::MappingEnd => {
                let Some(open) = stack.pop() else {
                    return Err((pos, Invalid::Syntax { message: "unbalanced collection end".into() }));
                };
                let kind = match open.body {
                    OpenBody::Seq(items) => RawKind::Seq(items),
                    OpenBody::Map { pairs, key: None } => RawKind::Map(pairs),
                    OpenBody::Map { key: Some(_), .. } => {
                        return Err((pos, Invalid::Syntax { message: "mapping key without a value".into() }));
                    }
                };
                let node = Rc::new(Raw { kind, tag: open.tag, pos: open.pos });
                if open.anchor != 0 {
                    open_anchors.remove(&open.anchor);
                    anchors.insert(open.anchor, Rc::clone(&node));
                }
                node
            }
        };
        match stack.last_mut() {
            None => root = Some(done),
            Some(Open { body: OpenBody::Seq(items), .. }) => items.push(done),
            Some(Open { body: OpenBody::Map { pairs, key }, .. }) => match key.take() {
                None => *key = Some(done),
                Some(k) => pairs.push((k, done)),
            },
        }
    }
    Ok(root)
}

/// Start reading a collection.
fn open(
    stack: &mut Vec<Open>,
    open_anchors: &mut HashSet<usize>,
    anchor: usize,
    tag: Option<String>,
    pos: Pos,
    body: OpenBody,
) -> Result<(), (Pos, Invalid)> {
    if stack.len() >= MAX_DEPTH {
        return Err((pos, Invalid::TooDeep { limit: MAX_DEPTH }));
    }
    if anchor != 0 {
        open_anchors.insert(anchor);
    }
    stack.push(Open { anchor, tag, pos, body });
    Ok(())
}

/// saphyr splits tags into handle and suffix, with `!` alone as handle "" + suffix "!".
fn full_tag(tag: &Tag) -> String {
    if tag.handle == "!" { format!("!{}", tag.suffix) } else { format!("{}{}", tag.handle, tag.suffix) }
}

/// What PyYAML's reader does before scanning: reject characters outside its printable set, and treat
/// NEL (U+0085) as a line break (saphyr, a YAML 1.2 parser, would not). U+2028/U+2029 are line breaks
/// to PyYAML that it keeps in scalar content; saphyr cannot reproduce that, so they are refused.
fn prepare(text: &str) -> Result<Cow<'_, str>, (Pos, Invalid)> {
    let mut line = 1u32;
    let mut col = 1u32;
    for ch in text.chars() {
        let printable = matches!(ch, '\t' | '\n' | '\r' | ' '..='~' | '\u{85}' | '\u{A0}'..='\u{D7FF}' | '\u{E000}'..='\u{FFFD}')
            || ch >= '\u{10000}';
        if !printable {
            return Err((Pos { line, col }, Invalid::NonPrintable { ch }));
        }
        if matches!(ch, '\u{2028}' | '\u{2029}') {
            return Err((Pos { line, col }, Invalid::LineSeparator { ch }));
        }
        if ch == '\n' || ch == '\u{85}' {
            line = line.saturating_add(1);
            col = 1;
        } else {
            col = col.saturating_add(1);
        }
    }
    Ok(if text.contains('\u{85}') { Cow::Owned(text.replace('\u{85}', "\n")) } else { Cow::Borrowed(text) })
}
