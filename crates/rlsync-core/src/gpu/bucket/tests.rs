//! The reference bucket device: slots packed and read in turn, unpacks that cast into the tensors, and
//! the CUDA device's clear error on a machine without one.

use super::*;

fn job(mem: &mut Memory, values: &[f32], offset: u64) -> BucketJob {
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    BucketJob {
        tensor: mem.alloc(&bytes),
        tensor_dtype: DType::F32,
        offset,
        wire_dtype: DType::Bf16,
        numel: values.len() as u64,
    }
}

#[test]
fn two_slots_hold_two_buckets_and_a_slot_is_read_once() {
    let mut dev = ReferenceBucketDevice::default();
    let a = job(&mut dev.mem, &[1.0, 2.0], 8);
    let b = job(&mut dev.mem, &[3.0], 16);
    dev.begin_pack(0, &[a], 12).unwrap();
    dev.begin_pack(1, &[b], 18).unwrap();
    let body = dev.finish_pack(0).unwrap();
    assert_eq!(&*body, &[0, 0, 0, 0, 0, 0, 0, 0, 0x80, 0x3F, 0x00, 0x40]);
    dev.recycle(0, body);
    let body = dev.finish_pack(1).unwrap();
    assert_eq!((body.len(), &body[16..]), (18, &[0x40u8, 0x40][..]));
    assert!(matches!(
        dev.finish_pack(0),
        Err(BucketDeviceError::Slot { slot: 0 })
    ));
    assert!(matches!(
        dev.begin_pack(2, &[a], 12),
        Err(BucketDeviceError::Slot { slot: 2 })
    ));
    assert_eq!(dev.launches, 2);
}

fn f32s(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

#[test]
fn unpack_copies_same_dtype_tensors_and_casts_the_others_in_batches() {
    let mut dev = ReferenceBucketDevice::default();
    let a = dev.mem.alloc(&f32s(&[0.0, 0.0]));
    let b = dev.mem.alloc(&[0u8; 3]);
    let c = dev.mem.alloc(&f32s(&[0.0]));
    // bf16 1.0 and -2.0 → f32; three raw bytes copied; bf16 3.0 → f32.
    let (wa, wc) = ([0x80u8, 0x3F, 0x00, 0xC0], [0x40u8, 0x40]);
    let uploads = [
        Upload {
            bytes: &wa,
            dtype: DType::Bf16,
            tensor: a,
            tensor_dtype: DType::F32,
        },
        Upload {
            bytes: &[7, 8, 9],
            dtype: DType::U8,
            tensor: b,
            tensor_dtype: DType::U8,
        },
        Upload {
            bytes: &wc,
            dtype: DType::Bf16,
            tensor: c,
            tensor_dtype: DType::F32,
        },
    ];
    dev.unpack(&uploads).unwrap();
    assert_eq!(dev.mem.read(a, 8).unwrap(), f32s(&[1.0, -2.0]));
    assert_eq!(dev.mem.read(b, 3).unwrap(), &[7, 8, 9]);
    assert_eq!(dev.mem.read(c, 4).unwrap(), f32s(&[3.0]));
    assert_eq!(dev.launches, 1, "both casts in one batch");

    // The plan: the copy goes straight, the casts share a batch at 8-aligned offsets until it is full.
    let plan = unpack_plan(&uploads, 1 << 20).unwrap();
    assert_eq!(plan.direct, vec![1]);
    assert_eq!(plan.batches.len(), 1);
    assert_eq!(plan.batches[0].pieces, vec![(0, 0), (2, 8)]);
    assert_eq!(plan.batches[0].len, 10);
    let plan = unpack_plan(&uploads, 8).unwrap();
    assert_eq!(plan.batches.len(), 2, "a full batch closes");
    assert_eq!(plan.batches[1].pieces, vec![(2, 0)]);
    let plan = unpack_plan(&uploads, 1).unwrap();
    assert_eq!(
        plan.batches.len(),
        2,
        "a tensor larger than a batch gets its own"
    );
}

#[test]
fn an_unpack_that_cannot_run_writes_nothing() {
    let mut dev = ReferenceBucketDevice::default();
    let a = dev.mem.alloc(&f32s(&[5.0]));
    let b = dev.mem.alloc(&[1, 2]);
    let good = Upload {
        bytes: &[9, 9],
        dtype: DType::U8,
        tensor: b,
        tensor_dtype: DType::U8,
    };
    let ragged = Upload {
        bytes: &[0x80, 0x3F, 0x00],
        dtype: DType::Bf16,
        tensor: a,
        tensor_dtype: DType::F32,
    };
    let integer = Upload {
        bytes: &[1, 0, 0, 0],
        dtype: DType::I32,
        tensor: a,
        tensor_dtype: DType::F32,
    };
    assert!(matches!(
        dev.unpack(&[good, ragged]),
        Err(BucketDeviceError::Ragged { bytes: 3, .. })
    ));
    assert!(matches!(
        dev.unpack(&[good, integer]),
        Err(BucketDeviceError::NotFloating { .. })
    ));
    assert_eq!(dev.mem.read(a, 4).unwrap(), f32s(&[5.0]));
    assert_eq!(dev.mem.read(b, 2).unwrap(), &[1, 2]);
    assert_eq!(dev.launches, 0);
}

#[test]
fn without_a_gpu_the_cuda_bucket_device_cannot_be_made_and_says_why() {
    // No driver here (or a build without CUDA): opening the device is the error, never a panic.
    if let Err(e) = Gpu::open(0) {
        let text = e.to_string();
        assert!(text.contains("CUDA") || text.contains("driver"), "{text}");
    }
}
