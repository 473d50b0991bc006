//! The bucket receiver installing on a device (`bucket_device: cuda`), run on the reference device: every
//! version lands in the device tensors bit for bit as the host install writes them (casts on the device),
//! host tensors of a mixed state stay on the host, the device tensors' host copies are never touched, and a
//! corrupt version is rejected whole with the device tensors untouched.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use super::*;
use crate::gpu::bucket::Upload;
use crate::gpu::bucket::{
    BucketDevice, BucketDeviceError, BucketJob, HostBody, ReferenceBucketDevice,
};
use crate::syncer::settings::Device;

/// A reference device the receiver's stager owns one handle of and the test reads through another.
#[derive(Clone, Default)]
struct SharedDevice(Arc<Mutex<ReferenceBucketDevice>>);

impl SharedDevice {
    fn lock(&self) -> MutexGuard<'_, ReferenceBucketDevice> {
        self.0.lock().unwrap()
    }
}

impl BucketDevice for SharedDevice {
    fn begin_pack(
        &mut self,
        slot: usize,
        jobs: &[BucketJob],
        body_len: usize,
    ) -> Result<(), BucketDeviceError> {
        self.lock().begin_pack(slot, jobs, body_len)
    }
    fn finish_pack(&mut self, slot: usize) -> Result<HostBody, BucketDeviceError> {
        self.lock().finish_pack(slot)
    }
    fn recycle(&mut self, slot: usize, body: HostBody) {
        self.lock().recycle(slot, body)
    }
    fn unpack(&mut self, uploads: &[Upload<'_>]) -> Result<(), BucketDeviceError> {
        self.lock().unpack(uploads)
    }
}

struct Stager {
    dev: SharedDevice,
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

/// What the host copies of the device tensors hold: the device install must neither read nor write them.
const STALE: u8 = 0x5A;

/// A bucket pair whose receiver installs the keys `on_device` picks (bit i: key i) on the reference
/// device: their current values move to the device, their host copies are overwritten with [`STALE`].
fn device_pair(
    rt: &tokio::runtime::Runtime,
    keys: &[KeySpec],
    s: &Settings,
    seed: u64,
    on_device: u8,
) -> (Pair, SharedDevice, HashMap<String, u64>) {
    let mut cfg = config(s, keys);
    cfg.bucket.bucket_device = Device::Cuda;
    let mut p = init_pair_with(rt, keys, s, seed, &cfg).unwrap();
    let dev = SharedDevice::default();
    let mut addrs = HashMap::new();
    for (i, k) in keys.iter().enumerate() {
        if on_device & (1 << (i % 8)) == 0 {
            continue;
        }
        let t = p.receiver.get_mut(&k.name).unwrap();
        addrs.insert(k.name.clone(), dev.lock().mem.alloc(t.bytes()));
        t.bytes_mut().fill(STALE);
    }
    let stager = Stager {
        dev: dev.clone(),
        addrs: addrs.clone(),
    };
    assert!(p.rx.set_bucket_stager(Box::new(stager)));
    (p, dev, addrs)
}

/// Every key's bytes as the receiver holds them: device memory for device keys, the state dict otherwise.
fn held(p: &Pair, dev: &SharedDevice, addrs: &HashMap<String, u64>) -> Vec<Vec<u8>> {
    p.receiver
        .iter()
        .map(|(name, t)| match addrs.get(name) {
            Some(&a) => dev
                .lock()
                .mem
                .read(a, t.bytes().len() as u64)
                .unwrap()
                .to_vec(),
            None => t.bytes().to_vec(),
        })
        .collect()
}

fn assert_host_copies_untouched(p: &Pair, addrs: &HashMap<String, u64>) {
    for name in addrs.keys() {
        let t = p.receiver.get(name).unwrap();
        assert!(
            t.bytes().iter().all(|&b| b == STALE),
            "host copy of device key {name} was touched"
        );
    }
}

fn bucket_settings(mut s: Settings) -> Settings {
    s.bucket = true;
    s
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, .. ProptestConfig::default() })]

    #[test]
    fn a_device_receiver_holds_what_the_host_install_writes(keys in model(), s in settings().prop_map(bucket_settings), seed in any::<u64>(), on_device in any::<u8>(), steps in 1..4usize, density in 0..60u64) {
        let rt = rt();
        let (mut p, dev, addrs) = device_pair(&rt, &keys, &s, seed, on_device);
        let frozen: Vec<Vec<u8>> = held(&p, &dev, &addrs);
        for v in 1..=steps as u64 {
            mutate(&mut p.sender, seed.wrapping_add(v), density);
            let (sent, applied) = sync_once(&rt, &mut p, v * 3);
            prop_assert_eq!(applied.version, v * 3);
            prop_assert_eq!(p.rx.version(), v * 3);
            prop_assert_eq!(sent.payload_bytes, applied.payload_bytes);
            let now = held(&p, &dev, &addrs);
            for (i, k) in keys.iter().enumerate() {
                let want = match k.class.is_synced() {
                    true => expected(&s, k, p.sender.get(&k.name).unwrap()),
                    false => frozen[i].clone(),
                };
                prop_assert!(now[i] == want, "key {} ({:?}) on device: {}", k.name, k, addrs.contains_key(&k.name));
            }
            assert_host_copies_untouched(&p, &addrs);
        }
        // A cast on the device is one launch per batch; same-dtype tensors are copied without one.
        let casts = keys.iter().any(|k| {
            let wire = match s.bucket_dtype {
                Some(d) if k.tx.is_floating() => DType::from(d),
                _ => k.tx,
            };
            k.class.is_synced() && addrs.contains_key(&k.name) && wire != k.rx && k.shape.iter().product::<usize>() > 0
        });
        prop_assert_eq!(dev.lock().launches > 0, casts);
    }

    #[test]
    fn a_corrupt_version_leaves_the_device_tensors_and_the_version_as_they_were(keys in model(), s in settings().prop_map(bucket_settings), seed in any::<u64>(), on_device in any::<u8>(), flip in any::<u64>()) {
        let rt = rt();
        let (mut p, dev, addrs) = device_pair(&rt, &keys, &s, seed, on_device);
        sync_once(&rt, &mut p, 1);
        let before = held(&p, &dev, &addrs);
        mutate(&mut p.sender, seed ^ 77, 30);
        let good = capture(&rt, &mut p, 2);
        let k = (flip as usize) % good.len();
        let mut bad = good[..=k].to_vec();
        let last = bad.last_mut().unwrap();
        let pos = (flip as usize / 7) % last.len();
        last[pos] ^= 1 << (flip % 8);
        let r = inject_and_apply(&rt, &mut p, &bad);
        prop_assert!(matches!(&r, Err(e) if e.is_rejection()), "accepted: {:?}", r.map(|r| r.version));
        prop_assert_eq!(p.rx.version(), 1);
        prop_assert!(held(&p, &dev, &addrs) == before, "a rejected version changed the receiver");
        assert_host_copies_untouched(&p, &addrs);
        // The genuine version still applies afterwards.
        let r = inject_and_apply(&rt, &mut p, &good).unwrap();
        prop_assert_eq!(r.version, 2);
        let now = held(&p, &dev, &addrs);
        for (i, k) in keys.iter().enumerate() {
            if k.class.is_synced() {
                prop_assert!(now[i] == expected(&s, k, p.sender.get(&k.name).unwrap()), "key {}", k.name);
            }
        }
    }
}

/// A version received and staged (`receive`) installs on the device at `commit`, and a stager set on a
/// patch receiver or a bucket receiver on `bucket_device: cpu` is refused.
#[test]
fn staged_versions_install_on_the_device_and_only_cuda_bucket_receivers_take_a_stager() {
    let rt = rt();
    let keys = simple_keys();
    let s = Settings {
        bucket: true,
        delta: false,
        lz4: false,
        init_sync: false,
        prefixes: false,
        bucket_size: 16,
        bucket_dtype: Some(FloatDtype::Float16),
        load_instant: true,
        threads: 1,
    };
    let (mut p, dev, addrs) = device_pair(&rt, &keys, &s, 5, 0xFF);
    mutate(&mut p.sender, 9, 50);
    let (sent, pending) =
        rt.block_on(async { tokio::join!(p.tx.sync(&p.sender, 4), p.rx.receive()) });
    sent.unwrap();
    let pending = pending.unwrap();
    let untouched = held(&p, &dev, &addrs);
    let w = keys.iter().position(|k| k.name == "w").unwrap();
    assert_ne!(
        untouched[w],
        expected(&s, &keys[w], p.sender.get("w").unwrap()),
        "nothing is written before the commit"
    );
    let report = rt.block_on(p.rx.commit(pending, &mut p.receiver)).unwrap();
    assert_eq!((report.version, p.rx.version()), (4, 4));
    let now = held(&p, &dev, &addrs);
    for (i, k) in keys.iter().enumerate().filter(|(_, k)| k.class.is_synced()) {
        assert_eq!(
            now[i],
            expected(&s, k, p.sender.get(&k.name).unwrap()),
            "{}",
            k.name
        );
    }
    assert_host_copies_untouched(&p, &addrs);
    assert!(
        dev.lock().launches > 0,
        "w: f16 on the wire, bf16 on the device: cast there"
    );

    let stager = || {
        Box::new(Stager {
            dev: SharedDevice::default(),
            addrs: HashMap::new(),
        })
    };
    let host = init_pair(&rt, &keys, &s, 5).unwrap();
    assert!(!host.rx.set_bucket_stager(stager()), "bucket_device: cpu");
    let patch = Settings { bucket: false, ..s };
    let mut cfg = config(&patch, &keys);
    cfg.bucket.bucket_device = Device::Cuda;
    let patch = init_pair_with(&rt, &keys, &patch, 5, &cfg).unwrap();
    assert!(!patch.rx.set_bucket_stager(stager()), "a patch receiver");
}
