"""rlsync.ray_launch on a local multi-raylet Ray cluster (three Ray nodes on 127.0.0.1): a run over three
rlsync nodes, a cluster with too few nodes, a node that refuses the run, and Ctrl-C of the launcher."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from python_runs import BIN, ROOT
from test_workers import leftovers, shm_leftovers

# A dev cluster on loopback: Ray's nodes take 127.0.0.1, not this host's address; no usage reports.
RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
NODES = 3


@pytest.fixture(scope="module")
def ray_cluster():
    # Ray's files (sessions, sockets, the current-cluster file) in a short private dir (socket paths are
    # limited to 107 bytes), removed afterwards; the launcher's driver inherits RAY_TMPDIR.
    base = tempfile.mkdtemp(prefix="rlray")
    os.makedirs(os.path.join(base, "ray"))
    os.environ.update(RAY_ENV, RAY_TMPDIR=base)
    from ray.cluster_utils import Cluster

    args = {"num_cpus": 1, "object_store_memory": 80 << 20, "node_ip_address": "127.0.0.1"}
    cluster = Cluster(initialize_head=True, head_node_args={**args, "include_dashboard": False})
    try:
        for _ in range(NODES - 1):
            cluster.add_node(**args)
        cluster.wait_for_nodes()
        yield cluster.address
    finally:
        cluster.shutdown()
        del os.environ["RAY_TMPDIR"]
        shutil.rmtree(base, ignore_errors=True)


def launch(address: str, tmp_path: Path, *overrides: str, nodes: int = NODES, **popen) -> subprocess.Popen:
    assert BIN.exists(), f"{BIN} is missing: build it with `cargo build --release` (make test does)"
    args = [
        sys.executable, "-m", "rlsync.ray_launch", "--address", address, "--nodes", str(nodes),
        "--rlsync", str(BIN), "--reserve-timeout-s", "10", "--",
        "train_embodied",
        "model@actor.model=synthetic_small", "env@env.train=synthetic", "env@env.eval=synthetic",
        "actor.model.params=65536", "actor.model.tensors=8",
        "env.train.total_num_envs=2", "env.eval.total_num_envs=2", "rollout.chunk_steps=4",
        "env.train.max_steps_per_rollout_epoch=4", "runner.val_check_interval=-1",
        "runner.logger.logger_backends=[]", "runner.shutdown_grace_s=2",
        "cluster.slots_per_node=1", "cluster.component_placement.actor=0",
        "cluster.component_placement.rollout=1-2",
        f"hydra.run.dir={tmp_path / 'run'}",
        *overrides,
    ]  # fmt: skip
    env = {**os.environ, **RAY_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "python"), env.get("PYTHONPATH", "")])
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, **popen)


def finish(proc: subprocess.Popen, timeout: float = 180) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def wait_for_steps(proc: subprocess.Popen, tmp_path: Path, steps: int) -> None:
    """Until the run wrote `steps` metrics rows (it must still be running)."""
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= steps):
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline, f"the run did not reach step {steps}"
        time.sleep(0.2)


def no_leftovers(tmp_path: Path, shm_before: set[str]) -> None:
    deadline = time.monotonic() + 20
    while leftovers(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert leftovers(tmp_path) == []
    assert shm_leftovers(shm_before) == []


def test_a_run_over_three_ray_nodes_syncs_every_step(ray_cluster, tmp_path):
    shm_before = set(os.listdir("/dev/shm"))
    rc, out = finish(launch(ray_cluster, tmp_path, "runner.max_steps=5"))
    assert rc == 0, out
    assert "rlsync.ray_launch: 3 node(s), node 0 at 127.0.0.1:" in out
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    synced = [r for r in rows if "sync/verified" in r]
    assert [r["step"] for r in rows] == list(range(5))
    assert synced and all(r["sync/verified"] for r in synced), rows
    # Node 0 placed the rollouts on the other two nodes, whose agents ran them in their own run dirs.
    assert (tmp_path / "run" / "node-1").is_dir() and (tmp_path / "run" / "node-2").is_dir(), out
    no_leftovers(tmp_path, shm_before)


def test_too_few_ray_nodes_is_a_clear_error(ray_cluster, tmp_path):
    rc, out = finish(launch(ray_cluster, tmp_path, "runner.max_steps=1", nodes=NODES + 1))
    assert rc == 2, out
    assert f"did not give {NODES + 1} bundles of 1 CPU on {NODES + 1} different nodes" in out
    assert f"it has {NODES} node(s)" in out
    assert not (tmp_path / "run").exists()


def test_a_node_that_refuses_the_run_fails_the_launch(ray_cluster, tmp_path):
    # A slot past the last node: every node refuses the placement before starting anything.
    rc, out = finish(launch(ray_cluster, tmp_path, "runner.max_steps=1", "cluster.component_placement.rollout=1-5"))
    assert rc == 1, out
    # The node's own error, in the launcher's tail of its output (Ray forwards logs asynchronously).
    assert "node 0 exited with status 1\n  | " in out, out
    assert "slot 3 would be on node 3" in out.split("node 0 exited with status 1", 1)[1], out
    assert leftovers(tmp_path) == []


def test_launcher_keys_and_node_counts_are_checked_before_ray(tmp_path):
    # No cluster needed: these fail before ray.init.
    rc, out = finish(launch("127.0.0.1:1", tmp_path, "cluster.node_rank=1"))
    assert rc == 2 and "the launcher sets cluster.node_rank for each node" in out, out
    rc, out = finish(launch("127.0.0.1:1", tmp_path, "cluster.num_nodes=2"))
    assert rc == 2 and "--nodes 3 but cluster.num_nodes=2" in out, out


def test_ctrl_c_of_the_launcher_stops_every_node(ray_cluster, tmp_path):
    shm_before = set(os.listdir("/dev/shm"))
    proc = launch(ray_cluster, tmp_path, "runner.max_steps=100000", start_new_session=True)
    wait_for_steps(proc, tmp_path, 3)
    proc.send_signal(signal.SIGINT)
    rc, out = finish(proc, timeout=60)
    assert rc != 0, out
    assert "SIGINT: stopping every node" in out
    no_leftovers(tmp_path, shm_before)


def test_a_dead_actor_takes_its_node_down_and_fails_the_launch(ray_cluster, tmp_path):
    shm_before = set(os.listdir("/dev/shm"))
    proc = launch(ray_cluster, tmp_path, "runner.max_steps=100000", "cluster.node_timeout_s=3")
    wait_for_steps(proc, tmp_path, 3)
    # The actor that started node 2's rlsync is the parent of the process whose command line says rank 2.
    run_dir = str(tmp_path / "run")
    node2 = [p for p in os.listdir("/proc") if p.isdigit() and run_dir in cmdline(p) and "node_rank=2" in cmdline(p)]
    assert len(node2) == 1, node2
    actor = int(Path(f"/proc/{node2[0]}/stat").read_text().rsplit(")", 1)[1].split()[1])
    os.kill(actor, signal.SIGKILL)
    rc, out = finish(proc, timeout=60)
    assert rc != 0, out
    assert "node 2: its Ray actor died" in out
    assert "node 2 (" in out, out  # node 0's error names the lost node
    no_leftovers(tmp_path, shm_before)


def cmdline(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""
