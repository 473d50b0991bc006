//! A Python trainer's own state (`Trainer.state_dict()`: optimizer, critic, schedules) in a checkpoint
//! directory: `optimizer.safetensors`, the tensors by dotted path plus the nesting as JSON in its metadata
//! (`python/rlsync/checkpoint.py` flattens and rebuilds it; this module only writes and reads the file).

use std::path::Path;

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

use rlsync::checkpoint::{
    CheckpointError, FORMAT_VERSION, META_FORMAT, OPTIMIZER_FILE, read_metadata,
};
use rlsync_core::tensor::StateDict;

use crate::errors::RlsyncError;
use crate::syncer::{Desc, borrow};

/// Metadata key of the JSON tree that `rlsync.checkpoint.flatten_state` made.
pub const STRUCTURE_KEY: &str = "trainer_state";

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(read_trainer_state, m)?)?;
    m.add_function(wrap_pyfunction!(write_trainer_state, m)?)?;
    Ok(())
}

/// The checkpoint error (the app's typed `CheckpointError::Invalid`) for `path`.
fn file_error(path: &Path, reason: impl ToString) -> CheckpointError {
    CheckpointError::Invalid {
        path: path.to_owned(),
        reason: reason.to_string(),
    }
}

/// Write the described tensors and `structure` to `<dir>/optimizer.safetensors` (the GIL is released while
/// the file is written; the described tensor objects are held until it is).
pub fn save(
    py: Python<'_>,
    dir: &Path,
    descs: Vec<Desc>,
    structure: String,
    step: u64,
    version: u64,
) -> Result<(), CheckpointError> {
    let path = dir.join(OPTIMIZER_FILE);
    let (borrowed, keep) = borrow(descs).map_err(|e| {
        file_error(
            &path,
            format!("the trainer state's tensors: {}", e.value(py)),
        )
    })?;
    let meta = [
        ("format", META_FORMAT.to_owned()),
        ("format_version", FORMAT_VERSION.to_owned()),
        ("global_step", step.to_string()),
        ("version", version.to_string()),
        (STRUCTURE_KEY, structure),
    ]
    .map(|(k, v)| (k.to_owned(), v));
    let state = borrowed.state;
    let target = path.clone();
    let written = py.detach(move || state.save_safetensors_with(&target, &meta));
    drop(keep);
    written.map_err(|source| CheckpointError::Tensors { path, source })
}

/// One saved tensor as Python rebuilds it: `(name, torch dtype name, shape, bytes)`.
pub type Item = (String, &'static str, Vec<usize>, Vec<u8>);

/// Read `<dir>/optimizer.safetensors`: its tensors and the JSON tree. `Ok(None)` when the directory has no
/// such file; an error when the file is not a Python trainer's state (a built-in learner's Adam moments).
pub fn load(dir: &Path) -> Result<Option<(Vec<Item>, String)>, CheckpointError> {
    let path = dir.join(OPTIMIZER_FILE);
    if !path.is_file() {
        return Ok(None);
    }
    let meta = read_metadata(&path)?;
    let structure = meta.get(STRUCTURE_KEY).cloned().ok_or_else(|| {
        file_error(
            &path,
            format!("has no `{STRUCTURE_KEY}` metadata: not a Python trainer's state (a built-in learner's optimizer?)"),
        )
    })?;
    let state = StateDict::load_safetensors(&path).map_err(|source| CheckpointError::Tensors {
        path: path.clone(),
        source,
    })?;
    let items = state
        .iter()
        .map(|(name, t)| {
            (
                name.to_owned(),
                t.dtype().name(),
                t.shape().to_vec(),
                t.bytes().to_vec(),
            )
        })
        .collect();
    Ok(Some((items, structure)))
}

/// `(items, structure)` of the trainer state in checkpoint directory `dir`: `items` are `(name, dtype, shape,
/// bytes)`; `rlsync.checkpoint.load_trainer_state` rebuilds the nested state from them.
#[pyfunction]
fn read_trainer_state<'py>(
    py: Python<'py>,
    dir: std::path::PathBuf,
) -> PyResult<(Bound<'py, PyList>, String)> {
    let loaded = py
        .detach(|| load(&dir))
        .map_err(|e| RlsyncError::new_err(rlsync_core::error_chain(&e)))?;
    let (items, structure) = loaded.ok_or_else(|| {
        RlsyncError::new_err(format!(
            "{}: no trainer state (the trainer defined no state_dict())",
            dir.join(OPTIMIZER_FILE).display()
        ))
    })?;
    Ok((items_to_py(py, items)?, structure))
}

/// Write the described tensors and the JSON tree `structure` to `<dir>/optimizer.safetensors` (the directory
/// is created if needed), as a checkpoint of a Python trainer does.
#[pyfunction]
#[pyo3(signature = (dir, tensors, structure, step = 0, version = 0))]
fn write_trainer_state(
    py: Python<'_>,
    dir: std::path::PathBuf,
    tensors: Vec<Desc>,
    structure: String,
    step: u64,
    version: u64,
) -> PyResult<()> {
    std::fs::create_dir_all(&dir)
        .map_err(|e| RlsyncError::new_err(format!("{}: {e}", dir.display())))?;
    save(py, &dir, tensors, structure, step, version)
        .map_err(|e| RlsyncError::new_err(rlsync_core::error_chain(&e)))
}

/// The items as a Python list of `(name, dtype, shape, bytes)`.
pub fn items_to_py<'py>(py: Python<'py>, items: Vec<Item>) -> PyResult<Bound<'py, PyList>> {
    let list = PyList::empty(py);
    for (name, dtype, shape, data) in items {
        list.append((name, dtype, shape, PyBytes::new(py, &data)))?;
    }
    Ok(list)
}
