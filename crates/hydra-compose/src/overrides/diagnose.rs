//! ANTLR's first error message for an override that does not parse, worded as Hydra's generated parser words it.
//!
//! Hydra raises on the first error ANTLR reports, so only where and how ANTLR 4's `DefaultErrorStrategy` reports
//! it matters. This walks the tokens as `OverrideParser.g4`'s generated parser does: `sync` before each block
//! and loop (an unexpected token is "extraneous" when the one after it would do, else "mismatched"), `match`
//! with single-token deletion and insertion ("missing X at Y"), LL(1) blocks that fail as "no viable
//! alternative" at one token, and the adaptive predictions (`value`, `packageOrGroup`, `element`, the
//! function argument name) whose lookahead spans the tokens named in "no viable alternative at input '...'".
//! The lexer is lazy, so a token that does not lex is reported only when the parser first looks at it (or when
//! a "no viable alternative" report reads the text of the whole input).

use super::GrammarError;
use super::lexer::{Tok, Token};
use crate::antlr_text::{quote, token_set};

/// A set of token kinds (the bit of each kind's position in [`ORDER`], EOF first as ANTLR sorts it).
type Set = u32;

/// Token kinds in `OverrideLexer.tokens` order, EOF (-1) first, with the names ANTLR prints for them.
const ORDER: [(Tok, &str); 26] = [
    (Tok::Eof, "<EOF>"),
    (Tok::Equal, "EQUAL"),
    (Tok::Tilde, "'~'"),
    (Tok::Plus, "'+'"),
    (Tok::At, "'@'"),
    (Tok::Colon, "':'"),
    (Tok::Slash, "'/'"),
    (Tok::KeySpecial, "KEY_SPECIAL"),
    (Tok::DotPath, "DOT_PATH"),
    (Tok::POpen, "POPEN"),
    (Tok::Comma, "COMMA"),
    (Tok::PClose, "PCLOSE"),
    (Tok::BracketOpen, "BRACKET_OPEN"),
    (Tok::BracketClose, "BRACKET_CLOSE"),
    (Tok::BraceOpen, "BRACE_OPEN"),
    (Tok::BraceClose, "BRACE_CLOSE"),
    (Tok::Float, "FLOAT"),
    (Tok::Int, "INT"),
    (Tok::Bool, "BOOL"),
    (Tok::Null, "NULL"),
    (Tok::UnquotedChar, "UNQUOTED_CHAR"),
    (Tok::Id, "ID"),
    (Tok::Esc, "ESC"),
    (Tok::Ws, "WS"),
    (Tok::Quoted, "QUOTED_VALUE"),
    (Tok::Interpolation, "INTERPOLATION"),
];

const fn bit(kind: Tok) -> Set {
    let mut i = 0;
    while i < ORDER.len() {
        if ORDER[i].0 as u8 == kind as u8 {
            return 1 << i;
        }
        i += 1;
    }
    0
}

const fn set(kinds: &[Tok]) -> Set {
    let mut out = 0;
    let mut i = 0;
    while i < kinds.len() {
        out |= bit(kinds[i]);
        i += 1;
    }
    out
}

/// The tokens a `primitive`'s loop takes (all but QUOTED_VALUE).
const PRIM_LOOP: Set = set(&[
    Tok::Colon,
    Tok::Float,
    Tok::Int,
    Tok::Bool,
    Tok::Null,
    Tok::UnquotedChar,
    Tok::Id,
    Tok::Esc,
    Tok::Ws,
    Tok::Interpolation,
]);
/// FIRST(element).
const ELEMENT: Set = PRIM_LOOP | set(&[Tok::Quoted, Tok::BracketOpen, Tok::BraceOpen]);
/// The tokens of a `dictKey`.
const DICT_KEY: Set = set(&[
    Tok::Float,
    Tok::Int,
    Tok::Bool,
    Tok::Null,
    Tok::UnquotedChar,
    Tok::Id,
    Tok::Esc,
    Tok::Ws,
]);
const KEY_START: Set = set(&[Tok::Id, Tok::KeySpecial, Tok::DotPath]);

fn render(s: Set) -> String {
    token_set(s, ORDER.iter().map(|(_, name)| *name))
}

/// How the override called `key`: what may follow it.
#[derive(Clone, Copy)]
enum KeyCtx {
    /// `key EQUAL ...` and `+key EQUAL ...`
    Equal,
    /// `~key (EQUAL value?)?`
    Tilde,
}

struct Diag<'a> {
    chars: &'a [char],
    /// The tokens that lexed; when `lex_error` is set, the token after the last one does not lex.
    tokens: &'a [Token],
    lex_error: Option<usize>,
    pos: usize,
}

type Step<T> = Result<T, GrammarError>;

/// The first error ANTLR reports for `tokens` (ending in EOF, or cut where the lexer failed at `lex_error`);
/// `None` when the parse succeeds.
pub(super) fn diagnose(
    chars: &[char],
    tokens: &[Token],
    lex_error: Option<usize>,
) -> Option<GrammarError> {
    if max_nesting(tokens) > MAX_NESTING {
        return None;
    }
    let mut d = Diag {
        chars,
        tokens,
        lex_error,
        pos: 0,
    };
    d.override_rule().err()
}

/// Deepest nesting this walk follows (it recurses once per unclosed bracket, brace or call); deeper input
/// keeps the parser's own error rather than risking the stack.
const MAX_NESTING: usize = 200;

fn max_nesting(tokens: &[Token]) -> usize {
    let mut depth: usize = 0;
    let mut deepest = 0;
    for t in tokens {
        match t.kind {
            Tok::BracketOpen | Tok::BraceOpen | Tok::POpen => {
                depth += 1;
                deepest = deepest.max(depth);
            }
            Tok::BracketClose | Tok::BraceClose | Tok::PClose => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    deepest
}

impl Diag<'_> {
    /// The kind of the token `ahead` tokens from the current one (0 = LT(1)); looking at the token that
    /// does not lex is the lexer's error.
    fn la(&self, ahead: usize) -> Step<Tok> {
        self.kind_at(self.pos + ahead)
    }

    fn kind_at(&self, index: usize) -> Step<Tok> {
        match self.tokens.get(index) {
            Some(t) => Ok(t.kind),
            None => match self.lex_error {
                Some(column) => Err(GrammarError::Lexer { column }),
                None => Ok(Tok::Eof),
            },
        }
    }

    fn text(&self, index: usize) -> String {
        match self.tokens.get(index) {
            Some(t) if t.kind != Tok::Eof => self.chars[t.start..t.end].iter().collect(),
            _ => "<EOF>".to_owned(),
        }
    }

    /// Consume LT(1); the token stream then fetches the next one.
    fn consume(&mut self) -> Step<()> {
        self.pos += 1;
        self.la(0).map(|_| ())
    }

    /// "no viable alternative": ANTLR's report reads the input's text through `getText`, which lexes the
    /// whole rest of the input first, so a later token that does not lex is the error instead.
    fn no_viable(&self, start: usize, offending: usize) -> GrammarError {
        if let Some(column) = self.lex_error {
            return GrammarError::Lexer { column };
        }
        let input = if self.kind_at(start) == Ok(Tok::Eof) {
            "<EOF>".to_owned()
        } else {
            (start..=offending)
                .take_while(|i| self.tokens.get(*i).is_some_and(|t| t.kind != Tok::Eof))
                .map(|i| self.text(i))
                .collect()
        };
        GrammarError::NoViableAlt {
            input: quote(&input),
        }
    }

    fn mismatched(&self, expected: Set) -> GrammarError {
        GrammarError::Mismatched {
            found: quote(&self.text(self.pos)),
            expected: render(expected),
        }
    }

    fn extraneous(&self, expected: Set) -> GrammarError {
        GrammarError::Extraneous {
            found: quote(&self.text(self.pos)),
            expected: render(expected),
        }
    }

    /// `sync` at a block start or loop entry whose next tokens (`next`, no epsilon) miss LT(1):
    /// single-token deletion when LT(2) fits, else an input mismatch.
    fn sync_block(&self, next: Set) -> Step<()> {
        let la1 = self.la(0)?;
        if next & bit(la1) != 0 {
            return Ok(());
        }
        let la2 = self.la(1)?;
        if next & bit(la2) != 0 {
            Err(self.extraneous(next))
        } else {
            Err(self.mismatched(next))
        }
    }

    /// `sync` at a `*` loop back: an unexpected token is reported as extraneous.
    fn sync_loop_back(&self, next: Set) -> Step<()> {
        let la1 = self.la(0)?;
        if next & bit(la1) != 0 {
            Ok(())
        } else {
            Err(self.extraneous(next))
        }
    }

    /// `match(kind)`: consume it, or recover inline (deletion, then insertion when LT(1) fits what follows
    /// the missing token, `after`), else an input mismatch.
    fn match_tok(&mut self, kind: Tok, after: Set) -> Step<()> {
        let la1 = self.la(0)?;
        if la1 == kind {
            if kind != Tok::Eof {
                self.consume()?;
            }
            return Ok(());
        }
        let la2 = self.la(1)?;
        if la2 == kind {
            return Err(self.extraneous(bit(kind)));
        }
        if after & bit(la1) != 0 {
            return Err(GrammarError::Missing {
                missing: render(bit(kind)),
                at: quote(&self.text(self.pos)),
            });
        }
        Err(self.mismatched(bit(kind)))
    }

    // override: (key EQUAL value? | TILDE key (EQUAL value?)? | PLUS PLUS? key EQUAL value?) EOF
    fn override_rule(&mut self) -> Step<()> {
        let start = KEY_START | set(&[Tok::Equal, Tok::At, Tok::Tilde, Tok::Plus]);
        self.sync_block(start)?;
        let value_or_eof = ELEMENT | bit(Tok::Eof);
        match self.la(0)? {
            Tok::Tilde => {
                self.consume()?;
                self.key(KeyCtx::Tilde)?;
                self.sync_block(set(&[Tok::Eof, Tok::Equal]))?;
                if self.la(0)? == Tok::Equal {
                    self.consume()?;
                    self.optional_value()?;
                }
            }
            Tok::Plus => {
                self.consume()?;
                self.sync_block(KEY_START | set(&[Tok::Equal, Tok::At, Tok::Plus]))?;
                if self.la(0)? == Tok::Plus {
                    self.consume()?;
                }
                self.key(KeyCtx::Equal)?;
                self.match_tok(Tok::Equal, value_or_eof)?;
                self.optional_value()?;
            }
            _ => {
                self.key(KeyCtx::Equal)?;
                self.match_tok(Tok::Equal, value_or_eof)?;
                self.optional_value()?;
            }
        }
        self.match_tok(Tok::Eof, bit(Tok::Eof))
    }

    /// `value?` after EQUAL: a block whose exit is EOF.
    fn optional_value(&mut self) -> Step<()> {
        self.sync_block(ELEMENT | bit(Tok::Eof))?;
        if ELEMENT & bit(self.la(0)?) != 0 {
            self.value()?;
        }
        Ok(())
    }

    // key: packageOrGroup (AT package)?
    fn key(&mut self, ctx: KeyCtx) -> Step<()> {
        let after_key = match ctx {
            KeyCtx::Equal => bit(Tok::Equal),
            KeyCtx::Tilde => set(&[Tok::Equal, Tok::Eof]),
        };
        // packageOrGroup: package | ID (SLASH ID)+ -- predicted: ID SLASH takes the second alternative.
        if self.la(0)? == Tok::Id && self.la(1)? == Tok::Slash {
            self.consume()?;
            while self.la(0)? == Tok::Slash {
                self.consume()?;
                self.match_tok(Tok::Id, set(&[Tok::Slash, Tok::At]) | after_key)?;
            }
        } else {
            self.package()?;
        }
        if self.la(0)? == Tok::At {
            self.consume()?;
            self.package()?;
        }
        Ok(())
    }

    // package: ( | ID | KEY_SPECIAL | DOT_PATH) -- an LL(1) block; its empty alternative is taken on
    // what follows a key anywhere in the grammar.
    fn package(&mut self) -> Step<()> {
        match self.la(0)? {
            Tok::Eof | Tok::Equal | Tok::At => Ok(()),
            Tok::Id | Tok::KeySpecial | Tok::DotPath => self.consume(),
            _ => Err(self.no_viable(self.pos, self.pos)),
        }
    }

    // value: element | simpleChoiceSweep -- predicted by reading the whole first element.
    fn value(&mut self) -> Step<()> {
        let start = self.pos;
        let end = self.recognize_element(start)?;
        let sweep = self.kind_at(end)? == Tok::Comma;
        self.element()?;
        if sweep {
            while self.la(0)? == Tok::Comma {
                self.consume()?;
                self.element()?;
            }
        }
        Ok(())
    }

    /// The adaptive prediction's walk over one element from `i`: the index after it, or "no viable
    /// alternative" from the decision's first token `self.pos` to the token where no alternative goes on.
    fn recognize_element(&self, i: usize) -> Step<usize> {
        let fail = |at: usize| -> Step<usize> {
            self.kind_at(at)?;
            Err(self.no_viable(self.pos, at))
        };
        let kind = self.kind_at(i)?;
        match kind {
            Tok::Quoted => Ok(i + 1),
            Tok::Id if self.kind_at(i + 1)? == Tok::POpen => {
                let mut j = i + 2;
                if self.kind_at(j)? == Tok::PClose {
                    return Ok(j + 1);
                }
                loop {
                    if self.kind_at(j)? == Tok::Id && self.kind_at(j + 1)? == Tok::Equal {
                        j += 2;
                    }
                    j = self.recognize_element(j)?;
                    match self.kind_at(j)? {
                        Tok::Comma => j += 1,
                        Tok::PClose => return Ok(j + 1),
                        _ => return fail(j),
                    }
                }
            }
            k if PRIM_LOOP & bit(k) != 0 => {
                let mut j = i + 1;
                while PRIM_LOOP & bit(self.kind_at(j)?) != 0 {
                    j += 1;
                }
                Ok(j)
            }
            Tok::BracketOpen => {
                let mut j = i + 1;
                if self.kind_at(j)? == Tok::BracketClose {
                    return Ok(j + 1);
                }
                loop {
                    j = self.recognize_element(j)?;
                    match self.kind_at(j)? {
                        Tok::Comma => j += 1,
                        Tok::BracketClose => return Ok(j + 1),
                        _ => return fail(j),
                    }
                }
            }
            Tok::BraceOpen => {
                let mut j = i + 1;
                if self.kind_at(j)? == Tok::BraceClose {
                    return Ok(j + 1);
                }
                loop {
                    if DICT_KEY & bit(self.kind_at(j)?) == 0 {
                        return fail(j);
                    }
                    while DICT_KEY & bit(self.kind_at(j)?) != 0 {
                        j += 1;
                    }
                    if self.kind_at(j)? != Tok::Colon {
                        return fail(j);
                    }
                    j = self.recognize_element(j + 1)?;
                    match self.kind_at(j)? {
                        Tok::Comma => j += 1,
                        Tok::BraceClose => return Ok(j + 1),
                        _ => return fail(j),
                    }
                }
            }
            _ => fail(i),
        }
    }

    // element: primitive | listContainer | dictContainer | function
    fn element(&mut self) -> Step<()> {
        self.sync_block(ELEMENT)?;
        match self.la(0)? {
            Tok::BracketOpen => self.list(),
            Tok::BraceOpen => self.dict(),
            Tok::Quoted => self.consume(),
            Tok::Id if self.la(1)? == Tok::POpen => self.function(),
            _ => {
                while PRIM_LOOP & bit(self.la(0)?) != 0 {
                    self.consume()?;
                }
                Ok(())
            }
        }
    }

    // function: ID POPEN (argName? element (COMMA argName? element)*)? PCLOSE
    fn function(&mut self) -> Step<()> {
        self.consume()?;
        self.consume()?;
        self.separated(ELEMENT, Tok::PClose, Self::argument)
    }

    /// `argName? element`: the name is predicted by ID EQUAL; after an ID, only what may follow it in a
    /// primitive, a call or an argument lets the element go on.
    fn argument(&mut self) -> Step<()> {
        self.sync_block(ELEMENT)?;
        if self.la(0)? == Tok::Id {
            let next = self.la(1)?;
            if next == Tok::Equal {
                self.consume()?;
                self.consume()?;
            } else if PRIM_LOOP & bit(next) == 0
                && !matches!(next, Tok::POpen | Tok::Comma | Tok::PClose)
            {
                return Err(self.no_viable(self.pos, self.pos + 1));
            }
        }
        self.element()
    }

    /// `(item (COMMA item)*)? close` once the opener is consumed, synced as ANTLR's generated loop syncs it:
    /// the arguments of a call, the elements of a list, the pairs of a dict.
    fn separated(&mut self, first: Set, close: Tok, item: fn(&mut Self) -> Step<()>) -> Step<()> {
        self.sync_block(first | bit(close))?;
        if first & bit(self.la(0)?) != 0 {
            item(self)?;
            let more = set(&[Tok::Comma, close]);
            self.sync_block(more)?;
            while self.la(0)? == Tok::Comma {
                self.consume()?;
                item(self)?;
                self.sync_loop_back(more)?;
            }
        }
        self.match_tok(close, 0)
    }

    // listContainer: BRACKET_OPEN (element (COMMA element)*)? BRACKET_CLOSE
    fn list(&mut self) -> Step<()> {
        self.consume()?;
        self.separated(ELEMENT, Tok::BracketClose, Self::element)
    }

    // dictContainer: BRACE_OPEN (dictKeyValuePair (COMMA dictKeyValuePair)*)? BRACE_CLOSE
    fn dict(&mut self) -> Step<()> {
        self.consume()?;
        self.separated(DICT_KEY, Tok::BraceClose, Self::pair)
    }

    // dictKeyValuePair: dictKey COLON element
    fn pair(&mut self) -> Step<()> {
        self.sync_block(DICT_KEY)?;
        while DICT_KEY & bit(self.la(0)?) != 0 {
            self.consume()?;
        }
        self.match_tok(Tok::Colon, ELEMENT)?;
        self.element()
    }
}
