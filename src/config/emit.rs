//! Write a config tree as YAML the way `OmegaConf.to_yaml` does, so that OmegaConf (and
//! [`crate::config::yaml::load_str`]) read back the same typed values.
//!
//! Layout and quoting follow PyYAML's emitter as OmegaConf drives it: block style, 2-space indent,
//! sequences not indented under their key, `{}`/`[]` for empty containers, keys longer than 127
//! characters (or empty) written as explicit `? key` entries, and strings quoted whenever a loader would
//! re-type them. Two deliberate differences from PyYAML, neither changing what is read back: strings with
//! line breaks are written double-quoted with `\n` escapes (PyYAML folds them into multi-line single
//! quotes), and long lines are never folded.

use base64::Engine;

use crate::config::node::{Dict, Key, Node, Value, python_float_repr};
use crate::config::yaml::scalar::{self, Implicit};

/// The YAML text of `node`, ending in a newline.
pub fn to_yaml(node: &Node) -> String {
    let mut w = Writer { out: String::new() };
    match &node.value {
        Value::Dict(d) if !d.is_empty() => w.dict(d, 0, false),
        Value::List(l) if !l.is_empty() => w.list(l, 0, false),
        Value::Bytes(b) if !b.is_empty() => w.binary_block(b, 0),
        other => {
            let (text, style) = scalar_text(other);
            w.out.push_str(&text);
            w.out.push('\n');
            // PyYAML closes a document made of one plain scalar with an explicit end marker.
            if style == Style::Plain && !other.is_container() {
                w.out.push_str("...\n");
            }
        }
    }
    w.out
}

struct Writer {
    out: String,
}

impl Writer {
    fn pad(&mut self, indent: usize) {
        self.out.extend(std::iter::repeat_n(' ', indent));
    }

    /// A block mapping at `indent`; with `inline_first` the first entry continues the current line
    /// (after `- ` or `: `).
    fn dict(&mut self, dict: &Dict, indent: usize, inline_first: bool) {
        for (i, (key, value)) in dict.iter().enumerate() {
            if i > 0 || !inline_first {
                self.pad(indent);
            }
            let (text, simple) = key_text(key);
            if simple {
                self.out.push_str(&text);
                self.out.push(':');
                self.after_simple_key(value, indent);
            } else {
                self.out.push_str("? ");
                self.out.push_str(&text);
                self.out.push('\n');
                self.pad(indent);
                self.out.push(':');
                self.inline_item(value, indent);
            }
        }
    }

    /// A value after `key:`: nested mappings indent by two, sequences stay at the key's column.
    fn after_simple_key(&mut self, value: &Node, indent: usize) {
        match &value.value {
            Value::Dict(d) if !d.is_empty() => {
                self.out.push('\n');
                self.dict(d, indent + 2, false);
            }
            Value::List(l) if !l.is_empty() => {
                self.out.push('\n');
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
            self.out.push('-');
            self.inline_item(item, indent);
        }
    }

    /// A value that starts on the current line after an indicator (`-`, `:`) written at `indent`.
    fn inline_item(&mut self, value: &Node, indent: usize) {
        self.out.push(' ');
        match &value.value {
            Value::Dict(d) if !d.is_empty() => self.dict(d, indent + 2, true),
            Value::List(l) if !l.is_empty() => self.list(l, indent + 2, true),
            Value::Bytes(b) if !b.is_empty() => self.binary_block(b, indent + 2),
            other => {
                self.out.push_str(&scalar_text(other).0);
                self.out.push('\n');
            }
        }
    }

    /// `!!binary |` and base64 in 76-character lines, as Python's `base64.encodebytes` writes it.
    fn binary_block(&mut self, bytes: &[u8], indent: usize) {
        self.out.push_str("!!binary |\n");
        let encoded = base64::engine::general_purpose::STANDARD.encode(bytes);
        // Base64 output is ASCII, so splitting by bytes keeps characters whole.
        for line in encoded.as_bytes().chunks(76) {
            self.pad(indent);
            self.out.push_str(&String::from_utf8_lossy(line));
            self.out.push('\n');
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Style {
    Plain,
    Single,
    Double,
}

/// A scalar value's text and the style it was written in. Containers here are empty ones.
fn scalar_text(value: &Value) -> (String, Style) {
    match value {
        Value::Null => ("null".into(), Style::Plain),
        Value::Bool(b) => (if *b { "true" } else { "false" }.into(), Style::Plain),
        Value::Int(i) => (i.to_string(), Style::Plain),
        Value::Float(f) => (float_text(*f), Style::Plain),
        Value::Missing => ("???".into(), Style::Plain),
        Value::Str(s) if s == "???" => ("'???'".into(), Style::Single),
        Value::Str(s) => string_text(s, false),
        Value::Bytes(_) => ("!!binary \"\"".into(), Style::Double),
        Value::List(_) => ("[]".into(), Style::Plain),
        Value::Dict(_) => ("{}".into(), Style::Plain),
    }
}

/// A key's text, and whether it can be written as a simple `key:` (PyYAML: shorter than 128
/// characters, not empty, on one line).
fn key_text(key: &Key) -> (String, bool) {
    match key {
        Key::Str(s) => {
            let analysis = analyze(s);
            let simple = s.chars().count() < 128 && !analysis.empty && !analysis.line_breaks;
            (string_text(s, simple).0, simple)
        }
        Key::Int(i) => (i.to_string(), true),
        Key::Float(bits) => (float_text(f64::from_bits(*bits)), true),
        Key::Bool(b) => (if *b { "true" } else { "false" }.into(), true),
        Key::Null => ("null".into(), true),
    }
}

/// PyYAML's `represent_float`: `.nan`/`.inf`/`-.inf`, else Python's repr with an exponent-only form
/// given a `.0` (`1e-05` → `1.0e-05`) so YAML 1.1 reads it as a float.
fn float_text(f: f64) -> String {
    if f.is_nan() {
        return ".nan".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { ".inf".into() } else { "-.inf".into() };
    }
    let repr = python_float_repr(f).to_lowercase();
    if !repr.contains('.') && repr.contains('e') { repr.replacen('e', ".0e", 1) } else { repr }
}

/// How a string is written: plain when a loader reads it back as this same string and PyYAML's emitter
/// allows it; single-quoted when OmegaConf's dumper asks for quotes (bool-, int- or float-like text) or
/// plain is not possible; double-quoted with escapes for special characters and line breaks.
fn string_text(s: &str, simple_key: bool) -> (String, Style) {
    let a = analyze(s);
    let omegaconf_quotes = scalar::omegaconf_bool_like(s) || scalar::python_is_int(s) || scalar::python_is_float(s);
    let reads_back_as_str = !s.is_empty() && scalar::resolve_plain(s) == Implicit::Str && !scalar::yaml11_timestamp(s);
    let plain = !omegaconf_quotes && reads_back_as_str && a.allow_block_plain && !(simple_key && a.empty);
    if plain {
        (s.to_owned(), Style::Plain)
    } else if a.allow_single_quoted && !a.line_breaks {
        (format!("'{}'", s.replace('\'', "''")), Style::Single)
    } else {
        (double_quoted(s), Style::Double)
    }
}

/// PyYAML's double-quoted writer (with `allow_unicode`), minus line folding.
fn double_quoted(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for ch in s.chars() {
        let printable = matches!(ch, ' '..='~' | '\u{A0}'..='\u{D7FF}' | '\u{E000}'..='\u{FFFD}');
        if printable && !matches!(ch, '"' | '\\' | '\u{85}' | '\u{2028}' | '\u{2029}' | '\u{FEFF}') {
            out.push(ch);
            continue;
        }
        let short = match ch {
            '\0' => Some('0'),
            '\u{7}' => Some('a'),
            '\u{8}' => Some('b'),
            '\t' => Some('t'),
            '\n' => Some('n'),
            '\u{B}' => Some('v'),
            '\u{C}' => Some('f'),
            '\r' => Some('r'),
            '\u{1B}' => Some('e'),
            '"' => Some('"'),
            '\\' => Some('\\'),
            '\u{85}' => Some('N'),
            '\u{A0}' => Some('_'),
            '\u{2028}' => Some('L'),
            '\u{2029}' => Some('P'),
            _ => None,
        };
        match short {
            Some(c) => {
                out.push('\\');
                out.push(c);
            }
            None if u32::from(ch) <= 0xFF => out.push_str(&format!("\\x{:02X}", u32::from(ch))),
            None if u32::from(ch) <= 0xFFFF => out.push_str(&format!("\\u{:04X}", u32::from(ch))),
            None => out.push_str(&format!("\\U{:08X}", u32::from(ch))),
        }
    }
    out.push('"');
    out
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
        return Analysis { empty: true, line_breaks: false, allow_block_plain: true, allow_single_quoted: true };
    }
    let chars: Vec<char> = s.chars().collect();
    let last = chars.len() - 1;
    let mut block_indicators = s.starts_with("---") || s.starts_with("...");
    let (mut line_breaks, mut special) = (false, false);
    let (mut leading_space, mut leading_break, mut trailing_space, mut trailing_break) = (false, false, false, false);
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
    let mut allow_block_plain = !(leading_space || leading_break || trailing_space || trailing_break);
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
    Analysis { empty: false, line_breaks, allow_block_plain, allow_single_quoted }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::config::yaml::{load_str, same_tree};

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
        Value::Str(text.to_owned())
    }

    fn k(text: &str) -> Key {
        Key::Str(text.to_owned())
    }

    fn round_trips(node: &Node) -> Result<(), String> {
        let text = to_yaml(node);
        match load_str(&text, "emitted.yaml") {
            Ok(back) if same_tree(&back, node) => Ok(()),
            Ok(back) => Err(format!("re-read differs\n--- yaml:\n{text}--- got: {:?}\n--- want: {:?}", back.value, node.value)),
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
            ("multi\nline", "\"multi\\nline\""),
            ("\u{2028}", "\"\\L\""),
            ("\u{feff}x", "\"\\uFEFFx\""),
            ("bell\u{7}", "\"bell\\a\""),
            ("\u{1F600}", "\u{1F600}"),
        ];
        for (input, want) in cases {
            assert_eq!(scalar_text(&Value::Str(input.to_owned())).0, want, "string {input:?}");
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
                            Value::Int(1),
                            dict(vec![(k("c"), Value::Int(2)), (k("d"), list(vec![Value::Int(3), list(vec![Value::Int(4), Value::Int(5)]), list(vec![])]))]),
                            list(vec![Value::Int(6), Value::Int(7)]),
                        ]),
                    ),
                    (k("e"), dict(vec![])),
                ]),
            ),
            (k("bin"), Value::Bytes(b"hello".to_vec())),
            (k("lb"), list(vec![Value::Bytes(b"hi".to_vec()), Value::Bytes(vec![])])),
            (k("f"), Value::Float(1e-5)),
            (k("h"), Value::Float(f64::NAN)),
            (Key::Int(1), s("b")),
            (Key::float(1.5), s("f")),
            (k(&long), dict(vec![(k("a"), Value::Int(1)), (k("b"), list(vec![Value::Int(1), Value::Int(2)]))])),
            (k(""), Value::Int(1)),
            (k("x"), list(vec![dict(vec![(k(&long), Value::Int(1))])])),
            (k("m"), Value::Missing),
            (k("n"), Value::Null),
            (k("t"), Value::Bool(true)),
        ]));
        let want = format!(
            "a:\n  b:\n  - 1\n  - c: 2\n    d:\n    - 3\n    - - 4\n      - 5\n    - []\n  - - 6\n    - 7\n  e: {{}}\n\
             bin: !!binary |\n  aGVsbG8=\nlb:\n- !!binary |\n  aGk=\n- !!binary \"\"\nf: 1.0e-05\nh: .nan\n1: b\n1.5: f\n\
             ? {long}\n: a: 1\n  b:\n  - 1\n  - 2\n? ''\n: 1\nx:\n- ? {long}\n  : 1\nm: ???\n'n': null\nt: true\n"
        );
        assert_eq!(to_yaml(&tree), want);
        round_trips(&tree).unwrap_or_else(|e| panic!("{e}"));
    }

    #[test]
    fn top_level_shapes() {
        assert_eq!(to_yaml(&n(dict(vec![]))), "{}\n");
        assert_eq!(to_yaml(&n(list(vec![]))), "[]\n");
        assert_eq!(to_yaml(&n(list(vec![Value::Int(1), s("yes")]))), "- 1\n- 'yes'\n");
        assert_eq!(to_yaml(&n(Value::Int(5))), "5\n...\n");
    }

    #[test]
    fn long_binary_wraps_at_76() {
        let text = to_yaml(&n(dict(vec![(k("b"), Value::Bytes(b"x".repeat(100)))])));
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.first(), Some(&"b: !!binary |"));
        assert_eq!(lines.get(1).map(|l| l.len()), Some(78));
        assert_eq!(lines.len(), 3);
    }

    #[test]
    fn conformance_yaml_files_round_trip() {
        let dir = std::env::var_os("RLSYNC_SHARED")
            .map(std::path::PathBuf::from)
            .unwrap_or_else(|| std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared"))
            .join("conformance/data");
        let mut stack = vec![dir.clone()];
        let mut checked = 0;
        let mut failures = Vec::new();
        while let Some(d) = stack.pop() {
            let entries = std::fs::read_dir(&d).unwrap_or_else(|e| panic!("cannot list {} (set RLSYNC_SHARED): {e}", d.display()));
            for entry in entries.flatten() {
                let path = entry.path();
                if path.is_dir() {
                    stack.push(path);
                } else if path.extension().is_some_and(|e| e == "yaml") {
                    if let Ok(node) = crate::config::yaml::load_file(&path) {
                        checked += 1;
                        if let Err(e) = round_trips(&node) {
                            failures.push(format!("{}: {e}", path.display()));
                        }
                    }
                }
            }
        }
        assert!(checked > 300, "only {checked} files loaded under {}", dir.display());
        assert!(failures.is_empty(), "{}", failures.join("\n"));
    }

    // ---- property: every loadable tree survives to_yaml → load_str ----

    fn any_string() -> impl Strategy<Value = String> {
        prop_oneof![
            // Texts that YAML would re-type or that need quoting.
            prop::sample::select(vec![
                "yes", "No", "on", "y", "n", "true", "null", "~", "", "1", "-1", "0x1F", "0o17", "0755", "1_000", "1:30", "1e-4",
                "1.5", ".inf", "-.inf", ".nan", "nan", "inf", "2024-01-01", "<<", "=", "-", "- a", "? x", ": x", "a: b", "a #b",
                "#c", "${a.b}", "\\${x}", "'", "\"", "\\", " x", "x ", "a\nb", "a\n", "\n", " \n ", "\t", "\r\n", "\u{85}",
                "\u{2028}", "\u{A0}", "\u{FEFF}", "é", "日本", "\u{1F600}", "---", "...", "%x", "@x", "`x", "!x", "&x", "*x",
                "|", ">", "[x]", "{x}", "a,b", "key: value", "a  b", "???x",
            ])
            .prop_map(str::to_owned),
            "[ -~]{0,12}",
            "[a-z0-9 :#'\"\\-.\n]{0,10}",
            any::<String>().prop_map(|s| s.chars().take(16).collect()),
        ]
        .prop_filter("??? loads as missing", |s| s != "???")
    }

    fn any_float() -> impl Strategy<Value = f64> {
        prop_oneof![
            any::<f64>(),
            prop::sample::select(vec![0.0, -0.0, 1.0, 0.1, 1e-5, 1e16, 1e300, 5e-324, f64::MAX, f64::NAN, f64::INFINITY, f64::NEG_INFINITY]),
        ]
    }

    fn any_key() -> impl Strategy<Value = Key> {
        prop_oneof![
            4 => any_string().prop_map(Key::Str),
            1 => any::<i64>().prop_map(Key::Int),
            // Keys equal in Python (1, 1.0, true; 0.0, -0.0) collapse on load, and NaN keys never
            // compare equal: keep float keys non-integral and not NaN.
            1 => any_float().prop_filter("distinct from ints", |f| !f.is_nan() && f.fract() != 0.0).prop_map(Key::float),
            1 => any::<bool>().prop_map(Key::Bool),
        ]
    }

    fn any_leaf() -> impl Strategy<Value = Value> {
        prop_oneof![
            Just(Value::Null),
            Just(Value::Missing),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::Int),
            any_float().prop_map(Value::Float),
            any_string().prop_map(Value::Str),
            prop::collection::vec(any::<u8>(), 0..100).prop_map(Value::Bytes),
        ]
    }

    /// A dict whose keys stay distinct under Python's key equality.
    fn python_distinct(pairs: Vec<(Key, Value)>) -> Value {
        let mut dict = Dict::new();
        let mut seen_numeric = std::collections::HashSet::new();
        for (key, value) in pairs {
            let numeric = match &key {
                Key::Int(i) => Some(*i),
                Key::Bool(b) => Some(i64::from(*b)),
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
                prop::collection::vec(inner.clone(), 0..6).prop_map(|items| Value::List(items.into_iter().map(Node::new).collect())),
                prop::collection::vec((any_key(), inner), 0..6).prop_map(python_distinct),
            ]
        });
        prop_oneof![
            prop::collection::vec((any_key(), value.clone()), 0..6).prop_map(python_distinct),
            prop::collection::vec(value, 1..6).prop_map(|items| Value::List(items.into_iter().map(Node::new).collect())),
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
            let tree = Node::new(dict(vec![(k("v"), Value::Str(text.clone())), (Key::Str(text), Value::Int(1))]));
            if let Err(e) = round_trips(&tree) {
                return Err(TestCaseError::fail(e));
            }
        }
    }
}
