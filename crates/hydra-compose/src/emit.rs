//! Write a config tree as YAML the way `OmegaConf.to_yaml` does, so that OmegaConf (and
//! [`crate::yaml::load_str`]) read back the same typed values.
//!
//! This is PyYAML's emitter as OmegaConf drives it (block style, 2-space indent, width 80, unicode
//! allowed, OmegaConf's rule quoting bool/int/float-like strings): sequences are not indented under
//! their key, empty containers are `{}`/`[]`, keys of 128+ characters (or empty, or multi-line) become
//! explicit `? key` entries, long plain and quoted scalars fold at spaces past column 80, and line
//! breaks in strings are written as PyYAML does (single-quoted, one blank line per break). One
//! deliberate difference: strings holding U+0085/U+2028/U+2029 are double-quoted with escapes, since
//! PyYAML would write them raw and read NEL back as `\n`.

use base64::Engine;

use crate::node::{Dict, Key, Node, Value};
use crate::scalar::{Scalar, python_float_repr};
use crate::yaml::scalar::{self, Implicit};

/// PyYAML's default line width.
const WIDTH: usize = 80;

/// The YAML text of `node`, ending in a newline.
pub(crate) fn to_yaml(node: &Node) -> String {
    let mut w = Writer {
        out: String::new(),
        column: 0,
    };
    match &node.value {
        Value::Dict(d) if !d.is_empty() => w.dict(d, 0, false),
        Value::List(l) if !l.is_empty() => w.list(l, 0, false),
        Value::Scalar(Scalar::Bytes(b)) if !b.is_empty() => w.binary_block(b, 0),
        other => {
            // A root scalar continues at PyYAML's indent for flow-level scalars.
            let style = w.scalar(other, 2, false);
            w.put("\n");
            // PyYAML closes a document made of one plain scalar with an explicit end marker.
            if style == Style::Plain && !other.is_container() {
                w.put("...\n");
            }
        }
    }
    w.out
}

/// The output and the current column (in characters), which folding needs.
struct Writer {
    out: String,
    column: usize,
}

impl Writer {
    fn put(&mut self, text: &str) {
        self.out.push_str(text);
        match text.rfind('\n') {
            Some(i) => self.column = text[i + 1..].chars().count(),
            None => self.column += text.chars().count(),
        }
    }

    fn put_chars(&mut self, chars: &[char]) {
        let text: String = chars.iter().collect();
        self.put(&text);
    }

    fn pad(&mut self, indent: usize) {
        self.put(&" ".repeat(indent));
    }

    /// PyYAML's `write_indent` inside a scalar: a line break unless at the start of a line, then spaces.
    fn break_and_indent(&mut self, indent: usize) {
        if self.column != 0 || !self.out.ends_with('\n') {
            self.put("\n");
        }
        self.pad(indent);
    }

    /// A block mapping at `indent`; with `inline_first` the first entry continues the current line
    /// (after `- ` or `: `).
    fn dict(&mut self, dict: &Dict, indent: usize, inline_first: bool) {
        for (i, (key, value)) in dict.iter().enumerate() {
            if i > 0 || !inline_first {
                self.pad(indent);
            }
            if is_simple_key(key) {
                self.key(key, indent + 2, true);
                self.put(":");
                self.after_simple_key(value, indent);
            } else {
                self.put("? ");
                self.key(key, indent + 2, false);
                self.put("\n");
                self.pad(indent);
                self.put(":");
                self.inline_item(value, indent);
            }
        }
    }

    fn key(&mut self, key: &Key, indent: usize, simple: bool) {
        match key {
            Key(Scalar::Str(s)) => {
                self.string(s, indent, simple);
            }
            Key(Scalar::Int(i)) => self.put(&i.to_string()),
            Key(Scalar::BigInt(i)) => self.put(&i.to_string()),
            Key(Scalar::Float(f)) => self.put(&float_text(*f)),
            Key(Scalar::Bool(b)) => self.put(if *b { "true" } else { "false" }),
            Key(Scalar::None) => self.put("null"),
            // Never a simple key: PyYAML writes `? !!binary |` and the base64 lines below it.
            Key(Scalar::Bytes(b)) if b.is_empty() => self.put("!!binary \"\""),
            Key(Scalar::Bytes(b)) => {
                self.put("!!binary |");
                let encoded = base64::engine::general_purpose::STANDARD.encode(b);
                for line in encoded.as_bytes().chunks(76) {
                    self.put("\n");
                    self.pad(indent);
                    self.put(&String::from_utf8_lossy(line));
                }
            }
        }
    }

    /// A value after `key:`: nested mappings indent by two, sequences stay at the key's column.
    fn after_simple_key(&mut self, value: &Node, indent: usize) {
        match &value.value {
            Value::Dict(d) if !d.is_empty() => {
                self.put("\n");
                self.dict(d, indent + 2, false);
            }
            Value::List(l) if !l.is_empty() => {
                self.put("\n");
                self.list(l, indent, false);
            }
            _ => self.inline_item(value, indent),
        }
    }

    fn list(&mut self, items: &[Node], indent: usize, inline_first: bool) {
        for (i, item) in items.iter().enumerate() {
            if i > 0 || !inline_first {
                self.pad(indent);
            }
            self.put("-");
            self.inline_item(item, indent);
        }
    }

    /// A value that starts on the current line after an indicator (`-`, `:`) written at `indent`.
    fn inline_item(&mut self, value: &Node, indent: usize) {
        self.put(" ");
        match &value.value {
            Value::Dict(d) if !d.is_empty() => self.dict(d, indent + 2, true),
            Value::List(l) if !l.is_empty() => self.list(l, indent + 2, true),
            Value::Scalar(Scalar::Bytes(b)) if !b.is_empty() => self.binary_block(b, indent + 2),
            other => {
                self.scalar(other, indent + 2, false);
                self.put("\n");
            }
        }
    }

    /// `!!binary |` and base64 in 76-character lines, as Python's `base64.encodebytes` writes it.
    fn binary_block(&mut self, bytes: &[u8], indent: usize) {
        self.put("!!binary |\n");
        let encoded = base64::engine::general_purpose::STANDARD.encode(bytes);
        // Base64 output is ASCII, so splitting by bytes keeps characters whole.
        for line in encoded.as_bytes().chunks(76) {
            self.pad(indent);
            self.put(&String::from_utf8_lossy(line));
            self.put("\n");
        }
    }

    /// A scalar (or empty container); continuation lines of folded strings go to `indent`.
    fn scalar(&mut self, value: &Value, indent: usize, simple_key: bool) -> Style {
        let text = match value {
            Value::Scalar(Scalar::None) => "null".to_owned(),
            Value::Scalar(Scalar::Bool(b)) => if *b { "true" } else { "false" }.to_owned(),
            Value::Scalar(Scalar::Int(i)) => i.to_string(),
            Value::Scalar(Scalar::BigInt(i)) => i.to_string(),
            Value::Scalar(Scalar::Float(f)) => float_text(*f),
            Value::Missing => "???".to_owned(),
            // The string `???` would read back as missing either way; quoting keeps it visibly a string.
            Value::Scalar(Scalar::Str(s)) if s == "???" => {
                self.put("'???'");
                return Style::Single;
            }
            Value::Scalar(Scalar::Str(s)) => return self.string(s, indent, simple_key),
            Value::Scalar(Scalar::Bytes(_)) => {
                self.put("!!binary \"\"");
                return Style::Double;
            }
            Value::List(_) => "[]".to_owned(),
            Value::Dict(_) => "{}".to_owned(),
        };
        self.put(&text);
        Style::Plain
    }

    fn string(&mut self, s: &str, indent: usize, simple_key: bool) -> Style {
        let style = choose_style(s, simple_key);
        let chars: Vec<char> = s.chars().collect();
        // PyYAML never folds a simple key.
        let split = !simple_key;
        match style {
            Style::Plain => self.plain(&chars, indent, split),
            Style::Single => self.single_quoted(&chars, indent, split),
            Style::Double => self.double_quoted(&chars, indent, split),
        }
        style
    }

    /// PyYAML's `write_plain`: a single space past the width becomes a line break.
    fn plain(&mut self, text: &[char], indent: usize, split: bool) {
        let (mut start, mut spaces) = (0, false);
        for end in 0..=text.len() {
            let ch = text.get(end).copied();
            if spaces {
                if ch != Some(' ') {
                    if start + 1 == end && self.column > WIDTH && split {
                        self.break_and_indent(indent);
                    } else {
                        self.put_chars(&text[start..end]);
                    }
                    start = end;
                }
            } else if ch.is_none_or(|c| c == ' ') {
                self.put_chars(&text[start..end]);
                start = end;
            }
            spaces = ch == Some(' ');
        }
    }

    /// PyYAML's `write_single_quoted`: `'` doubled, a break written as a blank line, and a single
    /// space past the width folded.
    fn single_quoted(&mut self, text: &[char], indent: usize, split: bool) {
        self.put("'");
        let (mut start, mut spaces, mut breaks) = (0, false, false);
        for end in 0..=text.len() {
            let ch = text.get(end).copied();
            if spaces {
                if ch != Some(' ') {
                    if start + 1 == end
                        && self.column > WIDTH
                        && split
                        && start != 0
                        && end != text.len()
                    {
                        self.break_and_indent(indent);
                    } else {
                        self.put_chars(&text[start..end]);
                    }
                    start = end;
                }
            } else if breaks {
                if ch.is_none_or(|c| c != '\n') {
                    // One extra break: a lone break inside quotes would fold into a space.
                    self.put("\n");
                    for _ in start..end {
                        self.put("\n");
                    }
                    self.break_and_indent(indent);
                    start = end;
                }
            } else if ch.is_none_or(|c| c == ' ' || c == '\n' || c == '\'') && start < end {
                self.put_chars(&text[start..end]);
                start = end;
            }
            if ch == Some('\'') {
                self.put("''");
                start = end + 1;
            }
            spaces = ch == Some(' ');
            breaks = ch == Some('\n');
        }
        self.put("'");
    }

    /// PyYAML's `write_double_quoted`: escapes, and past the width a `\` line continuation at a space
    /// (a leading space on the next line is kept by escaping it).
    fn double_quoted(&mut self, text: &[char], indent: usize, split: bool) {
        self.put("\"");
        let mut start = 0;
        for end in 0..=text.len() {
            let ch = text.get(end).copied();
            let escape = ch.and_then(escape_for);
            if ch.is_none() || escape.is_some() {
                if start < end {
                    self.put_chars(&text[start..end]);
                    start = end;
                }
                if let Some(e) = escape {
                    self.put(&e);
                    start = end + 1;
                }
            }
            let fold_here = end > 0 && end + 1 < text.len() && (ch == Some(' ') || start >= end);
            // Right after an escape `start` is `end + 1`, so this can be `column - 1`, as in PyYAML.
            let width_after = self.column as isize + end as isize - start as isize;
            if fold_here && width_after > WIDTH as isize && split {
                if start < end {
                    self.put_chars(&text[start..end]);
                    start = end;
                }
                self.put("\\");
                self.break_and_indent(indent);
                if text.get(start) == Some(&' ') {
                    self.put("\\");
                }
            }
        }
        self.put("\"");
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Style {
    Plain,
    Single,
    Double,
}

/// PyYAML's `check_simple_key` for a key: shorter than 128 characters, not empty, on one line.
fn is_simple_key(key: &Key) -> bool {
    match key {
        Key(Scalar::Str(s)) => s.chars().count() < 128 && !s.is_empty() && !s.chars().any(is_break),
        Key(Scalar::Bytes(_)) => false,
        _ => true,
    }
}

/// PyYAML's `represent_float`: `.nan`/`.inf`/`-.inf`, else Python's repr with an exponent-only form
/// given a `.0` (`1e-05` → `1.0e-05`) so YAML 1.1 reads it as a float.
fn float_text(f: f64) -> String {
    if f.is_nan() {
        return ".nan".into();
    }
    if f.is_infinite() {
        return if f > 0.0 {
            ".inf".into()
        } else {
            "-.inf".into()
        };
    }
    let repr = python_float_repr(f).to_lowercase();
    if !repr.contains('.') && repr.contains('e') {
        repr.replacen('e', ".0e", 1)
    } else {
        repr
    }
}

/// Plain when a loader reads the text back as this same string and PyYAML's emitter allows it;
/// single-quoted when OmegaConf's dumper asks for quotes (bool-, int- or float-like text) or plain is
/// not possible; double-quoted for special characters and where single quotes cannot carry the text.
fn choose_style(s: &str, simple_key: bool) -> Style {
    let a = analyze(s);
    let omegaconf_quotes =
        scalar::omegaconf_bool_like(s) || scalar::python_is_int(s) || scalar::python_is_float(s);
    let reads_back_as_str =
        !s.is_empty() && scalar::resolve_plain(s) == Implicit::Str && !scalar::yaml11_timestamp(s);
    let unicode_breaks = s.contains(['\u{85}', '\u{2028}', '\u{2029}']);
    if !omegaconf_quotes
        && reads_back_as_str
        && a.allow_block_plain
        && !(simple_key && (a.empty || a.line_breaks))
    {
        Style::Plain
    } else if a.allow_single_quoted && !(simple_key && a.line_breaks) && !unicode_breaks {
        Style::Single
    } else {
        Style::Double
    }
}

/// The escape PyYAML's double-quoted writer (with `allow_unicode`) uses for `ch`, if any.
fn escape_for(ch: char) -> Option<String> {
    let printable = matches!(ch, ' '..='~' | '\u{A0}'..='\u{D7FF}' | '\u{E000}'..='\u{FFFD}');
    if printable
        && !matches!(
            ch,
            '"' | '\\' | '\u{85}' | '\u{2028}' | '\u{2029}' | '\u{FEFF}'
        )
    {
        return None;
    }
    let short = match ch {
        '\0' => '0',
        '\u{7}' => 'a',
        '\u{8}' => 'b',
        '\t' => 't',
        '\n' => 'n',
        '\u{B}' => 'v',
        '\u{C}' => 'f',
        '\r' => 'r',
        '\u{1B}' => 'e',
        '"' => '"',
        '\\' => '\\',
        '\u{85}' => 'N',
        '\u{A0}' => '_',
        '\u{2028}' => 'L',
        '\u{2029}' => 'P',
        _ => {
            let code = u32::from(ch);
            return Some(if code <= 0xFF {
                format!("\\x{code:02X}")
            } else if code <= 0xFFFF {
                format!("\\u{code:04X}")
            } else {
                format!("\\U{code:08X}")
            });
        }
    };
    Some(format!("\\{short}"))
}

/// The parts of PyYAML's `analyze_scalar` that choose a block-context style.
struct Analysis {
    empty: bool,
    line_breaks: bool,
    allow_block_plain: bool,
    allow_single_quoted: bool,
}

fn is_break(ch: char) -> bool {
    matches!(ch, '\n' | '\u{85}' | '\u{2028}' | '\u{2029}')
}

fn is_space_or_break(ch: Option<char>) -> bool {
    ch.is_none_or(|c| matches!(c, '\0' | ' ' | '\t' | '\r') || is_break(c))
}

fn analyze(s: &str) -> Analysis {
    if s.is_empty() {
        return Analysis {
            empty: true,
            line_breaks: false,
            allow_block_plain: true,
            allow_single_quoted: true,
        };
    }
    let chars: Vec<char> = s.chars().collect();
    let last = chars.len() - 1;
    let mut block_indicators = s.starts_with("---") || s.starts_with("...");
    let (mut line_breaks, mut special) = (false, false);
    let (mut leading_space, mut leading_break, mut trailing_space, mut trailing_break) =
        (false, false, false, false);
    let (mut break_space, mut space_break) = (false, false);
    let (mut previous_space, mut previous_break) = (false, false);
    let mut preceded_by_whitespace = true;
    for (index, &ch) in chars.iter().enumerate() {
        let followed_by_whitespace = is_space_or_break(chars.get(index + 1).copied());
        if index == 0 {
            if "#,[]{}&*!|>'\"%@`".contains(ch) || (ch == '-' && followed_by_whitespace) {
                block_indicators = true;
            }
            if ch == '?' || ch == ':' {
                block_indicators |= followed_by_whitespace;
            }
        } else if (ch == ':' && followed_by_whitespace) || (ch == '#' && preceded_by_whitespace) {
            block_indicators = true;
        }
        if is_break(ch) {
            line_breaks = true;
        }
        if !(ch == '\n' || (' '..='~').contains(&ch)) {
            let unicode = matches!(ch, '\u{85}' | '\u{A0}'..='\u{D7FF}' | '\u{E000}'..='\u{FFFD}' | '\u{10000}'..='\u{10FFFE}');
            special |= !unicode || ch == '\u{FEFF}';
        }
        if ch == ' ' {
            leading_space |= index == 0;
            trailing_space |= index == last;
            break_space |= previous_break;
            (previous_space, previous_break) = (true, false);
        } else if is_break(ch) {
            leading_break |= index == 0;
            trailing_break |= index == last;
            space_break |= previous_space;
            (previous_space, previous_break) = (false, true);
        } else {
            (previous_space, previous_break) = (false, false);
        }
        preceded_by_whitespace = is_space_or_break(Some(ch));
    }
    let mut allow_block_plain =
        !(leading_space || leading_break || trailing_space || trailing_break);
    let mut allow_single_quoted = true;
    if break_space {
        allow_block_plain = false;
        allow_single_quoted = false;
    }
    if space_break || special {
        allow_block_plain = false;
        allow_single_quoted = false;
    }
    if line_breaks || block_indicators {
        allow_block_plain = false;
    }
    Analysis {
        empty: false,
        line_breaks,
        allow_block_plain,
        allow_single_quoted,
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::kit;
    use crate::yaml::load_str;

    fn n(value: Value) -> Node {
        Node::new(value)
    }

    fn dict(pairs: Vec<(Key, Value)>) -> Value {
        Value::Dict(pairs.into_iter().map(|(k, v)| (k, n(v))).collect())
    }

    fn list(items: Vec<Value>) -> Value {
        Value::List(items.into_iter().map(n).collect())
    }

    fn s(text: &str) -> Value {
        Value::str(text.to_owned())
    }

    fn k(text: &str) -> Key {
        Key::from(text.to_owned())
    }

    fn round_trips(node: &Node) -> Result<(), String> {
        let text = to_yaml(node);
        match load_str(&text, "emitted.yaml") {
            Ok(back) if kit::same(&back.value, &node.value) => Ok(()),
            Ok(back) => Err(format!(
                "re-read differs\n--- yaml:\n{text}--- got: {:?}\n--- want: {:?}",
                back.value, node.value
            )),
            Err(e) => Err(format!("re-read failed: {e}\n--- yaml:\n{text}")),
        }
    }

    /// Strings as OmegaConf.to_yaml writes them (`s:` list of the golden test below).
    #[test]
    fn strings_are_quoted_like_omegaconf() {
        let cases = [
            ("yes", "'yes'"),
            ("y", "'y'"),
            ("1e-4", "'1e-4'"),
            ("", "''"),
            ("a: b", "'a: b'"),
            ("#x", "'#x'"),
            ("x #y", "'x #y'"),
            (" lead", "' lead'"),
            ("trail ", "'trail '"),
            ("tab\there", "\"tab\\there\""),
            ("2024-01-01", "'2024-01-01'"),
            ("é", "é"),
            ("0o17", "0o17"),
            ("1_000", "'1_000'"),
            ("-", "'-'"),
            ("- a", "'- a'"),
            ("?x", "?x"),
            (":x", ":x"),
            ("@x", "'@x'"),
            ("%x", "'%x'"),
            ("`x", "'`x'"),
            ("!x", "'!x'"),
            ("&x", "'&x'"),
            ("*x", "'*x'"),
            ("|x", "'|x'"),
            (">x", "'>x'"),
            ("'q", "'''q'"),
            ("\"q", "'\"q'"),
            ("a,b", "a,b"),
            ("[x", "'[x'"),
            ("{x", "'{x'"),
            ("a\\b", "a\\b"),
            ("null", "'null'"),
            ("~", "'~'"),
            ("=", "'='"),
            ("<<", "'<<'"),
            ("---", "'---'"),
            ("...x", "'...x'"),
            ("inf", "'inf'"),
            ("nan", "'nan'"),
            (".inf", "'.inf'"),
            ("${a}", "${a}"),
            ("???", "'???'"),
            ("multi\nline", "'multi\n\n  line'"),
            ("a\n", "'a\n\n  '"),
            ("tab\t\nx", "\"tab\\t\\nx\""),
            ("\u{2028}", "\"\\L\""),
            ("\u{feff}x", "\"\\uFEFFx\""),
            ("bell\u{7}", "\"bell\\a\""),
            ("\u{1F600}", "\u{1F600}"),
        ];
        for (input, want) in cases {
            let text = to_yaml(&n(dict(vec![(k("v"), s(input))])));
            assert_eq!(
                text.strip_prefix("v: ").and_then(|t| t.strip_suffix('\n')),
                Some(want),
                "string {input:?}"
            );
        }
    }

    #[test]
    fn floats_reread_as_floats() {
        let cases = [
            (1.0, "1.0"),
            (1e-5, "1.0e-05"),
            (1e16, "1.0e+16"),
            (1.5e-7, "1.5e-07"),
            (0.1, "0.1"),
            (-0.0, "-0.0"),
            (f64::NAN, ".nan"),
            (f64::INFINITY, ".inf"),
            (f64::NEG_INFINITY, "-.inf"),
        ];
        for (f, want) in cases {
            assert_eq!(float_text(f), want, "float {f:e}");
        }
    }

    #[test]
    fn layout_matches_omegaconf_to_yaml() {
        let long = "k".repeat(130);
        let tree = n(dict(vec![
            (
                k("a"),
                dict(vec![
                    (
                        k("b"),
                        list(vec![
                            Value::int(1),
                            dict(vec![
                                (k("c"), Value::int(2)),
                                (
                                    k("d"),
                                    list(vec![
                                        Value::int(3),
                                        list(vec![Value::int(4), Value::int(5)]),
                                        list(vec![]),
                                    ]),
                                ),
                            ]),
                            list(vec![Value::int(6), Value::int(7)]),
                        ]),
                    ),
                    (k("e"), dict(vec![])),
                ]),
            ),
            (k("bin"), Value::Scalar(Scalar::Bytes(b"hello".to_vec()))),
            (
                k("lb"),
                list(vec![
                    Value::Scalar(Scalar::Bytes(b"hi".to_vec())),
                    Value::Scalar(Scalar::Bytes(vec![])),
                ]),
            ),
            (k("f"), Value::float(1e-5)),
            (k("h"), Value::float(f64::NAN)),
            (Key::int(1), s("b")),
            (Key::float(1.5), s("f")),
            (
                k(&long),
                dict(vec![
                    (k("a"), Value::int(1)),
                    (k("b"), list(vec![Value::int(1), Value::int(2)])),
                ]),
            ),
            (k(""), Value::int(1)),
            (k("x"), list(vec![dict(vec![(k(&long), Value::int(1))])])),
            (k("m"), Value::Missing),
            (k("n"), Value::NULL),
            (k("t"), Value::bool(true)),
        ]));
        let want = format!(
            "a:\n  b:\n  - 1\n  - c: 2\n    d:\n    - 3\n    - - 4\n      - 5\n    - []\n  - - 6\n    - 7\n  e: {{}}\n\
             bin: !!binary |\n  aGVsbG8=\nlb:\n- !!binary |\n  aGk=\n- !!binary \"\"\nf: 1.0e-05\nh: .nan\n1: b\n1.5: f\n\
             ? {long}\n: a: 1\n  b:\n  - 1\n  - 2\n? ''\n: 1\nx:\n- ? {long}\n  : 1\nm: ???\n'n': null\nt: true\n"
        );
        assert_eq!(to_yaml(&tree), want);
        round_trips(&tree).unwrap_or_else(|e| panic!("{e}"));
    }

    /// Expected texts are `OmegaConf.to_yaml` output (omegaconf 2.3.1, PyYAML 6).
    #[test]
    fn long_strings_fold_like_pyyaml() {
        let cases = [
            (
                "plain",
                "Stack the red block on the blue block, then stack the green block on the red block and then some more words to fold twice over",
                "plain: Stack the red block on the blue block, then stack the green block on the red\n  block and then some more words to fold twice over\n",
            ),
            (
                "multi",
                "line one\nline two\n\nafter blank",
                "multi: 'line one\n\n  line two\n\n\n  after blank'\n",
            ),
            (
                "double",
                "tab\there word word word word word word word word word word word word word word word word word word word word word word word word word é\u{7} end",
                "double: \"tab\\there word word word word word word word word word word word word word\\\n  \\ word word word word word word word word word word word word é\\a end\"\n",
            ),
        ];
        for (key, value, want) in cases {
            let tree = n(dict(vec![(k(key), s(value))]));
            assert_eq!(to_yaml(&tree), want, "{key}");
            round_trips(&tree).unwrap_or_else(|e| panic!("{e}"));
        }
        let nested = n(dict(vec![(
            k("l"),
            list(vec![dict(vec![(k("deep"), s(&"x ".repeat(60)))])]),
        )]));
        let want = "l:\n- deep: 'x x x x x x x x x x x x x x x x x x x x x x x x x x x x x x x x x x x x x\n    x x x x x x x x x x x x x x x x x x x x x x x '\n";
        assert_eq!(to_yaml(&nested), want);
    }

    #[test]
    fn top_level_shapes() {
        assert_eq!(to_yaml(&n(dict(vec![]))), "{}\n");
        assert_eq!(to_yaml(&n(list(vec![]))), "[]\n");
        assert_eq!(
            to_yaml(&n(list(vec![Value::int(1), s("yes")]))),
            "- 1\n- 'yes'\n"
        );
        assert_eq!(to_yaml(&n(Value::int(5))), "5\n...\n");
    }

    #[test]
    fn long_binary_wraps_at_76() {
        let text = to_yaml(&n(dict(vec![(
            k("b"),
            Value::Scalar(Scalar::Bytes(b"x".repeat(100))),
        )])));
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.first(), Some(&"b: !!binary |"));
        assert_eq!(lines.get(1).map(|l| l.len()), Some(78));
        assert_eq!(lines.len(), 3);
    }

    #[test]
    fn conformance_yaml_files_round_trip() {
        let dir = crate::kit::dir().join("data");
        let mut stack = vec![dir.clone()];
        let mut checked = 0;
        let mut failures = Vec::new();
        while let Some(d) = stack.pop() {
            let entries = std::fs::read_dir(&d)
                .unwrap_or_else(|e| panic!("cannot list {} (set RLSYNC_SHARED): {e}", d.display()));
            for entry in entries.flatten() {
                let path = entry.path();
                if path.is_dir() {
                    stack.push(path);
                } else if path.extension().is_some_and(|e| e == "yaml")
                    && let Ok(node) = crate::yaml::load_file(&path)
                {
                    checked += 1;
                    if let Err(e) = round_trips(&node) {
                        failures.push(format!("{}: {e}", path.display()));
                    }
                }
            }
        }
        assert!(
            checked > 300,
            "only {checked} files loaded under {}",
            dir.display()
        );
        assert!(failures.is_empty(), "{}", failures.join("\n"));
    }

    // ---- property: every loadable tree survives to_yaml → load_str ----

    fn any_string() -> impl Strategy<Value = String> {
        prop_oneof![
            // Texts that YAML would re-type or that need quoting.
            prop::sample::select(vec![
                "yes",
                "No",
                "on",
                "y",
                "n",
                "true",
                "null",
                "~",
                "",
                "1",
                "-1",
                "0x1F",
                "0o17",
                "0755",
                "1_000",
                "1:30",
                "1e-4",
                "1.5",
                ".inf",
                "-.inf",
                ".nan",
                "nan",
                "inf",
                "2024-01-01",
                "<<",
                "=",
                "-",
                "- a",
                "? x",
                ": x",
                "a: b",
                "a #b",
                "#c",
                "${a.b}",
                "\\${x}",
                "'",
                "\"",
                "\\",
                " x",
                "x ",
                "a\nb",
                "a\n",
                "\n",
                " \n ",
                "\t",
                "\r\n",
                "\u{85}",
                "\u{2028}",
                "\u{A0}",
                "\u{FEFF}",
                "é",
                "日本",
                "\u{1F600}",
                "---",
                "...",
                "%x",
                "@x",
                "`x",
                "!x",
                "&x",
                "*x",
                "|",
                ">",
                "[x]",
                "{x}",
                "a,b",
                "key: value",
                "a  b",
                "???x",
            ])
            .prop_map(str::to_owned),
            "[ -~]{0,12}",
            "[a-z0-9 :#'\"\\-.\n]{0,10}",
            any::<String>().prop_map(|s| s.chars().take(16).collect()),
            // Long enough to fold past column 80, with spaces, breaks and escapes where folds happen.
            prop::collection::vec(
                prop::sample::select(vec![
                    "word", " ", "  ", "\n", "\t", "'", "\"", "\\", "é", "#", ": ", "\u{7}", "x"
                ]),
                20..90
            )
            .prop_map(|parts| parts.concat()),
        ]
        .prop_filter("??? loads as missing", |s| s != "???")
    }

    fn any_float() -> impl Strategy<Value = f64> {
        prop_oneof![
            any::<f64>(),
            prop::sample::select(vec![
                0.0,
                -0.0,
                1.0,
                0.1,
                1e-5,
                1e16,
                1e300,
                5e-324,
                f64::MAX,
                f64::NAN,
                f64::INFINITY,
                f64::NEG_INFINITY
            ]),
        ]
    }

    fn any_key() -> impl Strategy<Value = Key> {
        prop_oneof![
            4 => any_string().prop_map(Key::from),
            1 => any::<i64>().prop_map(Key::int),
            // Keys equal in Python (1, 1.0, true; 0.0, -0.0) collapse on load, and NaN keys never
            // compare equal: keep float keys non-integral and not NaN.
            1 => any_float().prop_filter("distinct from ints", |f| !f.is_nan() && f.fract() != 0.0).prop_map(Key::float),
            1 => any::<bool>().prop_map(|b| Key(Scalar::Bool(b))),
        ]
    }

    fn any_leaf() -> impl Strategy<Value = Value> {
        prop_oneof![
            Just(Value::NULL),
            Just(Value::Missing),
            any::<bool>().prop_map(Value::bool),
            any::<i64>().prop_map(Value::int),
            any_float().prop_map(Value::float),
            any_string().prop_map(Value::str),
            prop::collection::vec(any::<u8>(), 0..100)
                .prop_map(|b| Value::Scalar(Scalar::Bytes(b))),
        ]
    }

    /// A dict whose keys stay distinct under Python's key equality.
    fn python_distinct(pairs: Vec<(Key, Value)>) -> Value {
        let mut dict = Dict::new();
        let mut seen_numeric = std::collections::HashSet::new();
        for (key, value) in pairs {
            let numeric = match &key {
                Key(Scalar::Int(i)) => Some(*i),
                Key(Scalar::Bool(b)) => Some(i64::from(*b)),
                _ => None,
            };
            if numeric.is_some_and(|v| !seen_numeric.insert(v)) {
                continue;
            }
            dict.insert(key, Node::new(value));
        }
        Value::Dict(dict)
    }

    fn any_tree() -> impl Strategy<Value = Node> {
        let value = any_leaf().prop_recursive(4, 48, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..6)
                    .prop_map(|items| Value::List(items.into_iter().map(Node::new).collect())),
                prop::collection::vec((any_key(), inner), 0..6).prop_map(python_distinct),
            ]
        });
        prop_oneof![
            prop::collection::vec((any_key(), value.clone()), 0..6).prop_map(python_distinct),
            prop::collection::vec(value, 1..6)
                .prop_map(|items| Value::List(items.into_iter().map(Node::new).collect())),
        ]
        .prop_map(Node::new)
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

        #[test]
        fn loadable_trees_round_trip(tree in any_tree()) {
            if let Err(e) = round_trips(&tree) {
                return Err(TestCaseError::fail(e));
            }
        }

        #[test]
        fn any_single_string_round_trips(text in any_string()) {
            let tree = Node::new(dict(vec![(k("v"), Value::str(text.clone())), (Key::from(text), Value::int(1))]));
            if let Err(e) = round_trips(&tree) {
                return Err(TestCaseError::fail(e));
            }
        }
    }
}
