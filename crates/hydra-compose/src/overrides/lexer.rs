//! Tokenizer for the override grammar: `OverrideLexer.g4`'s key mode and value mode, longest match first.

#[cfg(test)]
use super::GrammarError;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Tok {
    // Both modes.
    Equal,
    Colon,
    Id,
    // Key mode only.
    Tilde,
    Plus,
    At,
    Slash,
    KeySpecial,
    DotPath,
    // Value mode only.
    POpen,
    Comma,
    PClose,
    BracketOpen,
    BracketClose,
    BraceOpen,
    BraceClose,
    Float,
    Int,
    Bool,
    Null,
    UnquotedChar,
    Esc,
    Ws,
    Quoted,
    Interpolation,
    Eof,
}

/// A token: its kind and its text as `[start, end)` character indices into the input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Token {
    pub kind: Tok,
    pub start: usize,
    pub end: usize,
}

/// Split the whole override into tokens; the lexer starts in key mode and switches to value mode at `=`.
#[cfg(test)]
pub(super) fn tokenize(chars: &[char]) -> Result<Vec<Token>, GrammarError> {
    match tokenize_prefix(chars) {
        (tokens, None) => Ok(tokens),
        (_, Some(column)) => Err(GrammarError::Lexer { column }),
    }
}

/// The tokens up to the first character no token starts at (its column, then no EOF token), or all of
/// them with EOF.
pub(super) fn tokenize_prefix(chars: &[char]) -> (Vec<Token>, Option<usize>) {
    let mut tokens = Vec::new();
    let mut pos = 0;
    let mut value_mode = false;
    let closing = next_closing_braces(chars);
    while pos < chars.len() {
        let matched = if value_mode {
            value_token(chars, &closing, pos)
        } else {
            key_token(chars, pos)
        };
        let Some((kind, len)) = matched else {
            return (tokens, Some(pos));
        };
        if kind == Tok::Equal {
            value_mode = true;
        }
        tokens.push(Token {
            kind,
            start: pos,
            end: pos + len,
        });
        pos += len;
    }
    tokens.push(Token {
        kind: Tok::Eof,
        start: chars.len(),
        end: chars.len(),
    });
    (tokens, None)
}

fn at(chars: &[char], i: usize) -> Option<char> {
    chars.get(i).copied()
}

fn is_char(c: Option<char>) -> bool {
    c.is_some_and(|c| c.is_ascii_alphabetic())
}

fn is_digit(c: Option<char>) -> bool {
    c.is_some_and(|c| c.is_ascii_digit())
}

fn ws_len(chars: &[char], i: usize) -> usize {
    chars[i.min(chars.len())..]
        .iter()
        .take_while(|c| **c == ' ' || **c == '\t')
        .count()
}

/// `ID: (CHAR|'_') (CHAR|DIGIT|'_'|'-')*`
fn id_len(chars: &[char], i: usize) -> usize {
    let first = at(chars, i);
    if !(is_char(first) || first == Some('_')) {
        return 0;
    }
    1 + chars[i + 1..]
        .iter()
        .take_while(|c| c.is_ascii_alphanumeric() || **c == '_' || **c == '-')
        .count()
}

/// `KEY_SPECIAL: (CHAR|'_'|'$') (CHAR|DIGIT|'_'|'-'|'$')*`
fn key_special_len(chars: &[char], i: usize) -> usize {
    let first = at(chars, i);
    if !(is_char(first) || first == Some('_') || first == Some('$')) {
        return 0;
    }
    1 + chars[i + 1..]
        .iter()
        .take_while(|c| c.is_ascii_alphanumeric() || matches!(**c, '_' | '-' | '$'))
        .count()
}

/// `DIGIT (('_')? DIGIT)*`, 0 when there is no leading digit.
fn digits_len(chars: &[char], i: usize) -> usize {
    if !is_digit(at(chars, i)) {
        return 0;
    }
    let mut n = 1;
    loop {
        if is_digit(at(chars, i + n)) {
            n += 1;
        } else if at(chars, i + n) == Some('_') && is_digit(at(chars, i + n + 1)) {
            n += 2;
        } else {
            return n;
        }
    }
}

/// `INT_UNSIGNED: '0' | [1-9] (('_')? DIGIT)*`, 0 when it does not match.
fn int_unsigned_len(chars: &[char], i: usize) -> usize {
    match at(chars, i) {
        Some('0') => 1,
        Some('1'..='9') => digits_len(chars, i),
        _ => 0,
    }
}

/// `DOT_PATH: (KEY_SPECIAL | INT_UNSIGNED) ('.' (KEY_SPECIAL | INT_UNSIGNED))+`
fn dot_path_len(chars: &[char], i: usize) -> usize {
    let segment = |j: usize| key_special_len(chars, j).max(int_unsigned_len(chars, j));
    let first = segment(i);
    if first == 0 {
        return 0;
    }
    let (mut end, mut segments) = (i + first, 1);
    while at(chars, end) == Some('.') {
        let next = segment(end + 1);
        if next == 0 {
            break;
        }
        end += 1 + next;
        segments += 1;
    }
    if segments >= 2 { end - i } else { 0 }
}

fn key_token(chars: &[char], i: usize) -> Option<(Tok, usize)> {
    let single = match at(chars, i)? {
        '=' => return Some((Tok::Equal, 1 + ws_len(chars, i + 1))),
        '~' => Some(Tok::Tilde),
        '+' => Some(Tok::Plus),
        '@' => Some(Tok::At),
        ':' => Some(Tok::Colon),
        '/' => Some(Tok::Slash),
        _ => None,
    };
    if let Some(kind) = single {
        return Some((kind, 1));
    }
    longest(&[
        (Tok::Id, id_len(chars, i)),
        (Tok::KeySpecial, key_special_len(chars, i)),
        (Tok::DotPath, dot_path_len(chars, i)),
    ])
}

/// The longest candidate; on a tie the first listed (ANTLR's rule order).
fn longest(candidates: &[(Tok, usize)]) -> Option<(Tok, usize)> {
    let mut best: Option<(Tok, usize)> = None;
    for &(kind, len) in candidates {
        if len > 0 && best.is_none_or(|(_, b)| len > b) {
            best = Some((kind, len));
        }
    }
    best
}

/// `WS? <c> WS?` style punctuation; 0 when `c` is not there.
fn punct_len(chars: &[char], i: usize, c: char, ws_before: bool, ws_after: bool) -> usize {
    let before = if ws_before { ws_len(chars, i) } else { 0 };
    if at(chars, i + before) != Some(c) {
        return 0;
    }
    let after = if ws_after {
        ws_len(chars, i + before + 1)
    } else {
        0
    };
    before + 1 + after
}

/// The lengths `POINT_FLOAT` can match at `i`.
fn point_float_lens(chars: &[char], i: usize) -> Vec<usize> {
    let mut out = Vec::new();
    // INT_UNSIGNED '.'  |  INT_UNSIGNED '.' DIGIT (('_')? DIGIT)*
    let int = int_unsigned_len(chars, i);
    if int > 0 && at(chars, i + int) == Some('.') {
        out.push(int + 1);
        let frac = digits_len(chars, i + int + 1);
        if frac > 0 {
            out.push(int + 1 + frac);
        }
    }
    // '.' DIGIT (('_')? DIGIT)*
    if at(chars, i) == Some('.') {
        let frac = digits_len(chars, i + 1);
        if frac > 0 {
            out.push(1 + frac);
        }
    }
    out
}

/// `FLOAT: [+-]? (POINT_FLOAT | EXPONENT_FLOAT | [Ii][Nn][Ff] | [Nn][Aa][Nn])`
fn float_len(chars: &[char], i: usize) -> usize {
    let sign = usize::from(matches!(at(chars, i), Some('+' | '-')));
    let j = i + sign;
    let mut best = 0;
    let points = point_float_lens(chars, j);
    best = best.max(points.iter().copied().max().unwrap_or(0));
    let int = int_unsigned_len(chars, j);
    let bases = points.iter().copied().chain((int > 0).then_some(int));
    for base in bases {
        if matches!(at(chars, j + base), Some('e' | 'E')) {
            let exp_sign = usize::from(matches!(at(chars, j + base + 1), Some('+' | '-')));
            let digits = digits_len(chars, j + base + 1 + exp_sign);
            if digits > 0 {
                best = best.max(base + 1 + exp_sign + digits);
            }
        }
    }
    for word in ["inf", "nan"] {
        if word_len_ci(chars, j, word) > 0 {
            best = best.max(3);
        }
    }
    if best == 0 { 0 } else { sign + best }
}

/// `INT: [+-]? INT_UNSIGNED`
fn int_len(chars: &[char], i: usize) -> usize {
    let sign = usize::from(matches!(at(chars, i), Some('+' | '-')));
    let n = int_unsigned_len(chars, i + sign);
    if n == 0 { 0 } else { sign + n }
}

/// Case-insensitive ASCII keyword at `i`.
fn word_len_ci(chars: &[char], i: usize, word: &str) -> usize {
    let matches = word
        .chars()
        .enumerate()
        .all(|(k, w)| at(chars, i + k).is_some_and(|c| c.eq_ignore_ascii_case(&w)));
    if matches { word.len() } else { 0 }
}

/// `ESC: (ESC_BACKSLASH | '\\(' | ... | '\\ ' | '\\\t')+`
fn esc_len(chars: &[char], i: usize) -> usize {
    let mut n = 0;
    while at(chars, i + n) == Some('\\')
        && at(chars, i + n + 1).is_some_and(|c| "\\()[]{}:=, \t".contains(c))
    {
        n += 2;
    }
    n
}

/// `QUOTED_VALUE`: up to the first closing quote preceded by an even number of backslashes.
fn quoted_len(chars: &[char], i: usize) -> usize {
    let Some(quote @ ('\'' | '"')) = at(chars, i) else {
        return 0;
    };
    let mut backslashes = 0;
    for (k, &c) in chars[i + 1..].iter().enumerate() {
        if c == quote && backslashes % 2 == 0 {
            return k + 2;
        }
        backslashes = if c == '\\' { backslashes + 1 } else { 0 };
    }
    0
}

/// For each index, where the next `}` at or after it is (`chars.len()` if none), so that scanning for
/// interpolations stays linear even for input like `${${${...`.
fn next_closing_braces(chars: &[char]) -> Vec<usize> {
    let mut next = vec![chars.len(); chars.len() + 1];
    for i in (0..chars.len()).rev() {
        next[i] = if chars[i] == '}' { i } else { next[i + 1] };
    }
    next
}

/// `INTERPOLATION: '${' ~('}')+ '}'`
fn interpolation_len(chars: &[char], closing: &[usize], i: usize) -> usize {
    if at(chars, i) != Some('$') || at(chars, i + 1) != Some('{') {
        return 0;
    }
    match closing.get(i + 2) {
        Some(&close) if close < chars.len() && close > i + 2 => close - i + 1,
        _ => 0,
    }
}

fn value_token(chars: &[char], closing: &[usize], i: usize) -> Option<(Tok, usize)> {
    let unquoted = usize::from(at(chars, i).is_some_and(|c| "/-\\+.$%*@?|".contains(c)));
    longest(&[
        (Tok::POpen, punct_len(chars, i, '(', true, true)),
        (Tok::Comma, punct_len(chars, i, ',', true, true)),
        (Tok::PClose, punct_len(chars, i, ')', true, false)),
        (Tok::BracketOpen, punct_len(chars, i, '[', false, true)),
        (Tok::BracketClose, punct_len(chars, i, ']', true, false)),
        (Tok::BraceOpen, punct_len(chars, i, '{', false, true)),
        (Tok::BraceClose, punct_len(chars, i, '}', true, false)),
        (Tok::Colon, punct_len(chars, i, ':', true, true)),
        (Tok::Equal, punct_len(chars, i, '=', true, true)),
        (Tok::Float, float_len(chars, i)),
        (Tok::Int, int_len(chars, i)),
        (
            Tok::Bool,
            word_len_ci(chars, i, "true").max(word_len_ci(chars, i, "false")),
        ),
        (Tok::Null, word_len_ci(chars, i, "null")),
        (Tok::UnquotedChar, unquoted),
        (Tok::Id, id_len(chars, i)),
        (Tok::Esc, esc_len(chars, i)),
        (Tok::Ws, ws_len(chars, i)),
        (Tok::Quoted, quoted_len(chars, i)),
        (Tok::Interpolation, interpolation_len(chars, closing, i)),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kinds(text: &str) -> Vec<(Tok, String)> {
        let chars: Vec<char> = text.chars().collect();
        let tokens = tokenize(&chars).unwrap_or_else(|e| panic!("{text:?} does not lex: {e}"));
        tokens
            .iter()
            .map(|t| (t.kind, chars[t.start..t.end].iter().collect()))
            .collect()
    }

    fn check(text: &str, expect: &[(Tok, &str)]) {
        let got = kinds(text);
        let want: Vec<(Tok, String)> = expect
            .iter()
            .map(|(k, s)| (*k, (*s).to_owned()))
            .chain([(Tok::Eof, String::new())])
            .collect();
        assert_eq!(got, want, "tokens of {text:?}");
    }

    #[test]
    fn key_mode_tokens() {
        use Tok::*;
        check("a.b.c=1", &[(DotPath, "a.b.c"), (Equal, "="), (Int, "1")]);
        check(
            "++$x=",
            &[(Plus, "+"), (Plus, "+"), (KeySpecial, "$x"), (Equal, "=")],
        );
        check(
            "hydra/launcher@p.q= x",
            &[
                (Id, "hydra"),
                (Slash, "/"),
                (Id, "launcher"),
                (At, "@"),
                (DotPath, "p.q"),
                (Equal, "= "),
                (Id, "x"),
            ],
        );
        check("list.10_1.x", &[(DotPath, "list.10_1.x")]);
        check("list.0_1", &[(DotPath, "list.0"), (Id, "_1")]);
    }

    #[test]
    fn value_mode_longest_match() {
        use Tok::*;
        check("=1e3", &[(Equal, "="), (Float, "1e3")]);
        check("=1.e5", &[(Equal, "="), (Float, "1.e5")]);
        check("=trueish", &[(Equal, "="), (Id, "trueish")]);
        check("=TrUe", &[(Equal, "="), (Bool, "TrUe")]);
        check("=-inf", &[(Equal, "="), (Float, "-inf")]);
        check("=123abc", &[(Equal, "="), (Int, "123"), (Id, "abc")]);
        check(
            "=a , b",
            &[(Equal, "="), (Id, "a"), (Comma, " , "), (Id, "b")],
        );
        check(
            "=f (x )",
            &[
                (Equal, "="),
                (Id, "f"),
                (POpen, " ("),
                (Id, "x"),
                (PClose, " )"),
            ],
        );
        check(r"=\\\(x", &[(Equal, "="), (Esc, r"\\\("), (Id, "x")]);
        check(r"=\f", &[(Equal, "="), (UnquotedChar, "\\"), (Id, "f")]);
        check("='a\\'b'", &[(Equal, "="), (Quoted, "'a\\'b'")]);
        check("=${a.b}", &[(Equal, "="), (Interpolation, "${a.b}")]);
        check("=1___0", &[(Equal, "="), (Int, "1"), (Id, "___0")]);
        check("=05.5", &[(Equal, "="), (Int, "0"), (Float, "5.5")]);
    }

    #[test]
    fn lexer_errors_name_the_column() {
        let chars: Vec<char> = "key=[1,2,3]'".chars().collect();
        assert_eq!(tokenize(&chars), Err(GrammarError::Lexer { column: 11 }));
        let chars: Vec<char> = "a b=1".chars().collect();
        assert!(matches!(
            tokenize(&chars),
            Err(GrammarError::Lexer { column: 1 })
        ));
    }
}
