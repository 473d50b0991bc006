"""Elastic rollouts (issue 13) with Python workers: ``python -m rlsync.worker`` rollouts SIGKILLed at random
moments (their start-up and bootstrap, syncs, rollouts) are restarted, rejoin the weight channel, catch up and
the run finishes every step with every sync verified, exactly as with built-in workers (tests/elastic.rs).

Each run kills up to three times: once while a rollout starts, then at random moments of random later steps,
each after the previous successor caught up. The kill moments come from a seeded generator; the seed is printed
(``RLSYNC_FAULT_SEED=<seed>`` replays a run's choices).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
from python_runs import command, environment, processes

STEPS = 80
# A hang's bound, never a timing assertion: Python workers import torch at every start on a shared machine.
PATIENCE_S = 240.0


def overrides(syncer: str) -> list[str]:
    return [
        f"runner.max_steps={STEPS}",
        f"weight_syncer={syncer}",
        "runner.rollout_restarts=10",
        "runner.rollout_restart_backoff_s=0.05",
        "runner.rollout_weights_copy_interval=2",
        "runner.handshake_timeout_s=120",
        "runner.step_timeout_s=120",
        "runner.shutdown_grace_s=2",
        "+fixture.rollout_sleep_s=0.1",
    ]


def rows(run_dir: Path) -> list[dict]:
    try:
        text = (run_dir / "metrics.jsonl").read_text()
    except FileNotFoundError:
        return []
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line being written
    return out


def workers(run_dir: Path) -> dict[int, str]:
    """pid -> command line of this run's workers."""
    return {pid: cmd for pid, cmd in processes(run_dir).items() if f"--run-dir {run_dir}" in cmd and "--role" in cmd}


def rollout_pid(run_dir: Path, rank: int) -> int | None:
    needle = f"--role rollout --rank {rank} "
    return next((pid for pid, cmd in workers(run_dir).items() if needle in cmd), None)


def log_count(run_dir: Path, rank: int, text: str) -> int:
    try:
        return (run_dir / "logs" / f"rollout-{rank}.log").read_text(errors="replace").count(text)
    except FileNotFoundError:
        return 0


def caught_up(run_dir: Path, rank: int) -> int:
    """How many incarnations of rollout `rank` got weights (bootstrapped, or rejoined and caught up)."""
    return log_count(run_dir, rank, "weights received: version") + log_count(
        run_dir, rank, "rejoined the weight channel"
    )


def wait_until(proc: subprocess.Popen, what: str, cond) -> bool:
    """Poll `cond` until it holds (True) or the run ended (False); fails past PATIENCE_S."""
    deadline = time.monotonic() + PATIENCE_S
    while not cond():
        if proc.poll() is not None:
            return False
        assert time.monotonic() < deadline, f"no {what} within {PATIENCE_S} s"
        time.sleep(0.005)
    return True


def kill_campaign(proc: subprocess.Popen, run_dir: Path, rng: random.Random) -> list[tuple[int, int, int]]:
    """Up to three SIGKILLs of rollouts; returns (rank, pid, steps done) of each kill that hit a live rollout."""
    killed = []
    for n in range(3):
        rank = rng.randrange(2)
        if n == 0:
            # While it starts: importing torch, connecting, the weight bootstrap.
            if not wait_until(proc, "a rollout process", lambda: rollout_pid(run_dir, rank) is not None):
                break
            time.sleep(rng.uniform(0.0, 2.0))
        else:
            at = len(rows(run_dir)) + rng.randint(1, 6)
            if not wait_until(proc, f"step {at}", lambda: len(rows(run_dir)) >= at):
                break
            # Anywhere in the step: the sync, the rollout (0.1 s per chunk), the train.
            time.sleep(rng.uniform(0.0, 0.25))
        if len(rows(run_dir)) >= STEPS // 2:
            break
        pid = rollout_pid(run_dir, rank)
        before = caught_up(run_dir, rank)
        if pid is None:
            continue
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
        killed.append((rank, pid, len(rows(run_dir))))
        # The successor (same rank, a new process) catches up before the next kill.
        wait_until(proc, "the successor's catch-up", lambda: caught_up(run_dir, rank) > before)
    return killed


@pytest.mark.parametrize("syncer", ["patch_syncer", "bucket_syncer"])
@pytest.mark.parametrize("entry_point", ["train_embodied", "train_async"])
def test_killed_python_rollouts_are_restarted_and_the_run_finishes(tmp_path, entry_point, syncer):
    seed = int(os.environ.get("RLSYNC_FAULT_SEED") or random.randrange(1 << 30))
    print(f"RLSYNC_FAULT_SEED={seed}")
    rng = random.Random(seed)
    run_dir = tmp_path / "run"
    shm_before = set(os.listdir("/dev/shm"))
    extra = ["algorithm.staleness_threshold=1"] if entry_point == "train_async" else []
    proc = subprocess.Popen(
        command(entry_point, run_dir, *overrides(syncer), *extra),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "stderr.txt", "w"),
        env=environment(),
    )
    try:
        killed = kill_campaign(proc, run_dir, rng)
        code = proc.wait(timeout=PATIENCE_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stderr = (tmp_path / "stderr.txt").read_text()
    what = f"{entry_point} {syncer} seed {seed}, killed {killed}"
    assert code == 0, f"{what}: exit {code}\n{stderr}"
    assert "panicked" not in stderr, stderr
    assert len(killed) >= 2, f"{what}: the run ended before the kills (machine too slow?)\n{stderr}"
    train = [r for r in rows(run_dir) if "train/loss" in r]
    assert len(train) == STEPS, what
    # Every chunk, successors' included, came from exactly the trainer's weights of the version it reports.
    assert all(r["actor/weights_match"] == 1.0 for r in train), what
    assert all(r["sync/verified"] for r in train if "sync/verified" in r), what
    assert train[-1]["rollout/restarts"] == len(killed), f"{what}\n{stderr}"
    # A successor of a kill while running joined late and was caught up (replay or full), verified.
    assert "rejoined: caught up by" in stderr, f"{what}\n{stderr}"
    if syncer == "patch_syncer" and any(step >= 4 for _, _, step in killed):
        # Killed after it installed versions: the successor rejoined from the rollout's local copy.
        logs = "".join(
            (run_dir / "logs" / f"rollout-{r}.log").read_text(errors="replace") for r in range(2)
        )
        assert "loaded the local weights copy of version" in logs, what
    # Nothing left: no worker, no shared-memory segment, no weights copy.
    deadline = time.monotonic() + 10
    while workers(run_dir) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not workers(run_dir), workers(run_dir)
    prefix = json.loads((run_dir / ".rlsync" / "launch.json").read_text())["segment_prefix"]
    assert not [f for f in set(os.listdir("/dev/shm")) - shm_before if f.startswith(prefix)]
    assert not [f for f in os.listdir(run_dir / ".rlsync") if f.startswith("rollout-")]
    catchups = [line.split("INFO ", 1)[-1] for line in stderr.splitlines() if "rejoined: caught up by" in line]
    print(f"{what}: held; catch-ups: {catchups}")
