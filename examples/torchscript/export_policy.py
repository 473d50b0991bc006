"""Define a small actor-critic policy in PyTorch and export it as TorchScript for rlsync.

rlsync's signature for scripted policies (see `src/rl.rs`):

    forward(obs: Tensor[B, obs_dim] float32) -> Tuple[head, log_std, value]
        head:    [B, A]  action means (continuous tasks) or logits (discrete tasks)
        log_std: [A] or [B, A]  (ignored for discrete tasks)
        value:   [B] or [B, 1]

Every parameter with requires_grad is trained by the rlsync trainer (TrainableCModule); rollouts run the same
file with CModule. Parameter names become weight names with '.' replaced by '_'.

Usage (reach with 2 links has obs_dim 10 and 2 actions; cartpole has obs_dim 4 and 2 actions):

    python examples/torchscript/export_policy.py --obs-dim 10 --actions 2 --out /tmp/reach_policy.pt
    rlsync train_embodied model@actor.model=torchscript actor.model.torchscript_path=/tmp/reach_policy.pt
"""

import argparse
from typing import Tuple

import torch
from torch import Tensor, nn


class ActorCritic(nn.Module):
    def __init__(self, obs_dim: int, actions: int, hidden: int):
        super().__init__()
        self.pi = nn.Sequential(nn.Linear(obs_dim, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh())
        self.mu = nn.Linear(hidden, actions)
        self.log_std = nn.Parameter(torch.full((actions,), -0.5))
        self.vf = nn.Sequential(nn.Linear(obs_dim, hidden), nn.Tanh(), nn.Linear(hidden, 1))
        with torch.no_grad():
            self.mu.weight.mul_(0.01)
            self.mu.bias.zero_()

    def forward(self, obs: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        return self.mu(self.pi(obs)), self.log_std, self.vf(obs).squeeze(-1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--obs-dim", type=int, default=10)
    ap.add_argument("--actions", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    module = torch.jit.script(ActorCritic(args.obs_dim, args.actions, args.hidden))
    head, log_std, value = module(torch.zeros(3, args.obs_dim))
    assert head.shape == (3, args.actions) and value.shape == (3,), (head.shape, value.shape)
    module.save(args.out)
    print(f"saved {args.out}: {sum(p.numel() for p in module.parameters())} parameters")


if __name__ == "__main__":
    main()
