//! A synthetic model state dict with realistic updates (benches, tests and the synthetic workload).
//!
//! Shapes follow a transformer-like mix (embedding, qkv/proj/mlp matrices, biases, norms, a 4-D conv, an int
//! step counter buffer). Updates come in two modes:
//! - [`UpdateMode::Adam`]: fp32 master weights take an Adam-like step (momentum of random gradients,
//!   normalised by the gradient RMS) at a learning rate and are cast to the state's dtype, so the changed
//!   fraction comes out of the arithmetic as in real training (≈1 % of bf16 elements at lr 1e-6);
//! - [`UpdateMode::Density`]: a fixed fraction of elements gets random new values at random positions.

use std::num::NonZeroUsize;

use super::cast::cast_f32_to_bf16;
use super::parallel::map_items;
use super::storage::{Pod, pod_slice_mut};
use super::{Class, DType, StateDict, Tensor, TensorError};

/// What to build.
#[derive(Debug, Clone)]
pub struct ModelSpec {
    /// Total number of elements (exact).
    pub params: u64,
    /// Number of tensors (at least 1; exact when ≥ 3).
    pub tensors: u32,
    /// Dtype of floating weights in the produced state dict (bf16 | f16 | f32 | f64).
    pub dtype: DType,
    /// Share of parameters in frozen tensors (taken from the front: embedding, first blocks).
    pub frozen_fraction: f64,
    pub seed: u64,
}

/// How one step changes the weights.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum UpdateMode {
    Adam { lr: f64 },
    Density { density: f64 },
}

#[derive(Debug, thiserror::Error)]
pub enum SyntheticError {
    #[error("synthetic model dtype must be floating, got {dtype}")]
    NotFloating { dtype: DType },
    #[error("{what} must be within [0, 1], got {value}")]
    Fraction { what: &'static str, value: f64 },
    #[error("{params} parameters do not fit in memory on this host")]
    TooLarge { params: u64 },
    #[error(transparent)]
    Tensor(#[from] TensorError),
}

#[derive(Debug, Clone, Copy)]
enum Init {
    Uniform(f32),
    Const(f32),
    Counter,
}

/// One tensor of a synthetic model: name, shape, class and how it is initialised.
#[derive(Debug, Clone)]
struct ParamSpec {
    name: String,
    shape: Vec<usize>,
    class: Class,
    init: Init,
}

impl ParamSpec {
    fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// A synthetic trainer: fp32 master weights + Adam momentum for the trainable floating tensors.
pub struct SyntheticModel {
    spec: ModelSpec,
    entries: Vec<ParamSpec>,
    master: Vec<Vec<f32>>,
    momentum: Vec<Vec<f32>>,
    step: u64,
}

/// Elements per parallel work item (big enough to amortise scheduling, small enough to balance).
const CHUNK: usize = 1 << 20;

/// SplitMix64: a tiny, fast, seedable generator (statistical quality is ample for synthetic weights).
struct Rng(u64);

impl Rng {
    fn new(seed: u64, a: u64, b: u64, c: u64) -> Rng {
        let mut r = Rng(seed
            ^ a.wrapping_mul(0x9E37_79B9_7F4A_7C15)
            ^ b.wrapping_mul(0xC2B2_AE3D_27D4_EB4F)
            ^ c.rotate_left(31));
        r.next();
        r
    }

    #[inline(always)]
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1).
    #[inline(always)]
    fn sym(&mut self) -> f32 {
        ((self.next() >> 40) as f32) * (2.0 / (1u64 << 24) as f32) - 1.0
    }

    /// Uniform in (0, 1].
    fn unit(&mut self) -> f64 {
        ((self.next() >> 11) as f64 + 1.0) / (1u64 << 53) as f64
    }
}

fn shapes(spec: &ModelSpec) -> Vec<ParamSpec> {
    let p = spec.params as usize;
    let t = spec.tensors.max(1) as usize;
    if t < 3 {
        // Too few tensors for a model mix: one matrix-ish tensor (+ a bias).
        let n = if t == 2 { p.saturating_sub(1) } else { p };
        let mut v = vec![ParamSpec {
            name: "weight".into(),
            shape: vec![n],
            class: Class::Trainable,
            init: Init::Uniform(0.05),
        }];
        if t == 2 {
            v.push(ParamSpec {
                name: "step".into(),
                shape: vec![],
                class: Class::Buffer,
                init: Init::Counter,
            });
        }
        return v;
    }
    // Template block, sizes in (h, coefficient-of-h) form: (rows_mult, cols_mult) for matrices.
    #[derive(Clone, Copy)]
    enum K {
        Mat(usize, usize),
        Vec(usize, Init),
        Conv,
    }
    let template: [(&str, K); 8] = [
        ("attn.qkv.weight", K::Mat(3, 1)),
        ("attn.qkv.bias", K::Vec(3, Init::Const(0.0))),
        ("attn.proj.weight", K::Mat(1, 1)),
        ("mlp.fc1.weight", K::Mat(4, 1)),
        ("mlp.fc1.bias", K::Vec(4, Init::Const(0.0))),
        ("mlp.fc2.weight", K::Mat(1, 4)),
        ("norm.weight", K::Vec(1, Init::Const(1.0))),
        ("conv.weight", K::Conv),
    ];
    let body = t - 3; // besides embedding, head.bias and the step counter
    let quad: usize = (0..body)
        .map(|i| match template[i % 8].1 {
            K::Mat(a, b) => a * b,
            K::Conv => 1,
            K::Vec(..) => 0,
        })
        .sum();
    // Give the body ~80 % of the parameters; h is a multiple of 8 when large enough.
    let mut h = if quad == 0 {
        1
    } else {
        (((p as f64 * 0.8) / quad as f64).sqrt() as usize).max(1)
    };
    if h > 64 {
        h -= h % 8;
    }
    let conv_shape = |h: usize| vec![h.max(1), (h / 9).max(1), 3, 3];
    let build = |h: usize| -> Vec<ParamSpec> {
        (0..body)
            .map(|i| {
                let (name, k) = template[i % 8];
                let name = format!("blocks.{}.{name}", i / 8);
                match k {
                    K::Mat(a, b) => ParamSpec {
                        name,
                        shape: vec![a * h, b * h],
                        class: Class::Trainable,
                        init: Init::Uniform(1.0 / ((b * h) as f32).sqrt()),
                    },
                    K::Vec(a, init) => ParamSpec {
                        name,
                        shape: vec![a * h],
                        class: Class::Trainable,
                        init,
                    },
                    K::Conv => ParamSpec {
                        name,
                        shape: conv_shape(h),
                        class: Class::Trainable,
                        init: Init::Uniform(0.05),
                    },
                }
            })
            .collect()
    };
    let mut body_entries = build(h);
    while h > 1 && body_entries.iter().map(ParamSpec::numel).sum::<usize>() > p {
        h /= 2;
        body_entries = build(h);
    }
    let used: usize = body_entries.iter().map(ParamSpec::numel).sum();
    let rest = p.saturating_sub(used).saturating_sub(1); // one element for the step counter
    let vocab = rest / h.max(1);
    let head = rest - vocab * h.max(1);
    let mut v = Vec::with_capacity(t);
    v.push(ParamSpec {
        name: "embed.weight".into(),
        shape: vec![vocab, h.max(1)],
        class: Class::Trainable,
        init: Init::Uniform(0.035),
    });
    v.extend(body_entries);
    v.push(ParamSpec {
        name: "head.bias".into(),
        shape: vec![head],
        class: Class::Trainable,
        init: Init::Const(0.0),
    });
    v.push(ParamSpec {
        name: "step".into(),
        shape: vec![],
        class: Class::Buffer,
        init: Init::Counter,
    });
    v
}

fn mark_frozen(entries: &mut [ParamSpec], fraction: f64, params: u64) {
    let target = (fraction * params as f64) as usize;
    let mut frozen = 0usize;
    for e in entries.iter_mut() {
        if frozen >= target || !matches!(e.class, Class::Trainable) {
            break;
        }
        e.class = Class::Frozen;
        frozen += e.numel();
    }
}

fn init_values(e: &ParamSpec, idx: usize, seed: u64) -> Vec<f32> {
    let n = e.numel();
    match e.init {
        Init::Const(c) => vec![c; n],
        Init::Counter => vec![0.0; n],
        Init::Uniform(a) => {
            let mut v = vec![0f32; n];
            for (c, chunk) in v.chunks_mut(CHUNK).enumerate() {
                let mut rng = Rng::new(seed, idx as u64, c as u64, u64::MAX);
                for x in chunk {
                    *x = rng.sym() * a;
                }
            }
            v
        }
    }
}

fn write_f32s(dst: &mut [u8], dtype: DType, src: &[f32]) {
    match dtype {
        DType::Bf16 => fill(dst, src, cast_f32_to_bf16),
        DType::F16 => fill(dst, src, half::f16::from_f32),
        DType::F32 => fill(dst, src, |x| x),
        _ => fill(dst, src, f64::from),
    }
}

fn fill<D: Pod>(dst: &mut [u8], src: &[f32], f: impl Fn(f32) -> D) {
    if let Some(d) = pod_slice_mut::<D>(dst) {
        for (o, &x) in d.iter_mut().zip(src) {
            *o = f(x);
        }
    }
}

impl SyntheticModel {
    pub fn new(spec: ModelSpec) -> Result<SyntheticModel, SyntheticError> {
        if !spec.dtype.is_floating() {
            return Err(SyntheticError::NotFloating { dtype: spec.dtype });
        }
        if !(0.0..=1.0).contains(&spec.frozen_fraction) {
            return Err(SyntheticError::Fraction {
                what: "frozen_fraction",
                value: spec.frozen_fraction,
            });
        }
        if usize::try_from(spec.params).map_or(true, |p| p.checked_mul(16).is_none()) {
            return Err(SyntheticError::TooLarge {
                params: spec.params,
            });
        }
        let mut entries = shapes(&spec);
        mark_frozen(&mut entries, spec.frozen_fraction, spec.params);
        let master: Vec<Vec<f32>> = entries
            .iter()
            .enumerate()
            .map(|(i, e)| init_values(e, i, spec.seed))
            .collect();
        let momentum = entries
            .iter()
            .map(|e| {
                if matches!(e.class, Class::Trainable) {
                    vec![0f32; e.numel()]
                } else {
                    Vec::new()
                }
            })
            .collect();
        Ok(SyntheticModel {
            spec,
            entries,
            master,
            momentum,
            step: 0,
        })
    }

    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    /// Steps taken so far.
    pub fn steps(&self) -> u64 {
        self.step
    }

    /// The current weights as a state dict (floating weights in the spec's dtype, the counter as i64).
    pub fn state_dict(&self) -> Result<StateDict, SyntheticError> {
        let mut sd = StateDict::new();
        for (e, m) in self.entries.iter().zip(&self.master) {
            let t = match e.init {
                Init::Counter => {
                    Tensor::from_slice(DType::I64, &e.shape, e.class, &[self.step as i64])?
                }
                _ => {
                    let mut t = Tensor::zeros(self.spec.dtype, &e.shape, e.class)?;
                    write_f32s(t.bytes_mut(), self.spec.dtype, m);
                    t
                }
            };
            sd.insert(e.name.clone(), t);
        }
        Ok(sd)
    }

    /// One update step applied to `state` (which must come from [`SyntheticModel::state_dict`]); returns the
    /// number of elements whose bits changed.
    pub fn step(
        &mut self,
        mode: UpdateMode,
        state: &mut StateDict,
        threads: NonZeroUsize,
    ) -> Result<u64, SyntheticError> {
        if let UpdateMode::Density { density } = mode
            && !(0.0..=1.0).contains(&density)
        {
            return Err(SyntheticError::Fraction {
                what: "density",
                value: density,
            });
        }
        self.step += 1;
        let step = self.step;
        let seed = self.spec.seed;
        let dtype = self.spec.dtype;
        let mut items = Vec::new();
        let mut changed = 0u64;
        for (idx, ((e, (m, mom)), (_, t))) in self
            .entries
            .iter()
            .zip(self.master.iter_mut().zip(self.momentum.iter_mut()))
            .zip(state.iter_mut())
            .enumerate()
        {
            if matches!(e.init, Init::Counter) {
                if let Ok(s) = t.as_mut_slice::<i64>() {
                    for x in s.iter_mut() {
                        *x = step as i64;
                    }
                    changed += s.len() as u64;
                }
                continue;
            }
            if !matches!(e.class, Class::Trainable) {
                continue;
            }
            let es = dtype.size_bytes();
            let bytes = t.bytes_mut();
            let mut rest_m = m.as_mut_slice();
            let mut rest_mom = mom.as_mut_slice();
            let mut rest_b = bytes;
            let mut c = 0u64;
            while !rest_m.is_empty() {
                let n = CHUNK.min(rest_m.len());
                let (a, ra) = rest_m.split_at_mut(n);
                let (b, rb) = rest_mom.split_at_mut(n.min(rest_mom.len()));
                let (d, rd) = rest_b.split_at_mut((n * es).min(rest_b.len()));
                items.push((idx, c, a, b, d));
                rest_m = ra;
                rest_mom = rb;
                rest_b = rd;
                c += 1;
            }
        }
        let counts = map_items(items, threads, |(idx, c, master, mom, bytes)| {
            let mut rng = Rng::new(seed, idx as u64, c, step);
            match mode {
                UpdateMode::Adam { lr } => {
                    adam_chunk(master, mom, bytes, dtype, lr as f32, step, &mut rng)
                }
                UpdateMode::Density { density } => {
                    density_chunk(master, bytes, dtype, density, &mut rng)
                }
            }
        });
        Ok(changed + counts.into_iter().sum::<u64>())
    }
}

/// Adam-like step on one chunk: momentum of uniform gradients (β1 = 0.9, bias-corrected), normalised by the
/// gradient RMS (1/√3 for U[-1,1]), then cast; counts elements whose bits changed.
fn adam_chunk(
    master: &mut [f32],
    mom: &mut [f32],
    bytes: &mut [u8],
    dtype: DType,
    lr: f32,
    step: u64,
    rng: &mut Rng,
) -> u64 {
    let corr = 1.0 - 0.9f32.powi(step.min(1000) as i32);
    let scale = lr * 3f32.sqrt() / corr;
    for (x, m) in master.iter_mut().zip(mom.iter_mut()) {
        *m = 0.9 * *m + 0.1 * rng.sym();
        *x -= scale * *m;
    }
    recast(master, bytes, dtype)
}

fn recast(master: &[f32], bytes: &mut [u8], dtype: DType) -> u64 {
    fn go<D: Pod + PartialEq>(
        master: &[f32],
        bytes: &mut [u8],
        f: impl Fn(f32) -> D,
        eq: impl Fn(D, D) -> bool,
    ) -> u64 {
        let Some(d) = pod_slice_mut::<D>(bytes) else {
            return 0;
        };
        let mut n = 0u64;
        for (o, &x) in d.iter_mut().zip(master) {
            let v = f(x);
            n += u64::from(!eq(*o, v));
            *o = v;
        }
        n
    }
    match dtype {
        DType::Bf16 => go(master, bytes, cast_f32_to_bf16, |a, b| a == b),
        DType::F16 => go(
            master,
            bytes,
            |x| half::f16::from_f32(x).to_bits(),
            |a, b| a == b,
        ),
        DType::F32 => go(master, bytes, f32::to_bits, |a, b| a == b),
        _ => go(master, bytes, |x| f64::from(x).to_bits(), |a, b| a == b),
    }
}

/// Fixed density: geometric gaps between changed positions, new values uniform in ±0.05 (forced to differ).
fn density_chunk(
    master: &mut [f32],
    bytes: &mut [u8],
    dtype: DType,
    density: f64,
    rng: &mut Rng,
) -> u64 {
    if density <= 0.0 || master.is_empty() {
        return 0;
    }
    let log_q = (1.0 - density).ln();
    let mut i = 0usize;
    loop {
        let gap = if density >= 1.0 {
            0
        } else {
            (rng.unit().ln() / log_q).floor() as usize
        };
        i = match i.checked_add(gap) {
            Some(v) if v < master.len() => v,
            _ => break,
        };
        let old = master[i];
        let mut v = rng.sym() * 0.05;
        if same_bits(dtype, old, v) {
            v = -v + 0.001;
        }
        master[i] = v;
        i += 1;
    }
    recast(master, bytes, dtype)
}

fn same_bits(dtype: DType, a: f32, b: f32) -> bool {
    match dtype {
        DType::Bf16 => cast_f32_to_bf16(a) == cast_f32_to_bf16(b),
        DType::F16 => half::f16::from_f32(a).to_bits() == half::f16::from_f32(b).to_bits(),
        _ => a.to_bits() == b.to_bits(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(params: u64, tensors: u32, dtype: DType) -> ModelSpec {
        ModelSpec {
            params,
            tensors,
            dtype,
            frozen_fraction: 0.0,
            seed: 1,
        }
    }

    #[test]
    fn shape_mix_has_exact_params_and_tensor_count() {
        for (p, t) in [
            (1u64 << 20, 64u32),
            (1000, 16),
            (10, 3),
            (5, 1),
            (100_000, 2),
            (1 << 16, 9),
        ] {
            let m = SyntheticModel::new(spec(p, t, DType::Bf16)).unwrap();
            let sd = m.state_dict().unwrap();
            let total: usize = sd.iter().map(|(_, t)| t.numel()).sum();
            assert_eq!(total as u64, p, "params for ({p}, {t})");
            assert_eq!(sd.len(), t as usize, "tensors for ({p}, {t})");
        }
        let sd = SyntheticModel::new(spec(1 << 20, 64, DType::Bf16))
            .unwrap()
            .state_dict()
            .unwrap();
        assert!(
            sd.iter().any(|(_, t)| t.shape().len() == 4),
            "a 4-D conv weight is in the mix"
        );
        assert!(
            sd.iter()
                .any(|(_, t)| t.shape().is_empty() && t.dtype() == DType::I64)
        );
    }

    #[test]
    fn adam_at_1e6_changes_about_one_percent_of_bf16() {
        let mut m = SyntheticModel::new(spec(1 << 20, 32, DType::Bf16)).unwrap();
        let mut sd = m.state_dict().unwrap();
        let mut fractions = Vec::new();
        for _ in 0..4 {
            let c = m
                .step(
                    UpdateMode::Adam { lr: 1e-6 },
                    &mut sd,
                    NonZeroUsize::new(2).unwrap(),
                )
                .unwrap();
            fractions.push(c as f64 / (1u64 << 20) as f64);
        }
        let last = fractions[3];
        assert!(
            (0.002..0.05).contains(&last),
            "changed fraction {fractions:?}"
        );
        // The counted changes are the bits that differ from a freshly cast state.
        let fresh = m.state_dict().unwrap();
        for ((n, a), (_, b)) in sd.iter().zip(fresh.iter()) {
            assert_eq!(a.bytes(), b.bytes(), "{n}");
        }
    }

    #[test]
    fn density_mode_hits_the_requested_density() {
        let mut m = SyntheticModel::new(spec(1 << 20, 16, DType::F32)).unwrap();
        let mut sd = m.state_dict().unwrap();
        let before = sd.duplicate();
        let c = m
            .step(
                UpdateMode::Density { density: 0.01 },
                &mut sd,
                NonZeroUsize::MIN,
            )
            .unwrap();
        let frac = c as f64 / (1u64 << 20) as f64;
        assert!((0.008..0.012).contains(&frac), "density {frac}");
        let diff: usize = sd
            .iter()
            .zip(before.iter())
            .map(|((_, a), (_, b))| {
                a.bytes()
                    .chunks(4)
                    .zip(b.bytes().chunks(4))
                    .filter(|(x, y)| x != y)
                    .count()
            })
            .sum();
        assert_eq!(diff as u64, c);
    }

    #[test]
    fn frozen_fraction_marks_leading_tensors_and_they_never_change() {
        let mut s = spec(1 << 16, 20, DType::Bf16);
        s.frozen_fraction = 0.3;
        let mut m = SyntheticModel::new(s).unwrap();
        let mut sd = m.state_dict().unwrap();
        let frozen: usize = sd
            .iter()
            .filter(|(_, t)| t.class() == Class::Frozen)
            .map(|(_, t)| t.numel())
            .sum();
        assert!(frozen as f64 >= 0.3 * 65536.0, "frozen {frozen}");
        let before = sd.duplicate();
        m.step(UpdateMode::Adam { lr: 1e-3 }, &mut sd, NonZeroUsize::MIN)
            .unwrap();
        for ((n, a), (_, b)) in sd.iter().zip(before.iter()) {
            if a.class() == Class::Frozen {
                assert_eq!(a.bytes(), b.bytes(), "{n}");
            }
        }
    }

    #[test]
    fn bad_settings_are_errors() {
        assert!(matches!(
            SyntheticModel::new(spec(10, 3, DType::I32)),
            Err(SyntheticError::NotFloating { .. })
        ));
        let mut s = spec(10, 3, DType::Bf16);
        s.frozen_fraction = 1.5;
        assert!(matches!(
            SyntheticModel::new(s),
            Err(SyntheticError::Fraction { .. })
        ));
    }
}
