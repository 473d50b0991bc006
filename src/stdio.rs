//! Writing to stdout and stderr without panicking: a closed pipe (`rlsync --cfg all | head -1`) ends the output
//! quietly, as `cat` does, and the run's cleanup still happens.
//!
//! Rust's `print!`/`eprint!` panic when the write fails (the runtime ignores `SIGPIPE`, so a closed pipe is an
//! `EPIPE` error). Every user-facing write of rlsync goes through [`out`] / [`err`] instead: the first failed
//! write marks that stream closed and later writes to it are dropped.
//!
//! Errors say only their own layer and keep the cause in `source()` (nextest's convention); [`error_chain`]
//! puts an error and its causes on one line where a single line is wanted (a worker's `Failed` report, a
//! Python exception, a reason inside another message).

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};

static STDOUT_CLOSED: AtomicBool = AtomicBool::new(false);
static STDERR_CLOSED: AtomicBool = AtomicBool::new(false);

/// Write to stdout (flushed); a failure closes stdout for the rest of the process, silently.
pub fn out(args: fmt::Arguments<'_>) {
    write_to(&mut std::io::stdout().lock(), &STDOUT_CLOSED, args);
}

/// Write to stderr; a failure closes stderr for the rest of the process, silently.
pub fn err(args: fmt::Arguments<'_>) {
    write_to(&mut std::io::stderr().lock(), &STDERR_CLOSED, args);
}

/// `err` and each of its causes, outermost first, joined by `: ` (each layer's message says only its own part).
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

fn write_to(w: &mut impl std::io::Write, closed: &AtomicBool, args: fmt::Arguments<'_>) {
    if closed.load(Ordering::Relaxed) {
        return;
    }
    if w.write_fmt(args).and_then(|()| w.flush()).is_err() {
        closed.store(true, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Broken(usize);

    impl std::io::Write for Broken {
        fn write(&mut self, _: &[u8]) -> std::io::Result<usize> {
            self.0 += 1;
            Err(std::io::Error::from(std::io::ErrorKind::BrokenPipe))
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_broken_stream_is_written_once_then_dropped() {
        let closed = AtomicBool::new(false);
        let mut w = Broken(0);
        write_to(&mut w, &closed, format_args!("a"));
        write_to(&mut w, &closed, format_args!("b"));
        assert!(closed.load(Ordering::Relaxed));
        assert_eq!(w.0, 1, "after the first failure nothing more is tried");
    }
}
