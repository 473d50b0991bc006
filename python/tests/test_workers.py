"""Python workers launched by rlsync: real runs of the `rlsync` binary with `python -m rlsync.worker` workers."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from python_runs import ROOT, WORKERS, command, environment, processes

def run(tmp_path: Path, entry_point: str, *overrides: str, entry: str = "tiny_rl") -> subprocess.CompletedProcess:
    args = command(entry_point, tmp_path / "run", *overrides, entry=entry)
    return subprocess.run(args, capture_output=True, text=True, timeout=300, env=environment())


def metrics(tmp_path: Path) -> list[dict]:
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def leftovers(tmp_path: Path) -> list[str]:
    """Processes still running from this run."""
    return list(processes(tmp_path / "run").values())


def shm_leftovers(before: set[str]) -> list[str]:
    """rlsync segments created since `before` whose owners are gone: what a run left behind. A run's segments are
    `rlsync-<orchestrator pid>-<n>.<pid>.…`; those of live processes belong to other runs on this machine (other
    tests running at the same time), as rlsync's own leftover sweep judges them."""
    out = []
    for name in set(os.listdir("/dev/shm")) - before:
        if not name.startswith("rlsync"):
            continue
        run = re.match(r"rlsync-(\d+)-", name)
        parts = name.split(".")
        pids = ([run.group(1)] if run else []) + ([parts[1]] if len(parts) > 1 and parts[1].isdigit() else [])
        if not any(Path(f"/proc/{pid}").exists() for pid in pids):
            out.append(name)
    return out


def test_train_embodied_with_python_workers_syncs_exact_weights(tmp_path):
    p = run(tmp_path, "train_embodied", "runner.max_steps=4")
    assert p.returncode == 0, p.stderr
    rows = metrics(tmp_path)
    train = [r for r in rows if "actor/weights_match" in r]
    assert len(train) == 4
    # Every rollout acted with exactly the weights of the version it reported, and sync was verified.
    assert all(r["actor/weights_match"] == 1.0 for r in train), train
    assert all(r["sync/verified"] for r in rows if "sync/verified" in r)
    assert [r["sync/version"] for r in rows if "sync/version" in r][-1] >= 3
    assert not leftovers(tmp_path)


def test_train_async_with_python_workers(tmp_path):
    p = run(tmp_path, "train_async", "runner.max_steps=5", "algorithm.staleness_threshold=1")
    assert p.returncode == 0, p.stderr
    train = [r for r in metrics(tmp_path) if "actor/weights_match" in r]
    assert len(train) == 5
    assert all(r["actor/weights_match"] == 1.0 for r in train), train
    assert not leftovers(tmp_path)


def summary_seconds(stdout: str, name: str) -> float:
    """The first number of the summary's row `name`."""
    line = next((l for l in stdout.splitlines() if l.strip().startswith(name)), None)
    assert line is not None, f"no {name} row:\n{stdout}"
    return float(re.search(r"\d+(\.\d+)?", line.split(name, 1)[1]).group())


def test_a_slow_python_worker_construction_counts_in_the_start_up_not_in_the_init_bootstrap(tmp_path):
    # Each worker's construction sleeps 1.5 s (as importing a big model would): the start-up lasts until every
    # worker built its workload, and the init bootstrap is the weights' transfer alone.
    p = run(tmp_path, "train_embodied", "runner.max_steps=2", "+fixture.build_s=1.5")
    assert p.returncode == 0, p.stderr
    startup = summary_seconds(p.stdout, "workers' start-up")
    bootstrap = summary_seconds(p.stdout, "init bootstrap")
    assert startup >= 1.5 and bootstrap < 1.5, p.stdout
    assert metrics(tmp_path)[0]["time/init_weights"] < 1.5


@pytest.mark.parametrize(
    "where, role",
    [("train", "trainer"), ("rollout", "rollout"), ("trainer_init", "trainer"), ("state_dict", "trainer")],
)
def test_a_python_exception_fails_the_run_naming_the_worker_and_the_traceback(tmp_path, where, role):
    before = set(os.listdir("/dev/shm"))
    p = run(tmp_path, "train_embodied", "runner.max_steps=3", f"+fixture.raise_in={where}")
    assert p.returncode == 1, p.stderr
    assert f"boom in {where}" in p.stderr
    assert "ValueError" in p.stderr
    assert role in p.stderr
    assert not leftovers(tmp_path)
    assert not shm_leftovers(before)


@pytest.mark.parametrize("where, role", [("train", "trainer"), ("rollout", "rollout")])
def test_a_model_tensor_given_new_memory_fails_the_run_naming_it(tmp_path, where, role):
    # rlsync reads and installs model()'s tensors in place: after `param.data = ...` it would write memory the
    # model no longer uses, so the worker stops with what happened and how to update in place instead.
    p = run(tmp_path, "train_embodied", "runner.max_steps=3", f"+fixture.reassign_in={where}")
    assert p.returncode == 1, p.stderr
    assert f"{where}() gave model tensor 'w.weight' new memory" in p.stderr, p.stderr
    assert "update them in place" in p.stderr and role in p.stderr
    assert not leftovers(tmp_path)


def test_an_entry_that_does_not_import_names_the_module_and_the_search_path(tmp_path):
    p = run(tmp_path, "train_embodied", "runner.max_steps=2", entry="no_such_module_xyz")
    assert p.returncode == 1
    assert "no_such_module_xyz" in p.stderr
    assert "sys.path" in p.stderr
    assert str(WORKERS) in p.stderr
    assert not leftovers(tmp_path)


@pytest.mark.parametrize("dry_run", [True, False])
def test_an_entry_without_its_attribute_is_refused_before_anything_starts(tmp_path, dry_run):
    p = run(tmp_path, "train_embodied", "runner.max_steps=2", *(["--dry-run"] if dry_run else []), entry="tiny_rl:Trainr")
    out = p.stdout + p.stderr
    assert p.returncode == 1, out
    assert "actor.worker.entry=tiny_rl:Trainr" in out, out
    assert "has no attribute 'Trainr'" in out, out
    assert "sys.path searched" in out and str(WORKERS) in out, out
    assert "OK: configuration is valid" not in out
    # Checked once, before any worker started.
    assert not (tmp_path / "run" / "logs").exists() or not any((tmp_path / "run" / "logs").iterdir())
    assert not leftovers(tmp_path)


@pytest.mark.parametrize("dry_run", [True, False])
def test_an_interpreter_without_rlsync_is_named_with_the_fix_before_anything_starts(tmp_path, dry_run):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    # This very interpreter without its site-packages: one that cannot import rlsync, on any machine.
    bare = str(tmp_path / "bare-python3")
    with open(bare, "w") as f:
        f.write(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')
    os.chmod(bare, 0o755)
    probe = subprocess.run([bare, "-c", "import rlsync"], capture_output=True, env=env)
    assert probe.returncode != 0, probe
    args = command("train_embodied", tmp_path / "run", "runner.max_steps=2", f"actor.worker.python={bare}",
                   f"rollout.worker.python={bare}", *(["--dry-run"] if dry_run else []))
    p = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)
    out = p.stdout + p.stderr
    assert p.returncode == 1, out
    assert out.count("cannot import rlsync") == 1, out
    for want in [bare, "actor.worker.python", "No module named 'rlsync'", "run inside the venv", "make python"]:
        assert want in out, (want, out)
    assert not (tmp_path / "run" / "logs").exists() or not any((tmp_path / "run" / "logs").iterdir())


@pytest.mark.parametrize("clip, warned", [(0.5, True), (0.1, False)])
def test_a_python_trainers_clip_fraction_feeds_the_stale_sync_canary(tmp_path, clip, warned):
    p = run(tmp_path, "train_embodied", "runner.max_steps=6", "algorithm.stale_clip_window=3",
            f"+fixture.clip_fraction={clip}")
    assert p.returncode == 0, p.stderr
    assert all(r["actor/clip_fraction"] == clip for r in metrics(tmp_path) if "train/loss" in r)
    if warned:
        assert p.stderr.count("stale weights? actor/clip_fraction averaged 0.500 over the last 3 steps, above 0.30") == 1, p.stderr
        for knob in ["runner.weight_sync_interval", "algorithm.staleness_threshold"]:
            assert knob in p.stderr, p.stderr
        # And once on the progress line.
        assert p.stderr.count("| STALE SYNC? clip 0.50 > 0.30 over 3 steps") == 1, p.stderr
    else:
        assert "stale weights?" not in p.stderr and "STALE SYNC" not in p.stderr, p.stderr


@pytest.mark.parametrize(
    "fixture, named",
    [
        ("+fixture.rollout_out=4", ["w.weight", "[2, 3]", "[4, 3]"]),
        ("+fixture.rollout_extra=true", ["'extra'", "receiver"]),
    ],
)
def test_trainer_and_rollout_models_that_differ_fail_at_init_naming_the_first_mismatch(tmp_path, fixture, named):
    p = run(tmp_path, "train_embodied", "runner.max_steps=2", fixture)
    assert p.returncode == 1, p.stderr
    for text in named:
        assert text in p.stderr, (text, p.stderr[-3000:])
    assert not [r for r in (metrics(tmp_path) if (tmp_path / "run" / "metrics.jsonl").exists() else []) if "train/loss" in r]
    assert not leftovers(tmp_path)


def test_a_bad_entry_is_refused_by_the_config_before_anything_starts(tmp_path):
    p = run(tmp_path, "train_embodied", "runner.max_steps=2", entry="not a module")
    assert p.returncode == 1
    assert "actor.worker.entry" in p.stderr
    assert not (tmp_path / "run" / "logs").exists() or not any((tmp_path / "run" / "logs").iterdir())


def test_mixing_python_and_builtin_workers_is_refused(tmp_path):
    p = run(tmp_path, "train_embodied", "rollout.worker.kind=builtin", "--dry-run")
    assert p.returncode == 1
    assert "rollout.worker.kind" in p.stderr + p.stdout


def test_the_worker_module_refuses_bad_arguments():
    p = subprocess.run(
        [sys.executable, "-m", "rlsync.worker", "--role", "pilot", "--rank", "0", "--run-dir", "/nonexistent"],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT / "python")},
    )
    assert p.returncode == 1
    assert "unknown role 'pilot'" in p.stderr


def test_python_workers_checkpoint_resume_and_eval(tmp_path):
    # The final step always checkpoints the trainer's model() weights; an eval runs the rollouts' evaluate()
    # on the weights they hold after the step's sync (tiny_rl's return is that version).
    p = run(tmp_path, "train_embodied", "runner.max_steps=3", "runner.val_check_interval=3")
    assert p.returncode == 0, p.stderr
    ckpt = tmp_path / "run" / "checkpoints" / "global_step_3"
    assert (ckpt / "model.safetensors").is_file(), p.stdout
    assert str(ckpt) in p.stdout, "the summary names the last checkpoint"
    evals = [r for r in metrics(tmp_path) if "eval/episodes" in r]
    assert [(r["step"], r["eval/episodes"], r["eval/version"]) for r in evals] == [(2, 4, 3)], evals
    assert evals[0]["eval/return"] == 3.0 and evals[0]["eval/episode_len"] == 7.0, evals
    # Resume in place: steps 3..5, versions continue, metrics appended (3 + 2 train lines), weights loaded.
    p = run(tmp_path, "train_embodied", "runner.max_steps=5", f"runner.resume_dir={ckpt}")
    assert p.returncode == 0, p.stderr
    train = [r for r in metrics(tmp_path) if "actor/weights_match" in r]
    assert [r["step"] for r in train] == [0, 1, 2, 3, 4], train
    # The trainer's model got the checkpoint's weights: its `steps` buffer continues at 3.
    assert [r["actor/model_steps"] for r in train] == [0, 1, 2, 3, 4], train
    assert all(r["actor/weights_match"] == 1.0 for r in train), train
    assert (tmp_path / "run" / "checkpoints" / "global_step_5" / "model.safetensors").is_file()
    assert not leftovers(tmp_path)


def test_a_python_trainers_state_dict_is_checkpointed_and_restored_on_resume(tmp_path):
    # tiny_rl's Trainer defines state_dict() / load_state_dict(): Adam's moments and step counts, a counter and
    # other kinds of values go to optimizer.safetensors with every checkpoint and come back on resume.
    p = run(tmp_path, "train_embodied", "runner.max_steps=3")
    assert p.returncode == 0, p.stderr
    ckpt = tmp_path / "run" / "checkpoints" / "global_step_3"
    first = [r for r in metrics(tmp_path) if "actor/adam_step" in r]
    assert [r["actor/adam_step"] for r in first] == [0.0, 1.0, 2.0], first
    # The file: a plain safetensors file a PyTorch user reads with the safetensors package, or rlsync's loader.
    from safetensors import safe_open

    import rlsync

    with safe_open(str(ckpt / "optimizer.safetensors"), "pt") as f:
        meta = f.metadata()
        assert meta["format"] == "rlsync_checkpoint" and meta["global_step"] == "3", meta
        assert {"optimizer.state.0.exp_avg", "optimizer.state.0.exp_avg_sq", "optimizer.state.0.step"} <= set(f.keys())
        raw = rlsync.checkpoint.unflatten_state({k: f.get_tensor(k) for k in f.keys()}, meta["trainer_state"])
    sd = rlsync.load_trainer_state(ckpt)
    assert sd["updates"] == 3 and raw["updates"] == 3
    assert float(sd["optimizer"]["state"][0]["step"]) == 3.0
    assert sd["optimizer"]["param_groups"][0]["lr"] == 0.05
    saved_moments = sum(float(s["exp_avg"].double().sum()) for s in sd["optimizer"]["state"].values())
    assert saved_moments == first[-1]["actor/exp_avg_after"]
    assert all(torch.equal(raw["optimizer"]["state"][0][k], sd["optimizer"]["state"][0][k]) for k in ("exp_avg", "exp_avg_sq"))
    # Resume: the optimizer continues where it stopped (step 3, the same moments), not afresh.
    p = run(tmp_path, "train_embodied", "runner.max_steps=5", f"runner.resume_dir={ckpt}")
    assert p.returncode == 0, p.stderr
    rows = [r for r in metrics(tmp_path) if "actor/adam_step" in r]
    assert [r["actor/adam_step"] for r in rows] == [0.0, 1.0, 2.0, 3.0, 4.0], rows
    assert [r["actor/updates"] for r in rows] == [0.0, 1.0, 2.0, 3.0, 4.0], rows
    assert rows[3]["actor/exp_avg_before"] == first[-1]["actor/exp_avg_after"], (rows[3], first[-1])
    assert all(r["actor/weights_match"] == 1.0 for r in rows), rows
    assert float(rlsync.load_trainer_state(tmp_path / "run" / "checkpoints" / "global_step_5")["optimizer"]["state"][0]["step"]) == 5.0
    assert not leftovers(tmp_path)
