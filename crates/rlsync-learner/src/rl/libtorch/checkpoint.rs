//! Checkpoint files: named libtorch tensors to and from safetensors (written straight from the tensors'
//! CPU memory, no staging copy, replacing the file whole or not at all), with string metadata (tensor classes, step,
//! version, optimizer steps).

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::Path;

use safetensors::tensor::{Dtype, SafeTensors, View};
use tch::{Kind, Tensor};

use rlsync::checkpoint::CheckpointError;
use rlsync_core::atomic_file::{Access, AtomicFile};
use rlsync_core::tensor::TensorError;

use crate::rl::RlError;

/// A contiguous CPU tensor seen as safetensors bytes.
struct TensorBytes {
    tensor: Tensor,
    shape: Vec<usize>,
    dtype: Dtype,
}

impl View for &TensorBytes {
    fn dtype(&self) -> Dtype {
        self.dtype
    }

    fn shape(&self) -> &[usize] {
        &self.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        let len = self.data_len();
        if len == 0 {
            return Cow::Borrowed(&[]);
        }
        // SAFETY: `tensor` is a contiguous CPU tensor owned by `self` for the borrow's lifetime; its storage
        // holds `numel * element size` initialised bytes starting at `data_ptr`.
        Cow::Borrowed(unsafe {
            std::slice::from_raw_parts(self.tensor.data_ptr() as *const u8, len)
        })
    }

    fn data_len(&self) -> usize {
        self.tensor.numel() * self.tensor.kind().elt_size_in_bytes()
    }
}

fn dtype_of(kind: Kind) -> Option<Dtype> {
    Some(match kind {
        Kind::Float => Dtype::F32,
        Kind::Double => Dtype::F64,
        Kind::BFloat16 => Dtype::BF16,
        Kind::Half => Dtype::F16,
        Kind::Int64 => Dtype::I64,
        Kind::Int => Dtype::I32,
        Kind::Int16 => Dtype::I16,
        Kind::Int8 => Dtype::I8,
        Kind::Uint8 => Dtype::U8,
        Kind::Bool => Dtype::BOOL,
        _ => return None,
    })
}

fn kind_of(dtype: Dtype) -> Option<Kind> {
    Some(match dtype {
        Dtype::F32 => Kind::Float,
        Dtype::F64 => Kind::Double,
        Dtype::BF16 => Kind::BFloat16,
        Dtype::F16 => Kind::Half,
        Dtype::I64 => Kind::Int64,
        Dtype::I32 => Kind::Int,
        Dtype::I16 => Kind::Int16,
        Dtype::I8 => Kind::Int8,
        Dtype::U8 => Kind::Uint8,
        Dtype::BOOL => Kind::Bool,
        _ => return None,
    })
}

/// The checkpoint error for a file the `safetensors` crate cannot read or write.
fn format_error(path: &Path) -> impl FnOnce(safetensors::SafeTensorError) -> CheckpointError + '_ {
    move |source| CheckpointError::Tensors {
        path: path.to_owned(),
        source: TensorError::Format {
            path: path.to_owned(),
            source,
        },
    }
}

/// Writes `tensors` and `metadata` to `path` (a temporary file beside it, synced, renamed over it).
pub(crate) fn save(
    path: &Path,
    tensors: &[(String, Tensor)],
    metadata: HashMap<String, String>,
) -> Result<(), RlError> {
    let err = |reason: String| CheckpointError::Invalid {
        path: path.to_owned(),
        reason,
    };
    let views = tensors
        .iter()
        .map(|(name, t)| {
            let tensor = t.detach().contiguous();
            let dtype = dtype_of(tensor.kind()).ok_or_else(|| {
                err(format!(
                    "`{name}` has unsupported dtype {:?}",
                    tensor.kind()
                ))
            })?;
            let shape = tensor.size().iter().map(|&d| d as usize).collect();
            Ok((
                name.clone(),
                TensorBytes {
                    tensor,
                    shape,
                    dtype,
                },
            ))
        })
        .collect::<Result<Vec<_>, RlError>>()?;
    let io = |source| CheckpointError::Io {
        path: path.to_owned(),
        source,
    };
    let file = AtomicFile::create(path, Access::Shared).map_err(io)?;
    safetensors::serialize_to_file(
        views.iter().map(|(n, v)| (n.as_str(), v)),
        &Some(metadata),
        file.path(),
    )
    .map_err(format_error(path))?;
    file.commit().map_err(io)?;
    Ok(())
}

/// A checkpoint file's tensors (in file order) and its metadata.
type Loaded = (Vec<(String, Tensor)>, HashMap<String, String>);

/// Reads every tensor and the metadata of `path`.
pub(crate) fn load(path: &Path) -> Result<Loaded, RlError> {
    let err = |reason: String| CheckpointError::Invalid {
        path: path.to_owned(),
        reason,
    };
    let bytes = std::fs::read(path).map_err(|source| CheckpointError::Io {
        path: path.to_owned(),
        source,
    })?;
    let (_, meta) = SafeTensors::read_metadata(&bytes).map_err(format_error(path))?;
    let metadata = meta.metadata().clone().unwrap_or_default();
    let st = SafeTensors::deserialize(&bytes).map_err(format_error(path))?;
    let mut out = Vec::new();
    for (name, view) in st.tensors() {
        let kind = kind_of(view.dtype())
            .ok_or_else(|| err(format!("`{name}` has unsupported dtype {:?}", view.dtype())))?;
        let shape: Vec<i64> = view.shape().iter().map(|&d| d as i64).collect();
        let t = Tensor::f_from_data_size(view.data(), &shape, kind)
            .map_err(|e| err(format!("`{name}`: {e}")))?;
        out.push((name, t));
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok((out, metadata))
}

/// A metadata entry parsed as an integer.
pub(crate) fn meta_u64(
    meta: &HashMap<String, String>,
    key: &str,
    path: &Path,
) -> Result<u64, RlError> {
    meta.get(key).and_then(|v| v.parse().ok()).ok_or_else(|| {
        CheckpointError::Invalid {
            path: path.to_owned(),
            reason: format!("metadata `{key}` is missing or not an integer"),
        }
        .into()
    })
}
