"""rlsync from Python: RLinf-compatible weight syncers for torch state dicts, backed by rlsync's Rust core.

- :class:`PatchWeightSyncer` / :class:`BucketWeightSyncer` (and :meth:`WeightSyncer.create` from an
  RLinf ``weight_syncer`` config): ``init_sender`` / ``init_receiver`` / ``sync`` / ``apply``, async, over the
  caller's ``send`` / ``recv`` callables, rlsync's shared-memory channel (:func:`shm_sender`,
  :func:`shm_receiver`) or its authenticated TCP channel across hosts (:func:`tcp_sender`, :func:`tcp_receiver`); RLinf's config keys, attributes and ``comm_options`` (:class:`CollectiveGroupOptions`),
  FSDP2 / DTensor state dicts on every actor rank, payloads as ``bytes`` or uint8 tensors; per-call
  ``timeout=``, ``stage`` / ``commit`` / ``abort`` on receivers, and on rlsync's channel the receivers'
  acknowledgements (``acked_versions``, ``sync(..., wait="applied")``, ``rejections``).
- :func:`param_names_need_sync`: trainable parameters (tied aliases included) and persistent buffers.
- :mod:`rlsync.worker`: run your PyTorch trainer and Python simulator as rlsync's workers
  (``worker@actor.worker=python``); :mod:`rlsync.checkpoint` / :func:`load_trainer_state`: a trainer's own
  ``state_dict()`` (optimizer, critic, schedules) in rlsync checkpoints.
- CUDA tensors: either end's state dict may hold CUDA tensors (one device per state dict);
  :func:`cuda_available` says whether this build and machine can sync them, and why not.
- Same-host GPU channel (:mod:`rlsync.ipc`): :func:`cuda_ipc_sender` / :func:`cuda_ipc_receiver` share the
  patches device to device with receiver processes of the host (CUDA IPC, acks over a 0600 Unix socket).
- Host-shared receivers (:mod:`rlsync.host_shared`): ``init_receiver(..., host_shared="name")`` receives into one
  double-buffered copy of the weights in shared memory; the host's other processes attach a
  :class:`HostSharedReader` to their model (its tensors view the shared buffer, swapped between steps).
- Errors: :class:`RlsyncError` and its subclasses :class:`PayloadRejected` (weights and version untouched),
  :class:`HandshakeError`, :class:`TransportError` (and its :class:`Timeout`: a per-call ``timeout=`` or the
  channel's bound ran out, naming what was awaited), :class:`CudaError` (no CUDA backend, driver or device);
  bad tensors (other devices, non-contiguous, overlapping views, unsupported dtypes) raise ``ValueError``
  naming the key.

See ``help(rlsync.WeightSyncer)`` for the full interface.
"""

from ._native import (
    CudaError,
    HandshakeError,
    PayloadRejected,
    RlsyncError,
    Timeout,
    TransportError,
    __version__,
    cuda_available,
)
from . import checkpoint, host_shared, ipc
from .checkpoint import load_trainer_state
from .host_shared import HostSharedReader
from .ipc import CudaIpcReceiver, CudaIpcSender, cuda_ipc_receiver, cuda_ipc_sender
from .syncer import (
    BucketWeightSyncer,
    CollectiveGroupOptions,
    PatchWeightSyncer,
    RecvFn,
    SendFn,
    ShmReceiver,
    ShmSender,
    TcpReceiver,
    TcpSender,
    WeightSyncer,
    param_names_need_sync,
    shm_receiver,
    shm_sender,
    tcp_receiver,
    tcp_sender,
)

__all__ = [
    "__version__",
    "WeightSyncer",
    "PatchWeightSyncer",
    "BucketWeightSyncer",
    "CollectiveGroupOptions",
    "SendFn",
    "RecvFn",
    "ShmSender",
    "ShmReceiver",
    "shm_sender",
    "shm_receiver",
    "TcpSender",
    "TcpReceiver",
    "tcp_sender",
    "tcp_receiver",
    "param_names_need_sync",
    "checkpoint",
    "load_trainer_state",
    "RlsyncError",
    "PayloadRejected",
    "HandshakeError",
    "TransportError",
    "Timeout",
    "CudaError",
    "cuda_available",
    "ipc",
    "CudaIpcSender",
    "CudaIpcReceiver",
    "cuda_ipc_sender",
    "cuda_ipc_receiver",
    "host_shared",
    "HostSharedReader",
]
