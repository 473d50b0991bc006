//! ANTLR's first error for a config value that does not parse, worded as OmegaConf's generated parser words it.
//!
//! OmegaConf raises on the first error ANTLR reports, so this walks the tokens as the generated
//! `OmegaConfGrammarParser` does for `configValue`: `sync` before blocks and loops ("extraneous input" when
//! the token after would do, else "mismatched input"), `match` with single-token deletion and insertion
//! ("missing X at Y", judged on what may follow in the calling rules), LL(1) blocks that fail as "no viable
//! alternative" at one token, and the one adaptive prediction (`interpolation`: node or resolver), whose
//! lookahead spans the tokens named in "no viable alternative at input '...'". The lexer is lazy: a token
//! that does not lex (or pops an empty mode stack) is the error only once the parser looks at it, or when a
//! "no viable alternative" report reads the whole input's text.

use super::grammar::{GrammarError, Tk, Tok};
use crate::antlr_text::{quote, token_set};

/// A set of token kinds: bit `n` is token type `n` of `OmegaConfGrammarLexer.tokens`, bit 0 is EOF and
/// bit 31 ANTLR's epsilon (the rule may end here).
type Set = u32;

const EOF: Set = 1;
const EPS: Set = 1 << 31;

/// Token kinds by token type, with the names ANTLR prints.
const NAMES: [(Option<Tk>, &str); 26] = [
    (None, "<EOF>"),
    (Some(Tk::AnyStr), "ANY_STR"),
    (Some(Tk::EscInter), "ESC_INTER"),
    (Some(Tk::TopEsc), "TOP_ESC"),
    (Some(Tk::InterOpen), "INTER_OPEN"),
    (Some(Tk::BraceOpen), "BRACE_OPEN"),
    (Some(Tk::BraceClose), "BRACE_CLOSE"),
    (Some(Tk::QuoteOpenSingle), "QUOTE_OPEN_SINGLE"),
    (Some(Tk::QuoteOpenDouble), "QUOTE_OPEN_DOUBLE"),
    (Some(Tk::Comma), "COMMA"),
    (Some(Tk::BracketOpen), "BRACKET_OPEN"),
    (Some(Tk::BracketClose), "BRACKET_CLOSE"),
    (Some(Tk::Colon), "COLON"),
    (Some(Tk::Float), "FLOAT"),
    (Some(Tk::Int), "INT"),
    (Some(Tk::Bool), "BOOL"),
    (Some(Tk::Null), "NULL"),
    (Some(Tk::UnquotedChar), "UNQUOTED_CHAR"),
    (Some(Tk::Id), "ID"),
    (Some(Tk::Esc), "ESC"),
    (Some(Tk::Ws), "WS"),
    (Some(Tk::InterClose), "INTER_CLOSE"),
    (Some(Tk::Dot), "'.'"),
    (Some(Tk::InterKey), "INTER_KEY"),
    (Some(Tk::QuoteClose), "MATCHING_QUOTE_CLOSE"),
    (Some(Tk::QuotedEsc), "QUOTED_ESC"),
];

fn bit(kind: Option<Tk>) -> Set {
    NAMES
        .iter()
        .position(|(k, _)| *k == kind)
        .map_or(0, |i| 1 << i)
}

fn set(kinds: &[Tk]) -> Set {
    kinds.iter().fold(0, |acc, k| acc | bit(Some(*k)))
}

fn has(s: Set, kind: Option<Tk>) -> bool {
    s & bit(kind) != 0
}

/// What may follow a rule's end: `next` when the rule cannot end there, else `next` plus the caller's.
fn then(next: Set, follow: Set) -> Set {
    if next & EPS != 0 {
        (next & !EPS) | follow
    } else {
        next
    }
}

fn render(s: Set) -> String {
    token_set(s, NAMES.iter().map(|(_, name)| *name))
}

fn text_tokens() -> Set {
    set(&[
        Tk::AnyStr,
        Tk::EscInter,
        Tk::TopEsc,
        Tk::InterOpen,
        Tk::Esc,
        Tk::QuotedEsc,
    ])
}

fn prim_tokens() -> Set {
    set(&[
        Tk::InterOpen,
        Tk::Colon,
        Tk::Float,
        Tk::Int,
        Tk::Bool,
        Tk::Null,
        Tk::UnquotedChar,
        Tk::Id,
        Tk::Esc,
        Tk::Ws,
    ])
}

fn dict_key_tokens() -> Set {
    set(&[
        Tk::Float,
        Tk::Int,
        Tk::Bool,
        Tk::Null,
        Tk::UnquotedChar,
        Tk::Id,
        Tk::Esc,
        Tk::Ws,
    ])
}

/// FIRST(element).
fn element_tokens() -> Set {
    prim_tokens()
        | set(&[
            Tk::QuoteOpenSingle,
            Tk::QuoteOpenDouble,
            Tk::BracketOpen,
            Tk::BraceOpen,
        ])
}

fn key_tokens() -> Set {
    set(&[Tk::InterOpen, Tk::Id, Tk::InterKey])
}

/// After a node key: `.key`, `[key]` or the end.
fn node_more() -> Set {
    set(&[Tk::BracketOpen, Tk::InterClose, Tk::Dot])
}

type Step<T> = Result<T, GrammarError>;

struct Diag<'a> {
    tokens: &'a [Tok],
    lex_error: Option<&'a GrammarError>,
    pos: usize,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Alt {
    Node,
    Resolver,
}

/// Where a node-or-resolver prediction stands: both alternatives are alive only on `name (. name)*`.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Pair {
    Start,
    Named,
    Dot,
}

/// The first error ANTLR reports for a `configValue` of `tokens` (cut where the lexer failed with
/// `lex_error`); `None` when it parses.
pub(super) fn diagnose_value(
    tokens: &[Tok],
    lex_error: Option<&GrammarError>,
) -> Option<GrammarError> {
    diagnose(tokens, lex_error, Diag::config_value)
}

/// The same for a `singleElement` (`oc.decode`'s input, lexed in value mode).
pub(super) fn diagnose_element(
    tokens: &[Tok],
    lex_error: Option<&GrammarError>,
) -> Option<GrammarError> {
    diagnose(tokens, lex_error, Diag::single_element)
}

fn diagnose<'a>(
    tokens: &'a [Tok],
    lex_error: Option<&'a GrammarError>,
    rule: fn(&mut Diag<'a>) -> Step<()>,
) -> Option<GrammarError> {
    if max_nesting(tokens) > MAX_NESTING {
        return None;
    }
    let mut d = Diag {
        tokens,
        lex_error,
        pos: 0,
    };
    rule(&mut d).err()
}

/// Deepest nesting this walk follows (it recurses once per unclosed `${`, bracket, brace or quote); deeper
/// input keeps the parser's own error rather than risking the stack.
const MAX_NESTING: usize = 200;

fn max_nesting(tokens: &[Tok]) -> usize {
    let mut depth: usize = 0;
    let mut deepest = 0;
    for t in tokens {
        match t.kind {
            Tk::InterOpen
            | Tk::BracketOpen
            | Tk::BraceOpen
            | Tk::QuoteOpenSingle
            | Tk::QuoteOpenDouble => {
                depth += 1;
                deepest = deepest.max(depth);
            }
            Tk::InterClose | Tk::BracketClose | Tk::BraceClose | Tk::QuoteClose => {
                depth = depth.saturating_sub(1);
            }
            _ => {}
        }
    }
    deepest
}

fn fail(detail: String) -> GrammarError {
    GrammarError { detail }
}

impl Diag<'_> {
    fn kind_at(&self, index: usize) -> Step<Option<Tk>> {
        match self.tokens.get(index) {
            Some(t) => Ok(Some(t.kind)),
            None => match self.lex_error {
                Some(e) => Err(e.clone()),
                None => Ok(None),
            },
        }
    }

    fn la(&self, ahead: usize) -> Step<Option<Tk>> {
        self.kind_at(self.pos + ahead)
    }

    fn text(&self, index: usize) -> String {
        self.tokens
            .get(index)
            .map_or_else(|| "<EOF>".to_owned(), |t| t.text.clone())
    }

    fn consume(&mut self) -> Step<()> {
        self.pos += 1;
        self.la(0).map(|_| ())
    }

    fn no_viable(&self, start: usize, offending: usize) -> GrammarError {
        if let Some(e) = self.lex_error {
            return e.clone();
        }
        let input = if start >= self.tokens.len() {
            "<EOF>".to_owned()
        } else {
            (start..=offending.min(self.tokens.len() - 1))
                .map(|i| self.text(i))
                .collect()
        };
        fail(format!("no viable alternative at input {}", quote(&input)))
    }

    fn mismatched(&self, expected: Set) -> GrammarError {
        fail(format!(
            "mismatched input {} expecting {}",
            quote(&self.text(self.pos)),
            render(expected)
        ))
    }

    fn extraneous(&self, expected: Set) -> GrammarError {
        fail(format!(
            "extraneous input {} expecting {}",
            quote(&self.text(self.pos)),
            render(expected)
        ))
    }

    /// `sync` at a block start or `*` loop entry whose next tokens have no epsilon.
    fn sync_block(&self, next: Set) -> Step<()> {
        if has(next, self.la(0)?) {
            return Ok(());
        }
        if has(next, self.la(1)?) {
            Err(self.extraneous(next))
        } else {
            Err(self.mismatched(next))
        }
    }

    /// `sync` at a `*` loop back whose next tokens have no epsilon.
    fn sync_loop_back(&self, next: Set) -> Step<()> {
        if has(next, self.la(0)?) {
            Ok(())
        } else {
            Err(self.extraneous(next))
        }
    }

    /// `match(kind)` with inline recovery; `after` is what may follow the matched token (full context).
    fn match_tok(&mut self, kind: Option<Tk>, after: Set) -> Step<()> {
        let la1 = self.la(0)?;
        if la1 == kind {
            return if kind.is_some() {
                self.consume()
            } else {
                Ok(())
            };
        }
        if self.la(1)? == kind {
            return Err(self.extraneous(bit(kind)));
        }
        if has(after, la1) {
            return Err(fail(format!(
                "missing {} at {}",
                render(bit(kind)),
                quote(&self.text(self.pos))
            )));
        }
        Err(self.mismatched(bit(kind)))
    }

    // configValue: text EOF
    fn config_value(&mut self) -> Step<()> {
        self.text_rule(EOF)?;
        self.match_tok(None, EOF)
    }

    // singleElement: element EOF
    fn single_element(&mut self) -> Step<()> {
        self.element(EOF)?;
        self.match_tok(None, EOF)
    }

    // text: (interpolation | ANY_STR | ESC | ESC_INTER | TOP_ESC | QUOTED_ESC)+
    fn text_rule(&mut self, follow: Set) -> Step<()> {
        let toks = text_tokens();
        loop {
            self.sync_block(toks)?;
            if self.la(0)? == Some(Tk::InterOpen) {
                self.interpolation(toks | follow)?;
            } else {
                self.consume()?;
            }
            if !has(toks, self.la(0)?) {
                return Ok(());
            }
        }
    }

    // interpolation: interpolationNode | interpolationResolver
    fn interpolation(&mut self, follow: Set) -> Step<()> {
        match self.predict_interpolation()? {
            Alt::Node => self.node(),
            Alt::Resolver => self.resolver(follow),
        }
    }

    /// Decision 11's SLL prediction from the INTER_OPEN at `self.pos`.
    fn predict_interpolation(&self) -> Step<Alt> {
        let start = self.pos;
        let mut j = start + 1;
        let mut pair = Pair::Start;
        loop {
            let kind = self.kind_at(j)?;
            match (pair, kind) {
                (Pair::Start | Pair::Dot, Some(Tk::Id)) => pair = Pair::Named,
                (Pair::Start | Pair::Dot, Some(Tk::InterOpen)) => {
                    j = self
                        .skip_interpolation(j)
                        .map_err(|at| self.no_viable_or(start, at))?;
                    pair = Pair::Named;
                    continue;
                }
                (Pair::Start, Some(Tk::Dot | Tk::InterKey | Tk::BracketOpen))
                | (Pair::Dot, Some(Tk::InterKey))
                | (Pair::Named, Some(Tk::BracketOpen | Tk::InterClose)) => return Ok(Alt::Node),
                (Pair::Named, Some(Tk::Dot)) => pair = Pair::Dot,
                (Pair::Named, Some(Tk::Colon)) => return Ok(Alt::Resolver),
                _ => return Err(self.no_viable(start, j)),
            }
            j += 1;
        }
    }

    fn no_viable_or(&self, start: usize, at: Result<usize, GrammarError>) -> GrammarError {
        match at {
            Ok(offending) => self.no_viable(start, offending),
            Err(lexer) => lexer,
        }
    }

    /// The prediction's walk over a whole nested interpolation from `i`: the index after it, or where
    /// no alternative goes on (`Err(Ok(index))`), or the lexer's error (`Err(Err(e))`).
    fn skip_interpolation(&self, i: usize) -> Result<usize, Result<usize, GrammarError>> {
        let k = |j: usize| self.kind_at(j).map_err(Err);
        let mut j = i + 1;
        // The paired prefix: name (. name)*
        let mut pair = Pair::Start;
        let node_state = loop {
            match (pair, k(j)?) {
                (Pair::Start | Pair::Dot, Some(Tk::Id)) => {
                    pair = Pair::Named;
                    j += 1;
                }
                (Pair::Start | Pair::Dot, Some(Tk::InterOpen)) => {
                    j = self.skip_interpolation(j)?;
                    pair = Pair::Named;
                }
                (Pair::Named, Some(Tk::Dot)) => {
                    pair = Pair::Dot;
                    j += 1;
                }
                (Pair::Named, Some(Tk::Colon)) => {
                    j = self.skip_sequence(j + 1)?;
                    return if k(j)? == Some(Tk::BraceClose) {
                        Ok(j + 1)
                    } else {
                        Err(Ok(j))
                    };
                }
                (Pair::Start, _) => break NodeAt::Start,
                (Pair::Dot, _) => break NodeAt::AfterDot,
                (Pair::Named, _) => break NodeAt::Keyed,
            }
        };
        // The rest of a node: DOT* (key | [key]) (.key | [key])* INTER_CLOSE
        let mut at = node_state;
        loop {
            let kind = k(j)?;
            at = match (at, kind) {
                (NodeAt::Start, Some(Tk::Dot)) => NodeAt::Start,
                (NodeAt::Start | NodeAt::AfterDot | NodeAt::InBracket, Some(Tk::InterOpen)) => {
                    j = self.skip_interpolation(j)?;
                    at = if at == NodeAt::InBracket {
                        NodeAt::BracketKeyed
                    } else {
                        NodeAt::Keyed
                    };
                    continue;
                }
                (NodeAt::Start | NodeAt::AfterDot, Some(Tk::Id | Tk::InterKey)) => NodeAt::Keyed,
                (NodeAt::InBracket, Some(Tk::Id | Tk::InterKey)) => NodeAt::BracketKeyed,
                (NodeAt::Start | NodeAt::Keyed, Some(Tk::BracketOpen)) => NodeAt::InBracket,
                (NodeAt::BracketKeyed, Some(Tk::BracketClose)) => NodeAt::Keyed,
                (NodeAt::Keyed, Some(Tk::Dot)) => NodeAt::AfterDot,
                (NodeAt::Keyed, Some(Tk::InterClose)) => return Ok(j + 1),
                _ => return Err(Ok(j)),
            };
            j += 1;
        }
    }

    /// `sequence?` from `i` (strictly): the index after it.
    fn skip_sequence(&self, i: usize) -> Result<usize, Result<usize, GrammarError>> {
        let k = |j: usize| self.kind_at(j).map_err(Err);
        let mut j = i;
        if has(element_tokens(), k(j)?) {
            j = self.skip_element(j)?;
        }
        while k(j)? == Some(Tk::Comma) {
            j += 1;
            if has(element_tokens(), k(j)?) {
                j = self.skip_element(j)?;
            }
        }
        Ok(j)
    }

    fn skip_element(&self, i: usize) -> Result<usize, Result<usize, GrammarError>> {
        let k = |j: usize| self.kind_at(j).map_err(Err);
        let mut j = i;
        match k(j)? {
            Some(Tk::QuoteOpenSingle | Tk::QuoteOpenDouble) => {
                j += 1;
                loop {
                    match k(j)? {
                        Some(Tk::InterOpen) => j = self.skip_interpolation(j)?,
                        kind if has(text_tokens(), kind) => j += 1,
                        Some(Tk::QuoteClose) => return Ok(j + 1),
                        _ => return Err(Ok(j)),
                    }
                }
            }
            Some(Tk::BracketOpen) => {
                j = self.skip_sequence(j + 1)?;
                if k(j)? == Some(Tk::BracketClose) {
                    Ok(j + 1)
                } else {
                    Err(Ok(j))
                }
            }
            Some(Tk::BraceOpen) => {
                j += 1;
                if k(j)? == Some(Tk::BraceClose) {
                    return Ok(j + 1);
                }
                loop {
                    if !has(dict_key_tokens(), k(j)?) {
                        return Err(Ok(j));
                    }
                    while has(dict_key_tokens(), k(j)?) {
                        j += 1;
                    }
                    if k(j)? != Some(Tk::Colon) {
                        return Err(Ok(j));
                    }
                    j += 1;
                    if !has(element_tokens(), k(j)?) {
                        return Err(Ok(j));
                    }
                    j = self.skip_element(j)?;
                    match k(j)? {
                        Some(Tk::Comma) => j += 1,
                        Some(Tk::BraceClose) => return Ok(j + 1),
                        _ => return Err(Ok(j)),
                    }
                }
            }
            kind if has(prim_tokens(), kind) => {
                while has(prim_tokens(), k(j)?) {
                    if k(j)? == Some(Tk::InterOpen) {
                        j = self.skip_interpolation(j)?;
                    } else {
                        j += 1;
                    }
                }
                Ok(j)
            }
            _ => Err(Ok(j)),
        }
    }

    // interpolationNode: INTER_OPEN DOT* (configKey | BRACKET_OPEN configKey BRACKET_CLOSE)
    //                    (DOT configKey | BRACKET_OPEN configKey BRACKET_CLOSE)* INTER_CLOSE
    fn node(&mut self) -> Step<()> {
        self.consume()?;
        let dots = key_tokens() | set(&[Tk::BracketOpen, Tk::Dot]);
        self.sync_block(dots)?;
        while self.la(0)? == Some(Tk::Dot) {
            self.consume()?;
            self.sync_loop_back(dots)?;
        }
        self.sync_block(key_tokens() | set(&[Tk::BracketOpen]))?;
        match self.la(0)? {
            Some(Tk::BracketOpen) => {
                self.consume()?;
                self.config_key(set(&[Tk::BracketClose]))?;
                self.match_tok(Some(Tk::BracketClose), node_more())?;
            }
            kind if has(key_tokens(), kind) => self.config_key(node_more())?,
            _ => return Err(self.no_viable(self.pos, self.pos)),
        }
        self.sync_block(node_more())?;
        while matches!(self.la(0)?, Some(Tk::Dot | Tk::BracketOpen)) {
            if self.la(0)? == Some(Tk::Dot) {
                self.consume()?;
                self.config_key(node_more())?;
            } else {
                self.consume()?;
                self.config_key(set(&[Tk::BracketClose]))?;
                self.match_tok(Some(Tk::BracketClose), node_more())?;
            }
            self.sync_loop_back(node_more())?;
        }
        self.match_tok(Some(Tk::InterClose), 0)
    }

    // configKey: interpolation | ID | INTER_KEY
    fn config_key(&mut self, follow: Set) -> Step<()> {
        self.sync_block(key_tokens())?;
        match self.la(0)? {
            Some(Tk::InterOpen) => self.interpolation(follow),
            Some(Tk::Id | Tk::InterKey) => self.consume(),
            _ => Err(self.no_viable(self.pos, self.pos)),
        }
    }

    // interpolationResolver: INTER_OPEN resolverName COLON sequence? BRACE_CLOSE
    fn resolver(&mut self, follow: Set) -> Step<()> {
        self.consume()?;
        self.resolver_name()?;
        let body = element_tokens() | set(&[Tk::Comma, Tk::BraceClose]);
        self.match_tok(Some(Tk::Colon), body)?;
        self.sync_block(body)?;
        if has(element_tokens() | set(&[Tk::Comma]), self.la(0)?) {
            self.sequence(set(&[Tk::BraceClose]))?;
        }
        self.match_tok(Some(Tk::BraceClose), follow)
    }

    // resolverName: (interpolation | ID) (DOT (interpolation | ID))*
    fn resolver_name(&mut self) -> Step<()> {
        let name = set(&[Tk::InterOpen, Tk::Id]);
        let after = set(&[Tk::Dot, Tk::Colon]);
        self.sync_block(name)?;
        self.name_piece(after)?;
        while self.la(0)? == Some(Tk::Dot) {
            self.consume()?;
            self.sync_block(name)?;
            self.name_piece(after)?;
        }
        Ok(())
    }

    fn name_piece(&mut self, follow: Set) -> Step<()> {
        match self.la(0)? {
            Some(Tk::InterOpen) => self.interpolation(follow),
            Some(Tk::Id) => self.consume(),
            _ => Err(self.no_viable(self.pos, self.pos)),
        }
    }

    // sequence: (element (COMMA element?)*) | (COMMA element?)+
    fn sequence(&mut self, follow: Set) -> Step<()> {
        let elements = element_tokens();
        self.sync_block(elements | set(&[Tk::Comma]))?;
        let more = then(EPS | set(&[Tk::Comma]), follow);
        match self.la(0)? {
            Some(Tk::Comma) => loop {
                self.consume()?;
                if has(elements, self.la(0)?) {
                    self.element(more)?;
                }
                if self.la(0)? != Some(Tk::Comma) {
                    return Ok(());
                }
            },
            kind if has(elements, kind) => {
                self.element(more)?;
                while self.la(0)? == Some(Tk::Comma) {
                    self.consume()?;
                    if has(elements, self.la(0)?) {
                        self.element(more)?;
                    }
                }
                Ok(())
            }
            _ => Err(self.no_viable(self.pos, self.pos)),
        }
    }

    // element: primitive | quotedValue | listContainer | dictContainer
    fn element(&mut self, follow: Set) -> Step<()> {
        self.sync_block(element_tokens())?;
        match self.la(0)? {
            Some(Tk::QuoteOpenSingle | Tk::QuoteOpenDouble) => {
                self.consume()?;
                let close = set(&[Tk::QuoteClose]);
                self.sync_block(text_tokens() | close)?;
                if has(text_tokens(), self.la(0)?) {
                    self.text_rule(close)?;
                }
                self.match_tok(Some(Tk::QuoteClose), follow)
            }
            Some(Tk::BracketOpen) => {
                self.consume()?;
                let close = set(&[Tk::BracketClose]);
                let first = element_tokens() | set(&[Tk::Comma]);
                self.sync_block(first | close)?;
                if has(first, self.la(0)?) {
                    self.sequence(close)?;
                }
                self.match_tok(Some(Tk::BracketClose), follow)
            }
            Some(Tk::BraceOpen) => {
                self.consume()?;
                let more = set(&[Tk::BraceClose, Tk::Comma]);
                self.sync_block(dict_key_tokens() | set(&[Tk::BraceClose]))?;
                if has(dict_key_tokens(), self.la(0)?) {
                    self.pair(more)?;
                    self.sync_block(more)?;
                    while self.la(0)? == Some(Tk::Comma) {
                        self.consume()?;
                        self.pair(more)?;
                        self.sync_loop_back(more)?;
                    }
                }
                self.match_tok(Some(Tk::BraceClose), follow)
            }
            kind if has(prim_tokens(), kind) => {
                let prims = prim_tokens();
                loop {
                    self.sync_block(prims)?;
                    if self.la(0)? == Some(Tk::InterOpen) {
                        self.interpolation(prims | follow)?;
                    } else {
                        self.consume()?;
                    }
                    if !has(prims, self.la(0)?) {
                        return Ok(());
                    }
                }
            }
            _ => Err(self.no_viable(self.pos, self.pos)),
        }
    }

    // dictKeyValuePair: dictKey COLON element
    fn pair(&mut self, follow: Set) -> Step<()> {
        self.sync_block(dict_key_tokens())?;
        while has(dict_key_tokens(), self.la(0)?) {
            self.consume()?;
        }
        self.match_tok(Some(Tk::Colon), element_tokens())?;
        self.element(follow)
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum NodeAt {
    Start,
    AfterDot,
    Keyed,
    InBracket,
    BracketKeyed,
}
