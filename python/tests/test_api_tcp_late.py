"""Late joiners on rlsync's elastic TCP channel (issue 25 item 1): rollout processes on 127.0.0.1, one joining at
version 5, one killed with SIGKILL and restarted with the same rank; each is caught up at the sender's next
``sync`` (patch replay or a full transfer) and every receiver's checksum equals the sender's after each version."""

from __future__ import annotations

import asyncio
import gc
import multiprocessing as mp
import os
import queue
import signal
import socket
from typing import Any

import pytest
import torch

import rlsync
from python_runs import free_port
from test_api_tcp import TOKEN
from test_api_timeouts import make, state


def rollout(kind: str, addr: str, rank: int, seed: int, last: int, out: "mp.Queue") -> None:
    """Join as ``rank`` holding weights of ``seed``, report the catch-up, then every version up to ``last``."""

    async def main() -> None:
        sd = state(seed)
        w = sd["w"]
        r = make(kind)
        end = await rlsync.tcp_receiver(addr, rank, token=TOKEN, timeout=60)
        out.put(("joined", rank))
        await r.init_receiver(sd, end, timeout=60)
        out.put(("init", rank, r.version, r.checksum(sd)))
        v = r.version
        while v < last:
            v = await r.apply(sd, end, timeout=60)
            out.put(("applied", rank, v, r.checksum(sd), sd["w"] is w))

    try:
        asyncio.run(main())
    except BaseException as e:  # report instead of hanging the parent
        out.put(("error", rank, repr(e)))


class Inbox:
    """The rollouts' reports, taken per rank in order. Each rollout process reports on a queue of its own: a
    process killed while its queue's feeder thread held the queue's lock (right after a put) would leave the lock
    taken, and on a shared queue every other process's reports would then never arrive."""

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx
        self.queues: dict[int, "mp.Queue"] = {}
        self.held: list[tuple] = []

    def queue(self, rank: int) -> "mp.Queue":
        """The queue of a new process of ``rank`` (its predecessor's is read no more)."""
        q = self.ctx.Queue()
        self.queues[rank] = q
        return q

    async def pull(self, rank: int) -> None:
        """Wait for ``rank``'s next report and hold it."""
        try:
            self.held.append(await asyncio.to_thread(self.queues[rank].get, timeout=60))
        except queue.Empty:
            raise AssertionError(f"no report from rank {rank} within 60 s") from None

    async def arrived(self, rank: int) -> None:
        """Wait until a report of ``rank`` is held."""
        while not any(m[1] == rank for m in self.held):
            await self.pull(rank)

    async def next(self, rank: int) -> tuple:
        await self.arrived(rank)
        i = next(i for i, m in enumerate(self.held) if m[1] == rank)
        msg = self.held.pop(i)
        assert msg[0] != "error", msg
        return msg


class Trainer:
    """The sender's side: a version per step, the checksum it sent kept per version."""

    def __init__(self, kind: str, inbox: Inbox) -> None:
        self.kind, self.s, self.sd, self.inbox = kind, make(kind), state(1), inbox
        self.sent: dict[int, int] = {}

    async def start(self, end: rlsync.TcpSender) -> None:
        await self.s.init_sender(self.sd, ["w", "b"], end, timeout=60)
        self.sent[0] = self.s.checksum(self.sd)
        self.end = end

    async def step(self, v: int) -> None:
        with torch.no_grad():
            self.sd["w"][v % 64] += 1.0
            self.sd["b"] += 0.5
        await self.s.sync(self.sd, self.end, v, wait="applied", timeout=60)
        self.sent[v] = self.s.checksum(self.sd)

    async def expect_applied(self, rank: int, v: int | None) -> int:
        """The next version ``rank`` applied (``v``, or any one sent when ``None``), checked against the sender's."""
        kind, r, got, checksum, identity = await self.inbox.next(rank)
        assert (kind, r) == ("applied", rank)
        assert got == v if v is not None else got in self.sent, (got, v)
        assert checksum == self.sent[got], f"rank {rank} at version {got}"
        assert identity, "installed in place"
        return got

    async def expect_init(self, rank: int) -> None:
        """A first receiver's init: version 0, the sender's weights where the syncer sends them at init."""
        kind, r, version, checksum = await self.inbox.next(rank)
        assert (kind, r, version) == ("init", rank, 0)
        if self.kind == "patch":  # init_sync_enabled; the bucket syncer leaves initial weights alone
            assert checksum == self.sent[0]

    async def expect_caught_up(self, rank: int, upto: int) -> None:
        """A (re)joined rank: its catch-up (to a version it matches, or deferred to the next sync), then every
        version after it up to ``upto``."""
        assert await self.inbox.next(rank) == ("joined", rank)
        kind, r, version, checksum = await self.inbox.next(rank)
        assert (kind, r) == ("init", rank)
        if version > 0:
            assert checksum == self.sent[version], f"rank {rank} caught up to version {version}"
        # Deferred (version 0: nothing it could be caught up to matched), the next version reaches it whole.
        v = await self.expect_applied(rank, version + 1 if version > 0 else None)
        while v < upto:
            v = await self.expect_applied(rank, v + 1)


async def refused(addr: str, seconds: float = 10.0) -> None:
    """Wait until nothing listens at ``addr`` any more."""
    host, port = addr.rsplit(":", 1)
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    while True:
        with socket.socket() as s:
            if s.connect_ex((host, int(port))) != 0:
                return
        assert loop.time() < end, f"{addr} still accepts connections"
        await asyncio.sleep(0.05)


def spawn(ctx, inbox: Inbox, kind: str, addr: str, rank: int, seed: int, last: int) -> mp.Process:
    p = ctx.Process(target=rollout, args=(kind, addr, rank, seed, last, inbox.queue(rank)))
    p.start()
    return p


@pytest.mark.parametrize("kind", ["patch", "bucket"])
def test_a_receiver_joining_at_version_5_over_tcp_is_caught_up(kind: str) -> None:
    ctx = mp.get_context("spawn")
    inbox = Inbox(ctx)
    addr = f"127.0.0.1:{free_port()}"
    procs = [spawn(ctx, inbox, kind, addr, 0, 50, 8)]

    async def main() -> None:
        t = Trainer(kind, inbox)
        await t.start(await rlsync.tcp_sender(addr, 2, token=TOKEN, timeout=60, elastic=True, wait_for=1))
        assert await inbox.next(0) == ("joined", 0)
        await t.expect_init(0)
        for v in range(1, 6):
            await t.step(v)
            await t.expect_applied(0, v)
        assert t.s.acked_versions() == {0: 5}
        # Rank 1 shows up now, holding other weights.
        procs.append(spawn(ctx, inbox, kind, addr, 1, 77, 8))
        await inbox.arrived(1)  # its "joined": the sender welcomed it
        await asyncio.sleep(0.3)  # its join reaches the sender's channel
        for v in range(6, 9):
            await t.step(v)
            await t.expect_applied(0, v)
        await t.expect_caught_up(1, 8)
        await t.s.flush(timeout=30)
        # Released, the channel leaves nothing open: its listening socket is closed.
        del t
        gc.collect()
        await refused(addr)

    try:
        asyncio.run(main())
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


@pytest.mark.parametrize("kind", ["patch", "bucket"])
def test_a_receiver_killed_and_restarted_over_tcp_takes_its_rank_back(kind: str) -> None:
    ctx = mp.get_context("spawn")
    inbox = Inbox(ctx)
    addr = f"127.0.0.1:{free_port()}"
    procs = [spawn(ctx, inbox, kind, addr, r, 50 + r, 6) for r in range(2)]

    async def main() -> None:
        t = Trainer(kind, inbox)
        await t.start(await rlsync.tcp_sender(addr, 2, token=TOKEN, timeout=60, elastic=True))
        for r in range(2):
            assert await inbox.next(r) == ("joined", r)
            await t.expect_init(r)
        for v in (1, 2):
            await t.step(v)
            for r in range(2):
                await t.expect_applied(r, v)
        # Rank 1 dies: it is dropped, and syncs go on to rank 0 without waiting for it.
        os.kill(procs[1].pid, signal.SIGKILL)
        procs[1].join(timeout=10)
        loop = asyncio.get_running_loop()
        end = loop.time() + 10
        while t.s.acked_versions() != {0: 2}:
            assert loop.time() < end, f"rank 1 not dropped: {t.s.acked_versions()}"
            await asyncio.sleep(0.02)
        await t.step(3)
        await t.expect_applied(0, 3)
        # It restarts with its own initial weights and the same rank.
        procs.append(spawn(ctx, inbox, kind, addr, 1, 51, 6))
        await inbox.arrived(1)
        await asyncio.sleep(0.3)
        for v in (4, 5):
            await t.step(v)
            await t.expect_applied(0, v)
        assert t.s.acked_versions() == {0: 5, 1: 5}, "rank 1 is back and acknowledges"
        await t.step(6)
        await t.expect_applied(0, 6)
        await t.expect_caught_up(1, 6)
        await t.s.flush(timeout=30)

    try:
        asyncio.run(main())
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
