"""Issue 23 item 3: key sets and order. Tensors are matched by name, in any order, at every call; a missing or
extra key is an error naming it. Bucket: sender keys outside param_names_need_sync are not sent and receiver
keys that are not sent stay as they are (RLinf's strict=False); patch keeps RLinf's same-keys check."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

import rlsync
from conftest import Link

KINDS = ["patch", "bucket"]


def state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a.weight": torch.randn(8, 16, generator=g).to(torch.bfloat16),
        "a.bias": torch.randn(16, generator=g),
        "b.weight": torch.randn(4, 4, generator=g),
        "steps": torch.tensor(0, dtype=torch.int64),
    }


def make(kind: str) -> rlsync.WeightSyncer:
    if kind == "patch":
        return rlsync.PatchWeightSyncer(init_sync_enabled=True)
    return rlsync.BucketWeightSyncer(bucket_size=256)


async def pair(
    kind: str, tx_sd: Any, rx_sd: Any, names: list[str] | None = None
) -> tuple[rlsync.WeightSyncer, rlsync.WeightSyncer, Link]:
    tx, rx, link = make(kind), make(kind), Link()
    await asyncio.gather(
        tx.init_sender(tx_sd, list(tx_sd) if names is None else names, link.send, link.up_recv),
        rx.init_receiver(rx_sd, link.recv, link.up_send),
    )
    return tx, rx, link


def bump(sd: dict[str, torch.Tensor], step: int) -> None:
    with torch.no_grad():
        for t in sd.values():
            if t.dtype == torch.int64:
                t += 1
            else:
                t.view(-1)[step % t.numel()] += 1.5


def reordered(sd: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    keys = list(sd)
    order = torch.randperm(len(keys), generator=torch.Generator().manual_seed(seed)).tolist()
    return {keys[i]: sd[keys[i]] for i in order}


@pytest.mark.parametrize("kind", KINDS)
def test_both_ends_match_tensors_by_name_in_any_order_at_every_call(kind: str) -> None:
    tx_sd, rx_sd = state(1), state(2)

    async def main() -> None:
        tx, rx, link = await pair(kind, tx_sd, rx_sd)
        for v in range(4):
            bump(tx_sd, v)
            await tx.sync(reordered(tx_sd, v), link.send, v)
            assert await rx.apply(reordered(rx_sd, 100 + v), link.recv) == v
            for k in tx_sd:
                assert torch.equal(rx_sd[k], tx_sd[k]), k
            assert rx.checksum(reordered(rx_sd, 7)) == tx.checksum(reordered(tx_sd, 8))

    asyncio.run(main())


@pytest.mark.parametrize("kind", KINDS)
def test_a_missing_or_extra_key_is_an_error_naming_it(kind: str) -> None:
    tx_sd, rx_sd = state(3), state(3)

    async def main() -> None:
        tx, rx, link = await pair(kind, tx_sd, rx_sd)
        missing = {k: v for k, v in tx_sd.items() if k != "a.bias"}
        with pytest.raises(ValueError, match="key 'a.bias' is missing"):
            await tx.sync(missing, link.send, 1)
        with pytest.raises(ValueError, match="key 'extra' was not there at init"):
            await tx.sync({**tx_sd, "extra": torch.zeros(2)}, link.send, 1)
        with pytest.raises(ValueError, match="key 'b.weight' is missing"):
            await rx.apply({k: v for k, v in rx_sd.items() if k != "b.weight"}, link.recv)
        with pytest.raises(ValueError, match="key 'z' was not there at init"):
            await rx.apply({**rx_sd, "z": torch.zeros(1)}, link.recv)
        # Nothing was sent or changed: the next sync goes through.
        assert link.to_rx.empty()
        bump(tx_sd, 1)
        await tx.sync(tx_sd, link.send, 1)
        assert await rx.apply(rx_sd, link.recv) == 1
        assert all(torch.equal(rx_sd[k], tx_sd[k]) for k in tx_sd)

    asyncio.run(main())


def test_bucket_sends_only_the_synced_keys_and_leaves_the_receivers_others_alone() -> None:
    tx_sd = state(4)
    tx_sd["actor_only"] = torch.ones(3)  # a sender key outside param_names_need_sync and absent at the receiver
    rx_sd = {k: v.clone() for k, v in state(5).items()}
    rx_sd["rollout_only"] = torch.full((2,), 7.0)  # a receiver key the sender never sends (strict=False)
    names = ["a.weight", "steps"]
    not_sent = {k: rx_sd[k].clone() for k in ("a.bias", "b.weight", "rollout_only")}

    async def main() -> None:
        tx, rx, link = await pair("bucket", tx_sd, rx_sd, names)
        assert sorted(tx.synced_keys) == sorted(names)
        for v in range(3):
            bump(tx_sd, v)
            await tx.sync(tx_sd, link.send, v)
            assert await rx.apply(rx_sd, link.recv) == v
            for k in names:
                assert torch.equal(rx_sd[k], tx_sd[k]), k
            for k, before in not_sent.items():
                assert torch.equal(rx_sd[k], before), f"{k} was not sent and must stay as it was"

    asyncio.run(main())


def test_bucket_still_refuses_a_synced_key_the_receiver_lacks() -> None:
    tx_sd, rx_sd = state(6), state(6)
    del rx_sd["a.bias"]

    async def main() -> None:
        tx, rx, link = make("bucket"), make("bucket"), Link()
        results = await asyncio.gather(
            tx.init_sender(tx_sd, list(tx_sd), link.send, link.up_recv),
            rx.init_receiver(rx_sd, link.recv, link.up_send),
            return_exceptions=True,
        )
        assert isinstance(results[0], rlsync.HandshakeError), results
        assert "a.bias" in str(results[0])

    asyncio.run(main())


def test_patch_keeps_rlinfs_same_keys_check() -> None:
    tx_sd, rx_sd = state(7), state(7)
    rx_sd["rollout_only"] = torch.zeros(2)

    async def main() -> None:
        tx, rx, link = make("patch"), make("patch"), Link()
        results = await asyncio.gather(
            tx.init_sender(tx_sd, list(tx_sd), link.send, link.up_recv),
            rx.init_receiver(rx_sd, link.recv, link.up_send),
            return_exceptions=True,
        )
        assert isinstance(results[0], rlsync.HandshakeError), results
        assert "rollout_only" in str(results[0])

    asyncio.run(main())
