"""scripts/gpu_check.sh --cpu: the GPU check's dry run on the CPU writes the results JSON the GPU run writes, and
its correctness stage passes (so no GPU time is lost to a broken script)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from python_runs import BIN, ROOT, environment

STAGES = ["env", "kernels", "rooflines", "density", "timing_7b", "correctness", "ipc", "gym_ppo", "sanitizer"]


def run_check(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "check.json"
    env = {**environment(), "PYTHON": sys.executable, "RLSYNC_BIN": str(BIN)}
    p = subprocess.run(
        [str(ROOT / "scripts" / "gpu_check.sh"), "--cpu", "--out", str(out), *args],
        capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path,
    )
    assert out.exists(), p.stderr[-3000:]
    return p, json.loads(out.read_text())


def test_the_cpu_dry_run_writes_every_stage_and_its_checks_pass(tmp_path):
    p, r = run_check(tmp_path, "--budget", "150")
    assert p.returncode == 0, p.stderr[-3000:]
    assert r["mode"] == "cpu" and r["schema"] == 1
    assert len(r["rlinf_commit"]) == 40
    assert r["stage_order"] == STAGES
    assert list(r["stages"]) == STAGES, "every stage recorded, in order"
    for name, rec in r["stages"].items():
        assert rec["status"] in ("ok", "skipped"), (name, rec)
        assert isinstance(rec.get("elapsed_s"), float) or rec["status"] == "skipped", (name, rec)
    env = r["stages"]["env"]
    assert env["torch"] and env["rlsync_version"]
    assert 0.0 < r["stages"]["density"]["density"] < 0.5
    timing = r["stages"]["timing_7b"]
    assert timing["tensors"] == 3 + 2 * 9, "Llama's layout: embed, 9 per layer, norm, lm_head"
    assert timing["density"] == r["stages"]["density"]["density"]
    for variant in ("rlsync_patch_snapshot_cpu", "rlinf_snapshot_cpu"):
        v = timing[variant]
        assert v["status"] == "ok", (variant, v)
        assert v["receiver_equal"] is True, variant
        assert v["e2e_median_s"] > 0
    assert timing["rlsync_patch_snapshot_cpu"]["checksums_equal"] is True
    assert timing["rlsync_patch_snapshot_cpu"]["changed"] > 0
    assert timing["full_copy"]["load_state_dict"]["median_s"] > 0
    corr = r["stages"]["correctness"]
    assert corr["passed"] is True, corr
    runs = {(x["kind"], x["device"]): x for x in corr["runs"]}
    # patch-cast: the fp32 master weights synced to bf16 receivers (the casting build).
    assert set(runs) == {("patch", "cpu"), ("bucket", "cpu"), ("patch-cast", "cpu")}
    for run in runs.values():
        assert run["syncs_done"] == 30 and run["failure_count"] == 0, run
        assert run["corrupt_rejected"] and run["corrupt_receiver_untouched"], run
        assert run["intact_after_corrupt_applied"], run
    assert runs[("patch", "cpu")]["empty_patch_checks"] == 3
    assert runs[("patch-cast", "cpu")]["empty_patch_checks"] == 3
    assert r["stages"]["kernels"]["status"] == "skipped" and "GPU" in r["stages"]["kernels"]["note"]
    assert r["stages"]["sanitizer"]["status"] == "skipped"
    assert "GPU" in r["stages"]["sanitizer"]["note"]
    gym = r["stages"]["gym_ppo"]
    if gym["status"] == "ok":  # needs gymnasium + mujoco, which the test venv has
        assert gym["updates"] == 3 and gym["sync_verified"]
        assert gym["sync_paths"] and set(gym["sync_paths"].values()) == {"host copies"}, gym["sync_paths"]
        bucket = gym["bucket"]
        assert bucket["updates"] == 2 and bucket["sync_verified"], bucket
        assert bucket["behav_kl_max_abs"] < 1e-5 and set(bucket["sync_paths"].values()) == {"host copies"}, bucket
        assert gym["behav_kl_max_abs"] < 1e-5, gym["behav_kl"]
    else:
        assert "not importable" in gym["note"], gym


def test_a_missing_prerequisite_is_a_note_and_the_budget_skips_what_does_not_fit(tmp_path):
    # A budget too small for any stage skips them all, each with a note; no binary skips gym_ppo with a note.
    p, r = run_check(tmp_path, "--budget", "0.5", "--stages", "env,density,gym_ppo")
    assert p.returncode == 0, p.stderr[-3000:]
    assert list(r["stages"]) == ["env", "density", "gym_ppo"]
    for rec in r["stages"].values():
        assert rec["status"] == "skipped" and "budget" in rec["note"], rec
    q = subprocess.run(
        [sys.executable, str(ROOT / "python" / "bench" / "gpu_check.py"), "--cpu", "--out",
         str(tmp_path / "nobin.json"), "--stages", "gym_ppo", "--bin", str(tmp_path / "no-such-rlsync")],
        capture_output=True, text=True, timeout=120, env=environment(),
    )
    assert q.returncode == 0, q.stderr
    gym = json.loads((tmp_path / "nobin.json").read_text())["stages"]["gym_ppo"]
    assert gym["status"] == "skipped" and "binary is missing" in gym["note"], gym
