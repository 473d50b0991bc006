"""PPO on Gymnasium/MuJoCo tasks as rlsync Python workers: a PyTorch trainer and a vector-env rollout.

rlsync launches one ``Trainer`` (``actor.worker.entry=gym_ppo:Trainer``) and N ``Rollout`` workers
(``rollout.worker.entry=gym_ppo:Rollout``); it moves the actor's weights trainer -> rollouts after every update
(patch or bucket syncer, verified by checksum) and the trajectories rollouts -> trainer.

Only the actor (``Actor``: observation normaliser buffers + Gaussian policy) is synced: the critic lives on the
trainer alone, which computes values and GAE advantages on the batch it receives. The observation normaliser's
running statistics are persistent buffers of the actor, so they travel with the weights and every rollout
normalises exactly as the trainer does.

Run it from the repository root: ``rlsync train_embodied --config-name gym_reacher`` (README, "Python workers");
other tasks by override: ``env.train.task=InvertedPendulum-v5`` (also Pusher-v5; ``CartPole-v1`` for a
discrete action space). On a GPU: ``actor.worker.device=cuda rollout.worker.device=cuda`` (the trainer's actor
and critic, and each rollout's actor, live there; observations go to it and actions come back to the host).
The same file runs without rlsync for a quick check: ``python examples/gym_ppo/gym_ppo.py --steps 200000``.
"""

from __future__ import annotations

import math
import time
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from torch import nn

# Trajectory arrays a rollout returns for a chunk of T steps on N envs (time-major).
# obs [T, N, O], actions [T, N, A], logp [T, N], rewards [T, N], terminated [T, N], truncated [T, N],
# final_obs [T, N, O] (the observation an episode ended on; zeros elsewhere), last_obs [N, O].


class Actor(nn.Module):
    """Observation normaliser (persistent buffers) + tanh MLP: a Gaussian (mean + state-independent log
    std) for Box action spaces, a categorical over logits for Discrete ones."""

    def __init__(self, obs_dim: int, act_dim: int, hidden: int = 64, discrete: bool = False) -> None:
        super().__init__()
        self.register_buffer("obs_mean", torch.zeros(obs_dim, dtype=torch.float64))
        self.register_buffer("obs_var", torch.ones(obs_dim, dtype=torch.float64))
        self.register_buffer("obs_count", torch.tensor(1e-4, dtype=torch.float64))
        self.net = nn.Sequential(
            nn.Linear(obs_dim, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
            nn.Linear(hidden, act_dim),
        )
        nn.init.orthogonal_(self.net[-1].weight, gain=0.01)
        nn.init.zeros_(self.net[-1].bias)
        self.discrete = discrete
        # Unused (but synced, it is a parameter) for discrete actions.
        self.log_std = nn.Parameter(torch.full((act_dim,), -0.5))

    def normalize(self, obs: torch.Tensor) -> torch.Tensor:
        std = torch.sqrt(self.obs_var + 1e-8)
        return ((obs.double() - self.obs_mean) / std).clamp(-10.0, 10.0).float()

    def dist(self, obs: torch.Tensor) -> torch.distributions.Distribution:
        out = self.net(self.normalize(obs))
        if self.discrete:
            return torch.distributions.Categorical(logits=out)
        return torch.distributions.Normal(out, self.log_std.exp().expand_as(out))

    def log_prob(self, dist: torch.distributions.Distribution, action: torch.Tensor) -> torch.Tensor:
        lp = dist.log_prob(action)
        return lp if self.discrete else lp.sum(-1)

    def act_deterministic(self, obs: torch.Tensor) -> torch.Tensor:
        out = self.net(self.normalize(obs))
        return out.argmax(-1) if self.discrete else out

    @torch.no_grad()
    def update_normalizer(self, obs: np.ndarray) -> None:
        """Welford-style merge of a batch into the running mean/var (done by the trainer only)."""
        batch = torch.as_tensor(obs.reshape(-1, obs.shape[-1]), dtype=torch.float64, device=self.obs_mean.device)
        b_mean, b_var, b_n = batch.mean(0), batch.var(0, unbiased=False), batch.shape[0]
        delta, total = b_mean - self.obs_mean, self.obs_count + b_n
        m2 = self.obs_var * self.obs_count + b_var * b_n + delta.pow(2) * self.obs_count * b_n / total
        self.obs_mean += delta * b_n / total
        self.obs_var.copy_(m2 / total)
        self.obs_count.copy_(total)


def critic(obs_dim: int, hidden: int = 64) -> nn.Module:
    net = nn.Sequential(
        nn.Linear(obs_dim, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
        nn.Linear(hidden, 1),
    )
    nn.init.orthogonal_(net[-1].weight, gain=1.0)
    return net


def _task_dims(task: str) -> tuple[int, int, bool]:
    """Observation size, action size (dims or choices) and whether the action space is discrete."""
    env = gym.make(task)
    try:
        obs_dim = int(np.prod(env.observation_space.shape))
        space = env.action_space
        if isinstance(space, gym.spaces.Discrete):
            return obs_dim, int(space.n), True
        if isinstance(space, gym.spaces.Box):
            return obs_dim, int(np.prod(space.shape)), False
        raise ValueError(f"{task}: action space {space} is neither Box nor Discrete")
    finally:
        env.close()


def _get(cfg: dict, path: str, default: Any) -> Any:
    node: Any = cfg
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


class Trainer:
    """The PPO learner: actor (synced to rollouts) + critic (trainer only)."""

    def __init__(self, cfg: dict) -> None:
        self.task = _get(cfg, "env.train.task", "Reacher-v5")
        seed = int(_get(cfg, "actor.seed", 1))
        torch.manual_seed(seed)
        torch.set_num_threads(1)
        self.device = torch.device(_get(cfg, "actor.worker.device", "cpu"))
        obs_dim, act_dim, discrete = _task_dims(self.task)
        hidden = int(_get(cfg, "actor.model.hidden_dim", 64))
        self.actor = Actor(obs_dim, act_dim, hidden, discrete).to(self.device)
        self.critic = critic(obs_dim, hidden).to(self.device)
        lr = float(_get(cfg, "actor.optim.lr", 3e-4))
        self.optim = torch.optim.Adam(
            list(self.actor.parameters()) + list(self.critic.parameters()), lr=lr, eps=1e-5
        )
        self.gamma = float(_get(cfg, "algorithm.gamma", 0.99))
        self.lam = float(_get(cfg, "algorithm.gae_lambda", 0.95))
        self.clip_low = float(_get(cfg, "algorithm.clip_ratio_low", 0.2))
        self.clip_high = float(_get(cfg, "algorithm.clip_ratio_high", 0.2))
        self.value_coef = float(_get(cfg, "algorithm.value_coef", 0.5))
        self.epochs = int(_get(cfg, "algorithm.update_epoch", 10))
        self.minibatch = int(_get(cfg, "actor.global_batch_size", 256))
        self.clip_grad = float(_get(cfg, "actor.optim.clip_grad", 0.5))
        self.ret_rms = np.array([0.0, 1.0, 1e-4])  # running mean, var, count of discounted returns
        self.ret_acc: np.ndarray | None = None

    def model(self) -> nn.Module:
        """The module whose weights rlsync syncs to the rollouts."""
        return self.actor

    def state_dict(self) -> dict[str, Any]:
        """What resuming needs besides the actor (which rlsync checkpoints as ``model()``): the critic, Adam's
        moments and step counts, the reward scaler's running statistics and the RNG that shuffles minibatches.
        rlsync saves it with every checkpoint (``optimizer.safetensors``) and hands it back to
        :meth:`load_state_dict` on ``runner.resume_dir``."""
        return {
            "critic": self.critic.state_dict(),
            "optimizer": self.optim.state_dict(),
            "ret_rms": self.ret_rms,
            "ret_acc": self.ret_acc,
            "torch_rng": torch.get_rng_state(),
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.critic.load_state_dict(sd["critic"])
        self.optim.load_state_dict(sd["optimizer"])
        self.ret_rms = np.asarray(sd["ret_rms"], dtype=np.float64).copy()
        self.ret_acc = None if sd["ret_acc"] is None else np.asarray(sd["ret_acc"]).copy()
        torch.set_rng_state(sd["torch_rng"])

    def _reward_scale(self, rewards: np.ndarray, done: np.ndarray) -> float:
        # Scale rewards by the std of the running discounted return (as SB3's VecNormalize does).
        if self.ret_acc is None or self.ret_acc.shape != rewards.shape[1:]:
            self.ret_acc = np.zeros(rewards.shape[1:])
        rets = []
        for t in range(rewards.shape[0]):
            self.ret_acc = self.ret_acc * self.gamma + rewards[t]
            rets.append(self.ret_acc.copy())
            self.ret_acc[done[t]] = 0.0
        batch = np.asarray(rets)
        mean, var, count = self.ret_rms
        b_mean, b_var, b_n = batch.mean(), batch.var(), batch.size
        delta, total = b_mean - mean, count + b_n
        var = (var * count + b_var * b_n + delta**2 * count * b_n / total) / total
        self.ret_rms = np.array([mean + delta * b_n / total, var, total])
        return 1.0 / math.sqrt(var + 1e-8)

    def train(self, batches: list[dict[str, np.ndarray]]) -> dict[str, float]:
        """One PPO update on the trajectories of every rollout (each time-major [T, N, ...])."""
        b = {k: np.concatenate([x[k] for x in batches], axis=0 if k == "last_obs" else 1) for k in batches[0]}
        dev = self.device

        def on_dev(a: np.ndarray, dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
            return torch.as_tensor(a, dtype=dtype, device=dev)

        obs = on_dev(b["obs"])
        T, N = b["rewards"].shape
        done = np.logical_or(b["terminated"], b["truncated"])
        scale = self._reward_scale(b["rewards"], done)
        rewards = on_dev(b["rewards"] * scale).clamp(-10, 10)
        with torch.no_grad():
            norm = self.actor.normalize
            values = self.critic(norm(obs)).squeeze(-1)
            last_v = self.critic(norm(on_dev(b["last_obs"]))).squeeze(-1)
            final_v = self.critic(norm(on_dev(b["final_obs"]))).squeeze(-1)
            term = on_dev(b["terminated"])
            trunc = on_dev(b["truncated"])
            adv = torch.zeros(T, N, device=dev)
            gae = torch.zeros(N, device=dev)
            for t in reversed(range(T)):
                next_v = last_v if t == T - 1 else values[t + 1]
                ended = torch.maximum(term[t], trunc[t])
                # A truncated episode bootstraps from its final observation; a terminated one from 0.
                boot = torch.where(trunc[t] > 0, final_v[t], next_v) * (1.0 - term[t])
                delta = rewards[t] + self.gamma * boot - values[t]
                gae = delta + self.gamma * self.lam * (1.0 - ended) * gae
                adv[t] = gae
            returns = adv + values
        act = on_dev(b["actions"], None)
        act = act.reshape(T * N) if self.actor.discrete else act.float().reshape(T * N, -1)
        old_logp = on_dev(b["logp"]).reshape(-1)
        flat_obs, adv, returns = obs.reshape(T * N, -1), adv.reshape(-1), returns.reshape(-1)
        # The behaviour policy's log-probs against the trainer's weights before the update: ~0 when the rollouts
        # acted with exactly these weights (train_embodied), > 0 when they were stale (train_async).
        with torch.no_grad():
            behav_kl = (old_logp - self.actor.log_prob(self.actor.dist(flat_obs), act)).mean().item()
        stats = {"pg_loss": 0.0, "value_loss": 0.0, "approx_kl": 0.0, "clip_frac": 0.0}
        n_mb = 0
        for _ in range(self.epochs):
            perm = torch.randperm(T * N).to(dev)
            for start in range(0, T * N, self.minibatch):
                idx = perm[start : start + self.minibatch]
                a = adv[idx]
                a = (a - a.mean()) / (a.std() + 1e-8)
                logp = self.actor.log_prob(self.actor.dist(flat_obs[idx]), act[idx])
                ratio = (logp - old_logp[idx]).exp()
                clipped = ratio.clamp(1 - self.clip_low, 1 + self.clip_high)
                pg = -torch.min(ratio * a, clipped * a).mean()
                v = self.critic(self.actor.normalize(flat_obs[idx])).squeeze(-1)
                vloss = 0.5 * (v - returns[idx]).pow(2).mean()
                self.optim.zero_grad()
                (pg + self.value_coef * vloss).backward()
                nn.utils.clip_grad_norm_(
                    list(self.actor.parameters()) + list(self.critic.parameters()), self.clip_grad
                )
                self.optim.step()
                with torch.no_grad():
                    stats["pg_loss"] += pg.item()
                    stats["value_loss"] += vloss.item()
                    stats["approx_kl"] += (old_logp[idx] - logp).mean().item()
                    stats["clip_frac"] += (ratio != clipped).float().mean().item()
                n_mb += 1
        # Normalise with statistics that include this batch from the next update on (the rollouts get them
        # with the weights).
        self.actor.update_normalizer(b["obs"])
        out = {k: v / max(n_mb, 1) for k, v in stats.items()}
        out["loss"] = out["pg_loss"] + self.value_coef * out["value_loss"]
        out["behav_approx_kl"] = behav_kl
        with torch.no_grad():
            out["entropy"] = float(self.actor.dist(flat_obs[:1024]).entropy().mean().item())
        return out


class Rollout:
    """A Gymnasium vector env acting with the synced actor; episodes continue across chunks."""

    def __init__(self, cfg: dict, rank: int, num_rollouts: int) -> None:
        self.task = _get(cfg, "env.train.task", "Reacher-v5")
        total = int(_get(cfg, "env.train.total_num_envs", 16))
        self.num_envs = max(1, total // max(num_rollouts, 1))
        torch.set_num_threads(1)
        self.device = torch.device(_get(cfg, "rollout.worker.device", "cpu"))
        obs_dim, act_dim, discrete = _task_dims(self.task)
        hidden = int(_get(cfg, "actor.model.hidden_dim", 64))
        # The actor is built as the trainer builds its own (same seed, first), so version 0 is the same weights
        # on every worker: the bucket syncer sends nothing at start and the run verifies exactly that.
        torch.manual_seed(int(_get(cfg, "actor.seed", 1)))
        self.actor = Actor(obs_dim, act_dim, hidden, discrete).to(self.device)
        # Each rollout samples actions and resets its envs from its own stream.
        seed = int(_get(cfg, "actor.seed", 1)) * 1000 + rank * 100
        torch.manual_seed(seed)
        self.envs = gym.make_vec(
            self.task, num_envs=self.num_envs, vectorization_mode="sync",
            vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP},
        )
        space = self.envs.single_action_space
        self.act_shape = () if discrete else space.shape
        self.act_dtype = np.int64 if discrete else np.float32
        # Gaussian samples are clipped to the box when stepping (the trajectory keeps the sample).
        self.clip = (lambda a: a) if discrete else (lambda a: np.clip(a, space.low, space.high))
        self.obs, _ = self.envs.reset(seed=seed)
        self.ep_ret = np.zeros(self.num_envs)
        self.eval_task = _get(cfg, "env.eval.task", self.task)
        self.eval_seed = int(_get(cfg, "env.eval.seed", 1000)) + rank * 100
        self.eval_envs = int(_get(cfg, "env.eval.total_num_envs", 8)) // max(num_rollouts, 1) or 1

    def model(self) -> nn.Module:
        """The module rlsync installs the trainer's weights into (in place)."""
        return self.actor

    @torch.no_grad()
    def rollout(self, steps: int) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        """Act ``steps`` steps in every env; return the trajectories and episode statistics."""
        T, N, O = steps, self.num_envs, self.obs.shape[-1]
        out = {
            "obs": np.zeros((T, N, O), np.float32),
            "actions": np.zeros((T, N, *self.act_shape), self.act_dtype),
            "logp": np.zeros((T, N), np.float32),
            "rewards": np.zeros((T, N), np.float32),
            "terminated": np.zeros((T, N), bool),
            "truncated": np.zeros((T, N), bool),
            "final_obs": np.zeros((T, N, O), np.float32),
        }
        returns: list[float] = []
        for t in range(T):
            obs_t = torch.as_tensor(self.obs, dtype=torch.float32, device=self.device)
            dist = self.actor.dist(obs_t)
            action = dist.sample()
            act_np = action.cpu().numpy()
            out["obs"][t] = self.obs
            out["actions"][t] = act_np
            out["logp"][t] = self.actor.log_prob(dist, action).cpu().numpy()
            self.obs, reward, term, trunc, info = self.envs.step(self.clip(act_np))
            out["rewards"][t], out["terminated"][t], out["truncated"][t] = reward, term, trunc
            self.ep_ret += reward
            for i in np.flatnonzero(np.logical_or(term, trunc)):
                out["final_obs"][t, i] = info["final_obs"][i]
                returns.append(float(self.ep_ret[i]))
                self.ep_ret[i] = 0.0
        out["last_obs"] = self.obs.astype(np.float32)
        stats = {"episodes": float(len(returns))}
        if returns:
            stats["return"] = float(np.mean(returns))
        return out, stats

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Exactly one deterministic episode (the policy's mean action) per eval env."""
        envs = gym.make_vec(self.eval_task, num_envs=self.eval_envs, vectorization_mode="sync")
        try:
            obs, _ = envs.reset(seed=self.eval_seed)
            done = np.zeros(self.eval_envs, bool)
            total = np.zeros(self.eval_envs)
            length = np.zeros(self.eval_envs)
            while not done.all():
                obs_t = torch.as_tensor(obs, dtype=torch.float32, device=self.device)
                action = self.actor.act_deterministic(obs_t).cpu().numpy()
                obs, reward, term, trunc, _ = envs.step(self.clip(action))
                total += np.where(done, 0.0, reward)
                length += ~done
                done |= np.logical_or(term, trunc)
            return {"return": float(total.mean()), "episodes": self.eval_envs, "episode_len": float(length.mean())}
        finally:
            envs.close()


def _standalone(steps: int, task: str, rollouts: int, chunk: int, device: str = "cpu") -> None:
    """Trainer and rollouts in one process, weights copied by load_state_dict (a check without rlsync)."""
    cfg = {
        "env": {"train": {"task": task, "total_num_envs": 16}, "eval": {"task": task}},
        "actor": {"worker": {"device": device}},
        "rollout": {"worker": {"device": device}},
    }
    trainer = Trainer(cfg)
    workers = [Rollout(cfg, r, rollouts) for r in range(rollouts)]
    done_steps, start, it = 0, time.time(), 0
    while done_steps < steps:
        for w in workers:
            w.actor.load_state_dict(trainer.actor.state_dict())
        results = [w.rollout(chunk) for w in workers]
        stats = trainer.train([r[0] for r in results])
        done_steps += chunk * sum(w.num_envs for w in workers)
        rets = [r[1]["return"] for r in results if "return" in r[1]]
        it += 1
        if it % 10 == 0:
            ev = workers[0].evaluate()
            print(
                f"env_steps={done_steps} t={time.time() - start:.0f}s return={np.mean(rets) if rets else float('nan'):.2f} "
                f"eval={ev['return']:.2f} kl={stats['approx_kl']:.4f} behav_kl={stats['behav_approx_kl']:.2e}",
                flush=True,
            )


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300_000)
    p.add_argument("--task", default="Reacher-v5")
    p.add_argument("--rollouts", type=int, default=2)
    p.add_argument("--chunk", type=int, default=128)
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (trainer and rollouts)")
    a = p.parse_args()
    _standalone(a.steps, a.task, a.rollouts, a.chunk, a.device)
