"""Issue 23 item 1: versions as RLinf's runners use them (0 first, the same again, jumps, 0-d tensors), while a
replayed, stale or corrupt payload is still rejected by the sequence number every payload carries."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

import rlsync
from conftest import Link

KINDS = ["patch", "bucket", "bucket-staged"]


def state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(8, 16, generator=g).to(torch.bfloat16),
        "b": torch.randn(16, generator=g),
        "n": torch.tensor(0, dtype=torch.int64),
    }


def make(kind: str) -> rlsync.WeightSyncer:
    if kind == "patch":
        return rlsync.PatchWeightSyncer(init_sync_enabled=True)
    # bucket-staged: the whole version is staged and installed at the end (load_instant=False).
    return rlsync.BucketWeightSyncer(bucket_size=1 << 20, load_instant=kind == "bucket")


async def pair(kind: str, tx_sd: Any, rx_sd: Any) -> tuple[rlsync.WeightSyncer, rlsync.WeightSyncer, Link]:
    tx, rx, link = make(kind), make(kind), Link()
    await asyncio.gather(
        tx.init_sender(tx_sd, list(tx_sd), link.send, link.up_recv),
        rx.init_receiver(rx_sd, link.recv, link.up_send),
    )
    return tx, rx, link


def bump(sd: dict[str, torch.Tensor], step: int) -> None:
    with torch.no_grad():
        sd["w"][step % 8, :3] += 1
        sd["b"][step % 16] -= 1
        sd["n"] += 1


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[k].float(), b[k].float()) for k in a)


def expected(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in sd.items()}


@pytest.mark.parametrize("kind", KINDS)
def test_the_runners_version_sequence_applies_and_apply_returns_the_callers_version(kind: str) -> None:
    # The embodied runner: version 0 before the first step, one per global step, the same version again for an
    # evaluation's sync; the async runner under no-wait skips versions.
    versions = [0, 1, 1, 2, 5, 9, 9, 10]
    tx_sd, rx_sd = state(1), state(2)

    async def main() -> None:
        tx, rx, link = await pair(kind, tx_sd, rx_sd)
        for step, v in enumerate(versions):
            bump(tx_sd, step)
            await tx.sync(tx_sd, link.send, v)
            assert tx.version == v
            assert await rx.apply(rx_sd, link.recv) == v
            assert rx.version == v
            assert same(rx_sd, tx_sd)
            assert rx.checksum(rx_sd) == tx.checksum(tx_sd)

    asyncio.run(main())


@pytest.mark.parametrize("kind", KINDS)
def test_a_0d_integer_tensor_version_is_its_int(kind: str) -> None:
    tx_sd, rx_sd = state(3), state(3)

    async def main() -> None:
        tx, rx, link = await pair(kind, tx_sd, rx_sd)
        for v in [torch.tensor(0), torch.tensor(4, dtype=torch.int32), torch.tensor(4)]:
            bump(tx_sd, int(v))
            await tx.sync(tx_sd, link.send, v)
            got = await rx.apply(rx_sd, link.recv)
            assert got == int(v) and isinstance(got, int)
        with pytest.raises(ValueError, match="non-negative"):
            await tx.sync(tx_sd, link.send, -1)
        # Never truncated: floats, float tensors, bools and non-scalar tensors are refused.
        for bad in [4.7, torch.tensor(5.5), torch.tensor(True), torch.tensor([5]), True, "5"]:
            with pytest.raises(TypeError, match="int or a 0-d integer tensor"):
                await tx.sync(tx_sd, link.send, bad)
        # The refused calls sent nothing and moved nothing.
        assert link.to_rx.empty() and tx.version == 4

    asyncio.run(main())


@pytest.mark.parametrize("kind", KINDS)
def test_replayed_stale_and_corrupt_payloads_of_repeated_versions_are_rejected(kind: str) -> None:
    tx_sd, rx_sd = state(4), state(4)

    async def main() -> None:
        tx, rx, link = await pair(kind, tx_sd, rx_sd)
        bump(tx_sd, 0)
        await tx.sync(tx_sd, link.send, 1)
        first = link.taps[-1]
        assert await rx.apply(rx_sd, link.recv) == 1
        # Version 1 again (an evaluation), then version 0: both newer syncs, both apply.
        for step, v in [(1, 1), (2, 0)]:
            bump(tx_sd, step)
            await tx.sync(tx_sd, link.send, v)
            assert await rx.apply(rx_sd, link.recv) == v
        bump(tx_sd, 3)
        await tx.sync(tx_sd, link.send, 0)
        held_back = link.to_rx.get_nowait()  # the next sync, intercepted
        before = expected(rx_sd)

        async def rejected(payload: bytes, match: str) -> None:
            await link.to_rx.put(payload)
            with pytest.raises(rlsync.PayloadRejected, match=match):
                await rx.apply(rx_sd, link.recv)
            assert rx.version == 0
            assert same(rx_sd, before), "a rejected payload changes nothing"

        # The first payload again: same version as a later one, but an older sync.
        await rejected(first, "replayed or stale")
        flipped = bytearray(held_back)
        flipped[len(flipped) // 2] ^= 0x21
        await rejected(bytes(flipped), "rejected payload")
        await rejected(held_back[: len(held_back) - 5], "rejected payload")
        # The genuine one still applies, and is then itself stale.
        await link.to_rx.put(held_back)
        assert await rx.apply(rx_sd, link.recv) == 0
        assert same(rx_sd, tx_sd)
        after = expected(rx_sd)
        await link.to_rx.put(held_back)
        with pytest.raises(rlsync.PayloadRejected, match="replayed or stale"):
            await rx.apply(rx_sd, link.recv)
        assert same(rx_sd, after)

    asyncio.run(main())
