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


class Policy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Linear(3, 2)
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))


class Trainer:
    def __init__(self, cfg: dict) -> None:
        _fail(cfg, "trainer_init")
        torch.manual_seed(0)
        self.cfg = cfg
        self.policy = Policy()
        self.opt = torch.optim.SGD(self.policy.parameters(), lr=0.1)
        # Weights by version (the `steps` buffer: 0 initially, a checkpoint's step after a resume, which rlsync
        # restores into the model after __init__); each train() makes the next.
        self.history: dict[int, np.ndarray] = {}

    def _flat(self) -> np.ndarray:
        return torch.cat([p.detach().flatten() for p in self.policy.parameters()]).numpy().copy()

    def model(self) -> nn.Module:
        return self.policy

    def train(self, batches: list[dict[str, np.ndarray]]) -> dict[str, float]:
        _fail(self.cfg, "train")
        start = int(self.policy.steps)
        self.history.setdefault(start, self._flat())
        match = all(
            np.array_equal(b["weights"], self.history[int(b["version"][0])]) for b in batches
        )
        obs = torch.as_tensor(np.concatenate([b["obs"].reshape(-1, 3) for b in batches]))
        loss = self.policy.w(obs).pow(2).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        self.policy.steps += 1
        self.history[int(self.policy.steps)] = self._flat()
        return {
            "loss": float(loss),
            "weights_match": float(match),
            "chunks": float(len(batches)),
            "model_steps": float(start),
        }


class Rollout:
    def __init__(self, cfg: dict, rank: int, num_rollouts: int) -> None:
        _fail(cfg, "rollout_init")
        self.cfg = cfg
        # The trainer's initial weights (as the bucket syncer assumes: version 0 is each worker's own init).
        torch.manual_seed(0)
        self.policy = Policy()
        self.envs = int(cfg["env"]["train"]["total_num_envs"]) // num_rollouts
        self.eval_envs = int(cfg["env"]["eval"]["total_num_envs"]) // num_rollouts
        self.rng = np.random.default_rng(rank)
        self.version = 0
        # Seconds each rollout() takes at least (+fixture.rollout_sleep_s): runs long enough to kill workers in.
        self.sleep = float((cfg.get("fixture") or {}).get("rollout_sleep_s", 0.0))

    def model(self) -> nn.Module:
        return self.policy

    def evaluate(self) -> dict[str, float]:
        # Its "return" is the version of the weights it holds (the trainer's `steps` buffer travels with them).
        return {"return": float(self.policy.steps), "episodes": self.eval_envs, "episode_len": 7.0}

    def rollout(self, steps: int) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        _fail(self.cfg, "rollout")
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
