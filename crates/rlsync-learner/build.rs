//! Build script: record libtorch's library directory as an rpath of the learner's binaries and tests, so they
//! run (and are spawned by `rlsync`) without `LD_LIBRARY_PATH`.
//!
//! The directory is taken from `LIBTORCH_LIB`, else `$LIBTORCH/lib`, else (with `LIBTORCH_USE_PYTORCH`) from
//! the `torch` package of the Python found as `PYTHON_SYS_EXECUTABLE` or `python` on `PATH` — the same sources
//! torch-sys links against.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    rpath_libtorch();
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
    // Only this crate tracks where libtorch is: the plain crates below it never see these variables, so
    // `maturin` (which sets PYTHON_SYS_EXECUTABLE) and `make build` taking turns rebuild nothing of theirs.
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
