//! Stages of a worker's start-up where a probe passed into the worker runtime can hold it.
//!
//! The shipped executables pass no probe. The integration tests run their workers from the `held_worker`
//! example (`RLSYNC_WORKER`), whose probe holds one worker at one stage until the test kills it, so a test
//! can kill a rollout at an exact moment; nothing of that is compiled into `rlsync`.

use rlsync_core::syncer::Hold;

/// A point of a worker's start-up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// Before its hello: its supervisor (a node agent's too) is still waiting for it.
    Hello,
    /// Connected to its weight channel, before it sent its metadata (the trainer's init bootstrap waits on it).
    Handshake,
    /// The weight channel's plan received, before the init bootstrap's payloads.
    Bootstrap,
    /// A rejoin's catch-up announced, before its replay or full transfer.
    CatchUp,
}

/// What a worker awaits at each stage of its start-up.
pub trait StageProbe: Send + Sync {
    /// The future this worker awaits when it reaches `stage` (`None`: it goes on at once). Called when the
    /// stage's code is set up, which may be before it is reached: the future must do its work when polled.
    fn at(&self, stage: Stage) -> Option<Hold>;
}
