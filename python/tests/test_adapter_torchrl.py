"""rlsync.torchrl.RlsyncWeightSyncScheme in TorchRL's own collectors (torchrl from the venv), written from the
contract TorchRL documents and its collector tests exercise: no I/O in init, initial weights on connect,
picklable between init and connect, in-place installs that keep parameter identity, the policy version bumped
once per update, receive(timeout) -> None, subset sends refused, a dead worker named instead of a hang."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import torch  # noqa: E402  (torch and torchrl come with the venv: a missing one fails, never skips)

from tensordict.nn import TensorDictModule  # noqa: E402
from torch import nn  # noqa: E402
from torchrl.collectors import Collector, MultiAsyncCollector, MultiSyncCollector  # noqa: E402
from torchrl.testing.mocking_classes import ContinuousActionVecMockEnv  # noqa: E402
from torchrl.weight_update.weight_sync_schemes import WeightSyncScheme  # noqa: E402

import rlsync  # noqa: E402
from rlsync.torchrl import RlsyncWeightSyncScheme  # noqa: E402
from python_runs import free_port  # noqa: E402

OBS = 7


def make_env():
    return ContinuousActionVecMockEnv()


def make_policy(value: float = 0.0) -> TensorDictModule:
    linear = nn.Linear(OBS, OBS, bias=False)
    with torch.no_grad():
        linear.weight.fill_(value)
    return TensorDictModule(linear, in_keys=["observation"], out_keys=["action"])


def set_weights(policy: TensorDictModule, value: float) -> None:
    with torch.no_grad():
        policy.module.weight.fill_(value)


def actions_match(batch, value: float) -> bool:
    """Whether every action of ``batch`` is what a policy whose weights all equal ``value`` computes."""
    obs, act = batch["observation"], batch["action"]
    expected = obs.sum(-1, keepdim=True).expand_as(act) * value
    return bool(torch.allclose(act, expected, atol=1e-5))


def shm_segments(pid: int | None = None) -> set[str]:
    """rlsync's shared memory named after process ``pid`` (this one by default): the channel segments of the
    scheme's sender (``rlsync.<pid>.<n>.<n>``) and its arenas (``rlsync-torchrl-<pid>-<id>.arena``). Other
    processes' segments (tests running at the same time) are not this test's."""
    pid = os.getpid() if pid is None else pid
    return {n for n in os.listdir("/dev/shm") if n.startswith("rlsync") and (f".{pid}." in n or f"-{pid}-" in n)}


def test_registered_as_backend_and_no_io_in_init(tmp_path):
    assert isinstance(WeightSyncScheme.from_backend("rlsync"), RlsyncWeightSyncScheme)
    scheme = RlsyncWeightSyncScheme("bucket", socket_dir=str(tmp_path))
    scheme.init_on_sender(model_id="policy", model=make_policy(), num_workers=2)
    assert list(tmp_path.iterdir()) == []  # nothing bound, nothing created until connect
    clone = pickle.loads(pickle.dumps(scheme))  # TorchRL pickles the scheme into its workers here
    assert clone.sync_strategy == "bucket" and clone._socket_path == scheme._socket_path
    assert not clone.initialized_on_sender and not clone.synchronized_on_sender


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="strategy must be 'patch' or 'bucket'"):
        RlsyncWeightSyncScheme("delta")
    with pytest.raises(ValueError, match="host_shared=True .* needs transport='shm'"):
        RlsyncWeightSyncScheme(transport="tcp", address="127.0.0.1:1", token="t", host_shared=True)
    assert RlsyncWeightSyncScheme("bucket", host_shared=True).host_shared  # both strategies share a host copy
    with pytest.raises(ValueError, match="address='host:port' and token="):
        RlsyncWeightSyncScheme(transport="tcp")
    scheme = RlsyncWeightSyncScheme()
    with pytest.raises(NotImplementedError, match="per-worker weights"):
        scheme.init_on_sender(model_id="policy", params_map={0: {}}, num_workers=1)


@pytest.mark.parametrize(
    "strategy,host_shared", [("patch", False), ("bucket", False), ("patch", True), ("bucket", True)]
)
def test_multi_sync_collector(strategy, host_shared, sock_dir):
    """Two worker processes; the trainer changes its policy; after update_policy_weights_ every worker acts
    with the new weights and its policy version moved by exactly one. ``host_shared``: both act on one arena
    that worker 0 applies to; it is gone after shutdown."""
    before = shm_segments()
    policy = make_policy(0.0)
    scheme = RlsyncWeightSyncScheme(strategy, socket_dir=sock_dir, timeout=60, host_shared=host_shared)
    collector = MultiSyncCollector(
        [make_env, make_env],
        policy,
        frames_per_batch=20,
        total_frames=-1,
        weight_sync_schemes={"policy": scheme},
        track_policy_version=True,
    )
    try:
        it = iter(collector)
        batch = next(it)
        assert actions_match(batch, 0.0)
        versions0 = batch["policy_version"].unique().tolist()
        arenas = [n for n in shm_segments() - before if n.endswith(".arena")]
        assert len(arenas) == (1 if host_shared else 0), arenas  # one copy for the host, or none shared

        set_weights(policy, 0.5)
        collector.update_policy_weights_()  # sync=True: returns once both workers installed it
        assert scheme.acked_versions() == {0: 1, 1: 1}
        # A batch may have been started before the update: the one after it is entirely new weights. The
        # version stamp follows the install from the worker's receiving thread (as with TorchRL's own schemes),
        # so frames collected in between may still carry the old one; it moves by exactly one, never more.
        next(it)
        batch = next(it)
        assert actions_match(batch, 0.5)
        want = [v + 1 for v in versions0]
        seen = set(batch["policy_version"].unique().tolist())
        for _ in range(5):
            if seen == set(want):
                break
            assert seen <= set(versions0) | set(want), seen
            batch = next(it)
            assert actions_match(batch, 0.5)
            seen = set(batch["policy_version"].unique().tolist())
        assert seen == set(want)

        # The trainer's later writes do not reach the workers without an update (each holds its own copy).
        set_weights(policy, 2.0)
        next(it)
        assert actions_match(next(it), 0.5)
        collector.update_policy_weights_()
        assert scheme.acked_versions() == {0: 2, 1: 2}
        next(it)
        assert actions_match(next(it), 2.0)
    finally:
        collector.shutdown()
        if host_shared:
            # Found in s12 and left open: after MultiSyncCollector.shutdown() the host-shared arena and the channel's
            # segment were still there (the scheme's own shutdown, idempotent, removes both).
            scheme.shutdown()
    assert shm_segments() == before


def test_multi_async_collector(sock_dir):
    policy = make_policy(0.0)
    scheme = RlsyncWeightSyncScheme("patch", socket_dir=sock_dir, timeout=60)
    collector = MultiAsyncCollector(
        [make_env, make_env],
        policy,
        frames_per_batch=20,
        total_frames=-1,
        weight_sync_schemes={"policy": scheme},
    )
    try:
        it = iter(collector)
        assert actions_match(next(it), 0.0)
        set_weights(policy, -1.5)
        collector.update_policy_weights_()
        assert scheme.acked_versions() == {0: 1, 1: 1}
        # Batches already collected (at most one per worker in flight) may predate it; those after are new.
        for _ in range(4):
            next(it)
        assert all(actions_match(next(it), -1.5) for _ in range(4))
    finally:
        collector.shutdown()


def test_subset_send_is_refused(sock_dir):
    policy = make_policy(0.0)
    scheme = RlsyncWeightSyncScheme("patch", socket_dir=sock_dir, timeout=60)
    collector = MultiSyncCollector(
        [make_env, make_env], policy, frames_per_batch=20, total_frames=-1, weight_sync_schemes={"policy": scheme}
    )
    try:
        with pytest.raises(NotImplementedError, match="all 2 workers at once"):
            collector.update_policy_weights_(worker_ids=[1])
        collector.update_policy_weights_(worker_ids=[0, 1])  # all of them: fine
        assert scheme.acked_versions() == {0: 1, 1: 1}
    finally:
        collector.shutdown()


def _collector_worker(scheme, queue) -> None:
    """A rollout process: a single-process Collector receiving through the scheme."""
    policy = make_policy(0.0)
    ids = [id(p) for p in policy.parameters()]
    collector = Collector(
        make_env, policy, frames_per_batch=10, total_frames=-1, track_policy_version=True, worker_idx=0
    )
    collector.register_scheme_receiver({"policy": scheme})  # init_on_receiver + connect (initial weights)
    it = iter(collector)
    first = next(it)
    queue.put(("initial", actions_match(first, 0.25), scheme.receive(timeout=0.2) is None))
    got = scheme.receive(timeout=60)
    batch = next(it)
    queue.put(
        (
            "updated",
            got is not None,
            actions_match(batch, 3.0),
            collector.policy_version,
            [id(p) for p in policy.parameters()] == ids,
        )
    )
    scheme.shutdown()
    collector.shutdown()


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_single_collector_receiver_in_another_process(sock_dir, transport):
    trainer_policy = make_policy(0.25)
    if transport == "tcp":  # rlsync's authenticated TCP channel, as across hosts (here on loopback)
        kw = {"transport": "tcp", "address": f"127.0.0.1:{free_port()}", "token": "s3cret-run-token"}
    else:
        kw = {"socket_dir": sock_dir}
    scheme = RlsyncWeightSyncScheme("patch", timeout=60, **kw)
    scheme.init_on_sender(model_id="policy", model=trainer_policy, num_workers=1)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    worker = ctx.Process(target=_collector_worker, args=(scheme, queue))
    worker.start()
    try:
        scheme.connect()  # the rendezvous: the worker gets the trainer's weights (0.25)
        tag, acted_initial, none_on_timeout = queue.get(timeout=120)
        assert tag == "initial" and acted_initial and none_on_timeout
        set_weights(trainer_policy, 3.0)
        scheme.send()
        assert scheme.acked_versions() == {0: 1}
        tag, received, acted, version, same_params = queue.get(timeout=120)
        assert tag == "updated" and received and acted and same_params
        assert version == 1  # bumped once by the one update
    finally:
        worker.join(timeout=60)
        if worker.is_alive():
            worker.kill()
        scheme.shutdown()


def _idle_worker(scheme, ready) -> None:
    policy = make_policy(0.0)
    scheme.init_on_receiver(model_id="policy", model=policy, worker_idx=0)
    scheme.connect(worker_idx=0)
    ready.set()
    time.sleep(600)


def test_dead_worker_is_named_not_a_hang(sock_dir):
    policy = make_policy(0.0)
    scheme = RlsyncWeightSyncScheme("patch", socket_dir=sock_dir, timeout=30)
    scheme.init_on_sender(model_id="policy", model=policy, num_workers=1)
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    worker = ctx.Process(target=_idle_worker, args=(scheme, ready))
    worker.start()
    try:
        scheme.connect()
        assert ready.wait(120)
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(timeout=30)
        set_weights(policy, 1.0)
        started = time.monotonic()
        with pytest.raises(rlsync.TransportError, match="rank 0"):
            scheme.send()
        assert time.monotonic() - started < 20  # named at once, not after the timeout
    finally:
        if worker.is_alive():
            worker.kill()
        scheme.shutdown()


def _host_shared_rounds(strategy: str, socket_dir: str, rounds: int, versions: int) -> None:
    """Run in a child process by ``test_host_shared_survives_a_stalled_reader_and_restarts``: ``rounds``
    collectors one after another in this process, each 2 workers x ``versions`` updates, worker 1 stopped
    (SIGSTOP) across the publish of version 2; the collectors are shut down, their schemes never are (as
    TorchRL does): the processes clean up as they exit."""
    for _ in range(rounds):
        policy = make_policy(0.0)
        scheme = RlsyncWeightSyncScheme(strategy, socket_dir=socket_dir, timeout=20, host_shared=True)
        collector = MultiSyncCollector(
            [make_env, make_env], policy, frames_per_batch=20, total_frames=-1, weight_sync_schemes={"policy": scheme}
        )
        try:
            it = iter(collector)
            assert actions_match(next(it), 0.0)
            reader = collector.procs[1].pid
            for v in range(1, versions + 1):
                set_weights(policy, v / 8)
                if v == 2:
                    # Worker 1 keeps holding version 1's buffer while worker 0 publishes version 2 and then waits
                    # for that buffer (longer than its poll): the applier must wait on, not give up.
                    os.kill(reader, signal.SIGSTOP)
                    threading.Timer(1.5, os.kill, (reader, signal.SIGCONT)).start()
                collector.update_policy_weights_()  # bounded: TimeoutError after 20 s, not a hang
                assert scheme.acked_versions() == {0: v, 1: v}, (v, scheme.acked_versions())
                next(it)
                assert actions_match(next(it), v / 8), v
        finally:
            collector.shutdown()
    print("rounds done", flush=True)


@pytest.mark.parametrize("strategy", ["patch", "bucket"])
def test_host_shared_survives_a_stalled_reader_and_restarts(strategy, sock_dir):
    """Host-shared inside MultiSyncCollector, in a child process bounded by a timeout (a hang fails the test):
    a reader that does not swap off the back buffer for longer than the applier's poll only delays that version
    (s12's hang: the applier's thread gave up, and every later send waited for its timeout); a second collector
    in the same process works as the first; the processes exit cleanly without the schemes being shut down (a
    worker's thread inside rlsync at exit aborted it with "FATAL: exception not rethrown" and left the arena)."""
    tests = Path(__file__).resolve().parent
    code = (
        "import test_adapter_torchrl as t; "
        f"t._host_shared_rounds({strategy!r}, {sock_dir!r}, rounds=2, versions=4)"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tests), os.environ.get("PYTHONPATH", "")]))
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        stdout, stderr = child.communicate(timeout=300)
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
    assert child.returncode == 0 and "rounds done" in stdout, stdout[-2000:] + stderr[-4000:]
    assert "FATAL" not in stderr, stderr[-4000:]
    # No arena and no channel segment of the child's (both are named after the trainer's pid: "rlsync-torchrl-<pid>-"
    # and "rlsync.<pid>."; other processes' segments on this host are not this test's).
    assert shm_segments(child.pid) == set()
