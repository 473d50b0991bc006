//! Safetensors load/save of a state dict; roles and key order travel in the file's string metadata.
//!
//! Safetensors stores little-endian bytes and rlsync keeps native-endian storage, so this module (like the
//! rest of rlsync) assumes a little-endian host.

use std::collections::HashMap;
use std::path::Path;

use safetensors::tensor::{Dtype as StDtype, SafeTensors, TensorView};

use super::{DType, Role, StateDict, Tensor, TensorError};

const ORDER_KEY: &str = "rlsync.order";
const ROLES_KEY: &str = "rlsync.roles";

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
    let mut views = Vec::with_capacity(state.len());
    for (name, t) in state.iter() {
        let view = TensorView::new(to_st(t.dtype()), t.shape().to_vec(), t.bytes())
            .map_err(|e| err(format!("tensor '{name}': {e:?}")))?;
        views.push((name.to_string(), view));
    }
    let order: Vec<&str> = state.keys().collect();
    let roles: Vec<&str> = state.iter().map(|(_, t)| t.role().name()).collect();
    let mut meta = HashMap::new();
    meta.insert(
        ORDER_KEY.to_string(),
        serde_json::to_string(&order).map_err(|e| err(e.to_string()))?,
    );
    meta.insert(
        ROLES_KEY.to_string(),
        serde_json::to_string(&roles).map_err(|e| err(e.to_string()))?,
    );
    meta.extend(extra.iter().cloned());
    safetensors::tensor::serialize_to_file(views, &Some(meta), path)
        .map_err(|e| err(format!("{e:?}")))
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
    let st = SafeTensors::deserialize(&map).map_err(|e| err(format!("{e:?}")))?;
    let (_, meta) = SafeTensors::read_metadata(&map).map_err(|e| err(format!("{e:?}")))?;
    let meta = meta.metadata().clone().unwrap_or_default();
    let order: Option<Vec<String>> = match meta.get(ORDER_KEY) {
        Some(s) => Some(
            serde_json::from_str(s).map_err(|e| err(format!("bad {ORDER_KEY} metadata: {e}")))?,
        ),
        None => None,
    };
    let roles: Option<Vec<String>> = match meta.get(ROLES_KEY) {
        Some(s) => Some(
            serde_json::from_str(s).map_err(|e| err(format!("bad {ROLES_KEY} metadata: {e}")))?,
        ),
        None => None,
    };
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
        let view = st
            .tensor(name)
            .map_err(|e| err(format!("tensor '{name}': {e:?}")))?;
        let dtype = from_st(view.dtype()).ok_or_else(|| {
            err(format!(
                "tensor '{name}': unsupported dtype {:?}",
                view.dtype()
            ))
        })?;
        let role = match roles.as_ref().and_then(|r| r.get(i)) {
            Some(r) => Role::from_name(r)
                .ok_or_else(|| err(format!("tensor '{name}': unknown role '{r}'")))?,
            None => Role::Trainable,
        };
        let tensor = Tensor::from_bytes(dtype, view.shape(), role, view.data())?;
        if state.insert(name.clone(), tensor).is_some() {
            return Err(err(format!("{ORDER_KEY} lists '{name}' twice")));
        }
    }
    Ok((state, meta))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip_keeps_order_roles_dtypes_and_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.safetensors");
        let mut s = StateDict::new();
        s.insert(
            "z.weight",
            Tensor::from_slice(
                DType::F32,
                &[2, 2],
                Role::Trainable,
                &[1.0f32, -0.0, f32::NAN, 4.0],
            )
            .unwrap(),
        );
        s.insert(
            "a.count",
            Tensor::from_slice(DType::I64, &[], Role::Buffer, &[7i64]).unwrap(),
        );
        s.insert(
            "m.mask",
            Tensor::from_slice(DType::Bool, &[3], Role::Frozen, &[1u8, 0, 1]).unwrap(),
        );
        s.insert(
            "e.empty",
            Tensor::zeros(DType::Bf16, &[0, 4], Role::Trainable).unwrap(),
        );
        s.save_safetensors_with(&path, &[]).unwrap();
        let l = StateDict::load_safetensors(&path).unwrap();
        assert_eq!(
            l.keys().collect::<Vec<_>>(),
            vec!["z.weight", "a.count", "m.mask", "e.empty"]
        );
        for ((n1, t1), (_, t2)) in s.iter().zip(l.iter()) {
            assert_eq!(t1.layout(), t2.layout(), "{n1}");
            assert_eq!(t1.role(), t2.role(), "{n1}");
            assert_eq!(t1.bytes(), t2.bytes(), "{n1}");
        }
    }

    #[test]
    fn garbage_file_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bad.safetensors");
        std::fs::write(&path, b"not a safetensors file").unwrap();
        assert!(matches!(
            StateDict::load_safetensors(&path),
            Err(TensorError::Safetensors { .. })
        ));
        assert!(matches!(
            StateDict::load_safetensors(&dir.path().join("nope")),
            Err(TensorError::Io { .. })
        ));
    }
}
