//! The orchestrator: supervisor, control protocol, synchronous and asynchronous training loops, metrics.
