//! `rlsync bench_sync`: the weight-sync benchmark entry point.
