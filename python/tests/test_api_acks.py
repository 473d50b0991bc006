"""Acknowledgements on rlsync's channel (issue 25 item 2): receivers report each installed version, the sender's
``acked_versions()`` shows them, ``sync(..., wait="applied")`` returns once every live receiver installed it
(bounded, naming the missing ranks); over the caller's own send/recv, a clear error."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import tempfile

import pytest
import torch

import rlsync
from test_api_timeouts import make, shm_pair, state


@pytest.mark.parametrize("kind", ["patch", "bucket"])
def test_wait_applied_returns_once_every_receiver_installed(kind: str) -> None:
    async def main() -> None:
        with tempfile.TemporaryDirectory() as d:
            s, tx_sd, tx_end, rs, rx_sds, rx_ends = await shm_pair(kind, os.path.join(d, "s.sock"), receivers=2)
            assert s.acked_versions() == {}
            for v in (3, 4, 9):
                with torch.no_grad():
                    tx_sd["w"][v] += 1.0
                applied = [asyncio.create_task(r.apply(sd, end, timeout=10)) for r, sd, end in zip(rs, rx_sds, rx_ends)]
                await s.sync(tx_sd, tx_end, v, wait="applied", timeout=10)
                assert s.acked_versions() == {0: v, 1: v}
                assert await asyncio.gather(*applied) == [v, v]
            assert all(r.checksum(sd) == s.checksum(tx_sd) for r, sd in zip(rs, rx_sds))
            await s.flush(timeout=10)

    asyncio.run(main())


def test_wait_applied_times_out_naming_the_missing_rank() -> None:
    async def main() -> None:
        with tempfile.TemporaryDirectory() as d:
            s, tx_sd, tx_end, rs, rx_sds, rx_ends = await shm_pair("patch", os.path.join(d, "s.sock"), receivers=2)
            only = asyncio.create_task(rs[0].apply(rx_sds[0], rx_ends[0], timeout=10))
            with pytest.raises(rlsync.Timeout) as info:
                await s.sync(tx_sd, tx_end, 1, wait="applied", timeout=0.5)
            assert await only == 1
            e = info.value
            assert (e.rank, e.ranks, e.version) == (1, [1], 1)
            assert e.awaited == "ack of version 1 from receiver rank 1"
            assert s.acked_versions() == {0: 1}
            assert await rs[1].apply(rx_sds[1], rx_ends[1], timeout=10) == 1
            await s.flush(timeout=10)
            await asyncio.sleep(0.05)
            assert s.acked_versions() == {0: 1, 1: 1}

    asyncio.run(main())


def test_acks_need_an_rlsync_channel(link) -> None:
    async def main() -> None:
        ln = link()
        tx_sd, rx_sd = state(1), state(2)
        s, r = make("patch"), make("patch")
        await asyncio.gather(
            s.init_sender(tx_sd, ["w", "b"], ln.send, ln.up_recv), r.init_receiver(rx_sd, ln.recv, ln.up_send)
        )
        with pytest.raises(rlsync.RlsyncError, match="rlsync channel"):
            s.acked_versions()
        with pytest.raises(rlsync.RlsyncError, match="rlsync channel"):
            await s.sync(tx_sd, ln.send, 1, wait="applied")
        with pytest.raises(ValueError):
            await s.sync(tx_sd, ln.send, 1, wait="released")
        # Refused before anything was sent: the next sync is version 1's first payload.
        await s.sync(tx_sd, ln.send, 1)
        assert await r.apply(rx_sd, ln.recv, timeout=5) == 1

    asyncio.run(main())


def killed_rollout(path: str, rank: int, out: "mp.Queue") -> None:
    async def main() -> None:
        sd = state(20 + rank)
        end = await rlsync.shm_receiver(path, rank, timeout=30)
        r = make("patch")
        await r.init_receiver(sd, end)
        out.put(("ready", rank))
        await asyncio.sleep(60)  # killed by the test before it applies anything

    asyncio.run(main())


def test_a_killed_receiver_is_named_at_once() -> None:
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "s.sock")
        proc = ctx.Process(target=killed_rollout, args=(path, 0, out))
        proc.start()
        try:

            async def trainer() -> None:
                tx_sd = state(1)
                end = await rlsync.shm_sender(path, 1, timeout=30)
                s = make("patch")
                await s.init_sender(tx_sd, ["w", "b"], end)
                assert out.get(timeout=30) == ("ready", 0)
                proc.kill()
                proc.join(timeout=10)
                loop = asyncio.get_running_loop()
                t0 = loop.time()
                with pytest.raises(rlsync.TransportError) as info:
                    await s.sync(tx_sd, end, 1, wait="applied", timeout=20)
                assert loop.time() - t0 < 5  # named at once, not after the bound
                assert not isinstance(info.value, rlsync.Timeout)
                assert "receiver rank 0" in str(info.value)

            asyncio.run(trainer())
        finally:
            if proc.is_alive():
                proc.kill()
