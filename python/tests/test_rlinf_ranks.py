"""Issue 23 item 2: ranks as RLinf places them. N actor ranks x M rollout ranks: rollout rank 0 sends its
metadata to every actor rank in turn (a P2P send that waits for the receiver), actor rank 0 broadcasts the
payloads to every rollout rank; the other actor ranks are inactive senders (is_sender=False)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

import rlsync

KINDS = ["patch", "bucket"]


class P2P:
    """A point-to-point link that blocks like a P2P send: a bounded queue of size 1 whose ``send`` returns only
    once the consumer took the message."""

    def __init__(self) -> None:
        self.q: asyncio.Queue[Any] = asyncio.Queue(maxsize=1)

    async def send(self, data: Any) -> None:
        await self.q.put(data)
        await self.q.join()

    async def recv(self) -> Any:
        data = await self.q.get()
        self.q.task_done()
        return data


def state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "policy.weight": torch.randn(16, 8, generator=g),
        "policy.bias": torch.randn(16, generator=g).to(torch.bfloat16),
        "value.weight": torch.randn(1, 16, generator=g),
        "step": torch.tensor(0, dtype=torch.int64),
    }


def make(kind: str) -> rlsync.WeightSyncer:
    if kind == "patch":
        return rlsync.PatchWeightSyncer(init_sync_enabled=True)
    return rlsync.BucketWeightSyncer(bucket_size=512)


def train_step(sd: dict[str, torch.Tensor], step: int) -> None:
    with torch.no_grad():
        sd["policy.weight"][step % 16] += 0.5
        sd["value.weight"][0, step % 16] -= 0.25
        sd["step"] += 1


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("actors", "rollouts"), [(2, 3), (1, 2), (3, 1)])
def test_n_actor_ranks_x_m_rollout_ranks_complete_with_nothing_left_undelivered(
    kind: str, actors: int, rollouts: int
) -> None:
    versions = [0, 1, 1, 2, 5]
    # Every actor rank holds the same weights (FSDP full state dict), every rollout its own initial ones.
    actor_sd = [state(1) for _ in range(actors)]
    rollout_sd = [state(100 + r) for r in range(rollouts)]

    async def main() -> None:
        up = [P2P() for _ in range(actors)]  # rollout rank 0 -> actor rank a
        down = [P2P() for _ in range(rollouts)]  # actor rank 0 -> rollout rank r (the broadcast)
        tx = [make(kind) for _ in range(actors)]
        rx = [make(kind) for _ in range(rollouts)]

        def actor_send(a: int):
            async def send(data: Any) -> None:
                if a != 0:
                    return
                for link in down:
                    await link.send(data)

            return send

        def rollout_send(r: int):
            async def send(data: Any) -> None:
                if r != 0:
                    return
                for link in up:
                    await link.send(data)

            return send

        async def actor(a: int) -> None:
            names = list(actor_sd[a])
            await tx[a].init_sender(actor_sd[a], names, actor_send(a), up[a].recv, is_sender=a == 0)
            for step, v in enumerate(versions):
                train_step(actor_sd[a], step)
                await tx[a].sync(actor_sd[a], actor_send(a), version=v)

        async def rollout(r: int) -> list[int]:
            await rx[r].init_receiver(rollout_sd[r], down[r].recv, rollout_send(r))
            return [await rx[r].apply(rollout_sd[r], down[r].recv) for _ in versions]

        results = await asyncio.wait_for(
            asyncio.gather(*(actor(a) for a in range(actors)), *(rollout(r) for r in range(rollouts))),
            timeout=60,
        )
        for applied in results[actors:]:
            assert applied == versions
        for link in up + down:
            assert link.q.empty(), "a message was left undelivered"
        for r in range(rollouts):
            for k, t in actor_sd[0].items():
                assert torch.equal(rollout_sd[r][k], t), (r, k)
            assert rx[r].checksum(rollout_sd[r]) == tx[0].checksum(actor_sd[0])
        for a in range(1, actors):
            assert tx[a].sender_initialized() and tx[a].version == 0, "an inactive sender sends nothing"

    asyncio.run(main())


@pytest.mark.parametrize("kind", KINDS)
def test_an_inactive_sender_without_recv_never_communicates(kind: str) -> None:
    sd = state(5)

    async def main() -> None:
        tx = make(kind)

        async def never(*_: Any) -> Any:
            raise AssertionError("an inactive sender sends nothing")

        await tx.init_sender(sd, list(sd), never, None, is_sender=False)
        for v in [0, 3, 3]:
            await tx.sync(sd, never, v)
        assert tx.sender_initialized() and tx.version == 0

    asyncio.run(main())
