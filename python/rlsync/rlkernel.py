"""rlsync as an RL-Kernel weight bridge: ``RolloutExecutor(weight_bridge=RlsyncTensorBridge(...))``.

:class:`RlsyncTensorBridge` implements RL-Kernel's ``WeightBridge`` protocol (``rl_engine.executors.bridge``):
a publisher's ``publish(model, *, weight_version, metadata=None)`` returns a ``WeightUpdateManifest`` and a
consumer's ``import_update`` / ``acknowledge`` / ``reject`` / ``release`` follow RL-Kernel's per-update state
machine (published → imported → acknowledged | rejected → released). When ``rl_engine`` is importable the
manifest, descriptor, layout and error classes are RL-Kernel's own (``isinstance`` and ``dataclasses.replace``
work); otherwise this module's equivalents with the same fields.

How rlsync carries an update: ``publish`` encodes the state dict with rlsync's bucket syncer (self-describing
payloads: names, shapes, dtypes, a checksum per payload and one over the whole state) into one 0600 POSIX
shared-memory segment owned by the publisher; the manifest names it (``metadata["weight_bridge"]``), so a fresh
process imports from the manifest alone. ``import_update`` decodes and verifies every payload into staging
tensors that the caller's install adapter reads; the active weights are not touched until ``acknowledge``,
which re-verifies the staged content (xxh3 over the whole state) before switching the active version. A
corrupt, truncated, replayed or older payload is rejected whole (``WeightManifestValidationError`` /
``WeightUpdateRejectedError``) and the previous active version stays. ``release`` is idempotent and unlinks
the segment on the publisher's side; segments of publishers that died are removed by the next bridge built.

Differences from RL-Kernel's bridges, and why: the tensor descriptors' ``sha256`` is computed at publish (for
RL-Kernel's tools) but content is verified with rlsync's checksums (xxh3, several GB/s); imports copy into
staging (not aliases of the publisher's memory), so a publisher may change or free its weights right after
``publish``; a consumer rejects an update older than one it already imported from the same publisher.
"""

from __future__ import annotations

import ctypes
import hashlib
import mmap
import os
import time
import uuid
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from . import _native
from ._blocking import Runner
from .syncer import BucketWeightSyncer

__all__ = [
    "RlsyncTensorBridge",
    "TensorDescriptor",
    "WeightUpdateManifest",
    "WeightLayout",
    "WeightBridgeError",
    "WeightBridgeUnavailableError",
    "WeightManifestValidationError",
    "WeightUpdateRejectedError",
    "HAVE_RL_ENGINE",
]

_BRIDGE_KEY = "weight_bridge"
_FORMAT = "rlsync-bucket-v1"
_SEGMENT_PREFIX = "rlsync-rlk-"
_SHM_DIR = "/dev/shm"


def _tensor_sha256(tensor: torch.Tensor) -> str:
    """sha256 of the tensor's elements in row-major order (RL-Kernel hashes the storage, the same bytes for the
    whole, contiguous tensors a state dict holds)."""
    t = tensor.detach().cpu().contiguous()
    if t.numel() == 0:
        return hashlib.sha256(b"").hexdigest()
    return hashlib.sha256(ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())).hexdigest()


try:  # RL-Kernel's own classes, so its executors, tests and tools see the types they expect
    from rl_engine.executors.bridge import (  # type: ignore[import-not-found]
        TensorDescriptor,
        WeightBridgeError,
        WeightBridgeUnavailableError,
        WeightLayout,
        WeightManifestValidationError,
        WeightUpdateManifest,
        WeightUpdateRejectedError,
    )

    HAVE_RL_ENGINE = True
except ImportError:
    HAVE_RL_ENGINE = False

    class WeightBridgeError(RuntimeError):  # type: ignore[no-redef]
        """Base class for weight bridge failures (RL-Kernel's name)."""

    class WeightBridgeUnavailableError(WeightBridgeError):  # type: ignore[no-redef]
        """A requested transport or layout is not supported here."""

    class WeightManifestValidationError(WeightBridgeError):  # type: ignore[no-redef]
        """A manifest is incomplete or inconsistent, or content does not match it."""

    class WeightUpdateRejectedError(WeightBridgeError):  # type: ignore[no-redef]
        """An update cannot be imported or acknowledged."""

    @dataclass(frozen=True)
    class WeightLayout:  # type: ignore[no-redef]
        """How model state is laid out in an update (RL-Kernel's fields); only whole states on one node."""

        kind: str = "full-state"
        world_size: int = 1
        rank: int = 0
        tensor_parallel_size: int = 1
        data_parallel_size: int = 1
        zero_stage: int = 0
        node_count: int = 1
        rdma_enabled: bool = False

        @classmethod
        def from_metadata(cls, metadata: Mapping[str, Any] | None) -> "WeightLayout":
            raw = (metadata or {}).get("layout", {})
            if raw is None:
                return cls()
            if not isinstance(raw, Mapping):
                raise WeightManifestValidationError("weight layout metadata must be a mapping")
            return cls(
                kind=str(raw.get("kind", "full-state")),
                world_size=int(raw.get("world_size", 1)),
                rank=int(raw.get("rank", 0)),
                tensor_parallel_size=int(raw.get("tensor_parallel_size", 1)),
                data_parallel_size=int(raw.get("data_parallel_size", 1)),
                zero_stage=int(raw.get("zero_stage", 0)),
                node_count=int(raw.get("node_count", 1)),
                rdma_enabled=bool(raw.get("rdma_enabled", False)),
            )

        def to_metadata(self) -> dict[str, Any]:
            return {
                "kind": self.kind,
                "world_size": self.world_size,
                "rank": self.rank,
                "tensor_parallel_size": self.tensor_parallel_size,
                "data_parallel_size": self.data_parallel_size,
                "zero_stage": self.zero_stage,
                "node_count": self.node_count,
                "rdma_enabled": self.rdma_enabled,
            }

        def validate_supported(self) -> None:
            if self.kind not in ("full-state", "replicated"):
                raise WeightBridgeUnavailableError(
                    f"weight layout {self.kind!r} is not supported by this bridge: publish a gathered full state"
                )
            if self.tensor_parallel_size != 1:
                raise WeightBridgeUnavailableError("tensor-parallel weight layouts are not supported by this bridge")
            if self.node_count != 1 or self.rdma_enabled:
                raise WeightBridgeUnavailableError(
                    "multi-node/RDMA weight transport is not implemented by this bridge (rlsync's TCP channel is, "
                    "through rlsync.tcp_sender / tcp_receiver)"
                )
            if self.world_size < 1 or not 0 <= self.rank < self.world_size:
                raise WeightManifestValidationError(
                    f"invalid weight layout rank/world_size: rank={self.rank}, world_size={self.world_size}"
                )
            if self.data_parallel_size < 1:
                raise WeightManifestValidationError("data_parallel_size must be >= 1")

    @dataclass(frozen=True)
    class TensorDescriptor:  # type: ignore[no-redef]
        """Transport-independent metadata of one tensor (RL-Kernel's fields; ``dtype`` as ``"torch.float32"``)."""

        name: str
        shape: tuple[int, ...]
        dtype: str
        stride: tuple[int, ...]
        device: str
        numel: int
        nbytes: int
        sha256: str

        @classmethod
        def from_tensor(cls, name: str, tensor: torch.Tensor) -> "TensorDescriptor":
            return cls(
                name=name,
                shape=tuple(int(d) for d in tensor.shape),
                dtype=str(tensor.dtype),
                stride=tuple(int(s) for s in tensor.stride()),
                device=str(tensor.device),
                numel=int(tensor.numel()),
                nbytes=int(tensor.numel() * tensor.element_size()),
                sha256=_tensor_sha256(tensor),
            )

    @dataclass(frozen=True)
    class WeightUpdateManifest:  # type: ignore[no-redef]
        """The immutable, picklable record of one published update (RL-Kernel's fields)."""

        update_id: str
        source_worker: str
        source_rank: int
        weight_version: int
        transport: str
        tensors: Mapping[str, TensorDescriptor]
        created_at: float
        metadata: Mapping[str, Any] = field(default_factory=dict)

        @property
        def tensor_count(self) -> int:
            return len(self.tensors)

        @property
        def total_nbytes(self) -> int:
            return sum(d.nbytes for d in self.tensors.values())


def _validated_metadata(metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    out = dict(metadata or {})
    if _BRIDGE_KEY in out:
        raise WeightManifestValidationError(f"metadata key {_BRIDGE_KEY!r} is reserved for bridge internals")
    layout = WeightLayout.from_metadata(out)
    layout.validate_supported()
    out["layout"] = layout.to_metadata()
    return out


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise WeightManifestValidationError(f"unsupported tensor dtype in manifest: {name}")
    return dtype


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_dead_publishers_segments(directory: str) -> int:
    """Unlink segments whose publisher process is gone (a publisher killed before ``release``)."""
    removed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        if not name.startswith(_SEGMENT_PREFIX):
            continue
        pid_text = name[len(_SEGMENT_PREFIX) :].split("-", 1)[0]
        if pid_text.isdigit() and not _pid_alive(int(pid_text)):
            try:
                os.unlink(os.path.join(directory, name))
                removed += 1
            except OSError:
                pass
    return removed


def _unlink_all(paths: set[str]) -> None:
    for path in list(paths):
        try:
            os.unlink(path)
        except OSError:
            pass
        paths.discard(path)


def _write_segment(path: str, payloads: list[bytes]) -> list[list[int]]:
    """One 0600 segment holding the payloads back to back; returns ``[[offset, length], ...]``."""
    total = sum(len(p) for p in payloads)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, max(total, 1))
        spans: list[list[int]] = []
        with mmap.mmap(fd, max(total, 1)) as m:
            offset = 0
            for p in payloads:
                m[offset : offset + len(p)] = p
                spans.append([offset, len(p)])
                offset += len(p)
        return spans
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)


def _read_segment(path: str, spans: list[list[int]]) -> list[bytes]:
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError as exc:
        raise WeightUpdateRejectedError(f"the update's segment {path} is gone (released by its publisher)") from exc
    try:
        size = os.fstat(fd).st_size
        out = []
        with mmap.mmap(fd, size, prot=mmap.PROT_READ) as m:
            for offset, length in spans:
                if offset < 0 or length < 0 or offset + length > size:
                    raise WeightManifestValidationError(
                        f"the update's segment {path} is shorter than its manifest says ({size} bytes)"
                    )
                out.append(bytes(m[offset : offset + length]))
        return out
    finally:
        os.close(fd)


@dataclass
class _Record:
    manifest: Any
    staging: dict[str, torch.Tensor] | None = None
    state: str = "published"
    import_count: int = 0
    rejection_reason: str | None = None
    segment: str | None = None


class RlsyncTensorBridge:
    """RL-Kernel's ``WeightBridge`` (publisher and consumer) over rlsync (see the module docs).

    Args:
        source_worker, source_rank: written into every manifest this bridge publishes (RL-Kernel's names).
        bucket_size: most bytes per rlsync payload inside the segment.
        shm_dir: where segments are created (``/dev/shm``: POSIX shared memory).
    """

    transport = "rlsync-bucket"

    def __init__(
        self,
        *,
        source_worker: str = "local-training",
        source_rank: int = 0,
        bucket_size: int = 64 * 1024 * 1024,
        shm_dir: str = _SHM_DIR,
    ) -> None:
        self.source_worker = source_worker
        self.source_rank = int(source_rank)
        self._bucket_size = int(bucket_size)
        self._shm_dir = shm_dir
        self._updates: dict[str, _Record] = {}
        self._latest_published_weight_version = -1
        self.active_weight_version: int | None = None
        self.active_update_id: str | None = None
        self._runner = Runner()
        self._sender: BucketWeightSyncer | None = None
        self._sender_keys: list[str] | None = None
        self._receivers: dict[tuple[str, int], BucketWeightSyncer] = {}
        self._owned_segments: set[str] = set()
        self._finalizer = weakref.finalize(self, _unlink_all, self._owned_segments)
        _remove_dead_publishers_segments(shm_dir)

    # -- publisher -------------------------------------------------------------------------------------------

    def publish(self, model: torch.nn.Module, *, weight_version: int, metadata: Mapping[str, Any] | None = None) -> Any:
        """Encode ``model.state_dict()`` as ``weight_version`` into a shared-memory segment and return its
        manifest. Versions strictly increase per publisher."""
        user_metadata = _validated_metadata(metadata)
        version = int(weight_version)
        if version <= self._latest_published_weight_version:
            raise WeightManifestValidationError(
                f"weight_version must increase monotonically (got {version}, latest "
                f"{self._latest_published_weight_version})"
            )
        state = {
            name: (t.detach() if t.is_contiguous() else t.detach().contiguous())
            for name, t in model.state_dict().items()
            if isinstance(t, torch.Tensor)
        }
        if not state:
            raise WeightManifestValidationError("model state_dict produced no tensors")
        payloads: list[bytes] = []

        async def collect(payload: Any) -> None:
            payloads.append(bytes(payload))

        keys = list(state)
        if self._sender is None:
            sender = BucketWeightSyncer(bucket_size=self._bucket_size)
            self._runner.run(sender.init_sender(state, keys, collect))
            payloads.clear()  # nothing a receiver needs comes before a version's own payloads
            self._sender, self._sender_keys = sender, keys
        elif set(keys) != set(self._sender_keys):
            missing = sorted(set(self._sender_keys) - set(keys))
            extra = sorted(set(keys) - set(self._sender_keys))
            raise WeightManifestValidationError(
                f"the model's state dict keys changed since this bridge's first publish (missing={missing}, "
                f"extra={extra}): publish it from a new bridge"
            )
        self._runner.run(self._sender.sync(state, collect, version))
        checksum = self._sender.checksum(state)
        update_id = str(uuid.uuid4())
        path = os.path.join(self._shm_dir, f"{_SEGMENT_PREFIX}{os.getpid()}-{update_id}")
        spans = _write_segment(path, payloads)
        self._owned_segments.add(path)
        try:
            manifest = WeightUpdateManifest(
                update_id=update_id,
                source_worker=self.source_worker,
                source_rank=self.source_rank,
                weight_version=version,
                transport=self.transport,
                tensors={name: TensorDescriptor.from_tensor(name, t) for name, t in state.items()},
                created_at=time.perf_counter(),
                metadata={
                    **user_metadata,
                    _BRIDGE_KEY: {"format": _FORMAT, "segment": path, "payloads": spans, "xxh3": checksum},
                },
            )
        except BaseException:
            _unlink_all({path})
            self._owned_segments.discard(path)
            raise
        self._updates[update_id] = _Record(manifest=manifest, segment=path)
        self._latest_published_weight_version = version
        return manifest

    # -- consumer --------------------------------------------------------------------------------------------

    def import_update(self, manifest: Any) -> Mapping[str, torch.Tensor]:
        """Decode and verify ``manifest``'s update into staging tensors (returned) without touching the active
        weights. Works in a process that never saw the publisher (the manifest alone)."""
        record = self._updates.get(manifest.update_id)
        if record is not None:
            self._refuse_closed(record, manifest.update_id)
            self._check_same(record.manifest, manifest)
            if record.staging is not None:
                record.import_count += 1
                return dict(record.staging)
        spans, segment, checksum = self._bridge_metadata(manifest)
        staging = self._staging(manifest)
        payloads = _read_segment(segment, spans)
        version = self._decode(payloads, staging, manifest)
        if version != manifest.weight_version:
            raise WeightManifestValidationError(
                f"weight_version mismatch: the manifest says {manifest.weight_version}, its payloads carry {version}"
            )
        actual = self._receiver_for(manifest).checksum(staging)
        if actual != checksum:
            raise WeightManifestValidationError(f"tensor checksum mismatch: expected xxh3 {checksum:#x}, got {actual:#x}")
        if record is None:
            record = _Record(manifest=manifest)
            self._updates[manifest.update_id] = record
        record.staging = staging
        record.import_count += 1
        if record.state == "published":
            record.state = "imported"
        return dict(staging)

    def acknowledge(self, update_id: str) -> None:
        """Re-verify the imported content and make it the active version."""
        record = self._require(update_id)
        if record.state == "rejected":
            raise WeightUpdateRejectedError(f"cannot acknowledge rejected update {update_id}: {record.rejection_reason}")
        if record.state == "released":
            raise WeightUpdateRejectedError(f"cannot acknowledge released update {update_id}")
        if record.import_count == 0 or record.staging is None:
            raise WeightUpdateRejectedError(f"cannot acknowledge update {update_id} before import_update succeeds")
        _, _, checksum = self._bridge_metadata(record.manifest)
        actual = self._receiver_for(record.manifest).checksum(record.staging)
        if actual != checksum:
            raise WeightManifestValidationError(
                f"tensor checksum mismatch for update {update_id}: the staged weights changed after import "
                f"(expected xxh3 {checksum:#x}, got {actual:#x})"
            )
        record.state = "acknowledged"
        self.active_weight_version = record.manifest.weight_version
        self.active_update_id = update_id

    def reject(self, update_id: str, reason: str) -> None:
        """Drop the update; the active version stays."""
        record = self._require(update_id)
        if record.state == "acknowledged":
            raise WeightUpdateRejectedError(f"cannot reject acknowledged update {update_id}")
        record.state = "rejected"
        record.rejection_reason = reason
        record.staging = None

    def release(self, update_id: str) -> None:
        """Forget the update (idempotent); the publisher unlinks its segment. The active version number stays."""
        record = self._updates.pop(update_id, None)
        if record is None:
            return
        record.staging = None
        record.state = "released"
        if record.segment is not None and record.segment in self._owned_segments:
            _unlink_all({record.segment})
            self._owned_segments.discard(record.segment)
        if self.active_update_id == update_id:
            self.active_update_id = None

    def update_status(self, update_id: str) -> str:
        record = self._updates.get(update_id)
        return "released" if record is None else record.state

    def get_manifest(self, update_id: str) -> Any:
        return self._require(update_id).manifest

    def close(self) -> None:
        """Release every update and unlink every segment this bridge published (also done when it is
        garbage-collected or the interpreter exits)."""
        for update_id in list(self._updates):
            self.release(update_id)
        self._finalizer()
        self._runner.close()

    # -- internals -------------------------------------------------------------------------------------------

    def _require(self, update_id: str) -> _Record:
        try:
            return self._updates[update_id]
        except KeyError as exc:
            raise WeightUpdateRejectedError(f"unknown weight update {update_id}") from exc

    @staticmethod
    def _refuse_closed(record: _Record, update_id: str) -> None:
        if record.state == "rejected":
            raise WeightUpdateRejectedError(f"weight update {update_id} was rejected: {record.rejection_reason}")
        if record.state == "released":
            raise WeightUpdateRejectedError(f"weight update {update_id} was released")

    @staticmethod
    def _check_same(expected: Any, manifest: Any) -> None:
        if manifest.weight_version != expected.weight_version:
            raise WeightManifestValidationError(
                f"weight_version mismatch: expected {expected.weight_version}, got {manifest.weight_version}"
            )
        if set(manifest.tensors) != set(expected.tensors):
            missing = sorted(set(expected.tensors) - set(manifest.tensors))
            extra = sorted(set(manifest.tensors) - set(expected.tensors))
            raise WeightManifestValidationError(f"tensor manifest mismatch: missing={missing}, extra={extra}")
        for name, descriptor in expected.tensors.items():
            if manifest.tensors[name] != descriptor:
                raise WeightManifestValidationError(
                    f"tensor descriptor mismatch for {name}: expected {descriptor}, got {manifest.tensors[name]}"
                )

    def _bridge_metadata(self, manifest: Any) -> tuple[list[list[int]], str, int]:
        WeightLayout.from_metadata(manifest.metadata).validate_supported()
        if manifest.transport != self.transport:
            raise WeightManifestValidationError(f"transport mismatch: expected {self.transport}, got {manifest.transport}")
        meta = manifest.metadata.get(_BRIDGE_KEY)
        if not isinstance(meta, Mapping) or meta.get("format") != _FORMAT:
            raise WeightManifestValidationError(f"manifest has no {_FORMAT} bridge metadata")
        try:
            spans = [[int(o), int(n)] for o, n in meta["payloads"]]
            return spans, str(meta["segment"]), int(meta["xxh3"])
        except (KeyError, TypeError, ValueError) as exc:
            raise WeightManifestValidationError("manifest's bridge metadata is malformed") from exc

    @staticmethod
    def _staging(manifest: Any) -> dict[str, torch.Tensor]:
        staging = {}
        for name, d in manifest.tensors.items():
            if d.name != name:
                raise WeightManifestValidationError(f"tensor descriptor for {name} names {d.name}")
            shape = tuple(int(x) for x in d.shape)
            if any(x < 0 for x in shape):
                raise WeightManifestValidationError(f"invalid tensor shape for {name}: {shape}")
            dtype = _dtype(d.dtype)
            numel = 1
            for x in shape:
                numel *= x
            if numel != d.numel or numel * torch.empty((), dtype=dtype).element_size() != d.nbytes:
                raise WeightManifestValidationError(f"tensor descriptor mismatch for {name}: sizes disagree with shape")
            staging[name] = torch.empty(shape, dtype=dtype, device=d.device)
        return staging

    def _receiver_for(self, manifest: Any) -> BucketWeightSyncer:
        return self._receivers[(str(manifest.source_worker), int(manifest.source_rank))]

    def _decode(self, payloads: list[bytes], staging: dict[str, torch.Tensor], manifest: Any) -> int:
        pending = iter(payloads)

        async def recv() -> bytes:
            try:
                return next(pending)
            except StopIteration:
                raise WeightManifestValidationError(
                    f"update {manifest.update_id} is truncated: its payloads end before the version does"
                ) from None

        key = (str(manifest.source_worker), int(manifest.source_rank))
        receiver = self._receivers.get(key)
        if receiver is None:
            # One receiver per publisher: its sequence numbers reject a replayed or older update of that publisher.
            receiver = BucketWeightSyncer(bucket_size=self._bucket_size)
            self._runner.run(receiver.init_receiver(staging, recv))
            self._receivers[key] = receiver
        try:
            version = self._runner.run(receiver.apply(staging, recv))
        except _native.PayloadRejected as exc:
            raise WeightManifestValidationError(
                f"tensor checksum mismatch or replay: update {manifest.update_id} was rejected by rlsync: {exc}"
            ) from exc
        if next(pending, None) is not None:
            raise WeightManifestValidationError(f"update {manifest.update_id} has payloads after its version ended")
        return version
