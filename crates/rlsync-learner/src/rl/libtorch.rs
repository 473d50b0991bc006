//! The libtorch learner backend: the trainer's [`Learner`] (fp32 master weights, Adam, PPO/GRPO,
//! checkpoints) and the rollouts' [`Actor`] (a copy of the policy, optionally in bf16, or views of a shared
//! state dict for the length of a call).

mod adam;
mod checkpoint;
mod dist;
mod policy;
mod ppo;
mod state;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::path::Path;

use rand::SeedableRng;
use rand::rngs::StdRng;
use tch::{Kind, Tensor};

use crate::env::EnvSpec;
use rlsync::config::schema::{RunConfig, WeightDtype};

use super::{ActMode, Decision, RlError, TrainMetrics, Trajectory};
use adam::Adam;
use policy::{Policy, Use};
use rlsync::checkpoint::{
    CHECKSUM_KEY, CheckpointError, CheckpointInfo, FORMAT_VERSION, META_FORMAT, OPTIMIZER_FILE,
    SCRIPT_FILE, WEIGHTS_FILE, checkpoint_dir,
};
use rlsync_core::tensor::Class;
pub use state::NoViews;

/// Turns a libtorch error into [`RlError::Torch`] with what was being done.
fn torch_err(context: &'static str) -> impl Fn(tch::TchError) -> RlError {
    move |e| RlError::Torch {
        context,
        message: e.to_string(),
    }
}

/// One intra-op thread per worker process. The learner's models are small, and a trainer and N rollouts share
/// the machine's cores: libtorch's default (a thread per core in every process) oversubscribes them as soon as
/// the processes compute at the same time (train_async on 2 cores: 0.36 s per train step instead of 0.05 s).
fn one_thread_per_process() {
    tch::set_num_threads(1);
}

/// The trainer's model (fp32 master weights), optimizer and algorithm.
pub struct Learner {
    policy: Policy,
    adam: Adam,
    cfg: RunConfig,
    global_step: u64,
    /// Weight versions continue across a resume (the run's sync versions start at the checkpoint's), so a
    /// trajectory tagged with version `v` was acted by the learner's weights of version `v`.
    version: u64,
}

impl Learner {
    /// Builds the model `cfg.actor.model` describes for a task of shape `spec`, seeded by `cfg.actor.seed`.
    pub fn new(cfg: &RunConfig, spec: EnvSpec) -> Result<Learner, RlError> {
        one_thread_per_process();
        let policy = Policy::new(&cfg.actor.model, spec, cfg.actor.seed, Use::Train)?;
        let adam = Adam::new(
            policy.trainable()?,
            &cfg.actor.optim,
            &["critic.", "value_head."],
        );
        Ok(Learner {
            policy,
            adam,
            cfg: cfg.clone(),
            global_step: 0,
            version: 0,
        })
    }

    /// Trainer steps completed.
    pub fn global_step(&self) -> u64 {
        self.global_step
    }

    /// Version of the current weights (bumped by every training step).
    pub fn version(&self) -> u64 {
        self.version
    }

    /// Every named weight and its class (trainable | buffer | frozen), sorted by name.
    pub fn param_classes(&self) -> Vec<(String, Class)> {
        self.policy.classes().to_vec()
    }

    /// One PPO/GRPO update on `traj`; bumps the step and the weight version.
    pub fn train_step(&mut self, traj: &Trajectory) -> Result<TrainMetrics, RlError> {
        let seed = self
            .cfg
            .actor
            .seed
            .wrapping_add(self.global_step.wrapping_mul(0x9E37_79B9));
        let m = ppo::train_step(
            &mut self.policy,
            &mut self.adam,
            traj,
            &self.cfg,
            self.version,
            seed,
        )?;
        self.global_step += 1;
        self.version += 1;
        Ok(m)
    }

    /// xxh3 checksum of the fp32 master weights (every entry, names sorted): what a checkpoint records and a
    /// resume verifies.
    pub fn weights_checksum(&self) -> Result<u64, RlError> {
        self.weights_checksum_as(FORMAT_VERSION)
    }

    /// [`Learner::weights_checksum`] as a checkpoint of `format_version` records it (1: before checksums were
    /// chunked).
    fn weights_checksum_as(&self, format_version: &str) -> Result<u64, RlError> {
        let state = state::state_dict(&self.policy, None)?;
        let mut keys: Vec<String> = state.keys().map(str::to_owned).collect();
        keys.sort();
        Ok(match format_version {
            "1" => rlsync_core::tensor::state_checksum_v1(&state, &keys),
            _ => rlsync_core::tensor::state_checksum(&state, &keys),
        })
    }

    /// A rollout actor holding a copy of the current weights in `cfg.rollout.model.precision`.
    pub fn actor(&self, cfg: &RunConfig, seed: u64) -> Result<Actor, RlError> {
        let mut actor = Actor::new(cfg, self.policy.spec, seed)?;
        actor.load_from(self)?;
        Ok(actor)
    }

    /// The model as a state dict: every weight with its class (names sorted); floating weights cast to
    /// `float` when given (e.g. bf16 for rollouts), fp32 master values otherwise.
    pub fn state_dict(
        &self,
        float: Option<rlsync_core::tensor::DType>,
    ) -> Result<rlsync_core::tensor::StateDict, RlError> {
        state::state_dict(&self.policy, float)
    }

    /// Writes the current weights into `state` in place (one copy, no allocation; each entry keeps its
    /// dtype): what the trainer calls after a step, before `WeightSyncer::sync`.
    pub fn export_into(&self, state: &mut rlsync_core::tensor::StateDict) -> Result<(), RlError> {
        state::export_into(&self.policy, state)
    }

    /// Saves weights, optimizer state, step, version and the weights' checksum to
    /// `<run_dir>/checkpoints/global_step_<n>/`.
    pub fn save_checkpoint(&self, run_dir: &Path) -> Result<CheckpointInfo, RlError> {
        let dir = checkpoint_dir(run_dir, self.global_step);
        std::fs::create_dir_all(&dir).map_err(|source| CheckpointError::Io {
            path: dir.clone(),
            source,
        })?;
        let weights_checksum = self.weights_checksum()?;
        let mut meta = HashMap::from([
            ("format".to_owned(), META_FORMAT.to_owned()),
            ("format_version".to_owned(), FORMAT_VERSION.to_owned()),
            ("global_step".to_owned(), self.global_step.to_string()),
            ("version".to_owned(), self.version.to_string()),
            (CHECKSUM_KEY.to_owned(), format!("{weights_checksum:#018x}")),
        ]);
        for (name, class) in self.policy.classes() {
            meta.insert(format!("role.{name}"), class.name().to_owned());
        }
        checkpoint::save(&dir.join(WEIGHTS_FILE), &self.policy.named_tensors()?, meta)?;
        let opt_meta = HashMap::from([
            ("format".to_owned(), META_FORMAT.to_owned()),
            ("adam_steps".to_owned(), self.adam.steps().to_string()),
        ]);
        checkpoint::save(&dir.join(OPTIMIZER_FILE), &self.adam.state(), opt_meta)?;
        // A TorchScript policy also goes out as a module with the trained weights, for `torch.jit.load`.
        self.policy.save_script(&dir.join(SCRIPT_FILE))?;
        Ok(CheckpointInfo {
            dir,
            global_step: self.global_step,
            version: self.version,
            weights_checksum,
        })
    }

    /// Restores weights, optimizer state, step and version from a checkpoint directory, and checks the loaded
    /// weights against the checksum the checkpoint recorded (when it has one).
    pub fn resume(&mut self, dir: &Path) -> Result<CheckpointInfo, RlError> {
        let wpath = dir.join(WEIGHTS_FILE);
        let (weights, meta) = checkpoint::load(&wpath)?;
        if meta.get("format").map(String::as_str) != Some(META_FORMAT) {
            return Err(CheckpointError::Invalid {
                path: wpath,
                reason: "not an rlsync checkpoint (metadata `format`)".into(),
            }
            .into());
        }
        let global_step = checkpoint::meta_u64(&meta, "global_step", &wpath)?;
        let version = checkpoint::meta_u64(&meta, "version", &wpath)?;
        let opath = dir.join(OPTIMIZER_FILE);
        let (state, ometa) = checkpoint::load(&opath)?;
        let steps = checkpoint::meta_u64(&ometa, "adam_steps", &opath)?;
        install(&self.policy, &weights)?;
        self.adam.load_state(&state, steps as i64)?;
        // A checkpoint written before checksums were chunked (format 1, or no format_version) records the
        // format-1 checksum; the loaded weights are checked against it that way.
        let written_as = meta.get("format_version").map_or("1", String::as_str);
        let weights_checksum = self.weights_checksum_as(written_as)?;
        if let Some(saved) = meta.get(CHECKSUM_KEY) {
            let loaded = format!("{weights_checksum:#018x}");
            if *saved != loaded {
                return Err(CheckpointError::Invalid {
                    path: wpath,
                    reason: format!(
                        "loaded weights have checksum {loaded}, the checkpoint recorded {saved}"
                    ),
                }
                .into());
            }
        }
        self.global_step = global_step;
        self.version = version;
        Ok(CheckpointInfo {
            dir: dir.to_owned(),
            global_step,
            version,
            weights_checksum,
        })
    }
}

/// Copies `weights` (all of the policy's names, same shapes) into `policy`.
fn install(policy: &Policy, weights: &[(String, Tensor)]) -> Result<(), RlError> {
    let mine = policy.named_tensors()?;
    if mine.len() != weights.len() {
        return Err(RlError::WeightsMismatch {
            reason: format!(
                "{} weights given, the model has {}",
                weights.len(),
                mine.len()
            ),
        });
    }
    // check everything first: a rejected checkpoint leaves the weights untouched.
    let mut pairs = Vec::with_capacity(mine.len());
    for (name, dst) in mine {
        let Some((_, src)) = weights.iter().find(|(n, _)| *n == name) else {
            return Err(RlError::WeightsMismatch {
                reason: format!("`{name}` is missing"),
            });
        };
        if src.size() != dst.size() {
            return Err(RlError::WeightsMismatch {
                reason: format!(
                    "`{name}` has shape {:?}, the model {:?}",
                    src.size(),
                    dst.size()
                ),
            });
        }
        pairs.push((dst, src));
    }
    tch::no_grad(|| {
        for (mut dst, src) in pairs {
            dst.f_copy_(src).map_err(torch_err("installing weights"))?;
        }
        Ok(())
    })
}

/// What an actor's weights are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Weights {
    /// Its own tensors (built, imported or loaded).
    Own,
    /// Read-only views of the state dict of the [`Actor::with_views`] call running now.
    Views,
    /// Empty: the views of the last call were released (the policy's own storage went at the first).
    Released,
}

/// A rollout's copy of the policy — or, in the host-shared mode, views of a shared state dict: see
/// [`Actor::with_views`].
pub struct Actor {
    policy: Policy,
    rng: StdRng,
    version: u64,
    /// The policy's names, kinds and shapes (what a state dict must hold to be viewed in place).
    layout: state::Layout,
    /// What the policy's weights are: its own, views (inside [`Actor::with_views`]) or released after it.
    weights: Weights,
    /// Bytes of weights copied into the policy out of state dicts ([`Actor::import_state`]).
    imported_bytes: u64,
}

impl Actor {
    /// A policy for `spec` in `cfg.rollout.model.precision`, sampling with a RNG seeded by `seed`. Its
    /// weights are the initial ones until [`Actor::load_from`] (or a sync) installs the trainer's.
    pub fn new(cfg: &RunConfig, spec: EnvSpec, seed: u64) -> Result<Actor, RlError> {
        one_thread_per_process();
        let mut policy = Policy::new(&cfg.actor.model, spec, cfg.actor.seed, Use::Act)?;
        policy.set_kind(match cfg.rollout.model.precision {
            WeightDtype::Bf16 => Kind::BFloat16,
            WeightDtype::F16 => Kind::Half,
            WeightDtype::F32 => Kind::Float,
        });
        let layout = state::Layout::of(&policy)?;
        Ok(Actor {
            policy,
            rng: StdRng::seed_from_u64(seed),
            version: 0,
            layout,
            weights: Weights::Own,
            imported_bytes: 0,
        })
    }

    /// Version of the weights this actor holds.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// Decides actions for `obs` (`num_envs * obs_dim` values).
    pub fn act(&mut self, obs: &[f32], mode: ActMode) -> Result<Decision, RlError> {
        self.readable()?;
        let d = self.policy.spec.obs_dim;
        if d == 0 || !obs.len().is_multiple_of(d) {
            return Err(RlError::Shape {
                what: "observations".into(),
                expected: format!("a multiple of {d}"),
                got: obs.len().to_string(),
            });
        }
        let x = Tensor::from_slice(obs)
            .f_view([-1, d as i64])
            .map_err(torch_err("shaping observations"))?;
        let heads = tch::no_grad(|| self.policy.forward(&x))?;
        let (actions, logprobs) = dist::act(&heads, mode, &mut self.rng)?;
        Ok(Decision { actions, logprobs })
    }

    /// The actor's weights as a state dict in its own dtypes (the receiver side of a sync starts from it).
    pub fn state_dict(&self) -> Result<rlsync_core::tensor::StateDict, RlError> {
        self.readable()?;
        state::state_dict(&self.policy, None)
    }

    /// Installs weights received by a sync (converting dtypes) and records their version.
    pub fn import_state(
        &mut self,
        state: &rlsync_core::tensor::StateDict,
        version: u64,
    ) -> Result<(), RlError> {
        self.writable()?;
        self.imported_bytes += state::import_from(&self.policy, state)?;
        self.version = version;
        Ok(())
    }

    /// The weights may be read: the actor's own, or views inside [`Actor::with_views`].
    fn readable(&self) -> Result<(), RlError> {
        match self.weights {
            Weights::Own | Weights::Views => Ok(()),
            Weights::Released => Err(RlError::NoWeights),
        }
    }

    /// The weights may be written: only the actor's own (views may be of a read-only mapping).
    fn writable(&self) -> Result<(), RlError> {
        match self.weights {
            Weights::Own => Ok(()),
            Weights::Views => Err(RlError::ReadOnlyViews),
            Weights::Released => Err(RlError::NoWeights),
        }
    }

    /// Bytes of weights [`Actor::import_state`] copied so far (views copy none).
    pub fn imported_bytes(&self) -> u64 {
        self.imported_bytes
    }

    /// Whether `state` can be acted on in place by [`Actor::with_views`]: every weight has an entry of the
    /// policy's own dtype and shape (else acting on it needs a converting copy: [`Actor::import_state`]).
    pub fn viewable(&self, state: &rlsync_core::tensor::StateDict) -> Result<(), NoViews> {
        self.layout.viewable(state)
    }

    /// Runs `f` with the policy's weights pointing at `state`'s tensors (the weights of `version`): views,
    /// nothing copied. The views live exactly as long as this call — `state` stays borrowed throughout, and
    /// before returning (also on an error) every weight is re-pointed at an empty tensor, so the actor keeps
    /// no pointer into `state`, holds no weights of its own, and refuses to act until the next call. `f` only
    /// acts (never trains: an actor has no optimizer). The policy's own storage is released at the first call.
    pub fn with_views<R>(
        &mut self,
        state: &rlsync_core::tensor::StateDict,
        version: u64,
        f: impl FnOnce(&mut Actor) -> Result<R, RlError>,
    ) -> Result<R, RlError> {
        /// Releases the views however the call ends (an error, or a panic unwinding through it).
        struct Unbind<'a>(&'a mut Actor);
        impl Drop for Unbind<'_> {
            fn drop(&mut self) {
                self.0.weights = Weights::Released;
                if let Err(e) = state::release(&self.0.policy) {
                    // Views may stay, but the actor is `Released`: it neither reads nor writes them.
                    tracing::error!("releasing the policy's views: {e}");
                }
            }
        }
        let bound = Unbind(self);
        // From here on the weights are no longer the actor's own (a failed `point_at` may have re-pointed some).
        bound.0.weights = Weights::Released;
        // SAFETY: `state` is borrowed for this whole call, and `Unbind`'s drop runs on every way out of it: it
        // re-points every weight at an empty tensor and marks the actor `Released`, so nothing reads the views
        // after the call. Inside it the actor is `Views`: `act` reads the weights (under `no_grad`), and every
        // method that writes weights (`import_state`, `load_from`) refuses; an actor has no training step.
        unsafe { state::point_at(&bound.0.policy, &bound.0.layout, state) }?;
        bound.0.weights = Weights::Views;
        bound.0.version = version;
        f(bound.0)
    }

    /// Copies the learner's current weights and version (in-process sync, converting to this actor's dtype).
    pub fn load_from(&mut self, learner: &Learner) -> Result<(), RlError> {
        self.writable()?;
        self.policy.copy_from(&learner.policy)?;
        self.version = learner.version;
        Ok(())
    }
}
