//! Unix specifics of supervision: signalling the run's process group, and turning SIGINT/SIGTERM (or a
//! SIGHUP/SIGQUIT/SIGUSR1, or a manual shutdown handle) into supervisor events.

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use tokio::sync::{mpsc, watch};

use crate::orchestrator::supervisor::Event;

/// Send `signal` to every process of the group `pgid`; a group that is already gone is not an error.
pub fn signal_group(pgid: i32, signal: Signal) {
    if pgid > 1 {
        let _ = killpg(Pid::from_raw(pgid), signal);
    }
}

/// Where stop requests come from. Passed in so that tests need not send real signals to themselves.
pub enum ShutdownSource {
    /// SIGINT, SIGTERM, SIGHUP, SIGQUIT and SIGUSR1 of this process (the CLI).
    OsSignals,
    /// A handle the caller triggers (tests, embedding).
    Manual(ShutdownHandle),
}

/// Triggers a graceful stop; a second request kills the workers at once.
#[derive(Debug, Clone)]
pub struct ShutdownHandle(watch::Sender<u32>);

impl ShutdownHandle {
    pub fn new() -> ShutdownHandle {
        ShutdownHandle(watch::channel(0).0)
    }

    pub fn request(&self) {
        self.0.send_modify(|count| *count += 1);
    }
}

impl Default for ShutdownHandle {
    fn default() -> Self {
        ShutdownHandle::new()
    }
}

/// Forward stop requests from `source` as [`Event::Signal`]s.
pub fn forward_signals(
    source: ShutdownSource,
    events: mpsc::UnboundedSender<Event>,
) -> std::io::Result<()> {
    match source {
        ShutdownSource::OsSignals => {
            use tokio::signal::unix::{SignalKind, signal};
            let mut interrupt = signal(SignalKind::interrupt())?;
            let mut terminate = signal(SignalKind::terminate())?;
            // An ssh disconnect (SIGHUP), Ctrl-\ (SIGQUIT) and SIGUSR1 would otherwise end the orchestrator
            // without cleanup; they stop the run like SIGTERM.
            let mut hangup = signal(SignalKind::hangup())?;
            let mut quit = signal(SignalKind::quit())?;
            let mut user1 = signal(SignalKind::user_defined1())?;
            tokio::spawn(async move {
                loop {
                    let name = tokio::select! {
                        Some(()) = interrupt.recv() => "SIGINT",
                        Some(()) = terminate.recv() => "SIGTERM",
                        Some(()) = hangup.recv() => "SIGHUP",
                        Some(()) = quit.recv() => "SIGQUIT",
                        Some(()) = user1.recv() => "SIGUSR1",
                        else => break,
                    };
                    if events.send(Event::Signal { name }).is_err() {
                        break;
                    }
                }
            });
        }
        ShutdownSource::Manual(handle) => {
            let mut requests = handle.0.subscribe();
            tokio::spawn(async move {
                // Counting requests (not changes) keeps "second request kills at once" even when they coalesce.
                let mut seen = 0;
                loop {
                    let now = *requests.borrow_and_update();
                    for _ in seen..now {
                        if events
                            .send(Event::Signal {
                                name: "shutdown request",
                            })
                            .is_err()
                        {
                            return;
                        }
                    }
                    seen = now;
                    if requests.changed().await.is_err() {
                        return;
                    }
                }
            });
        }
    }
    Ok(())
}
