//! Bridges between libtorch weights and `tensor::StateDict`: one copy each way, written straight into (or
//! read straight from) the state dict's CPU bytes through `from_blob` views, converting dtypes on the way
//! (fp32 master weights to a bf16 rollout copy and back). Names, shapes and classes come from the policy.

use tch::{Device, Kind, Tensor};

use crate::rl::RlError;
use rlsync_core::tensor::{self, DType, StateDict};

use super::policy::Policy;
use super::torch_err;

pub(crate) fn kind_of(dtype: DType) -> Kind {
    match dtype {
        DType::Bf16 => Kind::BFloat16,
        DType::F16 => Kind::Half,
        DType::F32 => Kind::Float,
        DType::F64 => Kind::Double,
        DType::I8 => Kind::Int8,
        DType::I16 => Kind::Int16,
        DType::I32 => Kind::Int,
        DType::I64 => Kind::Int64,
        DType::U8 => Kind::Uint8,
        DType::Bool => Kind::Bool,
    }
}

pub(crate) fn dtype_of(kind: Kind) -> Option<DType> {
    Some(match kind {
        Kind::BFloat16 => DType::Bf16,
        Kind::Half => DType::F16,
        Kind::Float => DType::F32,
        Kind::Double => DType::F64,
        Kind::Int8 => DType::I8,
        Kind::Int16 => DType::I16,
        Kind::Int => DType::I32,
        Kind::Int64 => DType::I64,
        Kind::Uint8 => DType::U8,
        Kind::Bool => DType::Bool,
        _ => return None,
    })
}

fn shape_i64(shape: &[usize]) -> Vec<i64> {
    shape.iter().map(|&d| d as i64).collect()
}

/// A state dict with the policy's names (sorted), shapes and classes; floating entries in `float` (or in the
/// policy's own dtype), others in theirs. Values are copied in.
pub(crate) fn state_dict(policy: &Policy, float: Option<DType>) -> Result<StateDict, RlError> {
    let mut state = StateDict::new();
    for ((name, t), (_, class)) in policy.named_tensors()?.into_iter().zip(policy.classes()) {
        let own = dtype_of(t.kind()).ok_or_else(|| RlError::WeightsMismatch {
            reason: format!("`{name}` has unsupported kind {:?}", t.kind()),
        })?;
        let dtype = match float {
            Some(f) if own.is_floating() => f,
            _ => own,
        };
        let shape: Vec<usize> = t.size().iter().map(|&d| d.max(0) as usize).collect();
        let tensor =
            tensor::Tensor::zeros(dtype, &shape, *class).map_err(|e| RlError::WeightsMismatch {
                reason: format!("`{name}`: {e}"),
            })?;
        state.insert(name, tensor);
    }
    export_into(policy, &mut state)?;
    Ok(state)
}

/// Writes the policy's current weights into `state` in place (each entry keeps its dtype).
pub(crate) fn export_into(policy: &Policy, state: &mut StateDict) -> Result<(), RlError> {
    let weights = policy.named_tensors()?;
    check_all(&weights, state)?;
    for (name, src) in weights {
        let Some(dst) = state.get_mut(&name) else {
            continue;
        };
        if dst.numel() == 0 {
            continue;
        }
        let shape = shape_i64(dst.shape());
        let kind = kind_of(dst.dtype());
        let bytes = dst.bytes_mut();
        // SAFETY: `bytes` is the contiguous, initialised, exclusively borrowed storage of a tensor of exactly
        // this dtype and shape (checked above); the view is dropped before the borrow ends.
        let mut view =
            unsafe { Tensor::f_from_blob(bytes.as_mut_ptr(), &shape, &[], kind, Device::Cpu) }
                .map_err(torch_err("viewing state dict bytes"))?;
        tch::no_grad(|| view.f_copy_(&src)).map_err(torch_err("exporting weights"))?;
    }
    Ok(())
}

/// Copies every weight of the policy from `state` (converting dtypes); `state` may hold more entries.
pub(crate) fn import_from(policy: &Policy, state: &StateDict) -> Result<(), RlError> {
    let weights = policy.named_tensors()?;
    // check everything first: a rejected state dict leaves the weights untouched.
    check_all(&weights, state)?;
    for (name, mut dst) in weights {
        let Some(src) = state.get(&name) else {
            continue;
        };
        if src.numel() == 0 {
            continue;
        }
        let shape = shape_i64(src.shape());
        let bytes = src.bytes();
        // SAFETY: `bytes` is the contiguous, initialised storage of a tensor of this dtype and shape (checked
        // above), borrowed for the whole time the view lives; the view is only read.
        let view = unsafe {
            Tensor::f_from_blob(
                bytes.as_ptr(),
                &shape,
                &[],
                kind_of(src.dtype()),
                Device::Cpu,
            )
        }
        .map_err(torch_err("viewing state dict bytes"))?;
        tch::no_grad(|| dst.f_copy_(&view)).map_err(torch_err("importing weights"))?;
    }
    Ok(())
}

/// Every model weight has an entry of the same shape in `state`.
fn check_all(weights: &[(String, Tensor)], state: &StateDict) -> Result<(), RlError> {
    for (name, t) in weights {
        let entry = state.get(name).ok_or_else(|| RlError::WeightsMismatch {
            reason: format!("state dict lacks `{name}`"),
        })?;
        if t.size() != shape_i64(entry.shape()) {
            return Err(RlError::WeightsMismatch {
                reason: format!(
                    "`{name}` has shape {:?} in the state dict, {:?} in the model",
                    entry.shape(),
                    t.size()
                ),
            });
        }
    }
    Ok(())
}
