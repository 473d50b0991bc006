//! TEMPORARY stand-ins for `tensor` and `syncer` (API.md shapes) until their branches merge.
#![allow(dead_code)] // Stand-ins carry the whole API.md shape; not every part is used yet.
//!
//! Deliberately minimal: every sync is a full copy of the synced keys over the real `crate::transport`.
//! Deleted once `crate::{tensor, syncer}` exist in main; callers only use the API.md names.

pub mod tensor {
    use indexmap::IndexMap;

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum DType {
        Bf16,
        F16,
        F32,
    }

    impl DType {
        pub fn size_bytes(self) -> usize {
            match self {
                DType::Bf16 | DType::F16 => 2,
                DType::F32 => 4,
            }
        }
    }

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Role {
        Trainable,
        Buffer,
        Frozen,
    }

    #[derive(Debug)]
    pub struct Tensor {
        pub dtype: DType,
        pub shape: Vec<usize>,
        pub role: Role,
        pub bytes: Vec<u8>,
    }

    impl Tensor {
        pub fn zeros(dtype: DType, shape: &[usize], role: Role) -> Tensor {
            let n: usize = shape.iter().product();
            Tensor { dtype, shape: shape.to_vec(), role, bytes: vec![0; n * dtype.size_bytes()] }
        }
        pub fn numel(&self) -> usize {
            self.shape.iter().product()
        }
        pub fn bytes(&self) -> &[u8] {
            &self.bytes
        }
        pub fn bytes_mut(&mut self) -> &mut [u8] {
            &mut self.bytes
        }
    }

    #[derive(Debug, Default)]
    pub struct StateDict {
        entries: IndexMap<String, Tensor>,
    }

    impl StateDict {
        pub fn insert(&mut self, name: String, tensor: Tensor) {
            self.entries.insert(name, tensor);
        }
        pub fn get(&self, name: &str) -> Option<&Tensor> {
            self.entries.get(name)
        }
        pub fn get_mut(&mut self, name: &str) -> Option<&mut Tensor> {
            self.entries.get_mut(name)
        }
        pub fn iter(&self) -> impl Iterator<Item = (&String, &Tensor)> {
            self.entries.iter()
        }
        pub fn iter_mut(&mut self) -> impl Iterator<Item = (&String, &mut Tensor)> {
            self.entries.iter_mut()
        }
        pub fn synced_keys(&self) -> Vec<String> {
            self.entries.iter().filter(|(_, t)| t.role != Role::Frozen).map(|(k, _)| k.clone()).collect()
        }
    }

    pub fn state_checksum(state: &StateDict, keys: &[String]) -> u64 {
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        for key in keys {
            h.update(key.as_bytes());
            if let Some(t) = state.get(key) {
                h.update(&(t.dtype.size_bytes() as u64).to_le_bytes());
                for d in &t.shape {
                    h.update(&(*d as u64).to_le_bytes());
                }
                h.update(&t.bytes);
            }
        }
        h.digest()
    }
}

pub mod syncer {
    use std::time::{Duration, Instant};

    use super::tensor::{StateDict, state_checksum};
    use crate::transport::{Receiver, Sender, TransportError};
    use crate::config::schema::{SyncerKind, WeightSyncerConfig};

    #[derive(Debug, thiserror::Error)]
    pub enum SyncError {
        #[error(transparent)]
        Transport(#[from] TransportError),
        #[error("update rejected: {reason}")]
        Rejected { reason: String },
        #[error("syncer not initialised as {side}")]
        NotInitialised { side: &'static str },
    }

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum SyncKind {
        Init,
        Patch,
        Bucket,
    }

    #[derive(Debug, Clone)]
    pub struct SyncReport {
        pub version: u64,
        pub kind: SyncKind,
        pub payload_bytes: u64,
        pub changed: u64,
        pub state_bytes: u64,
        pub transfer: Duration,
        pub compression_ratio: f64,
    }

    #[derive(Debug, Clone, Copy, Default)]
    pub struct SyncOptions {
        pub threads: usize,
    }

    pub struct WeightSyncer {
        kind: SyncerKind,
        sender: Option<Sender>,
        receiver: Option<Receiver>,
        keys: Vec<String>,
        version: u64,
    }

    pub struct PendingUpdate {
        version: u64,
        payload: Vec<u8>,
        kind: SyncKind,
    }

    fn encode(state: &StateDict, keys: &[String], version: u64) -> Vec<u8> {
        let mut out = version.to_le_bytes().to_vec();
        out.extend_from_slice(&state_checksum(state, keys).to_le_bytes());
        for k in keys {
            if let Some(t) = state.get(k) {
                out.extend_from_slice(&(k.len() as u64).to_le_bytes());
                out.extend_from_slice(k.as_bytes());
                out.extend_from_slice(&(t.bytes().len() as u64).to_le_bytes());
                out.extend_from_slice(t.bytes());
            }
        }
        out
    }

    fn take<'a>(buf: &mut &'a [u8], n: usize) -> Result<&'a [u8], SyncError> {
        if buf.len() < n {
            return Err(SyncError::Rejected { reason: "truncated payload".into() });
        }
        let (a, b) = buf.split_at(n);
        *buf = b;
        Ok(a)
    }

    fn take_u64(buf: &mut &[u8]) -> Result<u64, SyncError> {
        let b = take(buf, 8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }

    fn install(payload: &[u8], state: &mut StateDict, current: u64, first: bool) -> Result<(u64, Vec<String>), SyncError> {
        let mut buf = payload;
        let version = take_u64(&mut buf)?;
        let checksum = take_u64(&mut buf)?;
        if !first && version <= current {
            return Err(SyncError::Rejected { reason: format!("version {version} not newer than {current}") });
        }
        let mut parts = Vec::new();
        while !buf.is_empty() {
            let klen = take_u64(&mut buf)? as usize;
            let key = String::from_utf8_lossy(take(&mut buf, klen)?).into_owned();
            let blen = take_u64(&mut buf)? as usize;
            let bytes = take(&mut buf, blen)?;
            match state.get(&key) {
                Some(t) if t.bytes().len() == bytes.len() => parts.push((key, bytes)),
                _ => return Err(SyncError::Rejected { reason: format!("unknown or mis-sized tensor {key}") }),
            }
        }
        let keys: Vec<String> = parts.iter().map(|(k, _)| k.clone()).collect();
        for (key, bytes) in parts {
            if let Some(t) = state.get_mut(&key) {
                t.bytes_mut().copy_from_slice(bytes);
            }
        }
        if state_checksum(state, &keys) != checksum {
            return Err(SyncError::Rejected { reason: "checksum mismatch".into() });
        }
        Ok((version, keys))
    }

    impl WeightSyncer {
        pub fn from_config(cfg: &WeightSyncerConfig, _opts: SyncOptions) -> Result<Self, SyncError> {
            Ok(WeightSyncer { kind: cfg.kind, sender: None, receiver: None, keys: Vec::new(), version: 0 })
        }

        fn kind(&self) -> SyncKind {
            match self.kind {
                SyncerKind::Patch => SyncKind::Patch,
                SyncerKind::Bucket => SyncKind::Bucket,
            }
        }

        async fn publish(&mut self, state: &StateDict, version: u64, kind: SyncKind) -> Result<SyncReport, SyncError> {
            let started = Instant::now();
            let payload = encode(state, &self.keys, version);
            let sender = self.sender.as_mut().ok_or(SyncError::NotInitialised { side: "sender" })?;
            sender.send_with(payload.len(), |buf| buf.copy_from_slice(&payload)).await?;
            self.version = version;
            let state_bytes: u64 = self.keys.iter().filter_map(|k| state.get(k)).map(|t| t.bytes().len() as u64).sum();
            Ok(SyncReport {
                version,
                kind,
                payload_bytes: payload.len() as u64,
                changed: self.keys.iter().filter_map(|k| state.get(k)).map(|t| t.numel() as u64).sum(),
                state_bytes,
                transfer: started.elapsed(),
                compression_ratio: state_bytes as f64 / payload.len().max(1) as f64,
            })
        }

        pub async fn init_sender(&mut self, state: &StateDict, keys: &[String], ch: Sender) -> Result<SyncReport, SyncError> {
            self.keys = keys.to_vec();
            self.sender = Some(ch);
            self.publish(state, 0, SyncKind::Init).await
        }

        pub async fn sync(&mut self, state: &StateDict, version: u64) -> Result<SyncReport, SyncError> {
            let kind = self.kind();
            self.publish(state, version, kind).await
        }

        pub async fn init_receiver(&mut self, state: &mut StateDict, ch: Receiver) -> Result<SyncReport, SyncError> {
            self.receiver = Some(ch);
            let update = self.receive().await?;
            let mut report = update.install_first(state)?;
            report.kind = SyncKind::Init;
            self.version = report.version;
            Ok(report)
        }

        pub async fn apply(&mut self, state: &mut StateDict) -> Result<SyncReport, SyncError> {
            let update = self.receive().await?;
            let report = update.install(state)?;
            Ok(report)
        }

        pub async fn receive(&mut self) -> Result<PendingUpdate, SyncError> {
            let kind = self.kind();
            let rx = self.receiver.as_mut().ok_or(SyncError::NotInitialised { side: "receiver" })?;
            let payload = rx.recv_with(|b| b.to_vec()).await?;
            let mut head = payload.as_slice();
            let version = take_u64(&mut head)?;
            self.version = version;
            Ok(PendingUpdate { version, payload, kind })
        }
    }

    impl PendingUpdate {
        pub fn version(&self) -> u64 {
            self.version
        }
        fn install_first(self, state: &mut StateDict) -> Result<SyncReport, SyncError> {
            self.install_inner(state, true)
        }
        pub fn install(self, state: &mut StateDict) -> Result<SyncReport, SyncError> {
            self.install_inner(state, false)
        }
        fn install_inner(self, state: &mut StateDict, first: bool) -> Result<SyncReport, SyncError> {
            let started = Instant::now();
            let current = self.version.saturating_sub(1);
            let (version, keys) = install(&self.payload, state, current, first)?;
            let state_bytes: u64 = keys.iter().filter_map(|k| state.get(k)).map(|t| t.bytes().len() as u64).sum();
            Ok(SyncReport {
                version,
                kind: self.kind,
                payload_bytes: self.payload.len() as u64,
                changed: 0,
                state_bytes,
                transfer: started.elapsed(),
                compression_ratio: 1.0,
            })
        }
    }
}
