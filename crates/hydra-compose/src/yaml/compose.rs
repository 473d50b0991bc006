//! Turn saphyr's event stream into a graph of raw YAML nodes (PyYAML's "composer"): anchors resolved,
//! aliases shared, tags and source positions kept, nothing typed yet.

use std::borrow::Cow;
use std::collections::{HashMap, HashSet};
use std::rc::Rc;

use saphyr_parser::{Event, Parser, ScalarStyle, Tag};

use super::reindent::{LineShifts, Repair, reindent, starts_flow_collection};
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
    /// Start line and column in the text as parsed (after any re-indenting), for indentation repairs.
    raw_line: usize,
    raw_col: usize,
    body: OpenBody,
}

enum OpenBody {
    Seq(Vec<Rc<Raw>>),
    Map {
        pairs: Vec<(Rc<Raw>, Rc<Raw>)>,
        key: Option<Rc<Raw>>,
    },
}

/// Read the single document of `text`. `Ok(None)` for a stream without any document.
pub(super) fn compose(text: &str) -> Result<Option<Rc<Raw>>, (Pos, Invalid)> {
    let mut text = prepare(text)?;
    let mut shifts = LineShifts::default();
    let mut last_repair = None;
    for _ in 0..MAX_REPAIRS {
        let (failure, repair) = match read(&text, &shifts) {
            Ok(root) => return Ok(root),
            Err(Stop::Fail(failure)) => return Err(failure),
            Err(Stop::Indentation { failure, repair }) => (failure, repair),
        };
        // The same repair twice means it did not help: report saphyr's error.
        if last_repair == Some(repair) {
            return Err(failure);
        }
        match reindent(&text, repair, &mut shifts) {
            Some(fixed) => text = Cow::Owned(fixed),
            None => return Err(failure),
        }
        last_repair = Some(repair);
    }
    Err((
        Pos { line: 1, col: 1 },
        Invalid::Syntax {
            message: "too many under-indented lines".into(),
        },
    ))
}

/// At most this many lines are re-indented (each costs a re-parse).
const MAX_REPAIRS: usize = 256;

/// Why reading stopped.
enum Stop {
    Fail((Pos, Invalid)),
    /// saphyr (YAML 1.2) wants continuation lines of flow collections and quoted scalars indented
    /// deeper than the enclosing block; PyYAML does not care. Such lines can be indented and re-read:
    /// leading whitespace there carries no meaning in either YAML version.
    Indentation {
        failure: (Pos, Invalid),
        repair: Repair,
    },
}

impl From<(Pos, Invalid)> for Stop {
    fn from(failure: (Pos, Invalid)) -> Stop {
        Stop::Fail(failure)
    }
}

/// Read the events of `text` into the raw graph.
fn read(text: &str, shifts: &LineShifts) -> Result<Option<Rc<Raw>>, Stop> {
    let mut parser = Parser::new_from_str(text);
    let mut anchors: HashMap<usize, Rc<Raw>> = HashMap::new();
    let mut open_anchors: HashSet<usize> = HashSet::new();
    let mut stack: Vec<Open> = Vec::new();
    let mut root: Option<Rc<Raw>> = None;
    let mut documents = 0usize;
    while let Some(next) = parser.next_event() {
        let (event, span) = match next {
            Ok(ok) => ok,
            Err(e) => {
                let m = e.marker();
                let failure = (
                    shifts.pos(m.line(), m.col()),
                    Invalid::Syntax {
                        message: e.info().to_owned(),
                    },
                );
                let repair = match e.info() {
                    "invalid indentation in quoted scalar" => Some(Repair::Quoted {
                        line: m.line(),
                        col: m.col(),
                    }),
                    // The innermost open collection starts at or right of the enclosing block's
                    // indentation, so one column past it is always deep enough.
                    "invalid indentation in flow construct" => {
                        let target = stack.last().map_or(1, |open| open.raw_col + 1);
                        Some(Repair::Flow {
                            line: m.line(),
                            target,
                        })
                    }
                    // Raised for any token left of the block indentation; only repaired when the
                    // token is inside a flow collection, where PyYAML ignores indentation.
                    "invalid indentation" => stack
                        .last()
                        .filter(|open| starts_flow_collection(text, open.raw_line, open.raw_col))
                        .map(|open| Repair::Flow {
                            line: m.line(),
                            target: open.raw_col + 1,
                        }),
                    _ => None,
                };
                return Err(match repair {
                    Some(repair) => Stop::Indentation { failure, repair },
                    None => Stop::Fail(failure),
                });
            }
        };
        let pos = shifts.pos(span.start.line(), span.start.col());
        let (raw_line, raw_col) = (span.start.line(), span.start.col());
        let is_sequence = matches!(event, Event::SequenceStart(..));
        let done: Rc<Raw> = match event {
            Event::StreamEnd => break,
            Event::DocumentStart(_) => {
                documents += 1;
                if documents > 1 {
                    return Err(Stop::Fail((pos, Invalid::MultipleDocuments)));
                }
                continue;
            }
            Event::Nothing | Event::StreamStart | Event::DocumentEnd => continue,
            Event::Alias(id) => {
                if open_anchors.contains(&id) {
                    return Err(Stop::Fail((pos, Invalid::RecursiveAlias)));
                }
                match anchors.get(&id) {
                    Some(node) => Rc::clone(node),
                    None => {
                        return Err(Stop::Fail((
                            pos,
                            Invalid::Syntax {
                                message: "found undefined alias".into(),
                            },
                        )));
                    }
                }
            }
            Event::Scalar(text, style, anchor, tag) => {
                let node = Rc::new(Raw {
                    kind: RawKind::Scalar {
                        text: text.into_owned(),
                        style,
                    },
                    tag: tag.as_deref().map(full_tag),
                    pos,
                });
                if anchor != 0 {
                    anchors.insert(anchor, Rc::clone(&node));
                }
                node
            }
            Event::SequenceStart(anchor, tag) | Event::MappingStart(anchor, tag) => {
                let body = if is_sequence {
                    OpenBody::Seq(Vec::new())
                } else {
                    OpenBody::Map {
                        pairs: Vec::new(),
                        key: None,
                    }
                };
                let tag = tag.as_deref().map(full_tag);
                open(
                    &mut stack,
                    &mut open_anchors,
                    Open {
                        anchor,
                        tag,
                        pos,
                        raw_line,
                        raw_col,
                        body,
                    },
                )?;
                continue;
            }
            Event::SequenceEnd | Event::MappingEnd => {
                let Some(open) = stack.pop() else {
                    return Err(Stop::Fail((
                        pos,
                        Invalid::Syntax {
                            message: "unbalanced collection end".into(),
                        },
                    )));
                };
                let kind = match open.body {
                    OpenBody::Seq(items) => RawKind::Seq(items),
                    OpenBody::Map { pairs, key: None } => RawKind::Map(pairs),
                    OpenBody::Map { key: Some(_), .. } => {
                        return Err(Stop::Fail((
                            pos,
                            Invalid::Syntax {
                                message: "mapping key without a value".into(),
                            },
                        )));
                    }
                };
                let node = Rc::new(Raw {
                    kind,
                    tag: open.tag,
                    pos: open.pos,
                });
                if open.anchor != 0 {
                    open_anchors.remove(&open.anchor);
                    anchors.insert(open.anchor, Rc::clone(&node));
                }
                node
            }
        };
        match stack.last_mut() {
            None => root = Some(done),
            Some(Open {
                body: OpenBody::Seq(items),
                ..
            }) => items.push(done),
            Some(Open {
                body: OpenBody::Map { pairs, key },
                ..
            }) => match key.take() {
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
    open: Open,
) -> Result<(), (Pos, Invalid)> {
    if stack.len() >= MAX_DEPTH {
        return Err((open.pos, Invalid::TooDeep { limit: MAX_DEPTH }));
    }
    if open.anchor != 0 {
        open_anchors.insert(open.anchor);
    }
    stack.push(open);
    Ok(())
}

/// saphyr splits tags into handle and suffix, with `!` alone as handle "" + suffix "!".
fn full_tag(tag: &Tag) -> String {
    if tag.handle == "!" {
        format!("!{}", tag.suffix)
    } else {
        format!("{}{}", tag.handle, tag.suffix)
    }
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
    Ok(if text.contains('\u{85}') {
        Cow::Owned(text.replace('\u{85}', "\n"))
    } else {
        Cow::Borrowed(text)
    })
}
