"""Define a small actor-critic policy in PyTorch and export it as TorchScript for rlsync.

rlsync's signature for scripted policies (see `src/rl.rs`):

    forward(obs: Tensor[B, obs_dim] float32) -> Tuple[head, log_std, value]
        head:    [B, A]  action means (continuous tasks) or logits (discrete tasks)
        log_std: [A] or [B, A]  (ignored for discrete tasks)
        value:   [B] or [B, 1]

Every parameter with requires_grad is trained by the rlsync trainer; rollouts run the same file. The weights
keep the module's parameter names (`pi.0.weight`) in syncs and checkpoints, and every checkpoint also holds
`policy.pt`: this module with the trained weights, for `torch.jit.load`.

Usage (reach with 2 links has obs_dim 10 and 2 actions; cartpole has obs_dim 4 and 2 actions):

    python examples/torchscript/export_policy.py --obs-dim 10 --actions 2 --out /tmp/reach_policy.pt
    rlsync train_embodied model@actor.model=torchscript actor.model.torchscript_path=/tmp/reach_policy.pt
"""

import argparse
from typing import List, Tuple

import torch
from torch import Tensor, nn


class ObsNorm(nn.Module):
    """Running observation statistics: rlsync's trainer updates `obs_norm.{mean,var,count}` (non-trainable
    parameters, so they travel with the weights) from every batch, as it does for `mlp_policy`."""

    def __init__(self, dim: int):
        super().__init__()
        self.mean = nn.Parameter(torch.zeros(dim), requires_grad=False)
        self.var = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.count = nn.Parameter(torch.zeros(()), requires_grad=False)

    def forward(self, obs: Tensor) -> Tensor:
        return ((obs - self.mean) / torch.sqrt(self.var + 1e-8)).clamp(-10.0, 10.0)


class ActorCritic(nn.Module):
    """The shape and initialisation of rlsync's `mlp_policy`: normalised observations, tanh towers for the actor and the critic, weights
    drawn from N(0, gain^2 / fan_in) with zero biases (gain sqrt(2) inside the towers, 0.01 for the action
    head, 1 for the value head), and a state-independent log std starting at -0.5."""

    def __init__(self, obs_dim: int, actions: int, hidden: int, layers: int):
        super().__init__()
        self.obs_norm = ObsNorm(obs_dim)

        def tower() -> nn.Sequential:
            dims = [obs_dim] + [hidden] * layers
            mods: List[nn.Module] = []
            for i in range(layers):
                mods += [linear(dims[i], dims[i + 1], 2.0**0.5), nn.Tanh()]
            return nn.Sequential(*mods)

        self.pi = tower()
        self.mu = linear(hidden, actions, 0.01)
        self.log_std = nn.Parameter(torch.full((actions,), -0.5))
        self.vf = tower()
        self.v = linear(hidden, 1, 1.0)

    def forward(self, obs: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        x = self.obs_norm(obs)
        return self.mu(self.pi(x)), self.log_std, self.v(self.vf(x)).squeeze(-1)


def linear(inp: int, out: int, gain: float) -> nn.Linear:
    layer = nn.Linear(inp, out)
    with torch.no_grad():
        layer.weight.normal_(0.0, gain / inp**0.5)
        layer.bias.zero_()
    return layer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--obs-dim", type=int, default=10)
    ap.add_argument("--actions", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    module = torch.jit.script(ActorCritic(args.obs_dim, args.actions, args.hidden, args.layers))
    head, log_std, value = module(torch.zeros(3, args.obs_dim))
    assert head.shape == (3, args.actions) and value.shape == (3,), (head.shape, value.shape)
    module.save(args.out)
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    print(f"saved {args.out}: {trainable} trainable parameters")


if __name__ == "__main__":
    main()
