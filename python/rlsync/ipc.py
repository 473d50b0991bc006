"""The same-host GPU channel: one sender's patches shared device to device with N receiver processes of the
host (CUDA IPC handles of rlsync's own buffers, control messages over a 0600 Unix socket).

The sender keeps a copy of its state dict on the GPU (rlsync's allocation, never PyTorch's memory) and, per
sync, runs the fused diff kernel against it; the changes stay on the device, where each receiver's install
kernel reads them. Only a small checksummed control message (sequence number, version, change counts) and an
ack per receiver travel over the socket. One version is in flight: ``sync`` returns after every receiver acked.

Bootstrap: the first ``sync`` (or an explicit :meth:`CudaIpcSender.bootstrap`) copies the state into the
snapshot and sends every receiver a full copy of it, so the receivers start equal to the sender whatever
their tensors held. A receiver that connects later (a rank below ``receivers``) gets a full copy at the start of
the next sync. A receiver that dies makes that sync raise :class:`rlsync.TransportError` naming its rank at
once; the others go on.

Integrity: every control message carries an xxh3 checksum and a strictly increasing sequence number, and a
receiver checks each one (newer sequence, a full copy first, change counts within the setup's capacities) before it
writes anything. The changes never leave GPU memory; they are checksummed there: the sender hashes what its diff
kernel wrote (every change's position and values, every overflowing tile's elements in the snapshot copy; for
a full copy the whole snapshot copy), seeded with the sync's sequence number, and each receiver hashes the same
device buffers before it writes anything; another sum or change count rejects the sync
(:class:`rlsync.PayloadRejected` on the receiver, :class:`rlsync.TransportError` naming the rank on the sender)
with the receiver's tensors untouched, and that receiver gets a full copy at the start of the next sync. The
sender checks its own count first: where its checksum kernel counted other changes than its diff kernel
reported (a fault on its device), it sends no patch but sets its snapshot copy to the state again and sends
that sync as a full copy (counted in ``sync()["fallbacks"]``, with a warning in the log).

Both ends need the same tensors (shapes and dtypes, in the same order), contiguous CUDA tensors of one device
each (the sender's and a receiver's device may differ: peer access is enabled). A sender made with ``dtype``
(fp32 master weights, bf16 receivers) casts its floating tensors to it on its GPU before each build, into a
scratch copy of their size in that dtype kept for the sender's life (bit for bit as ``tensor.to(dtype)``), and
diffs that: its receivers hold the floating tensors in ``dtype``, the others in their own. Without CUDA (no
driver, or a build without it) every call raises :class:`rlsync.CudaError`.
"""

from __future__ import annotations

import os
from typing import Any

from . import _native
from .syncer import StateDictLike, _describe, _dtype_name

__all__ = ["CudaIpcSender", "CudaIpcReceiver", "cuda_ipc_sender", "cuda_ipc_receiver"]


def _stream(descs: list[tuple]) -> int:
    """The caller's current stream on the tensors' device (0, the legacy default stream, without CUDA)."""
    for d in descs:
        if d[6].startswith("cuda"):
            import torch

            return torch.cuda.current_stream(d[1].device).cuda_stream
    return 0


class CudaIpcSender:
    """The sending end; see :func:`cuda_ipc_sender`."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        state_dict: StateDictLike,
        receivers: int,
        snapshot_device: str = "cuda",
        timeout: float = 60.0,
        elastic: bool = False,
        detach_acks: bool = False,
        dtype: Any = None,
    ) -> None:
        self._state = state_dict
        name = _dtype_name(dtype, "dtype")
        self._native = _native.CudaIpcSender(
            os.fspath(path), _describe(state_dict), receivers, snapshot_device, timeout, name
        )
        self._native.set_elastic(elastic)
        self._native.detach_acks(detach_acks)

    def bootstrap(self, version: int = 0) -> dict[str, Any]:
        """Snapshot := the state dict; wait for every receiver and send each a full copy at ``version``."""
        descs = _describe(self._state)
        return self._native.bootstrap(descs, _stream(descs), version)

    def sync(self, version: int) -> dict[str, Any]:
        """Build the patch of the state dict against the snapshot on the GPU, have every receiver verify and
        install it, return after all acks: ``{"seq", "version", "full", "build_s", "acks_s", "receivers",
        "fallbacks", "widths", "checksums", "per_receiver"}`` (``fallbacks``: the syncs this sender sent as a
        full copy because its own checksum counted other changes than its diff kernel reported, since it was
        made; ``widths``: ``(element bytes, changes, overflowed)``;
        ``checksums``: the device buffers' checksum per width; ``per_receiver``: per rank that acked, where its
        part went in seconds: ``total_s`` (sync sent → ack sent), ``wake_s`` (sync sent → read by the
        receiver), ``drain_s`` (work already queued on the receiver's stream), ``check_s`` (the checksum
        kernel), ``apply_s`` (the install kernel), ``reply_s`` (ack sent → read here; acks are read in rank
        order)); ``settled``: with ``detach_acks``, the previous sync's acks, collected before this sync touched
        the buffers (this sync's own come with the next one, and ``per_receiver`` is empty); ``dropped``: with
        ``elastic``, the ranks whose process went away since the last report (dropped, not an error). The first
        call bootstraps."""
        descs = _describe(self._state)
        return self._native.sync(descs, _stream(descs), version)

    def rejoin(self, rank: int) -> dict[str, Any]:
        """A restarted receiver ``rank`` comes back (``elastic``): forget its predecessor (also its ack of a
        detached sync), wait for its connection and give it a full copy of the current version at once, its ack
        waited for; the other receivers see nothing of it. The report is :meth:`sync`'s, for that copy."""
        descs = _describe(self._state)
        return self._native.rejoin(descs, _stream(descs), rank)

    def settle(self) -> list[dict[str, Any]]:
        """With ``detach_acks``: collect the acks of the sync still outstanding (waiting up to the timeout);
        their timings. A receiver's rejection or death surfaces here (or at the next sync)."""
        return self._native.settle()

    def ranks(self) -> list[int]:
        """The receivers connected now."""
        return self._native.ranks()

    def close(self) -> None:
        """Free the GPU buffers and remove the socket."""
        self._native.close()

    def __enter__(self) -> "CudaIpcSender":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class CudaIpcReceiver:
    """The receiving end; see :func:`cuda_ipc_receiver`."""

    def __init__(
        self, path: str | os.PathLike[str], rank: int, state_dict: StateDictLike, timeout: float = 60.0
    ) -> None:
        self._state = state_dict
        self._native = _native.CudaIpcReceiver(os.fspath(path), rank, _describe(state_dict), timeout)

    def apply(self, timeout: float = 60.0) -> int:
        """Wait up to ``timeout`` seconds for the next sync and install it into the state dict's tensors in
        place (on the current stream, waited for); its version. A message that fails validation, or whose
        device buffers do not match the sender's checksum, raises :class:`rlsync.PayloadRejected` with the
        tensors untouched."""
        descs = _describe(self._state)
        return self._native.apply(descs, _stream(descs), timeout)

    @property
    def version(self) -> int | None:
        """The version installed last (``None`` before the first sync)."""
        return self._native.version

    def close(self) -> None:
        """Unmap the sender's buffers."""
        self._native.close()

    def __enter__(self) -> "CudaIpcReceiver":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def cuda_ipc_sender(
    path: str | os.PathLike[str],
    state_dict: StateDictLike,
    receivers: int,
    snapshot_device: str = "cuda",
    timeout: float = 60.0,
    elastic: bool = False,
    detach_acks: bool = False,
    dtype: Any = None,
) -> CudaIpcSender:
    """Bind the socket ``path`` (created 0600; its directory must exist) for ``receivers`` receivers (ranks
    ``0 .. receivers-1``) and allocate the GPU snapshot copy and patch buffers for ``state_dict``'s CUDA
    tensors. ``snapshot_device`` must be ``"cuda"`` (the snapshot is shared by CUDA IPC). ``timeout`` bounds
    the wait for receivers and for each sync's acks. ``elastic``: a receiver whose process died is dropped
    (named in the next report's ``dropped``) instead of failing the sync, and its successor comes back by
    :meth:`CudaIpcSender.rejoin`. ``detach_acks``: a sync returns once sent (receivers that install between
    their own work) and its acks are collected by the next sync or :meth:`CudaIpcSender.settle`, before the
    buffers are rewritten. ``dtype`` (``None``, ``torch.bfloat16``, ``torch.float16`` or ``torch.float32``): the
    receivers hold the floating tensors in it, cast on the sender's GPU (see the module docs)."""
    return CudaIpcSender(path, state_dict, receivers, snapshot_device, timeout, elastic, detach_acks, dtype)


def cuda_ipc_receiver(
    path: str | os.PathLike[str], rank: int, state_dict: StateDictLike, timeout: float = 60.0
) -> CudaIpcReceiver:
    """Connect to the sender at ``path`` as ``rank`` (waiting up to ``timeout`` seconds for it to admit this
    receiver: it does so in its ``bootstrap`` or first ``sync``) and map its buffers on the device of
    ``state_dict``'s CUDA tensors."""
    return CudaIpcReceiver(path, rank, state_dict, timeout)
