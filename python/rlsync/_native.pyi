"""Type stubs of ``rlsync._native``, the PyO3 extension behind the ``rlsync`` package (python/src/*.rs).

Use the typed wrappers in :mod:`rlsync` (``PatchWeightSyncer``, ``BucketWeightSyncer``, ``shm_sender``, ...);
these are the raw classes and functions they call.
"""

from collections.abc import Callable, Sequence
from os import PathLike
from typing import Any, Literal

__version__: str

# A tensor as the Python side describes it: (name, tensor, data_ptr, dtype, shape, strides, device type).
Desc = tuple[str, Any, int, str, Sequence[int], Sequence[int], str]
# A named array: (name, numpy dtype string, shape, bytes).
Array = tuple[str, str, Sequence[int], bytes]

class RlsyncError(RuntimeError):
    """Base class of rlsync's errors (the message carries the Rust cause)."""

class PayloadRejected(RlsyncError):
    """A received payload was corrupt, truncated, replayed, stale or did not fit; weights and version are untouched."""

class HandshakeError(RlsyncError):
    """The sender and the receiver do not agree (state dict keys, shapes, dtypes or syncer kind)."""

class TransportError(RlsyncError):
    """Moving bytes failed: the caller's send/recv raised, a peer went away or a wait timed out."""

class Timeout(TransportError):
    """A per-call or channel bound ran out; weights and version are untouched."""

    awaited: str
    """What was awaited, e.g. "payload of version after 3 from the sender", "ack of version 4 from receiver rank 2"."""
    rank: int | None
    """The one receiver rank waited on (``None``: the sender, or several ranks)."""
    ranks: list[int]
    """Every receiver rank waited on (empty: the sender)."""
    version: int | None
    """The version the wait was about, when known (``None`` for the next version a receiver awaits)."""
    seconds: float
    """The bound that ran out."""

class CudaError(RlsyncError):
    """CUDA tensors could not be synced: a build without CUDA, no driver, no such device, or a driver call failed."""

def cuda_available() -> tuple[bool, str]: ...

class Op:
    """A running init / sync / apply: pump it with ``step`` (caller's send/recv) or ``run`` (shm channel)."""

    @property
    def finished(self) -> bool: ...
    def step(self) -> tuple[Literal["send"], bytes] | tuple[Literal["recv"], None] | tuple[Literal["done"], int]: ...
    def sent(self) -> None: ...
    def deliver(self, payload: bytes) -> None: ...
    def fail(self, reason: str) -> None: ...
    def time_out(self, seconds: float) -> None: ...
    def run(self) -> int: ...

class ShmSender:
    """The sending end of rlsync's shared-memory channel, before a syncer takes it over."""

    @property
    def receivers(self) -> int: ...

class ShmReceiver:
    """A receiving end of rlsync's shared-memory channel, before a syncer takes it over."""

    @property
    def rank(self) -> int: ...

class TcpSender:
    """The sending end of rlsync's TCP channel (1 -> N across hosts), before a syncer takes it over."""

    @property
    def receivers(self) -> int: ...
    @property
    def address(self) -> str: ...

class TcpReceiver:
    """A receiving end of rlsync's TCP channel, before a syncer takes it over."""

    @property
    def rank(self) -> int: ...

def tcp_bind(
    bind: str,
    receivers: int,
    token: bytes,
    timeout_s: float = 60.0,
    slots: int = 4,
    elastic: bool = False,
    wait_for: int | None = None,
) -> TcpSender: ...
def tcp_connect(addr: str, rank: int, token: bytes, timeout_s: float = 60.0) -> TcpReceiver: ...

class NativeSyncer:
    """A crate ``WeightSyncer`` (patch | bucket) over torch tensors' memory."""

    def __init__(self, config: str, threads: int = 0) -> None: ...
    def begin_init_sender(
        self,
        tensors: list[Desc],
        keys_to_sync: list[str],
        channel: ShmSender | TcpSender | None = None,
        same_keys: bool = True,
        described_after: int | None = None,
        timeout: float | None = None,
    ) -> Op: ...
    def begin_init_receiver(
        self,
        tensors: list[Desc],
        channel: ShmReceiver | TcpReceiver | None = None,
        described: bool = False,
        timeout: float | None = None,
    ) -> Op: ...
    def begin_sync(
        self, tensors: list[Desc], version: int, timeout: float | None = None, wait_applied: bool = False
    ) -> Op: ...
    def begin_apply(self, tensors: list[Desc], timeout: float | None = None) -> Op: ...
    def begin_stage(self, timeout: float | None = None) -> Op: ...
    def begin_commit(self, tensors: list[Desc]) -> Op: ...
    def begin_abort(self, reason: str) -> Op: ...
    def begin_flush(self, timeout: float | None = None) -> Op: ...
    @property
    def staged_version(self) -> int | None: ...
    def acked_versions(self) -> dict[int, int]: ...
    def rejections(self) -> dict[int, int]: ...
    def last_rejection(self) -> tuple[int, int, str] | None: ...
    @property
    def version(self) -> int: ...
    @property
    def sequence(self) -> int: ...
    @property
    def end(self) -> Literal["sender", "receiver", "uninitialised"]: ...
    @property
    def on_shm(self) -> bool: ...
    @property
    def synced_keys(self) -> list[str]: ...
    def checksum(self, tensors: list[Desc]) -> int: ...
    def use_stream(self, stream: int) -> None: ...
    def last_report(self) -> dict[str, Any]: ...

def shm_bind(
    socket_path: str | PathLike[str],
    receivers: int,
    timeout_s: float = 60.0,
    slots: int = 4,
    segment_prefix: str = "rlsync",
    elastic: bool = False,
    wait_for: int | None = None,
) -> ShmSender: ...
def shm_connect(socket_path: str | PathLike[str], rank: int, timeout_s: float = 60.0) -> ShmReceiver: ...
def run_worker(argv: list[str], factory: Callable[[str, dict[str, Any]], Any]) -> None: ...
def encode_arrays(rank: int, chunk: int, items: list[Array]) -> bytes: ...
def decode_arrays(data: bytes) -> list[tuple[int, int, list[Array]]]: ...
def read_trainer_state(dir: str | PathLike[str]) -> tuple[list[Array], str]: ...
def write_trainer_state(
    dir: str | PathLike[str], tensors: list[Desc], structure: str, step: int = 0, version: int = 0
) -> None: ...

class CudaIpcSender:
    def __init__(
        self, path: str, tensors: list[Desc], receivers: int, snapshot_device: str, timeout: float
    ) -> None: ...
    def bootstrap(self, tensors: list[Desc], stream: int, version: int) -> dict[str, Any]: ...
    def sync(self, tensors: list[Desc], stream: int, version: int) -> dict[str, Any]: ...
    def ranks(self) -> list[int]: ...
    def close(self) -> None: ...

class CudaIpcReceiver:
    def __init__(self, path: str, rank: int, tensors: list[Desc], timeout: float) -> None: ...
    def apply(self, tensors: list[Desc], stream: int, timeout: float) -> int: ...
    @property
    def version(self) -> int | None: ...
    def close(self) -> None: ...
