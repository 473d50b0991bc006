"""python/bench/collector_bench.py --smoke: every method (host-shared ones included) runs inside TorchRL's
MultiSyncCollector to the end, each worker holds exactly the last version sent and none sees a version that was
not sent, no process aborts at exit (no timing asserts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "python" / "bench" / "collector_bench.py"
METHODS = {
    "rlsync-patch",
    "rlsync-bucket",
    "rlsync-patch-host-shared",
    "rlsync-bucket-host-shared",
    "torchrl-shared",
    "torchrl-mp",
}


def segments_of(pid: int) -> list[str]:
    """rlsync's shared memory named after process ``pid``: its channel segments (``rlsync.<pid>.<n>.<n>``) and
    the scheme's arenas (``rlsync-torchrl-<pid>-<id>.arena``); other processes on the host have their own."""
    return [n for n in os.listdir("/dev/shm") if n.startswith("rlsync") and (f".{pid}." in n or f"-{pid}-" in n)]


def test_collector_bench_smoke_verifies_every_method():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "python"), os.environ.get("PYTHONPATH", "")]))
    bench = subprocess.Popen(
        [sys.executable, str(BENCH), "--smoke", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        stdout, stderr = bench.communicate(timeout=900)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.communicate()
    out = subprocess.CompletedProcess(bench.args, bench.returncode, stdout, stderr)
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    rows = [r for r in lines if "method" in r]
    floors = [r["floors"] for r in lines if "floors" in r]
    assert len(floors) == 1 and floors[0]["memcpy_ms"] > 0
    assert {r["method"] for r in rows} == METHODS, out.stdout + out.stderr[-2000:]
    for r in rows:
        assert "error" not in r, r
        assert r["verified"] is True, r  # every worker's weights hash equal to the trainer's last version
        assert r["isolated"] is True, r  # a trainer step that was not sent reached no worker
        assert r["workers"] == 2 and r["e2e_ms"] > 0
    assert out.returncode == 0, out.stderr[-2000:]
    # A worker whose receiving thread was still inside rlsync when its interpreter finalized aborted with this.
    assert "FATAL" not in out.stderr, out.stderr[-2000:]
    assert segments_of(bench.pid) == []
