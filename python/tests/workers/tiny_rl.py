"""Tiny Python workers for the tests: a linear policy on a fake 1-d env, and failure modes on demand.

The rollout returns, with its trajectories, the exact weights it acted with; the trainer checks them against
its own weights of the version the rollout says it used. So a run proves, step by step, that rlsync delivered
the trainer's weights bit for bit (``actor/weights_match`` = 1.0).
"""

from __future__ import annotations

import time

import numpy as np
import torch
from torch import nn


def _fail(cfg: dict, where: str) -> None:
    if (cfg.get("fixture") or {}).get("raise_in") == where:
        raise ValueError(f"boom in {where}")


def _reassign(cfg: dict, where: str, model: nn.Module) -> None:
    """+fixture.reassign_in=<where>: give the model's weight new memory there (what rlsync must refuse)."""
    if (cfg.get("fixture") or {}).get("reassign_in") == where:
        model.w.weight.data = model.w.weight.data.clone()


def _slow_build(cfg: dict) -> None:
    """Sleep ``fixture.build_s`` seconds while constructing, as a model that takes long to build would."""
    time.sleep(float((cfg.get("fixture") or {}).get("build_s", 0.0)))


class Policy(nn.Module):
    def __init__(self, out: int = 2, extra: bool = False) -> None:
        super().__init__()
        self.w = nn.Linear(3, out)
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))
        if extra:
            self.register_buffer("extra", torch.zeros(2))


class Trainer:
    def __init__(self, cfg: dict) -> None:
        _fail(cfg, "trainer_init")
        _slow_build(cfg)
        torch.manual_seed(0)
        self.cfg = cfg
        self.policy = Policy()
        self.opt = torch.optim.Adam(self.policy.parameters(), lr=0.05)
        self.updates = 0  # trainer state outside the model: saved by state_dict(), restored on resume
        # Weights by version (the `steps` buffer: 0 initially, a checkpoint's step after a resume, which rlsync
        # restores into the model after __init__); each train() makes the next.
        self.history: dict[int, np.ndarray] = {}

    def _flat(self) -> np.ndarray:
        return torch.cat([p.detach().flatten() for p in self.policy.parameters()]).numpy().copy()

    def model(self) -> nn.Module:
        return self.policy

    def state_dict(self) -> dict:
        # What resuming needs besides the model's tensors: the optimizer (Adam moments, step counts, param
        # groups), counters, and a few other kinds of values that must round-trip.
        _fail(self.cfg, "state_dict")
        return {
            "optimizer": self.opt.state_dict(),
            "updates": self.updates,
            "extras": {"ratio": np.array([0.5, 2.0]), "tag": ("tiny", None, True), 7: 1.5},
        }

    def load_state_dict(self, sd: dict) -> None:
        assert sd["extras"]["tag"] == ("tiny", None, True) and sd["extras"][7] == 1.5, sd["extras"]
        assert np.array_equal(sd["extras"]["ratio"], [0.5, 2.0])
        self.opt.load_state_dict(sd["optimizer"])
        self.updates = sd["updates"]

    def _adam(self) -> tuple[float, float]:
        """Adam's step count and the sum of its first moments (0 before the first update)."""
        st = self.opt.state.get(self.policy.w.weight, {})
        step = float(st["step"]) if "step" in st else 0.0
        exp_avg = sum(float(s["exp_avg"].double().sum()) for s in self.opt.state.values() if "exp_avg" in s)
        return step, exp_avg

    def train(self, batches: list[dict[str, np.ndarray]]) -> dict[str, float]:
        _fail(self.cfg, "train")
        start = int(self.policy.steps)
        self.history.setdefault(start, self._flat())
        match = all(
            np.array_equal(b["weights"], self.history[int(b["version"][0])]) for b in batches
        )
        adam_step, exp_avg_before = self._adam()
        obs = torch.as_tensor(np.concatenate([b["obs"].reshape(-1, 3) for b in batches]))
        loss = self.policy.w(obs).pow(2).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        self.policy.steps += 1
        self.history[int(self.policy.steps)] = self._flat()
        _reassign(self.cfg, "train", self.policy)
        updates, self.updates = self.updates, self.updates + 1
        # +fixture.clip_fraction=x: report it as PPO trainers do (logged as actor/clip_fraction).
        clip = (self.cfg.get("fixture") or {}).get("clip_fraction")
        extra = {} if clip is None else {"clip_fraction": float(clip)}
        return {
            **extra,
            "loss": float(loss),
            "weights_match": float(match),
            "chunks": float(len(batches)),
            "model_steps": float(start),
            "updates": float(updates),
            "adam_step": adam_step,
            "exp_avg_before": exp_avg_before,
            "exp_avg_after": self._adam()[1],
        }


class Rollout:
    def __init__(self, cfg: dict, rank: int, num_rollouts: int) -> None:
        _fail(cfg, "rollout_init")
        _slow_build(cfg)
        self.cfg = cfg
        # The trainer's initial weights (as the bucket syncer assumes: version 0 is each worker's own init),
        # or a rollout model that differs from the trainer's, on demand (the run must refuse it at init).
        torch.manual_seed(0)
        fixture = cfg.get("fixture") or {}
        self.policy = Policy(int(fixture.get("rollout_out", 2)), bool(fixture.get("rollout_extra", False)))
        self.envs = int(cfg["env"]["train"]["total_num_envs"]) // num_rollouts
        self.eval_envs = int(cfg["env"]["eval"]["total_num_envs"]) // num_rollouts
        self.rng = np.random.default_rng(rank)
        self.version = 0
        # Seconds each rollout() takes at least (+fixture.rollout_sleep_s): runs long enough to kill workers in.
        self.sleep = float((cfg.get("fixture") or {}).get("rollout_sleep_s", 0.0))
        # weight_syncer.host_shared: the parameters become views of the host's shared buffer, the objects stay.
        self.params = [(p, p.data_ptr()) for p in self.policy.parameters()]
        self.shared = bool(((cfg.get("weight_syncer") or {}).get("host_shared")))

    def model(self) -> nn.Module:
        return self.policy

    def evaluate(self) -> dict[str, float]:
        # Its "return" is the version of the weights it holds (the trainer's `steps` buffer travels with them).
        return {"return": float(self.policy.steps), "episodes": self.eval_envs, "episode_len": 7.0}

    def rollout(self, steps: int) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        _fail(self.cfg, "rollout")
        _reassign(self.cfg, "rollout", self.policy)
        if self.shared:
            now = list(self.policy.parameters())
            assert [id(p) for p in now] == [id(p) for p, _ in self.params], "the Parameter objects were replaced"
            moved = [p.data_ptr() != ptr for p, ptr in self.params]
            assert all(moved), f"host-shared: parameters still on their own memory: {moved}"
        if self.sleep > 0:
            time.sleep(self.sleep)
        obs = self.rng.standard_normal((steps, self.envs, 3)).astype(np.float32)
        with torch.no_grad():
            act = self.policy.w(torch.as_tensor(obs)).numpy()
        flat = torch.cat([p.detach().flatten() for p in self.policy.parameters()]).numpy().copy()
        # The version these weights are: the trainer's `steps` buffer travels with them.
        version = int(self.policy.steps)
        return (
            {
                "obs": obs,
                "actions": act,
                "rewards": -np.abs(act).sum(-1),
                "done": np.zeros((steps, self.envs), bool),
                "weights": flat,
                "version": np.array([version], np.int64),
            },
            {"return": float(-np.abs(act).sum(-1).mean())},
        )
