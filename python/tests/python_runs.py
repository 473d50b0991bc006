"""Shared by the tests that run the `rlsync` binary with Python workers: its command line, its environment,
and the processes a run has alive."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BIN = ROOT / "target" / "release" / "rlsync"
WORKERS = Path(__file__).resolve().parent / "workers"


def command(entry_point: str, run_dir: Path, *overrides: str, entry: str = "tiny_rl") -> list[str]:
    """`rlsync <entry_point>` with the fixture workers of `workers/` (module `entry`) on the small gym task."""
    assert BIN.exists(), f"{BIN} is missing: build it with `cargo build --release` (make test does)"
    return [
        str(BIN),
        entry_point,
        "worker@actor.worker=python",
        "worker@rollout.worker=python",
        f"actor.worker.entry={entry}",
        f"rollout.worker.entry={entry}",
        f"actor.worker.path=[{WORKERS}]",
        f"rollout.worker.path=[{WORKERS}]",
        f"actor.worker.python={sys.executable}",
        f"rollout.worker.python={sys.executable}",
        "env@env.train=gym",
        "env@env.eval=gym",
        "env.train.total_num_envs=4",
        "env.eval.total_num_envs=4",
        "env.train.max_steps_per_rollout_epoch=8",
        "rollout.chunk_steps=8",
        "runner.val_check_interval=-1",
        f"hydra.run.dir={run_dir}",
        *overrides,
    ]


def environment() -> dict[str, str]:
    """This process's environment, with the workers importing the package under test from this checkout."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "python"), env.get("PYTHONPATH", "")])
    return env


def processes(run_dir: Path) -> dict[int, str]:
    """pid -> command line of the live processes whose command line names `run_dir` (the orchestrator's
    `hydra.run.dir=`, the workers' `--run-dir`). By the run dir, not by name: it lies under pytest's tmp dir
    (/tmp/pytest-of-root/...), whose name every test process shares."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if str(run_dir) in cmd and int(pid) != os.getpid():
            found[int(pid)] = cmd
    return found


def free_port() -> int:
    """A loopback TCP port free now, below the kernel's ephemeral range: a port taken from that range (binding
    port 0) may be handed to another process's connection before the test binds it, which two pytest processes
    and their runs make likely; ports below it are only bound on purpose (tests/multinode.rs picks the same way)."""
    import random
    import socket

    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 32768
    for _ in range(1000):
        port = random.randrange(10000, max(ephemeral, 10001))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in 10000..{ephemeral}")
