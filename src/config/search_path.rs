//! the config search path: embedded tree, --config-path/--config-dir, hydra.searchpath.
