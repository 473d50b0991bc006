//! The Hydra command-line override grammar, parsed into typed overrides and sweeps.
//!
//! [`parse_override`] follows Hydra 1.3's `OverrideLexer.g4` / `OverrideParser.g4` and its visitor: the
//! same tokens (two lexer modes, longest match), the same value typing (`1` int, `1.0` float, `'1'` str,
//! `true`/`TrUe` bool, `null`), the same escapes, and the same functions evaluated at parse time (`int()`,
//! `float()`, `str()`, `bool()`, `choice()`, `range()`, `interval()`, `tag()`, `sort()`, `shuffle()`,
//! `glob()`; Hydra 1.3 has no `json_str()`). Errors carry Hydra's wording, so the composer can print them
//! as they are.
//!
//! Sweeps (`a=1,2`, `choice(..)`, `range(..)`, ...) come out as [`OverrideValue::Sweep`]; a single run must
//! reject them with [`Override::validate_sweep`]. A multirun builds each job's overrides as Hydra's basic
//! sweeper does: `<key_element>=<Element::to_override_text()>` for each value of [`Sweep::expand`], and
//! [`Override::job_text`] for the other overrides; each job then parses its overrides again.

mod decimal;
mod diagnose;
mod element;
mod functions;
mod lexer;
mod parser;
mod sweep;
mod value;

use crate::scalar::Scalar;
use std::fmt;

pub use element::{Element, GroupChoice, Quote};
pub use sweep::{ChoiceSweep, GlobSweep, IntervalSweep, Number, RangeSweep, Sweep};

/// Hydra's hint line, printed after every grammar error.
pub const GRAMMAR_HINT: &str =
    "See https://hydra.cc/docs/1.2/advanced/override_grammar/basic for details";

/// One parsed command-line override (`[+|++|~]key[@package][=value]`).
#[derive(Debug, Clone, PartialEq)]
pub struct Override {
    pub kind: OverrideKind,
    /// The config key (`a.b.c`) or config group (`db`, `hydra/launcher`); may be empty (`@pkg=x`).
    pub key_or_group: String,
    /// `Some("")` for `group@=option` (the `_global_` package); `None` when there is no `@`.
    pub package: Option<String>,
    /// `None` only for a delete without `=` (`~key`). `key=` gives an empty unquoted string.
    pub value: Option<OverrideValue>,
    /// The override exactly as typed.
    pub input: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OverrideKind {
    /// `key=value`
    Change,
    /// `+key=value`
    Add,
    /// `++key=value`
    ForceAdd,
    /// `~key` or `~key=value`
    Delete,
}

/// The part after `=`.
#[derive(Debug, Clone, PartialEq)]
pub enum OverrideValue {
    Element(Element),
    Sweep(Sweep),
}

/// Whether the command line runs one job or sweeps (`--multirun` / `-m`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunMode {
    Run,
    Multirun,
}

/// Errors of the override grammar and of sweep handling, worded as Hydra words them.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum OverrideError {
    /// The override does not parse, or a function in it fails.
    #[error("{}\n{GRAMMAR_HINT}", .reason.render(.input))]
    Grammar { input: String, reason: GrammarError },
    /// A sweep nested in a list or dict (`a=[choice(1,2)]`): Hydra fails when it merges the value.
    #[error(
        "Error merging override {input}\nUnexpected type annotation: Set[str]\n    full_key: tags\n    object_type={sweep_type}"
    )]
    NestedSweep {
        input: String,
        sweep_type: &'static str,
    },
    /// A choice with a sweep among its items (`a=1,choice(2,3)`), which Hydra cannot enumerate either.
    #[error(
        "Unexpected type annotation: Set[str]\n    full_key: tags\n    object_type={sweep_type}"
    )]
    NestedSweepInChoice { sweep_type: &'static str },
    /// `a=1,2` without `--multirun`.
    #[error(
        "Ambiguous value for argument '{input}'\n1. To use it as a list, use key=[value1,value2]\n2. To use it as string, quote the value: key=\\'value1,value2\\'\n3. To sweep over it, add --multirun to your command line"
    )]
    AmbiguousSweep { input: String },
    /// Any other sweep without `--multirun`.
    #[error("Sweep parameters '{input}' requires --multirun")]
    SweepNeedsMultirun { input: String },
    /// A sweep over a `hydra.` / `hydra/` key in `--multirun`.
    #[error("Sweeping over Hydra's configuration is not supported : '{input}'")]
    HydraSweep { input: String },
    /// `interval()` cannot be enumerated by the basic sweeper.
    #[error("BasicSweeper does not support sweep type : INTERVAL_SWEEP")]
    IntervalNotEnumerable,
    /// `range(a,b,0)` over ints.
    #[error("range() arg 3 must not be zero")]
    ZeroIntRangeStep,
    /// `range(a,b,0.0)` over floats.
    #[error("Invalid range values (start:{start}, stop:{stop}, step:{step})")]
    ZeroFloatRangeStep {
        start: String,
        stop: String,
        step: String,
    },
    /// A float range over `inf`/`nan` bounds, which never ends (Hydra loops or fails in `decimal`).
    #[error("range over a non-finite bound cannot be enumerated: range({start}, {stop}, {step})")]
    NonFiniteRange {
        start: String,
        stop: String,
        step: String,
    },
    /// A range with more elements than a sweep can reasonably launch.
    #[error("range has more than {limit} values and cannot be enumerated")]
    RangeTooLong { limit: usize },
    /// A config group deletion with a value that is not a string (`~db=1`).
    #[error("Config group override deletion value must be a string : {input}")]
    GroupDeletionValueType { input: String },
    /// A config group override whose value is not a string or a list (`db=1`).
    #[error("Config group override must be a string or a list. Got {type_name}")]
    GroupValueType { type_name: &'static str },
}

/// Why an override did not parse: the line printed between Hydra's first line and its hint line.
#[derive(Debug, Clone, PartialEq)]
pub enum GrammarError {
    /// No token starts at `column` (0-based, in characters); printed with a caret like Hydra's.
    Lexer { column: usize },
    /// The parser met `found` where it expected `expected` (an input deeper than the parser allows).
    Syntax {
        found: String,
        expected: &'static str,
    },
    /// ANTLR's prediction found no alternative for `input` (quoted as ANTLR quotes it).
    NoViableAlt { input: String },
    /// ANTLR's input mismatch: `found` (quoted) where `expected` (ANTLR's token-set text) was due.
    Mismatched { found: String, expected: String },
    /// ANTLR's single-token deletion: `found` (quoted) is in the way of `expected`.
    Extraneous { found: String, expected: String },
    /// ANTLR's single-token insertion: `missing` is due before `at` (quoted).
    Missing { missing: String, at: String },
    /// A primitive made of whitespace only.
    AllWhitespace,
    /// `f(a=1, 2)`.
    PositionalAfterKeyword,
    /// A grammar function raised: `<exception> while evaluating '<call>': <message>`.
    Function {
        call: String,
        exception: &'static str,
        message: String,
    },
    /// An INT token that is not decimal digits (the lexer never makes one).
    BadInt { text: String },
}

impl GrammarError {
    /// The message for `input` as Hydra prints it: a lexer error repeats the input with a caret under the
    /// bad character; ANTLR's exceptions (no viable alternative, input mismatch) print alone; the errors
    /// ANTLR reports without an exception (extraneous or missing token) and the visitor's follow
    /// "Error parsing override '<input>'".
    pub fn render(&self, input: &str) -> String {
        match self {
            GrammarError::Lexer { column } => {
                const PREFIX: &str = "LexerNoViableAltException: ";
                let caret_at = PREFIX.chars().count() + column + 1;
                format!("{PREFIX}{input}\n{:>caret_at$}", "^")
            }
            GrammarError::NoViableAlt { .. } | GrammarError::Mismatched { .. } => self.to_string(),
            other => format!("Error parsing override '{input}'\n{other}"),
        }
    }
}

impl fmt::Display for GrammarError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GrammarError::Lexer { column } => write!(f, "no token starts at column {column}"),
            GrammarError::Syntax { found, expected } => {
                write!(f, "mismatched input '{found}' expecting {expected}")
            }
            GrammarError::NoViableAlt { input } => {
                write!(f, "no viable alternative at input {input}")
            }
            GrammarError::Mismatched { found, expected } => {
                write!(f, "mismatched input {found} expecting {expected}")
            }
            GrammarError::Extraneous { found, expected } => {
                write!(f, "extraneous input {found} expecting {expected}")
            }
            GrammarError::Missing { missing, at } => write!(f, "missing {missing} at {at}"),
            GrammarError::AllWhitespace => {
                f.write_str("Trying to parse a primitive that is all whitespaces")
            }
            GrammarError::PositionalAfterKeyword => {
                f.write_str("positional argument follows keyword argument")
            }
            GrammarError::Function {
                call,
                exception,
                message,
            } => {
                write!(f, "{exception} while evaluating '{call}': {message}")
            }
            GrammarError::BadInt { text } => {
                write!(f, "invalid integer literal '{text}'")
            }
        }
    }
}

/// Parse one command-line override as Hydra 1.3 does (functions are evaluated here, as in Hydra).
pub fn parse_override(text: &str) -> Result<Override, OverrideError> {
    let grammar = |reason| OverrideError::Grammar {
        input: text.to_owned(),
        reason,
    };
    let parsed = parser::parse(text).map_err(grammar)?;
    let value = match parsed.value {
        None => None,
        Some(v) => Some(
            value::into_override_value(v).map_err(|nested| match nested {
                value::Nested::Sweep(sweep_type) => OverrideError::NestedSweep {
                    input: text.to_owned(),
                    sweep_type,
                },
            })?,
        ),
    };
    Ok(Override {
        kind: parsed.kind,
        key_or_group: parsed.key_or_group,
        package: parsed.package,
        value,
        input: text.to_owned(),
    })
}

impl Override {
    /// True for `hydra.x=...` and `hydra/x=...`.
    pub fn is_hydra_override(&self) -> bool {
        self.key_or_group.starts_with("hydra.") || self.key_or_group.starts_with("hydra/")
    }

    pub fn is_sweep(&self) -> bool {
        matches!(self.value, Some(OverrideValue::Sweep(_)))
    }

    /// The element value, if the override has one and it is not a sweep.
    pub fn element(&self) -> Option<&Element> {
        match &self.value {
            Some(OverrideValue::Element(e)) => Some(e),
            _ => None,
        }
    }

    /// Hydra's `get_key_element()`: the prefix, the key and `@package` (`+db@backup`).
    pub fn key_element(&self) -> String {
        let prefix = match self.kind {
            OverrideKind::Change => "",
            OverrideKind::Add => "+",
            OverrideKind::ForceAdd => "++",
            OverrideKind::Delete => "~",
        };
        match &self.package {
            None => format!("{prefix}{}", self.key_or_group),
            Some(pkg) => format!("{prefix}{}@{pkg}", self.key_or_group),
        }
    }

    /// How Hydra's basic sweeper writes this override into each job of a multirun when it is not a
    /// sweep: `key_element=value_text`, so `b= x ` becomes `b=x` and `~a` becomes `~a=null`. `None` for
    /// sweeps, which [`Sweep::expand`] enumerates instead.
    pub fn job_text(&self) -> Option<String> {
        let value = match &self.value {
            Some(OverrideValue::Sweep(_)) => return None,
            Some(OverrideValue::Element(e)) => e.to_override_text(),
            None => Element::Scalar(Scalar::None).to_override_text(),
        };
        Some(format!("{}={value}", self.key_element()))
    }

    /// Hydra's `get_value_string()`: the input after the first `=`, as typed.
    pub fn value_string(&self) -> Option<&str> {
        self.input.split_once('=').map(|(_, v)| v)
    }

    /// Hydra's `validate_sweep_overrides_legal` for one override.
    pub fn validate_sweep(&self, mode: RunMode) -> Result<(), OverrideError> {
        let Some(OverrideValue::Sweep(sweep)) = &self.value else {
            return Ok(());
        };
        let input = self.input.clone();
        match mode {
            RunMode::Multirun if self.is_hydra_override() => {
                Err(OverrideError::HydraSweep { input })
            }
            RunMode::Multirun => Ok(()),
            RunMode::Run if sweep.is_simple_choice() => {
                Err(OverrideError::AmbiguousSweep { input })
            }
            RunMode::Run => Err(OverrideError::SweepNeedsMultirun { input }),
        }
    }
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod golden;
