//! the Hydra command-line override grammar, parsed into typed overrides and sweeps.
