//! Action distributions over policy heads: diagonal Gaussian (continuous) and categorical (discrete).
//! Sampling noise comes from the caller's seeded Rust RNG so rollouts are reproducible whatever libtorch's
//! global generator did.

use rand::Rng;
use rand::rngs::StdRng;
use tch::{Kind, Tensor};

use crate::rl::{ActMode, ActionBuf, RlError};

use super::policy::Heads;
use super::torch_err;

const LOG_STD_MIN: f64 = -5.0;
const LOG_STD_MAX: f64 = 2.0;
const HALF_LOG_2PI: f64 = 0.918_938_533_204_672_7;

/// Actions as a tensor: `[B, A]` float32 (continuous) or `[B]` int64 (discrete).
pub(crate) fn actions_tensor(actions: &ActionBuf, batch: i64) -> Result<Tensor, RlError> {
    match actions {
        ActionBuf::Continuous(a) => Tensor::from_slice(a)
            .f_view([batch, -1])
            .map_err(torch_err("shaping actions")),
        ActionBuf::Discrete(a) => Ok(Tensor::from_slice(a)),
    }
}

/// Log-probability `[B]` of `actions` under `heads`.
pub(crate) fn log_prob(heads: &Heads, actions: &Tensor) -> Tensor {
    match &heads.log_std {
        Some(log_std) => {
            let log_std = log_std.clamp(LOG_STD_MIN, LOG_STD_MAX);
            let z = (actions - &heads.head) / log_std.exp();
            (z.square() * -0.5 - &log_std - HALF_LOG_2PI).sum_dim_intlist(-1, false, Kind::Float)
        }
        None => heads
            .head
            .log_softmax(-1, Kind::Float)
            .gather(-1, &actions.unsqueeze(-1), false)
            .squeeze_dim(-1),
    }
}

/// Entropy `[B]` of the distribution.
pub(crate) fn entropy(heads: &Heads) -> Tensor {
    match &heads.log_std {
        Some(log_std) => {
            let per_dim = log_std.clamp(LOG_STD_MIN, LOG_STD_MAX) + (0.5 + HALF_LOG_2PI);
            // a state-independent log_std `[A]` gives one entropy for the whole batch.
            per_dim
                .expand_as(&heads.head)
                .sum_dim_intlist(-1, false, Kind::Float)
        }
        None => {
            let logp = heads.head.log_softmax(-1, Kind::Float);
            -(logp.exp() * logp).sum_dim_intlist(-1, false, Kind::Float)
        }
    }
}

/// Picks actions for a batch (sampled with `rng` or the mode) and returns them with their log-probs.
pub(crate) fn act(
    heads: &Heads,
    mode: ActMode,
    rng: &mut StdRng,
) -> Result<(ActionBuf, Vec<f32>), RlError> {
    let batch = heads.head.size()[0];
    let actions = match &heads.log_std {
        Some(log_std) => {
            let mean = Vec::<f32>::try_from(heads.head.flatten(0, -1))
                .map_err(torch_err("reading means"))?;
            let std = log_std
                .clamp(LOG_STD_MIN, LOG_STD_MAX)
                .exp()
                .expand_as(&heads.head)
                .contiguous();
            let std = Vec::<f32>::try_from(std.flatten(0, -1)).map_err(torch_err("reading std"))?;
            let a = match mode {
                ActMode::Deterministic => mean,
                ActMode::Sample => mean
                    .iter()
                    .zip(&std)
                    .map(|(m, s)| m + s * normal(rng))
                    .collect(),
            };
            ActionBuf::Continuous(a)
        }
        None => {
            let probs = heads.head.softmax(-1, Kind::Float);
            let n = probs.size()[1] as usize;
            let probs = Vec::<f32>::try_from(probs.flatten(0, -1))
                .map_err(torch_err("reading probabilities"))?;
            let a = probs
                .chunks(n.max(1))
                .map(|row| match mode {
                    ActMode::Deterministic => argmax(row),
                    ActMode::Sample => sample_index(row, rng.r#gen::<f32>()),
                })
                .collect();
            ActionBuf::Discrete(a)
        }
    };
    let logp = log_prob(heads, &actions_tensor(&actions, batch)?);
    let logp = Vec::<f32>::try_from(logp).map_err(torch_err("reading log-probs"))?;
    Ok((actions, logp))
}

/// A standard normal draw (Box–Muller).
fn normal(rng: &mut StdRng) -> f32 {
    let u1: f64 = rng.r#gen::<f64>().max(f64::MIN_POSITIVE);
    let u2: f64 = rng.r#gen();
    ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
}

fn argmax(row: &[f32]) -> i64 {
    row.iter()
        .enumerate()
        .fold((0, f32::NEG_INFINITY), |best, (i, &p)| {
            if p > best.1 { (i, p) } else { best }
        })
        .0 as i64
}

fn sample_index(row: &[f32], u: f32) -> i64 {
    let mut acc = 0.0;
    for (i, p) in row.iter().enumerate() {
        acc += p;
        if u < acc {
            return i as i64;
        }
    }
    row.len().saturating_sub(1) as i64
}
