//! The device bucket sender on the reference device: the wire bytes equal the host path's for the same state
//! (mixed host and device tensors, casts, integers, several buckets and parts). The receiver's device
//! install is tested end to end in `syncer/tests/device_bucket_tests.rs`.

use std::collections::HashMap;

use super::*;
use crate::gpu::bucket::{BucketDevice, ReferenceBucketDevice};
use crate::syncer::bucket::plan;
use crate::tensor::{Class, Tensor};
use crate::transport::inproc_channel_with_timeout;

struct Stager {
    dev: ReferenceBucketDevice,
    addrs: HashMap<String, u64>,
}

impl BucketStager for Stager {
    fn addr(&self, key: &str) -> Option<u64> {
        self.addrs.get(key).copied()
    }
    fn device(&mut self) -> &mut dyn BucketDevice {
        &mut self.dev
    }
}

/// (key, dtype, numel, wire dtype, on the device)
const SPECS: [(&str, DType, usize, DType, bool); 7] = [
    ("a.w", DType::F32, 3000, DType::Bf16, true),
    ("a.b", DType::F32, 17, DType::Bf16, false),
    ("b.idx", DType::I64, 40, DType::I64, true),
    ("b.w", DType::Bf16, 2100, DType::Bf16, true),
    ("c.mask", DType::Bool, 9, DType::Bool, true),
    ("c.w", DType::F64, 513, DType::F16, true),
    ("d.empty", DType::F16, 0, DType::F32, true),
];

fn values(d: DType, n: usize, seed: u64) -> Vec<u8> {
    let mut x = (seed * 0x9E37_79B9) | 1;
    let mut out = Vec::with_capacity(n * d.size_bytes());
    for i in 0..n {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let v = match d {
            DType::F32 => ((i as f32 - 7.5) * 0.013 + (x % 1000) as f32 * 1e-3)
                .to_bits()
                .to_le_bytes()
                .to_vec(),
            DType::F64 => ((x % 100_000) as f64 * 1.7e-3 - 60.0)
                .to_le_bytes()
                .to_vec(),
            DType::Bool => vec![(x & 1) as u8],
            _ => x.to_le_bytes()[..d.size_bytes()].to_vec(),
        };
        out.extend_from_slice(&v);
    }
    out
}

/// The state on the host (device tensors' host copies filled with `stale` when given), the stager holding
/// the device tensors, and the planned buckets.
fn setup(stale: Option<u8>, bucket_size: u64) -> (StateDict, Stager, Vec<Vec<Planned>>) {
    let mut sd = StateDict::new();
    let mut stager = Stager {
        dev: ReferenceBucketDevice::default(),
        addrs: HashMap::new(),
    };
    let mut items = Vec::new();
    for (k, &(key, d, n, w, on_dev)) in SPECS.iter().enumerate() {
        let bytes = values(d, n, k as u64 + 1);
        let host = match (on_dev, stale) {
            (true, Some(b)) => vec![b; bytes.len()],
            _ => bytes.clone(),
        };
        let t = Tensor::from_bytes(d, &[n], Class::Trainable, &host).unwrap();
        sd.insert(key.to_owned(), t);
        if on_dev {
            stager
                .addrs
                .insert(key.to_owned(), stager.dev.mem.alloc(&bytes));
        }
        items.push(Planned {
            key: key.to_owned(),
            src: d,
            entry: BucketEntry {
                ordinal: k as u32,
                dtype: w,
                byte_len: n * w.size_bytes(),
            },
        });
    }
    (sd, stager, plan(items, bucket_size))
}

/// Every message one send publishes.
fn collect(
    send: impl AsyncFnOnce(&mut transport::Sender) -> Result<SendStats, SyncError>,
) -> (Vec<Vec<u8>>, SendStats) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let (mut ch, mut rxs) = inproc_channel_with_timeout(1, std::time::Duration::from_secs(5));
        let mut rx = rxs.pop().unwrap();
        let recv = async {
            let mut got = Vec::new();
            while let Ok(m) = rx.recv_with(<[u8]>::to_vec).await {
                got.push(m);
            }
            got
        };
        let send = async {
            let stats = send(&mut ch).await.unwrap();
            drop(ch);
            stats
        };
        let (stats, got) = tokio::join!(send, recv);
        (got, stats)
    })
}

const STAMP: Stamp = Stamp {
    version: 9,
    sequence: 4,
};

#[test]
fn the_device_path_sends_the_host_paths_bytes() {
    for (bucket_size, part_bytes) in [(1u64 << 30, 1usize << 20), (4000, 1500), (1, 64)] {
        let (sd, _, buckets) = setup(None, bucket_size);
        let (host, _) = collect(async |ch| {
            super::super::send(ch, &sd, &buckets, Kind::Bucket, STAMP, part_bytes).await
        });
        // The device tensors' host copies are garbage: the device path must not read them.
        let (stale_sd, mut stager, _) = setup(Some(0x5A), bucket_size);
        let (dev, stats) = collect(async |ch| {
            send_device(
                ch,
                &mut stager,
                &stale_sd,
                &buckets,
                Kind::Bucket,
                STAMP,
                part_bytes,
            )
            .await
        });
        assert!(host.len() >= buckets.len() && !host.is_empty());
        assert_eq!(host.len(), dev.len(), "bucket size {bucket_size}");
        for (i, (h, d)) in host.iter().zip(&dev).enumerate() {
            assert!(h == d, "message {i} differs (bucket size {bucket_size})");
        }
        assert_eq!(stats.messages as usize, dev.len());
        assert_eq!(stager.dev.launches, buckets.len());
    }
}

#[test]
fn a_state_that_no_longer_matches_the_plan_publishes_nothing() {
    let (mut sd, mut stager, buckets) = setup(None, 4000);
    sd.insert(
        "c.w".to_owned(),
        Tensor::zeros(DType::F32, &[513], Class::Trainable).unwrap(),
    );
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (mut ch, _rxs) = inproc_channel_with_timeout(1, std::time::Duration::from_secs(5));
    let err = rt
        .block_on(send_device(
            &mut ch,
            &mut stager,
            &sd,
            &buckets,
            Kind::Bucket,
            STAMP,
            1 << 20,
        ))
        .unwrap_err();
    assert!(
        matches!(err, SyncError::StateMismatch { ref key, .. } if key == "c.w"),
        "{err}"
    );
    assert_eq!(stager.dev.launches, 0);
}
