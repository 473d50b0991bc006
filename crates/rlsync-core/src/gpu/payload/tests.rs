//! Device payloads on the CPU: the sender's and receiver's device work done by the reference kernels over one
//! simulated device memory, the payload a buffer in it (as the caller's CUDA tensor would be).

use super::*;
use crate::gpu::ipc::reference::{RefReceiver, RefSender, SharedSim, SimMemory as _};
// The GPU channel's test state: every width, partial tiles, an empty tensor, a u8 tensor whose pool overflows
// when every third byte changes.
use crate::gpu::ipc::tests::{SHAPES, contents, layout, mutate, tensors};

type Sender = PayloadSender<RefSender<SharedSim>>;
type Receiver = PayloadReceiver<RefReceiver<SharedSim>>;

/// The tensors' names for a state checksum: key, dtype of their width, shape.
fn names() -> Vec<(String, crate::tensor::DType, Vec<usize>)> {
    use crate::tensor::DType;
    SHAPES
        .iter()
        .enumerate()
        .map(|(k, &(n, w))| {
            let dtype = match w {
                1 => DType::U8,
                2 => DType::Bf16,
                4 => DType::F32,
                _ => DType::I64,
            };
            (format!("t{k}"), dtype, vec![n as usize])
        })
        .collect()
}

fn copy_into(sim: &SharedSim, from: &[u64], to: &[u64]) {
    let data = contents(sim, from);
    let mut h = sim.lock();
    for ((&a, d), (n, w)) in to.iter().zip(data).zip(SHAPES) {
        h.mem.write(a, n * w as u64).unwrap().copy_from_slice(&d);
    }
}

/// A sender over fresh state tensors and a receiver whose tensors hold the same values (as after init).
fn pair() -> (SharedSim, Sender, Vec<u64>, Receiver, Vec<u64>) {
    let sim = SharedSim::default();
    let state = tensors(&sim, 1);
    let mine = tensors(&sim, 2);
    copy_into(&sim, &state, &mine);
    let tx = Sender::new(RefSender::new(sim.clone(), state.clone()), layout(), 0, 0).unwrap();
    let rx = Receiver::new(RefReceiver::new(sim.clone(), mine.clone()), layout(), 0, 0);
    (sim, tx, state, rx, mine)
}

/// Build and fill the next payload into a new buffer of the simulated memory: its address, length, report.
fn send(sim: &SharedSim, tx: &mut Sender) -> (u64, u64, PayloadReport) {
    // The caller's version label: ten per payload.
    let len = tx.build(10 * (tx.sequence() + 1)).unwrap();
    let addr = sim.lock().mem.alloc(&vec![0xee; len as usize]);
    let rep = tx.fill(addr, len).unwrap();
    (addr, len, rep)
}

fn bytes_at(sim: &SharedSim, addr: u64, len: u64) -> Vec<u8> {
    sim.lock().mem.read(addr, len).unwrap().to_vec()
}

fn put(sim: &SharedSim, addr: u64, bytes: &[u8]) {
    sim.lock()
        .mem
        .write(addr, bytes.len() as u64)
        .unwrap()
        .copy_from_slice(bytes);
}

fn rejected(r: Result<u64, PayloadError>) -> Reject {
    match r {
        Err(PayloadError::Rejected { reason, .. }) => reason,
        other => panic!("expected a rejection, got {other:?}"),
    }
}

#[test]
fn the_receiver_follows_the_sender_bitwise_through_patches_and_an_overflow() {
    let (sim, mut tx, state, mut rx, mine) = pair();
    let snapshot = crate::gpu::ipc::snapshot_offsets(&layout()).1;
    for round in 1..=6u64 {
        // Round 4 changes a third of the u8 tensor: more than its pool holds.
        let stride = if round == 4 { 3 } else { 0 };
        mutate(&sim, &state, round, stride);
        let (addr, len, rep) = send(&sim, &mut tx);
        assert_eq!((rep.sequence, rep.version), (round, 10 * round));
        assert_eq!(rep.full, round == 4, "round {round}: {rep:?}");
        if !rep.full {
            assert!(len < snapshot / 2, "round {round}: a patch of {len} bytes");
            let changed: u64 = rep.changes.iter().map(|c| c.1).sum();
            assert!(changed > 0, "round {round}");
        }
        assert_eq!(rx.apply(addr, len).unwrap(), 10 * round);
        assert_eq!((rx.sequence(), rx.version()), (round, 10 * round));
        assert_eq!(
            contents(&sim, &mine),
            contents(&sim, &state),
            "round {round}"
        );
        let last = rx.last().unwrap();
        assert_eq!((last.sequence, last.full), (round, rep.full));
        // The sender's checksum (of its snapshot copy) is the receiver's state checksum.
        let names = names();
        let theirs = crate::gpu::checksum::Plan::of_device(&names, &mine);
        let sum = sim
            .with(|mem| theirs.finish_on(mem, std::num::NonZeroUsize::MIN))
            .unwrap();
        assert_eq!(tx.checksum(&names).unwrap(), sum, "round {round}");
    }
    assert_eq!(tx.fallbacks, 0);
}

#[test]
fn an_unchanged_state_sends_an_empty_patch_that_still_advances_the_version() {
    let (sim, mut tx, _state, mut rx, _mine) = pair();
    let (addr, len, rep) = send(&sim, &mut tx);
    assert!(!rep.full);
    assert!(rep.changes.iter().all(|c| c.1 == 0), "{rep:?}");
    assert_eq!(rx.apply(addr, len).unwrap(), 10);
}

#[test]
fn a_corrupted_byte_anywhere_is_rejected_and_the_tensors_and_version_stay() {
    let (sim, mut tx, state, mut rx, mine) = pair();
    mutate(&sim, &state, 1, 0);
    let (addr, len, _) = send(&sim, &mut tx);
    let good = bytes_at(&sim, addr, len);
    let before = contents(&sim, &mine);
    let h = Header::decode(&good).unwrap();
    // The header, then a byte in each width's directory counts, index and values.
    let mut spots = vec![9usize, 30, h.len() - 1];
    for p in &h.widths {
        spots.push(p.dir_off as usize + 8);
        if p.entries > 0 {
            spots.push(p.idx_off as usize);
            spots.push(p.vals_off as usize + 5);
        }
    }
    for at in spots {
        let mut bad = good.clone();
        bad[at] ^= 0x10;
        put(&sim, addr, &bad);
        let reason = rejected(rx.apply(addr, len));
        assert_eq!(contents(&sim, &mine), before, "byte {at}: {reason}");
        assert_eq!(rx.version(), 0, "byte {at}");
        assert_eq!(rx.staged_version(), None);
    }
    put(&sim, addr, &good);
    assert_eq!(
        rx.apply(addr, len).unwrap(),
        10,
        "the intact payload applies"
    );
    assert_eq!(contents(&sim, &mine), contents(&sim, &state));
}

#[test]
fn truncated_replayed_misaligned_and_foreign_payloads_are_rejected() {
    let (sim, mut tx, state, mut rx, mine) = pair();
    mutate(&sim, &state, 1, 0);
    let (addr, len, _) = send(&sim, &mut tx);
    assert!(matches!(
        rejected(rx.apply(addr, len - 1)),
        Reject::Length { .. }
    ));
    assert!(matches!(
        rejected(rx.apply(addr + 4, len - 4)),
        Reject::Misaligned { .. }
    ));
    assert!(matches!(
        rejected(rx.apply(addr, 40)),
        Reject::Header(wire::HeaderError::Truncated { .. })
    ));
    // Coded host bytes are no device payload.
    let coded = b"RLSY not a device payload at all: coded bytes";
    let other = sim.lock().mem.alloc(coded);
    assert!(matches!(
        rejected(rx.apply(other, coded.len() as u64)),
        Reject::Header(wire::HeaderError::Magic { .. })
    ));
    assert_eq!(rx.apply(addr, len).unwrap(), 10);
    // The same payload again: its base is behind the receiver.
    let before = contents(&sim, &mine);
    assert!(matches!(
        rejected(rx.apply(addr, len)),
        Reject::Base { base: 0, .. }
    ));
    assert_eq!(contents(&sim, &mine), before);
    // A receiver of other tensors.
    let shapes = [(4096u64, 2usize), (10, 4)];
    let other_layout = Layout::new(&shapes).unwrap();
    let theirs: Vec<u64> = {
        let mut h = sim.lock();
        shapes
            .iter()
            .map(|&(n, w)| h.mem.alloc(&vec![0; n as usize * w]))
            .collect()
    };
    let mut stranger =
        PayloadReceiver::new(RefReceiver::new(sim.clone(), theirs), other_layout, 0, 0);
    assert!(matches!(
        rejected(stranger.apply(addr, len)),
        Reject::Layout { .. }
    ));
}

#[test]
fn a_lost_payload_or_an_unfilled_build_makes_the_next_one_full_and_a_receiver_catches_up() {
    let (sim, mut tx, state, mut rx, mine) = pair();
    mutate(&sim, &state, 1, 0);
    let (_addr, _len, rep) = send(&sim, &mut tx);
    assert!(!rep.full);
    tx.lost(); // never reached the receiver
    mutate(&sim, &state, 2, 0);
    let (addr, len, rep) = send(&sim, &mut tx);
    assert!(rep.full, "{rep:?}");
    assert_eq!(rep.sequence, 2);
    assert_eq!(rx.apply(addr, len).unwrap(), 20);
    assert_eq!(contents(&sim, &mine), contents(&sim, &state));
    // A build whose payload was never filled: the next build is full, the version did not skip.
    mutate(&sim, &state, 3, 0);
    tx.build(1).unwrap();
    mutate(&sim, &state, 4, 0);
    let (addr, len, rep) = send(&sim, &mut tx);
    assert!(rep.full);
    assert_eq!(rep.sequence, 3);
    assert_eq!(rx.apply(addr, len).unwrap(), 30);
    assert_eq!(contents(&sim, &mine), contents(&sim, &state));
    // Back to patches; an older full payload is stale.
    mutate(&sim, &state, 5, 0);
    let (a5, l5, rep) = send(&sim, &mut tx);
    assert!(!rep.full);
    assert_eq!(rx.apply(a5, l5).unwrap(), 40);
    assert!(matches!(
        rejected(rx.apply(addr, len)),
        Reject::Stale {
            sequence: 3,
            have: 4
        }
    ));
    // Too small a buffer: an error, and the payload can still be filled.
    mutate(&sim, &state, 6, 0);
    let need = tx.build(60).unwrap();
    let small = sim.lock().mem.alloc(&vec![0; need as usize - 1]);
    assert!(matches!(
        tx.fill(small, need - 1),
        Err(PayloadError::Buffer { .. })
    ));
    let buf = sim.lock().mem.alloc(&vec![0; need as usize]);
    tx.fill(buf, need).unwrap();
    assert_eq!(rx.apply(buf, need).unwrap(), 60);
    assert_eq!(contents(&sim, &mine), contents(&sim, &state));
}

#[test]
fn a_failed_own_check_sends_the_version_in_full_from_the_state() {
    let (sim, mut tx, state, mut rx, mine) = pair();
    mutate(&sim, &state, 1, 0);
    // The directory count of the 8-byte width's only tile, and a byte of the snapshot copy: the full payload
    // must come from the state, not from the broken copy.
    tx.device_mut().fault = Some(Box::new(|mem, dev| {
        let k = dev.outs.iter().position(|w| w.width == 8).unwrap();
        let at = dev.out_addrs[k] + dev.outs[k].dir_off + 8;
        mem.write(at, 1).unwrap()[0] ^= 1;
        mem.write(dev.snap + 3, 1).unwrap()[0] ^= 0x80;
    }));
    let (addr, len, rep) = send(&sim, &mut tx);
    assert!(rep.full);
    assert_eq!(tx.fallbacks, 1);
    assert_eq!(rx.apply(addr, len).unwrap(), 10);
    assert_eq!(contents(&sim, &mine), contents(&sim, &state));
    mutate(&sim, &state, 2, 0);
    let (addr, len, rep) = send(&sim, &mut tx);
    assert!(!rep.full, "patches again, on the refreshed snapshot copy");
    assert_eq!(rx.apply(addr, len).unwrap(), 20);
    assert_eq!(contents(&sim, &mine), contents(&sim, &state));
}

#[test]
fn stage_holds_a_verified_payload_until_commit_and_abort_drops_it() {
    let (sim, mut tx, state, mut rx, mine) = pair();
    let before = contents(&sim, &mine);
    mutate(&sim, &state, 1, 0);
    let (addr, len, _) = send(&sim, &mut tx);
    assert_eq!(rx.stage(addr, len).unwrap(), 10);
    assert_eq!(rx.staged_version(), Some(10));
    assert_eq!(contents(&sim, &mine), before, "staging writes nothing");
    assert_eq!(rx.version(), 0);
    assert_eq!(rx.abort(), Some(10));
    assert!(matches!(rx.commit(), Err(PayloadError::NotStaged)));
    assert_eq!(rx.stage(addr, len).unwrap(), 10);
    assert_eq!(rx.commit().unwrap(), 10);
    assert_eq!(contents(&sim, &mine), contents(&sim, &state));
}

/// A receiver on the CPU: its tensors and the payload in host memory.
struct Host {
    rx: PayloadReceiver<host::HostReceiver>,
    tensors: Vec<Vec<u8>>,
    /// Which tensors this receiver installs (the others are held elsewhere: address 0).
    here: Vec<bool>,
    /// The payload, 8-byte aligned.
    payload: Vec<u64>,
}

impl Host {
    fn new(tensors: Vec<Vec<u8>>) -> Host {
        let here = vec![true; tensors.len()];
        Host {
            rx: PayloadReceiver::new(host::HostReceiver::new(), layout(), 0, 0),
            tensors,
            here,
            payload: Vec::new(),
        }
    }

    /// Stage `bytes` (at `skew` bytes past an aligned start) for the tensors.
    fn stage(&mut self, bytes: &[u8], skew: usize) -> Result<u64, PayloadError> {
        self.payload = vec![0; (bytes.len() + skew).div_ceil(8)];
        let buf: &mut [u8] = bytemuck::cast_slice_mut(&mut self.payload);
        buf[skew..skew + bytes.len()].copy_from_slice(bytes);
        let addr = buf.as_ptr() as u64 + skew as u64;
        let regions: Vec<(u64, u64)> = self
            .tensors
            .iter_mut()
            .zip(&self.here)
            .map(|(t, &here)| match here {
                true => (t.as_mut_ptr() as u64, t.len() as u64),
                false => (0, 0),
            })
            .collect();
        let dev = self.rx.device_mut();
        // SAFETY: the tensors and the payload are this test's buffers, alive and untouched until the commit.
        unsafe {
            dev.set_tensors(&regions);
            dev.set_payload(addr, bytes.len() as u64);
        }
        self.rx.stage(addr, bytes.len() as u64)
    }

    /// Stage and commit `bytes` (at `skew` bytes past an aligned start) into the tensors.
    fn apply(&mut self, bytes: &[u8], skew: usize) -> Result<u64, PayloadError> {
        self.stage(bytes, skew)?;
        self.rx.commit()
    }
}

/// A byte the payload's checksums cover, past the header: in the last value of a patch, or mid-image.
fn inside(payload: &[u8]) -> usize {
    let h = Header::decode(payload).unwrap();
    let at = match h.mode {
        wire::Mode::Full => h.snapshot_off + h.snapshot_bytes / 2,
        wire::Mode::Patch => {
            let p = h.widths.iter().rfind(|p| p.entries > 0).unwrap();
            p.vals_off + 8 * (p.entries - 1) + 5
        }
    };
    at as usize
}

#[test]
fn a_receiver_on_the_cpu_installs_device_payloads_bit_for_bit_and_rejects_corrupt_ones() {
    let (sim, mut tx, state, _rx, _mine) = pair();
    let mut host = Host::new(contents(&sim, &state));
    for round in 1..=5u64 {
        let stride = if round == 3 { 3 } else { 0 };
        mutate(&sim, &state, round, stride);
        let (addr, len, rep) = send(&sim, &mut tx);
        assert_eq!(rep.full, round == 3);
        let bytes = bytes_at(&sim, addr, len);
        let before = host.tensors.clone();
        // Corrupted in a pool (or the image) and in the header: rejected, nothing written.
        for at in [inside(&bytes), 20] {
            let mut bad = bytes.clone();
            bad[at] ^= 4;
            assert!(
                matches!(host.apply(&bad, 0), Err(PayloadError::Rejected { .. })),
                "round {round}, byte {at}"
            );
            assert_eq!(host.tensors, before, "round {round}, byte {at}");
        }
        assert!(matches!(
            host.apply(&bytes, 4),
            Err(PayloadError::Rejected {
                reason: Reject::Misaligned { .. },
                ..
            })
        ));
        assert_eq!(host.apply(&bytes, 0).unwrap(), 10 * round);
        assert_eq!(host.tensors, contents(&sim, &state), "round {round}");
    }
}

#[test]
fn a_receiver_on_two_devices_installs_each_share_on_its_own_and_rejects_as_one() {
    // Even tensors on the (simulated) GPU, odd ones on the CPU: two receivers of the same layout, each with
    // the other's tensors held elsewhere (address 0), staged both before either commits.
    let (sim, mut tx, state, _rx, mine) = pair();
    let on_gpu = |k: usize| k.is_multiple_of(2);
    let gpu_addrs: Vec<u64> = mine
        .iter()
        .enumerate()
        .map(|(k, &a)| if on_gpu(k) { a } else { 0 })
        .collect();
    let mut gpu = Receiver::new(RefReceiver::new(sim.clone(), gpu_addrs), layout(), 0, 0);
    let mut host = Host::new(contents(&sim, &state));
    host.here = (0..SHAPES.len()).map(|k| !on_gpu(k)).collect();
    // What each device holds of the other's tensors, which no install may touch.
    let untouched_gpu = contents(&sim, &mine);
    let untouched_host: Vec<Vec<u8>> = host.tensors.iter().map(|t| vec![0x5a; t.len()]).collect();
    for (k, t) in host.tensors.iter_mut().enumerate() {
        if on_gpu(k) {
            t.copy_from_slice(&untouched_host[k]);
        }
    }
    for round in 1..=5u64 {
        let stride = if round == 3 { 3 } else { 0 };
        mutate(&sim, &state, round, stride);
        let (addr, len, rep) = send(&sim, &mut tx);
        assert_eq!(rep.full, round == 3, "round {round}");
        let bytes = bytes_at(&sim, addr, len);
        // The host's copy corrupted: its stage rejects, the GPU's staged payload is dropped, nothing written.
        let mut bad = bytes.clone();
        bad[inside(&bytes)] ^= 0x10;
        let (gpu_before, host_before) = (contents(&sim, &mine), host.tensors.clone());
        assert_eq!(gpu.stage(addr, len).unwrap(), 10 * round);
        assert!(
            matches!(host.stage(&bad, 0), Err(PayloadError::Rejected { .. })),
            "round {round}"
        );
        assert_eq!(gpu.abort(), Some(10 * round));
        assert_eq!(
            (contents(&sim, &mine), &host.tensors),
            (gpu_before, &host_before)
        );
        // The intact payload: both stage, both commit.
        assert_eq!(gpu.stage(addr, len).unwrap(), 10 * round);
        assert_eq!(host.stage(&bytes, 0).unwrap(), 10 * round);
        assert_eq!(gpu.commit().unwrap(), 10 * round);
        assert_eq!(host.rx.commit().unwrap(), 10 * round);
        let want = contents(&sim, &state);
        let got_gpu = contents(&sim, &mine);
        for k in 0..SHAPES.len() {
            if on_gpu(k) {
                assert_eq!(got_gpu[k], want[k], "round {round}, tensor {k} on the GPU");
                assert_eq!(
                    host.tensors[k], untouched_host[k],
                    "round {round}, tensor {k} not the CPU's"
                );
            } else {
                assert_eq!(
                    host.tensors[k], want[k],
                    "round {round}, tensor {k} on the CPU"
                );
                assert_eq!(
                    got_gpu[k], untouched_gpu[k],
                    "round {round}, tensor {k} not the GPU's"
                );
            }
        }
        assert_eq!((gpu.sequence(), host.rx.sequence()), (round, round));
    }
}
