//! Build script: embed rlsync's config tree (`config/`) into the binary.
//!
//! Generates `$OUT_DIR/embedded_configs.rs` with one table, `MAIN` (see hydra-compose's
//! `build/embed_tree.rs`, which this includes), that the app hands to the Hydra engine as its primary config
//! source.

use std::path::PathBuf;

#[path = "crates/hydra-compose/build/embed_tree.rs"]
mod embed_tree;

fn main() {
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").unwrap_or_default());
    embed_tree::write_tables("embedded_configs.rs", &[("MAIN", manifest.join("config"))]);
}
