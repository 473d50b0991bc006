"""python/bench/collector_bench.py --smoke: every method runs inside TorchRL's MultiSyncCollector to the end, each
worker holds exactly the last version sent and none sees a version that was not sent (no timing asserts)."""

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


def test_collector_bench_smoke_verifies_every_method():
    before = {n for n in os.listdir("/dev/shm") if n.startswith("rlsync")}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "python"), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run(
        [sys.executable, str(BENCH), "--smoke", "--json"], capture_output=True, text=True, timeout=900, env=env
    )
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
    assert {n for n in os.listdir("/dev/shm") if n.startswith("rlsync")} == before
