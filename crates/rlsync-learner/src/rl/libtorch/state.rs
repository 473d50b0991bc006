//! Bridges between libtorch weights and `tensor::StateDict`: one copy each way, written straight into (or
//! read straight from) the state dict's CPU bytes through `from_blob` views, converting dtypes on the way
//! (fp32 master weights to a bf16 rollout copy and back), or no copy at all: a policy's weights pointed at a
//! state dict's bytes (`point_at`, then `release`). Names, shapes and classes come from the policy.

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

/// Copies every weight of the policy from `state` (converting dtypes); `state` may hold more entries. Returns
/// the bytes read out of `state`.
pub(crate) fn import_from(policy: &Policy, state: &StateDict) -> Result<u64, RlError> {
    let weights = policy.named_tensors()?;
    // check everything first: a rejected state dict leaves the weights untouched.
    check_all(&weights, state)?;
    let mut copied = 0u64;
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
        copied += bytes.len() as u64;
    }
    Ok(copied)
}

/// Why a policy cannot act on a state dict's tensors in place: the first weight whose entry is missing or
/// differs in dtype or shape (it would need a conversion, which is a copy).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum NoViews {
    #[error("the state dict has no `{name}`")]
    Missing { name: String },
    #[error(
        "`{name}` is {state:?} in the state dict, {policy:?} in the policy (a view cannot convert)"
    )]
    Dtype {
        name: String,
        state: DType,
        policy: Kind,
    },
    #[error("`{name}` has shape {state:?} in the state dict, {policy:?} in the policy")]
    Shape {
        name: String,
        state: Vec<usize>,
        policy: Vec<i64>,
    },
}

/// The policy's weights as acting needs them (names sorted, kinds, shapes), kept apart from the tensors: a
/// policy whose weights were [`release`]d still knows what [`point_at`] must find.
pub(crate) struct Layout(Vec<(String, Kind, Vec<i64>)>);

impl Layout {
    pub(crate) fn of(policy: &Policy) -> Result<Layout, RlError> {
        Ok(Layout(
            policy
                .named_tensors()?
                .into_iter()
                .map(|(name, t)| {
                    let (kind, shape) = (t.kind(), t.size());
                    (name, kind, shape)
                })
                .collect(),
        ))
    }

    /// Whether every weight has an entry of its own dtype and shape in `state` (`state` may hold more
    /// entries): then the policy can act on `state`'s bytes in place ([`point_at`]).
    pub(crate) fn viewable(&self, state: &StateDict) -> Result<(), NoViews> {
        for (name, kind, shape) in &self.0 {
            let Some(entry) = state.get(name) else {
                return Err(NoViews::Missing { name: name.clone() });
            };
            if kind_of(entry.dtype()) != *kind {
                return Err(NoViews::Dtype {
                    name: name.clone(),
                    state: entry.dtype(),
                    policy: *kind,
                });
            }
            if *shape != shape_i64(entry.shape()) {
                return Err(NoViews::Shape {
                    name: name.clone(),
                    state: entry.shape().to_vec(),
                    policy: shape.clone(),
                });
            }
        }
        Ok(())
    }
}

/// Points every weight of the policy at its entry of `state` (`set_data` with a `from_blob` view: the
/// policy's tensors, and every handle its layers keep of them, then share `state`'s bytes; nothing is copied,
/// and the storage the weights had before is released). Checked first against the policy's `layout`: a
/// refused state dict leaves the weights as they were.
///
/// # Safety
/// Until [`release`] (or another `point_at`) re-points them, the policy's weights read `state`'s bytes: the
/// caller must not use the policy after those bytes are gone or while anyone writes them, and must never
/// write through the policy (no training step, no in-place update: `state` may be a read-only mapping).
pub(crate) unsafe fn point_at(
    policy: &Policy,
    layout: &Layout,
    state: &StateDict,
) -> Result<(), RlError> {
    let weights = policy.named_tensors()?;
    let same_names = weights.len() == layout.0.len()
        && weights
            .iter()
            .zip(&layout.0)
            .all(|((a, _), (b, _, _))| a == b);
    if !same_names {
        return Err(RlError::WeightsMismatch {
            reason: "the policy's weights are not the ones its layout names".into(),
        });
    }
    layout.viewable(state).map_err(RlError::NoViews)?;
    for (name, mut dst) in weights {
        let Some(src) = state.get(&name) else {
            continue;
        };
        let shape = shape_i64(src.shape());
        let kind = kind_of(src.dtype());
        let view = if src.numel() == 0 {
            Tensor::f_empty(&shape, (kind, Device::Cpu)).map_err(torch_err("an empty weight"))?
        } else {
            let bytes = src.bytes();
            // SAFETY: `bytes` is the contiguous, initialised storage of a tensor of exactly this dtype and
            // shape (checked above). The view does not own it; how long it may be read, and that it is never
            // written through, is this function's contract with its caller.
            unsafe { Tensor::f_from_blob(bytes.as_ptr(), &shape, &[], kind, Device::Cpu) }
                .map_err(torch_err("viewing state dict bytes"))?
        };
        dst.f_set_data(&view)
            .map_err(torch_err("pointing a weight at the state dict"))?;
    }
    Ok(())
}

/// Points every weight of the policy at an empty tensor of its kind: the policy holds no bytes (its views of
/// a state dict are gone) and cannot act until [`point_at`] gives it weights again.
pub(crate) fn release(policy: &Policy) -> Result<(), RlError> {
    for (_, mut t) in policy.named_tensors()? {
        let empty =
            Tensor::f_empty([0], (t.kind(), Device::Cpu)).map_err(torch_err("an empty weight"))?;
        t.f_set_data(&empty)
            .map_err(torch_err("releasing a weight's view"))?;
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
