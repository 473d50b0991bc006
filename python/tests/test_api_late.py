"""Late joiners on an elastic shm channel (issue 25 item 4): a receiver that connects after ``init_sender`` (or
restarts with the same rank) is caught up at the sender's next ``sync`` (replay or full transfer) and then
follows the others."""

from __future__ import annotations

import asyncio
import gc
import os
import tempfile

import pytest
import torch

import rlsync
from test_api_timeouts import make, state


async def until(cond, what: str, seconds: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    while not cond():
        if loop.time() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("kind", ["patch", "bucket"])
def test_a_receiver_joining_at_version_5_is_caught_up_at_the_next_sync(kind: str) -> None:
    async def main() -> None:
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "s.sock")
            tx_sd = state(1)
            tx_end, rx0_end = await asyncio.gather(
                rlsync.shm_sender(path, 2, timeout=30, elastic=True, wait_for=1),
                rlsync.shm_receiver(path, 0, timeout=30),
            )
            s, r0, sd0 = make(kind), make(kind), state(10)
            await asyncio.gather(s.init_sender(tx_sd, ["w", "b"], tx_end), r0.init_receiver(sd0, rx0_end))
            for v in range(1, 6):
                with torch.no_grad():
                    tx_sd["w"][v] += 1.0
                applied = asyncio.create_task(r0.apply(sd0, rx0_end, timeout=10))
                await s.sync(tx_sd, tx_end, v, wait="applied", timeout=10)
                assert await applied == v
            assert s.acked_versions() == {0: 5}
            # Rank 1 shows up now, holding other weights.
            sd1, r1 = state(77), make(kind)
            w1 = sd1["w"]
            rx1_end = await rlsync.shm_receiver(path, 1, timeout=30)
            joining = asyncio.create_task(r1.init_receiver(sd1, rx1_end, timeout=20))
            await asyncio.sleep(0.3)  # its join reaches the sender
            with torch.no_grad():
                tx_sd["b"] += 1.0
            applied0 = asyncio.create_task(r0.apply(sd0, rx0_end, timeout=10))
            await s.sync(tx_sd, tx_end, 6, timeout=20)
            await joining
            # Caught up to version 5 (patch: replay or full), or deferred to 6 (bucket keeps no copy of 5).
            assert r1.version in (5, 0)
            assert await r1.apply(sd1, rx1_end, timeout=10) == 6
            assert await applied0 == 6
            assert sd1["w"] is w1
            assert r1.checksum(sd1) == r0.checksum(sd0) == s.checksum(tx_sd)
            await until(lambda: s.acked_versions() == {0: 6, 1: 6}, "both acks")
            await s.flush(timeout=10)

    asyncio.run(main())


@pytest.mark.parametrize("kind", ["patch", "bucket"])
def test_a_restarted_receiver_takes_its_rank_back(kind: str) -> None:
    async def main() -> None:
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "s.sock")
            tx_sd = state(1)
            tx_end, *ends = await asyncio.gather(
                rlsync.shm_sender(path, 2, timeout=30, elastic=True),
                rlsync.shm_receiver(path, 0, timeout=30),
                rlsync.shm_receiver(path, 1, timeout=30),
            )
            s = make(kind)
            rs = [make(kind), make(kind)]
            sds = [state(10), state(11)]
            await asyncio.gather(
                s.init_sender(tx_sd, ["w", "b"], tx_end), *(r.init_receiver(sd, e) for r, sd, e in zip(rs, sds, ends))
            )

            async def sync_all(v: int) -> None:
                applied = [asyncio.create_task(r.apply(sd, e, timeout=10)) for r, sd, e in zip(rs, sds, ends)]
                await s.sync(tx_sd, tx_end, v, wait="applied", timeout=10)
                assert await asyncio.gather(*applied) == [v] * len(rs)

            for v in (1, 2):
                with torch.no_grad():
                    tx_sd["w"][v] += 1.0
                await sync_all(v)
            # Rank 1 dies: its channel end goes with it; syncs go on to rank 0, which is no longer waited for.
            del rs[1], ends[1], sds[1]
            gc.collect()
            await until(lambda: s.acked_versions() == {0: 2}, "rank 1 dropped")
            with torch.no_grad():
                tx_sd["w"][3] += 1.0
            await sync_all(3)
            # It restarts with its own initial weights and the same rank.
            r1, sd1 = make(kind), state(11)
            e1 = await rlsync.shm_receiver(path, 1, timeout=30)
            joining = asyncio.create_task(r1.init_receiver(sd1, e1, timeout=20))
            await asyncio.sleep(0.3)
            with torch.no_grad():
                tx_sd["w"][4] += 1.0
            applied0 = asyncio.create_task(rs[0].apply(sds[0], ends[0], timeout=10))
            await s.sync(tx_sd, tx_end, 4, timeout=20)
            await joining
            assert await r1.apply(sd1, e1, timeout=10) == 4
            assert await applied0 == 4
            assert r1.checksum(sd1) == rs[0].checksum(sds[0]) == s.checksum(tx_sd)
            await s.flush(timeout=10)

    asyncio.run(main())
