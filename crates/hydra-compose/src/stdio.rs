//! Writing to stdout and stderr without panicking: a closed pipe (`app --cfg all | head -1`) ends the output
//! quietly, as `cat` does, and the program's cleanup still happens.
//!
//! Rust's `print!`/`eprint!` panic when the write fails (Rust ignores `SIGPIPE`, so a closed pipe is an
//! `EPIPE` error). Everything Hydra prints (`--cfg`, `--info`, help, the multirun's job lines) goes through
//! [`out`] / [`err`] instead, and so can the program's own output: the first failed write marks that stream
//! closed and later writes to it are dropped.

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
