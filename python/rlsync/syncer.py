"""Weight syncers for torch state dicts with RLinf's interface, backed by rlsync's Rust core.

A trainer (sender) and its rollout workers (receivers) each create the same kind of syncer::

    # trainer                                           # rollout
    s = rlsync.PatchWeightSyncer()                      r = rlsync.PatchWeightSyncer()
    await s.init_sender(model.state_dict(),             await r.init_receiver(model.state_dict(), recv, send)
        rlsync.param_names_need_sync(model), send, recv)
    await s.sync(model.state_dict(), send, version=1)   v = await r.apply(model, recv)   # -> 1

``send`` / ``recv`` are the caller's async callables (``await send(payload)``, ``payload = await recv()``),
exactly as in RLinf; payloads are ``bytes``, or 1-D uint8 ``torch.Tensor`` s with ``payload_type="tensor"``
(``recv`` may return any bytes-like object or uint8 tensor), so any transport carries them. Callers without a
transport pass rlsync's shared-memory channel ends instead (see :func:`rlsync.shm_sender` /
:func:`rlsync.shm_receiver`).

Semantics are the Rust core's: the sender keeps a snapshot in the receivers' dtypes and sends only changes
(patch) or every synced tensor (bucket); every payload carries its version and a checksum, and a corrupt,
truncated, replayed or stale payload raises :class:`rlsync.PayloadRejected` and leaves the receiver's
weights and version untouched. Tensors must be CPU and contiguous: they are read in place and written in
place, so a module's parameters keep their identity (optimizers and other references see the new values).
Don't modify the tensors while an operation on them is being awaited.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import numbers
import sys
import warnings
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Union

from . import _native

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = [
    "SendFn",
    "RecvFn",
    "WeightSyncer",
    "CollectiveGroupOptions",
    "PatchWeightSyncer",
    "BucketWeightSyncer",
    "ShmSender",
    "ShmReceiver",
    "TcpSender",
    "TcpReceiver",
    "shm_sender",
    "shm_receiver",
    "tcp_sender",
    "tcp_receiver",
    "param_names_need_sync",
]

SendFn = Callable[[Any], Awaitable[None]]
"""``await send(payload)``: carry one payload (``bytes``, or a uint8 tensor with ``payload_type="tensor"``)."""
RecvFn = Callable[[], Awaitable[Any]]
"""``payload = await recv()``: the next payload from the peer (any bytes-like object or uint8 tensor)."""

ShmSender = _native.ShmSender
ShmReceiver = _native.ShmReceiver
TcpSender = _native.TcpSender
TcpReceiver = _native.TcpReceiver
_CHANNEL_SENDERS = (ShmSender, TcpSender)
_CHANNEL_RECEIVERS = (ShmReceiver, TcpReceiver)

StateDictLike = Union[Mapping[str, "torch.Tensor"], "torch.nn.Module"]


def param_names_need_sync(module: "torch.nn.Module") -> list[str]:
    """Names a syncer should keep in sync: trainable parameters (tied aliases included, under every name)
    and persistent buffers, in ``named_parameters`` / ``named_modules`` order — as RLinf's
    ``collect_param_names_need_sync``. Frozen parameters (``requires_grad=False``) are left out: only the
    init bootstrap (``init_sync_enabled``) aligns them.
    """
    names = [n for n, p in module.named_parameters(remove_duplicate=False) if p.requires_grad]
    for mod_name, sub in module.named_modules(remove_duplicate=False):
        non_persistent = getattr(sub, "_non_persistent_buffers_set", set())
        for buf_name, _ in sub.named_buffers(recurse=False, remove_duplicate=False):
            if buf_name in non_persistent:
                continue
            names.append(f"{mod_name}.{buf_name}" if mod_name else buf_name)
    return names


def _state_dict(obj: StateDictLike) -> Mapping[str, Any]:
    if isinstance(obj, Mapping):
        return obj
    state_dict = getattr(obj, "state_dict", None)
    if callable(state_dict):
        return state_dict(keep_vars=True)
    raise TypeError(f"expected a state dict (a mapping of names to tensors) or a torch.nn.Module, got {type(obj).__name__}")


def _dtensor_class() -> Any:
    """``torch.distributed.tensor.DTensor`` if it was imported (a DTensor cannot exist before), else ``None``."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def _materialize(obj: StateDictLike) -> StateDictLike:
    """The state dict with every DTensor (FSDP2 shards) replaced by its full tensor, in the state dict's order.

    ``full_tensor()`` is a collective: every rank of the DTensors' mesh must call this with the same state dict
    keys, in the same order, at the same point; the syncer does so at every ``init_sender`` and ``sync``, also on
    ranks that send nothing (``is_sender=False``), so no rank waits on an all-gather another skipped. Without
    DTensors ``obj`` is returned as it is."""
    dtensor = _dtensor_class()
    if dtensor is None:
        return obj
    state = _state_dict(obj)
    if not any(isinstance(t, dtensor) for t in state.values()):
        return obj
    import torch

    with torch.no_grad():
        return {
            name: t.full_tensor().detach().contiguous() if isinstance(t, dtensor) else t for name, t in state.items()
        }


def _describe(obj: StateDictLike) -> list[tuple]:
    """``(name, tensor, data_ptr, dtype, shape, strides, device)`` of every tensor, for the native module
    (``device`` as torch prints it: ``cpu``, ``cuda:0``)."""
    import torch

    dtensor = _dtensor_class()
    out = []
    for name, t in _state_dict(obj).items():
        if not isinstance(t, torch.Tensor):
            if "_extra_state" in name:
                continue  # modules' extra state is not a tensor; RLinf skips it too
            raise TypeError(f"state_dict['{name}'] is a {type(t).__name__}, not a torch.Tensor")
        if dtensor is not None and isinstance(t, dtensor):
            raise ValueError(
                f"tensor '{name}' is a DTensor: senders' DTensors are gathered with full_tensor() at init_sender and "
                "sync; a receiver (and checksum) needs plain tensors"
            )
        if t.layout != torch.strided:
            raise ValueError(f"tensor '{name}' has layout {t.layout}: rlsync syncs dense (strided) tensors only")
        out.append(
            (
                name,
                t,
                t.data_ptr(),
                str(t.dtype).removeprefix("torch."),
                tuple(t.shape),
                tuple(t.stride()),
                str(t.device),
            )
        )
    return out


def _version(value: Any) -> int:
    """A caller's version as RLinf passes it: an ``int`` >= 0 or a 0-d integer tensor (``global_step``). A float,
    a bool, or a tensor of another dtype or shape is refused rather than truncated."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        integral = not (value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool)
        if value.dim() != 0 or not integral:
            raise TypeError(
                f"version must be an int or a 0-d integer tensor, got a tensor of dtype {value.dtype} and shape "
                f"{tuple(value.shape)}"
            )
        value = int(value.item())
    elif isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"version must be an int or a 0-d integer tensor, got {type(value).__name__} {value!r}")
    value = int(value)
    if value < 0:
        raise ValueError(f"version must be a non-negative integer, got {value}")
    return value


def _as_bytes(payload: Any) -> bytes:
    """A received payload as ``bytes``: any bytes-like object, or a uint8 ``torch.Tensor`` (any device, shape or
    strides; read through torch itself, so numpy is not needed)."""
    if isinstance(payload, bytes):
        return payload
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(payload, torch.Tensor):
        if payload.dtype != torch.uint8:
            raise TypeError(f"recv() returned a torch.Tensor of dtype {payload.dtype}; rlsync payloads are uint8 tensors")
        flat = payload.detach().to("cpu").contiguous().reshape(-1)
        if flat.numel() == 0:
            return b""
        return ctypes.string_at(flat.data_ptr(), flat.numel())
    try:
        return bytes(memoryview(payload))
    except TypeError:
        pass
    raise TypeError(
        f"recv() returned a {type(payload).__name__}; rlsync payloads are bytes-like objects or uint8 torch tensors"
    )


def _as_tensor(payload: bytes) -> "torch.Tensor":
    """A payload as a 1-D CPU uint8 ``torch.Tensor`` that owns a copy of its bytes (``payload_type="tensor"``)."""
    import torch

    if not payload:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8)


def _tensor_send(send: SendFn, device: Any = None) -> SendFn:
    """``send`` handed each payload as a 1-D uint8 tensor, on ``device`` when one is given (RLinf's
    ``transport_device``: a CUDA payload goes straight onto a collective's GPU path)."""

    async def send_tensor(payload: Any) -> None:
        t = _as_tensor(payload)
        await send(t if device is None else t.to(device))

    return send_tensor


def _transport(value: Any) -> Any:
    """``transport_device`` as a ``torch.device`` for the payloads handed to ``send`` (``None``: the CPU). A CUDA
    device must be one torch can use here: a clear error otherwise, at construction rather than at a send."""
    _device(value, "transport_device")  # cpu or cuda, else the error every device argument gets
    dev = _torch_device(value)
    if dev.type != "cuda":
        return dev
    torch = _torch()
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = 0 if dev.index is None else dev.index
    if index >= count:
        raise ValueError(
            f"transport_device={dev}: payloads are handed to send as CUDA tensors there, but torch sees "
            f"{count} CUDA device(s) here (torch.cuda.is_available() is {torch.cuda.is_available()}); use "
            "transport_device='cpu'"
        )
    return dev


def _check_timeout(timeout: float | None) -> float | None:
    """A per-call bound: ``None`` (the channel's own) or a positive number of seconds."""
    if timeout is None:
        return None
    t = float(timeout)
    if not t > 0 or t == float("inf"):
        raise ValueError(f"timeout must be None or a positive number of seconds, got {timeout!r}")
    return t


class _TimedOut(Exception):
    """The caller's ``send`` / ``recv`` did not complete within the call's ``timeout``."""


async def _drive(op: _native.Op, send: SendFn | None, recv: RecvFn | None, timeout: float | None = None) -> int:
    """Pump a bridge op: run it until it needs ``send`` / ``recv``, await those, repeat until done. With
    ``timeout``, the awaits of the caller's ``send`` / ``recv`` together are bounded by it: when it runs out the
    op ends with :class:`rlsync.Timeout` (the syncer stays usable, weights and version untouched)."""
    loop = asyncio.get_running_loop()
    deadline = None if timeout is None else loop.time() + timeout

    async def bounded(awaitable: Awaitable[Any]) -> Any:
        if deadline is None:
            return await awaitable
        try:
            return await asyncio.wait_for(awaitable, max(deadline - loop.time(), 0.0))
        except asyncio.TimeoutError:
            raise _TimedOut() from None

    try:
        while True:
            kind, payload = op.step()
            if kind == "done":
                return payload
            if kind == "send":
                if send is None:
                    raise ValueError("this operation needs a send function")
                await bounded(send(payload))
                op.sent()
            else:
                if recv is None:
                    raise ValueError("this operation needs a recv function")
                op.deliver(_as_bytes(await bounded(recv())))
    except _TimedOut:
        # The op's pending wait ends with a timeout naming the far end; step() raises rlsync.Timeout.
        op.time_out(timeout)
        while True:
            kind, payload = op.step()
            if kind == "done":  # pragma: no cover - a timed-out op cannot finish successfully
                return payload
    except BaseException as exc:
        if not op.finished:
            # End the op cleanly so the syncer comes back (weights and version untouched), then re-raise.
            op.fail(f"{type(exc).__name__}: {exc}")
            try:
                while not op.finished:
                    op.step()
            except Exception:
                pass
        raise


class _DeviceArrived(Exception):
    """``recv`` returned a device payload: the host op ends, and the payload is installed on the GPU."""

    def __init__(self, payload: Any) -> None:
        super().__init__("a device payload arrived")
        self.payload = payload


_DEVICE_MAGIC = b"RLDP"


def _is_device_payload(payload: Any) -> bool:
    """Whether a received payload is a device payload (its first bytes; on a GPU that reads 4 bytes back)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(payload, torch.Tensor):
        if payload.dtype != torch.uint8 or payload.numel() < 4:
            return False
        return bytes(payload.detach().reshape(-1)[:4].cpu().tolist()) == _DEVICE_MAGIC
    try:
        return bytes(memoryview(payload)[:4]) == _DEVICE_MAGIC
    except TypeError:
        return False


def _synced(state_dict: StateDictLike, keys: list[str]) -> list[tuple]:
    """The descriptions of ``keys`` (the synced keys, in the syncer's order) in ``state_dict``."""
    by_name = {d[0]: d for d in _describe(state_dict)}
    missing = [k for k in keys if k not in by_name]
    if missing:
        raise KeyError(f"the state dict lacks the synced key(s) {missing[:3]} (it must hold the keys of init)")
    return [by_name[k] for k in keys]


def _on_one_gpu(descs: list[tuple]) -> bool:
    """Whether the synced tensors are all CUDA tensors of one device (a sender of device payloads)."""
    devices = {d[6] for d in descs}
    return len(devices) == 1 and next(iter(devices)).startswith("cuda")


def _device_payload_sender(
    descs: list[tuple], held: list[str], sequence: int, version: int, stream: int, snapshot_device: str
) -> Any:
    """The device payloads' sending end over ``descs`` (the tests without a GPU put the kernels' reference here)."""
    return _native.DevicePayloadSender(descs, held, sequence, version, stream, snapshot_device)


def _host_coded_only(recv: RecvFn) -> RecvFn:
    """``recv`` for a host-shared receiver: a device payload (its sender's ``transport_device`` is a GPU) is
    refused by name, weights and version untouched (the arena's applier installs host-coded payloads)."""

    async def checked() -> Any:
        payload = await recv()
        if _is_device_payload(payload):
            raise _native.RlsyncError(
                "a device payload arrived (the sender's transport_device is a GPU and its tensors are CUDA tensors), "
                "but a host-shared receiver installs host-coded payloads into its arena: give the sender "
                "transport_device='cpu' (weights and version untouched)"
            )
        return payload

    return checked


def _streams(devices: list[str]) -> list[int]:
    """The caller's current stream on each of ``devices`` (``cuda:N``, ``cpu``: 0)."""
    torch = _torch()
    return [torch.cuda.current_stream(d).cuda_stream if d.startswith("cuda") else 0 for d in devices]


def _device_kinds(devices: list[str]) -> str:
    """``cuda``, ``cpu`` or ``cuda+cpu``: where a device payloads' receiver installs."""
    kinds = ["cuda"] if any(d.startswith("cuda") for d in devices) else []
    return "+".join(kinds + (["cpu"] if "cpu" in devices else []))


def _timeout(awaited: str, version: int | None, seconds: float) -> Exception:
    """:class:`rlsync.Timeout` with the attributes the native module gives it."""
    err = _native.Timeout(f"timed out after {seconds} s: {awaited}")
    err.awaited = awaited
    err.rank = None
    err.ranks = []
    err.version = version
    err.seconds = seconds
    return err


@dataclass
class CollectiveGroupOptions:
    """RLinf's collective options, as :attr:`WeightSyncer.comm_options` holds them (the fields of RLinf's
    ``rlinf.scheduler.CollectiveGroupOptions``). rlsync's own transports ignore them; they are for the caller's
    broadcast / send / recv, as RLinf passes ``syncer.comm_options`` to its collectives."""

    accel_cluster_size: int | None = None
    accel_max_ctas: int | None = None
    accel_min_ctas: int | None = None
    is_high_priority_stream: bool = False
    use_ring_broadcast: bool = False

    def is_empty_options(self) -> bool:
        """Whether every option is at its default."""
        return self == CollectiveGroupOptions()


def _comm_options(config: Mapping[str, Any]) -> CollectiveGroupOptions | None:
    """RLinf's ``_build_comm_options``: the top-level ``use_ring_sync``, ``nccl_max_ctas`` and ``nccl_min_ctas``
    keys, ``None`` when all are at their defaults."""
    use_ring = config.get("use_ring_sync") or False
    max_ctas = config.get("nccl_max_ctas")
    min_ctas = config.get("nccl_min_ctas")
    if not use_ring and max_ctas is None and min_ctas is None:
        return None
    return CollectiveGroupOptions(use_ring_broadcast=bool(use_ring), accel_max_ctas=max_ctas, accel_min_ctas=min_ctas)


def _rlinf_attribute(name: str, doc: str) -> property:
    """A read-only attribute with RLinf's name, set once by the constructor (setting it later would not reach
    the native syncer, so it is refused)."""
    return property(lambda self: self._attrs[name], doc=doc)


class WeightSyncer:
    """A weight syncer (patch or bucket) for torch state dicts, with RLinf's async interface.

    Create it through :class:`PatchWeightSyncer`, :class:`BucketWeightSyncer` or :meth:`create`. One object
    is either a sender (after :meth:`init_sender`) or a receiver (after :meth:`init_receiver`); an init that
    fails leaves it uninitialised, ready for another. A bucket syncer without a handshake may be both (RLinf's
    tests sync and apply through one object): see :class:`BucketWeightSyncer`.

    ``threads`` is the most CPU threads its diff, coding and install run on (0: every core); the init fits them to
    the state dict, one per 4 MiB at most, so a small policy syncs on one thread without paying for the others.
    """

    def __init__(self, config: Mapping[str, Any], *, threads: int = 0, payload_type: str = "bytes") -> None:
        if payload_type not in ("bytes", "tensor"):
            raise ValueError(f"payload_type must be 'bytes' or 'tensor', got {payload_type!r}")
        self._payload_type = payload_type
        self._config = dict(config)
        self._native = _native.NativeSyncer(json.dumps(self._config), threads)
        self._threads = threads
        # Bucket without a handshake: whether ``_native`` is such a sender, and the receiving end of an object
        # that also sends (RLinf's tests sync and apply through one bucket syncer).
        self._described_sender = False
        self._rx_native: Any = None
        self._active = True
        self._channel: Any = None
        self._comm_options: CollectiveGroupOptions | None = None
        self._attrs: dict[str, Any] = {}
        # Host-shared receiver: this process's reader of the arena, which its model's tensors view.
        self._host_reader: Any = None
        # Device payloads (a patch syncer's ``transport_device="cuda"``, see :class:`PatchWeightSyncer`): the
        # sending end once init chose them, the receiving end once the first one arrived, the synced keys in
        # the sender's order, and the payload tensor a staged device payload reads.
        self._dev_tx: Any = None
        self._dev_rx: Any = None
        self._dev_keys: list[str] = []
        self._dev_staged: Any = None

    @classmethod
    def create(cls, config: Any, *, threads: int = 0) -> "WeightSyncer":
        """Build from an RLinf-shaped ``weight_syncer`` config (dict or OmegaConf ``DictConfig``):
        ``{"type": "patch" | "bucket", "patch": {...}, "bucket": {...}}`` with RLinf's key aliases
        (``patch.compression_algorithm`` before ``patch.compression``, ``init_sync.bucket_size`` before
        ``init_sync.buckets_size``), its top-level ``use_ring_sync`` / ``nccl_max_ctas`` / ``nccl_min_ctas``
        (see :attr:`comm_options`) and rlsync's top-level ``payload_type`` (see :attr:`payload_type`)."""
        try:
            from omegaconf import OmegaConf

            if OmegaConf.is_config(config):
                config = OmegaConf.to_container(config, resolve=True)
        except ImportError:  # pragma: no cover - omegaconf is optional
            pass
        if not isinstance(config, Mapping):
            raise TypeError(f"expected a weight_syncer config (a dict or DictConfig), got {type(config).__name__}")
        config = dict(config)
        kind = config.get("type")
        syncer: WeightSyncer
        if kind == "patch":
            p = dict(config.get("patch") or {})
            if "compression_algorithm" in p:
                p["compression"] = p.pop("compression_algorithm")
            config["patch"] = p
            syncer = PatchWeightSyncer._from_config(config, threads)
        elif kind == "bucket":
            syncer = BucketWeightSyncer._from_config(config, threads)
        else:
            raise ValueError(f"Unsupported weight syncer type: {kind!r} (expected 'patch' or 'bucket')")
        syncer._comm_options = _comm_options(config)
        return syncer

    # -- RLinf's interface ------------------------------------------------------------------------------

    async def init_sender(
        self,
        state_dict: StateDictLike,
        param_names_need_sync: Iterable[str],
        send: SendFn | ShmSender | TcpSender,
        recv: RecvFn | None = None,
        is_sender: bool = True,
        *,
        timeout: float | None = None,
    ) -> None:
        """Sender side of the handshake: read the receiver's metadata (``recv``), check that both state
        dicts match (first differing key, shape or dtype named in :class:`rlsync.HandshakeError`), send the
        plan and, for patch with ``init_sync_enabled``, the init bootstrap; then snapshot the synced keys.

        ``param_names_need_sync`` are the keys every later :meth:`sync` covers (see
        :func:`param_names_need_sync`; tied aliases fold into one). ``send`` may be an rlsync channel end
        (:class:`ShmSender`, :class:`TcpSender`)
        instead of a function (then ``recv`` is not needed). ``is_sender=False`` makes this rank a silent
        participant (as RLinf's non-source actor ranks): it consumes what the receivers send it during init
        (RLinf's rollout rank 0 sends its metadata to every actor rank in turn, and waits for each to take it),
        sends nothing, keeps no snapshot, and its :meth:`sync` sends nothing and returns.

        ``state_dict`` may hold DTensors (FSDP2 shards, e.g. ``get_model_state_dict(model)``): then every rank
        of their mesh calls ``init_sender`` and each :meth:`sync` (those with ``is_sender=False`` too), and each
        call gathers the full tensors there (``full_tensor()``, one all-gather per DTensor in the state dict's
        order) before only the sender sends them. Receivers take plain tensors.

        ``timeout`` bounds the whole init in seconds (``None``: the channel's own bound; with your own
        ``send``/``recv``, the awaits of them), raising :class:`rlsync.Timeout` when it runs out.
        """
        timeout = _check_timeout(timeout)
        state_dict = _materialize(state_dict)  # every actor rank joins the all-gathers, also those that send nothing
        if not is_sender:
            self._active = False
            if recv is not None and not isinstance(send, _CHANNEL_SENDERS):
                # The receivers' metadata, addressed to every actor rank: taken so their sends complete.
                await recv()
            return
        names = list(param_names_need_sync)
        if self._dev_tx is not None:
            # Initialised again: a fresh sender (the device payloads' end and its buffers go).
            self._dev_tx.close()
            self._dev_tx = None
            self._native = _native.NativeSyncer(json.dumps(self._config), self._threads)
        descs = self._stage(state_dict)
        # RLinf's patch syncer checks that both state dicts have the same keys; its bucket syncer loads with
        # strict=False: only the synced keys must match, other keys of either side are left alone.
        same_keys = self._config.get("type") != "bucket"
        if isinstance(send, _CHANNEL_SENDERS):
            self._channel = send
            op = self._native.begin_init_sender(descs, names, send, same_keys, timeout=timeout)
            await asyncio.to_thread(op.run)
            return
        if recv is None:
            if self._config.get("type") != "bucket":
                raise ValueError("init_sender needs a recv function: the receiver's metadata comes through it")
            await self._init_described_sender(descs, names, send, timeout)
            return
        op = self._native.begin_init_sender(descs, names, None, same_keys, timeout=timeout)
        await _drive(op, self._send(send), recv, timeout)
        if self._wants_device_payloads():
            self._start_device_payloads(state_dict)

    def _wants_device_payloads(self) -> bool:
        """Whether this syncer's sends should be device payloads: a patch syncer whose payloads go to ``send`` on
        a CUDA ``transport_device``, uncompressed (compression codes on the host)."""
        device = self._attrs.get("transport_device")
        patch = self._config.get("patch") or {}
        return (
            self._config.get("type") == "patch"
            and device is not None
            and device.type == "cuda"
            and patch.get("compression", "none") == "none"
        )

    def _start_device_payloads(self, state_dict: StateDictLike) -> None:
        """After a handshake over the caller's ``send``/``recv``: where every synced tensor is a CUDA tensor of one
        device, the sends from now on are device payloads, built on that GPU against a snapshot copy there (made
        now from the state, which the receivers hold), and the host end (its snapshot, its host copies) is
        released. Otherwise the payloads stay host-coded."""
        keys = list(self._native.synced_keys)
        descs = _synced(state_dict, keys)
        if not _on_one_gpu(descs):
            return
        stream = _streams([descs[0][6]])[0]
        held = list(self._native.synced_dtypes)
        try:
            self._dev_tx = _device_payload_sender(
                descs, held, self._native.sequence, self._native.version, stream, self._attrs["snapshot_device"].type
            )
        except (_native.CudaError, _native.HandshakeError, ValueError) as exc:
            # The handshake is done and the receivers wait for payloads: host-coded ones still reach them.
            warnings.warn(
                f"device payloads could not start ({exc}); this sender's payloads stay host-coded",
                RuntimeWarning,
                stacklevel=3,
            )
            return
        self._dev_keys = keys
        self._native.retire()

    async def _init_described_sender(
        self, descs: list[tuple], names: list[str], send: SendFn, timeout: float | None = None
    ) -> None:
        """Bucket sender without a handshake (RLinf's ``init_sender`` without ``recv``): nothing is exchanged;
        every :meth:`sync` sends a manifest first. Made again (RLinf may call ``init_sender`` twice), it
        continues the sequence of the one it replaces, so its receivers take its versions."""
        after = 0
        if self._described_sender and self._native.end == "sender":
            after = self._native.sequence
            self._native = _native.NativeSyncer(json.dumps(self._config), self._threads)
        op = self._native.begin_init_sender(descs, names, None, False, described_after=after)
        await _drive(op, self._send(send), None, timeout)
        self._described_sender = True

    async def _init_described_receiver(
        self, state_dict: StateDictLike, recv: RecvFn, timeout: float | None = None
    ) -> None:
        """Bucket receiver without a handshake (RLinf's ``init_receiver`` without ``send``): nothing is
        exchanged; each version's manifest names its keys. On an object that already sends, the receiving end
        is a second one beside it."""
        native = self._native
        if native.end != "uninitialised":
            native = _native.NativeSyncer(json.dumps(self._config), self._threads)
        descs = self._stage(state_dict, native)
        await _drive(native.begin_init_receiver(descs, None, described=True), None, recv, timeout)
        if native is not self._native:
            self._rx_native = native

    async def init_receiver(
        self,
        state_dict: StateDictLike | None,
        recv: RecvFn | ShmReceiver | TcpReceiver,
        send: SendFn | None = None,
        *,
        timeout: float | None = None,
        host_shared: str | None = None,
        max_readers: int = 64,
        verify: bool = True,
    ) -> None:
        """Receiver side of the handshake: send this state dict's metadata (keys, shapes, dtypes) through
        ``send``, receive the plan and, for patch with ``init_sync_enabled``, install the init bootstrap.
        ``recv`` may be an :class:`ShmReceiver` instead of a function (then ``send`` is not needed); on
        rlsync's channel the receiver then reports every version it installs to the sender
        (:meth:`acked_versions`). ``timeout`` bounds the whole init (see :meth:`apply`). ``state_dict`` is
        what :meth:`commit` installs into by default.

        ``host_shared="name"`` makes this the host's one receiver of a host-shared arena (see
        :mod:`rlsync.host_shared`): the arena is created (``/dev/shm/name``, 0600; an existing one is an error)
        laid out like ``state_dict`` (a CPU module, or ``state_dict(keep_vars=True)``: a plain ``state_dict()``
        holds detached tensors, and rebinding those would not reach the module), the init bootstrap goes into it, and
        ``state_dict``'s tensors become views of its active buffer, swapped in place by every :meth:`apply`.
        Other processes of the host attach :class:`rlsync.HostSharedReader` s (at most ``max_readers``, this
        process's own included). :meth:`close` removes the arena (so does dropping the syncer). ``verify``
        (host-shared only): publish the state checksum of the synced keys with every version, which readers hold
        as :attr:`rlsync.HostSharedReader.checksum` (``None`` without); it is hashed while the version's parts
        arrive, but it is one more read of the state per version (20–55 ms at 512 MiB on a 2-core machine:
        README, "Using rlsync from TorchRL")."""
        timeout = _check_timeout(timeout)
        if state_dict is None:
            raise ValueError("init_receiver needs the receiver's state_dict")
        if host_shared is not None:
            await self._init_host_shared(state_dict, recv, send, host_shared, max_readers, verify, timeout)
            return
        descs = self._stage(state_dict)
        self._receiver_state = state_dict
        # Initialised again: device payloads start over from this init's sequence.
        self._dev_rx, self._dev_staged = None, None
        if isinstance(recv, _CHANNEL_RECEIVERS):
            self._channel = recv
            op = self._native.begin_init_receiver(descs, recv, timeout=timeout)
            await asyncio.to_thread(op.run)
            return
        if send is None:
            if self._config.get("type") != "bucket":
                raise ValueError("init_receiver needs a send function: the metadata goes to the sender through it")
            await self._init_described_receiver(state_dict, recv, timeout)
            return
        await _drive(self._native.begin_init_receiver(descs, None, timeout=timeout), self._send(send), recv, timeout)

    async def _init_host_shared(
        self,
        state_dict: StateDictLike,
        recv: RecvFn | ShmReceiver | TcpReceiver,
        send: SendFn | None,
        name: str,
        max_readers: int,
        verify: bool,
        timeout: float | None,
    ) -> None:
        """``init_receiver(..., host_shared=name)``: the applier's init, then this process's reader bound to
        ``state_dict``."""
        from .host_shared import HostSharedReader

        descs = self._stage(state_dict)
        if isinstance(recv, _CHANNEL_RECEIVERS):
            self._channel = recv
            op = self._native.begin_init_host_shared(descs, name, recv, max_readers, bool(verify), timeout)
            await asyncio.to_thread(op.run)
        else:
            if send is None:
                raise ValueError("init_receiver needs a send function: the metadata goes to the sender through it")
            op = self._native.begin_init_host_shared(descs, name, None, max_readers, bool(verify), timeout)
            await _drive(op, self._send(send), recv, timeout)
        self._receiver_state = state_dict
        self._host_reader = HostSharedReader(name, state_dict, timeout=60.0 if timeout is None else timeout)

    async def close(self) -> None:
        """Host-shared receiver: give this process's model a private copy of the held version and remove the
        arena from ``/dev/shm`` (readers attached to it keep their mapping). Otherwise nothing to do."""
        reader, self._host_reader = self._host_reader, None
        if reader is not None:
            reader.close()
            _native.host_shared_unlink(reader.name)

    async def sync(
        self,
        state_dict: StateDictLike,
        send: SendFn | ShmSender | TcpSender,
        version: "int | torch.Tensor",
        *,
        timeout: float | None = None,
        wait: str | None = None,
    ) -> None:
        """Send ``version`` of the synced keys (patch: the changes since the last sync; bucket: all of them).
        ``version`` is any integer >= 0 (or a 0-d integer tensor), as RLinf uses it: 0 first, the same version
        again, jumps. Payloads are ordered by an internal sequence number (one more per ``sync``), so a replayed
        or older payload is still rejected by the receiver.

        ``wait="applied"`` (rlsync's channel only) returns once every live receiver reported installing this
        version (a receiver that aborted it raises :class:`rlsync.RlsyncError` naming it). ``timeout`` bounds
        the whole call in seconds (``None``: the channel's own bound per wait); when it runs out,
        :class:`rlsync.Timeout` names what was awaited (a payload slot's release, or the ack of ``version``
        from the ranks still missing). A sync that times out before its payload went out changes nothing; one
        that times out later counts as sent: a receiver that missed a patch rejects the patches after it."""
        timeout = _check_timeout(timeout)
        if wait not in (None, "applied"):
            raise ValueError(f"wait must be None or 'applied', got {wait!r}")
        state_dict = _materialize(state_dict)  # every actor rank joins the all-gathers, also those that send nothing
        if not self._active:
            return
        version = _version(version)
        if self._dev_tx is not None:
            if wait == "applied":
                raise _native.RlsyncError(
                    "sync(wait='applied') needs acknowledgements, which need an rlsync channel; device payloads go "
                    "through your send"
                )
            await self._device_sync(state_dict, send, version, timeout)
            return
        descs = self._stage(state_dict)
        if self._native.on_shm:
            self._check_channel(send)
            op = self._native.begin_sync(descs, version, timeout, wait == "applied")
            await asyncio.to_thread(op.run)
        else:
            op = self._native.begin_sync(descs, version, None, wait == "applied")
            await _drive(op, self._send(send), None, timeout)

    async def _device_sync(self, state_dict: StateDictLike, send: SendFn, version: int, timeout: float | None) -> None:
        """One device payload: built on the GPU, written into a uint8 CUDA tensor allocated here (on the state's
        device, on the current stream), moved to ``transport_device`` where that names another GPU, sent. A send
        that fails or times out makes the next payload a full one (the receivers may not have this one)."""
        torch = _torch()
        descs = _synced(state_dict, self._dev_keys)
        device = descs[0][1].device
        stream = _streams([descs[0][6]])[0]
        size = self._dev_tx.build(descs, stream, version)
        payload = torch.empty(size, dtype=torch.uint8, device=device)
        self._dev_tx.fill(payload.data_ptr(), size)
        target = self._attrs["transport_device"]
        if target.index is not None and target != device:
            payload = payload.to(target)
        try:
            if timeout is None:
                await send(payload)
            else:
                try:
                    await asyncio.wait_for(send(payload), timeout)
                except asyncio.TimeoutError:
                    raise _timeout(f"send of version {version}, waiting on your send", version, timeout) from None
        except BaseException:
            self._dev_tx.lost()
            raise

    async def _device_install(self, model: StateDictLike, payload: Any, commit: bool = True) -> int:
        """Verify a device payload (checksums over the payload before anything is written) and, with ``commit``,
        install it into ``model``'s tensors: on their GPU, or on the CPU (the same checks and writes, by the
        kernels' reference) where they are CPU tensors; a model on several devices takes one copy of the payload
        per device, each checked there before any is installed. Its version. Without ``commit`` the payload
        copies are kept for :meth:`commit`."""
        torch = _torch()
        keys = self._dev_keys or list(self._native.synced_keys)
        descs = _synced(model, keys)
        if self._dev_rx is None or self._dev_rx.sequence < self._native.sequence:
            # Made at the first device payload, from what the host end installed last (again if the host end
            # installed since: the sender's payloads continue its sequence).
            self._dev_rx = _native.DevicePayloadReceiver(descs, self._native.sequence, self._native.version)
            self._dev_keys = keys
        if not isinstance(payload, torch.Tensor):
            payload = torch.frombuffer(bytearray(_as_bytes(payload)), dtype=torch.uint8)
        payload = payload.detach().reshape(-1)
        copies = []
        for name in self._dev_rx.devices:
            copy = payload if payload.device == torch.device(name) else payload.to(name)
            if not copy.is_contiguous() or copy.data_ptr() % 8:
                copy = copy.clone()
            copies.append(copy)
        streams = _streams(self._dev_rx.devices)
        self._dev_staged = None
        version = self._dev_rx.stage([(c.data_ptr(), c.numel()) for c in copies], descs, streams)
        if not commit:
            self._dev_staged = copies
            return version
        return self._dev_rx.commit(descs, streams)

    async def flush(self, *, timeout: float | None = None) -> None:
        """Sender on rlsync's shm channel: wait until every receiver has released every payload sent so far.
        Await it before the sender goes away (a trainer's last sync, then exit): the channel's shared memory is
        removed with the sender, and a receiver that had not mapped it yet would fail with "the sender is
        gone". With your own ``send``/``recv`` delivery is your transport's, and this returns at once.
        ``timeout`` bounds it (:class:`rlsync.Timeout` naming the receivers that did not release)."""
        timeout = _check_timeout(timeout)
        if not self._active:
            return
        if self._native.on_shm:
            await asyncio.to_thread(self._native.begin_flush(timeout).run)

    async def apply(
        self,
        model: StateDictLike | None = None,
        recv: RecvFn | ShmReceiver | TcpReceiver | None = None,
        *,
        model_or_state_dict: StateDictLike | None = None,
        timeout: float | None = None,
    ) -> int:
        """Receive the next version, verify it completely, install it in place and return its number.
        A rejected payload raises :class:`rlsync.PayloadRejected` and changes nothing. ``apply`` is
        :meth:`stage` then :meth:`commit` in one call.

        ``model`` is a ``torch.nn.Module`` or its state dict (RLinf's parameter name; the older keyword
        ``model_or_state_dict`` is still accepted).

        ``timeout`` bounds the whole call in seconds (``None``: the channel's own bound; with your own
        ``recv``, the awaits of it). When it runs out :class:`rlsync.Timeout` is raised
        (``awaited="payload of version after N from the sender"``) and weights and version are untouched. A
        receiver whose apply timed out before any byte of the next payload arrived is still usable: call
        ``apply`` again later (poll with a short timeout). On rlsync's channel that holds after any timeout: a
        bucket version cut short midway is dropped whole and its remaining parts are skipped by the next call.
        With your own ``recv``, the awaited ``recv()`` was cancelled: what it would have returned is your
        transport's to keep or drop."""
        if model_or_state_dict is not None:
            if model is not None:
                raise TypeError("apply() got both 'model' and 'model_or_state_dict': pass one")
            model = model_or_state_dict
        if model is None:
            raise TypeError("apply() missing required argument: 'model'")
        if recv is None:
            raise TypeError("apply() missing required argument: 'recv'")
        timeout = _check_timeout(timeout)
        if self._host_reader is not None:
            return await self._apply_host_shared(recv, timeout)
        native = self._receiving(recv)
        if native is None:
            # A bucket syncer that has not received before (RLinf's tests apply on the object that sent):
            # its receiving end is made now, without a handshake, over ``model``.
            await self._init_described_receiver(model, recv, timeout)
            native = self._rx_native or self._native
        descs = self._stage(model, native)
        if native.on_shm:
            self._check_channel(recv)
            return await asyncio.to_thread(native.begin_apply(descs, timeout).run)
        if self._dev_rx is not None and self._dev_rx.staged_version is not None:
            raise _native.RlsyncError("a version is staged: commit() or abort() it before apply()")
        try:
            return await _drive(native.begin_apply(descs), None, self._watched(recv), timeout)
        except _DeviceArrived as arrived:
            return await self._device_install(model, arrived.payload)

    def _watched(self, recv: RecvFn) -> RecvFn:
        """``recv`` for a patch receiver over the caller's transport: a device payload (its sender's
        ``transport_device`` is a GPU) ends the host op (:class:`_DeviceArrived`) and is installed on the GPU."""
        if self._config.get("type") != "patch":
            return recv

        async def watched() -> Any:
            payload = await recv()
            if _is_device_payload(payload):
                raise _DeviceArrived(payload)
            return payload

        return watched

    async def _apply_host_shared(self, recv: Any, timeout: float | None) -> int:
        """A host-shared receiver's apply: wait for the back buffer (readers leave it between their steps),
        install the next version there, publish it, and swap this process's model to it."""
        wait = 60.0 if timeout is None else timeout
        op = self._native.begin_apply_host_shared(wait, timeout)
        if self._native.on_shm:
            self._check_channel(recv)
            version = await asyncio.to_thread(op.run)
        else:
            version = await _drive(op, None, _host_coded_only(recv), timeout)
        self._host_reader.refresh()
        return version

    def _refuse_host_shared(self, what: str) -> None:
        if self._host_reader is not None:
            raise _native.RlsyncError(
                f"{what}: a host-shared receiver installs in apply() only (it publishes each version to the host's readers)"
            )

    @property
    def host_shared(self) -> "Any":
        """This process's :class:`rlsync.HostSharedReader` of the arena it receives into (``None``: not a
        host-shared receiver)."""
        return self._host_reader

    def _receiving(self, recv: Any) -> Any:
        """The native end that applies: the receiver, the receiving end beside a sender, or ``None`` where a
        bucket syncer's receiving end is still to be made (not initialised as a receiver, no rlsync channel)."""
        if self._rx_native is not None:
            return self._rx_native
        if self._native.end == "receiver":
            return self._native
        bucket = self._config.get("type") == "bucket"
        if bucket and not isinstance(recv, _CHANNEL_RECEIVERS) and self._native.end in ("uninitialised", "sender"):
            return None
        return self._native

    async def stage(self, recv: RecvFn | ShmReceiver | TcpReceiver, *, timeout: float | None = None) -> int:
        """Receive the next version and verify it completely without touching the model; it is kept staged in
        rlsync's own memory (a patch's decoded values, or a bucket version's copy) until :meth:`commit` installs
        it or :meth:`abort` drops it. Returns its version. ``timeout`` as in :meth:`apply`. Staging again, or
        :meth:`apply`, while a version is staged raises :class:`rlsync.RlsyncError`."""
        timeout = _check_timeout(timeout)
        if recv is None:
            raise TypeError("stage() missing required argument: 'recv'")
        self._refuse_host_shared("stage")
        native = self._rx_native or self._native
        if native.on_shm:
            self._check_channel(recv)
            return await asyncio.to_thread(native.begin_stage(timeout).run)
        if self._dev_rx is not None and self._dev_rx.staged_version is not None:
            raise _native.RlsyncError("a version is already staged: commit() or abort() it first")
        try:
            return await _drive(native.begin_stage(), None, self._watched(recv), timeout)
        except _DeviceArrived as arrived:
            model = getattr(self, "_receiver_state", None)
            if model is None:
                raise TypeError("stage() of a device payload needs the state dict given to init_receiver") from None
            return await self._device_install(model, arrived.payload, commit=False)

    async def commit(self, model: StateDictLike | None = None) -> int:
        """Install the staged version in place (into ``model``, by default the state dict given to
        :meth:`init_receiver`) and return it; on rlsync's channel the sender learns of it
        (:meth:`acked_versions`). Without a staged version: :class:`rlsync.RlsyncError`. A staged version that
        no longer fits (a newer one was installed meanwhile) raises :class:`rlsync.PayloadRejected`."""
        self._refuse_host_shared("commit")
        if model is None:
            model = getattr(self, "_receiver_state", None)
            if model is None:
                raise TypeError("commit() needs the model: this syncer was not initialised as a receiver")
        if self._dev_rx is not None and self._dev_rx.staged_version is not None:
            descs = _synced(model, self._dev_keys)
            try:
                return self._dev_rx.commit(descs, _streams(self._dev_rx.devices))
            finally:
                self._dev_staged = None
        native = self._rx_native or self._native
        descs = self._stage(model, native)
        op = native.begin_commit(descs)
        if native.on_shm:
            return await asyncio.to_thread(op.run)
        return await _drive(op, None, None)

    async def abort(self, reason: str) -> None:
        """Drop the staged version (weights and version untouched). On rlsync's channel the sender is told
        ``reason`` and counts it (:meth:`rejections`); its acknowledged version for this receiver does not
        advance. A patch syncer's next patch builds on the dropped version, so the receiver rejects it
        (:class:`rlsync.PayloadRejected`, "a full resync is needed"); a bucket syncer's next version installs
        as usual. Without a staged version: :class:`rlsync.RlsyncError`."""
        self._refuse_host_shared("abort")
        if self._dev_rx is not None and self._dev_rx.staged_version is not None:
            # Over your own transport nobody hears of it: the next patch then fails its base check.
            self._dev_rx.abort()
            self._dev_staged = None
            return
        native = self._rx_native or self._native
        op = native.begin_abort(str(reason))
        if native.on_shm:
            await asyncio.to_thread(op.run)
        else:
            await _drive(op, None, None)

    @property
    def staged_version(self) -> int | None:
        """The version :meth:`stage` holds, not yet committed or aborted (``None``: nothing is staged)."""
        if self._dev_rx is not None and self._dev_rx.staged_version is not None:
            return self._dev_rx.staged_version
        return (self._rx_native or self._native).staged_version

    def acked_versions(self) -> dict[int, int]:
        """Sender on rlsync's channel: the version each live receiver reported installing last, by rank (a
        receiver that went away is left out; one that has not installed any version yet is absent). Over your
        own ``send``/``recv`` this raises :class:`rlsync.RlsyncError`: acknowledgements need an rlsync channel;
        so does calling it while another operation (a ``sync``) runs on this syncer."""
        if not self._active:
            return {}
        return dict(self._native.acked_versions())

    def rejections(self) -> dict[int, int]:
        """Sender on rlsync's channel: how many staged versions each receiver aborted (:meth:`abort`), by rank."""
        if not self._active:
            return {}
        return dict(self._native.rejections())

    def last_rejection(self) -> tuple[int, int, str] | None:
        """Sender on rlsync's channel: the last aborted version as ``(rank, version, reason)``, if any."""
        if not self._active:
            return None
        return self._native.last_rejection()

    def _send(self, send: SendFn) -> SendFn:
        """``send`` as this syncer's ``payload_type`` wants it: payloads as ``bytes`` or as uint8 tensors (on
        the ``transport_device`` of a patch syncer that names a CUDA device)."""
        device = self._attrs.get("transport_device")
        if device is not None and device.type == "cuda":
            return _tensor_send(send, device)
        return _tensor_send(send) if self._payload_type == "tensor" else send

    def _stage(self, state_dict: StateDictLike, native: Any = None) -> list[tuple]:
        """Describe ``state_dict`` for the native module (``native``: the end that takes it, by default this
        syncer's); with CUDA tensors, the native side also takes the caller's current stream of their device, so
        its copies and kernels follow the work queued on it."""
        descs = _describe(state_dict)
        for d in descs:
            if d[6].startswith("cuda"):
                import torch

                (native or self._native).use_stream(torch.cuda.current_stream(d[1].device).cuda_stream)
                break
        return descs

    # -- rlsync's extras --------------------------------------------------------------------------------

    @property
    def version(self) -> int:
        """Sender: the last version sent. Receiver: the version applied. 0 before the first sync."""
        device = self._dev_tx if self._dev_tx is not None else self._device_rx_ahead()
        return device.version if device is not None else self._native.version

    def _device_rx_ahead(self) -> Any:
        """The device payloads' receiving end where it installed the latest version (a later sequence than the
        host end's), else ``None``."""
        rx = self._dev_rx
        return rx if rx is not None and rx.sequence > self._native.sequence else None

    @property
    def synced_keys(self) -> list[str]:
        """The keys each sync covers (one name per tied group), known after init."""
        if self._dev_tx is not None:
            return list(self._dev_keys)
        return self._native.synced_keys

    def checksum(self, state_dict: StateDictLike) -> int:
        """xxh3 checksum of the synced keys. A receiver's equals its sender's after every applied version
        (a patch sender's is of its snapshot: what the receivers hold; with device payloads hashed on its GPU)."""
        if self._dev_tx is not None:
            return self._dev_tx.checksum()
        return self._native.checksum(self._stage(state_dict))

    def last_report(self) -> dict[str, Any]:
        """Sizes and timings of the last finished init / sync / apply (bytes, elements, seconds). With device
        payloads ``device`` is ``"cuda (device payload)"``, and the report has ``full`` (a full payload),
        ``sequence``, the sender's ``build_s`` / ``fill_s`` or the receiver's ``read_s`` / ``check_s`` /
        ``apply_s``."""
        device = self._dev_tx if self._dev_tx is not None else self._device_rx_ahead()
        if device is not None:
            report = dict(device.last_report())
            if report:
                where = "cuda" if self._dev_tx is not None else _device_kinds(self._dev_rx.devices)
                report.update(device=f"{where} (device payload)", kind="patch")
                return report
        return self._native.last_report()

    @property
    def payload_type(self) -> str:
        """What ``send`` is handed: ``"bytes"`` (the default) or ``"tensor"``, a 1-D uint8 ``torch.Tensor`` on
        the CPU, or on the ``transport_device`` of a patch syncer that names a CUDA device (always tensors then),
        for transports with a tensor path, such as RLinf's collectives. ``recv`` may return either, whatever
        this is; a uint8 tensor on any device is read through torch (numpy is not needed)."""
        device = self._attrs.get("transport_device")
        if device is not None and device.type == "cuda":
            return "tensor"
        return self._payload_type

    @property
    def comm_options(self) -> CollectiveGroupOptions | None:
        """RLinf's collective options, built by :meth:`create` from the config's top-level ``use_ring_sync``,
        ``nccl_max_ctas`` and ``nccl_min_ctas`` (:class:`CollectiveGroupOptions`); ``None`` when all are at
        their defaults or the syncer was constructed directly. rlsync's own transports (its shm channel) ignore
        them: they are for the caller's ``send`` / ``recv``."""
        return self._comm_options

    def sender_initialized(self) -> bool:
        return self._native.end == "sender" or not self._active

    def receiver_initialized(self) -> bool:
        return self._native.end == "receiver" or self._rx_native is not None or self._host_reader is not None

    def _check_channel(self, end: Any) -> None:
        if end is not self._channel:
            raise ValueError("this syncer runs on the shm channel it was initialised with: pass that channel end")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(end={self._native.end!r}, version={self.version})"


def _device(value: Any, what: str) -> str:
    name = "cpu" if value is None else str(value)
    kind = name.split(":")[0]
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"{what}: unsupported device {name!r} (rlsync syncs CPU and CUDA tensors)")
    return kind


def _torch() -> Any:
    import torch

    return torch


def _torch_device(value: Any) -> Any:
    """RLinf's ``normalize_device``, with rlsync's default: ``None`` is the CPU."""
    torch = _torch()
    if isinstance(value, torch.device):
        return value
    return torch.device("cpu" if value is None else str(value))


def _dtype_name(dtype: Any, what: str = "bucket_dtype") -> str | None:
    """The name of a floating dtype given as a ``torch.dtype`` or a name (``bf16``, ``"bfloat16"``, ...); ``what``
    names the argument in the error."""
    if dtype is None:
        return None
    name = str(dtype).removeprefix("torch.").lower()
    aliases = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}
    name = aliases.get(name, name)
    if name not in ("bfloat16", "float16", "float32"):
        raise ValueError(f"{what} must be None, torch.bfloat16, torch.float16 or torch.float32, got {dtype!r}")
    return name


class PatchWeightSyncer(WeightSyncer):
    """Incremental sync: the sender keeps a snapshot (in the receivers' dtypes) and sends only the elements
    that changed since the last version, delta-coded (``delta_encoding``) and optionally LZ4-compressed
    (``compression_algorithm="lz4"``). An unchanged state still sends an empty patch carrying its version.

    The arguments are RLinf's. Either end's tensors may be CPU or CUDA tensors (CUDA ones of one device per
    state dict, contiguous; see :func:`rlsync.cuda_available`). ``snapshot_device`` (``"cpu"``, the default,
    or ``"cuda"``) is where a sender of CUDA tensors keeps its snapshot; ``transport_device`` is where the
    payloads handed to ``send`` live (``None`` or ``"cpu"``: on the host; ``"cuda"`` / ``"cuda:N"``: as 1-D uint8
    CUDA tensors, ready for a collective's GPU path, whatever ``payload_type`` says — the payload is still coded
    and verified on the host, the same bytes); ``init_sync_enabled`` bootstraps the receiver with the sender's values of the whole
    state dict (or the keys under ``init_sync_prefixes``) during init, frozen parameters included.
    """

    def __init__(
        self,
        snapshot_device: Any = "cpu",
        transport_device: Any = None,
        delta_encoding: bool = True,
        compression_algorithm: str = "none",
        init_sync_enabled: bool = False,
        init_sync_prefixes: list[str] | None = None,
        init_sync_bucket_size: int = 128 * 1024 * 1024,
        *,
        threads: int = 0,
        payload_type: str = "bytes",
    ) -> None:
        transport = _transport(transport_device)
        if compression_algorithm not in ("none", "lz4", "nvcomp_lz4"):
            raise ValueError(f"compression_algorithm must be 'none' or 'lz4', got {compression_algorithm!r}")
        if int(init_sync_bucket_size) <= 0:
            raise ValueError(f"init_sync_bucket_size must be a positive number of bytes, got {init_sync_bucket_size}")
        if init_sync_enabled and init_sync_prefixes is not None and len(init_sync_prefixes) == 0:
            raise ValueError("Patch init sync prefixes must not be empty (None syncs the whole state dict)")
        config = {
            "type": "patch",
            "patch": {
                "snapshot_device": _device(snapshot_device, "snapshot_device"),
                # Where payloads are handed over is this binding's business (see `_send`): the core codes them
                # on the host either way.
                "transport_device": "cpu",
                "delta_encoding": bool(delta_encoding),
                "compression": compression_algorithm,
                "init_sync": {
                    "enabled": bool(init_sync_enabled),
                    "prefixes": None if init_sync_prefixes is None else [str(p) for p in init_sync_prefixes],
                    "bucket_size": int(init_sync_bucket_size),
                },
            },
        }
        super().__init__(config, threads=threads, payload_type=payload_type)
        self._attrs = {
            "snapshot_device": _torch_device(snapshot_device),
            "transport_device": transport,
            "delta_encoding": delta_encoding,
            "compression_algorithm": compression_algorithm,
            "init_sync_enabled": init_sync_enabled,
            "init_sync_prefixes": None if init_sync_prefixes is None else [str(p) for p in init_sync_prefixes],
            "init_sync_bucket_size": init_sync_bucket_size,
        }

    snapshot_device = _rlinf_attribute("snapshot_device", "Where the sender keeps its snapshot (a ``torch.device``).")
    transport_device = _rlinf_attribute(
        "transport_device", "Where payloads are staged (a ``torch.device``; ``None`` at construction means CPU)."
    )
    delta_encoding = _rlinf_attribute("delta_encoding", "Whether patch indices are delta-coded.")
    compression_algorithm = _rlinf_attribute("compression_algorithm", "``none``, ``lz4`` or ``nvcomp_lz4``.")
    init_sync_enabled = _rlinf_attribute("init_sync_enabled", "Whether init bootstraps the receiver's values.")
    init_sync_prefixes = _rlinf_attribute(
        "init_sync_prefixes", "Key prefixes the init bootstrap covers (``None``: the whole state dict)."
    )
    init_sync_bucket_size = _rlinf_attribute("init_sync_bucket_size", "Bytes per init bootstrap bucket.")

    @classmethod
    def _from_config(cls, config: dict, threads: int) -> "PatchWeightSyncer":
        p = config.get("patch") or {}
        init = p.get("init_sync") or {}
        return cls(
            snapshot_device=p.get("snapshot_device", "cpu"),
            transport_device=p.get("transport_device"),
            delta_encoding=p.get("delta_encoding", True),
            compression_algorithm=p.get("compression", "none"),
            init_sync_enabled=init.get("enabled", False),
            init_sync_prefixes=init.get("prefixes"),
            init_sync_bucket_size=init.get("bucket_size", init.get("buckets_size", 128 * 1024 * 1024)),
            threads=threads,
            payload_type=config.get("payload_type", "bytes"),
        )


class BucketWeightSyncer(WeightSyncer):
    """Dense sync: every synced tensor is sent in full, in buckets of at most ``bucket_size`` bytes (a
    tensor is never split). ``bucket_dtype`` (``None``, ``torch.bfloat16``, ``torch.float16`` or
    ``torch.float32``) casts floating tensors only on the wire; integer and bool buffers keep their dtype.
    With ``load_instant`` each verified bucket is installed as it arrives (undone if a later bucket of the
    same version fails), otherwise the whole version is staged and installed at the end.

    The arguments are RLinf's; ``is_agent`` is accepted and ignored. ``bucket_device="cuda"`` packs the
    buckets of a sender's CUDA tensors on the GPU (cast to ``bucket_dtype`` there, floating tensors only) into
    pinned host buffers, bucket k + 1 while bucket k is sent, with the same wire bytes as ``"cpu"`` and no host
    copy of the whole state; CPU tensors (a mixed or a CPU state dict) are staged on the host as with
    ``"cpu"``. A receiver with ``bucket_device="cuda"`` verifies each whole version on the host, then writes
    its CUDA tensors on the GPU (cast there where the wire dtype differs); with ``"cpu"`` it writes them
    through host copies.

    As RLinf's, it needs no handshake: :meth:`init_sender` without ``recv`` and :meth:`init_receiver` without
    ``send`` exchange nothing, and each version then starts with a manifest (names, shapes, wire and target
    dtypes; checksummed like every payload), so corrupt, truncated, replayed and stale versions are still
    rejected whole. Receiver keys the sender does not send keep their values (RLinf's ``strict=False``); a sent
    key the receiver lacks, another shape or a dtype that does not convert is a :class:`rlsync.PayloadRejected`
    naming the key, before anything is written. Both ends of a pair choose alike: with ``recv`` / ``send``
    (RLinf's workers pass both) they hold the handshake, which checks the synced keys up front. Without a
    handshake one object can also apply: :meth:`apply` on a syncer not initialised as a receiver makes its
    receiving end then, over the model it is given.
    """

    def __init__(
        self,
        bucket_size: int = 512 * 1024 * 1024,
        bucket_dtype: Any = None,
        bucket_device: Any = "cpu",
        is_agent: bool = False,
        load_instant: bool = True,
        *,
        threads: int = 0,
        payload_type: str = "bytes",
    ) -> None:
        if int(bucket_size) <= 0:
            raise ValueError(f"bucket_size must be a positive number of bytes, got {bucket_size}")
        config = {
            "type": "bucket",
            "bucket": {
                "bucket_size": int(bucket_size),
                "bucket_dtype": _dtype_name(bucket_dtype),
                "bucket_device": _device(bucket_device, "bucket_device"),
                "is_agent": bool(is_agent),
                "load_instant": bool(load_instant),
            },
        }
        super().__init__(config, threads=threads, payload_type=payload_type)
        dtype_name = config["bucket"]["bucket_dtype"]
        self._attrs = {
            "bucket_size": bucket_size,
            "bucket_dtype": None if dtype_name is None else getattr(_torch(), dtype_name),
            "bucket_device": _torch_device(bucket_device),
            "is_agent": is_agent,
            "load_instant": load_instant,
        }

    bucket_size = _rlinf_attribute("bucket_size", "Most bytes per bucket (a tensor is never split).")
    bucket_dtype = _rlinf_attribute(
        "bucket_dtype", "The wire dtype of floating tensors (a ``torch.dtype``), ``None``: their own."
    )
    bucket_device = _rlinf_attribute("bucket_device", "Where buckets are staged (a ``torch.device``).")
    is_agent = _rlinf_attribute("is_agent", "RLinf's agent key rewriting flag (accepted, ignored).")
    load_instant = _rlinf_attribute("load_instant", "Whether each verified bucket is installed as it arrives.")

    @classmethod
    def _from_config(cls, config: dict, threads: int) -> "BucketWeightSyncer":
        b = config.get("bucket") or {}
        return cls(
            bucket_size=b.get("bucket_size", 512 * 1024 * 1024),
            bucket_dtype=b.get("bucket_dtype"),
            bucket_device=b.get("bucket_device", "cpu"),
            is_agent=b.get("is_agent", False),
            load_instant=b.get("load_instant", True),
            threads=threads,
            payload_type=config.get("payload_type", "bytes"),
        )


async def shm_sender(
    socket_path: str,
    receivers: int,
    *,
    timeout: float = 60.0,
    slots: int = 4,
    segment_prefix: str = "rlsync",
    elastic: bool = False,
    wait_for: int | None = None,
) -> ShmSender:
    """Open rlsync's shared-memory channel (1 -> ``receivers`` on this host) for a sender: bind the Unix
    socket ``socket_path`` and wait until every receiver joined (each wait bounded by ``timeout`` seconds).
    Pass the result as ``send`` to :meth:`WeightSyncer.init_sender` and :meth:`WeightSyncer.sync`.

    ``elastic=True``: the channel outlives its receivers. One that dies is dropped (syncs go on to the others;
    :meth:`WeightSyncer.acked_versions` leaves it out), and a receiver that connects later for a rank (a
    restart, or a rank that was not there yet: ``wait_for`` receivers suffice to start) is caught up at the
    sender's next :meth:`WeightSyncer.sync`, by replaying the sender's logged patches when they cover what it
    holds, else by a full transfer; its :meth:`WeightSyncer.init_receiver` returns once caught up."""
    return await asyncio.to_thread(
        _native.shm_bind, socket_path, receivers, timeout, slots, segment_prefix, elastic, wait_for
    )


async def shm_receiver(socket_path: str, rank: int, *, timeout: float = 60.0) -> ShmReceiver:
    """Join rlsync's shared-memory channel at ``socket_path`` as receiver ``rank`` (``0..receivers``).
    Pass the result as ``recv`` to :meth:`WeightSyncer.init_receiver` and :meth:`WeightSyncer.apply`."""
    return await asyncio.to_thread(_native.shm_connect, socket_path, rank, timeout)


async def tcp_sender(
    bind: str,
    receivers: int,
    *,
    token: str | bytes,
    timeout: float = 60.0,
    slots: int = 4,
    elastic: bool = False,
    wait_for: int | None = None,
) -> TcpSender:
    """Open rlsync's TCP channel across hosts (1 -> ``receivers``) for a sender: listen on ``bind``
    (``"host:port"``) and wait until every receiver connected and proved ``token`` (the run's shared secret; it
    never crosses the wire), each wait bounded by ``timeout`` seconds. A peer without the token is refused and
    the sender keeps waiting for the right one. Same semantics as :func:`shm_sender`: pass the result as
    ``send`` to :meth:`WeightSyncer.init_sender` / :meth:`WeightSyncer.sync`; acknowledgements, per-call
    timeouts, and a receiver whose connection ends named at once (:class:`rlsync.TransportError`).

    ``elastic=True``: as :func:`shm_sender`'s, the channel outlives its receivers and keeps listening. One that
    goes away is dropped (syncs go on to the others), and a receiver that connects later for a rank (a restart,
    or a rank that was not there yet: ``wait_for`` receivers suffice to start) proves the token, is admitted,
    and is caught up at the sender's next :meth:`WeightSyncer.sync` by patch replay or a full transfer; its
    :meth:`WeightSyncer.init_receiver` returns once caught up. The listening socket closes with the channel."""
    return await asyncio.to_thread(
        _native.tcp_bind, bind, receivers, _token(token), timeout, slots, elastic, wait_for
    )


async def tcp_receiver(addr: str, rank: int, *, token: str | bytes, timeout: float = 60.0) -> TcpReceiver:
    """Join rlsync's TCP channel at the sender's ``addr`` (``"host:port"``) as receiver ``rank``
    (``0..receivers``), retrying until the sender listens (bounded by ``timeout``). Pass the result as ``recv``
    to :meth:`WeightSyncer.init_receiver` and :meth:`WeightSyncer.apply` / :meth:`WeightSyncer.stage`."""
    return await asyncio.to_thread(_native.tcp_connect, addr, rank, _token(token), timeout)


def _token(token: str | bytes) -> bytes:
    if isinstance(token, str):
        token = token.encode()
    if not isinstance(token, (bytes, bytearray)) or not token:
        raise ValueError("token must be a non-empty str or bytes (the run's shared secret)")
    return bytes(token)
