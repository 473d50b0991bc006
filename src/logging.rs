//! Logging set-up (tracing) shared by the orchestrator process and the workers: the console, and in the
//! orchestrator the Hydra job log `<run_dir>/<job_name>.log`.

use std::io::Write;
use std::path::Path;
use std::sync::Mutex;

use tracing::field::{Field, Visit};
use tracing_subscriber::Layer;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

use crate::config::schema::LogLevel;

/// The job log the orchestrator's lines also go to (one per job: `-m` switches it between jobs).
static JOB_LOG: Mutex<Option<std::fs::File>> = Mutex::new(None);

fn level_filter(level: LogLevel) -> tracing::level_filters::LevelFilter {
    use tracing::level_filters::LevelFilter;
    match level {
        LogLevel::Error => LevelFilter::ERROR,
        LogLevel::Warn => LevelFilter::WARN,
        LogLevel::Info => LevelFilter::INFO,
        LogLevel::Debug => LevelFilter::DEBUG,
        LogLevel::Trace => LevelFilter::TRACE,
    }
}

/// Install a plain stderr subscriber at `level` (`runner.logger.level`), plus the job-log layer (inactive until
/// [`set_job_log`]). Lines are short and unprefixed: the orchestrator adds the `[role-rank]` prefix to worker
/// output itself. A second call is a no-op.
pub(crate) fn init_console(level: LogLevel) {
    let console = tracing_subscriber::fmt::layer()
        .with_ansi(false)
        .without_time()
        .with_target(false)
        .with_writer(std::io::stderr)
        .with_filter(level_filter(level));
    let _ = tracing_subscriber::registry()
        .with(console)
        .with(JobLogLayer.with_filter(level_filter(level)))
        .try_init();
}

/// Send the orchestrator's log lines to `path` too (appended, as Hydra's job log is), or stop with `None`.
pub fn set_job_log(path: Option<&Path>) -> std::io::Result<()> {
    let file = match path {
        Some(path) => Some(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)?,
        ),
        None => None,
    };
    if let Ok(mut slot) = JOB_LOG.lock() {
        *slot = file;
    }
    Ok(())
}

/// Append `line` to the job log only (what the run prints on stdout, such as the summary, goes there too).
pub fn to_job_log(line: &str) {
    if let Ok(mut slot) = JOB_LOG.lock()
        && let Some(file) = slot.as_mut()
    {
        let now = chrono::Local::now().naive_local();
        let _ = writeln!(file, "{}", job_log_line(&now, &tracing::Level::INFO, line));
    }
}

/// One line of Hydra's job log format: `[2026-01-02 03:04:05,678][rlsync][INFO] - message`.
pub fn job_log_line(time: &chrono::NaiveDateTime, level: &tracing::Level, message: &str) -> String {
    format!(
        "[{}][rlsync][{}] - {message}",
        time.format("%Y-%m-%d %H:%M:%S,%3f"),
        match *level {
            tracing::Level::WARN => "WARNING".to_owned(),
            other => other.to_string(),
        }
    )
}

struct JobLogLayer;

#[derive(Default)]
struct Message(String);

impl Visit for Message {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.0 = value.to_owned();
        } else {
            self.0.push_str(&format!(" {}={value}", field.name()));
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            self.0 = format!("{value:?}");
        } else {
            self.0.push_str(&format!(" {}={value:?}", field.name()));
        }
    }
}

impl<S: tracing::Subscriber> Layer<S> for JobLogLayer {
    fn on_event(
        &self,
        event: &tracing::Event<'_>,
        _ctx: tracing_subscriber::layer::Context<'_, S>,
    ) {
        let Ok(mut slot) = JOB_LOG.lock() else {
            return;
        };
        let Some(file) = slot.as_mut() else {
            return;
        };
        let mut message = Message::default();
        event.record(&mut message);
        let now = chrono::Local::now().naive_local();
        let _ = writeln!(
            file,
            "{}",
            job_log_line(&now, event.metadata().level(), &message.0)
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn job_log_lines_use_hydras_format() {
        let t = chrono::NaiveDate::from_ymd_opt(2026, 1, 2)
            .and_then(|d| d.and_hms_milli_opt(3, 4, 5, 678))
            .unwrap();
        assert_eq!(
            job_log_line(&t, &tracing::Level::INFO, "step 1/2"),
            "[2026-01-02 03:04:05,678][rlsync][INFO] - step 1/2"
        );
        assert_eq!(
            job_log_line(&t, &tracing::Level::WARN, "x"),
            "[2026-01-02 03:04:05,678][rlsync][WARNING] - x"
        );
    }
}
