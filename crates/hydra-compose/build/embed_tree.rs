//! Build-time embedding of config trees: every `.yaml`/`.yml` file under a directory as a
//! `pub static NAME: &[(&str, &str)]` table of `(path relative to the tree root, file text)`, sorted by path.
//!
//! Shared by hydra-compose's build script (Hydra's own trees) and the app's (its `config/`), which includes
//! this file by path: a build script cannot depend on the crate it builds, and this is all the two share.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// Write `$OUT_DIR/<file>` with one table per `(NAME, tree root)`; a missing tree gives an empty table.
/// Cargo reruns the build script when a tree changes.
pub fn write_tables(file: &str, trees: &[(&str, PathBuf)]) {
    let out_dir = PathBuf::from(std::env::var_os("OUT_DIR").unwrap_or_default());
    let mut code = String::new();
    for (name, root) in trees {
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
    if let Err(err) = std::fs::write(out_dir.join(file), code) {
        panic!("cannot write {file}: {err}");
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
