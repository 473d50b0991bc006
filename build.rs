//! Build script: embed the config trees into the binary, and (feature `torch`) rpath libtorch's lib directory.
//!
//! Embedding: generates `$OUT_DIR/embedded_configs.rs` with three `&[(&str, &str)]` tables (path relative to
//! the tree root, file text): `MAIN` (the repo's `config/`), `HYDRA_PKG` (Hydra's `pkg://hydra.conf`) and
//! `HYDRA_STRUCTURED` (what Hydra keeps in its ConfigStore: `hydra/config`, launcher and sweeper).
//! Every `.yaml`/`.yml` file is embedded; a missing tree gives an empty table.
//!
//! libtorch: with the `torch` feature, records libtorch's library directory as an rpath of rlsync's binaries
//! and tests, so they run (and spawn workers) without `LD_LIBRARY_PATH`. The directory is taken from
//! `LIBTORCH_LIB`, else `$LIBTORCH/lib`, else (with `LIBTORCH_USE_PYTORCH`) from the `torch` package of the
//! Python found as `PYTHON_SYS_EXECUTABLE` or `python` on `PATH` — the same sources torch-sys links against.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    embed_configs();
    rpath_libtorch();
}

fn embed_configs() {
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").unwrap_or_default());
    let out_dir = PathBuf::from(std::env::var_os("OUT_DIR").unwrap_or_default());
    let builtin = manifest.join("src/config/hydra_builtin");
    let trees = [
        ("MAIN", manifest.join("config")),
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

fn torch_lib_dir() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("LIBTORCH_LIB") {
        return Some(PathBuf::from(dir));
    }
    if let Some(root) = std::env::var_os("LIBTORCH") {
        return Some(PathBuf::from(root).join("lib"));
    }
    std::env::var_os("LIBTORCH_USE_PYTORCH")?;
    let python = std::env::var_os("PYTHON_SYS_EXECUTABLE").unwrap_or_else(|| "python".into());
    let out = Command::new(python)
        .args([
            "-c",
            "import os, torch; print(os.path.join(os.path.dirname(torch.__file__), 'lib'))",
        ])
        .output()
        .ok()?;
    let dir = String::from_utf8(out.stdout).ok()?;
    out.status.success().then(|| PathBuf::from(dir.trim()))
}

fn rpath_libtorch() {
    println!("cargo:rerun-if-changed=build.rs");
    // The feature set is part of the build's identity already; only a torch build depends on where libtorch
    // is. A plain build must not track these: `maturin` sets PYTHON_SYS_EXECUTABLE, and a plain build that
    // tracked it would be rebuilt each time `make build` and `make python` take turns (issue 12 item 4).
    if std::env::var_os("CARGO_FEATURE_TORCH").is_none() {
        return;
    }
    for var in [
        "LIBTORCH_LIB",
        "LIBTORCH",
        "LIBTORCH_USE_PYTORCH",
        "PYTHON_SYS_EXECUTABLE",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    match torch_lib_dir() {
        Some(dir) => println!("cargo:rustc-link-arg=-Wl,-rpath,{}", dir.display()),
        None => println!(
            "cargo:warning=libtorch's lib directory not found: set LIBTORCH_LIB or LD_LIBRARY_PATH to run"
        ),
    }
}
