//! Adam with per-parameter learning rates, global gradient-norm clipping, and state that checkpoints can
//! save and restore (moment tensors by parameter name plus the step count).

use tch::{Kind, Tensor};

use crate::rl::RlError;
use rlsync::config::schema::OptimConfig;

pub(crate) struct Adam {
    params: Vec<Param>,
    t: i64,
    beta1: f64,
    beta2: f64,
    eps: f64,
    weight_decay: f64,
}

struct Param {
    name: String,
    tensor: Tensor,
    lr: f64,
    m: Tensor,
    v: Tensor,
}

impl Adam {
    /// `params` are `(name, tensor)`; names starting with one of `value_prefixes` use `optim.value_lr`.
    pub fn new(
        params: Vec<(String, Tensor)>,
        optim: &OptimConfig,
        value_prefixes: &[&str],
    ) -> Adam {
        let params = params
            .into_iter()
            .map(|(name, tensor)| {
                let lr = if value_prefixes.iter().any(|p| name.starts_with(p)) {
                    optim.value_lr
                } else {
                    optim.lr
                };
                Param {
                    m: tensor.zeros_like().detach(),
                    v: tensor.zeros_like().detach(),
                    name,
                    tensor,
                    lr,
                }
            })
            .collect();
        Adam {
            params,
            t: 0,
            beta1: optim.adam_beta1,
            beta2: optim.adam_beta2,
            eps: optim.adam_eps,
            weight_decay: optim.weight_decay,
        }
    }

    pub fn zero_grad(&mut self) {
        for p in &mut self.params {
            p.tensor.zero_grad();
        }
    }

    /// Global L2 norm of the gradients.
    pub fn grad_norm(&self) -> f64 {
        let sq: f64 = self
            .params
            .iter()
            .map(|p| p.tensor.grad())
            .filter(|g| g.defined())
            .map(|g| g.square().sum(Kind::Double).double_value(&[]))
            .sum();
        sq.sqrt()
    }

    /// Scales gradients so their global norm is at most `max_norm` (`<= 0`: off); returns the norm before.
    pub fn clip_grad_norm(&mut self, max_norm: f64) -> f64 {
        let norm = self.grad_norm();
        if max_norm > 0.0 && norm > max_norm && norm.is_finite() {
            let scale = max_norm / (norm + 1e-6);
            tch::no_grad(|| {
                for p in &self.params {
                    let mut g = p.tensor.grad();
                    if g.defined() {
                        let _ = g.g_mul_scalar_(scale);
                    }
                }
            });
        }
        norm
    }

    pub fn step(&mut self) {
        self.t += 1;
        let (b1, b2) = (self.beta1, self.beta2);
        let bc1 = 1.0 - b1.powi(self.t as i32);
        let bc2 = 1.0 - b2.powi(self.t as i32);
        tch::no_grad(|| {
            for p in &mut self.params {
                let g = p.tensor.grad();
                if !g.defined() {
                    continue;
                }
                let g = if self.weight_decay > 0.0 {
                    &g + &p.tensor * self.weight_decay
                } else {
                    g
                };
                p.m.copy_(&(&p.m * b1 + &g * (1.0 - b1)));
                p.v.copy_(&(&p.v * b2 + g.square() * (1.0 - b2)));
                let update = (&p.m / bc1) / ((&p.v / bc2).sqrt() + self.eps) * p.lr;
                let next = &p.tensor - update;
                p.tensor.copy_(&next);
            }
        });
    }

    pub fn steps(&self) -> i64 {
        self.t
    }

    /// Moment tensors named `m.<param>` and `v.<param>`.
    pub fn state(&self) -> Vec<(String, Tensor)> {
        self.params
            .iter()
            .flat_map(|p| {
                [
                    (format!("m.{}", p.name), p.m.shallow_clone()),
                    (format!("v.{}", p.name), p.v.shallow_clone()),
                ]
            })
            .collect()
    }

    /// Restores moments and the step count saved by [`Adam::state`]; every parameter must be present.
    pub fn load_state(&mut self, state: &[(String, Tensor)], steps: i64) -> Result<(), RlError> {
        for p in &mut self.params {
            for (prefix, dst) in [("m", &mut p.m), ("v", &mut p.v)] {
                let key = format!("{prefix}.{}", p.name);
                let Some((_, src)) = state.iter().find(|(n, _)| *n == key) else {
                    return Err(RlError::WeightsMismatch {
                        reason: format!("optimizer state lacks `{key}`"),
                    });
                };
                if src.size() != dst.size() {
                    return Err(RlError::WeightsMismatch {
                        reason: format!(
                            "optimizer `{key}` has shape {:?}, expected {:?}",
                            src.size(),
                            dst.size()
                        ),
                    });
                }
                tch::no_grad(|| dst.copy_(src));
            }
        }
        self.t = steps;
        Ok(())
    }
}
