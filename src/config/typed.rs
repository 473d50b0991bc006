//! extract the typed RunConfig from a resolved tree, with full key paths and did-you-mean errors.
