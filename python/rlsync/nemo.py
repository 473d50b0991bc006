"""rlsync as a NeMo-RL weight synchronizer: ``policy_generation.weight_synchronizer = RlsyncWeightSynchronizer(...)``.

NeMo-RL's refit calls ``weight_synchronizer.sync_weights(timer=..., kv_scales=...)`` after each policy update
(``nemo_rl.weight_sync.interfaces.WeightSynchronizer``). :class:`RlsyncWeightSynchronizer` implements that
contract — ``sync_weights``, ``is_stale``, ``init_communicator``, ``shutdown`` and a non-abstract ``mark_stale`` —
and is a subclass of NeMo-RL's ABC when ``nemo_rl`` is importable (duck-typed otherwise, nothing of NeMo-RL is
imported for it to work).

It drives rlsync's syncers in the workers through four methods that the policy and generation objects expose
(NeMo-RL's ``Policy`` / ``VllmGeneration`` reach their Ray workers the same way; the worker side is
:class:`RlsyncPolicyWorkerMixin` / :class:`RlsyncGenerationWorkerMixin`, mixed into the worker classes passed as
``worker_extension_cls_fqn``):

- ``policy.rlsync_init_sender(spec)`` / ``generation.rlsync_init_receiver(spec)``: the channel (rlsync's shm on
  one host, its authenticated TCP across hosts) and the handshake, once, in :meth:`init_communicator`;
- ``policy.rlsync_sync(version)`` / ``generation.rlsync_apply(version)``: one version, every generation worker.

Each returns what the workers return (a list of Ray ``ObjectRef`` s, ``concurrent.futures.Future`` s or plain
values: all are awaited). Semantics (NeMo-RL's): one version for all generation workers, all-or-nothing —
``sync_weights`` raises ``RuntimeError`` unless every worker reports that version with the sender's checksum,
and the synchronizer then stays stale; colocated runs get NeMo-RL's phase transitions, restored in ``finally``;
a dead worker fails the sync at once and a stuck one after ``timeout`` instead of hanging; FP8 ``kv_scales``
are not carried (``ValueError``, as NeMo-RL's HTTP synchronizer refuses them).
"""

from __future__ import annotations

import concurrent.futures
import os
import sys
import tempfile
import time
import uuid
from contextlib import nullcontext
from typing import Any

from ._blocking import Runner
from .syncer import WeightSyncer, shm_receiver, shm_sender, tcp_receiver, tcp_sender

__all__ = ["RlsyncWeightSynchronizer", "RlsyncPolicyWorkerMixin", "RlsyncGenerationWorkerMixin", "HAVE_NEMO_RL"]

try:
    from nemo_rl.weight_sync.interfaces import WeightSynchronizer as _Base  # type: ignore[import-not-found]

    HAVE_NEMO_RL = True
except ImportError:
    _Base = object  # type: ignore[assignment,misc]
    HAVE_NEMO_RL = False

TIMER_PHASE = "prepare_for_generation/transfer_and_update_weights"
"""NeMo-RL's timer phase for the transfer (its IPC and HTTP synchronizers use the same)."""


def _wait(results: Any, timeout: float) -> list[Any]:
    """The values behind ``results``: Ray object refs, futures or plain values, one or a list of them."""
    items = results if isinstance(results, (list, tuple)) else [results]
    ray = sys.modules.get("ray")
    out = []
    for item in items:
        if ray is not None and isinstance(item, getattr(ray, "ObjectRef", ())):
            out.append(ray.get(item, timeout=timeout))
        elif isinstance(item, concurrent.futures.Future):
            out.append(item.result(timeout=timeout))
        else:
            out.append(item)
    return out


class RlsyncWeightSynchronizer(_Base):  # type: ignore[misc,valid-type]
    """NeMo-RL's ``WeightSynchronizer`` over rlsync (see the module docs).

    Args:
        policy, generation: NeMo-RL's policy and generation objects (anything with the ``rlsync_*`` methods).
        colocated: run NeMo-RL's phase transitions around each transfer (policy and generation share GPUs).
        num_receivers: generation workers (default: ``generation.rlsync_num_receivers()``).
        syncer: rlsync's ``weight_syncer`` config (``{"type": "patch" | "bucket", ...}``, as
            :meth:`rlsync.WeightSyncer.create` takes it; default patch).
        transport: ``"shm"`` (one host) or ``"tcp"`` (``address`` ``host:port`` on the policy's rank 0 node,
            ``token`` authenticates the generation workers).
        timeout: seconds any one wait may take.
    """

    def __init__(
        self,
        policy: Any,
        generation: Any,
        *,
        colocated: bool = False,
        num_receivers: int | None = None,
        syncer: dict[str, Any] | None = None,
        transport: str = "shm",
        address: str | None = None,
        token: str | None = None,
        socket_dir: str | None = None,
        timeout: float = 120.0,
    ) -> None:
        if transport not in ("shm", "tcp"):
            raise ValueError(f"RlsyncWeightSynchronizer: transport must be 'shm' or 'tcp', got {transport!r}")
        if transport == "tcp" and (address is None or token is None):
            raise ValueError("RlsyncWeightSynchronizer: transport='tcp' needs address='host:port' and token=")
        if timeout <= 0:
            raise ValueError(f"RlsyncWeightSynchronizer: timeout must be positive, got {timeout}")
        self._policy = policy
        self._generation = generation
        self._colocated = bool(colocated)
        self._num_receivers = num_receivers
        self._syncer_cfg = dict(syncer or {"type": "patch"})
        if self._syncer_cfg.get("type") == "patch":
            # The handshake gives every generation worker the policy's values, the base each patch applies to.
            patch = dict(self._syncer_cfg.get("patch") or {})
            patch["init_sync"] = {**dict(patch.get("init_sync") or {}), "enabled": True}
            self._syncer_cfg["patch"] = patch
        WeightSyncer.create(self._syncer_cfg)  # a bad config fails here, not in the workers
        self._transport = transport
        self._address = address
        self._token = token
        self._socket_dir = socket_dir
        self._timeout = float(timeout)
        self._stale = True
        self._version = 0
        self._initialized = False

    @property
    def is_stale(self) -> bool:
        """True until the first successful :meth:`sync_weights`, after a failed one, and after :meth:`mark_stale`."""
        return self._stale

    def mark_stale(self) -> None:
        """Mark the generation weights out of date (NeMo-RL's interface had this abstract until 2026-08)."""
        self._stale = True

    @property
    def version(self) -> int:
        """The last version every generation worker installed (0: the initial weights)."""
        return self._version

    def init_communicator(self) -> None:
        """Open the channel and run the handshake (the generation workers get the policy's weights): once,
        after the policy and generation workers exist."""
        if self._initialized:
            raise RuntimeError("RlsyncWeightSynchronizer.init_communicator was already called")
        receivers = self._num_receivers
        if receivers is None:
            receivers = int(self._generation.rlsync_num_receivers())
        if receivers < 1:
            raise ValueError(f"RlsyncWeightSynchronizer: need at least one generation worker, got {receivers}")
        spec: dict[str, Any] = {
            "transport": self._transport,
            "receivers": receivers,
            "syncer": self._syncer_cfg,
            "timeout": self._timeout,
        }
        if self._transport == "shm":
            base = self._socket_dir or tempfile.gettempdir()
            spec["socket_path"] = os.path.join(base, f"rlsync-nemo-{os.getpid()}-{uuid.uuid4().hex[:12]}.sock")
        else:
            spec["address"], spec["token"] = self._address, self._token
        # Both sides block in the handshake: start both, then wait for both. ``generation.rlsync_init_receiver``
        # calls each worker's ``rlsync_init_receiver(spec, rank)`` with its rank, 0 .. receivers-1.
        sent = self._policy.rlsync_init_sender(spec)
        received = self._generation.rlsync_init_receiver(spec)
        try:
            _wait(sent, self._timeout)
            reports = _wait(received, self._timeout)
        except Exception as exc:
            raise RuntimeError(f"rlsync: setting up the weight channel failed: {exc}") from exc
        if len(reports) != receivers:
            raise RuntimeError(f"rlsync: {len(reports)} generation workers joined, {receivers} expected")
        self._initialized = True  # still stale: NeMo-RL's first refit runs sync_weights

    def sync_weights(self, *, timer: Any = None, kv_scales: dict[str, float] | None = None) -> dict[str, float]:
        """Send the policy's weights as the next version to every generation worker and verify that each
        installed it; returns rlsync's figures (``rlsync/version``, ``rlsync/bytes``, ``rlsync/seconds``,
        ``rlsync/receivers``). Raises ``RuntimeError`` (and stays stale) if any worker did not."""
        if kv_scales is not None:
            raise ValueError("rlsync does not carry FP8 KV-cache scales (kv_scales); sync them another way")
        if not self._initialized:
            raise RuntimeError("RlsyncWeightSynchronizer.sync_weights before init_communicator")
        version = self._version + 1
        ok = False
        if self._colocated:
            self._policy.offload_before_refit()
            self._generation.prepare_for_generation(tags=["weights"])
        try:
            started = time.perf_counter()
            with timer.time(TIMER_PHASE) if timer is not None else nullcontext():
                sent = self._policy.rlsync_sync(version)
                applied = self._generation.rlsync_apply(version)
                try:
                    senders = _wait(sent, self._timeout)
                    receivers = _wait(applied, self._timeout)
                except Exception as exc:
                    raise RuntimeError(f"rlsync: weight sync of version {version} failed: {exc}") from exc
            seconds = time.perf_counter() - started
            report = next((r for r in senders if isinstance(r, dict) and r.get("sent")), None)
            if report is None:
                raise RuntimeError(f"rlsync: no policy rank sent version {version}")
            bad = [
                (i, r)
                for i, r in enumerate(receivers)
                if not isinstance(r, dict) or r.get("version") != version or r.get("checksum") != report["checksum"]
            ]
            if bad:
                raise RuntimeError(
                    f"rlsync: generation workers did not install version {version} with the policy's checksum "
                    f"{report['checksum']:#x}: " + ", ".join(f"worker {i}: {r}" for i, r in bad)
                )
            ok = True
        finally:
            if self._colocated:
                self._policy.offload_after_refit()
                self._generation.prepare_for_generation(tags=["kv_cache"])
            self._stale = not ok
        self._version = version
        return {
            "rlsync/version": float(version),
            "rlsync/bytes": float(report.get("bytes", 0)),
            "rlsync/seconds": seconds,
            "rlsync/receivers": float(len(receivers)),
        }

    def shutdown(self) -> None:
        """Release the channel in every worker (idempotent)."""
        if not self._initialized:
            return
        self._initialized = False
        for side in (self._generation, self._policy):
            try:
                _wait(side.rlsync_shutdown(), self._timeout)
            except Exception:
                pass


class _WorkerSide:
    """What both worker mixins share: the syncer, its channel end and a private event loop."""

    _rlsync_syncer: WeightSyncer | None = None
    _rlsync_channel: Any = None
    _rlsync_runner: Runner | None = None
    _rlsync_timeout: float = 120.0

    def _rlsync_start(self, spec: dict[str, Any]) -> Runner:
        self.rlsync_shutdown()
        self._rlsync_timeout = float(spec.get("timeout", 120.0))
        self._rlsync_syncer = WeightSyncer.create(spec["syncer"])
        self._rlsync_runner = Runner()
        return self._rlsync_runner

    def rlsync_shutdown(self) -> None:
        self._rlsync_syncer = None
        self._rlsync_channel = None
        if self._rlsync_runner is not None:
            self._rlsync_runner.close()
        self._rlsync_runner = None


class RlsyncPolicyWorkerMixin(_WorkerSide):
    """Policy-worker side. Override :meth:`rlsync_state_dict` (default ``self.model.state_dict()``) and
    :meth:`rlsync_rank` (default the ``torch.distributed`` rank, else 0). Rank 0 sends; every rank takes part in
    each sync (DTensor shards are gathered with every rank, as :meth:`rlsync.WeightSyncer.sync` does)."""

    def rlsync_state_dict(self) -> Any:
        return self.model.state_dict()  # type: ignore[attr-defined]

    def rlsync_rank(self) -> int:
        import torch.distributed as dist

        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    def rlsync_init_sender(self, spec: dict[str, Any]) -> dict[str, Any]:
        from . import param_names_need_sync

        runner = self._rlsync_start(spec)
        is_sender = self.rlsync_rank() == 0
        state = self.rlsync_state_dict()
        names = list(state) if isinstance(state, dict) else param_names_need_sync(state)
        channel = None
        if is_sender:
            if spec["transport"] == "shm":
                channel = runner.run(shm_sender(spec["socket_path"], spec["receivers"], timeout=self._rlsync_timeout))
            else:
                channel = runner.run(
                    tcp_sender(spec["address"], spec["receivers"], token=spec["token"], timeout=self._rlsync_timeout)
                )
        runner.run(self._rlsync_syncer.init_sender(state, names, channel, is_sender=is_sender, timeout=self._rlsync_timeout))
        self._rlsync_channel = channel
        return {"sent": is_sender}

    def rlsync_sync(self, version: int) -> dict[str, Any]:
        syncer, runner = self._rlsync_syncer, self._rlsync_runner
        if syncer is None or runner is None:
            raise RuntimeError("rlsync_sync before rlsync_init_sender")
        state = self.rlsync_state_dict()
        wait = "applied" if self._rlsync_channel is not None else None  # ranks that send nothing wait for nobody
        runner.run(syncer.sync(state, self._rlsync_channel, version, timeout=self._rlsync_timeout, wait=wait))
        if self._rlsync_channel is None:
            return {"sent": False}
        report = syncer.last_report()
        return {"sent": True, "version": version, "checksum": syncer.checksum(state), "bytes": report.get("payload_bytes", 0)}


class RlsyncGenerationWorkerMixin(_WorkerSide):
    """Generation-worker side. Override :meth:`rlsync_state_dict` (default ``self.model.state_dict()``: the
    tensors installed in place) and, where the engine needs telling, :meth:`rlsync_installed` (called with the
    version after each install, e.g. to reload vLLM's weights from the installed tensors)."""

    def rlsync_state_dict(self) -> Any:
        return self.model.state_dict()  # type: ignore[attr-defined]

    def rlsync_installed(self, version: int) -> None:
        """Hook: the weights of ``version`` were installed in place."""

    def rlsync_init_receiver(self, spec: dict[str, Any], rank: int) -> dict[str, Any]:
        runner = self._rlsync_start(spec)
        if spec["transport"] == "shm":
            channel = runner.run(shm_receiver(spec["socket_path"], rank, timeout=self._rlsync_timeout))
        else:
            channel = runner.run(tcp_receiver(spec["address"], rank, token=spec["token"], timeout=self._rlsync_timeout))
        state = self.rlsync_state_dict()
        runner.run(self._rlsync_syncer.init_receiver(state, channel, timeout=self._rlsync_timeout))
        self._rlsync_channel = channel
        return {"version": self._rlsync_syncer.version, "checksum": self._rlsync_syncer.checksum(state)}

    def rlsync_apply(self, version: int) -> dict[str, Any]:
        syncer, runner = self._rlsync_syncer, self._rlsync_runner
        if syncer is None or runner is None:
            raise RuntimeError("rlsync_apply before rlsync_init_receiver")
        state = self.rlsync_state_dict()
        got = runner.run(syncer.apply(state, self._rlsync_channel, timeout=self._rlsync_timeout))
        self.rlsync_installed(got)
        return {"version": got, "checksum": syncer.checksum(state)}
