"""`actor.worker.device` / `rollout.worker.device`: typed and validated by the config, reaching the Python worker
(which moves `model()` there), and `cuda` on a machine without CUDA refused at start with a clear message (no
traceback), by the run and by `--dry-run`."""

from __future__ import annotations

import json
import subprocess
from types import SimpleNamespace

import pytest
import torch
from python_runs import WORKERS, command, environment, processes

from rlsync import worker as rlsync_worker

NO_CUDA = not torch.cuda.is_available()


def run(tmp_path, *overrides: str, dry: bool = False) -> subprocess.CompletedProcess:
    args = command("train_embodied", tmp_path / "run", "runner.max_steps=2", *overrides)
    if dry:
        args.append("--dry-run")
    return subprocess.run(args, capture_output=True, text=True, timeout=300, env=environment())


@pytest.mark.skipif(not NO_CUDA, reason="this machine has CUDA: the refusal is for machines without it")
@pytest.mark.parametrize("dry", [False, True], ids=["run", "dry-run"])
def test_cuda_without_cuda_is_refused_before_any_worker_starts(tmp_path, dry):
    p = run(tmp_path, "rollout.worker.device=cuda:0", dry=dry)
    text = p.stdout + p.stderr
    assert p.returncode == 1, text
    assert "rollout.worker.device=cuda:0: CUDA is not available on this machine" in text, text
    assert "set rollout.worker.device=cpu" in text
    assert "Traceback" not in text
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or dry
    assert not processes(tmp_path / "run")


def test_a_bad_device_is_refused_by_the_config(tmp_path):
    p = run(tmp_path, "actor.worker.device=gpu", dry=True)
    assert p.returncode == 1
    text = p.stdout + p.stderr
    assert "actor.worker.device" in text and "'gpu' is not a device: expected cpu, cuda or cuda:N" in text, text


def test_the_device_is_listed_by_the_dry_run_and_cpu_runs(tmp_path):
    p = run(tmp_path, "actor.worker.device=cpu", "rollout.worker.device=cpu", dry=True)
    assert p.returncode == 0, p.stderr
    assert "python -m rlsync.worker (tiny_rl, on cpu) --role trainer" in p.stdout, p.stdout
    p = run(tmp_path, "actor.worker.device=cpu", "rollout.worker.device=cpu")
    assert p.returncode == 0, p.stderr
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["actor/weights_match"] for r in rows if "actor/weights_match" in r] == [1.0, 1.0]


def job(device: str | None, role_section: str = "rollout") -> str:
    worker = {"entry": "tiny_rl"} | ({} if device is None else {"device": device})
    cfg = {
        "actor": {"worker": {"entry": "tiny_rl"}},
        "rollout": {"worker": {"entry": "tiny_rl"}},
        "env": {"train": {"total_num_envs": 2}, "eval": {"total_num_envs": 2}},
    }
    cfg[role_section]["worker"] = worker
    return json.dumps(cfg)


def test_the_worker_reads_its_roles_device_and_checks_it(monkeypatch):
    monkeypatch.syspath_prepend(str(WORKERS))
    assert rlsync_worker.worker_device(json.loads(job(None)), "rollout") == torch.device("cpu")
    assert rlsync_worker.worker_device(json.loads(job("cpu")), "rollout") == torch.device("cpu")
    # The trainer reads actor.worker.device, the rollout rollout.worker.device.
    assert rlsync_worker.worker_device(json.loads(job("cuda:3")), "trainer") == torch.device("cpu")
    with pytest.raises(ValueError, match=r"rollout.worker.device='tpu' is not a device"):
        rlsync_worker.worker_device(json.loads(job("tpu")), "rollout")
    with pytest.raises(ValueError, match=r"is not a device"):
        rlsync_worker.worker_device(json.loads(job("cuda:x")), "rollout")
    if NO_CUDA:
        with pytest.raises(RuntimeError, match=r"rollout.worker.device=cuda: CUDA is not available to this worker"):
            rlsync_worker._factory(job("cuda"), {"role": "rollout", "rank": 0, "rollouts": 1})


def test_the_worker_moves_model_to_its_device_keeping_the_parameters(monkeypatch):
    """What the worker does with a GPU, shown with torch's `meta` device standing in for it: the adapter moves
    `model()` there before anything is described to the syncer."""
    monkeypatch.syspath_prepend(str(WORKERS))
    monkeypatch.setattr(rlsync_worker, "worker_device", lambda cfg, role: torch.device("meta"))
    adapter = rlsync_worker._factory(job("cuda"), {"role": "rollout", "rank": 0, "rollouts": 1})
    model = adapter.user.model()
    assert {t.device.type for t in [*model.parameters(), *model.buffers()]} == {"meta"}
    # With cpu the model stays where the user's code put it.
    monkeypatch.setattr(rlsync_worker, "worker_device", lambda cfg, role: torch.device("cpu"))
    adapter = rlsync_worker._factory(job("cpu"), {"role": "rollout", "rank": 0, "rollouts": 1})
    assert {t.device.type for t in adapter.user.model().parameters()} == {"cpu"}


def test_arrays_a_rollout_returns_as_tensors_travel_from_the_host():
    items = rlsync_worker._arrays_out({"obs": torch.arange(6, dtype=torch.float32).reshape(2, 3)})
    assert items[0][:3] == ("obs", "<f4", (2, 3))
    assert items[0][3] == torch.arange(6, dtype=torch.float32).numpy().tobytes()


def test_the_worker_waits_for_its_gpus_after_the_users_code(monkeypatch):
    """After ``train()`` / ``rollout()`` / ``evaluate()`` the adapter waits for each GPU the model lives on (and no
    other device): the user's work on streams of its own is done before rlsync reads or installs the weights."""
    monkeypatch.syspath_prepend(str(WORKERS))
    adapter = rlsync_worker._factory(job("cpu"), {"role": "rollout", "rank": 0, "rollouts": 1})
    adapter.describe()
    waited: list = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waited.append(device))
    adapter._settle()
    assert waited == [], "a model on the CPU waits for no GPU"
    real_describe = rlsync_worker._describe
    placed = {"a": "cuda:1", "b": "cpu", "c": "cuda:0", "d": "cuda:1"}
    fake = [(n, SimpleNamespace(device=d), 8 * i, "float32", (1,), (1,), d) for i, (n, d) in enumerate(placed.items())]
    monkeypatch.setattr(rlsync_worker, "_describe", lambda model: fake)
    adapter.describe()
    monkeypatch.setattr(rlsync_worker, "_describe", real_describe)
    adapter._settle()
    assert waited == ["cuda:0", "cuda:1"]
    checked: list = []
    monkeypatch.setattr(adapter, "_check_in_place", checked.append)
    waited.clear()
    adapter._returned("rollout")
    assert waited == ["cuda:0", "cuda:1"] and checked == ["rollout"]
