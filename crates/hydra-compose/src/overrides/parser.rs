//! Recursive-descent parser for `OverrideParser.g4`, visiting as it parses (functions are evaluated here).

use std::collections::HashMap;

use super::diagnose::diagnose;
use super::element::Quote;
use super::functions::{self, Call};
use super::lexer::{Tok, Token, tokenize_prefix};
use super::value::{Choice, Val};
use super::{GrammarError, OverrideKind};
use crate::node::Key;
use crate::scalar::{Scalar, parse_int_digits};

/// An override before its value is split into element or sweep.
pub(super) struct Parsed {
    pub kind: OverrideKind,
    pub key_or_group: String,
    pub package: Option<String>,
    pub value: Option<Val>,
}

/// Deepest nesting of lists, dicts and calls; deeper input is rejected rather than overflowing the stack.
const MAX_DEPTH: usize = 200;

/// Parse and visit one override. On any failure ANTLR's first syntax error wins, as Hydra's visitor (and
/// so its functions) only runs on a complete parse tree.
pub(super) fn parse(text: &str) -> Result<Parsed, GrammarError> {
    let chars: Vec<char> = text.chars().collect();
    let (tokens, lex_error) = tokenize_prefix(&chars);
    let result = match lex_error {
        Some(column) => Err(GrammarError::Lexer { column }),
        None => Parser {
            chars: &chars,
            tokens: &tokens,
            pos: 0,
            depth: 0,
        }
        .parse_override(),
    };
    result.map_err(|e| diagnose(&chars, &tokens, lex_error).unwrap_or(e))
}

struct Parser<'a> {
    chars: &'a [char],
    tokens: &'a [Token],
    pos: usize,
    depth: usize,
}

/// Tokens a primitive may be made of (besides a lone quoted value).
fn is_primitive_token(kind: Tok) -> bool {
    matches!(
        kind,
        Tok::Id
            | Tok::Null
            | Tok::Int
            | Tok::Float
            | Tok::Bool
            | Tok::Interpolation
            | Tok::UnquotedChar
            | Tok::Colon
            | Tok::Esc
            | Tok::Ws
    )
}

/// Tokens a dict key may be made of: a primitive's, without `:` and interpolations.
fn is_dict_key_token(kind: Tok) -> bool {
    is_primitive_token(kind) && !matches!(kind, Tok::Colon | Tok::Interpolation)
}

const EXPECT_ELEMENT: &str = "{':', BRACKET_OPEN, BRACE_OPEN, FLOAT, INT, BOOL, NULL, UNQUOTED_CHAR, ID, ESC, WS, QUOTED_VALUE, INTERPOLATION}";

impl<'a> Parser<'a> {
    fn peek(&self) -> Tok {
        self.peek_at(0)
    }

    fn peek_at(&self, ahead: usize) -> Tok {
        self.tokens
            .get(self.pos + ahead)
            .map_or(Tok::Eof, |t| t.kind)
    }

    fn text_of(&self, t: &Token) -> String {
        self.chars[t.start..t.end].iter().collect()
    }

    fn bump(&mut self) -> Token {
        let t = self.tokens.get(self.pos).copied().unwrap_or(Token {
            kind: Tok::Eof,
            start: 0,
            end: 0,
        });
        if t.kind != Tok::Eof {
            self.pos += 1;
        }
        t
    }

    fn error(&self, expected: &'static str) -> GrammarError {
        let found = match self.tokens.get(self.pos) {
            Some(t) if t.kind != Tok::Eof => self.text_of(t),
            _ => "<EOF>".to_owned(),
        };
        GrammarError::Syntax { found, expected }
    }

    fn expect(&mut self, kind: Tok, expected: &'static str) -> Result<Token, GrammarError> {
        if self.peek() == kind {
            Ok(self.bump())
        } else {
            Err(self.error(expected))
        }
    }

    // override: (key EQUAL value? | TILDE key (EQUAL value?)? | PLUS PLUS? key EQUAL value?) EOF
    fn parse_override(&mut self) -> Result<Parsed, GrammarError> {
        let kind = match self.peek() {
            Tok::Tilde => {
                self.bump();
                OverrideKind::Delete
            }
            Tok::Plus => {
                self.bump();
                if self.peek() == Tok::Plus {
                    self.bump();
                    OverrideKind::ForceAdd
                } else {
                    OverrideKind::Add
                }
            }
            _ => OverrideKind::Change,
        };
        let (key_or_group, package) = self.parse_key()?;
        let value = if kind == OverrideKind::Delete && self.peek() == Tok::Eof {
            None
        } else {
            self.expect(Tok::Equal, "EQUAL")?;
            if self.peek() == Tok::Eof {
                Some(Val::str(String::new()))
            } else {
                Some(self.parse_value()?)
            }
        };
        self.expect(Tok::Eof, "<EOF>")?;
        Ok(Parsed {
            kind,
            key_or_group,
            package,
            value,
        })
    }

    // key: packageOrGroup (AT package)?
    // packageOrGroup: package | ID (SLASH ID)+
    // package: ( | ID | KEY_SPECIAL | DOT_PATH)
    fn parse_key(&mut self) -> Result<(String, Option<String>), GrammarError> {
        let key = if self.peek() == Tok::Id && self.peek_at(1) == Tok::Slash {
            let first = self.bump();
            let mut key = self.text_of(&first);
            while self.peek() == Tok::Slash {
                self.bump();
                let id = self.expect(Tok::Id, "ID")?;
                key.push('/');
                key.push_str(&self.text_of(&id));
            }
            key
        } else {
            self.parse_package()
        };
        let package = if self.peek() == Tok::At {
            self.bump();
            Some(self.parse_package())
        } else {
            None
        };
        Ok((key, package))
    }

    fn parse_package(&mut self) -> String {
        if matches!(self.peek(), Tok::Id | Tok::KeySpecial | Tok::DotPath) {
            let t = self.bump();
            self.text_of(&t)
        } else {
            String::new()
        }
    }

    // value: element | element (COMMA element)+
    fn parse_value(&mut self) -> Result<Val, GrammarError> {
        let first = self.parse_element()?;
        if self.peek() != Tok::Comma {
            return Ok(first);
        }
        let mut items = vec![first];
        while self.peek() == Tok::Comma {
            self.bump();
            items.push(self.parse_element()?);
        }
        Ok(Val::Choice(Choice::new(items, true)))
    }

    // element: primitive | listContainer | dictContainer | function
    fn parse_element(&mut self) -> Result<Val, GrammarError> {
        self.depth += 1;
        if self.depth > MAX_DEPTH {
            return Err(self.error("a shallower value"));
        }
        let result = match self.peek() {
            Tok::Id if self.peek_at(1) == Tok::POpen => self.parse_function(),
            Tok::BracketOpen => self.parse_list(),
            Tok::BraceOpen => self.parse_dict(),
            Tok::Quoted => {
                let t = self.bump();
                Ok(unquote(&self.chars[t.start..t.end]))
            }
            kind if is_primitive_token(kind) => {
                let tokens = self.take_while(is_primitive_token);
                self.primitive(&tokens)
            }
            _ => Err(self.error(EXPECT_ELEMENT)),
        };
        self.depth -= 1;
        result
    }

    fn take_while(&mut self, pred: fn(Tok) -> bool) -> Vec<Token> {
        let mut out = Vec::new();
        while pred(self.peek()) {
            out.push(self.bump());
        }
        out
    }

    // listContainer: BRACKET_OPEN (element (COMMA element)*)? BRACKET_CLOSE
    fn parse_list(&mut self) -> Result<Val, GrammarError> {
        self.bump();
        let mut items = Vec::new();
        if self.peek() != Tok::BracketClose {
            items.push(self.parse_element()?);
            while self.peek() == Tok::Comma {
                self.bump();
                items.push(self.parse_element()?);
            }
        }
        self.expect(Tok::BracketClose, "{',', BRACKET_CLOSE}")?;
        Ok(Val::List(items))
    }

    // dictContainer: BRACE_OPEN (dictKeyValuePair (COMMA dictKeyValuePair)*)? BRACE_CLOSE
    // dictKeyValuePair: dictKey COLON element
    fn parse_dict(&mut self) -> Result<Val, GrammarError> {
        self.bump();
        let mut pairs: Vec<(Key, Val)> = Vec::new();
        // Python's dict: keys equal under `==` (`1 == 1.0 == True`) are one key.
        let mut index: HashMap<Key, usize> = HashMap::new();
        if self.peek() != Tok::BraceClose {
            loop {
                let key_tokens = self.take_while(is_dict_key_token);
                if key_tokens.is_empty() {
                    return Err(self.error(
                        "{BRACE_CLOSE, FLOAT, INT, BOOL, NULL, UNQUOTED_CHAR, ID, ESC, WS}",
                    ));
                }
                let key = dict_key(self.primitive(&key_tokens)?);
                self.expect(Tok::Colon, "':'")?;
                let value = self.parse_element()?;
                // A Python dict: a repeated key keeps its first position and takes the last value.
                let canonical = key.python_canonical();
                match canonical.as_ref().and_then(|k| index.get(k).copied()) {
                    Some(i) => {
                        if let Some(slot) = pairs.get_mut(i) {
                            slot.1 = value;
                        }
                    }
                    None => {
                        if let Some(k) = canonical {
                            index.insert(k, pairs.len());
                        }
                        pairs.push((key, value));
                    }
                }
                if self.peek() != Tok::Comma {
                    break;
                }
                self.bump();
            }
        }
        self.expect(Tok::BraceClose, "{',', BRACE_CLOSE}")?;
        Ok(Val::Dict(pairs))
    }

    // function: ID POPEN (argName? element (COMMA argName? element)*)? PCLOSE
    // argName: ID EQUAL
    fn parse_function(&mut self) -> Result<Val, GrammarError> {
        let name_tok = self.bump();
        self.bump(); // POPEN
        let mut args = Vec::new();
        let mut kwargs = Vec::new();
        if self.peek() != Tok::PClose {
            loop {
                if self.peek() == Tok::Id && self.peek_at(1) == Tok::Equal {
                    let name_tok = self.bump();
                    let name = self.text_of(&name_tok);
                    self.bump();
                    kwargs.push((name, self.parse_element()?));
                } else {
                    let value = self.parse_element()?;
                    if !kwargs.is_empty() {
                        return Err(GrammarError::PositionalAfterKeyword);
                    }
                    args.push(value);
                }
                if self.peek() != Tok::Comma {
                    break;
                }
                self.bump();
            }
        }
        let close = self.expect(Tok::PClose, "{',', ')'}")?;
        let name: String = self.text_of(&name_tok);
        let text: String = self.chars[name_tok.start..close.end].iter().collect();
        functions::eval(Call {
            name: &name,
            text: &text,
            args,
            kwargs,
        })
    }

    /// The visitor's `_createPrimitive`: one token is typed, several are concatenated into a string.
    fn primitive(&self, tokens: &[Token]) -> Result<Val, GrammarError> {
        let mut inner = tokens;
        if let [first, rest @ ..] = inner
            && first.kind == Tok::Ws
        {
            if rest.is_empty() {
                return Err(GrammarError::AllWhitespace);
            }
            inner = rest;
        }
        if let [rest @ .., last] = inner
            && last.kind == Tok::Ws
        {
            inner = rest;
        }
        match inner {
            [single] => self.typed_token(single),
            many => {
                let mut out = String::new();
                for t in many {
                    let text = &self.chars[t.start..t.end];
                    if t.kind == Tok::Esc {
                        out.extend(text.iter().skip(1).step_by(2));
                    } else {
                        out.extend(text.iter());
                    }
                }
                Ok(Val::str(out))
            }
        }
    }

    fn typed_token(&self, t: &Token) -> Result<Val, GrammarError> {
        let text = self.text_of(t);
        Ok(match t.kind {
            Tok::Int => {
                let clean: String = text.chars().filter(|c| *c != '_').collect();
                let (negative, digits) = match clean.strip_prefix('-') {
                    Some(rest) => (true, rest),
                    None => (false, clean.strip_prefix('+').unwrap_or(&clean)),
                };
                // The lexer only makes INT tokens of digits, so this fails only on a lexer bug.
                let magnitude = parse_int_digits(digits, 10)
                    .ok_or_else(|| GrammarError::BadInt { text: text.clone() })?;
                Val::int(if negative { -magnitude } else { magnitude })
            }
            Tok::Float => Val::Scalar(Scalar::Float(functions::parse_float_token(&text))),
            Tok::Null => Val::NONE,
            Tok::Bool => Val::Scalar(Scalar::Bool(text.eq_ignore_ascii_case("true"))),
            Tok::Esc => Val::Scalar(Scalar::Str(text.chars().skip(1).step_by(2).collect())),
            _ => Val::str(text),
        })
    }
}

/// A dict key from its primitive value (dict keys are never quoted, never containers).
fn dict_key(v: Val) -> Key {
    match v {
        Val::Scalar(s) => Key(s),
        Val::Quoted(s, _) => Key::from(s),
        _ => Key(Scalar::None),
    }
}

/// The visitor's `_unescape_quoted_string`: drop the quotes, and halve each run of backslashes that
/// precedes a quote of the same kind (an odd run also keeps the quote itself).
fn unquote(token: &[char]) -> Val {
    let (qc, quote) = if token.first() == Some(&'"') {
        ('"', Quote::Double)
    } else {
        ('\'', Quote::Single)
    };
    let body = token
        .get(1..token.len().saturating_sub(1))
        .unwrap_or_default();
    let mut out = String::with_capacity(body.len());
    let mut i = 0;
    while i < body.len() {
        if body[i] == '\\' {
            let run = body[i..].iter().take_while(|c| **c == '\\').count();
            let next = body.get(i + run).copied();
            if next == Some(qc) {
                // `\"` -> `"`, `\\\"` -> `\"`: half the backslashes (rounded down), then the quote.
                out.extend(std::iter::repeat_n('\\', run / 2));
                out.push(qc);
                i += run + 1;
                continue;
            }
            if next.is_none() {
                // Backslashes before the closing quote are escaped in pairs.
                out.extend(std::iter::repeat_n('\\', run / 2));
                i += run;
                continue;
            }
            out.extend(std::iter::repeat_n('\\', run));
            i += run;
        } else {
            out.push(body[i]);
            i += 1;
        }
    }
    Val::Quoted(out, quote)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(s: &str) -> String {
        let chars: Vec<char> = s.chars().collect();
        match unquote(&chars) {
            Val::Quoted(text, _) => text,
            other => panic!("not quoted: {other:?}"),
        }
    }

    #[test]
    fn unquoting_follows_hydra() {
        let cases = [
            ("''", ""),
            (r"'\\'", r"\"),
            (r#""\\\\""#, r"\\"),
            (r"'abc\\'", r"abc\"),
            (r#""abc\\\"def\\\'ghi\\\\""#, r#"abc\"def\\\'ghi\\"#),
            (r"'foo \'bar'", "foo 'bar"),
            (r"'foo\bar'", r"foo\bar"),
            (r"'foo\\bar'", r"foo\\bar"),
        ];
        for (input, want) in cases {
            assert_eq!(q(input), want, "unquote {input}");
        }
    }
}
