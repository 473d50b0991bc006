//! How ANTLR 4 writes the parts of a syntax error (an expected-token set, an offending input), shared by the two
//! error walks that reproduce its messages: overrides (Hydra's grammar) and interpolations (OmegaConf's).

/// An expected-token set as `IntervalSet.toString(vocabulary)` prints it: one name bare, several in braces.
/// `names[i]` is the name of the token kind of bit `i` of `set`.
pub(crate) fn token_set(set: u32, names: impl IntoIterator<Item = &'static str>) -> String {
    let names: Vec<&str> = names
        .into_iter()
        .enumerate()
        .filter(|(i, _)| *i < 32 && set & (1 << i) != 0)
        .map(|(_, n)| n)
        .collect();
    match names.as_slice() {
        [one] => (*one).to_owned(),
        many => format!("{{{}}}", many.join(", ")),
    }
}

/// ANTLR's `escapeWSAndQuote`: line breaks and tabs escaped, the text in single quotes.
pub(crate) fn quote(text: &str) -> String {
    let escaped = text
        .replace('\n', "\\n")
        .replace('\r', "\\r")
        .replace('\t', "\\t");
    format!("'{escaped}'")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_name_is_bare_several_are_braced_in_bit_order() {
        let names = ["<EOF>", "EQUAL", "'~'", "ID"];
        assert_eq!(token_set(0b0010, names), "EQUAL");
        assert_eq!(token_set(0b1001, names), "{<EOF>, ID}");
        assert_eq!(token_set(0, names), "{}");
    }

    #[test]
    fn whitespace_is_escaped_inside_quotes() {
        assert_eq!(quote("a\tb\nc\rd"), "'a\\tb\\nc\\rd'");
        assert_eq!(quote(""), "''");
    }
}
