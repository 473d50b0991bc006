//! OmegaConf 2.3's interpolation grammar (`OmegaConfGrammarLexer.g4` / `OmegaConfGrammarParser.g4`), hand-written.
//!
//! The lexer reproduces ANTLR's behaviour: per-mode longest match, ties broken by rule order, and the mode
//! stack (`${` pushes, `}` pops, `:` inside an interpolation switches to value mode). The parser is a
//! recursive-descent version of the parser rules that accepts the same language. Escapes are undone here,
//! exactly as OmegaConf's `GrammarVisitor._unescape` does, so the evaluator only sees literal text.

use std::fmt;

/// A syntax error. OmegaConf reports ANTLR's wording; only the fact that it fails is contractual.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{detail}")]
pub struct GrammarError {
    pub detail: String,
}

fn err<T>(detail: impl Into<String>) -> Result<T, GrammarError> {
    Err(GrammarError {
        detail: detail.into(),
    })
}

/// A whole config value (`configValue: text EOF`) or a quoted string's content.
#[derive(Debug, Clone, PartialEq)]
pub struct Text {
    pub parts: Vec<Part>,
}

/// A piece of text: literal characters (already unescaped) or an interpolation.
#[derive(Debug, Clone, PartialEq)]
pub enum Part {
    Lit(String),
    Interp(Interp),
}

/// `${...}`, with the source text (ANTLR's `getText()`, used in some error messages).
#[derive(Debug, Clone, PartialEq)]
pub struct Interp {
    pub kind: InterpKind,
    pub text: String,
}

#[derive(Debug, Clone, PartialEq)]
pub enum InterpKind {
    /// `${a.b[0]}`: the key is the concatenation of the pieces, re-split later (OmegaConf's `split_key`).
    Node(Vec<KeyPiece>),
    /// `${name:args}`: the name is the pieces joined with `.`; `None` args are empty sequence slots (`""`).
    Resolver {
        name: Vec<KeyPiece>,
        args: Vec<Element>,
    },
}

#[derive(Debug, Clone, PartialEq)]
pub enum KeyPiece {
    Lit(String),
    Interp(Interp),
}

/// One element of the value grammar (resolver arguments, `oc.decode` input).
#[derive(Debug, Clone, PartialEq)]
pub enum Element {
    /// A missing sequence element (`a,,b`): OmegaConf turns it into `""`.
    Empty,
    Null,
    Bool(bool),
    Int(String),
    Float(String),
    /// An unquoted string made of one token (ID, `/`, `:`, an escape...).
    Str(String),
    /// A lone interpolation: keeps its type.
    Interp(Interp),
    /// Several tokens concatenated into a string (interpolations converted with `str()`).
    Concat(Vec<Part>),
    /// `'...'` or `"..."`: always a string.
    Quoted(Text),
    List(Vec<Element>),
    Dict(Vec<(DictKey, Element)>),
}

/// A dict key in the value grammar: like a primitive without `:`, quotes or interpolations.
#[derive(Debug, Clone, PartialEq)]
pub enum DictKey {
    Null,
    Bool(bool),
    Int(String),
    Float(String),
    Str(String),
}

/// Parse a config value that contains `${` (OmegaConf's `parse(value)`). On failure the error is the first
/// one ANTLR reports, worded as ANTLR words it (see `diagnose`).
pub fn parse_value(input: &str) -> Result<Text, GrammarError> {
    let (toks, lex_error) = lex_prefix(input, Mode::Default);
    let parsed = match &lex_error {
        Some(e) => Err(e.clone()),
        None => {
            let mut p = Parser {
                toks: toks.clone(),
                pos: 0,
                depth: 0,
            };
            p.text(TextCtx::TopLevel)
                .and_then(|text| p.expect_eof().map(|()| text))
        }
    };
    parsed.map_err(|e| super::diagnose::diagnose_value(&toks, lex_error.as_ref()).unwrap_or(e))
}

/// Parse a single element in value mode (`oc.decode`'s `singleElement`).
pub fn parse_element(input: &str) -> Result<Element, GrammarError> {
    let (toks, lex_error) = lex_prefix(input, Mode::Value);
    let parsed = match &lex_error {
        Some(e) => Err(e.clone()),
        None => {
            let mut p = Parser {
                toks: toks.clone(),
                pos: 0,
                depth: 0,
            };
            p.element().and_then(|el| p.expect_eof().map(|()| el))
        }
    };
    parsed.map_err(|e| super::diagnose::diagnose_element(&toks, lex_error.as_ref()).unwrap_or(e))
}

/// OmegaConf's strict validation when a value is stored: strings matching its fast
/// `SIMPLE_INTERPOLATION_PATTERN` are accepted without parsing (even the few the grammar rejects, such as
/// `${:x}`), anything else with `${` must parse.
pub fn validate_value(s: &str) -> Result<(), GrammarError> {
    if !s.contains("${") || matches_simple_pattern(s) {
        return Ok(());
    }
    parse_value(s).map(|_| ())
}

/// `SIMPLE_INTERPOLATION_PATTERN` of `grammar_parser.py` (ASCII mode): text without `${`, and at least one
/// `${a.b[c]}` or `${name:arg, arg}` whose content has no braces.
fn matches_simple_pattern(s: &str) -> bool {
    let mut rest = s;
    let mut found = false;
    while let Some(start) = rest.find("${") {
        let after = &rest[start + 2..];
        let Some(end) = after.find('}') else {
            return false;
        };
        let content = &after[..end];
        if !(simple_node_content(content) || simple_resolver_content(content)) {
            return false;
        }
        found = true;
        rest = &after[end + 1..];
    }
    found
}

fn is_py_space(c: char) -> bool {
    matches!(c, ' ' | '\t' | '\n' | '\r' | '\x0b' | '\x0c')
}

fn is_word(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// `\s*(\.)*([$\w]+|\[[$\w]+\])(\.[$\w]+|\[[$\w]+\])*\s*`
fn simple_node_content(content: &str) -> bool {
    let body = content.trim_matches(is_py_space);
    let key_char = |c: char| is_word(c) || c == '$';
    let mut chars = body.trim_start_matches('.').chars().peekable();
    let mut first = true;
    loop {
        let bracket = match chars.peek() {
            None => return !first,
            Some('[') => true,
            Some('.') if !first => false,
            Some(_) if first => {
                let mut n = 0;
                while chars.peek().is_some_and(|&c| key_char(c)) {
                    chars.next();
                    n += 1;
                }
                if n == 0 {
                    return false;
                }
                first = false;
                continue;
            }
            Some(_) => return false,
        };
        chars.next();
        let mut n = 0;
        while chars.peek().is_some_and(|&c| key_char(c)) {
            chars.next();
            n += 1;
        }
        if n == 0 || (bracket && chars.next() != Some(']')) {
            return false;
        }
        first = false;
    }
}

/// `\s*([a-zA-Z_][\w\-]*(\.[a-zA-Z_][\w\-]*)*)?\s*:\s*ARG(\s*,\s*ARG)*?\s*`: OmegaConf writes
/// `{_args}?`, which makes only the repetition optional, so at least one argument is required.
fn simple_resolver_content(content: &str) -> bool {
    let Some((name, args)) = content.split_once(':') else {
        return false;
    };
    let name = name.trim_matches(is_py_space);
    let name_ok = name.is_empty()
        || name.split('.').all(|id| {
            let mut cs = id.chars();
            cs.next()
                .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
                && cs.all(|c| is_word(c) || c == '-')
        });
    let args = args.trim_matches(is_py_space);
    let arg_ok =
        |a: &str| !a.is_empty() && a.chars().all(|c| is_word(c) || "/-+.$%*@?|".contains(c));
    name_ok && args.split(',').all(|a| arg_ok(a.trim_matches(is_py_space)))
}

// ---------------------------------------------------------------- lexer

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Default,
    Value,
    Interp,
    QuoteSingle,
    QuoteDouble,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Tk {
    AnyStr,
    EscInter,
    TopEsc,
    InterOpen,
    BraceOpen,
    BraceClose,
    QuoteOpenSingle,
    QuoteOpenDouble,
    Comma,
    BracketOpen,
    BracketClose,
    Colon,
    Float,
    Int,
    Bool,
    Null,
    UnquotedChar,
    Id,
    Esc,
    Ws,
    InterClose,
    Dot,
    InterKey,
    QuoteClose,
    QuotedEsc,
}

impl fmt::Display for Tk {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self {
            Tk::AnyStr => "ANY_STR",
            Tk::EscInter => "ESC_INTER",
            Tk::TopEsc => "TOP_ESC",
            Tk::InterOpen => "INTER_OPEN",
            Tk::BraceOpen => "BRACE_OPEN",
            Tk::BraceClose => "BRACE_CLOSE",
            Tk::QuoteOpenSingle => "QUOTE_OPEN_SINGLE",
            Tk::QuoteOpenDouble => "QUOTE_OPEN_DOUBLE",
            Tk::Comma => "COMMA",
            Tk::BracketOpen => "BRACKET_OPEN",
            Tk::BracketClose => "BRACKET_CLOSE",
            Tk::Colon => "COLON",
            Tk::Float => "FLOAT",
            Tk::Int => "INT",
            Tk::Bool => "BOOL",
            Tk::Null => "NULL",
            Tk::UnquotedChar => "UNQUOTED_CHAR",
            Tk::Id => "ID",
            Tk::Esc => "ESC",
            Tk::Ws => "WS",
            Tk::InterClose => "INTER_CLOSE",
            Tk::Dot => "DOT",
            Tk::InterKey => "INTER_KEY",
            Tk::QuoteClose => "MATCHING_QUOTE_CLOSE",
            Tk::QuotedEsc => "QUOTED_ESC",
        };
        f.write_str(name)
    }
}

#[derive(Debug, Clone)]
pub(super) struct Tok {
    pub(super) kind: Tk,
    pub(super) text: String,
}

struct Lexer {
    s: Vec<char>,
    mode: Mode,
    stack: Vec<Mode>,
}

fn is_ws(c: char) -> bool {
    c == ' ' || c == '\t'
}

/// The tokens before the first one that fails to lex (no token starts there, or it pops an empty mode
/// stack), and that failure.
fn lex_prefix(input: &str, start: Mode) -> (Vec<Tok>, Option<GrammarError>) {
    let mut lx = Lexer {
        s: input.chars().collect(),
        mode: start,
        stack: Vec::new(),
    };
    let mut toks = Vec::new();
    let mut i = 0;
    while i < lx.s.len() {
        let matched = match lx.mode {
            Mode::Default => Ok(lx.default_mode(i)),
            Mode::Value => lx.value_mode(i),
            Mode::Interp => lx.interp_mode(i),
            Mode::QuoteSingle => Ok(lx.quoted_mode(i, '\'')),
            Mode::QuoteDouble => Ok(lx.quoted_mode(i, '"')),
        };
        let (kind, len) = match matched {
            Ok(m) => m,
            Err(e) => return (toks, Some(e)),
        };
        // Every rule matches at least one character; a zero length would be a bug, not bad input.
        let len = len.max(1);
        let text: String = lx.s[i..(i + len).min(lx.s.len())].iter().collect();
        if let Err(e) = lx.apply_mode_change(kind) {
            return (toks, Some(e));
        }
        toks.push(Tok { kind, text });
        i += len;
    }
    (toks, None)
}

impl Lexer {
    fn at(&self, i: usize) -> Option<char> {
        self.s.get(i).copied()
    }

    fn starts_with(&self, i: usize, pat: &str) -> bool {
        (i..).zip(pat.chars()).all(|(j, c)| self.at(j) == Some(c))
    }

    fn count_ws(&self, i: usize) -> usize {
        let mut n = 0;
        while self.at(i + n).is_some_and(is_ws) {
            n += 1;
        }
        n
    }

    fn count_backslashes(&self, i: usize) -> usize {
        let mut n = 0;
        while self.at(i + n) == Some('\\') {
            n += 1;
        }
        n
    }

    /// `~[stops]* ~[\\ stops]`: the longest run without a stop character that does not end with `\`.
    fn any_str_len(&self, i: usize, stops: &[char]) -> usize {
        let mut j = i;
        let mut best = 0;
        while let Some(c) = self.at(j) {
            if stops.contains(&c) {
                break;
            }
            if c != '\\' {
                best = j - i + 1;
            }
            j += 1;
        }
        best
    }

    /// The mode actions of the rule that produced `kind` in the current mode.
    fn apply_mode_change(&mut self, kind: Tk) -> Result<(), GrammarError> {
        match (self.mode, kind) {
            (_, Tk::InterOpen) => self.push(Mode::Interp),
            (Mode::Value, Tk::BraceOpen) => self.push(Mode::Value),
            (Mode::Value, Tk::QuoteOpenSingle) => self.push(Mode::QuoteSingle),
            (Mode::Value, Tk::QuoteOpenDouble) => self.push(Mode::QuoteDouble),
            (Mode::Value, Tk::BraceClose) | (Mode::Interp, Tk::InterClose) => return self.pop(),
            (Mode::QuoteSingle | Mode::QuoteDouble, Tk::QuoteClose) => return self.pop(),
            (Mode::Interp, Tk::Colon) => self.mode = Mode::Value,
            _ => {}
        }
        Ok(())
    }

    fn push(&mut self, m: Mode) {
        self.stack.push(self.mode);
        self.mode = m;
    }

    fn pop(&mut self) -> Result<(), GrammarError> {
        match self.stack.pop() {
            Some(m) => {
                self.mode = m;
                Ok(())
            }
            None => err("Empty Stack"),
        }
    }

    /// ANTLR's lexer error: the text from the token's start through the first character no rule of the
    /// mode can go on with (`len` characters, cut at the end of input), tabs and newlines escaped.
    fn recognition_error<T>(&self, i: usize, len: usize) -> Result<T, GrammarError> {
        let rest: String = self.s[i..]
            .iter()
            .take(len)
            .map(|c| match c {
                '\n' => "\\n".to_owned(),
                '\t' => "\\t".to_owned(),
                '\r' => "\\r".to_owned(),
                c => c.to_string(),
            })
            .collect();
        err(format!("token recognition error at: '{rest}'"))
    }

    fn default_mode(&self, i: usize) -> (Tk, usize) {
        if self.starts_with(i, "${") {
            return (Tk::InterOpen, 2 + self.count_ws(i + 2));
        }
        match self.at(i) {
            Some('$') => (Tk::AnyStr, 1),
            Some('\\') => {
                let n = self.count_backslashes(i);
                let esc_inter = if n % 2 == 1 && self.starts_with(i + n, "${") {
                    n + 2
                } else {
                    0
                };
                let cands = [
                    (Tk::AnyStr, self.any_str_len(i, &['$'])),
                    (Tk::EscInter, esc_inter),
                    (Tk::TopEsc, n - n % 2),
                    (Tk::AnyStr, n),
                ];
                longest(&cands)
            }
            _ => (Tk::AnyStr, self.any_str_len(i, &['$'])),
        }
    }

    fn quoted_mode(&self, i: usize, quote: char) -> (Tk, usize) {
        if self.starts_with(i, "${") {
            return (Tk::InterOpen, 2 + self.count_ws(i + 2));
        }
        match self.at(i) {
            Some(c) if c == quote => (Tk::QuoteClose, 1),
            Some('$') => (Tk::AnyStr, 1),
            Some('\\') => {
                let n = self.count_backslashes(i);
                let odd = n % 2 == 1;
                let esc_inter = if odd && self.starts_with(i + n, "${") {
                    n + 2
                } else {
                    0
                };
                let esc_quote = if odd && self.at(i + n) == Some(quote) {
                    n + 1
                } else {
                    0
                };
                let cands = [
                    (Tk::AnyStr, self.any_str_len(i, &[quote, '$'])),
                    (Tk::EscInter, esc_inter),
                    (Tk::Esc, esc_quote),
                    (Tk::QuotedEsc, n - n % 2),
                    (Tk::AnyStr, n),
                ];
                longest(&cands)
            }
            _ => (Tk::AnyStr, self.any_str_len(i, &[quote, '$'])),
        }
    }

    fn interp_mode(&self, i: usize) -> Result<(Tk, usize), GrammarError> {
        if self.starts_with(i, "${") {
            return Ok((Tk::InterOpen, 2 + self.count_ws(i + 2)));
        }
        let ws = self.count_ws(i);
        match self.at(i + ws) {
            Some(':') => return Ok((Tk::Colon, ws + 1 + self.count_ws(i + ws + 1))),
            Some('}') => return Ok((Tk::InterClose, ws + 1)),
            // Only INTER_COLON and INTER_CLOSE start with whitespace: the error spans it and the next char.
            _ if ws > 0 => return self.recognition_error(i, ws + 1),
            _ => {}
        }
        match self.at(i) {
            Some('.') => return Ok((Tk::Dot, 1)),
            Some('[') => return Ok((Tk::BracketOpen, 1)),
            Some(']') => return Ok((Tk::BracketClose, 1)),
            _ => {}
        }
        let id = self.id_len(i);
        let mut key = 0;
        while self
            .at(i + key)
            .is_some_and(|c| !"\\{}()[]:. \t'\"".contains(c))
        {
            key += 1;
        }
        if id > 0 && id >= key {
            Ok((Tk::Id, id))
        } else if key > 0 {
            Ok((Tk::InterKey, key))
        } else {
            self.recognition_error(i, 1)
        }
    }

    fn value_mode(&self, i: usize) -> Result<(Tk, usize), GrammarError> {
        if self.starts_with(i, "${") {
            return Ok((Tk::InterOpen, 2 + self.count_ws(i + 2)));
        }
        match self.at(i) {
            Some('{') => return Ok((Tk::BraceOpen, 1 + self.count_ws(i + 1))),
            Some('\'') => return Ok((Tk::QuoteOpenSingle, 1)),
            Some('"') => return Ok((Tk::QuoteOpenDouble, 1)),
            Some('[') => return Ok((Tk::BracketOpen, 1 + self.count_ws(i + 1))),
            _ => {}
        }
        let ws = self.count_ws(i);
        match self.at(i + ws) {
            Some('}') => return Ok((Tk::BraceClose, ws + 1)),
            Some(']') => return Ok((Tk::BracketClose, ws + 1)),
            Some(',') => return Ok((Tk::Comma, ws + 1 + self.count_ws(i + ws + 1))),
            Some(':') => return Ok((Tk::Colon, ws + 1 + self.count_ws(i + ws + 1))),
            _ if ws > 0 => return Ok((Tk::Ws, ws)),
            _ => {}
        }
        let unquoted = usize::from(self.at(i).is_some_and(|c| "/-\\+.$%*@?|".contains(c)));
        let cands = [
            (Tk::Float, self.float_len(i)),
            (Tk::Int, self.int_len(i)),
            (Tk::Bool, self.keyword_len(i, &["true", "false"])),
            (Tk::Null, self.keyword_len(i, &["null"])),
            (Tk::UnquotedChar, unquoted),
            (Tk::Id, self.id_len(i)),
            (Tk::Esc, self.esc_len(i)),
        ];
        let (kind, len) = longest(&cands);
        if len == 0 {
            self.recognition_error(i, 1)
        } else {
            Ok((kind, len))
        }
    }

    /// `ID: (CHAR|'_') (CHAR|DIGIT|'_'|'-')*`
    fn id_len(&self, i: usize) -> usize {
        match self.at(i) {
            Some(c) if c.is_ascii_alphabetic() || c == '_' => {}
            _ => return 0,
        }
        let mut n = 1;
        while self
            .at(i + n)
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
        {
            n += 1;
        }
        n
    }

    fn keyword_len(&self, i: usize, words: &[&str]) -> usize {
        for w in words {
            let matches = w
                .chars()
                .enumerate()
                .all(|(k, wc)| self.at(i + k).is_some_and(|c| c.eq_ignore_ascii_case(&wc)));
            if matches {
                return w.len();
            }
        }
        0
    }

    /// `ESC: (ESC_BACKSLASH | '\(' | '\)' | ... | '\ ' | '\\t')+`
    fn esc_len(&self, i: usize) -> usize {
        let mut n = 0;
        while self.at(i + n) == Some('\\')
            && self
                .at(i + n + 1)
                .is_some_and(|c| "\\()[]{}:=, \t".contains(c))
        {
            n += 2;
        }
        n
    }

    /// `DIGIT (('_')? DIGIT)*`, returning the end position.
    fn digits_end(&self, i: usize) -> Option<usize> {
        if !self.at(i).is_some_and(|c| c.is_ascii_digit()) {
            return None;
        }
        let mut j = i + 1;
        loop {
            if self.at(j).is_some_and(|c| c.is_ascii_digit()) {
                j += 1;
            } else if self.at(j) == Some('_') && self.at(j + 1).is_some_and(|c| c.is_ascii_digit())
            {
                j += 2;
            } else {
                return Some(j);
            }
        }
    }

    /// `INT_UNSIGNED: '0' | [1-9] (('_')? DIGIT)*`
    fn int_unsigned_end(&self, i: usize) -> Option<usize> {
        match self.at(i) {
            Some('0') => Some(i + 1),
            Some('1'..='9') => self.digits_end(i),
            _ => None,
        }
    }

    fn sign_len(&self, i: usize) -> usize {
        usize::from(matches!(self.at(i), Some('+' | '-')))
    }

    fn int_len(&self, i: usize) -> usize {
        let p = i + self.sign_len(i);
        self.int_unsigned_end(p).map_or(0, |e| e - i)
    }

    /// `FLOAT: [+-]? (POINT_FLOAT | EXPONENT_FLOAT | [Ii][Nn][Ff] | [Nn][Aa][Nn])`, longest match.
    fn float_len(&self, i: usize) -> usize {
        let p = i + self.sign_len(i);
        let special = self.keyword_len(p, &["inf", "nan"]);
        let mut best = if special > 0 { p + special - i } else { 0 };
        // POINT_FLOAT: INT_UNSIGNED '.' | INT_UNSIGNED? '.' DIGIT (('_')? DIGIT)*
        let mut point_ends = Vec::new();
        let int_end = self.int_unsigned_end(p);
        let dot_at = int_end.unwrap_or(p);
        if self.at(dot_at) == Some('.') {
            if int_end.is_some() {
                point_ends.push(dot_at + 1);
            }
            if let Some(e) = self.digits_end(dot_at + 1) {
                point_ends.push(e);
            }
        }
        // EXPONENT_FLOAT: (INT_UNSIGNED | POINT_FLOAT) [eE] [+-]? DIGIT (('_')? DIGIT)*
        let mut ends = point_ends.clone();
        for base in int_end.into_iter().chain(point_ends) {
            if matches!(self.at(base), Some('e' | 'E')) {
                let q = base + 1 + self.sign_len(base + 1);
                if let Some(e) = self.digits_end(q) {
                    ends.push(e);
                }
            }
        }
        for e in ends {
            best = best.max(e - i);
        }
        best
    }
}

/// ANTLR's choice: the longest match; among equals, the rule listed first.
fn longest(cands: &[(Tk, usize)]) -> (Tk, usize) {
    let mut best = (Tk::AnyStr, 0);
    for &(k, n) in cands {
        if n > best.1 {
            best = (k, n);
        }
    }
    best
}

// ---------------------------------------------------------------- parser

struct Parser {
    toks: Vec<Tok>,
    pos: usize,
    /// Current nesting of interpolations and containers; bounded so hostile input cannot overflow the stack.
    depth: usize,
}

/// Deepest nesting of `${...}`, `[...]` and `{...}` accepted in one value.
const MAX_NESTING: usize = 64;

#[derive(Clone, Copy, PartialEq, Eq)]
enum TextCtx {
    TopLevel,
    Quoted,
}

/// What may appear in a node interpolation's key path, before it is known to be one.
enum PathItem {
    Dot,
    Id(String),
    Key(String),
    Open,
    Close,
    Interp(Interp),
}

impl Parser {
    fn peek(&self) -> Option<Tk> {
        self.toks.get(self.pos).map(|t| t.kind)
    }

    fn next_text(&mut self) -> String {
        let t = self
            .toks
            .get(self.pos)
            .map(|t| t.text.clone())
            .unwrap_or_default();
        self.pos += 1;
        t
    }

    fn mismatch<T>(&self, expecting: &str) -> Result<T, GrammarError> {
        match self.toks.get(self.pos) {
            Some(t) => err(format!(
                "mismatched input '{}' expecting {expecting}",
                t.text
            )),
            None => err(format!("mismatched input '<EOF>' expecting {expecting}")),
        }
    }

    fn expect(&mut self, kind: Tk) -> Result<String, GrammarError> {
        if self.peek() == Some(kind) {
            Ok(self.next_text())
        } else {
            self.mismatch(&kind.to_string())
        }
    }

    fn expect_eof(&self) -> Result<(), GrammarError> {
        if self.pos >= self.toks.len() {
            Ok(())
        } else {
            let t = &self.toks[self.pos];
            err(format!("mismatched input '{}' expecting <EOF>", t.text))
        }
    }

    /// Source text of tokens `from..self.pos`.
    fn text_since(&self, from: usize) -> String {
        self.toks[from..self.pos.min(self.toks.len())]
            .iter()
            .map(|t| t.text.as_str())
            .collect()
    }

    /// `text: (interpolation | ANY_STR | ESC | ESC_INTER | TOP_ESC | QUOTED_ESC)+`, unescaped.
    fn text(&mut self, ctx: TextCtx) -> Result<Text, GrammarError> {
        enum Raw {
            Tok(Tk, String),
            Interp(Interp),
        }
        let mut raw = Vec::new();
        loop {
            match self.peek() {
                Some(Tk::InterOpen) => raw.push(Raw::Interp(self.interpolation()?)),
                Some(k @ (Tk::AnyStr | Tk::Esc | Tk::EscInter | Tk::TopEsc | Tk::QuotedEsc)) => {
                    raw.push(Raw::Tok(k, self.next_text()));
                }
                _ => break,
            }
        }
        if raw.is_empty() {
            return self.mismatch("text");
        }
        let mut parts: Vec<Part> = Vec::new();
        let n = raw.len();
        let mut iter = raw.into_iter().enumerate().peekable();
        while let Some((idx, item)) = iter.next() {
            match item {
                Raw::Interp(i) => parts.push(Part::Interp(i)),
                Raw::Tok(kind, text) => {
                    let next_is_interp = matches!(iter.peek(), Some((_, Raw::Interp(_))));
                    let is_last = idx + 1 == n;
                    let lit = match kind {
                        Tk::EscInter => {
                            let chars: Vec<char> = text.chars().collect();
                            let keep = chars.len() / 2 + 1;
                            chars[chars.len().saturating_sub(keep)..].iter().collect()
                        }
                        Tk::Esc => every_second(&text),
                        Tk::TopEsc if next_is_interp => every_second(&text),
                        Tk::QuotedEsc if ctx == TextCtx::Quoted && (next_is_interp || is_last) => {
                            every_second(&text)
                        }
                        _ => text,
                    };
                    match parts.last_mut() {
                        Some(Part::Lit(prev)) => prev.push_str(&lit),
                        _ => parts.push(Part::Lit(lit)),
                    }
                }
            }
        }
        Ok(Text { parts })
    }

    /// `inner` one nesting level deeper, refused beyond [`MAX_NESTING`].
    fn nested<T>(
        &mut self,
        inner: fn(&mut Self) -> Result<T, GrammarError>,
    ) -> Result<T, GrammarError> {
        self.depth += 1;
        if self.depth > MAX_NESTING {
            return err(format!(
                "interpolations nested deeper than {MAX_NESTING} levels"
            ));
        }
        let out = inner(self);
        self.depth -= 1;
        out
    }

    fn interpolation(&mut self) -> Result<Interp, GrammarError> {
        self.nested(Self::interpolation_inner)
    }

    fn interpolation_inner(&mut self) -> Result<Interp, GrammarError> {
        let start = self.pos;
        self.expect(Tk::InterOpen)?;
        let mut items = Vec::new();
        loop {
            match self.peek() {
                Some(Tk::Dot) => {
                    self.pos += 1;
                    items.push(PathItem::Dot);
                }
                Some(Tk::Id) => items.push(PathItem::Id(self.next_text())),
                Some(Tk::InterKey) => items.push(PathItem::Key(self.next_text())),
                Some(Tk::BracketOpen) => {
                    self.pos += 1;
                    items.push(PathItem::Open);
                }
                Some(Tk::BracketClose) => {
                    self.pos += 1;
                    items.push(PathItem::Close);
                }
                Some(Tk::InterOpen) => items.push(PathItem::Interp(self.interpolation()?)),
                _ => break,
            }
        }
        let kind = match self.peek() {
            Some(Tk::InterClose) => {
                self.pos += 1;
                InterpKind::Node(node_path(items, &self.text_since(start))?)
            }
            Some(Tk::Colon) => {
                self.pos += 1;
                let name = resolver_name(items, &self.text_since(start))?;
                let args = if self.peek() == Some(Tk::BraceClose) {
                    Vec::new()
                } else {
                    self.sequence()?
                };
                self.expect(Tk::BraceClose)?;
                InterpKind::Resolver { name, args }
            }
            _ => return self.no_viable(start),
        };
        Ok(Interp {
            kind,
            text: self.text_since(start),
        })
    }

    fn no_viable<T>(&self, start: usize) -> Result<T, GrammarError> {
        let upto = (self.pos + 1).min(self.toks.len());
        let text: String = self.toks[start..upto]
            .iter()
            .map(|t| t.text.as_str())
            .collect();
        err(format!("no viable alternative at input '{text}'"))
    }

    /// `sequence: (element (COMMA element?)*) | (COMMA element?)+`, with OmegaConf's `""` for empty slots.
    fn sequence(&mut self) -> Result<Vec<Element>, GrammarError> {
        let mut out = Vec::new();
        let mut previous_comma = true;
        let mut any = false;
        loop {
            if self.peek() == Some(Tk::Comma) {
                self.pos += 1;
                if previous_comma {
                    out.push(Element::Empty);
                }
                previous_comma = true;
                any = true;
            } else if previous_comma && self.peek().is_some_and(starts_element) {
                out.push(self.element()?);
                previous_comma = false;
                any = true;
            } else {
                break;
            }
        }
        if !any {
            return self.mismatch("element");
        }
        if previous_comma {
            out.push(Element::Empty);
        }
        Ok(out)
    }

    fn element(&mut self) -> Result<Element, GrammarError> {
        self.nested(Self::element_inner)
    }

    fn element_inner(&mut self) -> Result<Element, GrammarError> {
        match self.peek() {
            Some(Tk::QuoteOpenSingle | Tk::QuoteOpenDouble) => {
                self.pos += 1;
                let text = if self.peek() == Some(Tk::QuoteClose) {
                    Text { parts: Vec::new() }
                } else {
                    self.text(TextCtx::Quoted)?
                };
                self.expect(Tk::QuoteClose)?;
                Ok(Element::Quoted(text))
            }
            Some(Tk::BracketOpen) => {
                self.pos += 1;
                let items = if self.peek() == Some(Tk::BracketClose) {
                    Vec::new()
                } else {
                    self.sequence()?
                };
                self.expect(Tk::BracketClose)?;
                Ok(Element::List(items))
            }
            Some(Tk::BraceOpen) => {
                self.pos += 1;
                let mut pairs = Vec::new();
                if self.peek() != Some(Tk::BraceClose) {
                    loop {
                        let key = self.dict_key()?;
                        self.expect(Tk::Colon)?;
                        let value = self.element()?;
                        pairs.push((key, value));
                        if self.peek() == Some(Tk::Comma) {
                            self.pos += 1;
                        } else {
                            break;
                        }
                    }
                }
                self.expect(Tk::BraceClose)?;
                Ok(Element::Dict(pairs))
            }
            Some(k) if is_primitive_token(k) => self.primitive(),
            _ => self.mismatch("element"),
        }
    }

    fn primitive(&mut self) -> Result<Element, GrammarError> {
        let mut items: Vec<Element> = Vec::new();
        let mut raw_texts: Vec<(Tk, String)> = Vec::new();
        while let Some(k) = self.peek() {
            if k == Tk::InterOpen {
                items.push(Element::Interp(self.interpolation()?));
                raw_texts.push((k, String::new()));
            } else if is_primitive_token(k) {
                let text = self.next_text();
                items.push(single_token(k, &text));
                raw_texts.push((k, text));
            } else {
                break;
            }
        }
        if items.len() == 1
            && let Some(only) = items.pop()
        {
            return Ok(only);
        }
        let mut parts: Vec<Part> = Vec::new();
        for (item, (kind, text)) in items.into_iter().zip(raw_texts) {
            let lit = match item {
                Element::Interp(i) => {
                    parts.push(Part::Interp(i));
                    continue;
                }
                _ if kind == Tk::Esc => every_second(&text),
                _ => text,
            };
            match parts.last_mut() {
                Some(Part::Lit(prev)) => prev.push_str(&lit),
                _ => parts.push(Part::Lit(lit)),
            }
        }
        Ok(Element::Concat(parts))
    }

    fn dict_key(&mut self) -> Result<DictKey, GrammarError> {
        let mut toks: Vec<(Tk, String)> = Vec::new();
        while let Some(k) = self.peek() {
            if matches!(
                k,
                Tk::Id
                    | Tk::Null
                    | Tk::Int
                    | Tk::Float
                    | Tk::Bool
                    | Tk::UnquotedChar
                    | Tk::Esc
                    | Tk::Ws
            ) {
                toks.push((k, self.next_text()));
            } else {
                break;
            }
        }
        match toks.as_slice() {
            [] => self.mismatch("dictKey"),
            [(k, text)] => Ok(match single_token(*k, text) {
                Element::Null => DictKey::Null,
                Element::Bool(b) => DictKey::Bool(b),
                Element::Int(s) => DictKey::Int(s),
                Element::Float(s) => DictKey::Float(s),
                Element::Str(s) => DictKey::Str(s),
                _ => DictKey::Str(text.clone()),
            }),
            many => Ok(DictKey::Str(
                many.iter()
                    .map(|(k, t)| {
                        if *k == Tk::Esc {
                            every_second(t)
                        } else {
                            t.clone()
                        }
                    })
                    .collect(),
            )),
        }
    }
}

fn starts_element(k: Tk) -> bool {
    is_primitive_token(k)
        || matches!(
            k,
            Tk::QuoteOpenSingle | Tk::QuoteOpenDouble | Tk::BracketOpen | Tk::BraceOpen
        )
}

fn is_primitive_token(k: Tk) -> bool {
    matches!(
        k,
        Tk::Id
            | Tk::Null
            | Tk::Int
            | Tk::Float
            | Tk::Bool
            | Tk::UnquotedChar
            | Tk::Colon
            | Tk::Esc
            | Tk::Ws
            | Tk::InterOpen
    )
}

/// OmegaConf's `_createPrimitive` for a lone token.
fn single_token(k: Tk, text: &str) -> Element {
    match k {
        Tk::Null => Element::Null,
        Tk::Int => Element::Int(text.to_owned()),
        Tk::Float => Element::Float(text.to_owned()),
        Tk::Bool => Element::Bool(text.eq_ignore_ascii_case("true")),
        Tk::Esc => Element::Str(every_second(text)),
        _ => Element::Str(text.to_owned()),
    }
}

/// `text[1::2]`: undo a run of two-character escapes.
fn every_second(text: &str) -> String {
    text.chars().skip(1).step_by(2).collect()
}

/// `INTER_OPEN DOT* (configKey | [configKey]) (DOT configKey | [configKey])* INTER_CLOSE`
fn node_path(items: Vec<PathItem>, text: &str) -> Result<Vec<KeyPiece>, GrammarError> {
    let bad = || GrammarError {
        detail: format!("no viable alternative at input '{text}'"),
    };
    let mut out = Vec::new();
    let mut it = items.into_iter().peekable();
    while matches!(it.peek(), Some(PathItem::Dot)) {
        it.next();
        out.push(KeyPiece::Lit(".".into()));
    }
    let mut first = true;
    loop {
        match it.next() {
            None if !first => return Ok(out),
            Some(PathItem::Dot) if !first => out.push(KeyPiece::Lit(".".into())),
            Some(PathItem::Open) => {
                out.push(KeyPiece::Lit("[".into()));
                out.push(config_key(it.next()).ok_or_else(bad)?);
                if !matches!(it.next(), Some(PathItem::Close)) {
                    return Err(bad());
                }
                out.push(KeyPiece::Lit("]".into()));
                first = false;
                continue;
            }
            Some(other) if first => {
                out.push(config_key(Some(other)).ok_or_else(bad)?);
                first = false;
                continue;
            }
            _ => return Err(bad()),
        }
        // after a DOT: a config key
        out.push(config_key(it.next()).ok_or_else(bad)?);
    }
}

fn config_key(item: Option<PathItem>) -> Option<KeyPiece> {
    match item? {
        PathItem::Id(s) | PathItem::Key(s) => Some(KeyPiece::Lit(s)),
        PathItem::Interp(i) => Some(KeyPiece::Interp(i)),
        _ => None,
    }
}

/// `resolverName: (interpolation | ID) (DOT (interpolation | ID))*`
fn resolver_name(items: Vec<PathItem>, text: &str) -> Result<Vec<KeyPiece>, GrammarError> {
    let mut out = Vec::new();
    let mut expect_name = true;
    for item in items {
        match (expect_name, item) {
            (true, PathItem::Id(s)) => out.push(KeyPiece::Lit(s)),
            (true, PathItem::Interp(i)) => out.push(KeyPiece::Interp(i)),
            (false, PathItem::Dot) => {}
            _ => return err(format!("no viable alternative at input '{text}'")),
        }
        expect_name = !expect_name;
    }
    if expect_name {
        return err(format!("no viable alternative at input '{text}'"));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {

    /// ANTLR's first error, as OmegaConf 2.3.1 reports it (texts from the oracle): the lexer's text runs from
    /// the token's start through the first character no rule of the mode goes on with; the parser's follows
    /// ANTLR's error recovery (prediction spans, sync, single-token deletion and insertion).
    #[test]
    fn syntax_errors_follow_antlr_error_recovery() {
        let cases = [
            ("${dict .\ta}", "token recognition error at: ' .'"),
            ("${dict \t.a}", "token recognition error at: ' \\t.'"),
            ("${a:b", "missing BRACE_CLOSE at '<EOF>'"),
            ("${ [a }", "missing BRACKET_CLOSE at ' }'"),
            ("${ ]a }", "no viable alternative at input '${ ]'"),
            ("x${a:[1,2}", "missing BRACKET_CLOSE at '}'"),
            ("${foo:{a:1,b}}", "mismatched input '}' expecting COLON"),
            (
                "${a:'x}",
                "mismatched input '<EOF>' expecting MATCHING_QUOTE_CLOSE",
            ),
            ("${a:b}${", "no viable alternative at input '${'"),
            (
                "${${a}.b:c,${d:",
                "mismatched input '<EOF>' expecting {INTER_OPEN, BRACE_OPEN, BRACE_CLOSE, QUOTE_OPEN_SINGLE, QUOTE_OPEN_DOUBLE, COMMA, BRACKET_OPEN, COLON, FLOAT, INT, BOOL, NULL, UNQUOTED_CHAR, ID, ESC, WS}",
            ),
            ("${a:1,2]}", "extraneous input ']' expecting BRACE_CLOSE"),
            (
                "${.a:b}",
                "mismatched input ':' expecting {BRACKET_OPEN, INTER_CLOSE, '.'}",
            ),
            ("${a[b}", "missing BRACKET_CLOSE at '}'"),
            (
                "${a:{1:2,}}",
                "mismatched input '}' expecting {FLOAT, INT, BOOL, NULL, UNQUOTED_CHAR, ID, ESC, WS}",
            ),
        ];
        for (input, want) in cases {
            let got = validate_value(input).map_err(|e| e.to_string());
            assert_eq!(got, Err(want.to_owned()), "{input:?}");
        }
        // Deep nesting that ends in a lexer error: the error walk must not recurse into it.
        assert!(validate_value(&format!("{}(", "${".repeat(100_000))).is_err());
    }
    use super::*;

    fn lit(s: &str) -> Part {
        Part::Lit(s.into())
    }

    fn node(keys: &[&str]) -> Part {
        let pieces = keys.iter().map(|k| KeyPiece::Lit((*k).into())).collect();
        let text = format!("${{{}}}", keys.concat());
        Part::Interp(Interp {
            kind: InterpKind::Node(pieces),
            text,
        })
    }

    #[test]
    fn top_level_escapes_match_omegaconf() {
        let cases: &[(&str, Vec<Part>)] = &[
            (r"\${a}", vec![lit("${a}")]),
            (r"x_\\${a}", vec![lit(r"x_\"), node(&["a"])]),
            (r"\\\${a}", vec![lit(r"\${a}")]),
            (r"a\b${a}", vec![lit(r"a\b"), node(&["a"])]),
            (r"${a}\\", vec![node(&["a"]), lit(r"\\")]),
            (r"$${a}", vec![lit("$"), node(&["a"])]),
            (r"Wrong: \${str\}", vec![lit(r"Wrong: ${str\}")]),
        ];
        for (input, want) in cases {
            let got = parse_value(input).map(|t| t.parts);
            assert_eq!(got.as_ref(), Ok(want), "input {input:?}");
        }
    }

    #[test]
    fn syntax_errors_are_rejected() {
        for bad in [
            "${}",
            "${ }",
            "${a.}",
            "${a..b}",
            "${d i c t.a}",
            "${te st:foo}",
            "${some_${resolver}:a, b, c}",
            "${1e1:1,2,3}",
            "${foo",
            "${foo:bar",
            "${.a:b}",
            "${a[b}",
            "${foo:'a'b}",
        ] {
            assert!(parse_value(bad).is_err(), "{bad:?} should not parse");
        }
    }

    #[test]
    fn valid_interpolations_parse() {
        for good in [
            "${a.b}",
            "${a[0]}",
            "${..a}",
            "${.[a].b}",
            "${a.${b}}",
            "${ a }",
            "${foo:}",
            "${foo:a,,b,}",
            "${oc.env:X,'d'}",
            "${f:{a: 1, b: [1, '2', ${x}]}}",
            "${ns.${n}.f:1}",
            "x_${a}_y",
            "${$x$y$z$}",
            "${x@y}",
        ] {
            assert!(
                parse_value(good).is_ok(),
                "{good:?} should parse: {:?}",
                parse_value(good)
            );
        }
    }

    #[test]
    fn elements_are_typed_like_antlr() {
        let cases: &[(&str, Element)] = &[
            ("123", Element::Int("123".into())),
            ("-1_000", Element::Int("-1_000".into())),
            ("1.5", Element::Float("1.5".into())),
            ("1e-3", Element::Float("1e-3".into())),
            ("-inf", Element::Float("-inf".into())),
            ("NaN", Element::Float("NaN".into())),
            ("TrUe", Element::Bool(true)),
            ("null", Element::Null),
            ("nulls", Element::Str("nulls".into())),
            ("a-b", Element::Str("a-b".into())),
            (r"\,", Element::Str(",".into())),
            ("1.5.3", Element::Concat(vec![lit("1.5.3")])),
            ("a b", Element::Concat(vec![lit("a b")])),
            (
                "'a\\'b'",
                Element::Quoted(Text {
                    parts: vec![lit("a'b")],
                }),
            ),
            ("''", Element::Quoted(Text { parts: vec![] })),
        ];
        for (input, want) in cases {
            assert_eq!(parse_element(input).as_ref(), Ok(want), "input {input:?}");
        }
        for bad in [
            "a,=b",
            "È",
            "\\#",
            "'Hi''there'",
            "''a'",
            "\"abc\\\"",
            "[1,",
            "",
            "{'a': 1}",
        ] {
            assert!(parse_element(bad).is_err(), "{bad:?} should not parse");
        }
    }

    #[test]
    fn deep_nesting_is_an_error_not_a_crash() {
        let deep = "${".repeat(10_000) + &"}".repeat(10_000);
        assert!(parse_value(&deep).is_err());
        let lists = "[".repeat(10_000) + &"]".repeat(10_000);
        assert!(parse_element(&lists).is_err());
        let ok = "${a.".repeat(10) + "b" + &"}".repeat(10);
        assert!(parse_value(&ok).is_ok(), "{ok}");
    }

    #[test]
    fn storing_a_value_validates_like_omegaconf() {
        // Accepted by OmegaConf's fast pattern although the grammar rejects them.
        assert!(validate_value("${:true}").is_ok());
        assert!(validate_value("a ${ : x} b").is_ok());
        // ... but not these, which go to the parser and fail there.
        assert!(validate_value("${\t: }").is_err());
        assert!(validate_value("${:}").is_err());
        assert!(parse_value("${:true}").is_err());
        assert!(validate_value("plain").is_ok());
        assert!(validate_value("${a.b[c]} and ${oc.env:HOME, x}").is_ok());
        assert!(validate_value("${a.${b}}").is_ok());
        for bad in ["${}", "${a.}", "${foo", "x ${d i c t}", "${a:'b}"] {
            assert!(validate_value(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn sequence_keeps_empty_slots() {
        let t = parse_value("${f:,a,}").expect("valid");
        let Some(Part::Interp(Interp {
            kind: InterpKind::Resolver { args, .. },
            ..
        })) = t.parts.first()
        else {
            panic!("not a resolver: {t:?}");
        };
        assert_eq!(
            args,
            &vec![Element::Empty, Element::Str("a".into()), Element::Empty]
        );
    }
}
