//! Weight syncers over torch tensors' memory: `NativeSyncer` (the crate end it became: an unready
//! `WeightSyncer`, a `SyncSender`, a `SyncReceiver` or a host-shared `Applier`), `Op` (one running init / sync /
//! apply / stage / commit / abort / flush, pumped by Python's async `send`/`recv` or run on rlsync's channel), and
//! the shm channel ends (`ShmSender`, `ShmReceiver`; the TCP ones are in `tcp.rs`).
//!
//! Per-call timeouts bound the crate end's channel waits (`set_bound`), or, over the caller's `send`/`recv`,
//! Python's awaits of them (`Op::time_out`); a timeout becomes `rlsync.Timeout` naming what the op awaited
//! (`Call`). A staged update (`stage`) waits in the syncer for `commit` / `abort`. On rlsync's channel receivers
//! report what they install, and the sender reads the reports (`acked_versions`, `sync(wait_applied)`).
//!
//! Tensors arrive as descriptions `(name, tensor, data_ptr, dtype, shape, strides, device)`; the crate checks
//! them and borrows their memory ([`BorrowedState`]), so the sender reads them in place and the receiver
//! installs in place (parameters keep their identity). An `Op` keeps the tensor objects alive while it runs.
//! The crate end moves into the op and comes back when it finishes (with its error, if any), so a rejected
//! payload leaves the syncer usable; a failed init leaves a fresh unready syncer.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use rlsync::config::schema::WeightSyncerConfig;
use rlsync_core::host_shared::{Applier, HostSharedError};
use rlsync_core::syncer::{
    PendingUpdate, SyncError, SyncOptions, SyncReceiver, SyncReport, SyncSender, WeightSyncer,
};
use rlsync_core::tensor::{BorrowedState, RawTensor, state_checksum};
use rlsync_core::transport::bridge::{self, BridgeIo, Payload, Pump, Step};
use rlsync_core::transport::{
    self, Peer, ShmConfig, ShmReceiver as CoreShmReceiver, ShmSender as CoreShmSender,
    TransportError as CoreTransportError,
};

use crate::device::{self, SharedSide};
use crate::errors::{
    Awaited, RlsyncError, borrow_error, find_timeout, gpu_error, host_shared_error, sync_error,
    timeout_error, transport_error,
};
use crate::runtime;

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<NativeSyncer>()?;
    m.add_class::<Op>()?;
    m.add_class::<ShmSender>()?;
    m.add_class::<ShmReceiver>()?;
    m.add_function(wrap_pyfunction!(shm_bind, m)?)?;
    m.add_function(wrap_pyfunction!(shm_connect, m)?)?;
    Ok(())
}

/// One tensor as the Python side describes it.
pub(crate) type Desc = (
    String,
    Py<PyAny>,
    usize,
    String,
    Vec<usize>,
    Vec<i64>,
    String,
);

/// Borrow the described tensors; the returned objects keep them alive.
pub(crate) fn borrow(descs: Vec<Desc>) -> PyResult<(BorrowedState, Vec<Py<PyAny>>)> {
    let mut raws = Vec::with_capacity(descs.len());
    let mut keep = Vec::with_capacity(descs.len());
    for (name, obj, addr, dtype, shape, strides, device) in descs {
        raws.push(RawTensor {
            name,
            addr,
            dtype,
            shape,
            strides,
            device,
        });
        keep.push(obj);
    }
    // SAFETY: the memory belongs to the tensor objects in `keep`, which every caller holds for as long as the
    // state lives (an `Op` owns both). The Python API documents that the tensors must not be used elsewhere
    // while an operation on them runs (it runs while the caller awaits it).
    let st = unsafe { BorrowedState::new(&raws) }.map_err(|e| borrow_error(&e))?;
    Ok((st, keep))
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The channel a syncer was initialised with.
enum Channel {
    /// Not initialised yet.
    None,
    /// Bytes carried by the caller's `send`/`recv`.
    Bridge(BridgeIo),
    /// rlsync's own channel, shared memory or TCP (ops run to completion on the runtime).
    Shm,
}

/// The Rust end a `NativeSyncer` is: Python's one `WeightSyncer` object becomes either end at init.
// One per Python syncer, moved only in and out of an op: boxing the large sender would buy nothing.
#[allow(clippy::large_enum_variant)]
enum End {
    /// Configured, not initialised yet.
    Unready(WeightSyncer),
    Sender(SyncSender),
    Receiver(SyncReceiver),
    /// A host-shared receiver: installs into an arena the host's readers share (`rlsync.host_shared`).
    Applier(Box<Applier>),
}

/// Which end the syncer is (for the messages and the `end` getter).
#[derive(PartialEq, Eq, Clone, Copy)]
enum EndKind {
    Uninit,
    Sender,
    Receiver,
    Applier,
}

impl EndKind {
    fn name(self) -> &'static str {
        match self {
            EndKind::Uninit => "uninitialised",
            EndKind::Sender => "sender",
            EndKind::Receiver => "receiver",
            EndKind::Applier => "host-shared receiver",
        }
    }
}

impl End {
    fn kind(&self) -> EndKind {
        match self {
            End::Unready(_) => EndKind::Uninit,
            End::Sender(_) => EndKind::Sender,
            End::Receiver(_) => EndKind::Receiver,
            End::Applier(_) => EndKind::Applier,
        }
    }

    fn version(&self) -> u64 {
        match self {
            End::Unready(_) => 0,
            End::Sender(s) => s.version(),
            End::Receiver(r) => r.version(),
            End::Applier(a) => a.active().map_or(0, |h| h.version),
        }
    }
}

/// Where the end is: here (boxed: it is large, and moves into and out of every op), held by a running op, or
/// lost with an op abandoned midway (`kind`: its kind).
enum Slot {
    Ready(Box<End>),
    Busy {
        op: &'static str,
        kind: EndKind,
    },
    Lost {
        kind: EndKind,
    },
    /// A sender that handed its sends over to device payloads (`retire`; Python's syncer routes there).
    Moved {
        kind: EndKind,
    },
}

impl Slot {
    fn kind(&self) -> EndKind {
        match self {
            Slot::Ready(end) => end.kind(),
            Slot::Busy { kind, .. } | Slot::Lost { kind } | Slot::Moved { kind } => *kind,
        }
    }
}

struct Inner {
    end: Slot,
    channel: Channel,
    /// Canonical keys of the state dict at init, in order: later calls must pass the same state dict layout.
    keys: Vec<String>,
    report: Option<SyncReport>,
    /// The device side, once the state dict had CUDA tensors.
    device: Option<SharedSide>,
    /// The caller's current CUDA stream for the next operation (`use_stream`; 0: the legacy default stream).
    stream: u64,
    /// Receiver: the update `stage` received and verified, waiting for `commit` or `abort`.
    staged: Option<PendingUpdate>,
}

/// A crate syncer (patch | bucket) for torch tensors; see `rlsync.WeightSyncer` for the Python API.
#[pyclass(module = "rlsync._native", frozen)]
pub struct NativeSyncer {
    inner: Mutex<Inner>,
    /// The settings, for a fresh unready syncer after a failed init (the init consumed the last one).
    config: WeightSyncerConfig,
    options: SyncOptions,
}

/// What an op hands back when it finishes.
struct OpOut {
    /// `None` when a failed init consumed the unready syncer.
    end: Option<End>,
    /// `None` for an op that moves no version (`flush`).
    result: Result<Option<SyncReport>, SyncError>,
    /// What `stage` received, kept for `commit` / `abort`.
    staged: Option<PendingUpdate>,
    /// A host-shared end's own failure (not the weight channel's), raised instead of `result`'s.
    host: Option<HostSharedError>,
}

/// Which call an op runs, and what it is about (for `rlsync.Timeout`'s attributes).
#[derive(Clone, Copy)]
enum Call {
    InitSender,
    InitReceiver,
    /// `apply` / `stage`: the next version after `after`.
    Receive {
        after: u64,
    },
    Sync {
        version: u64,
    },
    Flush {
        version: u64,
    },
    /// `commit` / `abort`.
    Staged,
}

impl Call {
    /// The far end of the caller's own transport (the bridge), named when its `send`/`recv` times out.
    fn far(self) -> Peer {
        match self {
            Call::InitReceiver | Call::Receive { .. } | Call::Staged => Peer::Sender,
            Call::InitSender | Call::Sync { .. } | Call::Flush { .. } => Peer::Receiver(0),
        }
    }

    /// What a wait of this call that timed out (`op`, on `peer`, after `timeout`) was awaiting.
    fn awaited(self, op: &str, peer: &Peer, timeout: Duration) -> Awaited {
        let ranks = match peer {
            Peer::Receiver(r) => vec![*r],
            Peer::Receivers(rs) => rs.clone(),
            Peer::Sender | Peer::Node(_) => Vec::new(),
        };
        let (what, version) = match self {
            Call::InitSender | Call::InitReceiver => {
                (format!("{op} during init, from {peer}"), None)
            }
            Call::Receive { after } => (
                format!("payload of version after {after} from {peer}"),
                None,
            ),
            Call::Sync { version } if op.contains("reports") => (
                format!("ack of version {version} from {peer}"),
                Some(version),
            ),
            Call::Sync { version } => (
                format!("{op} of version {version}, waiting on {peer}"),
                Some(version),
            ),
            Call::Flush { version } => (
                format!("release of every payload up to version {version} by {peer}"),
                Some(version),
            ),
            Call::Staged => (format!("{op}, waiting on {peer}"), None),
        };
        Awaited {
            what,
            ranks,
            version,
            seconds: timeout.as_secs_f64(),
        }
    }
}

/// A per-call bound from Python (`None`: the channel's own).
fn bound(timeout: Option<f64>) -> PyResult<Option<Duration>> {
    timeout.map(self::timeout).transpose()
}

type BoxedOp = Pin<Box<dyn Future<Output = OpOut> + Send>>;

enum Driver {
    Bridge(Pump<OpOut>),
    Blocking(BoxedOp),
}

impl NativeSyncer {
    /// Take the end out for op `what`, which needs an end of kind `kind` (`pick` takes that kind apart); an
    /// error if it is another kind, another op runs or one was abandoned.
    fn take<T>(
        &self,
        what: &'static str,
        kind: EndKind,
        pick: fn(Box<End>) -> Result<T, Box<End>>,
    ) -> PyResult<T> {
        let mut g = lock(&self.inner);
        if g.end.kind() != kind {
            return Err(wrong_end(what, kind));
        }
        match std::mem::replace(&mut g.end, Slot::Busy { op: what, kind }) {
            Slot::Ready(end) => pick(end).map_err(|end| {
                g.end = Slot::Ready(end);
                wrong_end(what, kind)
            }),
            other => {
                let err = match &other {
                    Slot::Busy { op, .. } => RlsyncError::new_err(format!(
                        "another operation ({op}) is running on this syncer; await it first"
                    )),
                    Slot::Moved { .. } => RlsyncError::new_err(
                        "this sender's payloads are device payloads now (transport_device=cuda): its host end was released",
                    ),
                    _ => RlsyncError::new_err(
                        "this syncer was lost: an earlier operation on it was abandoned midway",
                    ),
                };
                g.end = other;
                Err(err)
            }
        }
    }

    /// An op's end comes back (a fresh unready syncer after a failed init).
    fn give_back(&self, end: Option<End>) -> PyResult<()> {
        let end = match end {
            Some(end) => end,
            None => End::Unready(
                WeightSyncer::from_config(&self.config, self.options)
                    .map_err(|e| sync_error(&e))?,
            ),
        };
        lock(&self.inner).end = Slot::Ready(Box::new(end));
        Ok(())
    }

    /// Stage an operation's tensors: CUDA ones are replaced by their host copies (see `device.rs`).
    fn stage(&self, tensors: Vec<Desc>) -> PyResult<(Vec<Desc>, Option<SharedSide>)> {
        let mut g = lock(&self.inner);
        let stream = g.stream;
        device::stage(tensors, &mut g.device, stream)
    }

    /// An op was abandoned without handing its end back.
    fn lose(&self) {
        let mut g = lock(&self.inner);
        let kind = g.end.kind();
        g.end = Slot::Lost { kind };
    }

    /// The tensors of a call matched by name to the keys seen at init, in init order (a state dict may list
    /// them in any order at every call); a key missing now, one not there at init, or one given twice is an
    /// error naming it.
    fn in_init_order(&self, tensors: Vec<Desc>) -> PyResult<Vec<Desc>> {
        let g = lock(&self.inner);
        in_order(tensors, &g.keys)
    }

    /// Record what an init is starting with: the state dict's keys (tied aliases included) and the channel.
    fn start_init(&self, names: Vec<String>, io: &Option<BridgeIo>) {
        let mut g = lock(&self.inner);
        g.keys = names;
        g.channel = match io {
            Some(io) => Channel::Bridge(io.clone()),
            None => Channel::Shm,
        };
    }

    /// The bridge handle for a call on an initialised end (None on the shm channel).
    fn io(&self) -> Option<BridgeIo> {
        match &lock(&self.inner).channel {
            Channel::Bridge(io) => Some(io.clone()),
            _ => None,
        }
    }
}

/// The crate end of an rlsync channel's sending end (`ShmSender` or `TcpSender`).
fn take_sender(c: &Bound<'_, PyAny>) -> PyResult<transport::Sender> {
    if let Ok(s) = c.cast::<ShmSender>() {
        return s.get().take();
    }
    if let Ok(s) = c.cast::<crate::tcp::TcpSender>() {
        return s.get().take();
    }
    Err(PyValueError::new_err(
        "channel must be an rlsync channel's sending end (ShmSender or TcpSender)",
    ))
}

/// The crate end of an rlsync channel's receiving end (`ShmReceiver` or `TcpReceiver`).
fn take_receiver(c: &Bound<'_, PyAny>) -> PyResult<transport::Receiver> {
    if let Ok(r) = c.cast::<ShmReceiver>() {
        return r.get().take();
    }
    if let Ok(r) = c.cast::<crate::tcp::TcpReceiver>() {
        return r.get().take();
    }
    Err(PyValueError::new_err(
        "channel must be an rlsync channel's receiving end (ShmReceiver or TcpReceiver)",
    ))
}

/// A receiver's channel: rlsync's own when `channel` is given, else a bridge whose bytes the caller's `recv`
/// carries (its `BridgeIo` is returned for the op to pump).
fn receiver_end(
    channel: Option<&Bound<'_, PyAny>>,
) -> PyResult<(transport::Receiver, Option<BridgeIo>)> {
    Ok(match channel {
        Some(c) => (take_receiver(c)?, None),
        None => {
            let (rx, io) = bridge::bridge_receiver();
            (rx, Some(io))
        }
    })
}

/// `tensors` in the order of `keys` (matched by name); a missing, unknown or repeated name is an error naming it.
fn in_order(tensors: Vec<Desc>, keys: &[String]) -> PyResult<Vec<Desc>> {
    let differs = |what: String| {
        PyValueError::new_err(format!(
            "the state dict differs from the one given at init: {what}"
        ))
    };
    if tensors.len() == keys.len() && tensors.iter().zip(keys).all(|(d, k)| d.0 == *k) {
        return Ok(tensors);
    }
    let position: std::collections::HashMap<&str, usize> = keys
        .iter()
        .enumerate()
        .map(|(i, k)| (k.as_str(), i))
        .collect();
    let mut slots: Vec<Option<Desc>> = (0..keys.len()).map(|_| None).collect();
    for d in tensors {
        let Some(&i) = position.get(d.0.as_str()) else {
            return Err(differs(format!("key '{}' was not there at init", d.0)));
        };
        if slots[i].is_some() {
            return Err(differs(format!("key '{}' is given twice", d.0)));
        }
        slots[i] = Some(d);
    }
    slots
        .into_iter()
        .zip(keys)
        .map(|(d, k)| d.ok_or_else(|| differs(format!("key '{k}' is missing"))))
        .collect()
}

/// The error of an acknowledgement call on the caller's own transport.
fn no_acks(what: &str) -> PyErr {
    RlsyncError::new_err(format!(
        "{what}: acknowledgements need an rlsync channel (shm_sender / shm_receiver); over your own \
         send/recv, have the receivers report their versions through your transport"
    ))
}

/// The error of op `what` on an end that is not of kind `kind`.
fn wrong_end(what: &str, kind: EndKind) -> PyErr {
    RlsyncError::new_err(match kind {
        EndKind::Uninit => "the syncer is already initialised".to_owned(),
        EndKind::Sender | EndKind::Receiver | EndKind::Applier => format!(
            "{what}: the syncer is not initialised as a {0} (call init_{0} first)",
            kind.name()
        ),
    })
}

fn applier(end: Box<End>) -> Result<Box<Applier>, Box<End>> {
    match *end {
        End::Applier(a) => Ok(a),
        end => Err(Box::new(end)),
    }
}

fn unready(end: Box<End>) -> Result<WeightSyncer, Box<End>> {
    match *end {
        End::Unready(syncer) => Ok(syncer),
        end => Err(Box::new(end)),
    }
}

fn sender(end: Box<End>) -> Result<SyncSender, Box<End>> {
    match *end {
        End::Sender(sender) => Ok(sender),
        end => Err(Box::new(end)),
    }
}

fn receiver(end: Box<End>) -> Result<SyncReceiver, Box<End>> {
    match *end {
        End::Receiver(receiver) => Ok(receiver),
        end => Err(Box::new(end)),
    }
}

fn make_op(
    owner: Py<NativeSyncer>,
    driver: Driver,
    io: Option<BridgeIo>,
    keep: Vec<Py<PyAny>>,
    call: Call,
) -> Op {
    Op {
        state: Mutex::new(Some(driver)),
        owner,
        io,
        _keep: keep,
        call,
    }
}

/// An op's output on an end it keeps.
fn out(end: End, result: Result<Option<SyncReport>, SyncError>) -> OpOut {
    OpOut {
        end: Some(end),
        result,
        staged: None,
        host: None,
    }
}

#[pymethods]
impl NativeSyncer {
    /// `config`: the JSON of an RLinf-shaped `weight_syncer` section (`{"type": "patch", "patch": {...}}`).
    #[new]
    #[pyo3(signature = (config, threads = 0))]
    fn new(config: &str, threads: usize) -> PyResult<Self> {
        let config: WeightSyncerConfig = serde_json::from_str(config)
            .map_err(|e| PyValueError::new_err(format!("weight_syncer config: {e}")))?;
        let options = SyncOptions { threads };
        let syncer = WeightSyncer::from_config(&config, options).map_err(|e| sync_error(&e))?;
        Ok(NativeSyncer {
            inner: Mutex::new(Inner {
                end: Slot::Ready(Box::new(End::Unready(syncer))),
                channel: Channel::None,
                keys: Vec::new(),
                report: None,
                device: None,
                stream: 0,
                staged: None,
            }),
            config,
            options,
        })
    }

    /// Start the sender's init: handshake (+ patch init bootstrap). `channel`: an `ShmSender`, or `None` for
    /// the caller's `send`/`recv` (pump the returned op with `step`).
    /// `described_after` (bucket, the caller's `send` only): no handshake, every version carries its manifest
    /// (RLinf's bucket `init_sender` without `recv`); its first sync follows that sequence.
    #[pyo3(signature = (tensors, keys_to_sync, channel = None, same_keys = true, described_after = None, timeout = None))]
    fn begin_init_sender(
        slf: &Bound<'_, Self>,
        tensors: Vec<Desc>,
        keys_to_sync: Vec<String>,
        channel: Option<&Bound<'_, PyAny>>,
        same_keys: bool,
        described_after: Option<u64>,
        timeout: Option<f64>,
    ) -> PyResult<Op> {
        let this = slf.get();
        this.expect(EndKind::Uninit, "init")?;
        let bound = bound(timeout)?;
        let names = tensors.iter().map(|d| d.0.clone()).collect();
        let (tensors, dev) = this.stage(tensors)?;
        let (st, keep) = borrow(tensors)?;
        let keys = st.fold_keys(&keys_to_sync).map_err(|e| borrow_error(&e))?;
        let (mut ch, io) = match channel {
            Some(c) => (take_sender(c)?, None),
            None => {
                let (tx, io) = bridge::bridge_sender();
                (tx, Some(io))
            }
        };
        ch.set_bound(bound);
        let mut syncer = this.take("init_sender", EndKind::Uninit, unready)?;
        syncer.require_same_keys(same_keys);
        this.start_init(names, &io);
        let fut = async move {
            if let Err(e) = device::pull(&dev) {
                return out(End::Unready(syncer), Err(e.into()));
            }
            let made = match described_after {
                Some(after) => {
                    syncer
                        .init_sender_described(&st.state, &keys, ch, after)
                        .await
                }
                None => syncer.init_sender(&st.state, &keys, ch).await,
            };
            match made {
                Ok((mut end, report)) => {
                    end.set_bound(None);
                    device::attach_builder(&dev, &mut end, &st.state);
                    device::attach_stager(&dev, &mut end);
                    out(End::Sender(end), Ok(Some(report)))
                }
                Err(e) => OpOut {
                    end: None,
                    result: Err(e),
                    staged: None,
                    host: None,
                },
            }
        };
        Ok(op_for(slf, fut, io, keep, Call::InitSender))
    }

    /// Start the receiver's init: send metadata, receive the plan and (patch) the init bootstrap.
    /// `described` (bucket, the caller's `recv` only): no handshake, each version's manifest says what comes
    /// (RLinf's bucket `init_receiver` without `send`).
    /// On rlsync's channel the receiver reports each installed version upstream (`acked_versions`).
    #[pyo3(signature = (tensors, channel = None, described = false, timeout = None))]
    fn begin_init_receiver(
        slf: &Bound<'_, Self>,
        tensors: Vec<Desc>,
        channel: Option<&Bound<'_, PyAny>>,
        described: bool,
        timeout: Option<f64>,
    ) -> PyResult<Op> {
        let this = slf.get();
        let bound = bound(timeout)?;
        this.expect(EndKind::Uninit, "init")?;
        let names = tensors.iter().map(|d| d.0.clone()).collect();
        let (tensors, dev) = this.stage(tensors)?;
        let (mut st, keep) = borrow(tensors)?;
        let (mut ch, io) = receiver_end(channel)?;
        ch.set_bound(bound);
        let reports = io.is_none();
        let syncer = this.take("init_receiver", EndKind::Uninit, unready)?;
        this.start_init(names, &io);
        let fut = async move {
            if let Err(e) = device::pull(&dev) {
                return out(End::Unready(syncer), Err(e.into()));
            }
            // A receiver that joined an elastic channel late (a restart, or after the sender started) is
            // caught up from the sender's replay log or by a full transfer at its next sync.
            let made = if described {
                syncer.init_receiver_described(&st.state, ch).await
            } else if ch.joined_late() {
                syncer
                    .rejoin_receiver(&mut st.state, ch, 0)
                    .await
                    .map(|(end, r)| {
                        let report = SyncReport {
                            version: end.version(),
                            payload_bytes: r.payload_bytes,
                            ..SyncReport::default()
                        };
                        (end, report)
                    })
            } else {
                syncer.init_receiver(&mut st.state, ch).await
            };
            match made {
                Ok((mut end, report)) => match device::push(&dev) {
                    Ok(()) => {
                        end.set_bound(None);
                        end.set_reports(reports);
                        device::attach_installer(&dev, &end);
                        out(End::Receiver(end), Ok(Some(report)))
                    }
                    Err(e) => out(End::Receiver(end), Err(e.into())),
                },
                Err(e) => OpOut {
                    end: None,
                    result: Err(e),
                    staged: None,
                    host: None,
                },
            }
        };
        Ok(op_for(slf, fut, io, keep, Call::InitReceiver))
    }

    /// Start the init of a host-shared receiver: create arena `name` laid out like `tensors` (their values
    /// fill both buffers), then the handshake and init bootstrap into it, published as version 0 (`verify`:
    /// with the state checksum). The tensors are only the template: the caller binds its model to a
    /// `HostSharedReader`'s views afterwards.
    #[pyo3(signature = (tensors, name, channel = None, max_readers = 64, verify = true, timeout = None))]
    fn begin_init_host_shared(
        slf: &Bound<'_, Self>,
        tensors: Vec<Desc>,
        name: String,
        channel: Option<&Bound<'_, PyAny>>,
        max_readers: usize,
        verify: bool,
        timeout: Option<f64>,
    ) -> PyResult<Op> {
        let this = slf.get();
        let bound = bound(timeout)?;
        this.expect(EndKind::Uninit, "init")?;
        let names = tensors.iter().map(|d| d.0.clone()).collect();
        let (tensors, dev) = this.stage(tensors)?;
        if dev.is_some() {
            return Err(PyValueError::new_err(
                "host_shared: the arena holds CPU weights; pass a CPU model to init_receiver",
            ));
        }
        let (st, keep) = borrow(tensors)?;
        let mut applier =
            Applier::create(&name, &st.state, max_readers).map_err(|e| host_shared_error(&e))?;
        let (mut ch, io) = receiver_end(channel)?;
        ch.set_bound(bound);
        let syncer = this.take("init_receiver", EndKind::Uninit, unready)?;
        this.start_init(names, &io);
        let fut = async move {
            match applier.init(syncer, ch, 0, verify).await {
                Ok(published) => {
                    if let Some(r) = applier.receiver_mut() {
                        r.set_bound(None);
                    }
                    out(End::Applier(Box::new(applier)), Ok(Some(published.report)))
                }
                // The arena goes with the applier; the syncer may init again (a fresh unready end).
                Err(e) => OpOut {
                    end: None,
                    result: Ok(None),
                    staged: None,
                    host: Some(e),
                },
            }
        };
        Ok(op_for(slf, fut, io, keep, Call::InitReceiver))
    }

    /// Start one host-shared apply: wait (up to `wait` seconds) for the back buffer, receive the next version
    /// (bounded by `timeout`, `None`: the channel's bound), install it into the arena and publish it. A
    /// rejected payload or a wait that runs out changes nothing the arena's readers see.
    #[pyo3(signature = (wait, timeout = None))]
    fn begin_apply_host_shared(
        slf: &Bound<'_, Self>,
        wait: f64,
        timeout: Option<f64>,
    ) -> PyResult<Op> {
        let this = slf.get();
        this.expect(EndKind::Applier, "apply")?;
        let bound = bound(timeout)?;
        let wait = self::timeout(wait)?;
        let mut applier = this.take("apply", EndKind::Applier, applier)?;
        let fut = async move {
            if let Some(r) = applier.receiver_mut() {
                r.set_bound(bound);
            }
            let result = applier.apply(wait).await;
            if let Some(r) = applier.receiver_mut() {
                r.set_bound(None);
            }
            match result {
                Ok(published) => out(End::Applier(applier), Ok(Some(published.report))),
                Err(HostSharedError::Sync { source, .. }) => {
                    out(End::Applier(applier), Err(source))
                }
                Err(e) => OpOut {
                    end: Some(End::Applier(applier)),
                    result: Ok(None),
                    staged: None,
                    host: Some(e),
                },
            }
        };
        let after = this.version();
        Ok(op_for(
            slf,
            fut,
            this.io(),
            Vec::new(),
            Call::Receive { after },
        ))
    }

    /// The host-shared arena's name (`None`: not a host-shared receiver).
    #[getter]
    fn host_shared(&self) -> Option<String> {
        match &lock(&self.inner).end {
            Slot::Ready(end) => match end.as_ref() {
                End::Applier(a) => Some(a.name().to_owned()),
                _ => None,
            },
            _ => None,
        }
    }

    /// Start one sync of `version` (sender); with `wait_applied` it ends once every live receiver reported
    /// installing it (rlsync's channel only). `timeout` bounds the whole call (`None`: the channel's bound).
    #[pyo3(signature = (tensors, version, timeout = None, wait_applied = false))]
    fn begin_sync(
        slf: &Bound<'_, Self>,
        tensors: Vec<Desc>,
        version: u64,
        timeout: Option<f64>,
        wait_applied: bool,
    ) -> PyResult<Op> {
        let this = slf.get();
        this.expect(EndKind::Sender, "sync")?;
        let bound = bound(timeout)?;
        let on_channel = this.io().is_none();
        if wait_applied && !on_channel {
            return Err(no_acks("sync(wait=\"applied\")"));
        }
        let tensors = this.in_init_order(tensors)?;
        let (tensors, dev) = this.stage(tensors)?;
        let (st, keep) = borrow(tensors)?;
        let mut sender = this.take("sync", EndKind::Sender, sender)?;
        let fut = async move {
            // A device build reads the CUDA tensors themselves, and so does a device bucket pack (unless a
            // rejoin or the kept copy of the last version needs the host view); the host path reads copies.
            if !device::on_device(&dev)
                && sender.needs_host_view()
                && let Err(e) = device::pull(&dev)
            {
                return out(End::Sender(sender), Err(e.into()));
            }
            sender.set_bound(bound);
            // Take the receivers' reports so far (on rlsync's channel), so they never pile up unread.
            let polled = match on_channel {
                true => sender.poll_reports(),
                false => Ok(()),
            };
            // Receivers that joined an elastic channel since the last sync are caught up first.
            let caught_up = match polled {
                Ok(()) => sender.rejoin_joined(&st.state).await.map(drop),
                Err(e) => Err(e),
            };
            let mut result = match caught_up {
                Ok(()) => sender.sync(&st.state, version).await,
                Err(e) => Err(e),
            };
            if wait_applied && let Ok(report) = result {
                result = sender.wait_applied().await.map(|()| report);
            }
            sender.set_bound(None);
            out(End::Sender(sender), result.map(Some))
        };
        Ok(op_for(slf, fut, this.io(), keep, Call::Sync { version }))
    }

    /// Start one receive + install (receiver); the op's result is the applied version. `timeout` bounds the
    /// whole call (`None`: the channel's bound).
    #[pyo3(signature = (tensors, timeout = None))]
    fn begin_apply(
        slf: &Bound<'_, Self>,
        tensors: Vec<Desc>,
        timeout: Option<f64>,
    ) -> PyResult<Op> {
        let this = slf.get();
        this.expect(EndKind::Receiver, "apply")?;
        let bound = bound(timeout)?;
        this.refuse_staged("apply")?;
        let tensors = this.in_init_order(tensors)?;
        let (tensors, dev) = this.stage(tensors)?;
        let (mut st, keep) = borrow(tensors)?;
        let mut receiver = this.take("apply", EndKind::Receiver, receiver)?;
        let fut = async move {
            // A device install writes the CUDA tensors themselves; the host path writes their copies, which
            // are pulled first (tensors the version does not cover keep their values) and pushed after. Only
            // a version that was installed is pushed (a rejected one left the host copies untouched).
            let host = !device::on_device(&dev);
            if host && let Err(e) = device::pull(&dev) {
                return out(End::Receiver(receiver), Err(e.into()));
            }
            receiver.set_bound(bound);
            let result = receiver.apply(&mut st.state).await;
            receiver.set_bound(None);
            let result = result.and_then(|report| match host {
                true => device::push(&dev).map(|()| report).map_err(SyncError::Gpu),
                false => Ok(report),
            });
            out(End::Receiver(receiver), result.map(Some))
        };
        let after = this.version();
        Ok(op_for(slf, fut, this.io(), keep, Call::Receive { after }))
    }

    /// Start receiving and verifying the next version without touching the model (receiver); it is kept
    /// staged for `begin_commit` / `begin_abort`. The op's result is the staged version.
    #[pyo3(signature = (timeout = None))]
    fn begin_stage(slf: &Bound<'_, Self>, timeout: Option<f64>) -> PyResult<Op> {
        let this = slf.get();
        this.expect(EndKind::Receiver, "stage")?;
        let bound = bound(timeout)?;
        this.refuse_staged("stage")?;
        let mut receiver = this.take("stage", EndKind::Receiver, receiver)?;
        let fut = async move {
            receiver.set_bound(bound);
            let result = receiver.receive().await;
            receiver.set_bound(None);
            match result {
                Ok(pending) => OpOut {
                    result: Ok(Some(SyncReport {
                        version: pending.version(),
                        ..pending.report().clone()
                    })),
                    end: Some(End::Receiver(receiver)),
                    staged: Some(pending),
                    host: None,
                },
                Err(e) => out(End::Receiver(receiver), Err(e)),
            }
        };
        let after = this.version();
        Ok(op_for(
            slf,
            fut,
            this.io(),
            Vec::new(),
            Call::Receive { after },
        ))
    }

    /// Start installing the staged version into `tensors` in place (receiver); the op's result is its version.
    fn begin_commit(slf: &Bound<'_, Self>, tensors: Vec<Desc>) -> PyResult<Op> {
        let this = slf.get();
        this.expect(EndKind::Receiver, "commit")?;
        let tensors = this.in_init_order(tensors)?;
        let (tensors, dev) = this.stage(tensors)?;
        let (mut st, keep) = borrow(tensors)?;
        let pending = this.take_staged("commit")?;
        let mut receiver = match this.take("commit", EndKind::Receiver, receiver) {
            Ok(r) => r,
            Err(e) => {
                lock(&this.inner).staged = Some(pending);
                return Err(e);
            }
        };
        let fut = async move {
            let host = !device::on_device(&dev);
            if host && let Err(e) = device::pull(&dev) {
                return OpOut {
                    end: Some(End::Receiver(receiver)),
                    result: Err(e.into()),
                    staged: Some(pending),
                    host: None,
                };
            }
            let result = receiver.commit(pending, &mut st.state).await;
            let result = result.and_then(|report| match host {
                true => device::push(&dev).map(|()| report).map_err(SyncError::Gpu),
                false => Ok(report),
            });
            out(End::Receiver(receiver), result.map(Some))
        };
        Ok(op_for(slf, fut, this.io(), keep, Call::Staged))
    }

    /// Start dropping the staged version (receiver) and, on rlsync's channel, telling the sender `reason`.
    fn begin_abort(slf: &Bound<'_, Self>, reason: String) -> PyResult<Op> {
        let this = slf.get();
        this.expect(EndKind::Receiver, "abort")?;
        let pending = this.take_staged("abort")?;
        let mut receiver = match this.take("abort", EndKind::Receiver, receiver) {
            Ok(r) => r,
            Err(e) => {
                lock(&this.inner).staged = Some(pending);
                return Err(e);
            }
        };
        let fut = async move {
            receiver.decline(pending, &reason).await;
            out(End::Receiver(receiver), Ok(None))
        };
        Ok(op_for(slf, fut, this.io(), Vec::new(), Call::Staged))
    }

    /// The version staged by `stage` and not yet committed or aborted (`None`: nothing is staged).
    #[getter]
    fn staged_version(&self) -> Option<u64> {
        lock(&self.inner)
            .staged
            .as_ref()
            .map(PendingUpdate::version)
    }

    /// Sender on rlsync's channel: the version each live receiver reported installing last, by rank.
    fn acked_versions(&self) -> PyResult<std::collections::BTreeMap<usize, u64>> {
        self.with_reports("acked_versions", |s| {
            s.acked()
                .into_iter()
                .map(|(r, st)| (r, st.version))
                .collect()
        })
    }

    /// Sender on rlsync's channel: how many staged updates each receiver aborted, by rank.
    fn rejections(&self) -> PyResult<std::collections::BTreeMap<usize, u64>> {
        self.with_reports("rejections", |s| s.declined().0.into_iter().collect())
    }

    /// Sender on rlsync's channel: the last aborted update as `(rank, version, reason)`, if any.
    fn last_rejection(&self) -> PyResult<Option<(usize, u64, String)>> {
        self.with_reports("last_rejection", |s| {
            s.declined()
                .1
                .map(|d| (d.rank, d.version, d.reason.clone()))
        })
    }

    /// Start waiting until every receiver has released every payload published so far (sender on rlsync's
    /// shm channel; on the caller's transport there is nothing in flight that rlsync holds).
    #[pyo3(signature = (timeout = None))]
    fn begin_flush(slf: &Bound<'_, Self>, timeout: Option<f64>) -> PyResult<Op> {
        let this = slf.get();
        let bound = bound(timeout)?;
        let mut sender = this.take("flush", EndKind::Sender, sender)?;
        let version = sender.version();
        let fut = async move {
            sender.set_bound(bound);
            let result = sender.flush().await.map(|()| None);
            sender.set_bound(None);
            out(End::Sender(sender), result)
        };
        Ok(op_for(
            slf,
            fut,
            this.io(),
            Vec::new(),
            Call::Flush { version },
        ))
    }

    /// The caller's current CUDA stream (`torch.cuda.current_stream(device).cuda_stream`) for the next
    /// operations on CUDA tensors: their copies and kernels are ordered after the work queued on it.
    fn use_stream(&self, stream: u64) {
        lock(&self.inner).stream = stream;
    }

    /// Sender: the last version sent. Receiver: the applied version. 0 before the first sync.
    #[getter]
    fn version(&self) -> u64 {
        match &lock(&self.inner).end {
            Slot::Ready(end) => end.version(),
            _ => 0,
        }
    }

    /// Sender: the sequence number of the last sync. Receiver: that of the applied one. 0 before the first.
    #[getter]
    fn sequence(&self) -> u64 {
        match &lock(&self.inner).end {
            Slot::Ready(end) => match end.as_ref() {
                End::Sender(s) => s.sequence(),
                End::Receiver(r) => r.sequence(),
                End::Applier(a) => a.active().map_or(0, |h| h.sequence),
                End::Unready(_) => 0,
            },
            Slot::Busy { .. } | Slot::Lost { .. } | Slot::Moved { .. } => 0,
        }
    }

    /// `"sender"`, `"receiver"` or `"uninitialised"`.
    #[getter]
    fn end(&self) -> &'static str {
        lock(&self.inner).end.kind().name()
    }

    /// Whether the syncer was initialised on rlsync's shm channel (else on the caller's send/recv).
    #[getter]
    fn on_shm(&self) -> bool {
        matches!(lock(&self.inner).channel, Channel::Shm)
    }

    /// The synced keys (canonical names of tied groups), known after init.
    #[getter]
    fn synced_keys(&self) -> Vec<String> {
        match &lock(&self.inner).end {
            Slot::Ready(end) => match end.as_ref() {
                End::Sender(s) => s.synced_keys().to_vec(),
                End::Receiver(r) => r.synced_keys().to_vec(),
                End::Applier(a) => a.synced_keys().to_vec(),
                End::Unready(_) => Vec::new(),
            },
            Slot::Busy { .. } | Slot::Lost { .. } | Slot::Moved { .. } => Vec::new(),
        }
    }

    /// Sender: the receivers' dtype of each synced key (`synced_keys`' order), known after init.
    #[getter]
    fn synced_dtypes(&self) -> Vec<String> {
        match &lock(&self.inner).end {
            Slot::Ready(end) => match end.as_ref() {
                End::Sender(s) => s.synced_dtypes().iter().map(|d| d.name().into()).collect(),
                _ => Vec::new(),
            },
            _ => Vec::new(),
        }
    }

    /// Sender over the caller's `send`/`recv`: hand the sends over to device payloads. The crate sender (its
    /// host snapshot) and the host copies of CUDA tensors are released; every later call on this end is an
    /// error saying so. Returns the (sequence, version) the receivers hold.
    fn retire(&self) -> PyResult<(u64, u64)> {
        let mut g = lock(&self.inner);
        if !matches!(g.channel, Channel::Bridge(_)) {
            return Err(RlsyncError::new_err(
                "device payloads are for a sender over the caller's send/recv, not rlsync's channels",
            ));
        }
        let held = match &g.end {
            Slot::Ready(end) => match end.as_ref() {
                End::Sender(s) => (s.sequence(), s.version()),
                _ => return Err(wrong_end("device payloads", EndKind::Sender)),
            },
            _ => return Err(wrong_end("device payloads", EndKind::Sender)),
        };
        g.end = Slot::Moved {
            kind: EndKind::Sender,
        };
        g.device = None;
        g.staged = None;
        Ok(held)
    }

    /// xxh3 checksum of the synced keys as the receivers hold them (sender) or hold them (receiver). CUDA
    /// tensors are hashed on the GPU where the checksum is the state's (receivers; a bucket sender without
    /// casts); a patch sender's is of its snapshot, and a casting bucket sender's reads the host copies.
    fn checksum(&self, tensors: Vec<Desc>) -> PyResult<u64> {
        let (tensors, dev) = self.stage(tensors)?;
        let (st, _keep) = borrow(tensors)?;
        let g = lock(&self.inner);
        let Slot::Ready(end) = &g.end else {
            return Err(RlsyncError::new_err(
                "an operation is running on this syncer",
            ));
        };
        let of_state = match end.as_ref() {
            End::Sender(s) => s.checksum_as_state(&st.state),
            End::Receiver(r) => Some(r.synced_keys()),
            End::Applier(a) => Some(a.synced_keys()),
            End::Unready(_) => return Err(not_initialised()),
        };
        if let Some(keys) = of_state
            && let Some(sum) = device::checksum(&dev, &st.state, keys)
        {
            return sum.map_err(|e| gpu_error(&e));
        }
        match end.as_ref() {
            End::Sender(s) => {
                if s.checksum_reads_state() {
                    device::pull(&dev).map_err(|e| gpu_error(&e))?;
                }
                s.checksum(&st.state).map_err(|e| sync_error(&e))
            }
            End::Receiver(r) => Ok(r.checksum(&st.state)),
            End::Applier(a) => Ok(state_checksum(&st.state, a.synced_keys())),
            End::Unready(_) => Err(not_initialised()),
        }
    }

    /// Sizes and timings of the last finished operation, as a dict (empty before the first).
    fn last_report<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        let g = lock(&self.inner);
        if let Some(r) = &g.report {
            // Where the tensors were: "cpu", or "cuda (…)" saying what ran on the device (`device::Mode`).
            let device = match &g.device {
                None => "cpu",
                Some(_) => device::mode(&g.device).label(),
            };
            d.set_item("device", device)?;
            d.set_item("version", r.version)?;
            d.set_item("kind", r.kind.name())?;
            d.set_item("payload_bytes", r.payload_bytes)?;
            d.set_item("changed", r.changed)?;
            d.set_item("state_bytes", r.state_bytes)?;
            d.set_item("tensors", r.tensors)?;
            d.set_item("messages", r.messages)?;
            d.set_item("build_s", r.build.as_secs_f64())?;
            d.set_item("encode_s", r.encode.as_secs_f64())?;
            d.set_item("transfer_s", r.transfer.as_secs_f64())?;
            d.set_item("decode_s", r.decode.as_secs_f64())?;
            d.set_item("apply_s", r.apply.as_secs_f64())?;
            d.set_item("compression_ratio", r.compression_ratio)?;
        }
        Ok(d)
    }
}

impl NativeSyncer {
    /// `apply` / `stage` while a version is staged: refused (commit or abort it first).
    fn refuse_staged(&self, what: &str) -> PyResult<()> {
        match &lock(&self.inner).staged {
            Some(p) => Err(RlsyncError::new_err(format!(
                "{what}: version {} is staged; commit() or abort() it first",
                p.version()
            ))),
            None => Ok(()),
        }
    }

    /// The staged update, for `commit` / `abort`; an error when nothing is staged.
    fn take_staged(&self, what: &str) -> PyResult<PendingUpdate> {
        lock(&self.inner).staged.take().ok_or_else(|| {
            RlsyncError::new_err(format!("{what}: no version is staged (call stage() first)"))
        })
    }

    /// Read the receivers' reports on the sender's end (rlsync's channel only), then `read` them.
    fn with_reports<T>(&self, what: &str, read: impl FnOnce(&SyncSender) -> T) -> PyResult<T> {
        if self.io().is_some() {
            return Err(no_acks(what));
        }
        let mut g = lock(&self.inner);
        if g.end.kind() != EndKind::Sender {
            return Err(wrong_end(what, EndKind::Sender));
        }
        let Slot::Ready(end) = &mut g.end else {
            return Err(RlsyncError::new_err(format!(
                "{what}: an operation is running on this syncer; await it first"
            )));
        };
        let End::Sender(s) = end.as_mut() else {
            return Err(wrong_end(what, EndKind::Sender));
        };
        s.poll_reports().map_err(|e| sync_error(&e))?;
        Ok(read(s))
    }

    /// A call for `kind`'s end (sync, apply): refused before its tensors are looked at when this is another end.
    fn expect(&self, kind: EndKind, what: &str) -> PyResult<()> {
        if lock(&self.inner).end.kind() == kind {
            return Ok(());
        }
        Err(wrong_end(what, kind))
    }
}

fn op_for(
    slf: &Bound<'_, NativeSyncer>,
    fut: impl Future<Output = OpOut> + Send + 'static,
    io: Option<BridgeIo>,
    keep: Vec<Py<PyAny>>,
    call: Call,
) -> Op {
    let driver = match &io {
        Some(io) => {
            io.reset();
            Driver::Bridge(Pump::new(fut, io.clone()))
        }
        None => Driver::Blocking(Box::pin(fut)),
    };
    make_op(slf.clone().unbind(), driver, io, keep, call)
}

/// A running init / sync / apply. Bridge ops: call `step()` until it returns `("done", version)`; on
/// `("send", payload)` await the caller's `send(payload)` then `sent()`, on `("recv", None)` await `recv()`
/// then `deliver(payload)`. Shm ops: call `run()` (blocks, without the GIL, until done).
#[pyclass(module = "rlsync._native", frozen)]
pub struct Op {
    /// `None` once finished.
    state: Mutex<Option<Driver>>,
    owner: Py<NativeSyncer>,
    io: Option<BridgeIo>,
    /// The tensors whose memory the op reads or writes.
    _keep: Vec<Py<PyAny>>,
    call: Call,
}

impl Op {
    fn busy(&self) -> PyResult<MutexGuard<'_, Option<Driver>>> {
        self.state
            .try_lock()
            .map_err(|_| RlsyncError::new_err("this operation is being driven from another thread"))
    }

    fn io(&self) -> PyResult<&BridgeIo> {
        self.io.as_ref().ok_or_else(|| {
            RlsyncError::new_err("this operation runs on the shm channel: call run()")
        })
    }

    /// Return the end to its owner and turn the result into the applied / sent version; a timeout becomes
    /// `rlsync.Timeout` naming what was awaited.
    fn finish(&self, py: Python<'_>, out: OpOut) -> PyResult<u64> {
        let owner = self.owner.get();
        let OpOut {
            end,
            result,
            staged,
            host,
        } = out;
        owner.give_back(end)?;
        if let Some(e) = host {
            return Err(host_shared_error(&e));
        }
        if staged.is_some() {
            lock(&owner.inner).staged = staged;
        }
        match result {
            Ok(Some(report)) => {
                let v = report.version;
                lock(&owner.inner).report = Some(report);
                Ok(v)
            }
            Ok(None) => Ok(owner.version()),
            Err(e) => Err(self.error(py, &e)),
        }
    }

    fn error(&self, py: Python<'_>, err: &SyncError) -> PyErr {
        match find_timeout(err) {
            Some(CoreTransportError::Timeout { op, peer, timeout }) => timeout_error(
                py,
                crate::errors::chain(err),
                self.call.awaited(op, peer, *timeout),
            ),
            _ => sync_error(err),
        }
    }
}

impl Drop for Op {
    /// An op dropped midway (its driver gave up) is ended cleanly, so the end comes back to its owner; one
    /// that cannot be ended loses it.
    fn drop(&mut self) {
        let state = self.state.get_mut().unwrap_or_else(|p| p.into_inner());
        let owner = self.owner.get();
        match (state.take(), &self.io) {
            (None, _) => {}
            (Some(Driver::Bridge(mut pump)), Some(io)) => {
                io.fail("the operation was abandoned");
                match pump.step() {
                    Ok(Step::Done(out)) => {
                        if owner.give_back(out.end).is_err() {
                            owner.lose();
                        }
                    }
                    _ => owner.lose(),
                }
            }
            (Some(_), _) => owner.lose(),
        }
    }
}

/// A payload handed in from Python: a `bytes` object read in place (kept alive until the crate is done).
struct PyPayload {
    _obj: Py<PyBytes>,
    ptr: *const u8,
    len: usize,
}

// SAFETY: a `bytes` object is immutable and `_obj` keeps it alive, so its buffer may be read from any thread.
unsafe impl Send for PyPayload {}

impl Payload for PyPayload {
    fn bytes(&self) -> &[u8] {
        // SAFETY: see the `Send` impl: the buffer of the live, immutable bytes object.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

#[pymethods]
impl Op {
    /// Run until the op needs the caller: `("send", bytes)`, `("recv", None)` or `("done", version)`.
    /// Raises the op's error when it finishes with one (the syncer stays usable).
    fn step(&self, py: Python<'_>) -> PyResult<(&'static str, Py<PyAny>)> {
        let mut g = self.busy()?;
        let Some(Driver::Bridge(pump)) = g.as_mut() else {
            return match g.as_ref() {
                None => Err(RlsyncError::new_err("this operation already finished")),
                Some(_) => Err(RlsyncError::new_err(
                    "this operation runs on the shm channel: call run()",
                )),
            };
        };
        let step = py.detach(|| pump.step());
        match step {
            Ok(Step::Send(msg)) => Ok(("send", PyBytes::new(py, &msg).into_any().unbind())),
            Ok(Step::Recv) => Ok(("recv", py.None())),
            Ok(Step::Done(out)) => {
                *g = None;
                drop(g);
                let v = self.finish(py, out)?;
                Ok(("done", v.into_pyobject(py)?.into_any().unbind()))
            }
            Err(e) => {
                // The op's future is gone, and the end with it.
                *g = None;
                self.owner.get().lose();
                Err(transport_error(&e))
            }
        }
    }

    /// The caller's `send` of the last `("send", ...)` payload completed.
    fn sent(&self) -> PyResult<()> {
        self.io()?.sent();
        Ok(())
    }

    /// Hand in what the caller's `recv` returned (a `bytes` object, read in place).
    fn deliver(&self, payload: Bound<'_, PyBytes>) -> PyResult<()> {
        let bytes = payload.as_bytes();
        let p = PyPayload {
            ptr: bytes.as_ptr(),
            len: bytes.len(),
            _obj: payload.unbind(),
        };
        self.io()?.deliver(Box::new(p));
        Ok(())
    }

    /// The caller's transport failed: the op ends with a transport error naming `reason` at its next step.
    fn fail(&self, reason: String) -> PyResult<()> {
        self.io()?.fail(reason);
        Ok(())
    }

    /// Whether the op finished (successfully or not).
    #[getter]
    fn finished(&self) -> bool {
        self.state.try_lock().map(|g| g.is_none()).unwrap_or(false)
    }

    /// Run a shm-channel op to completion (the GIL is released while it runs); returns the version.
    fn run(&self, py: Python<'_>) -> PyResult<u64> {
        let mut g = self.busy()?;
        let Some(Driver::Blocking(_)) = g.as_ref() else {
            return Err(RlsyncError::new_err(
                "this operation is not a shm-channel operation (or already finished): use step()",
            ));
        };
        let Some(Driver::Blocking(fut)) = g.take() else {
            return Err(RlsyncError::new_err("this operation already finished"));
        };
        drop(g);
        let rt = runtime::get()?;
        let out = py.detach(|| rt.block_on(fut));
        self.finish(py, out)
    }

    /// The caller gave up awaiting its `send`/`recv` after `seconds`: the op ends (at its next `step`) with
    /// `rlsync.Timeout` naming the far end; the syncer stays usable.
    fn time_out(&self, seconds: f64) -> PyResult<()> {
        let t = Duration::try_from_secs_f64(seconds).unwrap_or(Duration::ZERO);
        self.io()?.time_out(self.call.far(), t);
        Ok(())
    }
}

/// The sending end of rlsync's shared-memory channel (1 -> N receivers on this host), before a syncer
/// takes it over at `init_sender`.
#[pyclass(module = "rlsync._native", frozen)]
pub struct ShmSender {
    end: Mutex<Option<transport::Sender>>,
    receivers: usize,
}

/// A receiving end of rlsync's shared-memory channel, before a syncer takes it over at `init_receiver`.
#[pyclass(module = "rlsync._native", frozen)]
pub struct ShmReceiver {
    end: Mutex<Option<transport::Receiver>>,
    rank: usize,
}

impl ShmSender {
    fn take(&self) -> PyResult<transport::Sender> {
        lock(&self.end).take().ok_or_else(|| {
            RlsyncError::new_err(
                "this ShmSender is already used by a syncer (one syncer per channel)",
            )
        })
    }
}

impl ShmReceiver {
    fn take(&self) -> PyResult<transport::Receiver> {
        lock(&self.end).take().ok_or_else(|| {
            RlsyncError::new_err(
                "this ShmReceiver is already used by a syncer (one syncer per channel)",
            )
        })
    }
}

#[pymethods]
impl ShmSender {
    #[getter]
    fn receivers(&self) -> usize {
        self.receivers
    }
}

#[pymethods]
impl ShmReceiver {
    #[getter]
    fn rank(&self) -> usize {
        self.rank
    }
}

pub(crate) fn timeout(seconds: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(seconds)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| {
            PyValueError::new_err(format!(
                "timeout must be a positive number of seconds, got {seconds}"
            ))
        })
}

/// Bind the shm channel's socket at `socket_path` and wait (GIL released) until all `receivers` joined.
/// With `elastic`, receivers may go and (re)join later (caught up at the next sync), and the bind returns once
/// `wait_for` of them joined (default: all).
#[pyfunction]
#[pyo3(signature = (socket_path, receivers, timeout_s = 60.0, slots = 4, segment_prefix = "rlsync".to_string(), elastic = false, wait_for = None))]
#[allow(clippy::too_many_arguments)]
fn shm_bind(
    py: Python<'_>,
    socket_path: std::path::PathBuf,
    receivers: usize,
    timeout_s: f64,
    slots: usize,
    segment_prefix: String,
    elastic: bool,
    wait_for: Option<usize>,
) -> PyResult<ShmSender> {
    if receivers == 0 {
        return Err(PyValueError::new_err("receivers must be at least 1"));
    }
    let cfg = ShmConfig {
        socket_path,
        segment_prefix,
        receivers,
        timeout: timeout(timeout_s)?,
        slots,
        elastic,
        ..ShmConfig::default()
    };
    let wait_for = wait_for.unwrap_or(receivers);
    let rt = runtime::get()?;
    let end = py
        .detach(|| rt.block_on(CoreShmSender::bind_waiting_for(cfg, wait_for)))
        .map_err(|e| transport_error(&e))?;
    Ok(ShmSender {
        end: Mutex::new(Some(end)),
        receivers,
    })
}

/// Join the shm channel at `socket_path` as receiver `rank` (GIL released while connecting).
#[pyfunction]
#[pyo3(signature = (socket_path, rank, timeout_s = 60.0))]
fn shm_connect(
    py: Python<'_>,
    socket_path: std::path::PathBuf,
    rank: usize,
    timeout_s: f64,
) -> PyResult<ShmReceiver> {
    let t = timeout(timeout_s)?;
    let rt = runtime::get()?;
    let end = py
        .detach(|| rt.block_on(CoreShmReceiver::connect(&socket_path, rank, t)))
        .map_err(|e| transport_error(&e))?;
    Ok(ShmReceiver {
        end: Mutex::new(Some(end)),
        rank,
    })
}

/// An operation on a syncer that neither `init_sender` nor `init_receiver` has set up.
fn not_initialised() -> PyErr {
    RlsyncError::new_err("the syncer is not initialised (call init_sender or init_receiver first)")
}
