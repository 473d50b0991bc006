"""A Python trainer's own state (optimizer, critic, schedules) in rlsync checkpoints: the file round-trips
exactly, PyTorch users read it with safetensors, and resuming an optimizer from it continues bit for bit."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import rlsync
from rlsync.checkpoint import flatten_state, save_trainer_state, unflatten_state

ROOT = Path(__file__).resolve().parents[2]


def trained(steps: int = 3) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for _ in range(steps):
        step(net, opt, sched, seed=_)
    return net, opt, sched


def step(net: torch.nn.Module, opt: torch.optim.Optimizer, sched: object, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    loss = net(torch.randn(16, 4, generator=g)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()  # type: ignore[attr-defined]


def same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def test_a_trainer_state_round_trips_through_the_file_exactly(tmp_path: Path) -> None:
    net, opt, sched = trained()
    state = {
        "optimizer": opt.state_dict(),  # int keys, tensors (0-d step counts too), tuples (betas), None, bools
        "schedule": sched.state_dict(),
        "critic": net.state_dict(),
        "ret_rms": np.array([0.25, 4.0, 17.0]),
        "mask": torch.tensor([True, False]),
        "half": torch.ones(3, dtype=torch.bfloat16),
        "rng": torch.get_rng_state(),  # uint8
        "empty": torch.zeros(0, 5),
        "lists": [1, -2.5, "x", None, [np.float32(1.5)]],
    }
    save_trainer_state(tmp_path, state, global_step=7, version=9)
    back = rlsync.load_trainer_state(tmp_path)
    want = copy.deepcopy(state)
    want["lists"][4][0] = 1.5  # a numpy scalar comes back as the Python number it holds
    assert same(back, want)

    # The same file through the safetensors package, as a PyTorch user without rlsync's loader reads it.
    from safetensors import safe_open

    with safe_open(str(tmp_path / "optimizer.safetensors"), "pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    assert (meta["format"], meta["global_step"], meta["version"]) == ("rlsync_checkpoint", "7", "9")
    assert "optimizer.state.0.exp_avg" in tensors and "critic.2.weight" in tensors
    assert same(unflatten_state(tensors, meta["trainer_state"]), want)


def test_an_optimizer_resumed_from_the_file_continues_bit_for_bit(tmp_path: Path) -> None:
    net, opt, sched = trained(3)
    save_trainer_state(tmp_path, {"optimizer": opt.state_dict(), "schedule": sched.state_dict()})
    # Resumed: the same weights in a fresh module, a fresh optimizer and schedule loaded from the file.
    net2 = copy.deepcopy(net)
    opt2 = torch.optim.Adam(net2.parameters(), lr=1e-2)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=2, gamma=0.5)
    sd = rlsync.load_trainer_state(tmp_path)
    opt2.load_state_dict(sd["optimizer"])
    sched2.load_state_dict(sd["schedule"])
    assert float(opt2.state[next(net2.parameters())]["step"]) == 3.0
    for seed in range(3, 6):
        step(net, opt, sched, seed)
        step(net2, opt2, sched2, seed)
    for (k, a), b in zip(net.state_dict().items(), net2.state_dict().values()):
        assert torch.equal(a, b), k
    assert opt.param_groups[0]["lr"] == opt2.param_groups[0]["lr"]


@pytest.mark.parametrize(
    "state, match",
    [
        ({"opt": {"fn": print}}, r"trainer state at 'opt.fn' is a builtin_function_or_method"),
        ({"a": [1, object()]}, r"trainer state at 'a.1' is a object"),
        ({(1, 2): 3}, r"key \(1, 2\) is a tuple"),
        ({"c": torch.zeros(2, dtype=torch.complex64)}, "dtype complex64"),
        ({"a.b": torch.ones(1), "a": {"b": torch.ones(1)}}, "two tensors at 'a.b'"),
    ],
)
def test_what_cannot_be_saved_is_named(tmp_path: Path, state: dict, match: str) -> None:
    with pytest.raises((TypeError, ValueError, rlsync.RlsyncError), match=match):
        save_trainer_state(tmp_path, state)


def test_reading_a_checkpoint_without_trainer_state_says_so(tmp_path: Path) -> None:
    with pytest.raises(rlsync.RlsyncError, match="no trainer state"):
        rlsync.load_trainer_state(tmp_path)


def test_flatten_names_tensors_by_their_path() -> None:
    tensors, _ = flatten_state({"optimizer": {"state": {0: {"exp_avg": torch.ones(2)}}}, "x": (torch.ones(1),)})
    assert sorted(tensors) == ["optimizer.state.0.exp_avg", "x.0"]


def test_the_gym_ppo_trainer_resumes_its_optimizer_critic_and_reward_scaling(tmp_path: Path) -> None:
    pytest.importorskip("gymnasium")
    sys.path.insert(0, str(ROOT / "examples" / "gym_ppo"))
    try:
        import gym_ppo
    finally:
        sys.path.pop(0)
    cfg = {"env": {"train": {"task": "CartPole-v1", "total_num_envs": 4}}, "algorithm": {"update_epoch": 1}}
    trainer, rollout = gym_ppo.Trainer(cfg), gym_ppo.Rollout(cfg, 0, 1)
    rollout.actor.load_state_dict(trainer.actor.state_dict())
    trainer.train([rollout.rollout(16)[0]])
    assert trainer.optim.state, "one update made Adam state"
    save_trainer_state(tmp_path, trainer.state_dict())
    fresh = gym_ppo.Trainer(cfg)
    fresh.actor.load_state_dict(trainer.actor.state_dict())  # rlsync restores model() from model.safetensors
    fresh.load_state_dict(rlsync.load_trainer_state(tmp_path))
    assert same(fresh.state_dict(), trainer.state_dict())
