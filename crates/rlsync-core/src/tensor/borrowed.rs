//! State dicts over caller-owned memory: raw tensor descriptions (address, dtype, shape, strides, device)
//! checked and turned into zero-copy borrowed storages, with tied aliases folded.
//!
//! The Python binding describes each torch tensor of a state dict as a [`RawTensor`]; [`BorrowedState::new`]
//! accepts only what the kernels can read and write in place: CPU, row-major contiguous, aligned to the element
//! size, a supported dtype. Two names over exactly the same bytes with the same dtype and shape (tied
//! parameters) become one tensor under the first name, the others recorded as aliases; any other overlap
//! (views of one storage) is refused, since an install through one view would silently change another.

use super::{Class, DType, Layout, StateDict, Storage, Tensor};

/// One tensor as its owner describes it. `strides` are in elements, as `torch.Tensor.stride()` gives them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawTensor {
    pub name: String,
    /// Address of the first element (`data_ptr()`).
    pub addr: usize,
    /// PyTorch's dtype name without the `torch.` prefix (`float32`, `bfloat16`, `int64`, `bool`, ...).
    pub dtype: String,
    pub shape: Vec<usize>,
    pub strides: Vec<i64>,
    /// Device type (`cpu`, `cuda`, `meta`, ...).
    pub device: String,
}

/// Why a state dict cannot be borrowed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BorrowError {
    #[error(
        "tensor '{key}' is on device '{device}': rlsync reads and writes CPU and CUDA tensors in place (move the model to one of those)"
    )]
    NotCpu { key: String, device: String },
    #[error(
        "tensor '{key}' has dtype {dtype}, which rlsync does not sync (supported: bfloat16, float16, float32, float64, int8, int16, int32, int64, uint8, bool)"
    )]
    UnsupportedDtype { key: String, dtype: String },
    #[error(
        "tensor '{key}' is not contiguous (shape {shape:?}, strides {strides:?}): rlsync installs in place, so it needs the tensor's own row-major memory (a .contiguous() copy would not be updated)"
    )]
    NotContiguous {
        key: String,
        shape: Vec<usize>,
        strides: Vec<i64>,
    },
    #[error("tensor '{key}': {got} strides for {rank} dimensions")]
    StrideRank {
        key: String,
        rank: usize,
        got: usize,
    },
    #[error(
        "tensor '{key}' at address {addr:#x} is not aligned to its element size of {align} bytes"
    )]
    Misaligned {
        key: String,
        addr: usize,
        align: usize,
    },
    #[error("tensor '{key}' has {numel} elements but a null data pointer")]
    NullPointer { key: String, numel: usize },
    #[error("tensor '{key}' of shape {shape:?} overflows the address space")]
    Overflow { key: String, shape: Vec<usize> },
    #[error(
        "tensors '{first}' and '{second}' overlap in memory without being the same tensor (views of one storage): an install through one would change the other; sync the base tensor instead"
    )]
    Overlap { first: String, second: String },
    #[error("key '{key}' appears twice in the state dict")]
    Duplicate { key: String },
    #[error("'{key}' is not a key of the state dict")]
    UnknownKey { key: String },
}

/// A [`StateDict`] whose storages borrow the described memory, plus the folded aliases.
#[derive(Debug)]
pub struct BorrowedState {
    pub state: StateDict,
    /// `(alias, canonical)`: names folded into the first name over the same memory, in state-dict order.
    aliases: Vec<(String, String)>,
}

struct Checked {
    dtype: DType,
    len: usize,
}

fn check(t: &RawTensor) -> Result<Checked, BorrowError> {
    if t.device != "cpu" {
        return Err(BorrowError::NotCpu {
            key: t.name.clone(),
            device: t.device.clone(),
        });
    }
    check_memory(t)
}

/// Dtype and byte length of `t` after every check but the device's (supported dtype, row-major contiguous,
/// aligned, non-null, in the address space): what a device backend needs to mirror a tensor it cannot borrow.
pub fn check_device_memory(t: &RawTensor) -> Result<(DType, usize), BorrowError> {
    check_memory(t).map(|c| (c.dtype, c.len))
}

fn check_memory(t: &RawTensor) -> Result<Checked, BorrowError> {
    let key = || t.name.clone();
    let dtype = DType::from_name(&t.dtype).ok_or_else(|| BorrowError::UnsupportedDtype {
        key: key(),
        dtype: t.dtype.clone(),
    })?;
    if t.strides.len() != t.shape.len() {
        return Err(BorrowError::StrideRank {
            key: key(),
            rank: t.shape.len(),
            got: t.strides.len(),
        });
    }
    let len = Layout::new(dtype, &t.shape)
        .checked_byte_len()
        .ok_or_else(|| BorrowError::Overflow {
            key: key(),
            shape: t.shape.clone(),
        })?;
    if len == 0 {
        return Ok(Checked { dtype, len });
    }
    // Row-major: each stride is the product of the later dims; dims of size 1 may carry any stride.
    let mut expect: u128 = 1;
    for (&d, &s) in t.shape.iter().zip(&t.strides).rev() {
        if d != 1 && i128::from(s) != expect as i128 {
            return Err(BorrowError::NotContiguous {
                key: key(),
                shape: t.shape.clone(),
                strides: t.strides.clone(),
            });
        }
        expect = expect.saturating_mul(d as u128);
    }
    if t.addr == 0 {
        return Err(BorrowError::NullPointer {
            key: key(),
            numel: len / dtype.size_bytes(),
        });
    }
    if !t.addr.is_multiple_of(dtype.size_bytes()) {
        return Err(BorrowError::Misaligned {
            key: key(),
            addr: t.addr,
            align: dtype.size_bytes(),
        });
    }
    if t.addr.checked_add(len).is_none() {
        return Err(BorrowError::Overflow {
            key: key(),
            shape: t.shape.clone(),
        });
    }
    Ok(Checked { dtype, len })
}

impl BorrowedState {
    /// Check every tensor and borrow its memory (see the module docs). All tensors get [`Class::Trainable`]:
    /// which keys are synced is the syncer's `keys_to_sync`.
    ///
    /// # Safety
    /// Every described range `addr..addr + bytes` must stay valid for reads and writes while the returned
    /// state lives, and be accessed only through it while a syncer operation runs on it (see
    /// [`Storage::borrowed`]).
    pub unsafe fn new(tensors: &[RawTensor]) -> Result<BorrowedState, BorrowError> {
        let mut checked = Vec::with_capacity(tensors.len());
        for t in tensors {
            checked.push(check(t)?);
        }
        // Duplicate names first: they would otherwise look like aliases.
        let mut seen = std::collections::HashSet::with_capacity(tensors.len());
        for t in tensors {
            if !seen.insert(t.name.as_str()) {
                return Err(BorrowError::Duplicate {
                    key: t.name.clone(),
                });
            }
        }
        // Overlaps: sort non-empty ranges by (start, end, position); each range is compared with the one
        // reaching furthest so far. Position breaks ties, so an alias folds into the earliest name.
        let mut ranges: Vec<(usize, usize, usize)> = tensors
            .iter()
            .zip(&checked)
            .enumerate()
            .filter(|(_, (_, c))| c.len > 0)
            .map(|(i, (t, c))| (t.addr, t.addr + c.len, i))
            .collect();
        ranges.sort_unstable();
        let mut canonical: Vec<Option<usize>> = vec![None; tensors.len()];
        let mut reach: Option<(usize, usize, usize)> = None;
        for &(start, end, i) in &ranges {
            if let Some((rs, re, ri)) = reach
                && start < re
            {
                let same = start == rs
                    && end == re
                    && checked[i].dtype == checked[ri].dtype
                    && tensors[i].shape == tensors[ri].shape;
                if !same {
                    let (a, b) = if ri < i { (ri, i) } else { (i, ri) };
                    return Err(BorrowError::Overlap {
                        first: tensors[a].name.clone(),
                        second: tensors[b].name.clone(),
                    });
                }
                canonical[i] = Some(canonical[ri].unwrap_or(ri));
                continue;
            }
            if reach.is_none_or(|(_, re, _)| end > re) {
                reach = Some((start, end, i));
            }
        }
        let mut state = StateDict::new();
        let mut aliases = Vec::new();
        for (i, (t, c)) in tensors.iter().zip(&checked).enumerate() {
            if let Some(first) = canonical[i] {
                aliases.push((t.name.clone(), tensors[first].name.clone()));
                continue;
            }
            // SAFETY: the caller's contract above; `check` verified the range is non-null, aligned and fits.
            let storage = unsafe { Storage::borrowed(t.addr as *mut u8, c.len) };
            let tensor =
                Tensor::from_storage(Layout::new(c.dtype, &t.shape), storage, Class::Trainable)
                    .map_err(|_| BorrowError::Overflow {
                        key: t.name.clone(),
                        shape: t.shape.clone(),
                    })?;
            state.insert(t.name.clone(), tensor);
        }
        Ok(BorrowedState { state, aliases })
    }

    /// `(alias, canonical)` pairs of tied tensors, in state-dict order.
    pub fn aliases(&self) -> &[(String, String)] {
        &self.aliases
    }

    /// The name `key` is held under: itself, or the first name of its tied group.
    pub fn canonical<'a>(&'a self, key: &'a str) -> Option<&'a str> {
        if self.state.get(key).is_some() {
            return Some(key);
        }
        self.aliases
            .iter()
            .find(|(a, _)| a == key)
            .map(|(_, c)| c.as_str())
    }

    /// Map `keys` to their canonical names, dropping repeats (a tied group listed under several names is
    /// synced once), in the state dict's order (the order patches and buckets carry tensors in, whatever
    /// order the caller listed them in). An unknown key is an error naming it.
    pub fn fold_keys(&self, keys: &[String]) -> Result<Vec<String>, BorrowError> {
        let mut picked = vec![false; self.state.len()];
        for k in keys {
            let c = self
                .canonical(k)
                .ok_or_else(|| BorrowError::UnknownKey { key: k.clone() })?;
            if let Some(i) = self.state.index_of(c) {
                picked[i] = true;
            }
        }
        Ok(self
            .state
            .keys()
            .zip(picked)
            .filter(|(_, p)| *p)
            .map(|(k, _)| k.to_string())
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(name: &str, addr: usize, dtype: &str, shape: &[usize]) -> RawTensor {
        let mut strides = vec![0i64; shape.len()];
        let mut acc = 1i64;
        for i in (0..shape.len()).rev() {
            strides[i] = acc;
            acc *= shape[i] as i64;
        }
        RawTensor {
            name: name.into(),
            addr,
            dtype: dtype.into(),
            shape: shape.to_vec(),
            strides,
            device: "cpu".into(),
        }
    }

    #[test]
    fn borrows_in_place_and_writes_through() {
        let mut a = vec![1.0f32, 2.0, 3.0, 4.0];
        let mut b = vec![7i64];
        let ts = [
            raw("a", a.as_mut_ptr() as usize, "float32", &[2, 2]),
            raw("b", b.as_mut_ptr() as usize, "int64", &[]),
        ];
        // SAFETY: `a` and `b` outlive `st` and are not touched while it lives.
        let mut st = unsafe { BorrowedState::new(&ts) }.unwrap();
        assert_eq!(
            st.state.get("a").unwrap().as_slice::<f32>().unwrap(),
            &[1.0, 2.0, 3.0, 4.0]
        );
        st.state
            .get_mut("a")
            .unwrap()
            .as_mut_slice::<f32>()
            .unwrap()[3] = 9.0;
        st.state
            .get_mut("b")
            .unwrap()
            .as_mut_slice::<i64>()
            .unwrap()[0] = 8;
        // A storage swap keeps the caller's memory: the old bytes come back in the given storage.
        let old = st
            .state
            .get_mut("a")
            .unwrap()
            .replace_storage(Storage::from_bytes(&[0u8; 16]))
            .unwrap();
        assert_eq!(old.bytes()[12..16], 9.0f32.to_ne_bytes());
        drop(st);
        assert_eq!(a, vec![0.0; 4]);
        assert_eq!(b, vec![8]);
    }

    #[test]
    fn tied_aliases_fold_into_the_first_name() {
        let mut w = vec![0u16; 6];
        let mut x = vec![0u16; 6];
        let p = w.as_mut_ptr() as usize;
        let ts = [
            raw("emb.weight", p, "bfloat16", &[2, 3]),
            raw("x", x.as_mut_ptr() as usize, "bfloat16", &[6]),
            raw("head.weight", p, "bfloat16", &[2, 3]),
        ];
        // SAFETY: the vectors outlive the state.
        let st = unsafe { BorrowedState::new(&ts) }.unwrap();
        assert_eq!(st.state.keys().collect::<Vec<_>>(), vec!["emb.weight", "x"]);
        assert_eq!(
            st.aliases(),
            &[("head.weight".to_string(), "emb.weight".to_string())]
        );
        let keys = ["x", "head.weight", "emb.weight"].map(String::from);
        assert_eq!(st.fold_keys(&keys).unwrap(), vec!["emb.weight", "x"]);
        assert_eq!(
            st.fold_keys(&["nope".to_string()]).unwrap_err(),
            BorrowError::UnknownKey { key: "nope".into() }
        );
    }

    #[test]
    fn bad_tensors_are_refused_with_their_name() {
        let mut m = vec![0f32; 8];
        let p = m.as_mut_ptr() as usize;
        let check = |ts: &[RawTensor], expect: &str| {
            // SAFETY: `m` outlives every state built here.
            let err = unsafe { BorrowedState::new(ts) }.unwrap_err().to_string();
            assert!(err.contains(expect), "{err} lacks {expect}");
        };
        let mut t = raw("w", p, "float32", &[2, 4]);
        t.strides = vec![1, 2];
        check(&[t], "tensor 'w' is not contiguous");
        let mut t = raw("w", p, "float32", &[2]);
        t.device = "cuda".into();
        check(&[t], "tensor 'w' is on device 'cuda'");
        check(&[raw("w", p, "complex64", &[2])], "dtype complex64");
        check(&[raw("w", p + 2, "float32", &[2])], "not aligned");
        check(&[raw("w", 0, "float32", &[2])], "null data pointer");
        // A view of half of another tensor, and the same bytes seen with another shape.
        check(
            &[
                raw("a", p, "float32", &[8]),
                raw("b", p + 8, "float32", &[2]),
            ],
            "tensors 'a' and 'b' overlap",
        );
        check(
            &[
                raw("a", p, "float32", &[8]),
                raw("b", p, "float32", &[2, 4]),
            ],
            "tensors 'a' and 'b' overlap",
        );
        check(
            &[
                raw("a", p, "float32", &[2]),
                raw("a", p + 8, "float32", &[2]),
            ],
            "appears twice",
        );
        // Dims of size 1 may carry any stride; empty tensors need no memory.
        let mut t = raw("w", p, "float32", &[1, 8]);
        t.strides = vec![99, 1];
        // SAFETY: as above.
        assert!(unsafe { BorrowedState::new(&[t, raw("e", 0, "float32", &[0, 3])]) }.is_ok());
    }
}
