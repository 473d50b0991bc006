"""rlsync.nemo.RlsyncWeightSynchronizer against NeMo-RL's WeightSynchronizer contract, written from what its
tests (tests/unit/weight_sync/test_weight_synchronizer.py) require of a synchronizer: the full lifecycle,
RuntimeError on failure with the synchronizer left stale, phases restored when colocated (also on failure),
the timer phase, kv_scales. The policy and generation workers are real processes (two policy ranks, two
generation workers) reached through futures, as NeMo-RL reaches its Ray workers."""

from __future__ import annotations

import concurrent.futures
import multiprocessing as mp
import os
import signal
import threading
import time
from contextlib import contextmanager

import pytest

import torch  # noqa: E402

import rlsync.nemo as nemo  # noqa: E402
from rlsync.nemo import RlsyncGenerationWorkerMixin, RlsyncPolicyWorkerMixin, RlsyncWeightSynchronizer  # noqa: E402


class PolicyWorker(RlsyncPolicyWorkerMixin):
    def __init__(self, rank: int) -> None:
        self.rank = rank
        torch.manual_seed(0)  # every policy rank holds the same replica
        self.model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Linear(32, 4))

    def rlsync_rank(self) -> int:
        return self.rank

    def train_step(self, seed: int) -> None:
        torch.manual_seed(seed)
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(torch.randn_like(p) * 0.01)

    def weights(self) -> dict:
        return {k: v.clone() for k, v in self.model.state_dict().items()}


class GenerationWorker(RlsyncGenerationWorkerMixin):
    def __init__(self, rank: int) -> None:
        self.rank = rank
        torch.manual_seed(100 + rank)  # not the policy's values until the handshake
        self.model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Linear(32, 4))
        self.installed: list[int] = []

    def rlsync_installed(self, version: int) -> None:
        self.installed.append(version)

    def weights(self) -> dict:
        return {k: v.clone() for k, v in self.model.state_dict().items()}

    def installed_versions(self) -> list[int]:
        return list(self.installed)


def _serve(factory, args, conn) -> None:
    obj = factory(*args)
    while True:
        try:
            method, margs = conn.recv()
        except EOFError:
            return
        try:
            conn.send(("ok", getattr(obj, method)(*margs)))
        except Exception as exc:  # sent back, raised by the future
            conn.send(("err", f"{type(exc).__name__}: {exc}"))


class Remote:
    """One worker object in its own process; each call returns a ``concurrent.futures.Future``."""

    def __init__(self, factory, *args) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(factory, args, child), daemon=True)
        self.proc.start()
        self.lock = threading.Lock()
        self.pool = concurrent.futures.ThreadPoolExecutor(1)

    def call(self, method: str, *args) -> concurrent.futures.Future:
        def roundtrip():
            with self.lock:
                self.conn.send((method, args))
                if not self.conn.poll(120):
                    raise TimeoutError(f"{method}: no answer")
                status, value = self.conn.recv()
            if status == "err":
                raise RuntimeError(value)
            return value

        return self.pool.submit(roundtrip)

    def close(self) -> None:
        self.conn.close()
        self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.kill()
        self.pool.shutdown(wait=False)


class FakePolicy:
    """NeMo-RL's ``Policy`` as far as the synchronizer sees it: worker-group calls returning futures, and the
    colocated phase methods (recorded)."""

    def __init__(self, ranks: int, phases: list) -> None:
        self.workers = [Remote(PolicyWorker, r) for r in range(ranks)]
        self.phases = phases

    def rlsync_init_sender(self, spec):
        return [w.call("rlsync_init_sender", spec) for w in self.workers]

    def rlsync_sync(self, version):
        return [w.call("rlsync_sync", version) for w in self.workers]

    def rlsync_shutdown(self):
        return [w.call("rlsync_shutdown") for w in self.workers]

    def train_step(self, seed):
        for f in [w.call("train_step", seed) for w in self.workers]:
            f.result()

    def offload_before_refit(self):
        self.phases.append("offload_before_refit")

    def offload_after_refit(self):
        self.phases.append("offload_after_refit")


class FakeGeneration:
    def __init__(self, workers: int, phases: list) -> None:
        self.workers = [Remote(GenerationWorker, r) for r in range(workers)]
        self.phases = phases

    def rlsync_num_receivers(self):
        return len(self.workers)

    def rlsync_init_receiver(self, spec):
        return [w.call("rlsync_init_receiver", spec, rank) for rank, w in enumerate(self.workers)]

    def rlsync_apply(self, version):
        return [w.call("rlsync_apply", version) for w in self.workers]

    def rlsync_shutdown(self):
        return [w.call("rlsync_shutdown") for w in self.workers]

    def prepare_for_generation(self, tags):
        self.phases.append(f"prepare_for_generation:{','.join(tags)}")


class Timer:
    def __init__(self) -> None:
        self.phases: list[str] = []

    @contextmanager
    def time(self, name: str):
        self.phases.append(name)
        yield


@pytest.fixture
def cluster(tmp_path):
    phases: list[str] = []
    policy, generation = FakePolicy(2, phases), FakeGeneration(2, phases)
    yield policy, generation, phases, tmp_path
    for w in policy.workers + generation.workers:
        w.close()


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("kind", ["patch", "bucket"])
def test_full_lifecycle(cluster, kind):
    policy, generation, _, tmp = cluster
    sync = RlsyncWeightSynchronizer(policy, generation, syncer={"type": kind}, socket_dir=str(tmp), timeout=60)
    assert sync.is_stale
    sync.init_communicator()
    assert sync.is_stale  # NeMo-RL's first refit still runs
    timer = Timer()
    for step in (1, 2, 3):
        policy.train_step(step)
        metrics = sync.sync_weights(timer=timer)
        assert not sync.is_stale and sync.version == step
        assert metrics["rlsync/version"] == step and metrics["rlsync/receivers"] == 2
        assert metrics["rlsync/bytes"] > 0 and metrics["rlsync/seconds"] > 0
        want = policy.workers[0].call("weights").result()
        for w in generation.workers:
            assert _same(w.call("weights").result(), want)
    assert timer.phases == [nemo.TIMER_PHASE] * 3
    assert [w.call("installed_versions").result() for w in generation.workers] == [[1, 2, 3]] * 2
    sync.mark_stale()
    assert sync.is_stale
    sync.shutdown()
    sync.shutdown()  # idempotent


def test_colocated_phases_restored_also_on_failure(cluster):
    policy, generation, phases, tmp = cluster
    sync = RlsyncWeightSynchronizer(policy, generation, colocated=True, socket_dir=str(tmp), timeout=20)
    sync.init_communicator()
    policy.train_step(1)
    sync.sync_weights()
    assert phases == [
        "offload_before_refit",
        "prepare_for_generation:weights",
        "offload_after_refit",
        "prepare_for_generation:kv_cache",
    ]
    phases.clear()
    victim = generation.workers[1].proc
    os.kill(victim.pid, signal.SIGKILL)
    victim.join(timeout=10)
    policy.train_step(2)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="version 2"):
        sync.sync_weights()
    assert time.monotonic() - started < 15  # a dead worker fails the sync, it does not hang it
    assert sync.is_stale
    assert phases[-2:] == ["offload_after_refit", "prepare_for_generation:kv_cache"]


def test_kv_scales_are_refused_before_anything_moves(cluster):
    policy, generation, phases, tmp = cluster
    sync = RlsyncWeightSynchronizer(policy, generation, colocated=True, socket_dir=str(tmp))
    with pytest.raises(ValueError, match="kv_scales"):
        sync.sync_weights(kv_scales={"k": 1.0})
    assert phases == []


class _Stub:
    """In-process policy/generation whose workers answer with fixed reports (plain values, no futures)."""

    def __init__(self, answers) -> None:
        self.answers = answers

    def __getattr__(self, name):
        if name.startswith("rlsync_"):
            return lambda *a: self.answers.get(name, [{}])
        raise AttributeError(name)


def test_a_worker_with_another_checksum_fails_the_sync_and_stays_stale():
    policy = _Stub({"rlsync_sync": [{"sent": True, "checksum": 0xABC, "bytes": 10}, {"sent": False}]})
    generation = _Stub(
        {
            "rlsync_init_receiver": [{"version": 0}, {"version": 0}],
            "rlsync_apply": [{"version": 1, "checksum": 0xABC}, {"version": 1, "checksum": 0xDEF}],
        }
    )
    sync = RlsyncWeightSynchronizer(policy, generation, num_receivers=2)
    sync.init_communicator()
    with pytest.raises(RuntimeError, match="worker 1"):
        sync.sync_weights()
    assert sync.is_stale and sync.version == 0


def test_interface_without_nemo_rl():
    assert not nemo.HAVE_NEMO_RL or issubclass(RlsyncWeightSynchronizer, nemo._Base)
    for name in ("sync_weights", "is_stale", "init_communicator", "shutdown", "mark_stale"):
        assert hasattr(RlsyncWeightSynchronizer, name)
    with pytest.raises(ValueError, match="type"):
        RlsyncWeightSynchronizer(None, None, syncer={"type": "delta"})
