//! "Did you mean": the known name closest to a mistyped one, when it is close enough to be a typo.

/// The closest name in `known` to `key` by edit distance, if within a third of `key`'s length (1 to 3 edits).
pub fn closest(key: &str, known: &[&str]) -> Option<String> {
    let budget = (key.chars().count() / 3).clamp(1, 3);
    known
        .iter()
        .map(|k| (strsim::levenshtein(key, k), *k))
        .filter(|(d, _)| *d <= budget)
        .min_by_key(|(d, _)| *d)
        .map(|(_, k)| k.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_near_misses_are_suggested() {
        assert_eq!(
            closest("compresion", &["compression", "delta_encoding"]).as_deref(),
            Some("compression")
        );
        assert_eq!(
            closest("video_cfg", &["compression", "delta_encoding"]),
            None
        );
        assert_eq!(closest("ab", &["abc", "xyz"]).as_deref(), Some("abc"));
        assert_eq!(closest("a", &["xyz"]), None);
    }

    #[test]
    fn the_nearest_of_several_wins() {
        assert_eq!(
            closest("bucket_sze", &["bucket_size", "bucket_dtype"]).as_deref(),
            Some("bucket_size")
        );
    }
}
