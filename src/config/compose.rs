//! merge configs in defaults-list order, apply CLI overrides, enforce struct mode.
