//! The syncer's settings: the typed `weight_syncer` section of the run configuration.
//!
//! The app reads them from the composed config (key paths and defaults follow RLinf's
//! `weight_syncer.{type,patch.*,bucket.*}`); the Python binding receives them as serde's JSON of these types.
//! Devices and compressions a build cannot serve are accepted here and refused by the syncer with a clear error.

use std::num::NonZeroU64;

use serde::{Deserialize, Serialize};

use crate::tensor::DType;

/// `weight_syncer.type`.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum SyncerKind {
    #[default]
    Patch,
    Bucket,
}

/// A device where a buffer lives (`cpu` | `cuda`); the syncer refuses `cuda` (rlsync has no GPU backend).
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum Device {
    #[default]
    Cpu,
    Cuda,
}

/// `weight_syncer.patch.compression`.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "snake_case")]
pub enum Compression {
    #[default]
    None,
    /// CPU LZ4 (lz4_flex).
    Lz4,
    /// GPU LZ4 via nvCOMP (RLinf's); accepted in configs, refused by the syncer: rlsync has no GPU backend.
    NvcompLz4,
}

/// `weight_syncer.bucket.bucket_dtype` (floating tensors only are cast).
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum FloatDtype {
    #[serde(alias = "bf16")]
    Bfloat16,
    #[serde(alias = "fp16", alias = "f16", alias = "half")]
    Float16,
    #[serde(alias = "fp32", alias = "f32", alias = "float")]
    Float32,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct WeightSyncerConfig {
    #[serde(rename = "type")]
    pub kind: SyncerKind,
    pub patch: PatchConfig,
    pub bucket: BucketConfig,
    /// `weight_syncer.host_shared`: the rollouts of a host act on one double-buffered copy of the weights in
    /// shared memory (`host_shared`), one of them receiving for all; read by the app, not by the syncer.
    pub host_shared: bool,
}

impl Default for WeightSyncerConfig {
    fn default() -> Self {
        WeightSyncerConfig {
            kind: SyncerKind::Patch,
            patch: PatchConfig::default(),
            bucket: BucketConfig::default(),
            host_shared: false,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct PatchConfig {
    pub snapshot_device: Device,
    pub transport_device: Device,
    pub delta_encoding: bool,
    pub compression: Compression,
    pub init_sync: InitSyncConfig,
    /// Patches the trainer keeps so a rollout that rejoins can catch up by replay (0: always a full transfer).
    pub replay_versions: u32,
    /// Memory cap of that log in bytes (oldest patches are evicted first).
    pub replay_max_bytes: u64,
}

/// Largest `weight_syncer.patch.replay_versions`.
pub const MAX_REPLAY_VERSIONS: u32 = 4096;

impl Default for PatchConfig {
    fn default() -> Self {
        PatchConfig {
            snapshot_device: Device::Cpu,
            transport_device: Device::Cpu,
            delta_encoding: true,
            compression: Compression::None,
            init_sync: InitSyncConfig::default(),
            replay_versions: 8,
            replay_max_bytes: 512 << 20,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct InitSyncConfig {
    pub enabled: bool,
    /// `None`: the whole state dict; otherwise keys equal to a prefix or starting with `prefix.`.
    pub prefixes: Option<Vec<String>>,
    pub bucket_size: NonZeroU64,
}

impl Default for InitSyncConfig {
    fn default() -> Self {
        InitSyncConfig {
            enabled: true,
            prefixes: None,
            bucket_size: NonZeroU64::new(128 << 20).unwrap(),
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct BucketConfig {
    pub bucket_size: NonZeroU64,
    pub bucket_dtype: Option<FloatDtype>,
    pub bucket_device: Device,
    /// RLinf compatibility switch for agent-side key naming; accepted, no effect on embodied runs.
    pub is_agent: bool,
    /// `true`: install each bucket on arrival; `false`: stage all buckets, install at the end.
    pub load_instant: bool,
}

impl Default for BucketConfig {
    fn default() -> Self {
        BucketConfig {
            bucket_size: NonZeroU64::new(512 << 20).unwrap(),
            bucket_dtype: None,
            bucket_device: Device::Cpu,
            is_agent: false,
            load_instant: true,
        }
    }
}

impl From<FloatDtype> for DType {
    fn from(d: FloatDtype) -> DType {
        match d {
            FloatDtype::Bfloat16 => DType::Bf16,
            FloatDtype::Float16 => DType::F16,
            FloatDtype::Float32 => DType::F32,
        }
    }
}
