"""rlsync's TCP channel from Python (issue 25 item 5): ``tcp_sender`` / ``tcp_receiver`` on 127.0.0.1, one trainer
and two rollout processes, authenticated by the run token, with the shm channel's semantics (acks, timeouts,
a dead receiver named at once)."""

from __future__ import annotations

import asyncio
import multiprocessing as mp

import pytest
import torch

import rlsync
from python_runs import free_port
from test_api_timeouts import make, state

TOKEN = "run-secret"


def rollout(kind: str, addr: str, rank: int, versions: int, out: "mp.Queue", token: str = TOKEN) -> None:
    async def main() -> None:
        sd = state(50 + rank)
        w = sd["w"]
        r = make(kind)
        end = await rlsync.tcp_receiver(addr, rank, token=token, timeout=30)
        await r.init_receiver(sd, end)
        got = []
        for _ in range(versions):
            v = await r.apply(sd, end, timeout=30)
            got.append((v, r.checksum(sd)))
        out.put((rank, got, sd["w"] is w))

    try:
        asyncio.run(main())
    except BaseException as e:  # report instead of hanging the parent
        out.put((rank, repr(e), False))


@pytest.mark.parametrize("kind", ["patch", "bucket"])
def test_tcp_channel_one_trainer_two_rollout_processes(kind: str) -> None:
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    addr = f"127.0.0.1:{free_port()}"
    versions = 3
    procs = [ctx.Process(target=rollout, args=(kind, addr, r, versions, out)) for r in range(2)]
    for p in procs:
        p.start()

    async def trainer() -> list[tuple[int, int]]:
        sd = state(1)
        end = await rlsync.tcp_sender(addr, 2, token=TOKEN, timeout=60)
        assert end.receivers == 2 and end.address == addr
        s = make(kind)
        await s.init_sender(sd, ["w", "b"], end, timeout=30)
        sent = []
        for v in range(1, versions + 1):
            with torch.no_grad():
                sd["w"][v] += 1.0
            await s.sync(sd, end, v, wait="applied", timeout=30)
            if v < versions:  # after the last version the rollouts exit: gone receivers are left out
                assert s.acked_versions() == {0: v, 1: v}
            sent.append((v, s.checksum(sd)))
        await s.flush(timeout=30)
        return sent

    try:
        sent = asyncio.run(trainer())
        got = sorted(out.get(timeout=60) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert [g[0] for g in got] == [0, 1]
    for _rank, sums, identity in got:
        assert sums == sent
        assert identity


def test_tcp_wrong_token_is_refused_and_timeouts_name_what_was_awaited() -> None:
    async def main() -> None:
        addr = f"127.0.0.1:{free_port()}"
        sender = asyncio.create_task(rlsync.tcp_sender(addr, 1, token=TOKEN, timeout=20))
        with pytest.raises(rlsync.TransportError):
            await rlsync.tcp_receiver(addr, 0, token="not-the-secret", timeout=5)
        rx_end = await rlsync.tcp_receiver(addr, 0, token=TOKEN, timeout=20)
        tx_end = await sender
        s, r = make("patch"), make("patch")
        tx_sd, rx_sd = state(1), state(2)
        await asyncio.gather(s.init_sender(tx_sd, ["w", "b"], tx_end), r.init_receiver(rx_sd, rx_end))
        with pytest.raises(rlsync.Timeout) as info:
            await r.apply(rx_sd, rx_end, timeout=0.2)
        assert info.value.awaited == "payload of version after 0 from the sender"
        with pytest.raises(rlsync.Timeout) as info:
            await s.sync(tx_sd, tx_end, 1, wait="applied", timeout=0.3)
        assert (info.value.rank, info.value.version) == (0, 1)
        assert await r.apply(rx_sd, rx_end, timeout=10) == 1
        assert r.checksum(rx_sd) == s.checksum(tx_sd)
        await s.flush(timeout=10)
        with pytest.raises(ValueError):
            await rlsync.tcp_sender(addr, 1, token="", timeout=1)

    asyncio.run(main())


def idle_rollout(addr: str, out: "mp.Queue") -> None:
    async def main() -> None:
        end = await rlsync.tcp_receiver(addr, 0, token=TOKEN, timeout=30)
        r = make("patch")
        await r.init_receiver(state(3), end)
        out.put("ready")
        await asyncio.sleep(60)

    asyncio.run(main())


def test_tcp_killed_receiver_is_named_at_once() -> None:
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    addr = f"127.0.0.1:{free_port()}"
    proc = ctx.Process(target=idle_rollout, args=(addr, out))
    proc.start()
    try:

        async def trainer() -> None:
            sd = state(1)
            end = await rlsync.tcp_sender(addr, 1, token=TOKEN, timeout=60)
            s = make("patch")
            await s.init_sender(sd, ["w", "b"], end)
            assert out.get(timeout=30) == "ready"
            proc.kill()
            proc.join(timeout=10)
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            with pytest.raises(rlsync.TransportError) as info:
                for v in (1, 2):  # the first sync may still reach the socket buffer
                    await s.sync(sd, end, v, wait="applied", timeout=20)
            assert loop.time() - t0 < 5
            assert not isinstance(info.value, rlsync.Timeout)
            assert "receiver rank 0" in str(info.value)

        asyncio.run(trainer())
    finally:
        if proc.is_alive():
            proc.kill()
