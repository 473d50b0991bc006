//! The weight syncer: `init_sender`/`init_receiver`/`sync`/`apply` over a transport (patch | bucket).
