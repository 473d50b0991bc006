"""rlsync from Python: RLinf-compatible weight syncers for torch state dicts, backed by rlsync's Rust core.

- :class:`PatchWeightSyncer` / :class:`BucketWeightSyncer` (and :meth:`WeightSyncer.create` from an
  RLinf ``weight_syncer`` config): ``init_sender`` / ``init_receiver`` / ``sync`` / ``apply``, async, over the
  caller's ``send`` / ``recv`` callables or rlsync's shared-memory channel (:func:`shm_sender`,
  :func:`shm_receiver`).
- :func:`param_names_need_sync`: trainable parameters (tied aliases included) and persistent buffers.
- Errors: :class:`RlsyncError` and its subclasses :class:`PayloadRejected` (weights and version untouched),
  :class:`HandshakeError`, :class:`TransportError`; bad tensors (non-CPU, non-contiguous, overlapping views,
  unsupported dtypes) raise ``ValueError`` naming the key.

See ``help(rlsync.WeightSyncer)`` for the full interface.
"""

from ._native import (
    HandshakeError,
    PayloadRejected,
    RlsyncError,
    TransportError,
    __version__,
)
from .syncer import (
    BucketWeightSyncer,
    PatchWeightSyncer,
    RecvFn,
    SendFn,
    ShmReceiver,
    ShmSender,
    WeightSyncer,
    param_names_need_sync,
    shm_receiver,
    shm_sender,
)

__all__ = [
    "__version__",
    "WeightSyncer",
    "PatchWeightSyncer",
    "BucketWeightSyncer",
    "SendFn",
    "RecvFn",
    "ShmSender",
    "ShmReceiver",
    "shm_sender",
    "shm_receiver",
    "param_names_need_sync",
    "RlsyncError",
    "PayloadRejected",
    "HandshakeError",
    "TransportError",
]
