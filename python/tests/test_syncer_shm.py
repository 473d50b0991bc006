"""rlsync's shared-memory channel from Python: one trainer process, two rollout processes (spawned)."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import tempfile

import pytest
import torch

import rlsync


def model_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(64, 32, generator=g).to(torch.bfloat16)
    return {"w": w, "b": torch.randn(32, generator=g), "tied": w, "steps": torch.tensor(0, dtype=torch.int64)}


def step(sd: dict[str, torch.Tensor], v: int) -> None:
    with torch.no_grad():
        sd["w"][v, : 4 * v] += 0.5
        sd["b"][v % 32] -= 1.0
        sd["steps"] += 1


def rollout(kind: str, path: str, rank: int, versions: int, out: "mp.Queue") -> None:
    async def main() -> None:
        sd = model_state(100 + rank)  # different start: the init bootstrap (patch) or the first bucket aligns it
        w = sd["w"]
        make = rlsync.PatchWeightSyncer(init_sync_enabled=True) if kind == "patch" else rlsync.BucketWeightSyncer()
        rx = await rlsync.shm_receiver(path, rank, timeout=30)
        await make.init_receiver(sd, rx)
        sums = []
        for _ in range(versions):
            v = await make.apply(sd, rx)
            sums.append((v, make.checksum(sd)))
        out.put((rank, sums, sd["w"] is w and sd["tied"] is w))

    try:
        asyncio.run(main())
    except BaseException as e:  # report instead of hanging the parent
        out.put((rank, repr(e), False))


@pytest.mark.parametrize("kind", ["patch", "bucket"])
def test_shm_channel_one_trainer_two_rollout_processes(kind: str) -> None:
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    versions = 3
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "weights.sock")
        procs = [ctx.Process(target=rollout, args=(kind, path, r, versions, out)) for r in range(2)]
        for p in procs:
            p.start()

        async def trainer() -> list[tuple[int, int]]:
            sd = model_state(7)
            tx = await rlsync.shm_sender(path, 2, timeout=30)
            s = rlsync.PatchWeightSyncer(init_sync_enabled=True) if kind == "patch" else rlsync.BucketWeightSyncer()
            await s.init_sender(sd, ["w", "b", "tied", "steps"], tx)
            sent = []
            for v in range(1, versions + 1):
                step(sd, v)
                await s.sync(sd, tx, v)
                sent.append((v, s.checksum(sd)))
            await s.flush()  # the segments go with the sender: let every rollout read the last version first
            return sent

        try:
            sent = asyncio.run(trainer())
            got = sorted(out.get(timeout=60) for _ in procs)
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
    for rank, sums, identity in got:
        assert sums == sent, f"rank {rank}: {sums}"
        assert identity, f"rank {rank}: tensors replaced instead of updated in place"
    assert all(p.exitcode == 0 for p in procs)


def test_shm_syncer_must_use_its_own_channel_end() -> None:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "w.sock")

        async def main() -> None:
            sd = {"w": torch.ones(4)}
            rsd = {"w": torch.zeros(4)}
            tx_end, rx_end = await asyncio.gather(rlsync.shm_sender(path, 1, timeout=10), rlsync.shm_receiver(path, 0, timeout=10))
            tx, rx = rlsync.BucketWeightSyncer(), rlsync.BucketWeightSyncer()
            await asyncio.gather(tx.init_sender(sd, ["w"], tx_end), rx.init_receiver(rsd, rx_end))

            async def other(_: bytes) -> None:
                pass

            with pytest.raises(ValueError, match="shm channel it was initialised with"):
                await tx.sync(sd, other, 1)
            with pytest.raises(rlsync.RlsyncError, match="already used by a syncer"):
                await rlsync.BucketWeightSyncer().init_sender(sd, ["w"], tx_end)
            _, v = await asyncio.gather(tx.sync(sd, tx_end, 1), rx.apply(rsd, rx_end))
            assert v == 1 and torch.equal(rsd["w"], sd["w"])

        asyncio.run(main())
