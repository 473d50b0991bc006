//! Property and end-to-end tests of the weight syncer over the in-process transport.
