"""rlsync as a TorchRL weight-sync scheme: ``weight_sync_schemes={"policy": RlsyncWeightSyncScheme()}``.

A TorchRL collector (``Collector``, ``MultiSyncCollector``, ``MultiAsyncCollector``) takes this scheme where it
takes TorchRL's own (``MultiProcessWeightSyncScheme``, ``SharedMemWeightSyncScheme``); after ``import
rlsync.torchrl`` it is also ``WeightSyncScheme.from_backend("rlsync")``. It moves the policy's weights with
rlsync's syncers over rlsync's shared-memory channel (one host) or its authenticated TCP channel (across hosts):

- ``strategy="patch"`` (default): each update sends only the elements that changed since the last one, delta-coded
  (and LZ4-compressed with ``compression_algorithm="lz4"``); ``strategy="bucket"``: every tensor, in buckets.
- Every update is checksummed and all-or-nothing: a corrupt, replayed or stale payload is rejected and the
  worker keeps its whole previous version (no partial update).
- ``send`` returns once every worker installed the version (``sync=True``, the default), bounded by ``timeout``
  (``TORCHRL_WEIGHT_SYNC_TIMEOUT``, else 120 s): a dead worker is named in the error at once, a stuck one after
  the timeout, instead of a hang. :meth:`RlsyncWeightSyncScheme.acked_versions` says which version each worker
  runs.
- Workers install in place (parameters keep their identity) and bump the collector's ``PolicyVersion`` once per
  update. CPU policies that TorchRL placed in shared memory are first given their own storage in the worker
  (otherwise the trainer's writes would reach the rollouts mid-update and the sync would do nothing).
- ``host_shared=True`` (one host, ``transport="shm"``, patch or bucket): the workers act on ONE double-buffered
  copy of the weights in shared memory (:mod:`rlsync.host_shared`) instead of one copy each. Worker 0 is the
  host's only receiver on rlsync's channel and applies each version to the back buffer; every worker's
  parameters are views of the active buffer, swapped to the new one (``param.data = view``, identity kept) by
  its background thread as soon as it is published. ``send`` returns once every worker reported acting on the
  version (the applier after installing and publishing it, the others after swapping to it; a dead one is named
  after ``timeout``); a worker slow to swap off the back buffer only delays the next version. The views are
  read-only memory. The swap runs on the worker's background thread (TorchRL's own schemes install
  from a thread too): a forward pass running at that moment may read some tensors of the old version and some
  of the new one, each tensor whole.

Lifecycle (as TorchRL's): ``init_on_sender`` / ``init_on_receiver`` do no communication and the scheme can be
pickled into the workers between init and ``connect``; ``connect`` is the rendezvous that delivers the initial
weights; a background thread in each worker installs later versions as they arrive; ``shutdown`` releases the
channel (nothing is left in ``/dev/shm``). TorchRL's collectors do not shut their schemes down (neither the
trainer's nor the workers'), so each process also does it when it exits: a worker stops its background thread
before the interpreter finalizes (a thread still inside rlsync then would abort the process with "FATAL:
exception not rethrown") and the applier removes the arena; the trainer removes the arena it named.

Known limit: with the ``fork`` start method (TorchRL's default is ``spawn``), workers forked from a trainer that
already used rlsync in that process (a second collector) cannot use it: rlsync's native runtime does not survive
``fork`` and their connect never completes (the trainer's ``connect`` fails after ``timeout``).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import tempfile
import time
import threading
import uuid
import weakref
from collections.abc import Mapping
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn
from torchrl._utils import logger as torchrl_logger
from torchrl.weight_update.utils import _resolve_model
from torchrl.weight_update.weight_sync_schemes import WeightSyncScheme, register_weight_sync_backend

from . import _native, host_shared
from ._blocking import Runner
from .syncer import (
    BucketWeightSyncer,
    PatchWeightSyncer,
    WeightSyncer,
    shm_receiver,
    shm_sender,
    tcp_receiver,
    tcp_sender,
)

__all__ = ["RlsyncWeightSyncScheme"]

_POLL_S = 0.5
"""How long the worker's background receiver waits for a version before it checks whether to stop."""


def _shutdown_at_exit(ref: "weakref.ReferenceType[RlsyncWeightSyncScheme]") -> None:
    """Run at interpreter exit (see :meth:`RlsyncWeightSyncScheme._shutdown_at_exit`)."""
    scheme = ref()
    if scheme is None:
        return
    try:
        scheme.shutdown()
    except Exception as exc:  # exit goes on; say what was left
        torchrl_logger.warning(f"RlsyncWeightSyncScheme: shutdown at exit failed: {exc!r}")


def _default_timeout() -> float:
    raw = os.environ.get("TORCHRL_WEIGHT_SYNC_TIMEOUT", "120")
    try:
        value = float(raw)
    except ValueError as exc:
        raise ValueError(f"TORCHRL_WEIGHT_SYNC_TIMEOUT must be a number of seconds, got {raw!r}") from exc
    if value <= 0:
        raise ValueError(f"TORCHRL_WEIGHT_SYNC_TIMEOUT must be positive, got {raw!r}")
    return value


def _flat(weights: Any) -> dict[str, torch.Tensor]:
    """The weights as ``{dotted name: tensor}`` over the same storage (no copy); TorchRL's extra state
    (``__extra_state__``) travels with them when it holds tensors."""
    if isinstance(weights, nn.Module):
        weights = TensorDict.from_module(weights)
    if isinstance(weights, TensorDictBase):
        flat = weights.flatten_keys(".")
        return {str(k): v for k, v in flat.items(include_nested=False, leaves_only=True)}
    if isinstance(weights, Mapping):
        return {str(k): v for k, v in weights.items()}
    raise TypeError(f"RlsyncWeightSyncScheme: cannot take weights of type {type(weights).__name__}")


def _own_storage(module: nn.Module) -> int:
    """Give every parameter and buffer of ``module`` its own, real storage (same ``Parameter`` objects): those
    TorchRL placed in shared memory get a private copy, and those it sent as ``meta`` skeletons (collectors
    with a weight-sync scheme do, expecting the scheme to deliver the weights) get memory on the device of the
    module's other tensors, else the CPU; ``connect`` then fills them. Returns how many were given storage."""
    moved = 0
    tensors = list(module.parameters()) + list(module.buffers())
    if any(t.device.type == "meta" for t in tensors):
        real = next((t.device for t in tensors if t.device.type != "meta"), torch.device("cpu"))
        moved += sum(1 for t in tensors if t.device.type == "meta")
        module.to_empty(device=real)
    with torch.no_grad():
        for p in module.parameters():
            if p.device.type == "cpu" and p.is_shared():
                p.data = p.data.clone()
                moved += 1
        for sub in module.modules():
            for name, b in list(sub._buffers.items()):
                if b is not None and b.device.type == "cpu" and b.is_shared():
                    sub._buffers[name] = b.clone()
                    moved += 1
    return moved


@register_weight_sync_backend("rlsync")
class RlsyncWeightSyncScheme(WeightSyncScheme):
    """A TorchRL weight-sync scheme backed by rlsync (see the module docs).

    Args:
        strategy: ``"patch"`` (send changes) or ``"bucket"`` (send every tensor).
        sync: ``send`` waits until every worker installed the version.
        timeout: seconds any one wait may take (connect, send, acknowledgements); ``None``:
            ``TORCHRL_WEIGHT_SYNC_TIMEOUT``, else 120.
        num_workers: workers to expect when the collector does not say (a ``Collector`` whose receivers are
            other processes).
        transport: ``"shm"`` (one host, the default) or ``"tcp"`` (``address`` is ``host:port`` the sender binds
            and the workers connect to; ``token`` authenticates them).
        socket_dir: where the shm channel's Unix socket goes (default: the system's temp dir).
        extract_as: TorchRL's weight format, ``"tensordict"`` or ``"state_dict"``.
        host_shared: the workers (one host, ``transport="shm"``) share one double-buffered copy of the weights;
            worker 0 applies each version to it (see the module docs).
        **syncer_kwargs: passed to :class:`rlsync.PatchWeightSyncer` / :class:`rlsync.BucketWeightSyncer`
            (e.g. ``compression_algorithm="lz4"``, ``bucket_size=...``).
    """

    def __init__(
        self,
        strategy: str = "patch",
        *,
        sync: bool = True,
        timeout: float | None = None,
        num_workers: int | None = None,
        transport: str = "shm",
        address: str | None = None,
        token: str | None = None,
        socket_dir: str | None = None,
        extract_as: str = "tensordict",
        host_shared: bool = False,
        **syncer_kwargs: Any,
    ) -> None:
        if strategy not in ("patch", "bucket"):
            raise ValueError(f"RlsyncWeightSyncScheme: strategy must be 'patch' or 'bucket', got {strategy!r}")
        if transport not in ("shm", "tcp"):
            raise ValueError(f"RlsyncWeightSyncScheme: transport must be 'shm' or 'tcp', got {transport!r}")
        if transport == "tcp" and (address is None or token is None):
            raise ValueError("RlsyncWeightSyncScheme: transport='tcp' needs address='host:port' and token=")
        if host_shared and transport != "shm":
            raise ValueError(
                "RlsyncWeightSyncScheme: host_shared=True shares one copy per host; it needs transport='shm'"
            )
        if "init_sync_enabled" in syncer_kwargs:
            raise ValueError(
                "RlsyncWeightSyncScheme: the initial weights always go out on connect (init_sync_enabled)"
            )
        super().__init__(extract_as)
        self.sync_strategy = strategy
        self.sync = bool(sync)
        self.timeout = _default_timeout() if timeout is None else float(timeout)
        if self.timeout <= 0:
            raise ValueError(f"RlsyncWeightSyncScheme: timeout must be positive, got {timeout}")
        self.transport = transport
        self.address = address
        self._token = token
        self._num_workers = num_workers
        self._socket_dir = socket_dir
        self._syncer_kwargs = dict(syncer_kwargs)
        self._socket_path: str | None = None
        self.host_shared = bool(host_shared)
        self._arena: str | None = None
        self._reader_acks: Any = None  # host-shared: (worker, version) from each worker that swapped to a version
        self._version = 0
        self._reset_runtime()

    # -- runtime state (dropped when pickled) ----------------------------------------------------------------

    def _reset_runtime(self) -> None:
        self._runner: Runner | None = None
        self._syncer: WeightSyncer | None = None
        self._channel: Any = None
        self._receiver_weights: dict[str, torch.Tensor] | None = None
        self._receiver_model: Any = None
        self._applied = threading.Condition()
        self._applied_version = 0
        self._returned_version = 0
        self._receive_error: BaseException | None = None
        self._host_reader: host_shared.HostSharedReader | None = None
        self._reader_versions: dict[int, int] = {}
        self._exit_hooked = False

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        for key in ("_runner", "_syncer", "_channel", "_receiver_weights", "_receiver_model", "_applied",
                    "_receive_error", "_host_reader", "_reader_versions", "_exit_hooked"):
            state.pop(key, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._reset_runtime()
        self._version = state.get("_version", 0)

    def _make_syncer(self) -> WeightSyncer:
        if self.sync_strategy == "patch":
            return PatchWeightSyncer(init_sync_enabled=True, **self._syncer_kwargs)
        return BucketWeightSyncer(**self._syncer_kwargs)

    def _shutdown_at_exit(self) -> None:
        """Shut this scheme down when its process exits, before the interpreter finalizes (TorchRL's collectors
        never call a scheme's ``shutdown``): a worker's background thread still blocked in rlsync when the
        interpreter finalizes is ended by a forced unwind through rlsync's native frames, which aborts the
        process ("FATAL: exception not rethrown") and leaves the arena behind. ``threading``'s exit hooks run in
        a ``multiprocessing`` worker's own exit path too (fork and spawn), before non-daemon threads are joined.
        The hook holds the scheme weakly."""
        if self._exit_hooked:
            return
        register = getattr(threading, "_register_atexit", None)  # CPython >= 3.9; else the plain atexit
        hook = (_shutdown_at_exit, weakref.ref(self))
        try:
            if register is not None:
                register(*hook)
            else:
                import atexit

                atexit.register(*hook)
        except RuntimeError:  # the interpreter is already shutting down: nothing to hook into
            return
        self._exit_hooked = True

    def create_transport(self, **kwargs: Any) -> Any:
        raise NotImplementedError(
            "RlsyncWeightSyncScheme moves weights over rlsync's own channel; it has no TorchRL transport"
        )

    # -- sender ----------------------------------------------------------------------------------------------

    def _init_on_sender_impl(
        self,
        *,
        model_id: str | None = None,
        context: Any = None,
        weights: Any = None,
        model: Any = None,
        params_map: Any = None,
        devices: Any = None,
        device_map_fn: Any = None,
        num_workers: int | None = None,
        ctx: Any = None,
        **kwargs: Any,
    ) -> None:
        if params_map is not None or device_map_fn is not None:
            raise NotImplementedError(
                "RlsyncWeightSyncScheme sends the same weights to every worker (one sender snapshot); per-worker "
                "weights (params_map / device_map_fn) need TorchRL's MultiProcessWeightSyncScheme"
            )
        self.model_id = model_id or "policy"
        if context is not None:
            self.context = context
            if model is None and weights is None:
                model = _resolve_model(context, self.model_id)
        if model is not None:
            self.model = model
        elif weights is not None:
            self._sender_weights = weights
        else:
            raise ValueError("RlsyncWeightSyncScheme.init_on_sender needs a context, a model or weights")
        if num_workers is None and context is not None:
            devices_of = getattr(context, "policy_device", None)
            if isinstance(devices_of, (list, tuple)):
                num_workers = len(devices_of)
            else:
                num_workers = getattr(context, "num_workers", None)
        if num_workers is None and devices is not None:
            num_workers = len(devices)
        if num_workers is None:
            num_workers = self._num_workers
        if num_workers is None or int(num_workers) < 1:
            raise ValueError(
                "RlsyncWeightSyncScheme: how many workers receive the weights is unknown; pass num_workers= to "
                "the scheme or to init_on_sender"
            )
        self._num_workers = int(num_workers)
        if self.transport == "shm":
            base = self._socket_dir or tempfile.gettempdir()
            self._socket_path = os.path.join(base, f"rlsync-torchrl-{os.getpid()}-{uuid.uuid4().hex[:12]}.sock")
        if self.host_shared:
            self._arena = f"rlsync-torchrl-{os.getpid()}-{uuid.uuid4().hex[:12]}.arena"
            self._reader_acks = (ctx or mp.get_context("spawn")).Queue()

    def _sender_state(self, weights: Any = None) -> dict[str, torch.Tensor]:
        if weights is not None:
            prepared = self.prepare_weights(weights, self.model_id, self._strategy, self.context)
        elif self.model is not None:
            prepared = self._strategy.extract_weights(self.model)
        else:
            prepared = getattr(self, "_sender_weights", None)
        if prepared is None:
            raise RuntimeError("RlsyncWeightSyncScheme: no weights to send (the model is gone)")
        return _flat(prepared)

    def _setup_connection_and_weights_on_sender_impl(
        self, *, worker_idx: int | None = None, weights: Any = None
    ) -> None:
        if worker_idx is not None:
            raise RuntimeError("RlsyncWeightSyncScheme connects every worker at once (worker_idx is for receivers)")
        self._runner = Runner()
        self._shutdown_at_exit()
        state = self._sender_state(weights)
        if self.transport == "shm":
            receivers = 1 if self.host_shared else self._num_workers  # host-shared: worker 0 receives for the host
            channel = self._runner.run(shm_sender(self._socket_path, receivers, timeout=self.timeout))
        else:
            channel = self._runner.run(
                tcp_sender(self.address, self._num_workers, token=self._token, timeout=self.timeout)
            )
        syncer = self._make_syncer()
        self._runner.run(syncer.init_sender(state, list(state), channel, timeout=self.timeout))
        self._syncer, self._channel = syncer, channel
        if self.sync_strategy == "bucket":
            # Bucket receivers get their first weights as version 0 (patch's init bootstrap does this itself).
            wait0 = None if self.host_shared else "applied"  # host-shared: every worker reports on the queue
            self._runner.run(syncer.sync(state, channel, 0, timeout=self.timeout, wait=wait0))
        self._wait_readers(0)

    def send(self, weights: Any = None, worker_ids: int | list[int] | None = None) -> None:
        """Send the policy's current weights to every worker as the next version; with ``sync=True`` return
        once each of them installed it. A subset of workers cannot be served (every worker follows one
        snapshot): ``worker_ids`` must name all of them or be ``None``."""
        if not self.initialized_on_sender:
            raise RuntimeError("Must be initialized on sender before sending weights")
        if not self.synchronized_on_sender or self._syncer is None:
            raise RuntimeError("Must be synchronized on sender before sending weights")
        if worker_ids is not None:
            ids = {worker_ids} if isinstance(worker_ids, int) else set(worker_ids)
            if ids != set(range(self._num_workers)):
                raise NotImplementedError(
                    f"RlsyncWeightSyncScheme updates all {self._num_workers} workers at once (one sender snapshot); "
                    f"worker_ids={sorted(ids)} would leave the others behind it"
                )
        state = self._sender_state(weights)
        self._version += 1
        # Host-shared: the applier does not report installs on rlsync's channel; every worker, the applier
        # included, reports the version it acts on through the scheme's queue instead (_wait_readers).
        wait = "applied" if self.sync and not self.host_shared else None
        self._runner.run(self._syncer.sync(state, self._channel, self._version, timeout=self.timeout, wait=wait))
        if self.sync:
            self._wait_readers(self._version)
        else:
            self._drain_acks()

    def _drain_acks(self) -> None:
        """Host-shared: take the workers' reports that arrived so far without waiting (with ``sync=False``
        nothing else reads them, and a worker whose queue pipe filled up could not exit)."""
        if not self.host_shared or self._reader_acks is None:
            return
        while True:
            try:
                worker, got = self._reader_acks.get_nowait()
            except queue.Empty:
                return
            self._reader_versions[worker] = max(got, self._reader_versions.get(worker, -1))

    def _wait_readers(self, version: int) -> None:
        """Host-shared: wait until every worker (the applier too) acts on ``version`` (bounded by ``timeout``)."""
        if not self.host_shared:
            return
        readers = range(self._num_workers)
        deadline = time.monotonic() + self.timeout
        while any(self._reader_versions.get(w, -1) < version for w in readers):
            left = deadline - time.monotonic()
            try:
                worker, got = self._reader_acks.get(timeout=max(left, 0.0))
            except queue.Empty:
                behind = [w for w in readers if self._reader_versions.get(w, -1) < version]
                raise TimeoutError(
                    f"RlsyncWeightSyncScheme: workers {behind} did not swap to version {version} within "
                    f"{self.timeout} s"
                ) from None
            self._reader_versions[worker] = max(got, self._reader_versions.get(worker, -1))

    def acked_versions(self) -> dict[int, int]:
        """Sender: ``{worker index: version it installed}`` for every live worker."""
        if self._syncer is None:
            return {}
        if self.host_shared:
            self._drain_acks()
            return {w: v for w, v in self._reader_versions.items() if v >= 0}
        return self._syncer.acked_versions()

    @property
    def version(self) -> int:
        """Sender: the last version sent (0: the initial weights). Worker: the last version installed."""
        return self._applied_version if self.initialized_on_receiver else self._version

    # -- receiver --------------------------------------------------------------------------------------------

    def _init_on_receiver_impl(self, *, model_id: str, context: Any = None, **kwargs: Any) -> None:
        worker_idx = kwargs.get("worker_idx")
        model = kwargs.get("model")
        if context is not None:
            if worker_idx is None:
                worker_idx = getattr(context, "worker_idx", None)
            if model is None:
                if hasattr(context, "get_model"):
                    model = context.get_model(model_id)
                else:
                    model = _resolve_model(context, model_id)
            self.context = context
        if worker_idx is None:
            raise ValueError("RlsyncWeightSyncScheme.init_on_receiver needs worker_idx (from the context or kwargs)")
        self.model_id = model_id
        self.worker_idx = int(worker_idx)
        if model is not None:
            self.model = model

    def _receiver_state(self) -> dict[str, torch.Tensor]:
        model = self.model
        if model is None:
            raise RuntimeError("RlsyncWeightSyncScheme: the worker has no model to install the weights into")
        if isinstance(model, nn.Module):
            _own_storage(model)
        return _flat(self._strategy.extract_weights(model) if isinstance(model, nn.Module) else model)

    def _setup_connection_and_weights_on_receiver_impl(self, *, worker_idx: int | None = None) -> None:
        if worker_idx is None:
            worker_idx = self.worker_idx
        if worker_idx is None:
            raise RuntimeError("RlsyncWeightSyncScheme: connect on a worker needs its worker_idx")
        self.worker_idx = int(worker_idx)
        state = self._current_state()
        if self.host_shared and self.worker_idx > 0:
            # A reader: its parameters become views of the arena worker 0 applies to (waits for its first version).
            self._host_reader = host_shared.HostSharedReader(self._arena, state, timeout=self.timeout)
            if self.sync_strategy == "bucket":
                self._hold_trainer_weights(self._host_reader)
            self._applied_version = self._returned_version = self._host_reader.version
            self._reader_acks.put((self.worker_idx, self._host_reader.version))
            self._start_background_receiver()
            self._shutdown_at_exit()
            return
        runner = Runner()
        if self.transport == "shm":
            channel = runner.run(shm_receiver(self._socket_path, self.worker_idx, timeout=self.timeout))
        else:
            channel = runner.run(tcp_receiver(self.address, self.worker_idx, token=self._token, timeout=self.timeout))
        syncer = self._make_syncer()
        if self.host_shared:  # worker 0: the host's applier, its own parameters views of the arena
            readers = max(self._num_workers or 1, 1)
            runner.run(syncer.init_receiver(state, channel, timeout=self.timeout, host_shared=self._arena,
                                            max_readers=readers))
        else:
            runner.run(syncer.init_receiver(state, channel, timeout=self.timeout))
        if self.sync_strategy == "bucket":
            runner.run(syncer.apply(state, channel, timeout=self.timeout))
        runner.close()
        self._syncer, self._channel = syncer, channel
        self._applied_version = self._returned_version = syncer.version
        if self.host_shared:
            self._reader_acks.put((self.worker_idx, syncer.version))
        self._start_background_receiver()
        self._shutdown_at_exit()

    def _hold_trainer_weights(self, reader: host_shared.HostSharedReader) -> None:
        """Bucket, host-shared reader: wait (bounded) until the arena holds the trainer's initial weights. The
        applier's init publishes the arena as version 0 with worker 0's own weights (a bucket handshake carries
        no values); the trainer's come next as version 0 again (sequence 1). A reader attached in between would
        otherwise report version 0 while acting on worker 0's weights."""
        deadline = time.monotonic() + self.timeout
        while reader._native.held[1] == 0:  # (version, sequence, ...): sequence 0 is the init's template
            if reader.refresh() is None:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"RlsyncWeightSyncScheme worker {self.worker_idx}: the trainer's initial weights did not "
                        f"reach arena {reader.name!r} within {self.timeout} s"
                    )
                time.sleep(0.002)

    def _current_state(self) -> dict[str, torch.Tensor]:
        """The worker's weights to install into: rebuilt when the collector replaced the model (TorchRL re-points
        ``scheme.model`` at the collector's own copy after ``connect``)."""
        model = self.model
        if model is not self._receiver_model or self._receiver_weights is None:
            self._receiver_weights = self._receiver_state()
            self._receiver_model = model
        return self._receiver_weights

    def _background_receive_loop(self) -> None:
        if self._host_reader is not None:
            self._reader_loop()
            return
        runner = Runner()
        syncer, channel = self._syncer, self._channel
        # A bucket version arrives in parts, and a bound that runs out between two of them drops the whole version
        # (its remaining parts are skipped), so its sender would wait for an ack that never comes (seen at 512 MiB
        # on a loaded host): a bucket worker waits with the scheme's timeout, and stops when the channel closes.
        # A patch's parts survive a poll that runs out between them (the receiver keeps them for the next call).
        poll = _POLL_S if self.sync_strategy == "patch" else self.timeout
        try:
            while not self._stop_event.is_set():
                try:
                    # Receive and verify without touching the model, then install into the model the worker runs
                    # now: the collector may have swapped it while this waited.
                    if self.host_shared:  # the applier: into the arena's back buffer, then published and swapped
                        version = runner.run(syncer.apply(self._receiver_weights, channel, timeout=poll))
                    else:
                        runner.run(syncer.stage(channel, timeout=poll))
                        version = runner.run(syncer.commit(self._current_state()))
                except _native.Timeout:
                    # Nothing arrived (the channel is still usable), or, host-shared, a reader had not yet swapped
                    # off the back buffer (a slow or busy worker; it swaps on its own). Nothing was consumed: look
                    # at the stop flag and wait again. Ending the thread on the latter left the host without an
                    # applier, and the trainer's next send waited for its timeout (the s12 hang).
                    continue
                except _native.PayloadRejected as exc:
                    # All-or-nothing: the worker keeps its whole previous version; the sender sees no ack.
                    torchrl_logger.warning(f"RlsyncWeightSyncScheme worker {self.worker_idx}: update rejected: {exc}")
                    continue
                except _native.TransportError as exc:
                    if not self._stop_event.is_set():
                        torchrl_logger.warning(
                            f"RlsyncWeightSyncScheme worker {self.worker_idx}: channel closed: {exc}"
                        )
                        self._fail(exc)
                    return
                self._installed(version)
                if self.host_shared:
                    self._reader_acks.put((self.worker_idx, version))
        except BaseException as exc:  # an unexpected error must not die silently in a daemon thread
            self._fail(exc)
        finally:
            runner.close()

    def _reader_loop(self) -> None:
        """Host-shared worker > 0: swap to each version as soon as the applier publishes it, and say so."""
        reader = self._host_reader
        try:
            while not self._stop_event.is_set():
                try:
                    version = reader.wait_newer(reader.version, timeout=_POLL_S)
                except _native.RlsyncError:
                    if reader.closed:
                        return
                    continue  # nothing newer yet: look at the stop flag
                self._installed(version)
                self._reader_acks.put((self.worker_idx, version))
        except BaseException as exc:
            self._fail(exc)

    def _installed(self, version: int) -> None:
        context = self.context
        if context is not None:
            if hasattr(context, "increment_version"):
                context.increment_version()  # the leaf collector's PolicyVersion, once per update
            elif hasattr(context, "update_policy_weights_"):
                context.update_policy_weights_(model_id=self.model_id, policy_or_weights=self._weights_td())
        with self._applied:
            self._applied_version = version
            self._applied.notify_all()

    def _fail(self, exc: BaseException) -> None:
        with self._applied:
            self._receive_error = exc
            self._applied.notify_all()

    def _weights_td(self) -> TensorDictBase:
        return TensorDict(self._receiver_weights, batch_size=[]).unflatten_keys(".")

    def receive(self, timeout: float | None = None) -> TensorDictBase | None:
        """Worker: wait (up to ``timeout`` seconds; ``None``: the scheme's timeout) for a version newer than the
        last one this returned; return the installed weights, or ``None`` when none arrived in time. The
        background receiver installs versions as they come; this only observes them."""
        if not self.initialized_on_receiver:
            raise RuntimeError("Must be initialized on receiver before receiving weights")
        if not self.synchronized_on_receiver:
            raise RuntimeError("Must be synchronized on receiver before receiving weights")
        wait_s = self.timeout if timeout is None else float(timeout)
        with self._applied:
            got = self._applied.wait_for(
                lambda: self._applied_version > self._returned_version or self._receive_error is not None, wait_s
            )
            if self._receive_error is not None:
                raise RuntimeError(
                    f"RlsyncWeightSyncScheme worker {self.worker_idx}: receiving stopped"
                ) from self._receive_error
            if not got:
                return None
            self._returned_version = self._applied_version
        return self._weights_td()

    # -- both ------------------------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop the worker's background receiver, or let the workers take what was sent; then release the
        channel (its shared memory and socket go with it). Idempotent."""
        stop = getattr(self, "_stop_event", None)
        if stop is not None:
            stop.set()
        thread = getattr(self, "_background_thread", None)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=_POLL_S * 4 + 1)
        if thread is not None and thread.is_alive() and getattr(self, "_host_reader", None) is not None:
            # A host-shared reader's thread waits at most _POLL_S inside the reader; closing the reader while it
            # is in there deadlocks (the binding holds the reader's lock across the wait, then needs the GIL
            # this thread holds while it waits for that lock; reported). Wait it out, bounded.
            thread.join(timeout=self.timeout)
            if thread.is_alive():
                torchrl_logger.warning(
                    f"RlsyncWeightSyncScheme worker {self.worker_idx}: its receiving thread did not stop within "
                    f"{self.timeout} s; the model is left on the shared arena"
                )
                self._host_reader = None
        self._background_thread = None
        syncer = getattr(self, "_syncer", None)
        runner = getattr(self, "_runner", None)
        if syncer is not None and runner is not None and syncer.sender_initialized():
            try:
                runner.run(syncer.flush(timeout=self.timeout))
            except Exception:  # a worker already gone: nothing more to deliver to it
                pass
        reader, self._host_reader = getattr(self, "_host_reader", None), None
        if reader is not None:
            reader.close()  # the model keeps a private copy of the held version
        if syncer is not None and getattr(self, "host_shared", False) and syncer.host_shared is not None:
            closer = Runner()
            try:
                closer.run(syncer.close())  # the applier: a private copy, and the arena unlinked
            finally:
                closer.close()
        if getattr(self, "host_shared", False) and self._arena is not None and self.initialized_on_sender:
            host_shared.unlink(self._arena)  # the sender owns the name: gone even when a worker died
        self._syncer = self._channel = None
        self._receiver_weights = None
        if runner is not None:
            runner.close()
        self._runner = None
