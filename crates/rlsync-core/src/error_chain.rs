//! An error and its causes on one line, where a single line is wanted (a worker's `Failed` report, a Python
//! exception, a reason inside another message).
//!
//! Errors say only their own layer and keep the cause in `source()` (nextest's convention); the app's
//! `cli::error_report` prints the chain a line per cause, this joins it.

/// `err` and each of its causes, outermost first, joined by `: `.
pub fn error_chain(err: &dyn std::error::Error) -> String {
    let mut msg = err.to_string();
    let mut cause = err.source();
    while let Some(c) = cause {
        msg.push_str(": ");
        msg.push_str(&c.to_string());
        cause = c.source();
    }
    msg
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("outer")]
    struct Outer(#[source] std::io::Error);

    #[test]
    fn every_cause_is_joined_outermost_first() {
        let err = Outer(std::io::Error::other("inner"));
        assert_eq!(error_chain(&err), "outer: inner");
    }
}
