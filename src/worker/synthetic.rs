//! The synthetic workload: a model-shaped state dict, an Adam-like update per train step, fake trajectories.
//!
//! The update is the realistic part: fp32 master weights take an Adam step with noise gradients and are cast
//! to the held dtype, so the share of elements that change per step (what the patch syncer sees) behaves like
//! a real fine-tune. Compute time is emulated by sleeping `train_ms` / `rollout_ms_per_step`, which lets the
//! sync/async trade-off be measured on a machine without a GPU.

use std::path::Path;
use std::time::Duration;

use crate::config::schema::{ModelConfig, WeightDtype};
use crate::worker::workload::{Batch, TrainStats, TrajectoryChunk, Workload, WorkloadError};
use rlsync_core::tensor::{Class, DType, StateDict, Tensor};

/// Name, shape and class of one tensor of the synthetic model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    pub name: String,
    pub shape: Vec<usize>,
    pub class: Class,
}

impl TensorSpec {
    #[cfg(test)]
    fn numel(&self) -> u64 {
        self.shape.iter().map(|d| *d as u64).product()
    }
}

pub(crate) fn dtype_of(precision: WeightDtype) -> DType {
    match precision {
        WeightDtype::Bf16 => DType::Bf16,
        WeightDtype::F16 => DType::F16,
        WeightDtype::F32 => DType::F32,
    }
}

/// A realistic shape for `n` elements: a near-square matrix with a power-of-two inner dim, or a vector.
fn shape_for(n: u64) -> Vec<usize> {
    if n < 256 {
        return vec![n.max(1) as usize];
    }
    let mut cols = 1u64;
    while cols * 2 * cols * 2 <= n && cols < 8192 {
        cols *= 2;
    }
    vec![(n / cols) as usize, cols as usize]
}

/// The tensors of the synthetic model: a frozen backbone (`frozen_fraction` of the parameters), a
/// trainable head, and one persistent buffer (running statistics, synced like trainable weights).
pub fn layout(model: &ModelConfig) -> Result<Vec<TensorSpec>, WorkloadError> {
    let f = model.frozen_fraction;
    if !(0.0..1.0).contains(&f) {
        return Err(WorkloadError::InvalidModel {
            reason: format!("frozen_fraction {f} is not in [0, 1)"),
        });
    }
    let tensors = u64::from(model.tensors.get());
    if model.params < tensors {
        return Err(WorkloadError::InvalidModel {
            reason: format!("params {} is smaller than tensors {tensors}", model.params),
        });
    }
    let frozen_params = (model.params as f64 * f).round() as u64;
    let frozen_tensors = if frozen_params == 0 {
        0
    } else {
        ((tensors as f64 * f).round() as u64).clamp(1, tensors - 1)
    };
    let head_tensors = tensors - frozen_tensors;
    let mut specs = Vec::with_capacity(tensors as usize);
    for i in 0..frozen_tensors {
        let n = frozen_params / frozen_tensors;
        specs.push(TensorSpec {
            name: format!("backbone.layers.{i}.weight"),
            shape: shape_for(n),
            class: Class::Frozen,
        });
    }
    let head_params = model.params - frozen_params;
    // One small buffer (running statistics) when there is room for it next to at least one weight.
    let buffer_len = if head_tensors >= 2 {
        (head_params / head_tensors).min(1024)
    } else {
        0
    };
    let weights = if buffer_len > 0 {
        head_tensors - 1
    } else {
        head_tensors
    };
    for i in 0..weights {
        let n = (head_params - buffer_len) / weights;
        specs.push(TensorSpec {
            name: format!("head.layers.{i}.weight"),
            shape: shape_for(n),
            class: Class::Trainable,
        });
    }
    if buffer_len > 0 {
        specs.push(TensorSpec {
            name: "head.norm.running_mean".into(),
            shape: vec![buffer_len as usize],
            class: Class::Buffer,
        });
    }
    Ok(specs)
}

/// SplitMix64: fast, deterministic, good enough for synthetic values.
#[derive(Debug, Clone)]
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed ^ 0x9E37_79B9_7F4A_7C15)
    }
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [-1, 1).
    fn next_sym(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 23) as f32) - 1.0
    }
}

fn name_seed(seed: u64, name: &str) -> u64 {
    xxhash_rust::xxh3::xxh3_64_with_seed(name.as_bytes(), seed)
}

fn write_elem(dtype: DType, out: &mut [u8], value: f32) {
    match dtype {
        DType::Bf16 => out.copy_from_slice(&half::bf16::from_f32(value).to_le_bytes()),
        DType::F16 => out.copy_from_slice(&half::f16::from_f32(value).to_le_bytes()),
        DType::F32 => out.copy_from_slice(&value.to_le_bytes()),
        // `dtype_of` only yields the floating dtypes above.
        _ => {}
    }
}

fn read_elem(dtype: DType, bytes: &[u8]) -> f32 {
    match (dtype, bytes) {
        (DType::Bf16, [a, b, ..]) => half::bf16::from_le_bytes([*a, *b]).to_f32(),
        (DType::F16, [a, b, ..]) => half::f16::from_le_bytes([*a, *b]).to_f32(),
        (DType::F32, [a, b, c, d, ..]) => f32::from_le_bytes([*a, *b, *c, *d]),
        _ => 0.0,
    }
}

/// fp32 master copy and Adam moments of one updated tensor (trainer only).
struct Master {
    name: String,
    params: Vec<f32>,
    m: Vec<f32>,
    v: Vec<f32>,
    class: Class,
}

pub(crate) struct SyntheticWorkload {
    model: ModelConfig,
    dtype: DType,
    envs: u32,
    seed: u64,
    rng: Rng,
    masters: Vec<Master>,
    step: u64,
}

impl SyntheticWorkload {
    pub fn new(
        model: &ModelConfig,
        envs: u32,
        seed: u64,
        worker_seed: u64,
    ) -> Result<Self, WorkloadError> {
        layout(model)?;
        Ok(SyntheticWorkload {
            model: model.clone(),
            dtype: dtype_of(model.precision),
            envs: envs.max(1),
            seed,
            rng: Rng::new(seed.wrapping_add(worker_seed.wrapping_mul(0x1000_0001))),
            masters: Vec::new(),
            step: 0,
        })
    }

    fn ensure_masters(&mut self, state: &StateDict) -> Result<(), WorkloadError> {
        if !self.masters.is_empty() {
            return Ok(());
        }
        for spec in layout(&self.model)? {
            if spec.class == Class::Frozen {
                continue;
            }
            let tensor = state
                .get(&spec.name)
                .ok_or_else(|| WorkloadError::MissingTensor {
                    name: spec.name.clone(),
                })?;
            let size = self.dtype.size_bytes();
            let params: Vec<f32> = tensor
                .bytes()
                .chunks_exact(size)
                .map(|c| read_elem(self.dtype, c))
                .collect();
            let n = params.len();
            self.masters.push(Master {
                name: spec.name,
                params,
                m: vec![0.0; n],
                v: vec![0.0; n],
                class: spec.class,
            });
        }
        Ok(())
    }
}

fn sleep_ms(ms: f64) {
    if ms > 0.0 && ms.is_finite() {
        std::thread::sleep(Duration::from_secs_f64(ms / 1000.0));
    }
}

impl Workload for SyntheticWorkload {
    fn init_state(&mut self) -> Result<StateDict, WorkloadError> {
        let mut state = StateDict::default();
        let size = self.dtype.size_bytes();
        for spec in layout(&self.model)? {
            let mut tensor = Tensor::zeros(self.dtype, &spec.shape, spec.class)?;
            let mut rng = Rng::new(name_seed(self.seed, &spec.name));
            let scale = if spec.class == Class::Buffer {
                1.0
            } else {
                0.05
            };
            for elem in tensor.bytes_mut().chunks_exact_mut(size) {
                write_elem(self.dtype, elem, rng.next_sym() * scale);
            }
            state.insert(spec.name, tensor);
        }
        Ok(state)
    }

    fn train_step(
        &mut self,
        state: &mut StateDict,
        batch: &Batch<'_>,
    ) -> Result<TrainStats, WorkloadError> {
        self.ensure_masters(state)?;
        self.step += 1;
        let (b1, b2, eps) = (0.9f32, 0.999f32, 1e-8f32);
        let t = self.step as i32;
        let (c1, c2) = (1.0 - b1.powi(t), 1.0 - b2.powi(t));
        let lr = self.model.adam_lr as f32;
        let size = self.dtype.size_bytes();
        // The batch enters the loss so every byte handed over is actually read.
        let data_mean = batch.data.iter().map(|b| u64::from(*b)).sum::<u64>() as f64
            / batch.data.len().max(1) as f64;
        for master in &mut self.masters {
            let tensor =
                state
                    .get_mut(&master.name)
                    .ok_or_else(|| WorkloadError::MissingTensor {
                        name: master.name.clone(),
                    })?;
            let bytes = tensor.bytes_mut();
            for (i, elem) in bytes.chunks_exact_mut(size).enumerate() {
                let (Some(p), Some(m), Some(v)) = (
                    master.params.get_mut(i),
                    master.m.get_mut(i),
                    master.v.get_mut(i),
                ) else {
                    break;
                };
                if master.class == Class::Buffer {
                    // Running statistics drift towards fresh batch statistics.
                    *p = 0.99 * *p + 0.01 * self.rng.next_sym();
                } else {
                    let g = self.rng.next_sym() * 1e-2 + *p * 1e-3;
                    *m = b1 * *m + (1.0 - b1) * g;
                    *v = b2 * *v + (1.0 - b2) * g * g;
                    *p -= lr * (*m / c1) / ((*v / c2).sqrt() + eps);
                }
                write_elem(self.dtype, elem, *p);
            }
        }
        sleep_ms(self.model.train_ms);
        Ok(TrainStats {
            loss: 1.0 / (1.0 + self.step as f64) + data_mean * 1e-6,
            metrics: Vec::new(),
        })
    }

    fn rollout(
        &mut self,
        state: &StateDict,
        _version: u64,
        steps: u32,
    ) -> Result<TrajectoryChunk, WorkloadError> {
        let env_steps = u64::from(steps) * u64::from(self.envs);
        let len = env_steps.saturating_mul(self.model.traj_bytes_per_step) as usize;
        let mut data = vec![0u8; len];
        for word in data.chunks_mut(8) {
            let bytes = self.rng.next_u64().to_le_bytes();
            word.copy_from_slice(&bytes[..word.len()]);
        }
        // A fake return that depends on the weights, so different versions act differently.
        let probe = state
            .iter()
            .find(|(_, t)| t.class() == Class::Trainable)
            .and_then(|(_, t)| {
                t.bytes()
                    .get(..self.dtype.size_bytes())
                    .map(|b| read_elem(self.dtype, b))
            })
            .unwrap_or(0.0);
        sleep_ms(self.model.rollout_ms_per_step * f64::from(steps));
        Ok(TrajectoryChunk {
            env_steps,
            mean_return: f64::from(probe) * 10.0 + f64::from(self.rng.next_sym()),
            data,
        })
    }

    /// The checkpoint's weights (the emulated Adam moments restart) and its step.
    fn restore(&mut self, state: &mut StateDict, dir: &Path) -> Result<(), WorkloadError> {
        let info = crate::checkpoint::load_weights_into(state, dir)?;
        self.step = info.global_step;
        self.masters.clear();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroU32;

    use super::*;

    fn model(params: u64, tensors: u32, frozen: f64) -> ModelConfig {
        ModelConfig {
            params,
            tensors: NonZeroU32::new(tensors).unwrap(),
            frozen_fraction: frozen,
            ..ModelConfig::default()
        }
    }

    fn check_layout(params: u64, tensors: u32, frozen: f64, expect_classes: (usize, usize, usize)) {
        let specs = layout(&model(params, tensors, frozen)).unwrap();
        assert_eq!(specs.len(), tensors as usize);
        let count = |r: Class| specs.iter().filter(|s| s.class == r).count();
        assert_eq!(
            (
                count(Class::Frozen),
                count(Class::Trainable),
                count(Class::Buffer)
            ),
            expect_classes
        );
        let total: u64 = specs.iter().map(TensorSpec::numel).sum();
        assert!(
            total <= params && total as f64 >= params as f64 * 0.9,
            "total {total} for {params}"
        );
        let frozen_total: u64 = specs
            .iter()
            .filter(|s| s.class == Class::Frozen)
            .map(TensorSpec::numel)
            .sum();
        assert!((frozen_total as f64 - params as f64 * frozen).abs() <= params as f64 * 0.05);
    }

    #[test]
    fn layouts_have_requested_classes_and_sizes() {
        check_layout(1 << 20, 16, 0.0, (0, 15, 1));
        check_layout(1 << 20, 16, 0.5, (8, 7, 1));
        check_layout(1 << 20, 10, 0.97, (9, 1, 0));
        check_layout(100, 1, 0.0, (0, 1, 0));
    }

    #[test]
    fn bad_models_are_errors() {
        assert!(layout(&model(10, 16, 0.0)).is_err());
        assert!(layout(&model(1 << 20, 16, 1.0)).is_err());
        assert!(layout(&model(1 << 20, 16, f64::NAN)).is_err());
    }

    #[test]
    fn same_config_gives_same_state_and_updates_change_few_elements() {
        let cfg = ModelConfig {
            adam_lr: 1e-4,
            ..model(1 << 16, 4, 0.25)
        };
        let mut trainer = SyntheticWorkload::new(&cfg, 1, 7, 0).unwrap();
        let mut rollout = SyntheticWorkload::new(&cfg, 1, 7, 1).unwrap();
        let mut a = trainer.init_state().unwrap();
        let b = rollout.init_state().unwrap();
        let keys: Vec<String> = a.keys().map(str::to_owned).collect();
        let sum = rlsync_core::tensor::state_checksum;
        assert_eq!(sum(&a, &keys), sum(&b, &keys));
        let before: Vec<u8> = a.get("head.layers.0.weight").unwrap().bytes().to_vec();
        let frozen_before: Vec<u8> = a.get("backbone.layers.0.weight").unwrap().bytes().to_vec();
        trainer
            .train_step(
                &mut a,
                &Batch {
                    chunks: 1,
                    env_steps: 1,
                    data: &[1, 2, 3],
                },
            )
            .unwrap();
        let after = a.get("head.layers.0.weight").unwrap().bytes();
        let changed = before
            .chunks(2)
            .zip(after.chunks(2))
            .filter(|(x, y)| x != y)
            .count();
        assert!(
            changed > 0 && changed < before.len() / 2,
            "changed {changed} of {}",
            before.len() / 2
        );
        assert_eq!(
            a.get("backbone.layers.0.weight").unwrap().bytes(),
            &frozen_before[..]
        );
    }

    #[test]
    fn rollout_produces_requested_trajectory_size() {
        let cfg = ModelConfig {
            traj_bytes_per_step: 10,
            ..model(4096, 2, 0.0)
        };
        let mut w = SyntheticWorkload::new(&cfg, 3, 1, 0).unwrap();
        let state = w.init_state().unwrap();
        let chunk = w.rollout(&state, 0, 5).unwrap();
        assert_eq!(chunk.env_steps, 15);
        assert_eq!(chunk.data.len(), 150);
    }

    #[test]
    fn a_checkpoint_resumes_the_trained_weights() {
        let tmp = tempfile::tempdir().unwrap();
        let cfg = model(4096, 4, 0.25);
        let mut w = SyntheticWorkload::new(&cfg, 2, 1, 0).unwrap();
        let mut state = w.init_state().unwrap();
        let data = [1u8; 8];
        let batch = Batch {
            chunks: 1,
            env_steps: 8,
            data: &data,
        };
        w.train_step(&mut state, &batch).unwrap();
        let dir = w.save_checkpoint(&state, tmp.path(), 1, 1).unwrap();
        assert!(dir.ends_with("checkpoints/global_step_1"));
        let info = crate::checkpoint::read_info(&dir).unwrap();
        assert_eq!((info.global_step, info.version), (1, 1));
        let mut back = SyntheticWorkload::new(&cfg, 2, 1, 0).unwrap();
        let mut resumed = back.init_state().unwrap();
        back.restore(&mut resumed, &dir).unwrap();
        assert_eq!(back.step, 1);
        let fresh = SyntheticWorkload::new(&cfg, 2, 1, 0)
            .unwrap()
            .init_state()
            .unwrap();
        let bytes = |s: &StateDict| {
            s.iter()
                .map(|(_, t)| t.bytes().to_vec())
                .collect::<Vec<_>>()
        };
        assert_eq!(bytes(&resumed), bytes(&state));
        assert_ne!(
            bytes(&resumed),
            bytes(&fresh),
            "training changed the weights"
        );
        // Another model's checkpoint is refused with a reason.
        let mut other = SyntheticWorkload::new(&model(8192, 4, 0.25), 2, 1, 0).unwrap();
        let mut state = other.init_state().unwrap();
        let err = rlsync_core::error_chain(&other.restore(&mut state, &dir).unwrap_err());
        assert!(err.contains("the model's is"), "{err}");
    }
}
