//! Build script: embed Hydra's own config trees (`pkg://hydra.conf` and its ConfigStore) into the library.
//!
//! Generates `$OUT_DIR/embedded_configs.rs` with two tables (see `build/embed_tree.rs`): `HYDRA_PKG` (Hydra's
//! `pkg://hydra.conf`) and `HYDRA_STRUCTURED` (what Hydra keeps in its ConfigStore: `hydra/config`, launcher
//! and sweeper).

use std::path::PathBuf;

#[path = "build/embed_tree.rs"]
mod embed_tree;

fn main() {
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").unwrap_or_default());
    let builtin = manifest.join("src/hydra_builtin");
    embed_tree::write_tables(
        "embedded_configs.rs",
        &[
            ("HYDRA_PKG", builtin.join("pkg")),
            ("HYDRA_STRUCTURED", builtin.join("structured")),
        ],
    );
}
