//! Named CPU tensors with dtype, shape and class (trainable | buffer | frozen); safetensors I/O; checksums.
//!
//! A [`Tensor`] is a [`Layout`] (dtype + shape) over a [`Storage`] (aligned host bytes) plus its
//! [`Class`]. A [`StateDict`] is an ordered map from names to tensors. "Synced keys" are the trainable
//! parameters and persistent buffers; frozen tensors are only aligned by the one-time init bootstrap.

pub mod borrowed;
mod cast;
pub(crate) mod checksum;
mod dtype;
pub mod parallel;
mod safetensors_io;
mod storage;
pub mod synthetic;

use indexmap::IndexMap;

pub use borrowed::{BorrowError, BorrowedState, RawTensor};
pub use cast::{CastError, can_cast, cast_bytes, cast_f32_to_bf16, copy_streaming};
pub use checksum::{
    CHUNK as CHECKSUM_CHUNK, StateHasher, state_checksum, state_checksum_threads, state_checksum_v1,
};
pub use dtype::{DType, Element};
pub use storage::{Layout, Storage};
pub(crate) use storage::{Pod, pod_slice, pod_slice_mut};

/// Errors of tensor construction and typed views.
#[derive(Debug, thiserror::Error)]
pub enum TensorError {
    #[error("shape {shape:?} of dtype {dtype} overflows the address space")]
    ShapeOverflow { dtype: DType, shape: Vec<usize> },
    #[error("{got} bytes given for a {dtype} tensor of shape {shape:?} (expected {expected})")]
    ByteLength {
        dtype: DType,
        shape: Vec<usize>,
        expected: usize,
        got: usize,
    },
    #[error("cannot view a {dtype} tensor as {requested}")]
    ViewType {
        dtype: DType,
        requested: &'static str,
    },
    #[error("i/o on {path}")]
    Io {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    #[error("safetensors file {path}: {reason}")]
    Safetensors {
        path: std::path::PathBuf,
        reason: String,
    },
    /// The file is not safetensors (as the `safetensors` crate reads it), or cannot be written as such.
    #[error("safetensors file {path}")]
    Format {
        path: std::path::PathBuf,
        #[source]
        source: safetensors_io::SafeTensorError,
    },
    /// One of rlsync's metadata entries (key order, classes) is not the JSON list it writes.
    #[error("safetensors file {path}: bad {key} metadata")]
    Metadata {
        path: std::path::PathBuf,
        key: &'static str,
        #[source]
        source: serde_json::Error,
    },
    /// The file holds other tensors than the state it was loaded for (boxed: it names a tensor and two
    /// layouts, which would make every `TensorError` that large).
    #[error("safetensors file {path} does not hold the model's tensors")]
    Mismatch {
        path: std::path::PathBuf,
        #[source]
        source: Box<LayoutMismatch>,
    },
}

/// The first way a state dict differs from a model's in names, dtypes or shapes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutMismatch {
    #[error("it has {found} keys, the model has {expected}")]
    Count { found: usize, expected: usize },
    #[error("it has no tensor `{name}`")]
    Missing { name: String },
    #[error("`{name}` is {found_dtype} {found_shape:?}, the model's is {dtype} {shape:?}")]
    Layout {
        name: String,
        found_dtype: DType,
        found_shape: Vec<usize>,
        dtype: DType,
        shape: Vec<usize>,
    },
}

/// How a tensor takes part in training and weight sync.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Class {
    /// A parameter the optimizer updates (synced every version).
    Trainable,
    /// A persistent buffer (running stats, counters; synced every version).
    Buffer,
    /// A parameter that never changes (aligned once by the init bootstrap, never patched).
    Frozen,
}

impl Class {
    pub fn name(self) -> &'static str {
        match self {
            Class::Trainable => "trainable",
            Class::Buffer => "buffer",
            Class::Frozen => "frozen",
        }
    }

    pub(crate) fn from_name(name: &str) -> Option<Class> {
        match name {
            "trainable" => Some(Class::Trainable),
            "buffer" => Some(Class::Buffer),
            "frozen" => Some(Class::Frozen),
            _ => None,
        }
    }

    /// Whether incremental sync covers tensors of this class.
    pub(crate) fn is_synced(self) -> bool {
        !matches!(self, Class::Frozen)
    }
}

/// A contiguous tensor: layout + storage + class. Not `Clone` (use [`Tensor::duplicate`]).
#[derive(Debug)]
pub struct Tensor {
    layout: Layout,
    storage: Storage,
    class: Class,
}

impl Tensor {
    /// A zero-filled tensor.
    pub fn zeros(dtype: DType, shape: &[usize], class: Class) -> Result<Tensor, TensorError> {
        let layout = Layout::new(dtype, shape);
        let len = layout
            .checked_byte_len()
            .ok_or_else(|| TensorError::ShapeOverflow {
                dtype,
                shape: shape.to_vec(),
            })?;
        Ok(Tensor {
            layout,
            storage: Storage::zeroed(len),
            class,
        })
    }

    /// A tensor holding a copy of `bytes` (native-endian element bytes, row-major).
    pub fn from_bytes(
        dtype: DType,
        shape: &[usize],
        class: Class,
        bytes: &[u8],
    ) -> Result<Tensor, TensorError> {
        let mut t = Tensor::zeros(dtype, shape, class)?;
        if t.storage.len() != bytes.len() {
            return Err(TensorError::ByteLength {
                dtype,
                shape: shape.to_vec(),
                expected: t.storage.len(),
                got: bytes.len(),
            });
        }
        t.storage.bytes_mut().copy_from_slice(bytes);
        Ok(t)
    }

    /// A tensor from typed values; `dtype` must match `T` (`u8` also fits `Bool`, values must then be 0 or 1).
    pub fn from_slice<T: Element>(
        dtype: DType,
        shape: &[usize],
        class: Class,
        values: &[T],
    ) -> Result<Tensor, TensorError> {
        if !T::matches(dtype) {
            return Err(TensorError::ViewType {
                dtype,
                requested: std::any::type_name::<T>(),
            });
        }
        Tensor::from_bytes(dtype, shape, class, bytemuck::cast_slice(values))
    }

    /// A tensor over an existing storage; its length must match the layout.
    pub fn from_storage(
        layout: Layout,
        storage: Storage,
        class: Class,
    ) -> Result<Tensor, TensorError> {
        let expected = layout
            .checked_byte_len()
            .ok_or_else(|| TensorError::ShapeOverflow {
                dtype: layout.dtype(),
                shape: layout.shape().to_vec(),
            })?;
        if storage.len() != expected {
            return Err(TensorError::ByteLength {
                dtype: layout.dtype(),
                shape: layout.shape().to_vec(),
                expected,
                got: storage.len(),
            });
        }
        Ok(Tensor {
            layout,
            storage,
            class,
        })
    }

    /// An explicit deep copy.
    pub fn duplicate(&self) -> Tensor {
        Tensor {
            layout: self.layout.clone(),
            storage: self.storage.duplicate(),
            class: self.class,
        }
    }

    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    pub fn dtype(&self) -> DType {
        self.layout.dtype()
    }

    pub fn shape(&self) -> &[usize] {
        self.layout.shape()
    }

    pub fn numel(&self) -> usize {
        self.storage.len() / self.dtype().size_bytes()
    }

    pub fn class(&self) -> Class {
        self.class
    }

    pub fn set_class(&mut self, class: Class) {
        self.class = class;
    }

    pub fn storage(&self) -> &Storage {
        &self.storage
    }

    pub fn bytes(&self) -> &[u8] {
        self.storage.bytes()
    }

    pub fn bytes_mut(&mut self) -> &mut [u8] {
        self.storage.bytes_mut()
    }

    /// Swap in another storage of the same byte length, returning the previous one (used for atomic installs).
    ///
    /// A borrowed storage (memory the caller owns, see [`Storage::borrowed`]) stays in place: the bytes are
    /// swapped instead, so the caller's tensor gets the new values and the returned storage holds the old ones.
    pub(crate) fn replace_storage(&mut self, mut storage: Storage) -> Result<Storage, TensorError> {
        if storage.len() != self.storage.len() {
            return Err(TensorError::ByteLength {
                dtype: self.dtype(),
                shape: self.shape().to_vec(),
                expected: self.storage.len(),
                got: storage.len(),
            });
        }
        if self.storage.is_borrowed() {
            self.storage
                .bytes_mut()
                .swap_with_slice(storage.bytes_mut());
            return Ok(storage);
        }
        Ok(std::mem::replace(&mut self.storage, storage))
    }

    /// Typed view; `T` must match the dtype (`u8` for `Bool`).
    pub fn as_slice<T: Element>(&self) -> Result<&[T], TensorError> {
        let dtype = self.dtype();
        if !T::matches(dtype) {
            return Err(TensorError::ViewType {
                dtype,
                requested: std::any::type_name::<T>(),
            });
        }
        storage::element_slice(self.storage.bytes()).ok_or(TensorError::ViewType {
            dtype,
            requested: std::any::type_name::<T>(),
        })
    }

    /// Typed mutable view; `T` must match the dtype (`u8` for `Bool`).
    pub fn as_mut_slice<T: Element>(&mut self) -> Result<&mut [T], TensorError> {
        let dtype = self.dtype();
        if !T::matches(dtype) {
            return Err(TensorError::ViewType {
                dtype,
                requested: std::any::type_name::<T>(),
            });
        }
        storage::element_slice_mut(self.storage.bytes_mut()).ok_or(TensorError::ViewType {
            dtype,
            requested: std::any::type_name::<T>(),
        })
    }
}

/// Ordered name → tensor map (insertion order is the state dict's order).
#[derive(Debug, Default)]
pub struct StateDict {
    tensors: IndexMap<String, Tensor>,
}

impl StateDict {
    pub fn new() -> StateDict {
        StateDict::default()
    }

    /// Insert (or replace, keeping the original position) a tensor; returns the previous one.
    pub fn insert(&mut self, name: impl Into<String>, tensor: Tensor) -> Option<Tensor> {
        self.tensors.insert(name.into(), tensor)
    }

    pub fn get(&self, name: &str) -> Option<&Tensor> {
        self.tensors.get(name)
    }

    pub fn get_mut(&mut self, name: &str) -> Option<&mut Tensor> {
        self.tensors.get_mut(name)
    }

    pub(crate) fn get_index(&self, index: usize) -> Option<(&str, &Tensor)> {
        self.tensors.get_index(index).map(|(k, v)| (k.as_str(), v))
    }

    pub(crate) fn get_index_mut(&mut self, index: usize) -> Option<(&str, &mut Tensor)> {
        self.tensors
            .get_index_mut(index)
            .map(|(k, v)| (k.as_str(), v))
    }

    pub(crate) fn index_of(&self, name: &str) -> Option<usize> {
        self.tensors.get_index_of(name)
    }

    pub fn iter(&self) -> impl Iterator<Item = (&str, &Tensor)> {
        self.tensors.iter().map(|(k, v)| (k.as_str(), v))
    }

    pub fn iter_mut(&mut self) -> impl Iterator<Item = (&str, &mut Tensor)> {
        self.tensors.iter_mut().map(|(k, v)| (k.as_str(), v))
    }

    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    /// Trainable parameters and persistent buffers, in order.
    pub fn synced_keys(&self) -> Vec<String> {
        self.tensors
            .iter()
            .filter(|(_, t)| t.class.is_synced())
            .map(|(k, _)| k.clone())
            .collect()
    }

    /// Total bytes of all tensors.
    pub fn total_bytes(&self) -> usize {
        self.tensors.values().map(|t| t.storage.len()).sum()
    }

    /// An explicit deep copy of every tensor.
    pub fn duplicate(&self) -> StateDict {
        StateDict {
            tensors: self
                .tensors
                .iter()
                .map(|(k, t)| (k.clone(), t.duplicate()))
                .collect(),
        }
    }

    /// Save to a safetensors file with further string metadata entries; classes and the key order are kept in
    /// the file's metadata. (Checkpoints of workloads without libtorch: synthetic, Python workers.) The file is
    /// replaced whole or not at all ([`crate::atomic_file`]), readable as `File::create` makes it.
    pub fn save_safetensors_with(
        &self,
        path: &std::path::Path,
        metadata: &[(String, String)],
    ) -> Result<(), TensorError> {
        safetensors_io::save(self, path, metadata)
    }

    /// Check that `other` holds exactly this state's tensors: the same names (in any order), dtypes and shapes.
    /// The error is the first difference, in this state's key order.
    pub fn check_layout_of(&self, other: &StateDict) -> Result<(), LayoutMismatch> {
        if other.len() != self.len() {
            return Err(LayoutMismatch::Count {
                found: other.len(),
                expected: self.len(),
            });
        }
        for (name, own) in self.iter() {
            let found = other.get(name).ok_or_else(|| LayoutMismatch::Missing {
                name: name.to_owned(),
            })?;
            if found.layout() != own.layout() {
                return Err(LayoutMismatch::Layout {
                    name: name.to_owned(),
                    found_dtype: found.dtype(),
                    found_shape: found.shape().to_vec(),
                    dtype: own.dtype(),
                    shape: own.shape().to_vec(),
                });
            }
        }
        Ok(())
    }

    /// Copy every tensor's values from `from`, in place (a borrowed state's memory gets them). `from` must hold
    /// exactly this state's tensors ([`StateDict::check_layout_of`]); otherwise nothing is copied.
    pub fn copy_values_from(&mut self, from: &StateDict) -> Result<(), LayoutMismatch> {
        self.check_layout_of(from)?;
        for (name, own) in self.iter_mut() {
            if let Some(t) = from.get(name) {
                own.bytes_mut().copy_from_slice(t.bytes());
            }
        }
        Ok(())
    }

    /// Read the safetensors file at `path` as a state of this state's layout: an error
    /// ([`TensorError::Mismatch`]) unless it holds exactly this state's tensors. Nothing is installed (see
    /// [`StateDict::copy_values_from`]), so a caller can check the file's contents first; also returns the
    /// file's string metadata.
    pub fn read_safetensors_like(
        &self,
        path: &std::path::Path,
    ) -> Result<(StateDict, std::collections::HashMap<String, String>), TensorError> {
        let (loaded, meta) = safetensors_io::load_with_metadata(path)?;
        self.check_layout_of(&loaded)
            .map_err(|source| TensorError::Mismatch {
                path: path.to_owned(),
                source: Box::new(source),
            })?;
        Ok((loaded, meta))
    }

    /// Load the safetensors file at `path` into this state, in place, when it holds exactly this state's
    /// tensors (names, dtypes, shapes; else nothing changes); returns the file's string metadata.
    pub fn load_safetensors_into(
        &mut self,
        path: &std::path::Path,
    ) -> Result<std::collections::HashMap<String, String>, TensorError> {
        let (loaded, meta) = self.read_safetensors_like(path)?;
        self.copy_values_from(&loaded)
            .map_err(|source| TensorError::Mismatch {
                path: path.to_owned(),
                source: Box::new(source),
            })?;
        Ok(meta)
    }

    /// Load a safetensors file (classes default to trainable when the file has no rlsync metadata).
    pub fn load_safetensors(path: &std::path::Path) -> Result<StateDict, TensorError> {
        safetensors_io::load(path)
    }

    /// [`StateDict::load_safetensors`], with the file's string metadata entries.
    pub fn load_safetensors_with_metadata(
        path: &std::path::Path,
    ) -> Result<(StateDict, std::collections::HashMap<String, String>), TensorError> {
        safetensors_io::load_with_metadata(path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    #[test]
    fn typed_views_check_dtype() {
        let mut t = Tensor::from_slice(DType::F32, &[2], Class::Trainable, &[1.0f32, 2.0]).unwrap();
        assert_eq!(t.as_slice::<f32>().unwrap(), &[1.0, 2.0]);
        assert!(matches!(
            t.as_slice::<bf16>(),
            Err(TensorError::ViewType { .. })
        ));
        t.as_mut_slice::<f32>().unwrap()[1] = 5.0;
        assert_eq!(t.as_slice::<f32>().unwrap()[1], 5.0);
        let b = Tensor::from_slice(DType::Bool, &[3], Class::Buffer, &[1u8, 0, 1]).unwrap();
        assert_eq!(b.as_slice::<u8>().unwrap(), &[1, 0, 1]);
    }

    #[test]
    fn from_bytes_rejects_wrong_length() {
        let err = Tensor::from_bytes(DType::I16, &[3], Class::Trainable, &[0u8; 5]).unwrap_err();
        assert!(
            matches!(
                err,
                TensorError::ByteLength {
                    expected: 6,
                    got: 5,
                    ..
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn synced_keys_skip_frozen_in_order() {
        let mut sd = StateDict::new();
        sd.insert("a", Tensor::zeros(DType::F32, &[2], Class::Frozen).unwrap());
        sd.insert(
            "b",
            Tensor::zeros(DType::F32, &[2], Class::Trainable).unwrap(),
        );
        sd.insert("c", Tensor::zeros(DType::I64, &[], Class::Buffer).unwrap());
        assert_eq!(sd.synced_keys(), vec!["b".to_string(), "c".to_string()]);
        assert_eq!(sd.total_bytes(), 8 + 8 + 8);
    }

    #[test]
    fn replace_storage_checks_length() {
        let mut t = Tensor::zeros(DType::F32, &[2], Class::Trainable).unwrap();
        assert!(t.replace_storage(Storage::zeroed(4)).is_err());
        let old = t.replace_storage(Storage::from_bytes(&[1u8; 8])).unwrap();
        assert_eq!(old.bytes(), &[0u8; 8]);
        assert_eq!(t.bytes(), &[1u8; 8]);
    }
}
