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

#[test]
fn unpack_casts_the_body_into_the_tensors() {
    let mut dev = ReferenceBucketDevice::default();
    let a = job(&mut dev.mem, &[0.0, 0.0], 2);
    // bf16 1.0 and -2.0 at offset 2.
    dev.unpack(&[9, 9, 0x80, 0x3F, 0x00, 0xC0], &[a]).unwrap();
    let got = dev.mem.read(a.tensor, 8).unwrap().to_vec();
    assert_eq!(got, [1.0f32, -2.0].map(f32::to_le_bytes).concat());
    // A body too short for its jobs writes nothing.
    assert!(matches!(
        dev.unpack(&[0; 4], &[a]),
        Err(BucketDeviceError::Range { .. })
    ));
    assert_eq!(dev.mem.read(a.tensor, 8).unwrap(), got);
}

#[test]
fn without_a_gpu_the_cuda_bucket_device_cannot_be_made_and_says_why() {
    // No driver here (or a build without CUDA): opening the device is the error, never a panic.
    if let Err(e) = Gpu::open(0) {
        let text = e.to_string();
        assert!(text.contains("CUDA") || text.contains("driver"), "{text}");
    }
}
