//! The syncer over caller-owned memory and a caller-pumped bridge, as the Python binding drives it: tensors
//! borrowed zero-copy and updated in place, payloads carried by the test (as Python's `send`/`recv` would),
//! tied aliases synced once, a corrupt payload rejected with weights and version untouched.

use std::collections::VecDeque;

use rlsync::config::schema::{SyncerKind, WeightSyncerConfig};
use rlsync_core::syncer::{SyncOptions, WeightSyncer};
use rlsync_core::tensor::{BorrowedState, RawTensor};
use rlsync_core::transport::bridge::{BridgeIo, Pump, Step, bridge_receiver, bridge_sender};

fn raw(name: &str, data: &mut [f32], shape: &[usize]) -> RawTensor {
    let mut strides = vec![1i64; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * shape[i + 1] as i64;
    }
    RawTensor {
        name: name.into(),
        addr: data.as_mut_ptr() as usize,
        dtype: "float32".into(),
        shape: shape.to_vec(),
        strides,
        device: "cpu".into(),
    }
}

/// Two tensors, the first tied under a second name.
fn describe(w: &mut [f32], b: &mut [f32]) -> Vec<RawTensor> {
    let tied = raw("head.weight", w, &[2, 3]);
    vec![raw("emb.weight", w, &[2, 3]), raw("b", b, &[3]), tied]
}

/// Run one operation on each side against each other, carrying payloads through in-memory queues; `tamper`
/// may change each downstream payload.
fn run_pair<A: Send + 'static, B: Send + 'static>(
    (mut a, a_io): (Pump<A>, BridgeIo),
    (mut b, b_io): (Pump<B>, BridgeIo),
    tamper: &mut dyn FnMut(&mut Vec<u8>),
) -> (A, B) {
    let (mut down, mut up): (VecDeque<Vec<u8>>, VecDeque<Vec<u8>>) = Default::default();
    let (mut ra, mut rb, mut a_wait, mut b_wait) = (None, None, false, false);
    for _ in 0..10_000 {
        if ra.is_none() && (!a_wait || !up.is_empty()) {
            if a_wait {
                a_io.deliver(Box::new(up.pop_front().unwrap()));
                a_wait = false;
            }
            match a.step().unwrap() {
                Step::Send(mut m) => {
                    tamper(&mut m);
                    down.push_back(m);
                    a_io.sent();
                }
                Step::Recv => a_wait = true,
                Step::Done(v) => ra = Some(v),
            }
        }
        if rb.is_none() && (!b_wait || !down.is_empty()) {
            if b_wait {
                b_io.deliver(Box::new(down.pop_front().unwrap()));
                b_wait = false;
            }
            match b.step().unwrap() {
                Step::Send(m) => {
                    up.push_back(m);
                    b_io.sent();
                }
                Step::Recv => b_wait = true,
                Step::Done(v) => rb = Some(v),
            }
        }
        if ra.is_some() && rb.is_some() {
            break;
        }
    }
    (ra.expect("sender finished"), rb.expect("receiver finished"))
}

#[test]
fn patch_over_a_bridge_installs_in_place_and_rejects_a_corrupt_payload() {
    let cfg = WeightSyncerConfig {
        kind: SyncerKind::Patch,
        ..WeightSyncerConfig::default()
    };
    let (mut tw, mut tb) = (vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], vec![0.5f32; 3]);
    let (mut rw, mut rb) = (vec![0.0f32; 6], vec![0.0f32; 3]);
    let rw_ptr = rw.as_ptr();
    // SAFETY: the vectors outlive every state built over them and are only touched between operations.
    let tx_state = unsafe { BorrowedState::new(&describe(&mut tw, &mut tb)) }.unwrap();
    // SAFETY: as above, for the receiver's vectors.
    let rx_state = unsafe { BorrowedState::new(&describe(&mut rw, &mut rb)) }.unwrap();
    let keys = tx_state
        .fold_keys(&["head.weight".into(), "b".into(), "emb.weight".into()])
        .unwrap();
    assert_eq!(keys, vec!["emb.weight", "b"]);

    let tx = WeightSyncer::from_config(&cfg, SyncOptions::default()).unwrap();
    let rx = WeightSyncer::from_config(&cfg, SyncOptions::default()).unwrap();
    let (tch, tio) = bridge_sender();
    let (rch, rio) = bridge_receiver();
    let mut rx_state = rx_state;
    let a = Pump::new(
        async move {
            let r = tx.init_sender(&tx_state.state, &keys, tch).await;
            (tx_state, r)
        },
        tio.clone(),
    );
    let b = Pump::new(
        async move {
            let r = rx.init_receiver(&mut rx_state.state, rch).await;
            (rx_state, r)
        },
        rio.clone(),
    );
    let ((tx_state, r1), (rx_state, r2)) =
        run_pair((a, tio.clone()), (b, rio.clone()), &mut |_| {});
    let (mut tx, _) = r1.unwrap();
    let (mut rx, _) = r2.unwrap();
    drop((tx_state, rx_state));
    assert_eq!(
        rw, tw,
        "the init bootstrap wrote into the receiver's own memory"
    );
    assert_eq!(rw.as_ptr(), rw_ptr);

    // Version 1, corrupted on the way: rejected, nothing changes. The intact payload then applies.
    tw[4] += 1.0;
    tb[1] -= 2.0;
    let before = (rw.clone(), rb.clone());
    // SAFETY: as above.
    let ts = unsafe { BorrowedState::new(&describe(&mut tw, &mut tb)) }.unwrap();
    // SAFETY: as above, for the receiver's vectors.
    let mut rs = unsafe { BorrowedState::new(&describe(&mut rw, &mut rb)) }.unwrap();
    let a = Pump::new(
        async move {
            let r = tx.sync(&ts.state, 1).await;
            (tx, r)
        },
        tio.clone(),
    );
    let b = Pump::new(
        async move {
            let r = rx.apply(&mut rs.state).await;
            (rx, rs, r)
        },
        rio.clone(),
    );
    let mut intact = Vec::new();
    let mut tamper = |m: &mut Vec<u8>| {
        intact = m.clone();
        let mid = m.len() / 2;
        m[mid] ^= 0x40;
    };
    let ((tx, r1), (rx, rs, r2)) = run_pair((a, tio.clone()), (b, rio.clone()), &mut tamper);
    r1.unwrap();
    assert!(matches!(&r2, Err(e) if e.is_rejection()), "{r2:?}");
    assert_eq!(rx.version(), 0);
    drop(rs);
    assert_eq!(
        (rw.clone(), rb.clone()),
        before,
        "a rejected payload changes nothing"
    );

    let mut rx = rx;
    // SAFETY: as above.
    let mut rs = unsafe { BorrowedState::new(&describe(&mut rw, &mut rb)) }.unwrap();
    rio.reset();
    let mut b = Pump::new(
        async move {
            let r = rx.apply(&mut rs.state).await;
            (rx, r)
        },
        rio.clone(),
    );
    assert!(matches!(b.step().unwrap(), Step::Recv));
    rio.deliver(Box::new(intact));
    let Step::Done((rx, r)) = b.step().unwrap() else {
        panic!("expected the apply to finish");
    };
    assert_eq!(r.unwrap().version, 1);
    assert_eq!(rx.version(), 1);
    assert_eq!(tx.version(), 1);
    assert_eq!((&rw, &rb), (&tw, &tb));
    assert_eq!(rw.as_ptr(), rw_ptr);
}
