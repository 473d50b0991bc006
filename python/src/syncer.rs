//! Weight syncers over torch tensors' memory: `NativeSyncer` (one crate `WeightSyncer`), `Op` (one running
//! init / sync / apply, pumped by Python's async `send`/`recv` or run on the shm channel), and the shm
//! channel ends (`ShmSender`, `ShmReceiver`).
//!
//! Tensors arrive as descriptions `(name, tensor, data_ptr, dtype, shape, strides, device)`; the crate checks
//! them and borrows their memory ([`BorrowedState`]), so the sender reads them in place and the receiver
//! installs in place (parameters keep their identity). An `Op` keeps the tensor objects alive while it runs.
//! The crate syncer moves into the op and comes back when it finishes (with its error, if any), so a rejected
//! payload leaves the syncer usable.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use rlsync::config::schema::WeightSyncerConfig;
use rlsync_core::syncer::{SyncError, SyncOptions, SyncReport, WeightSyncer};
use rlsync_core::tensor::{BorrowedState, RawTensor};
use rlsync_core::transport::bridge::{self, BridgeIo, Payload, Pump, Step};
use rlsync_core::transport::{
    self, ShmConfig, ShmReceiver as CoreShmReceiver, ShmSender as CoreShmSender,
};

use crate::errors::{RlsyncError, borrow_error, sync_error, transport_error};
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
    /// rlsync's shared-memory channel (ops run to completion on the runtime).
    Shm,
}

#[derive(PartialEq, Eq, Clone, Copy)]
enum Role {
    Uninit,
    Sender,
    Receiver,
}

struct Inner {
    /// The crate syncer; `None` while an op runs (it owns it then) or after an op was abandoned.
    syncer: Option<WeightSyncer>,
    channel: Channel,
    role: Role,
    /// Canonical keys of the state dict at init, in order: later calls must pass the same state dict layout.
    keys: Vec<String>,
    report: Option<SyncReport>,
    busy: &'static str,
}

/// A crate `WeightSyncer` (patch | bucket) for torch tensors; see `rlsync.WeightSyncer` for the Python API.
#[pyclass(module = "rlsync._native", frozen)]
pub struct NativeSyncer {
    inner: Mutex<Inner>,
}

/// What an op hands back when it finishes.
struct OpOut {
    syncer: WeightSyncer,
    /// `None` for an op that moves no version (`flush`).
    result: Result<Option<SyncReport>, SyncError>,
}

type BoxedOp = Pin<Box<dyn Future<Output = OpOut> + Send>>;

enum Driver {
    Bridge(Pump<OpOut>),
    Blocking(BoxedOp),
}

impl NativeSyncer {
    /// Take the crate syncer out for an op (error if another op runs or one was abandoned).
    fn take(&self, what: &'static str) -> PyResult<WeightSyncer> {
        let mut g = lock(&self.inner);
        match g.syncer.take() {
            Some(s) => {
                g.busy = what;
                Ok(s)
            }
            None if g.busy.is_empty() => Err(RlsyncError::new_err(
                "this syncer was lost: an earlier operation on it was abandoned midway",
            )),
            None => Err(RlsyncError::new_err(format!(
                "another operation ({}) is running on this syncer; await it first",
                g.busy
            ))),
        }
    }

    fn give_back(&self, syncer: WeightSyncer) {
        let mut g = lock(&self.inner);
        g.syncer = Some(syncer);
        g.busy = "";
    }

    /// The keys of `st` must be those seen at init.
    fn check_keys(&self, st: &BorrowedState) -> PyResult<()> {
        let g = lock(&self.inner);
        let keys: Vec<&str> = st.state.keys().collect();
        if keys.len() == g.keys.len() && keys.iter().zip(&g.keys).all(|(a, b)| a == b) {
            return Ok(());
        }
        let first = keys
            .iter()
            .zip(&g.keys)
            .position(|(a, b)| a != b)
            .unwrap_or_else(|| keys.len().min(g.keys.len()));
        let got = keys.get(first).map_or("<end>", |k| k);
        let want = g.keys.get(first).map_or("<end>", String::as_str);
        Err(PyValueError::new_err(format!(
            "the state dict differs from the one given at init: key #{first} is '{got}', expected '{want}'"
        )))
    }
}

fn make_op(
    owner: Py<NativeSyncer>,
    driver: Driver,
    io: Option<BridgeIo>,
    keep: Vec<Py<PyAny>>,
) -> Op {
    Op {
        state: Mutex::new(Some(driver)),
        owner,
        io,
        _keep: keep,
    }
}

#[pymethods]
impl NativeSyncer {
    /// `config`: the JSON of an RLinf-shaped `weight_syncer` section (`{"type": "patch", "patch": {...}}`).
    #[new]
    #[pyo3(signature = (config, threads = 0))]
    fn new(config: &str, threads: usize) -> PyResult<Self> {
        let cfg: WeightSyncerConfig = serde_json::from_str(config)
            .map_err(|e| PyValueError::new_err(format!("weight_syncer config: {e}")))?;
        let syncer =
            WeightSyncer::from_config(&cfg, SyncOptions { threads }).map_err(|e| sync_error(&e))?;
        Ok(NativeSyncer {
            inner: Mutex::new(Inner {
                syncer: Some(syncer),
                channel: Channel::None,
                role: Role::Uninit,
                keys: Vec::new(),
                report: None,
                busy: "",
            }),
        })
    }

    /// Start the sender's init: handshake (+ patch init bootstrap). `channel`: an `ShmSender`, or `None` for
    /// the caller's `send`/`recv` (pump the returned op with `step`).
    #[pyo3(signature = (tensors, keys_to_sync, channel = None, same_keys = true))]
    fn begin_init_sender(
        slf: &Bound<'_, Self>,
        tensors: Vec<Desc>,
        keys_to_sync: Vec<String>,
        channel: Option<&Bound<'_, ShmSender>>,
        same_keys: bool,
    ) -> PyResult<Op> {
        let this = slf.get();
        if lock(&this.inner).role != Role::Uninit {
            return Err(RlsyncError::new_err("the syncer is already initialised"));
        }
        let (st, keep) = borrow(tensors)?;
        let keys = st.fold_keys(&keys_to_sync).map_err(|e| borrow_error(&e))?;
        let (ch, io) = match channel {
            Some(c) => (c.get().take()?, None),
            None => {
                let (tx, io) = bridge::bridge_sender();
                (tx, Some(io))
            }
        };
        let mut syncer = this.take("init_sender")?;
        syncer.require_same_keys(same_keys);
        {
            let mut g = lock(&this.inner);
            g.role = Role::Sender;
            g.keys = st.state.keys().map(str::to_string).collect();
            g.channel = match &io {
                Some(io) => Channel::Bridge(io.clone()),
                None => Channel::Shm,
            };
        }
        let fut = async move {
            let result = syncer.init_sender(&st.state, &keys, ch).await;
            OpOut {
                syncer,
                result: result.map(Some),
            }
        };
        Ok(op_for(slf, fut, io, keep))
    }

    /// Start the receiver's init: send metadata, receive the plan and (patch) the init bootstrap.
    #[pyo3(signature = (tensors, channel = None))]
    fn begin_init_receiver(
        slf: &Bound<'_, Self>,
        tensors: Vec<Desc>,
        channel: Option<&Bound<'_, ShmReceiver>>,
    ) -> PyResult<Op> {
        let this = slf.get();
        if lock(&this.inner).role != Role::Uninit {
            return Err(RlsyncError::new_err("the syncer is already initialised"));
        }
        let (mut st, keep) = borrow(tensors)?;
        let (ch, io) = match channel {
            Some(c) => (c.get().take()?, None),
            None => {
                let (rx, io) = bridge::bridge_receiver();
                (rx, Some(io))
            }
        };
        let mut syncer = this.take("init_receiver")?;
        {
            let mut g = lock(&this.inner);
            g.role = Role::Receiver;
            g.keys = st.state.keys().map(str::to_string).collect();
            g.channel = match &io {
                Some(io) => Channel::Bridge(io.clone()),
                None => Channel::Shm,
            };
        }
        let fut = async move {
            let result = syncer.init_receiver(&mut st.state, ch).await;
            OpOut {
                syncer,
                result: result.map(Some),
            }
        };
        Ok(op_for(slf, fut, io, keep))
    }

    /// Start one sync of `version` (sender).
    fn begin_sync(slf: &Bound<'_, Self>, tensors: Vec<Desc>, version: u64) -> PyResult<Op> {
        let this = slf.get();
        let io = this.io_for(Role::Sender, "sync")?;
        let (st, keep) = borrow(tensors)?;
        this.check_keys(&st)?;
        let mut syncer = this.take("sync")?;
        let fut = async move {
            let result = syncer.sync(&st.state, version).await;
            OpOut {
                syncer,
                result: result.map(Some),
            }
        };
        Ok(op_for(slf, fut, io, keep))
    }

    /// Start one receive + install (receiver); the op's result is the applied version.
    fn begin_apply(slf: &Bound<'_, Self>, tensors: Vec<Desc>) -> PyResult<Op> {
        let this = slf.get();
        let io = this.io_for(Role::Receiver, "apply")?;
        let (mut st, keep) = borrow(tensors)?;
        this.check_keys(&st)?;
        let mut syncer = this.take("apply")?;
        let fut = async move {
            let result = syncer.apply(&mut st.state).await;
            OpOut {
                syncer,
                result: result.map(Some),
            }
        };
        Ok(op_for(slf, fut, io, keep))
    }

    /// Start waiting until every receiver has released every payload published so far (sender on rlsync's
    /// shm channel; on the caller's transport there is nothing in flight that rlsync holds).
    fn begin_flush(slf: &Bound<'_, Self>) -> PyResult<Op> {
        let this = slf.get();
        let io = this.io_for(Role::Sender, "flush")?;
        let mut syncer = this.take("flush")?;
        let fut = async move {
            let result = syncer.flush().await.map(|()| None);
            OpOut { syncer, result }
        };
        Ok(op_for(slf, fut, io, Vec::new()))
    }

    /// Sender: the last version sent. Receiver: the applied version. 0 before the first sync.
    #[getter]
    fn version(&self) -> u64 {
        lock(&self.inner)
            .syncer
            .as_ref()
            .map_or(0, WeightSyncer::version)
    }

    /// `"sender"`, `"receiver"` or `"uninitialised"`.
    #[getter]
    fn role(&self) -> &'static str {
        match lock(&self.inner).role {
            Role::Uninit => "uninitialised",
            Role::Sender => "sender",
            Role::Receiver => "receiver",
        }
    }

    /// Whether the syncer was initialised on rlsync's shm channel (else on the caller's send/recv).
    #[getter]
    fn on_shm(&self) -> bool {
        matches!(lock(&self.inner).channel, Channel::Shm)
    }

    /// The synced keys (canonical names of tied groups), known after init.
    #[getter]
    fn synced_keys(&self) -> Vec<String> {
        lock(&self.inner)
            .syncer
            .as_ref()
            .map_or_else(Vec::new, |s| s.synced_keys().to_vec())
    }

    /// xxh3 checksum of the synced keys as the receivers hold them (sender) or hold them (receiver).
    fn checksum(&self, tensors: Vec<Desc>) -> PyResult<u64> {
        let (st, _keep) = borrow(tensors)?;
        let g = lock(&self.inner);
        let s = g
            .syncer
            .as_ref()
            .ok_or_else(|| RlsyncError::new_err("an operation is running on this syncer"))?;
        s.checksum(&st.state).map_err(|e| sync_error(&e))
    }

    /// Sizes and timings of the last finished operation, as a dict (empty before the first).
    fn last_report<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        if let Some(r) = &lock(&self.inner).report {
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
    /// The bridge handle for a call on `role` (None on the shm channel).
    fn io_for(&self, role: Role, what: &str) -> PyResult<Option<BridgeIo>> {
        let g = lock(&self.inner);
        if g.role != role {
            let expected = if role == Role::Sender {
                "sender"
            } else {
                "receiver"
            };
            return Err(RlsyncError::new_err(format!(
                "{what}: the syncer is not initialised as a {expected} (call init_{expected} first)"
            )));
        }
        Ok(match &g.channel {
            Channel::Bridge(io) => Some(io.clone()),
            _ => None,
        })
    }
}

fn op_for(
    slf: &Bound<'_, NativeSyncer>,
    fut: impl Future<Output = OpOut> + Send + 'static,
    io: Option<BridgeIo>,
    keep: Vec<Py<PyAny>>,
) -> Op {
    let driver = match &io {
        Some(io) => {
            io.reset();
            Driver::Bridge(Pump::new(fut, io.clone()))
        }
        None => Driver::Blocking(Box::pin(fut)),
    };
    make_op(slf.clone().unbind(), driver, io, keep)
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

    /// Return the syncer to its owner and turn the result into the applied / sent version.
    fn finish(&self, out: OpOut) -> PyResult<u64> {
        let owner = self.owner.get();
        let OpOut { syncer, result } = out;
        owner.give_back(syncer);
        match result {
            Ok(Some(report)) => {
                let v = report.version;
                lock(&owner.inner).report = Some(report);
                Ok(v)
            }
            Ok(None) => Ok(owner.version()),
            Err(e) => Err(sync_error(&e)),
        }
    }
}

impl Drop for Op {
    /// An op dropped midway (its driver gave up) is ended cleanly, so the syncer comes back to its owner.
    fn drop(&mut self) {
        let state = self.state.get_mut().unwrap_or_else(|p| p.into_inner());
        if let (Some(Driver::Bridge(pump)), Some(io)) = (state.as_mut(), &self.io) {
            io.fail("the operation was abandoned");
            if let Ok(Step::Done(out)) = pump.step() {
                self.owner.get().give_back(out.syncer);
            }
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
                let v = self.finish(out)?;
                Ok(("done", v.into_pyobject(py)?.into_any().unbind()))
            }
            Err(e) => {
                *g = None;
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
        self.finish(out)
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

fn timeout(seconds: f64) -> PyResult<Duration> {
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
#[pyfunction]
#[pyo3(signature = (socket_path, receivers, timeout_s = 60.0, slots = 4, segment_prefix = "rlsync".to_string()))]
fn shm_bind(
    py: Python<'_>,
    socket_path: std::path::PathBuf,
    receivers: usize,
    timeout_s: f64,
    slots: usize,
    segment_prefix: String,
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
        ..ShmConfig::default()
    };
    let rt = runtime::get()?;
    let end = py
        .detach(|| rt.block_on(CoreShmSender::bind(cfg)))
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
