//! Console logging set-up (tracing) shared by the orchestrator process and the workers.

use crate::config::schema::LogLevel;

/// Install a plain stderr subscriber at `level` (`runner.logger.level`). Lines are short and unprefixed: the
/// orchestrator adds the `[role-rank]` prefix to worker output itself. A second call is a no-op.
pub(crate) fn init_console(level: LogLevel) {
    let level = match level {
        LogLevel::Error => tracing::Level::ERROR,
        LogLevel::Warn => tracing::Level::WARN,
        LogLevel::Info => tracing::Level::INFO,
        LogLevel::Debug => tracing::Level::DEBUG,
        LogLevel::Trace => tracing::Level::TRACE,
    };
    let _ = tracing_subscriber::fmt()
        .with_max_level(level)
        .with_ansi(false)
        .without_time()
        .with_target(false)
        .with_writer(std::io::stderr)
        .try_init();
}
