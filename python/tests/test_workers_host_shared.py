"""Python rollouts in the host-shared mode (``weight_syncer.host_shared=true``): the rollouts of the host act
on one copy of the weights in shared memory — their ``model()`` parameters are views of it, swapped in place —
and every chunk is generated with exactly the trainer's weights of the version it reports."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from python_runs import command, environment, processes

SHARED = (
    "weight_syncer.host_shared=true",
    "cluster.component_placement.rollout=0-2",
    "env.train.total_num_envs=6",
    "env.eval.total_num_envs=6",
)


def run(tmp_path: Path, entry_point: str, *overrides: str) -> subprocess.CompletedProcess:
    args = command(entry_point, tmp_path / "run", *SHARED, *overrides)
    return subprocess.run(args, capture_output=True, text=True, timeout=300, env=environment())


def metrics(tmp_path: Path) -> list[dict]:
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def arena(tmp_path: Path) -> str:
    launch = json.loads((tmp_path / "run" / ".rlsync" / "launch.json").read_text())
    return launch["host_shared"]["arena"]


@pytest.mark.parametrize(
    "entry_point, overrides",
    [
        ("train_embodied", ("runner.max_steps=5",)),
        ("train_embodied", ("runner.max_steps=5", "weight_syncer=bucket_syncer")),
        ("train_async", ("runner.max_steps=5", "algorithm.staleness_threshold=1", "actor.sync_weight_no_wait=true")),
    ],
)
def test_python_rollouts_act_on_the_hosts_shared_weights(tmp_path, entry_point, overrides):
    p = run(tmp_path, entry_point, *overrides)
    assert p.returncode == 0, p.stderr
    rows = metrics(tmp_path)
    train = [r for r in rows if "actor/weights_match" in r]
    assert len(train) == 5
    # Every chunk was generated with the trainer's weights of the version it reports, bit for bit (the
    # rollouts' parameters are views of the shared buffer they hold; tiny_rl asserts their identity is kept).
    assert all(r["actor/weights_match"] == 1.0 for r in train), train
    assert all(r["sync/verified"] for r in rows if "sync/verified" in r)
    logs = tmp_path / "run" / "logs"
    assert "into the host's arena" in (logs / "rollout-0.log").read_text()
    for rank in (1, 2):
        assert "attached to the host's weights" in (logs / f"rollout-{rank}.log").read_text()
    assert not processes(tmp_path / "run")
    assert not os.path.exists(f"/dev/shm/{arena(tmp_path)}"), "the arena is removed at the run's end"


def test_a_failed_python_run_leaves_no_arena(tmp_path):
    p = run(tmp_path, "train_embodied", "runner.max_steps=5", "+fixture.raise_in=rollout")
    assert p.returncode == 1
    assert "boom in rollout" in p.stderr
    assert not processes(tmp_path / "run")
    assert not os.path.exists(f"/dev/shm/{arena(tmp_path)}")
