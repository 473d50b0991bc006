//! Python workers: `run_worker(argv, factory)` runs the crate's worker — handshake, weight channel, command
//! loop, verification, failure reports — with a workload whose compute is a Python object.
//!
//! The Python side (`rlsync.worker`) passes `factory(job_json, placement) -> adapter`; the adapter exposes
//! `describe() -> (tensor descriptions, synced names)`, `train(chunks) -> dict`, `rollout(steps, version) ->
//! (arrays, stats)`. Tensors are borrowed in place (see `syncer::borrow`), so the syncer installs straight
//! into the module's parameters; trajectories travel in the crate's named-array codec. In the host-shared mode
//! (`weight_syncer.host_shared`) a rollout's parameters are views of the host's shared buffer it holds instead,
//! rebound (`bind_shared`) when it flips to the other buffer between chunks. The GIL is released
//! while the crate runs and taken only for each call into the adapter. A model on a GPU
//! (`worker.device=cuda`): the state dict holds host copies of its CUDA tensors, refreshed only when the
//! runtime reads them ([`LazyHostCopies`]); the syncs work on the CUDA tensors themselves where the syncer can
//! (a patch build or install, a bucket pack or install with `bucket_device: cuda`).

use std::path::{Path, PathBuf};

use pyo3::call::PyCallArgs;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use rlsync::worker::host_copies::LazyHostCopies;
use rlsync::worker::workload::EpisodeMetrics;
use rlsync::worker::workload::{Batch, TrainStats, TrajectoryChunk, Workload, WorkloadError};
use rlsync::worker::{WorkerContext, WorkloadBuilder};
use rlsync_core::gpu::ipc::{ReceiverDevice, SenderDevice};
use rlsync_core::protocol::arrays::ChunkOrigin;
use rlsync_core::protocol::arrays::{self, NamedArray};
use rlsync_core::syncer::settings::Device;
use rlsync_core::syncer::{SyncReceiver, SyncSender};
use rlsync_core::tensor::{Class, DType, StateDict};

use crate::checkpoint;
use crate::device::{self, CudaCopies, SharedSide};
use crate::errors::{RlsyncError, chain};
use crate::syncer::{Desc, borrow};

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(run_worker, m)?)?;
    m.add_function(wrap_pyfunction!(encode_arrays, m)?)?;
    m.add_function(wrap_pyfunction!(decode_arrays, m)?)?;
    Ok(())
}

/// Lines of a Python traceback quoted in the failure the orchestrator prints (the whole traceback is in the
/// worker's log).
const TRACEBACK_LINES: usize = 8;

/// A Python exception as a workload error: the traceback goes to stderr (the worker's log) and its last lines
/// into the message.
fn foreign(py: Python<'_>, what: &str, err: PyErr) -> WorkloadError {
    let lines: Vec<String> = py
        .import("traceback")
        .and_then(|tb| tb.call_method1("format_exception", (err.clone_ref(py),)))
        .and_then(|list| list.extract::<Vec<String>>())
        .map(|parts| parts.concat().lines().map(str::to_owned).collect())
        .unwrap_or_else(|_| vec![err.to_string()]);
    eprintln!("{what} raised:\n{}", lines.join("\n"));
    let tail = &lines[lines.len().saturating_sub(TRACEBACK_LINES)..];
    WorkloadError::Foreign {
        message: format!("{what} raised:\n    {}", tail.join("\n    ")),
    }
}

/// A checkpoint error met by the Python trainer's save / restore, named as the Python trainer's.
fn trainer_error(err: rlsync::checkpoint::CheckpointError) -> WorkloadError {
    WorkloadError::Foreign {
        message: format!("Python trainer: {}", rlsync_core::error_chain(&err)),
    }
}

/// The user's Python object behind the crate's `Workload` trait.
struct PyWorkload {
    adapter: Py<PyAny>,
    /// The tensor objects whose memory the state dict borrows (kept alive as long as it).
    keep: Vec<Py<PyAny>>,
    rank: u32,
    next_chunk: u64,
    /// The model's CUDA tensors' host copies (a model on `worker.device=cuda`), which the runtime's state dict
    /// holds: pulled only when the runtime reads them after the device changed, pushed when it wrote them.
    /// A patch build or install on the device (and a device bucket pack or install) uses neither.
    device: Option<LazyHostCopies<CudaCopies>>,
    /// `weight_syncer.host_shared`: the address of the arena buffer `model()`'s tensors are views of now (the
    /// rollout runtime hands the held buffer's state to `rollout`/`evaluate`; a flip rebinds the views).
    shared: Option<Option<usize>>,
}

/// A device copy failed: the worker stops with the cause.
fn device_failed(what: &str, e: &rlsync_core::gpu::GpuError) -> WorkloadError {
    WorkloadError::Foreign {
        message: format!("{what}: {}", rlsync_core::error_chain(e)),
    }
}

impl PyWorkload {
    /// Host-shared mode: make `model()`'s tensors views of `state` (the arena buffer this rollout holds) when
    /// it is not the buffer they view already; the Parameter objects keep their identity (`.data` is swapped).
    fn bind_shared(&mut self, state: &StateDict) -> Result<(), WorkloadError> {
        let Some(bound) = self.shared else {
            return Ok(());
        };
        let at = state
            .iter()
            .next()
            .map(|(_, t)| t.bytes().as_ptr() as usize);
        if at.is_none() || at == bound {
            return Ok(());
        }
        let items: Vec<(String, usize, usize, &'static str, Vec<usize>)> = state
            .iter()
            .map(|(name, t)| {
                let bytes = t.bytes();
                (
                    name.to_owned(),
                    bytes.as_ptr() as usize,
                    bytes.len(),
                    t.dtype().name(),
                    t.shape().to_vec(),
                )
            })
            .collect();
        Python::attach(|py| {
            self.call(py, "bind_shared", (at.unwrap_or(0), items))?;
            Ok::<(), WorkloadError>(())
        })?;
        self.shared = Some(at);
        Ok(())
    }

    fn call<'py>(
        &self,
        py: Python<'py>,
        method: &str,
        args: impl PyCallArgs<'py>,
    ) -> Result<Bound<'py, PyAny>, WorkloadError> {
        self.adapter
            .bind(py)
            .call_method1(method, args)
            .map_err(|e| foreign(py, &format!("{method}()"), e))
    }
}

fn bad_return(what: &str, err: PyErr) -> WorkloadError {
    WorkloadError::Foreign {
        message: format!("{what} returned an unexpected value: {err}"),
    }
}

impl PyWorkload {
    /// The device side of a model on a GPU, for the same-host GPU channel.
    fn channel_side(&self) -> Result<SharedSide, WorkloadError> {
        match &self.device {
            Some(copies) => Ok(copies.copies().0.clone()),
            None => Err(WorkloadError::GpuChannel {
                reason: "the model has no CUDA tensor (`model()` moved to the worker's device, actor.worker.device / \
                         rollout.worker.device): the channel moves the synced tensors of one GPU"
                    .into(),
            }),
        }
    }
}

impl Workload for PyWorkload {
    fn init_state(&mut self) -> Result<StateDict, WorkloadError> {
        Python::attach(|py| {
            let out = self.call(py, "describe", ())?;
            let (descs, synced) = out
                .extract::<(Vec<Desc>, Vec<String>)>()
                .map_err(|e| bad_return("describe()", e))?;
            // CUDA tensors get host copies, the state dict the runtime reads; its syncs work on the tensors
            // themselves where they can (`attach_sender` / `attach_receiver`). The legacy default stream
            // orders every copy, build and install after the model's own work on torch's default stream (and the
            // adapter waits for the model's GPUs after each call of the user's code: `_Adapter._settle`).
            let mut side: Option<SharedSide> = None;
            let (descs, dev) =
                device::stage(descs, &mut side, 0).map_err(|e| WorkloadError::Foreign {
                    message: format!("the model's tensors cannot be synced: {}", e.value(py)),
                })?;
            self.device = dev.map(|side| LazyHostCopies::new(CudaCopies(side)));
            self.host_view()?;
            let (borrowed, keep) = borrow(descs).map_err(|e| WorkloadError::Foreign {
                message: format!("the model's tensors cannot be synced: {}", e.value(py)),
            })?;
            let synced = borrowed
                .fold_keys(&synced)
                .map_err(|e| WorkloadError::Foreign {
                    message: format!("the synced names: {e}"),
                })?;
            self.keep = keep;
            let mut state = borrowed.state;
            for (name, tensor) in state.iter_mut() {
                if !synced.iter().any(|s| s == name) {
                    tensor.set_class(Class::Frozen);
                }
            }
            Ok(state)
        })
    }

    fn train_step(
        &mut self,
        _state: &mut StateDict,
        batch: &Batch<'_>,
    ) -> Result<TrainStats, WorkloadError> {
        let chunks = arrays::decode_arrays(batch.data)?;
        Python::attach(|py| {
            let list = PyList::empty(py);
            for (_, arrays) in &chunks {
                let chunk = PyList::empty(py);
                for a in arrays {
                    let item = (a.name, a.dtype, a.shape.clone(), PyBytes::new(py, a.data));
                    chunk.append(item).map_err(|e| foreign(py, "train()", e))?;
                }
                list.append(chunk).map_err(|e| foreign(py, "train()", e))?;
            }
            let out = self.call(py, "train", (list,))?;
            let (loss, metrics) = out
                .extract::<(f64, Vec<(String, f64)>)>()
                .map_err(|e| bad_return("train()", e))?;
            if let Some(copies) = &mut self.device {
                copies.device_changed();
            }
            Ok(TrainStats { loss, metrics })
        })
    }

    fn rollout(
        &mut self,
        state: &StateDict,
        version: u64,
        steps: u32,
    ) -> Result<TrajectoryChunk, WorkloadError> {
        self.bind_shared(state)?;
        let origin = ChunkOrigin {
            rank: self.rank,
            chunk: self.next_chunk,
        };
        self.next_chunk += 1;
        Python::attach(|py| {
            let out = self.call(py, "rollout", (steps, version))?;
            let (items, env_steps, mean_return) = out
                .extract::<(Vec<PyArray>, u64, f64)>()
                .map_err(|e| bad_return("rollout()", e))?;
            let named = named_arrays(&items);
            Ok(TrajectoryChunk {
                env_steps,
                mean_return,
                data: arrays::encode_arrays(origin, &named)?,
            })
        })
    }

    fn evaluate(
        &mut self,
        state: &StateDict,
        _version: u64,
    ) -> Result<Option<EpisodeMetrics>, WorkloadError> {
        self.bind_shared(state)?;
        Python::attach(|py| {
            let out = self.call(py, "evaluate", ())?;
            if out.is_none() {
                return Ok(None);
            }
            let (episodes, ret, success_rate, episode_len) = out
                .extract::<(u64, f64, f64, f64)>()
                .map_err(|e| bad_return("evaluate()", e))?;
            Ok(Some(EpisodeMetrics {
                ret,
                success_rate,
                episode_len,
                episodes,
            }))
        })
    }

    /// A patch sender on the GPU (all synced tensors CUDA; floating ones in another dtype than the receivers'
    /// cast there first), or a bucket sender with
    /// `bucket_device: cuda` packing on the GPU.
    fn attach_sender(&mut self, sender: &mut SyncSender, state: &StateDict) -> Option<String> {
        let side = Some(self.device.as_ref()?.copies().0.clone());
        if device::attach_builder(&side, sender, state) {
            return Some(format!(
                "{}, snapshot copy in {} memory (weight_syncer.patch.snapshot_device)",
                device::mode(&side).label(),
                match sender.snapshot_device() {
                    Device::Cuda => "GPU",
                    Device::Cpu => "pinned host",
                }
            ));
        }
        device::attach_stager(&side, sender).then(|| device::mode(&side).label().to_owned())
    }

    /// A patch receiver whose synced tensors are all CUDA tensors, or a bucket receiver with
    /// `bucket_device: cuda`, installs into the CUDA tensors on the GPU.
    fn attach_receiver(&mut self, receiver: &SyncReceiver) -> Option<String> {
        let side = Some(self.device.as_ref()?.copies().0.clone());
        device::attach_installer(&side, receiver).then(|| device::mode(&side).label().to_owned())
    }

    /// The same-host GPU channel's sending device over the model's CUDA tensors.
    fn gpu_sender_device(
        &mut self,
        state: &StateDict,
        keys: &[String],
        dtypes: &[DType],
    ) -> Result<Box<dyn SenderDevice + Send>, WorkloadError> {
        let side = self.channel_side()?;
        device::channel_sender(&side, state, keys, dtypes)
            .map_err(|reason| WorkloadError::GpuChannel { reason })
    }

    /// The same-host GPU channel's receiving device, installing into the model's CUDA tensors.
    fn gpu_receiver_device(
        &mut self,
        _state: &StateDict,
        keys: &[String],
    ) -> Result<Box<dyn ReceiverDevice + Send>, WorkloadError> {
        let side = self.channel_side()?;
        device::channel_receiver(&side, keys)
            .map(|d| Box::new(d) as Box<dyn ReceiverDevice + Send>)
            .map_err(|reason| WorkloadError::GpuChannel { reason })
    }

    /// A model on a GPU is hashed there (no copy of the weights to the host per verified sync).
    fn weights_checksum(
        &mut self,
        state: &StateDict,
        keys: &[String],
    ) -> Result<Option<u64>, WorkloadError> {
        let Some(copies) = &self.device else {
            return Ok(None);
        };
        let side = Some(copies.copies().0.clone());
        device::checksum(&side, state, keys)
            .transpose()
            .map_err(|e| device_failed("hashing the model's CUDA tensors on the GPU", &e))
    }

    fn host_view(&mut self) -> Result<(), WorkloadError> {
        match &mut self.device {
            Some(copies) => copies
                .host_view()
                .map_err(|e| device_failed("copying the model's CUDA tensors to the host", &e)),
            None => Ok(()),
        }
    }

    fn weights_written(&mut self, on_device: bool) -> Result<(), WorkloadError> {
        match &mut self.device {
            Some(copies) => copies
                .written(on_device)
                .map_err(|e| device_failed("copying the synced weights to the CUDA tensors", &e)),
            None => Ok(()),
        }
    }

    /// The weights (`model.safetensors`, as for every workload), then the trainer's own `state_dict()`, if it
    /// defines one, in `optimizer.safetensors` next to them.
    fn save_checkpoint(
        &mut self,
        state: &StateDict,
        run_dir: &Path,
        step: u64,
        version: u64,
    ) -> Result<PathBuf, WorkloadError> {
        let dir = rlsync::checkpoint::save_weights(state, run_dir, step, version)
            .map_err(trainer_error)?;
        Python::attach(|py| {
            let out = self
                .adapter
                .bind(py)
                .call_method0("trainer_state")
                .map_err(|e| foreign(py, "state_dict()", e))?;
            if out.is_none() {
                return Ok(());
            }
            let (descs, structure) = out
                .extract::<(Vec<Desc>, String)>()
                .map_err(|e| bad_return("state_dict()", e))?;
            checkpoint::save(py, &dir, descs, structure, step, version).map_err(trainer_error)?;
            Ok::<(), WorkloadError>(())
        })?;
        Ok(dir)
    }

    /// The checkpoint's weights into `model()` (in place), then its trainer state into the trainer's
    /// `load_state_dict()`, before the bootstrap sync and the first step.
    fn restore(&mut self, state: &mut StateDict, dir: &Path) -> Result<(), WorkloadError> {
        rlsync::checkpoint::load_weights_into(state, dir).map_err(trainer_error)?;
        self.weights_written(false)?;
        let saved = checkpoint::load(dir).map_err(trainer_error)?;
        Python::attach(|py| {
            let (items, structure) = match saved {
                Some((items, structure)) => (
                    checkpoint::items_to_py(py, items)
                        .map_err(|e| foreign(py, "load_state_dict()", e))?
                        .into_any(),
                    Some(structure),
                ),
                None => (py.None().into_bound(py), None),
            };
            self.adapter
                .bind(py)
                .call_method1("load_trainer_state", (items, structure))
                .map_err(|e| foreign(py, "load_state_dict()", e))?;
            Ok(())
        })
    }
}

/// Run this process as an rlsync worker (`argv`: `--role R --rank N --run-dir D`), with the workload that
/// `factory(job_json: str, placement: dict)` returns. Blocks until the orchestrator says stop; raises
/// `RlsyncError` naming the cause when the worker fails (the orchestrator has been told).
#[pyfunction]
fn run_worker(py: Python<'_>, argv: Vec<String>, factory: Py<PyAny>) -> PyResult<()> {
    let builder: WorkloadBuilder = Box::new(move |ctx: &WorkerContext| {
        let place = ctx.placement();
        let job = serde_json::to_string(ctx.job()).map_err(|e| WorkloadError::Foreign {
            message: format!("the job config does not serialize: {e}"),
        })?;
        Python::attach(|py| {
            let placement = PyDict::new(py);
            let filled: PyResult<()> = (|| {
                placement.set_item("role", place.role.name())?;
                placement.set_item("rank", place.rank)?;
                placement.set_item("rollouts", place.rollouts)?;
                placement.set_item("envs", place.envs)?;
                placement.set_item("run_dir", place.run_dir.to_string_lossy().into_owned())
            })();
            filled.map_err(|e| foreign(py, "the worker's placement", e))?;
            let adapter = factory
                .call1(py, (job, placement))
                .map_err(|e| foreign(py, "creating the worker", e))?;
            Ok(Box::new(PyWorkload {
                adapter,
                keep: Vec::new(),
                rank: place.rank,
                next_chunk: 0,
                device: None,
                shared: ctx.launch.host_shared.as_ref().map(|_| None),
            }) as Box<dyn Workload>)
        })
    });
    py.detach(|| rlsync::worker::run_worker_with(&argv, builder))
        .map_err(|e| RlsyncError::new_err(chain(&e)))
}

/// Encode `arrays` — `[(name, dtype_str, shape, bytes)]` — as one named-array chunk (what a rollout sends).
/// One array as Python hands it over: `(name, dtype, shape, bytes)`.
type PyArray = (String, String, Vec<u64>, Vec<u8>);

/// The arrays as the trajectory codec takes them (borrowing names and bytes).
fn named_arrays(items: &[PyArray]) -> Vec<NamedArray<'_>> {
    items
        .iter()
        .map(|(name, dtype, shape, data)| NamedArray {
            name,
            dtype,
            shape: shape.clone(),
            data,
        })
        .collect()
}

#[pyfunction]
fn encode_arrays<'py>(
    py: Python<'py>,
    rank: u32,
    chunk: u64,
    items: Vec<PyArray>,
) -> PyResult<Bound<'py, PyBytes>> {
    let named = named_arrays(&items);
    let bytes = arrays::encode_arrays(ChunkOrigin { rank, chunk }, &named)
        .map_err(|e| pyo3::exceptions::PyValueError::new_err(e.to_string()))?;
    Ok(PyBytes::new(py, &bytes))
}

/// Decode back-to-back named-array chunks: `[(rank, chunk, [(name, dtype_str, shape, bytes)])]`.
#[pyfunction]
fn decode_arrays<'py>(py: Python<'py>, data: &[u8]) -> PyResult<Bound<'py, PyList>> {
    let chunks = arrays::decode_arrays(data)
        .map_err(|e| pyo3::exceptions::PyValueError::new_err(e.to_string()))?;
    let out = PyList::empty(py);
    for (origin, arrays) in chunks {
        let list = PyList::empty(py);
        for a in arrays {
            list.append((a.name, a.dtype, a.shape, PyBytes::new(py, a.data)))?;
        }
        out.append((origin.rank, origin.chunk, list))?;
    }
    Ok(out)
}
