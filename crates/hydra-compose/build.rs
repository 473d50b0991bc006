//! Build script: embed Hydra's own config trees (`pkg://hydra.conf` and its ConfigStore) into the library.
//!
//! Generates `$OUT_DIR/embedded_configs.rs` with two `&[(&str, &str)]` tables (path relative to the tree root,
//! file text): `HYDRA_PKG` (Hydra's `pkg://hydra.conf`) and `HYDRA_STRUCTURED` (what Hydra keeps in its
//! ConfigStore: `hydra/config`, launcher and sweeper). Every `.yaml`/`.yml` file is embedded.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

fn main() {
    embed_configs();
}

fn embed_configs() {
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").unwrap_or_default());
    let out_dir = PathBuf::from(std::env::var_os("OUT_DIR").unwrap_or_default());
    let builtin = manifest.join("src/hydra_builtin");
    let trees = [
        ("HYDRA_PKG", builtin.join("pkg")),
        ("HYDRA_STRUCTURED", builtin.join("structured")),
    ];
    let mut code = String::new();
    for (name, root) in &trees {
        println!("cargo:rerun-if-changed={}", root.display());
        let mut files = Vec::new();
        collect(root, root, &mut files);
        files.sort();
        let _ = writeln!(code, "pub static {name}: &[(&str, &str)] = &[");
        for (rel, abs) in files {
            let _ = writeln!(
                code,
                "    ({rel:?}, include_str!({:?})),",
                abs.display().to_string()
            );
        }
        let _ = writeln!(code, "];");
    }
    if let Err(err) = std::fs::write(out_dir.join("embedded_configs.rs"), code) {
        panic!("cannot write embedded_configs.rs: {err}");
    }
}

/// Collect `(path relative to root with '/' separators, absolute path)` of every YAML file under `dir`.
fn collect(root: &Path, dir: &Path, out: &mut Vec<(String, PathBuf)>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            collect(root, &path, out);
        } else if matches!(
            path.extension().and_then(|e| e.to_str()),
            Some("yaml" | "yml")
        ) && let Ok(rel) = path.strip_prefix(root)
        {
            let rel: Vec<String> = rel
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect();
            out.push((rel.join("/"), path));
        }
    }
}
