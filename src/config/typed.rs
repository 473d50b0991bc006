//! Extract the typed [`RunConfig`] from a resolved tree, with full key paths, origins and did-you-mean errors.
//!
//! Stage two of configuration: the composed, resolved [`Node`] tree is deserialized through serde into
//! [`schema`](super::schema) structs. Every problem names the full key path, the offending value, what was
//! expected and the file it came from. All problems are collected, not just the first: after a value error the
//! offending key is dropped (its default takes over) and extraction is retried.
//!
//! Unknown keys: inside sections rlsync owns (`weight_syncer`, `bench`) they are errors; elsewhere (sections
//! shared with RLinf configs, which carry many keys rlsync does not use) a key close to a known one is an error
//! with a suggestion, and any other is reported as ignored.

use std::cell::RefCell;
use std::fmt;

use serde::Deserialize;
use serde::de::{self, DeserializeSeed, IntoDeserializer, MapAccess, SeqAccess, Visitor};

use super::schema::{
    Compression, Device, EnvType, MAX_ROLLOUTS_PER_HOST, RunConfig, SyncerKind, WorkerDevice,
    WorkerKind,
};
use hydra_compose::node::{Key, Node, Origin, Value};
use hydra_compose::scalar::Scalar;
use rlsync_core::syncer::{SyncError, SyncOptions, WeightSyncer};

/// Top-level sections whose every key rlsync defines: an unknown key there is always an error.
const STRICT_SECTIONS: &[&str] = &["weight_syncer", "bench"];
/// Retry budget when collecting value errors (each retry drops one offending key).
const MAX_PROBLEMS: usize = 64;
/// Upper bound of the synthetic workload's emulated compute per train step or env step, in milliseconds.
const MAX_EMULATED_MS: f64 = 3_600_000.0;

/// One problem found while extracting or validating the typed configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct Problem {
    /// Full dotted key path (`weight_syncer.patch.compression`).
    pub path: String,
    pub message: String,
    /// Where the value came from, when known.
    pub origin: Option<Origin>,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.path, self.message)?;
        if let Some(origin) = &self.origin {
            write!(f, " (from {origin})")?;
        }
        Ok(())
    }
}

/// Every problem of a configuration that could not be turned into a [`RunConfig`].
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub struct ConfigErrors {
    pub problems: Vec<Problem>,
}

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.problems.len();
        writeln!(
            f,
            "invalid configuration ({n} problem{}):",
            if n == 1 { "" } else { "s" }
        )?;
        for p in &self.problems {
            writeln!(f, "  - {p}")?;
        }
        Ok(())
    }
}

/// A successfully extracted configuration plus the keys it ignored.
#[derive(Debug, Clone)]
pub struct Extracted {
    pub config: RunConfig,
    /// Keys present in the tree that rlsync does not read (full paths), for `--dry-run`.
    pub ignored: Vec<String>,
}

/// Turn a resolved tree into a validated [`RunConfig`], or report every problem found.
pub fn extract(resolved: &Node) -> Result<Extracted, ConfigErrors> {
    let mut tree = resolved.clone();
    let mut problems = Vec::new();
    let mut ignored = Vec::new();
    let config = loop {
        let sink = Sink::default();
        let result = RunConfig::deserialize(NodeDe {
            node: &tree,
            path: Path::root(),
            sink: &sink,
            fields: None,
        });
        let Sink { unknown, .. } = sink;
        match result {
            Ok(config) => {
                for u in unknown.into_inner() {
                    match u.kind {
                        UnknownKind::Ignored => ignored.push(u.problem.path),
                        UnknownKind::Error => problems.push(u.problem),
                    }
                }
                break config;
            }
            Err(err) => {
                let removed = err
                    .path
                    .as_deref()
                    .is_some_and(|p| remove_path(&mut tree, p));
                problems.push(Problem {
                    path: err.path.clone().unwrap_or_else(|| "<root>".into()),
                    message: err.message,
                    origin: err.origin,
                });
                if !removed || problems.len() >= MAX_PROBLEMS {
                    return Err(ConfigErrors { problems });
                }
            }
        }
    };
    problems.extend(cross_field_problems(&config, resolved));
    if problems.is_empty() {
        Ok(Extracted { config, ignored })
    } else {
        Err(ConfigErrors { problems })
    }
}

/// Rules that involve more than one key.
fn cross_field_problems(cfg: &RunConfig, tree: &Node) -> Vec<Problem> {
    let mut out = Vec::new();
    let mut problem = |path: &str, message: String| {
        let origin = tree.get_path(path).and_then(|n| n.origin.clone());
        out.push(Problem {
            path: path.to_owned(),
            message,
            origin,
        });
    };
    let patch = &cfg.weight_syncer.patch;
    if patch.compression == Compression::NvcompLz4 && patch.transport_device != Device::Cuda {
        problem(
            "weight_syncer.patch.compression",
            "nvcomp_lz4 (GPU compression) requires weight_syncer.patch.transport_device: cuda"
                .into(),
        );
    }
    if matches!(&patch.init_sync.prefixes, Some(p) if p.is_empty()) {
        problem(
            "weight_syncer.patch.init_sync.prefixes",
            "must be null (whole state dict) or a non-empty list of key prefixes".into(),
        );
    }
    if let Some(prefixes) = &patch.init_sync.prefixes {
        for (i, p) in prefixes.iter().enumerate() {
            if p.is_empty() {
                problem(
                    &format!("weight_syncer.patch.init_sync.prefixes.{i}"),
                    "a prefix must not be empty".into(),
                );
            }
        }
    }
    if patch.replay_versions > super::schema::MAX_REPLAY_VERSIONS {
        problem(
            "weight_syncer.patch.replay_versions",
            format!(
                "{} is more than {} (the log is for recent versions; older rejoins take a full transfer)",
                patch.replay_versions,
                super::schema::MAX_REPLAY_VERSIONS
            ),
        );
    }
    if cfg.runner.rollout_restarts > super::schema::MAX_ROLLOUT_RESTARTS {
        problem(
            "runner.rollout_restarts",
            format!(
                "{} is more than {} restarts per rollout worker",
                cfg.runner.rollout_restarts,
                super::schema::MAX_ROLLOUT_RESTARTS
            ),
        );
    }
    if cfg.runner.max_steps <= 0 && cfg.runner.max_epochs <= 0 {
        problem(
            "runner.max_steps",
            "the run never ends: set runner.max_steps or runner.max_epochs > 0".into(),
        );
    }
    for (path, secs) in [
        ("runner.handshake_timeout_s", cfg.runner.handshake_timeout_s),
        ("runner.shutdown_grace_s", cfg.runner.shutdown_grace_s),
    ] {
        if secs.get().is_zero() {
            problem(path, format!("{secs} is not a positive number of seconds"));
        }
    }
    for (path, ms) in [
        ("actor.model.train_ms", cfg.actor.model.train_ms),
        (
            "actor.model.rollout_ms_per_step",
            cfg.actor.model.rollout_ms_per_step,
        ),
    ] {
        if !(0.0..=MAX_EMULATED_MS).contains(&ms) {
            problem(
                path,
                format!(
                    "{ms} ms is outside [0, {MAX_EMULATED_MS}] (at most one hour of emulated compute)"
                ),
            );
        }
    }
    match crate::config::placement::resolve(&cfg.cluster) {
        Err(e) => {
            let path = e.key_path();
            let text = e.to_string();
            let message = text.strip_prefix(&format!("{path}: ")).unwrap_or(&text);
            problem(&path, message.to_owned());
        }
        Ok(placement) => {
            let workers = placement.rollouts.len() as u32;
            let busiest = (0..cfg.cluster.num_nodes.get())
                .map(|n| placement.rollouts.iter().filter(|w| w.node == n).count())
                .max()
                .unwrap_or(0);
            if busiest > MAX_ROLLOUTS_PER_HOST {
                problem(
                    "cluster.component_placement.rollout",
                    format!(
                        "{busiest} rollout workers is more than the {MAX_ROLLOUTS_PER_HOST} rlsync starts on one host (one process each, on the busiest node)"
                    ),
                );
            }
            for split in ["train", "eval"] {
                let envs = if split == "train" {
                    &cfg.env.train
                } else {
                    &cfg.env.eval
                };
                if envs.total_num_envs.get() % workers != 0 {
                    problem(
                        &format!("env.{split}.total_num_envs"),
                        format!(
                            "{} envs cannot be split evenly across {workers} rollout workers",
                            envs.total_num_envs
                        ),
                    );
                }
            }
        }
    }
    let c = &cfg.cluster;
    if !(c.node_timeout_s.is_finite() && c.node_timeout_s > 0.0) {
        problem(
            "cluster.node_timeout_s",
            format!("{} is not a positive number of seconds", c.node_timeout_s),
        );
    }
    if c.network.port_min == 0 || c.network.port_min > c.network.port_max {
        problem(
            "cluster.network.port_min",
            format!(
                "{}-{} is not a port range (1 <= port_min <= port_max <= 65535)",
                c.network.port_min, c.network.port_max
            ),
        );
    } else if u32::from(c.network.port_max - c.network.port_min) + 1 < c.num_nodes.get() {
        problem(
            "cluster.network.port_max",
            format!(
                "{}-{} has fewer ports than cluster.num_nodes={} (one weight-chain port per node)",
                c.network.port_min, c.network.port_max, c.num_nodes
            ),
        );
    }
    if c.network.part_bytes.get() < 4096 || c.network.part_bytes.get() > 1 << 30 {
        problem(
            "cluster.network.part_bytes",
            format!("{} is outside [4096, 1 GiB]", c.network.part_bytes),
        );
    }
    if let Some(rank) = c.node_rank
        && rank >= c.num_nodes.get()
    {
        problem(
            "cluster.node_rank",
            format!("{rank} is not a node of cluster.num_nodes={}", c.num_nodes),
        );
    }
    for (path, v, lo_open) in [
        (
            "actor.model.frozen_fraction",
            cfg.actor.model.frozen_fraction,
            false,
        ),
        ("bench.frozen_fraction", cfg.bench.frozen_fraction, false),
        ("bench.density", cfg.bench.density, true),
    ] {
        let ok =
            v.is_finite() && v < 1.0 + f64::EPSILON && if lo_open { v > 0.0 } else { v >= 0.0 };
        let ok = ok && !(path.ends_with("frozen_fraction") && v >= 1.0);
        if !ok {
            let range = if lo_open { "(0, 1]" } else { "[0, 1)" };
            problem(path, format!("{v} is outside {range}"));
        }
    }
    let clip = cfg.algorithm.stale_clip_fraction;
    if clip.is_nan() || clip <= 0.0 || clip > 1.0 {
        problem(
            "algorithm.stale_clip_fraction",
            format!(
                "{clip} is outside (0, 1] (a share of samples; 1 turns the stale-sync warning off)"
            ),
        );
    }
    for (path, v) in [
        ("actor.model.adam_lr", cfg.actor.model.adam_lr),
        ("bench.adam_lr", cfg.bench.adam_lr),
    ] {
        if !(v.is_finite() && v > 0.0) {
            problem(path, format!("{v} is not a positive learning rate"));
        }
    }
    worker_problems(cfg, &mut problem);
    host_shared_problems(cfg, &mut problem);
    gpu_channel_problems(cfg, &mut problem);
    // What the weight syncer itself refuses (a setting no backend of this build serves) is a problem of the
    // config too, so `--dry-run` reports it before any process starts, not the trainer after the spawn. With
    // the GPU channel, the syncer runs the handshake and bootstrap on the host (`host_syncer`).
    if let Err(e) = WeightSyncer::from_config(&cfg.host_syncer(), SyncOptions::default())
        && !out.iter().any(|p| p.path.starts_with("weight_syncer"))
    {
        let path = match &e {
            SyncError::NoGpuBackend { setting, .. } => setting,
            SyncError::Gpu(_) => "weight_syncer.patch.snapshot_device",
            _ => "weight_syncer",
        };
        let text = e.to_string();
        let message = text.strip_prefix(&format!("{path}: ")).unwrap_or(&text);
        out.push(Problem {
            path: path.to_owned(),
            message: message.to_owned(),
            origin: tree.get_path(path).and_then(|n| n.origin.clone()),
        });
    }
    out
}

/// `weight_syncer.host_shared`: the rollouts of a host act on one copy of the weights in the host's memory, so
/// every rollout holds its weights there (no GPU rollouts, no GPU install path).
fn host_shared_problems(cfg: &RunConfig, problem: &mut impl FnMut(&str, String)) {
    if !cfg.weight_syncer.host_shared {
        return;
    }
    let rollout = &cfg.rollout.worker;
    if rollout.kind == WorkerKind::Python && rollout.device.is_cuda() {
        problem(
            "weight_syncer.host_shared",
            format!(
                "the rollouts' weights are shared in host memory, but rollout.worker.device={} keeps them on \
                 the GPU: set rollout.worker.device=cpu or weight_syncer.host_shared=false",
                rollout.device
            ),
        );
    }
    if cfg.weight_syncer.kind == SyncerKind::Patch
        && cfg.weight_syncer.patch.transport_device == Device::Cuda
    {
        problem(
            "weight_syncer.host_shared",
            "the rollouts' weights are shared in host memory, but weight_syncer.patch.transport_device=cuda \
             installs patches on the GPU: set weight_syncer.patch.transport_device=cpu or \
             weight_syncer.host_shared=false"
                .into(),
        );
    }
}

/// `weight_syncer.patch.transport_device: cuda`: the same-host GPU channel carries every version from the
/// trainer's CUDA tensors to the rollouts' of its host (`worker::gpu_channel`; other hosts' rollouts take the
/// TCP chain). It needs both models on a GPU and its snapshot copy there (the rollouts read it through CUDA
/// IPC).
fn gpu_channel_problems(cfg: &RunConfig, problem: &mut impl FnMut(&str, String)) {
    if !cfg.gpu_channel() {
        return;
    }
    const KEY: &str = "weight_syncer.patch.transport_device";
    for (role, worker) in [
        ("actor", &cfg.actor.worker),
        ("rollout", &cfg.rollout.worker),
    ] {
        if worker.kind == WorkerKind::Python && !worker.device.is_cuda() {
            problem(
                &format!("{role}.worker.device"),
                format!(
                    "{KEY}=cuda moves the weights between CUDA tensors, but {role}.worker.device={} keeps this \
                     model on the host: set {role}.worker.device=cuda (or cuda:N), or {KEY}=cpu",
                    worker.device
                ),
            );
        }
    }
    if cfg.weight_syncer.patch.snapshot_device != Device::Cuda {
        problem(
            "weight_syncer.patch.snapshot_device",
            format!(
                "{KEY}=cuda shares the snapshot copy with the rollouts through CUDA IPC (they read overflowing \
                 tiles and full copies from it), so it lives in GPU memory: set \
                 weight_syncer.patch.snapshot_device=cuda, or {KEY}=cpu"
            ),
        );
    }
}

/// `actor.worker` / `rollout.worker`: a Python worker names an importable entry; both roles run the same kind
/// (the trajectories a rollout sends are in its kind's format); a Python env needs Python rollouts.
fn worker_problems(cfg: &RunConfig, problem: &mut impl FnMut(&str, String)) {
    for (role, worker) in [
        ("actor", &cfg.actor.worker),
        ("rollout", &cfg.rollout.worker),
    ] {
        if worker.kind != WorkerKind::Python {
            if worker.device != WorkerDevice::Cpu {
                problem(
                    &format!("{role}.worker.device"),
                    format!(
                        "{}: only python workers (worker@{role}.worker=python) take a device; the builtin \
                         worker runs on the CPU",
                        worker.device
                    ),
                );
            }
            continue;
        }
        match worker.entry.as_deref() {
            None => problem(
                &format!("{role}.worker.entry"),
                "a python worker needs an entry: `package.module:Attr`".into(),
            ),
            Some(entry) if !valid_entry(entry) => problem(
                &format!("{role}.worker.entry"),
                format!(
                    "'{entry}' is not `package.module:Attr` (dotted Python identifiers, one optional colon)"
                ),
            ),
            Some(_) => {}
        }
    }
    if cfg.actor.worker.kind != cfg.rollout.worker.kind {
        problem(
            "rollout.worker.kind",
            format!(
                "the trainer runs a {:?} worker and the rollouts a {:?} one: both roles must be python or both \
                 builtin (the trajectories a rollout sends are in its own kind's format)",
                cfg.actor.worker.kind, cfg.rollout.worker.kind
            )
            .to_lowercase(),
        );
    }
    for split in ["train", "eval"] {
        let env = if split == "train" {
            &cfg.env.train
        } else {
            &cfg.env.eval
        };
        if env.env_type == EnvType::Python && cfg.rollout.worker.kind != WorkerKind::Python {
            problem(
                &format!("env.{split}.env_type"),
                "a python env is simulated by a python rollout worker: set worker@rollout.worker=python".into(),
            );
        }
    }
}

/// `package.module` or `package.module:Attr.attr`, each part a Python identifier.
fn valid_entry(entry: &str) -> bool {
    let ident = |s: &str| {
        let mut chars = s.chars();
        chars.next().is_some_and(|c| c == '_' || c.is_alphabetic())
            && chars.all(|c| c == '_' || c.is_alphanumeric())
    };
    let dotted = |s: &str| s.split('.').all(ident);
    match entry.split_once(':') {
        Some((module, attr)) => dotted(module) && dotted(attr),
        None => dotted(entry),
    }
}

// ---------------------------------------------------------------------------------------------------------
// the serde Deserializer over Node

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum UnknownKind {
    Ignored,
    Error,
}

#[derive(Debug)]
struct Unknown {
    kind: UnknownKind,
    problem: Problem,
}

/// Collects unknown keys while serde walks the tree.
#[derive(Default)]
struct Sink {
    unknown: RefCell<Vec<Unknown>>,
}

/// A key path as a linked list of borrowed segments (cheap to extend while descending).
#[derive(Clone, Copy)]
struct Path<'a> {
    parent: Option<&'a Path<'a>>,
    segment: Option<&'a Key>,
    index: Option<usize>,
}

impl<'a> Path<'a> {
    fn root() -> Path<'static> {
        Path {
            parent: None,
            segment: None,
            index: None,
        }
    }

    fn render(&self) -> String {
        let mut parts = Vec::new();
        let mut cur = Some(self);
        while let Some(p) = cur {
            if let Some(k) = p.segment {
                parts.push(k.to_string());
            } else if let Some(i) = p.index {
                parts.push(i.to_string());
            }
            cur = p.parent;
        }
        parts.reverse();
        parts.join(".")
    }

    fn top(&self) -> Option<String> {
        let mut cur = self;
        while let Some(parent) = cur.parent {
            if parent.parent.is_none() {
                return cur.segment.map(|k| k.to_string());
            }
            cur = parent;
        }
        cur.segment.map(|k| k.to_string())
    }
}

/// serde error carrying the innermost path and origin.
#[derive(Debug)]
struct DeError {
    path: Option<String>,
    origin: Option<Origin>,
    message: String,
}

impl fmt::Display for DeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for DeError {}

impl de::Error for DeError {
    fn custom<T: fmt::Display>(msg: T) -> Self {
        DeError {
            path: None,
            origin: None,
            message: humanize(&msg.to_string()),
        }
    }
}

/// serde's messages use backticks and Rust's type names; make them read like the rest of rlsync's errors
/// (a config author writes YAML: "expected an integer", not "expected i64").
fn humanize(msg: &str) -> String {
    let msg = msg.replace('`', "'");
    const RUST_TYPES: &[(&str, &str)] = &[
        ("i8", "an integer"),
        ("i16", "an integer"),
        ("i32", "an integer"),
        ("i64", "an integer"),
        ("u8", "a non-negative integer"),
        ("u16", "a non-negative integer"),
        ("u32", "a non-negative integer"),
        ("u64", "a non-negative integer"),
        ("usize", "a non-negative integer"),
        ("a nonzero u8", "a positive integer"),
        ("a nonzero u16", "a positive integer"),
        ("a nonzero u32", "a positive integer"),
        ("a nonzero u64", "a positive integer"),
        ("a nonzero usize", "a positive integer"),
        ("f32", "a number"),
        ("f64", "a number"),
    ];
    for (rust, words) in RUST_TYPES {
        if let Some(head) = msg.strip_suffix(&format!("expected {rust}")) {
            return format!("{head}expected {words}");
        }
    }
    msg
}

struct NodeDe<'a, 'p, 's> {
    node: &'a Node,
    path: Path<'p>,
    sink: &'s Sink,
    /// The field names of the struct this node is a field of (for did-you-mean on unknown keys).
    fields: Option<&'static [&'static str]>,
}

impl NodeDe<'_, '_, '_> {
    fn locate(&self, mut err: DeError) -> DeError {
        if err.path.is_none() {
            err.path = Some(self.path.render());
            err.origin = self.node.origin.clone();
        }
        err
    }

    fn type_error(&self, expected: &str) -> DeError {
        let shown = describe(&self.node.value);
        self.locate(DeError {
            path: None,
            origin: None,
            message: format!("{shown} is not {expected}"),
        })
    }

    fn out_of_range(&self, digits: &str) -> DeError {
        self.locate(DeError {
            path: None,
            origin: None,
            message: format!("integer {digits} is out of range (beyond 64 bits)"),
        })
    }

    /// NaN and ±inf reach no setting: no field of [`RunConfig`] gives them a meaning, and each would fail (or
    /// panic) far from its key once used.
    fn reject_non_finite(&self) -> Result<(), DeError> {
        let x = match &self.node.value {
            Value::Scalar(s @ (Scalar::Float(_) | Scalar::BigInt(_))) => {
                s.as_f64().unwrap_or(f64::NAN)
            }
            _ => return Ok(()),
        };
        if x.is_finite() {
            return Ok(());
        }
        Err(self.locate(DeError {
            path: None,
            origin: None,
            message: format!("{} is not a finite number", describe(&self.node.value)),
        }))
    }

    fn record_unknown(&self) {
        let path = self.path.render();
        let key = self.path.segment.map(|k| k.to_string()).unwrap_or_default();
        let strict = self
            .path
            .top()
            .is_some_and(|t| STRICT_SECTIONS.contains(&t.as_str()));
        let fields = self.fields.unwrap_or(&[]);
        let suggestion = hydra_compose::did_you_mean::closest(&key, fields);
        let parent = path.strip_suffix(&key).unwrap_or("").to_owned();
        let (kind, message) = match (&suggestion, strict) {
            (Some(s), _) => (
                UnknownKind::Error,
                format!("unknown key (did you mean {parent}{s}?)"),
            ),
            (None, true) => (
                UnknownKind::Error,
                format!("unknown key; known keys here: {}", fields.join(", ")),
            ),
            (None, false) => (UnknownKind::Ignored, "not used by rlsync".to_owned()),
        };
        self.sink.unknown.borrow_mut().push(Unknown {
            kind,
            problem: Problem {
                path,
                message,
                origin: self.node.origin.clone(),
            },
        });
    }
}

fn describe(v: &Value) -> String {
    match v {
        Value::Scalar(Scalar::None) => "null".into(),
        Value::Scalar(Scalar::Bool(b)) => format!("boolean {b}"),
        Value::Scalar(Scalar::Int(i)) => format!("integer {i}"),
        Value::Scalar(Scalar::BigInt(digits)) => format!("integer {digits}"),
        Value::Scalar(Scalar::Float(x)) => {
            format!("float {}", hydra_compose::scalar::python_float_repr(*x))
        }
        Value::Scalar(Scalar::Str(s)) => format!("string '{s}'"),
        Value::Scalar(Scalar::Bytes(_)) => "binary data".into(),
        Value::Missing => "??? (missing mandatory value)".into(),
        Value::List(_) => "a list".into(),
        Value::Dict(_) => "a mapping".into(),
    }
}

/// Remove the node at a dotted path (so its default applies on the next attempt).
fn remove_path(tree: &mut Node, dotted: &str) -> bool {
    let (parent, last) = match dotted.rsplit_once('.') {
        Some((p, l)) => (Some(p), l),
        None => (None, dotted),
    };
    // A bad list element: drop the whole list from its parent so the default applies (replacing it by null
    // would be reported again as "null is not a list").
    if let Some(list) = parent
        && matches!(tree.get_path(list).map(|n| &n.value), Some(Value::List(_)))
    {
        return remove_path(tree, list);
    }
    let mut cur = tree;
    if let Some(parent) = parent {
        for part in parent.split('.') {
            cur = match &mut cur.value {
                Value::Dict(d) => match d.get_mut(&Key::from(part)) {
                    Some(n) => n,
                    None => return false,
                },
                Value::List(l) => match part.parse::<usize>().ok().and_then(|i| l.get_mut(i)) {
                    Some(n) => n,
                    None => return false,
                },
                _ => return false,
            };
        }
    }
    match &mut cur.value {
        Value::Dict(d) => d.shift_remove(&Key::from(last)).is_some(),
        // A bad list element: drop the whole list so the default applies.
        Value::List(_) => {
            *cur = Node::new(Value::NULL);
            true
        }
        _ => false,
    }
}

macro_rules! forward_to_any {
    ($($method:ident)*) => {
        $(fn $method<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, DeError> {
            self.deserialize_any(visitor)
        })*
    };
}

impl<'de, 'a: 'de, 'p, 's> de::Deserializer<'de> for NodeDe<'a, 'p, 's> {
    type Error = DeError;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, DeError> {
        let r = match &self.node.value {
            Value::Scalar(Scalar::None) => visitor.visit_unit(),
            Value::Scalar(Scalar::Bool(b)) => visitor.visit_bool(*b),
            Value::Scalar(Scalar::Int(i)) => visitor.visit_i64(*i),
            Value::Scalar(Scalar::BigInt(i)) => return Err(self.out_of_range(&i.to_string())),
            Value::Scalar(Scalar::Float(x)) => visitor.visit_f64(*x),
            Value::Scalar(Scalar::Str(s)) => visitor.visit_borrowed_str(s.as_str()),
            Value::Scalar(Scalar::Bytes(b)) => visitor.visit_borrowed_bytes(b.as_slice()),
            Value::Missing => return Err(self.type_error("set (mandatory value)")),
            Value::List(items) => visitor.visit_seq(ListAccess {
                items,
                next: 0,
                de: &self,
            }),
            Value::Dict(_) => visitor.visit_map(DictAccess::new(&self, None)),
        };
        r.map_err(|e| self.locate(e))
    }

    fn deserialize_f64<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, DeError> {
        self.reject_non_finite()?;
        // OmegaConf lets an int stand for a float (`lr: 1`).
        let r = match &self.node.value {
            // Python's float(int) rounds to nearest, as `as_f64` does.
            Value::Scalar(s @ (Scalar::Int(_) | Scalar::BigInt(_) | Scalar::Float(_))) => {
                visitor.visit_f64(s.as_f64().unwrap_or(f64::NAN))
            }
            _ => return Err(self.type_error("a number")),
        };
        r.map_err(|e| self.locate(e))
    }

    fn deserialize_f32<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, DeError> {
        self.deserialize_f64(visitor)
    }

    fn deserialize_bool<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, DeError> {
        match &self.node.value {
            Value::Scalar(Scalar::Bool(b)) => visitor.visit_bool(*b).map_err(|e| self.locate(e)),
            _ => Err(self.type_error("a boolean (true/false)")),
        }
    }

    fn deserialize_string<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, DeError> {
        match &self.node.value {
            Value::Scalar(Scalar::Str(s)) => visitor
                .visit_borrowed_str(s.as_str())
                .map_err(|e| self.locate(e)),
            _ => Err(self.type_error("a string")),
        }
    }

    fn deserialize_str<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, DeError> {
        self.deserialize_string(visitor)
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, DeError> {
        match &self.node.value {
            Value::Scalar(Scalar::None) => visitor.visit_none().map_err(|e| self.locate(e)),
            _ => visitor.visit_some(self),
        }
    }

    fn deserialize_seq<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, DeError> {
        match &self.node.value {
            Value::List(items) => visitor
                .visit_seq(ListAccess {
                    items,
                    next: 0,
                    de: &self,
                })
                .map_err(|e| self.locate(e)),
            _ => Err(self.type_error("a list")),
        }
    }

    fn deserialize_map<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, DeError> {
        match &self.node.value {
            Value::Dict(_) => visitor
                .visit_map(DictAccess::new(&self, None))
                .map_err(|e| self.locate(e)),
            _ => Err(self.type_error("a mapping")),
        }
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, DeError> {
        match &self.node.value {
            Value::Dict(_) => visitor
                .visit_map(DictAccess::new(&self, Some(fields)))
                .map_err(|e| self.locate(e)),
            // `section: null` means "all defaults", as an absent section would.
            Value::Scalar(Scalar::None) => visitor.visit_map(EmptyMap).map_err(|e| self.locate(e)),
            _ => Err(self.type_error("a mapping")),
        }
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        _name: &'static str,
        variants: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, DeError> {
        match &self.node.value {
            Value::Scalar(Scalar::Str(s)) => visitor
                .visit_enum(s.as_str().into_deserializer())
                .map_err(|e: DeError| self.locate(e)),
            _ => Err(self.type_error(&format!("one of {}", variants.join(", ")))),
        }
    }

    fn deserialize_ignored_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, DeError> {
        self.record_unknown();
        visitor.visit_unit()
    }

    forward_to_any! {
        deserialize_i8 deserialize_i16 deserialize_i32 deserialize_i64 deserialize_i128
        deserialize_u8 deserialize_u16 deserialize_u32 deserialize_u64 deserialize_u128
        deserialize_char deserialize_bytes deserialize_byte_buf deserialize_unit deserialize_identifier
    }

    fn deserialize_unit_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        visitor: V,
    ) -> Result<V::Value, DeError> {
        self.deserialize_any(visitor)
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        visitor: V,
    ) -> Result<V::Value, DeError> {
        visitor.visit_newtype_struct(self)
    }

    fn deserialize_tuple<V: Visitor<'de>>(self, _: usize, visitor: V) -> Result<V::Value, DeError> {
        self.deserialize_seq(visitor)
    }

    fn deserialize_tuple_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        _: usize,
        visitor: V,
    ) -> Result<V::Value, DeError> {
        self.deserialize_seq(visitor)
    }
}

struct ListAccess<'a, 'b, 'p, 's> {
    items: &'a [Node],
    next: usize,
    de: &'b NodeDe<'a, 'p, 's>,
}

impl<'de, 'a: 'de, 'b, 'p, 's> SeqAccess<'de> for ListAccess<'a, 'b, 'p, 's> {
    type Error = DeError;

    fn next_element_seed<T: DeserializeSeed<'de>>(
        &mut self,
        seed: T,
    ) -> Result<Option<T::Value>, DeError> {
        let Some(node) = self.items.get(self.next) else {
            return Ok(None);
        };
        let path = Path {
            parent: Some(&self.de.path),
            segment: None,
            index: Some(self.next),
        };
        self.next += 1;
        seed.deserialize(NodeDe {
            node,
            path,
            sink: self.de.sink,
            fields: None,
        })
        .map(Some)
    }
}

struct DictAccess<'a, 'b, 'p, 's> {
    iter: indexmap::map::Iter<'a, Key, Node>,
    value: Option<(&'a Key, &'a Node)>,
    de: &'b NodeDe<'a, 'p, 's>,
    fields: Option<&'static [&'static str]>,
}

impl<'a, 'b, 'p, 's> DictAccess<'a, 'b, 'p, 's> {
    fn new(de: &'b NodeDe<'a, 'p, 's>, fields: Option<&'static [&'static str]>) -> Self {
        let iter = match &de.node.value {
            Value::Dict(d) => d.iter(),
            _ => unreachable!("DictAccess is only built for dicts"),
        };
        DictAccess {
            iter,
            value: None,
            de,
            fields,
        }
    }
}

impl<'de, 'a: 'de, 'b, 'p, 's> MapAccess<'de> for DictAccess<'a, 'b, 'p, 's> {
    type Error = DeError;

    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, DeError> {
        let Some((key, node)) = self.iter.next() else {
            return Ok(None);
        };
        self.value = Some((key, node));
        let text = key.to_string();
        seed.deserialize(de::value::StringDeserializer::<DeError>::new(text))
            .map(Some)
    }

    fn next_value_seed<V: DeserializeSeed<'de>>(&mut self, seed: V) -> Result<V::Value, DeError> {
        let Some((key, node)) = self.value.take() else {
            return Err(de::Error::custom("value requested before key"));
        };
        let path = Path {
            parent: Some(&self.de.path),
            segment: Some(key),
            index: None,
        };
        seed.deserialize(NodeDe {
            node,
            path,
            sink: self.de.sink,
            fields: self.fields,
        })
    }
}

struct EmptyMap;

impl<'de> MapAccess<'de> for EmptyMap {
    type Error = DeError;

    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        _: K,
    ) -> Result<Option<K::Value>, DeError> {
        Ok(None)
    }

    fn next_value_seed<V: DeserializeSeed<'de>>(&mut self, _: V) -> Result<V::Value, DeError> {
        Err(de::Error::custom("no value in an empty mapping"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::schema::{FloatDtype, SyncerKind};
    use hydra_compose::node::Dict;
    use std::sync::Arc;

    /// Build a tree from `(dotted.path, value)` pairs.
    fn tree(entries: &[(&str, Value)]) -> Node {
        let mut root = Node::empty_dict();
        for (path, value) in entries {
            let mut cur = &mut root;
            let parts: Vec<&str> = path.split('.').collect();
            for (i, part) in parts.iter().enumerate() {
                let dict = cur.as_dict_mut().expect("test paths go through dicts");
                let last = i + 1 == parts.len();
                let child = dict
                    .entry(Key::from(*part))
                    .or_insert_with(|| Node::new(Value::Dict(Dict::new())));
                if last {
                    *child = Node::with_origin(
                        value.clone(),
                        Some(Origin::File {
                            file: Arc::from("t.yaml"),
                            line: 3,
                            col: 7,
                        }),
                    );
                }
                cur = child;
            }
        }
        root
    }

    fn s(v: &str) -> Value {
        Value::Scalar(Scalar::Str(v.into()))
    }

    #[test]
    fn empty_tree_gives_defaults() {
        let got = extract(&Node::empty_dict()).expect("defaults validate");
        assert_eq!(got.config, RunConfig::default());
        assert!(got.ignored.is_empty());
    }

    #[test]
    fn values_are_typed() {
        let got = extract(&tree(&[
            ("weight_syncer.type", s("bucket")),
            ("weight_syncer.bucket.bucket_dtype", s("bfloat16")),
            ("weight_syncer.bucket.bucket_size", Value::int(1024)),
            ("actor.optim.lr", Value::int(1)),
            ("actor.sync_weight_no_wait", Value::bool(true)),
            ("runner.weight_sync_interval", Value::int(8)),
        ]))
        .expect("valid");
        let c = got.config;
        assert_eq!(c.weight_syncer.kind, SyncerKind::Bucket);
        assert_eq!(
            c.weight_syncer.bucket.bucket_dtype,
            Some(FloatDtype::Bfloat16)
        );
        assert_eq!(c.weight_syncer.bucket.bucket_size.get(), 1024);
        assert_eq!(c.actor.optim.lr, 1.0);
        assert!(c.actor.sync_weight_no_wait);
        assert_eq!(c.runner.weight_sync_interval.get(), 8);
    }

    #[test]
    fn typo_in_strict_section_suggests_the_key() {
        let err = extract(&tree(&[("weight_syncer.patch.compresion", s("lz4"))])).unwrap_err();
        assert_eq!(err.problems.len(), 1);
        let p = &err.problems[0];
        assert_eq!(p.path, "weight_syncer.patch.compresion");
        assert!(
            p.message
                .contains("did you mean weight_syncer.patch.compression?"),
            "{}",
            p.message
        );
        assert!(p.to_string().contains("t.yaml:3:7"), "{p}");
    }

    #[test]
    fn unrelated_key_in_shared_section_is_ignored_not_an_error() {
        let got = extract(&tree(&[
            ("actor.fsdp_config.strategy", s("fsdp")),
            ("reward.use_reward_model", Value::bool(false)),
        ]))
        .expect("RLinf keys rlsync does not use are ignored");
        assert_eq!(
            got.ignored,
            vec!["actor.fsdp_config".to_owned(), "reward".to_owned()]
        );
    }

    #[test]
    fn every_problem_is_reported_not_just_the_first() {
        let err = extract(&tree(&[
            ("weight_syncer.patch.compression", s("lz5")),
            ("weight_syncer.bucket.bucket_size", Value::int(0)),
            ("runner.weight_sync_interval", s("often")),
            ("actor.optim.lr", s("fast")),
        ]))
        .unwrap_err();
        let paths: Vec<&str> = err.problems.iter().map(|p| p.path.as_str()).collect();
        assert_eq!(
            paths,
            [
                "weight_syncer.patch.compression",
                "weight_syncer.bucket.bucket_size",
                "runner.weight_sync_interval",
                "actor.optim.lr"
            ]
        );
        assert!(
            err.problems[0].message.contains("lz5")
                && err.problems[0].message.contains("nvcomp_lz4")
        );
        assert!(
            err.problems[1]
                .message
                .ends_with("integer '0', expected a positive integer"),
            "{}",
            err.problems[1].message
        );
        assert!(
            err.problems[2]
                .message
                .ends_with("string \"often\", expected a positive integer"),
            "serde's Rust type names are worded for a config author: {}",
            err.problems[2].message
        );
        assert!(
            err.problems[3]
                .message
                .contains("string 'fast' is not a number"),
            "{}",
            err.problems[3].message
        );
    }

    #[test]
    fn a_bad_list_element_is_one_problem() {
        // Regression: the list used to be replaced by null, reported again as "null is not a list".
        let list = Value::List(vec![Node::new(s("tensorboard")), Node::new(s("wandb"))]);
        let err = extract(&tree(&[("runner.logger.logger_backends", list)])).unwrap_err();
        assert_eq!(err.problems.len(), 1, "{err}");
        let p = &err.problems[0];
        assert_eq!(p.path, "runner.logger.logger_backends.1");
        for want in ["wandb", "tensorboard", "jsonl", "csv"] {
            assert!(p.message.contains(want), "{}", p.message);
        }
    }

    #[test]
    fn the_stale_sync_canary_keys_are_typed_and_bounded() {
        let c = extract(&tree(&[])).unwrap().config;
        assert_eq!(
            (
                c.algorithm.stale_clip_fraction,
                c.algorithm.stale_clip_window.get()
            ),
            (0.3, 10)
        );
        let c = extract(&tree(&[
            ("algorithm.stale_clip_fraction", Value::float(0.5)),
            ("algorithm.stale_clip_window", Value::int(3)),
        ]))
        .unwrap()
        .config;
        assert_eq!(c.algorithm.stale_clip_window.get(), 3);
        for bad in [0.0, -0.1, 1.5] {
            let err = extract(&tree(&[(
                "algorithm.stale_clip_fraction",
                Value::float(bad),
            )]))
            .unwrap_err();
            assert_eq!(err.problems[0].path, "algorithm.stale_clip_fraction");
            assert!(err.problems[0].message.contains("outside (0, 1]"), "{err}");
        }
        let err = extract(&tree(&[("algorithm.stale_clip_window", Value::int(0))])).unwrap_err();
        assert_eq!(err.problems[0].path, "algorithm.stale_clip_window");
    }

    #[test]
    fn cross_field_rules() {
        let err = extract(&tree(&[
            ("weight_syncer.patch.compression", s("nvcomp_lz4")),
            (
                "weight_syncer.patch.init_sync.prefixes",
                Value::List(vec![]),
            ),
            ("cluster.component_placement.rollout", s("0-2")),
        ]))
        .unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("requires weight_syncer.patch.transport_device: cuda"),
            "{text}"
        );
        assert!(
            text.contains("null (whole state dict) or a non-empty list"),
            "{text}"
        );
        assert!(
            text.contains("cannot be split evenly across 3 rollout workers"),
            "{text}"
        );
    }

    /// A setting the weight syncer refuses is a config problem at its own key (so `--dry-run` names it),
    /// once, and not on top of a cross-field problem of the same syncer config.
    #[test]
    fn what_the_syncer_refuses_is_a_config_problem() {
        let err = extract(&tree(&[
            ("weight_syncer.patch.transport_device", s("cuda")),
            ("weight_syncer.patch.snapshot_device", s("cuda")),
            ("weight_syncer.patch.compression", s("nvcomp_lz4")),
        ]))
        .unwrap_err();
        assert_eq!(err.problems.len(), 1, "{err}");
        assert_eq!(err.problems[0].path, "weight_syncer.patch.compression");
        assert!(
            err.problems[0].message.contains("does not link nvCOMP"),
            "{}",
            err.problems[0].message
        );
        assert!(extract(&tree(&[("weight_syncer.patch.snapshot_device", s("cuda"))])).is_ok());
    }

    /// `transport_device: cuda`, the same-host GPU channel: each thing that keeps it from working is named
    /// at its key, with what to set instead.
    #[test]
    fn the_gpu_channel_names_what_it_needs() {
        let python = |device: &'static str| {
            vec![
                ("weight_syncer.patch.transport_device", s("cuda")),
                ("weight_syncer.patch.snapshot_device", s("cuda")),
                ("actor.worker.kind", s("python")),
                ("actor.worker.entry", s("pkg.mod:Trainer")),
                ("actor.worker.device", s(device)),
                ("rollout.worker.kind", s("python")),
                ("rollout.worker.entry", s("pkg.mod:Rollout")),
                ("rollout.worker.device", s(device)),
            ]
        };
        let ok = extract(&tree(&python("cuda:0"))).unwrap();
        assert!(ok.config.gpu_channel());
        // The host syncer runs the handshake and bootstrap: its transport is the host's.
        assert_eq!(ok.config.host_syncer().patch.transport_device, Device::Cpu);
        // The bucket syncer ignores the patch section.
        let mut bucket = python("cuda");
        bucket.push(("weight_syncer.type", s("bucket")));
        assert!(!extract(&tree(&bucket)).unwrap().config.gpu_channel());
        let err = extract(&tree(&python("cpu"))).unwrap_err();
        let paths: Vec<&str> = err.problems.iter().map(|p| p.path.as_str()).collect();
        assert_eq!(
            paths,
            ["actor.worker.device", "rollout.worker.device"],
            "{err}"
        );
        assert!(
            err.problems[1]
                .message
                .contains("rollout.worker.device=cpu keeps this model on the host"),
            "{err}"
        );
        let err = extract(&tree(&[(
            "weight_syncer.patch.transport_device",
            s("cuda"),
        )]))
        .unwrap_err();
        assert_eq!(err.problems.len(), 1, "{err}");
        assert_eq!(err.problems[0].path, "weight_syncer.patch.snapshot_device");
        assert!(err.problems[0].message.contains("CUDA IPC"), "{err}");
        // Several hosts: the channel serves the trainer's; the chain's syncer keeps its snapshot on the host.
        let mut t = python("cuda");
        t.push(("cluster.num_nodes", Value::int(2)));
        let cfg = extract(&tree(&t)).unwrap().config;
        assert!(cfg.gpu_channel());
        assert_eq!(cfg.host_syncer().patch.snapshot_device, Device::Cuda);
        let chain = cfg.chain_syncer().patch;
        assert_eq!(
            (chain.snapshot_device, chain.transport_device),
            (Device::Cpu, Device::Cpu)
        );
        // Restartable rollouts rejoin over the channel.
        let mut t = python("cuda");
        t.push(("runner.rollout_restarts", Value::int(2)));
        let cfg = extract(&tree(&t)).unwrap().config;
        assert!(cfg.gpu_channel() && cfg.runner.rollout_restarts == 2);
    }

    #[test]
    fn missing_value_is_reported() {
        let err = extract(&tree(&[("actor.seed", Value::Missing)])).unwrap_err();
        assert!(
            err.problems[0].message.contains("missing mandatory value"),
            "{}",
            err.problems[0].message
        );
    }

    #[test]
    fn big_int_in_an_integer_field_names_the_key() {
        let err = extract(&tree(&[(
            "actor.seed",
            Value::Scalar(Scalar::int(
                "99999999999999999999".parse().unwrap_or_default(),
            )),
        )]))
        .unwrap_err();
        let p = &err.problems[0];
        assert_eq!(p.path, "actor.seed");
        assert!(
            p.message
                .contains("integer 99999999999999999999 is out of range"),
            "{}",
            p.message
        );
        // A float field takes it as Python's float(int) would.
        let got = extract(&tree(&[(
            "actor.optim.lr",
            Value::Scalar(Scalar::int(
                "100000000000000000000".parse().unwrap_or_default(),
            )),
        )]))
        .expect("valid");
        assert_eq!(got.config.actor.optim.lr, 1e20);
    }

    /// Issue 9, break 5: durations and magnitudes a real run cannot use are refused at their key.
    #[test]
    fn durations_and_magnitudes_are_bounded() {
        let check = |key: &str, value: Value, want: &str| {
            let err = extract(&tree(&[(key, value)])).unwrap_err();
            let p = err
                .problems
                .iter()
                .find(|p| p.path == key)
                .unwrap_or_else(|| panic!("no problem at {key}: {err}"));
            assert!(p.message.contains(want), "{key}: {}", p.message);
            assert!(p.to_string().contains("t.yaml:3:7"), "{p}");
        };
        check(
            "runner.handshake_timeout_s",
            Value::float(1e300),
            "beyond the limit",
        );
        check(
            "runner.step_timeout_s",
            Value::float(1e19),
            "beyond the limit",
        );
        check(
            "runner.shutdown_grace_s",
            Value::float(1e300),
            "beyond the limit",
        );
        check("runner.shutdown_grace_s", Value::int(-1), "negative");
        check(
            "runner.handshake_timeout_s",
            Value::int(0),
            "not a positive number",
        );
        check(
            "actor.model.train_ms",
            Value::float(1e300),
            "outside [0, 3600000]",
        );
        check(
            "actor.model.rollout_ms_per_step",
            Value::float(-1.0),
            "outside",
        );
        let ok = extract(&tree(&[
            ("runner.step_timeout_s", Value::int(0)),
            ("runner.handshake_timeout_s", Value::float(604800.0)),
        ]))
        .expect("0 turns the step deadline off; 7 days is allowed");
        assert_eq!(ok.config.runner.step_timeout_s.get(), None);
        assert_eq!(
            ok.config.runner.handshake_timeout_s.get(),
            std::time::Duration::from_secs(604800)
        );
    }

    /// Issue 9, break 6: NaN and infinities are refused at their key, with the value and its origin.
    #[test]
    fn nan_and_inf_are_refused_at_their_key() {
        for key in [
            "algorithm.gamma",
            "actor.optim.lr",
            "runner.step_timeout_s",
            "algorithm.clip_ratio_low",
            "algorithm.stale_clip_fraction",
        ] {
            for (value, shown) in [
                (f64::NAN, "float nan"),
                (f64::INFINITY, "float inf"),
                (f64::NEG_INFINITY, "float -inf"),
            ] {
                let err = extract(&tree(&[(key, Value::float(value))])).unwrap_err();
                let p = &err.problems[0];
                assert_eq!(p.path, key);
                assert!(
                    p.message
                        .contains(&format!("{shown} is not a finite number")),
                    "{key}: {}",
                    p.message
                );
                assert!(p.to_string().contains("t.yaml:3:7"), "{p}");
            }
        }
        // An integer too large for a float becomes inf too.
        let big = "9".repeat(400);
        let err = extract(&tree(&[(
            "algorithm.gamma",
            Value::Scalar(Scalar::int(big.parse().unwrap_or_default())),
        )]))
        .unwrap_err();
        assert!(
            err.problems[0].message.contains("is not a finite number"),
            "{}",
            err.problems[0].message
        );
    }

    /// Issue 9, break 8: a huge placement is refused quickly with a clear error, before expanding it.
    #[test]
    fn rollout_placement_is_capped() {
        let err = extract(&tree(&[(
            "cluster.component_placement.rollout",
            s("0-2000000"),
        )]))
        .unwrap_err();
        let p = &err.problems[0];
        assert_eq!(p.path, "cluster.component_placement.rollout");
        assert!(p.message.contains("more than 4096 slots"), "{}", p.message);
        let err = extract(&tree(&[
            ("cluster.component_placement.rollout", s("0-9999")),
            ("env.train.total_num_envs", Value::int(10000)),
            ("env.eval.total_num_envs", Value::int(10000)),
        ]))
        .unwrap_err();
        assert!(err.to_string().contains("more than 4096 slots"), "{err}");
        let err = extract(&tree(&[
            ("cluster.component_placement.rollout", s("0-511")),
            ("env.train.total_num_envs", Value::int(512)),
            ("env.eval.total_num_envs", Value::int(512)),
        ]))
        .unwrap_err();
        assert!(
            err.to_string()
                .contains("512 rollout workers is more than the 256 rlsync starts on one host"),
            "{err}"
        );
    }

    #[test]
    fn a_python_workers_device_is_typed_and_a_bad_one_is_named() {
        let python = |device: &str| {
            tree(&[
                ("actor.worker.kind", s("python")),
                ("actor.worker.entry", s("m")),
                ("actor.worker.device", s(device)),
                ("rollout.worker.kind", s("python")),
                ("rollout.worker.entry", s("m")),
            ])
        };
        for (text, want) in [
            ("cpu", WorkerDevice::Cpu),
            ("cuda", WorkerDevice::Cuda(None)),
            ("cuda:0", WorkerDevice::Cuda(Some(0))),
            ("cuda:7", WorkerDevice::Cuda(Some(7))),
        ] {
            let got = extract(&python(text)).expect(text).config;
            assert_eq!(got.actor.worker.device, want, "{text}");
            assert_eq!(got.rollout.worker.device, WorkerDevice::Cpu, "the default");
            assert_eq!(want.to_string(), text, "displayed as written");
        }
        for bad in [
            "gpu",
            "cuda:",
            "cuda:x",
            "cuda:-1",
            "cuda:+1",
            "CUDA",
            "cuda:99999",
        ] {
            let err = extract(&python(bad)).unwrap_err();
            assert_eq!(err.problems.len(), 1, "{bad}: {err}");
            let p = &err.problems[0];
            assert_eq!(p.path, "actor.worker.device", "{bad}");
            assert!(
                p.message.contains(&format!("'{bad}'")),
                "{bad}: {}",
                p.message
            );
        }
        let err = extract(&python("gpu")).unwrap_err();
        assert!(
            err.problems[0]
                .message
                .contains("expected cpu, cuda or cuda:N"),
            "{err}"
        );
        let err = extract(&tree(&[("actor.worker.device", Value::int(0))])).unwrap_err();
        assert_eq!(err.problems[0].path, "actor.worker.device");
        // The builtin worker runs on the CPU: a device for it is refused, not ignored.
        let err = extract(&tree(&[("rollout.worker.device", s("cuda"))])).unwrap_err();
        assert_eq!(err.problems[0].path, "rollout.worker.device");
        assert!(
            err.problems[0].message.contains("only python workers"),
            "{err}"
        );
    }

    #[test]
    fn host_shared_refuses_what_keeps_rollout_weights_off_the_host() {
        let ok = extract(&tree(&[("weight_syncer.host_shared", Value::bool(true))])).unwrap();
        assert!(ok.config.weight_syncer.host_shared);
        assert!(
            !extract(&Node::empty_dict())
                .unwrap()
                .config
                .weight_syncer
                .host_shared
        );
        let python_cuda = tree(&[
            ("weight_syncer.host_shared", Value::bool(true)),
            ("actor.worker.kind", s("python")),
            ("actor.worker.entry", s("pkg.mod:Trainer")),
            ("rollout.worker.kind", s("python")),
            ("rollout.worker.entry", s("pkg.mod:Rollout")),
            ("rollout.worker.device", s("cuda:1")),
        ]);
        let err = extract(&python_cuda).unwrap_err();
        assert_eq!(err.problems.len(), 1, "{err}");
        let p = &err.problems[0];
        assert_eq!(p.path, "weight_syncer.host_shared");
        assert!(
            p.message.contains("rollout.worker.device=cuda:1")
                && p.message.contains("weight_syncer.host_shared=false"),
            "{err}"
        );
        let gpu_install = tree(&[
            ("weight_syncer.host_shared", Value::bool(true)),
            ("weight_syncer.patch.transport_device", s("cuda")),
        ]);
        let err = extract(&gpu_install).unwrap_err();
        assert!(
            err.problems
                .iter()
                .any(|p| p.path == "weight_syncer.host_shared"
                    && p.message
                        .contains("weight_syncer.patch.transport_device=cuda")),
            "{err}"
        );
        let err = extract(&tree(&[("weight_syncer.host_shared", s("yes please"))])).unwrap_err();
        assert_eq!(err.problems[0].path, "weight_syncer.host_shared");
    }
}
