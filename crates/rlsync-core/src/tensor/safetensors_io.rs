//! Safetensors load/save of a state dict; classes and key order travel in the file's string metadata.
//!
//! Safetensors stores little-endian bytes and rlsync keeps native-endian storage, so this module (like the
//! rest of rlsync) assumes a little-endian host.

use std::collections::HashMap;
use std::path::Path;

pub use safetensors::SafeTensorError;
use safetensors::tensor::{Dtype as StDtype, SafeTensors, TensorView};

use super::{Class, DType, StateDict, Tensor, TensorError};
use crate::atomic_file::{Access, AtomicFile};

const ORDER_KEY: &str = "rlsync.order";
const CLASSES_KEY: &str = "rlsync.roles";

fn to_st(d: DType) -> StDtype {
    match d {
        DType::Bf16 => StDtype::BF16,
        DType::F16 => StDtype::F16,
        DType::F32 => StDtype::F32,
        DType::F64 => StDtype::F64,
        DType::I8 => StDtype::I8,
        DType::I16 => StDtype::I16,
        DType::I32 => StDtype::I32,
        DType::I64 => StDtype::I64,
        DType::U8 => StDtype::U8,
        DType::Bool => StDtype::BOOL,
    }
}

fn from_st(d: StDtype) -> Option<DType> {
    Some(match d {
        StDtype::BF16 => DType::Bf16,
        StDtype::F16 => DType::F16,
        StDtype::F32 => DType::F32,
        StDtype::F64 => DType::F64,
        StDtype::I8 => DType::I8,
        StDtype::I16 => DType::I16,
        StDtype::I32 => DType::I32,
        StDtype::I64 => DType::I64,
        StDtype::U8 => DType::U8,
        StDtype::BOOL => DType::Bool,
        _ => return None,
    })
}

pub(super) fn save(
    state: &StateDict,
    path: &Path,
    extra: &[(String, String)],
) -> Result<(), TensorError> {
    let err = |reason: String| TensorError::Safetensors {
        path: path.to_path_buf(),
        reason,
    };
    let format = |source| TensorError::Format {
        path: path.to_path_buf(),
        source,
    };
    let io = |source| TensorError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut views = Vec::with_capacity(state.len());
    for (name, t) in state.iter() {
        // A tensor's byte length always matches its layout, so only a broken invariant fails here.
        let view = TensorView::new(to_st(t.dtype()), t.shape().to_vec(), t.bytes())
            .map_err(|e| err(format!("tensor '{name}': {e}")))?;
        views.push((name.to_string(), view));
    }
    let order: Vec<&str> = state.keys().collect();
    let classes: Vec<&str> = state.iter().map(|(_, t)| t.class().name()).collect();
    let mut meta = HashMap::new();
    // Lists of strings always serialize.
    meta.insert(
        ORDER_KEY.to_string(),
        serde_json::to_string(&order).unwrap_or_default(),
    );
    meta.insert(
        CLASSES_KEY.to_string(),
        serde_json::to_string(&classes).unwrap_or_default(),
    );
    meta.extend(extra.iter().cloned());
    let file = AtomicFile::create(path, Access::Shared).map_err(io)?;
    safetensors::tensor::serialize_to_file(views, &Some(meta), file.path()).map_err(format)?;
    file.commit().map_err(io)
}

pub(super) fn load(path: &Path) -> Result<StateDict, TensorError> {
    load_with_metadata(path).map(|(state, _)| state)
}

/// [`load`], with the file's string metadata (rlsync's own entries included).
pub(super) fn load_with_metadata(
    path: &Path,
) -> Result<(StateDict, HashMap<String, String>), TensorError> {
    let err = |reason: String| TensorError::Safetensors {
        path: path.to_path_buf(),
        reason,
    };
    let file = std::fs::File::open(path).map_err(|source| TensorError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    // SAFETY: the mapping is read-only and dropped before returning; a concurrent writer could change bytes
    // under us, which at worst yields wrong tensor values, never unsoundness in safe code reading plain bytes.
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|source| TensorError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let format = |source| TensorError::Format {
        path: path.to_path_buf(),
        source,
    };
    let st = SafeTensors::deserialize(&map).map_err(format)?;
    let (_, meta) = SafeTensors::read_metadata(&map).map_err(format)?;
    let meta = meta.metadata().clone().unwrap_or_default();
    let list = |key: &'static str| -> Result<Option<Vec<String>>, TensorError> {
        meta.get(key)
            .map(|s| serde_json::from_str(s))
            .transpose()
            .map_err(|source| TensorError::Metadata {
                path: path.to_path_buf(),
                key,
                source,
            })
    };
    let order = list(ORDER_KEY)?;
    let classes = list(CLASSES_KEY)?;
    let names: Vec<String> = match &order {
        Some(o) if o.len() == st.len() => o.clone(),
        Some(o) => {
            return Err(err(format!(
                "{ORDER_KEY} lists {} keys, the file has {}",
                o.len(),
                st.len()
            )));
        }
        None => {
            let mut n: Vec<String> = st.names().into_iter().cloned().collect();
            n.sort();
            n
        }
    };
    let mut state = StateDict::new();
    for (i, name) in names.iter().enumerate() {
        let view = st.tensor(name).map_err(format)?;
        let dtype = from_st(view.dtype()).ok_or_else(|| {
            err(format!(
                "tensor '{name}': unsupported dtype {:?}",
                view.dtype()
            ))
        })?;
        let class = match classes.as_ref().and_then(|r| r.get(i)) {
            Some(r) => Class::from_name(r)
                .ok_or_else(|| err(format!("tensor '{name}': unknown class '{r}'")))?,
            None => Class::Trainable,
        };
        let tensor = Tensor::from_bytes(dtype, view.shape(), class, view.data())?;
        if state.insert(name.clone(), tensor).is_some() {
            return Err(err(format!("{ORDER_KEY} lists '{name}' twice")));
        }
    }
    Ok((state, meta))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::LayoutMismatch;

    #[test]
    fn roundtrip_keeps_order_classes_dtypes_and_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.safetensors");
        let mut s = StateDict::new();
        s.insert(
            "z.weight",
            Tensor::from_slice(
                DType::F32,
                &[2, 2],
                Class::Trainable,
                &[1.0f32, -0.0, f32::NAN, 4.0],
            )
            .unwrap(),
        );
        s.insert(
            "a.count",
            Tensor::from_slice(DType::I64, &[], Class::Buffer, &[7i64]).unwrap(),
        );
        s.insert(
            "m.mask",
            Tensor::from_slice(DType::Bool, &[3], Class::Frozen, &[1u8, 0, 1]).unwrap(),
        );
        s.insert(
            "e.empty",
            Tensor::zeros(DType::Bf16, &[0, 4], Class::Trainable).unwrap(),
        );
        s.save_safetensors_with(&path, &[]).unwrap();
        let l = StateDict::load_safetensors(&path).unwrap();
        assert_eq!(
            l.keys().collect::<Vec<_>>(),
            vec!["z.weight", "a.count", "m.mask", "e.empty"]
        );
        for ((n1, t1), (_, t2)) in s.iter().zip(l.iter()) {
            assert_eq!(t1.layout(), t2.layout(), "{n1}");
            assert_eq!(t1.class(), t2.class(), "{n1}");
            assert_eq!(t1.bytes(), t2.bytes(), "{n1}");
        }
    }

    fn model(w: &[f32]) -> StateDict {
        let mut s = StateDict::new();
        s.insert(
            "w",
            Tensor::from_slice(DType::F32, &[2], Class::Trainable, w).unwrap(),
        );
        s.insert(
            "n",
            Tensor::from_slice(DType::I64, &[1], Class::Buffer, &[3i64]).unwrap(),
        );
        s
    }

    #[test]
    fn a_file_loads_into_a_model_of_its_layout_and_names_the_first_difference_otherwise() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.safetensors");
        let extra = [("k".to_string(), "v".to_string())];
        model(&[1.0, 2.0])
            .save_safetensors_with(&path, &extra)
            .unwrap();
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            1,
            "no temporary file left"
        );
        let mut m = model(&[0.0, 0.0]);
        let meta = m.load_safetensors_into(&path).unwrap();
        assert_eq!(meta.get("k").map(String::as_str), Some("v"));
        assert_eq!(m.get("w").unwrap().as_slice::<f32>().unwrap(), &[1.0, 2.0]);
        // Key order does not matter; names, count, dtypes and shapes do.
        let mut reordered = StateDict::new();
        for name in ["n", "w"] {
            reordered.insert(name, m.get(name).unwrap().duplicate());
        }
        reordered.load_safetensors_into(&path).unwrap();

        let mismatch = |m: &mut StateDict| match m.load_safetensors_into(&path) {
            Err(TensorError::Mismatch { source, .. }) => *source,
            other => panic!("{other:?}"),
        };
        let mut more = model(&[0.0, 0.0]);
        more.insert("x", Tensor::zeros(DType::F32, &[1], Class::Frozen).unwrap());
        assert_eq!(
            mismatch(&mut more),
            LayoutMismatch::Count {
                found: 2,
                expected: 3
            }
        );
        let mut renamed = StateDict::new();
        renamed.insert(
            "w",
            Tensor::zeros(DType::F32, &[2], Class::Trainable).unwrap(),
        );
        renamed.insert("m", Tensor::zeros(DType::I64, &[1], Class::Buffer).unwrap());
        assert_eq!(
            mismatch(&mut renamed),
            LayoutMismatch::Missing { name: "m".into() }
        );
        let mut reshaped = StateDict::new();
        reshaped.insert(
            "w",
            Tensor::zeros(DType::F32, &[1, 2], Class::Trainable).unwrap(),
        );
        reshaped.insert("n", Tensor::zeros(DType::I32, &[1], Class::Buffer).unwrap());
        let err = mismatch(&mut reshaped);
        assert_eq!(
            err.to_string(),
            "`w` is float32 [2], the model's is float32 [1, 2]"
        );
        assert_eq!(
            reshaped.get("w").unwrap().bytes(),
            &[0; 8],
            "nothing is copied on a mismatch"
        );
        // Read without installing: the caller can look at the values first.
        let (read, _) = m.read_safetensors_like(&path).unwrap();
        assert_eq!(
            read.get("w").unwrap().as_slice::<f32>().unwrap(),
            &[1.0, 2.0]
        );
        let mut other = model(&[5.0, 6.0]);
        assert_eq!(
            other.copy_values_from(&renamed),
            Err(LayoutMismatch::Missing { name: "n".into() })
        );
        other.copy_values_from(&read).unwrap();
        assert_eq!(
            other.get("w").unwrap().as_slice::<f32>().unwrap(),
            &[1.0, 2.0]
        );
    }

    #[test]
    fn bad_rlsync_metadata_is_an_error_with_its_cause() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.safetensors");
        let bad = [(ORDER_KEY.to_string(), "not json".to_string())];
        model(&[1.0, 2.0])
            .save_safetensors_with(&path, &bad)
            .unwrap();
        let err = StateDict::load_safetensors(&path).unwrap_err();
        assert!(
            matches!(&err, TensorError::Metadata { key, .. } if *key == ORDER_KEY),
            "{err:?}"
        );
        assert!(std::error::Error::source(&err).is_some());
    }

    #[test]
    fn garbage_file_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bad.safetensors");
        std::fs::write(&path, b"not a safetensors file").unwrap();
        assert!(matches!(
            StateDict::load_safetensors(&path),
            Err(TensorError::Format { .. })
        ));
        assert!(matches!(
            StateDict::load_safetensors(&dir.path().join("nope")),
            Err(TensorError::Io { .. })
        ));
    }
}
