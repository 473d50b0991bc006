//! Policies on libtorch: `mlp_policy`, `vla_tiny` and a user's TorchScript module, behind one `Policy` type
//! that knows every named weight's class.

use std::path::Path;

use tch::nn::{Init, VarStore};
use tch::{CModule, Device, IValue, Kind, Tensor};

use crate::env::EnvSpec;
use crate::rl::RlError;
use rlsync::config::schema::{ModelConfig, ModelType};
use rlsync_core::tensor::Class;

use super::torch_err;

const LOG_STD_INIT: f64 = -0.5;

/// What a policy forward returns (all float32).
pub(crate) struct Heads {
    /// `[B, A]`: action means (continuous) or logits (discrete).
    pub head: Tensor,
    /// `[A]` or `[B, A]` (continuous only).
    pub log_std: Option<Tensor>,
    /// `[B]` (absent without a critic).
    pub value: Option<Tensor>,
}

/// The var-store path and leaf for a dotted weight name (tch forbids dots inside one path segment).
fn at<'a, 'n>(root: &tch::nn::Path<'a>, name: &'n str) -> (tch::nn::Path<'a>, &'n str) {
    let (dirs, leaf) = name.rsplit_once('.').unwrap_or(("", name));
    let path = dirs
        .split('.')
        .filter(|d| !d.is_empty())
        .fold(root.clone(), |p, d| p.sub(d));
    (path, leaf)
}

struct Linear {
    w: Tensor,
    b: Tensor,
}

impl Linear {
    fn new(
        p: &tch::nn::Path<'_>,
        name: &str,
        inp: usize,
        out: usize,
        std: f64,
        trainable: bool,
    ) -> Linear {
        let (i, o) = (inp as i64, out as i64);
        let std = std / (inp as f64).sqrt();
        let (p, leaf) = at(p, name);
        let p = p.sub(leaf);
        let w = p.var(
            "weight",
            &[o, i],
            Init::Randn {
                mean: 0.0,
                stdev: std,
            },
        );
        let b = p.var("bias", &[o], Init::Const(0.0));
        let (w, b) = if trainable {
            (w, b)
        } else {
            (w.set_requires_grad(false), b.set_requires_grad(false))
        };
        Linear { w, b }
    }

    fn forward(&self, x: &Tensor) -> Tensor {
        x.linear(&self.w, Some(&self.b))
    }
}

/// A TorchScript policy's running observation statistics: its non-trainable parameters `obs_norm.mean`
/// and `obs_norm.var` (`[obs_dim]`) and `obs_norm.count` (`[]`), if it declares all three.
fn script_obs_norm(params: &[(String, Tensor)], obs: usize) -> Result<Option<ObsNorm>, String> {
    let find = |leaf: &str, shape: &[i64]| -> Result<Option<Tensor>, String> {
        let name = format!("obs_norm.{leaf}");
        let Some((_, t)) = params.iter().find(|(n, _)| *n == name) else {
            return Ok(None);
        };
        if t.size() != shape || t.requires_grad() || t.kind() != Kind::Float {
            return Err(format!(
                "{name} must be a float32 parameter of shape {shape:?} with requires_grad=False"
            ));
        }
        Ok(Some(t.shallow_clone()))
    };
    let dim = obs as i64;
    match (
        find("mean", &[dim])?,
        find("var", &[dim])?,
        find("count", &[])?,
    ) {
        (Some(mean), Some(var), Some(count)) => Ok(Some(ObsNorm { mean, var, count })),
        (None, None, None) => Ok(None),
        _ => Err("declare all of obs_norm.mean, obs_norm.var and obs_norm.count, or none".into()),
    }
}

/// Running observation statistics kept as synced buffers (`obs_norm.*`).
struct ObsNorm {
    mean: Tensor,
    var: Tensor,
    count: Tensor,
}

impl ObsNorm {
    fn new(p: &tch::nn::Path<'_>, dim: usize) -> ObsNorm {
        ObsNorm {
            mean: p.sub("obs_norm").zeros_no_train("mean", &[dim as i64]),
            var: p.sub("obs_norm").ones_no_train("var", &[dim as i64]),
            count: p.sub("obs_norm").zeros_no_train("count", &[]),
        }
    }

    fn apply(&self, x: &Tensor) -> Tensor {
        ((x - &self.mean) / (&self.var + 1e-8).sqrt()).clamp(-10.0, 10.0)
    }

    /// Merges a batch `[B, D]` into the running statistics (parallel Welford).
    fn update(&mut self, x: &Tensor) {
        tch::no_grad(|| {
            let x = x.to_kind(self.mean.kind());
            let n = x.size()[0] as f64;
            if n < 1.0 {
                return;
            }
            let bmean = x.mean_dim(0, false, Kind::Float);
            let bvar = x.var_dim(0, false, false);
            let count = self.count.double_value(&[]);
            let total = count + n;
            let delta = &bmean - &self.mean;
            let mean = &self.mean + &delta * (n / total);
            let m2 = &self.var * count + bvar * n + delta.square() * (count * n / total);
            self.mean.copy_(&mean);
            self.var.copy_(&(m2 / total));
            self.count.copy_(&Tensor::from(total as f32));
        });
    }
}

struct Mlp {
    norm: ObsNorm,
    actor: Vec<Linear>,
    head: Linear,
    log_std: Option<Tensor>,
    critic: Vec<Linear>,
    value: Linear,
}

struct VlaTiny {
    norm: ObsNorm,
    /// Frozen backbone layers with their trainable low-rank adapters `(A [r, in], B [out, r])`.
    layers: Vec<(Linear, Tensor, Tensor)>,
    head: Linear,
    log_std: Option<Tensor>,
    value: Linear,
}

enum Script {
    /// The module in training mode, its parameters registered in the policy's `VarStore` (as tch's
    /// `TrainableCModule` does: `.` in a name becomes `_` there), with each store name's module name.
    Train {
        module: CModule,
        names: std::collections::HashMap<String, String>,
        /// The module's `obs_norm.{mean,var,count}` parameters, kept as running observation statistics.
        norm: Option<ObsNorm>,
    },
    Eval(CModule),
}

enum Net {
    Mlp(Mlp),
    Vla(VlaTiny),
    Script {
        module: Script,
        path: std::path::PathBuf,
    },
}

/// Whether a policy is built for training (grad-tracking TorchScript) or acting only.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Use {
    Train,
    Act,
}

pub(crate) struct Policy {
    pub vs: VarStore,
    net: Net,
    /// Every named weight and its class, sorted by name.
    classes: Vec<(String, Class)>,
    pub spec: EnvSpec,
}

impl Policy {
    /// Builds the policy `model` describes for `spec`, initialised from `seed`, in float32.
    pub fn new(
        model: &ModelConfig,
        spec: EnvSpec,
        seed: u64,
        usage: Use,
    ) -> Result<Policy, RlError> {
        tch::manual_seed(seed as i64);
        let vs = VarStore::new(Device::Cpu);
        let root = vs.root();
        let (obs, act) = (spec.obs_dim, spec.action.head_dim());
        let continuous = matches!(spec.action, crate::env::ActionSpace::Continuous { .. });
        let hidden = model.hidden_dim.get() as usize;
        let depth = model.num_layers.get() as usize;
        let net = match model.model_type {
            ModelType::MlpPolicy => {
                let tower = |prefix: &str| {
                    (0..depth)
                        .map(|i| {
                            let inp = if i == 0 { obs } else { hidden };
                            Linear::new(
                                &root,
                                &format!("{prefix}.layers.{i}"),
                                inp,
                                hidden,
                                2f64.sqrt(),
                                true,
                            )
                        })
                        .collect::<Vec<_>>()
                };
                Net::Mlp(Mlp {
                    norm: ObsNorm::new(&root, obs),
                    actor: tower("actor"),
                    head: Linear::new(&root, "actor.head", hidden, act, 0.01, true),
                    log_std: continuous.then(|| {
                        root.sub("actor")
                            .var("log_std", &[act as i64], Init::Const(LOG_STD_INIT))
                    }),
                    critic: tower("critic"),
                    value: Linear::new(&root, "critic.head", hidden, 1, 1.0, true),
                })
            }
            ModelType::VlaTiny => {
                let rank = model.lora_rank.get() as i64;
                let layers = (0..=depth)
                    .map(|i| {
                        let inp = if i == 0 { obs } else { hidden };
                        let name = if i == 0 {
                            "backbone.embed".to_owned()
                        } else {
                            format!("backbone.layers.{}", i - 1)
                        };
                        let base = Linear::new(&root, &name, inp, hidden, 1.5, false);
                        let adapter = if i == 0 {
                            "adapters.embed".to_owned()
                        } else {
                            format!("adapters.layers.{}", i - 1)
                        };
                        let (ap, _) = at(&root, &format!("{adapter}.x"));
                        let a = ap.var(
                            "lora_a",
                            &[rank, inp as i64],
                            Init::Randn {
                                mean: 0.0,
                                stdev: 1.0 / (inp as f64).sqrt(),
                            },
                        );
                        let b = ap.var("lora_b", &[hidden as i64, rank], Init::Const(0.0));
                        (base, a, b)
                    })
                    .collect();
                Net::Vla(VlaTiny {
                    norm: ObsNorm::new(&root, obs),
                    layers,
                    head: Linear::new(&root, "action_head", hidden, act, 0.01, true),
                    log_std: continuous.then(|| {
                        root.sub("action_head").var(
                            "log_std",
                            &[act as i64],
                            Init::Const(LOG_STD_INIT),
                        )
                    }),
                    value: Linear::new(&root, "value_head", hidden, 1, 1.0, true),
                })
            }
            ModelType::Torchscript => {
                let path = model
                    .torchscript_path
                    .clone()
                    .ok_or(RlError::MissingTorchscriptPath)?;
                let ts_err = |e: tch::TchError| RlError::Torchscript {
                    path: path.clone(),
                    reason: e.to_string(),
                };
                let module = match usage {
                    Use::Train => {
                        let mut module =
                            CModule::load_on_device(&path, root.device()).map_err(ts_err)?;
                        module.set_train();
                        let mut names = std::collections::HashMap::new();
                        let params = module.named_parameters().map_err(ts_err)?;
                        let norm = script_obs_norm(&params, obs).map_err(|reason| {
                            RlError::Torchscript {
                                path: path.clone(),
                                reason,
                            }
                        })?;
                        for (name, tensor) in params {
                            let stored = name.replace('.', "_");
                            if let Some(other) = names.insert(stored.clone(), name.clone()) {
                                return Err(RlError::Torchscript {
                                    path: path.clone(),
                                    reason: format!(
                                        "parameters '{other}' and '{name}' differ only in '.' and '_'"
                                    ),
                                });
                            }
                            let trainable = tensor.requires_grad();
                            let _registered = root.add(&stored, tensor, trainable);
                        }
                        Script::Train {
                            module,
                            names,
                            norm,
                        }
                    }
                    Use::Act => {
                        let mut m = CModule::load(&path).map_err(ts_err)?;
                        m.set_eval();
                        Script::Eval(m)
                    }
                };
                Net::Script { module, path }
            }
            ModelType::Synthetic => {
                return Err(RlError::UnsupportedModel {
                    model: "synthetic".into(),
                });
            }
        };
        let mut policy = Policy {
            vs,
            net,
            classes: Vec::new(),
            spec,
        };
        policy.classes = policy.compute_classes()?;
        Ok(policy)
    }

    fn compute_classes(&self) -> Result<Vec<(String, Class)>, RlError> {
        let mut classes: Vec<(String, Class)> = self
            .named_tensors()?
            .into_iter()
            .map(|(name, t)| {
                let class = if name.starts_with("obs_norm.") {
                    Class::Buffer
                } else if t.requires_grad()
                    || matches!(
                        self.net,
                        Net::Script {
                            module: Script::Eval(_),
                            ..
                        }
                    )
                {
                    Class::Trainable
                } else {
                    Class::Frozen
                };
                (name, class)
            })
            .collect();
        classes.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(classes)
    }

    /// Every named weight with its class, sorted by name.
    pub fn classes(&self) -> &[(String, Class)] {
        &self.classes
    }

    /// Every named weight (shallow handles sharing storage with the model), sorted by name. A TorchScript
    /// module's weights keep the module's own parameter names (`pi.0.weight`).
    pub fn named_tensors(&self) -> Result<Vec<(String, Tensor)>, RlError> {
        let mut v: Vec<(String, Tensor)> = match &self.net {
            Net::Script {
                module: Script::Eval(m),
                ..
            } => m
                .named_parameters()
                .map_err(torch_err("listing torchscript parameters"))?,
            Net::Script {
                module: Script::Train { names, .. },
                ..
            } => self
                .vs
                .variables()
                .into_iter()
                .map(|(n, t)| (names.get(&n).cloned().unwrap_or(n), t))
                .collect(),
            _ => self.vs.variables().into_iter().collect(),
        };
        v.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(v)
    }

    /// Writes a TorchScript policy with its current weights to `path` (`torch.jit.load`-able); `false` for the
    /// built-in policies, which have no module to write.
    pub fn save_script(&self, path: &Path) -> Result<bool, RlError> {
        let module = match &self.net {
            Net::Script {
                module: Script::Train { module, .. } | Script::Eval(module),
                ..
            } => module,
            _ => return Ok(false),
        };
        module
            .save(path)
            .map_err(torch_err("writing the torchscript policy"))?;
        Ok(true)
    }

    /// Trainable weights, sorted by name.
    pub fn trainable(&self) -> Result<Vec<(String, Tensor)>, RlError> {
        let classes = &self.classes;
        Ok(self
            .named_tensors()?
            .into_iter()
            .filter(|(n, t)| {
                t.requires_grad()
                    && classes
                        .iter()
                        .any(|(r, class)| r == n && *class == Class::Trainable)
            })
            .collect())
    }

    /// Casts every floating weight to `kind` (rollouts may act in bf16).
    pub fn set_kind(&mut self, kind: Kind) {
        match &mut self.net {
            Net::Script {
                module: Script::Eval(m),
                ..
            } => m.to(Device::Cpu, kind, false),
            _ => self.vs.set_kind(kind),
        }
    }

    /// Kind the weights are held in.
    pub fn kind(&self) -> Kind {
        match &self.net {
            Net::Script {
                module: Script::Eval(m),
                ..
            } => m
                .named_parameters()
                .ok()
                .and_then(|p| p.first().map(|(_, t)| t.kind()))
                .unwrap_or(Kind::Float),
            _ => self.vs.kind(),
        }
    }

    /// Feeds a float32 batch `[B, obs_dim]` through the policy; outputs come back as float32.
    pub fn forward(&self, obs: &Tensor) -> Result<Heads, RlError> {
        let x = obs.to_kind(self.kind());
        let heads = match &self.net {
            Net::Mlp(m) => {
                let x = m.norm.apply(&x);
                let tower = |layers: &[Linear]| {
                    layers
                        .iter()
                        .fold(x.shallow_clone(), |h, l| l.forward(&h).tanh())
                };
                let h = tower(&m.actor);
                let c = tower(&m.critic);
                Heads {
                    head: m.head.forward(&h),
                    log_std: m.log_std.as_ref().map(|t| t.shallow_clone()),
                    value: Some(m.value.forward(&c).squeeze_dim(-1)),
                }
            }
            Net::Vla(v) => {
                let x = v.norm.apply(&x);
                let h = v.layers.iter().fold(x, |h, (base, a, b)| {
                    (base.forward(&h) + h.matmul(&a.tr()).matmul(&b.tr())).tanh()
                });
                Heads {
                    head: v.head.forward(&h),
                    log_std: v.log_std.as_ref().map(|t| t.shallow_clone()),
                    value: Some(v.value.forward(&h).squeeze_dim(-1)),
                }
            }
            Net::Script { module, path } => {
                let input = [IValue::Tensor(x)];
                let out = match module {
                    Script::Train { module, .. } => module.forward_is(&input),
                    Script::Eval(m) => m.forward_is(&input),
                };
                script_heads(out, path)?
            }
        };
        let b = obs.size().first().copied().unwrap_or(0);
        let continuous = matches!(self.spec.action, crate::env::ActionSpace::Continuous { .. });
        let heads = Heads {
            head: heads.head.to_kind(Kind::Float),
            log_std: heads
                .log_std
                .filter(|_| continuous)
                .map(|t| t.to_kind(Kind::Float)),
            value: heads.value.map(|t| t.to_kind(Kind::Float)),
        };
        check_heads(&heads, b, self.spec.action.head_dim())?;
        Ok(heads)
    }

    /// Updates the observation statistics buffers (a TorchScript policy's when it declares them).
    pub fn update_obs_norm(&mut self, obs: &Tensor) {
        match &mut self.net {
            Net::Mlp(m) => m.norm.update(obs),
            Net::Vla(v) => v.norm.update(obs),
            Net::Script {
                module: Script::Train {
                    norm: Some(norm), ..
                },
                ..
            } => norm.update(obs),
            Net::Script { .. } => {}
        }
    }

    /// Copies every weight of `src` (same architecture) into this policy, converting dtypes.
    pub fn copy_from(&mut self, src: &Policy) -> Result<(), RlError> {
        let theirs = src.named_tensors()?;
        let mine = self.named_tensors()?;
        if theirs.len() != mine.len() {
            return Err(RlError::WeightsMismatch {
                reason: format!("{} weights vs {}", theirs.len(), mine.len()),
            });
        }
        if let Some(((name, dst), (src_name, src))) = mine
            .iter()
            .zip(&theirs)
            .find(|((n, d), (m, s))| n != m || d.size() != s.size())
        {
            return Err(RlError::WeightsMismatch {
                reason: format!("{name} {:?} vs {src_name} {:?}", dst.size(), src.size()),
            });
        }
        tch::no_grad(|| {
            for ((_, mut dst), (_, src)) in mine.into_iter().zip(theirs) {
                dst.f_copy_(&src).map_err(torch_err("copying weights"))?;
            }
            Ok(())
        })
    }
}

fn script_heads(out: Result<IValue, tch::TchError>, path: &Path) -> Result<Heads, RlError> {
    let bad = |reason: String| RlError::Torchscript {
        path: path.to_owned(),
        reason,
    };
    let out = out.map_err(|e| bad(format!("forward failed: {e}")))?;
    let IValue::Tuple(items) = out else {
        return Err(bad(
            "forward must return a tuple (head, log_std, value)".into()
        ));
    };
    let mut tensors = items.into_iter().map(|i| match i {
        IValue::Tensor(t) => Ok(t),
        other => Err(bad(format!("forward returned a non-tensor item {other:?}"))),
    });
    let (Some(head), Some(log_std), Some(value), None) = (
        tensors.next(),
        tensors.next(),
        tensors.next(),
        tensors.next(),
    ) else {
        return Err(bad(
            "forward must return exactly three tensors (head, log_std, value)".into(),
        ));
    };
    let value = value?;
    let value = if value.dim() == 2 {
        value.squeeze_dim(-1)
    } else {
        value
    };
    Ok(Heads {
        head: head?,
        log_std: Some(log_std?),
        value: Some(value),
    })
}

fn check_heads(h: &Heads, batch: i64, act: usize) -> Result<(), RlError> {
    let shape_err = |what: &str, expected: String, got: Vec<i64>| RlError::Shape {
        what: what.into(),
        expected,
        got: format!("{got:?}"),
    };
    if h.head.size() != [batch, act as i64] {
        return Err(shape_err(
            "policy head",
            format!("[{batch}, {act}]"),
            h.head.size(),
        ));
    }
    if let Some(v) = &h.value
        && v.size() != [batch]
    {
        return Err(shape_err("value", format!("[{batch}]"), v.size()));
    }
    if let Some(s) = &h.log_std {
        let ok = s.size() == [act as i64] || s.size() == [batch, act as i64];
        if !ok {
            return Err(shape_err(
                "log_std",
                format!("[{act}] or [{batch}, {act}]"),
                s.size(),
            ));
        }
    }
    Ok(())
}
