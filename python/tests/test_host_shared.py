"""Host-shared receivers from Python: one applier, readers in this and other processes, whole versions only."""

from __future__ import annotations

import asyncio
import gc
import multiprocessing as mp
import os
import signal
import time
import uuid

import pytest
import torch

import rlsync
from conftest import Link


class Policy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(64, 48))
        self.b = torch.nn.Parameter(torch.zeros(48, dtype=torch.bfloat16))
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))
        self.frozen = torch.nn.Parameter(torch.arange(8, dtype=torch.float32), requires_grad=False)


def set_version(p: Policy, v: int) -> None:
    """Version ``v``: every synced element derived from ``v`` (a reader can tell a whole version from a torn one)."""
    with torch.no_grad():
        p.w.fill_(float(v))
        p.b.fill_(-float(v))
        p.steps.fill_(v)


def whole(p: Policy) -> int:
    """The version ``p`` holds, asserting every synced element belongs to it."""
    v = int(p.steps)
    assert torch.all(p.w == float(v)), f"w is not all {v}"
    assert torch.all(p.b == -float(v)), f"b is not all {-v}"
    return v


def arena_name() -> str:
    return f"rlsync-pytest.{os.getpid()}.{uuid.uuid4().hex[:8]}"


def shm(name: str) -> str:
    return os.path.join("/dev/shm", name)


def make(kind: str) -> rlsync.WeightSyncer:
    return rlsync.PatchWeightSyncer(init_sync_enabled=True) if kind == "patch" else rlsync.BucketWeightSyncer()


async def start(
    name: str, trainer: Policy, rollout: Policy, kind: str = "patch", verify: bool = True
) -> tuple[Link, rlsync.WeightSyncer, rlsync.WeightSyncer]:
    link = Link()
    tx, rx = make(kind), make(kind)
    await asyncio.gather(
        tx.init_sender(trainer.state_dict(), rlsync.param_names_need_sync(trainer), link.send, link.up_recv),
        rx.init_receiver(rollout, link.recv, link.up_send, host_shared=name, max_readers=8, verify=verify),
    )
    return link, tx, rx


@pytest.mark.parametrize("kind", ["patch", "bucket"])
def test_the_receivers_model_views_the_arena_and_keeps_its_identity(kind: str) -> None:
    name = arena_name()
    trainer, rollout, other = Policy(), Policy(), Policy()
    set_version(trainer, 0)
    weight = rollout.w

    async def main() -> None:
        link, tx, rx = await start(name, trainer, rollout, kind)
        assert os.stat(shm(name)).st_mode & 0o777 == 0o600
        assert whole(rollout) == 0 and rx.host_shared.version == 0
        with rlsync.HostSharedReader(name, other, timeout=5) as reader:
            assert whole(other) == 0
            for v in (1, 2, 3):
                set_version(trainer, v)
                await tx.sync(trainer.state_dict(), link.send, v)
                assert await rx.apply(rollout, link.recv) == v
                assert whole(rollout) == v and rollout.w is weight
                assert tx.checksum(trainer.state_dict()) == rx.checksum(rollout)
                assert reader.refresh() == v and whole(other) == v
                assert reader.checksum == tx.checksum(trainer.state_dict())
                assert reader.refresh() is None
        assert other.w.sum() == 3 * 64 * 48, "a closed reader's model keeps a private copy"
        await rx.close()

    asyncio.run(main())
    assert not os.path.exists(shm(name)), "close removes the arena"
    assert whole(rollout) == 3


@pytest.mark.parametrize("kind", ["patch", "bucket"])
def test_without_verify_no_checksum_is_published_and_versions_still_install(kind: str) -> None:
    name = arena_name()
    trainer, rollout, other = Policy(), Policy(), Policy()

    async def main() -> None:
        link, tx, rx = await start(name, trainer, rollout, kind, verify=False)
        with rlsync.HostSharedReader(name, other, timeout=5) as reader:
            assert reader.checksum is None
            for v in (1, 2):
                set_version(trainer, v)
                await tx.sync(trainer.state_dict(), link.send, v)
                assert await rx.apply(rollout, link.recv) == v
                assert reader.refresh() == v and whole(other) == v and reader.checksum is None
                assert rx.checksum(rollout) == tx.checksum(trainer.state_dict())
        await rx.close()

    asyncio.run(main())


def test_a_corrupt_payload_leaves_the_weights_and_the_version() -> None:
    name = arena_name()
    trainer, rollout = Policy(), Policy()

    async def main() -> None:
        link, tx, rx = await start(name, trainer, rollout)
        set_version(trainer, 1)
        await tx.sync(trainer.state_dict(), link.send, 1)
        await rx.apply(rollout, link.recv)
        set_version(trainer, 2)
        await tx.sync(trainer.state_dict(), link.send, 2)
        good = await link.to_rx.get()
        bad = bytearray(good)
        bad[len(bad) // 2] ^= 0x20
        await link.to_rx.put(bytes(bad))
        with pytest.raises(rlsync.PayloadRejected):
            await rx.apply(rollout, link.recv)
        assert whole(rollout) == 1 and rx.host_shared.version == 1
        await link.to_rx.put(good)
        assert await rx.apply(rollout, link.recv) == 2 and whole(rollout) == 2
        with pytest.raises(rlsync.RlsyncError, match="host-shared receiver installs in apply"):
            await rx.stage(link.recv)
        await rx.close()

    asyncio.run(main())


def reader_process(name: str, last: int, out: "mp.Queue") -> None:
    """Check every version held until ``last``; report the versions seen."""
    try:
        p = Policy()
        seen = []
        with rlsync.HostSharedReader(name, p, timeout=30) as reader:
            while True:
                v = whole(p)
                if not seen or seen[-1] != v:
                    seen.append(v)
                if v >= last:
                    break
                if reader.refresh() is None:
                    time.sleep(0.0005)
        out.put((os.getpid(), seen))
    except BaseException as e:  # report instead of hanging the parent
        out.put((os.getpid(), repr(e)))


def holder_process(name: str, out: "mp.Queue") -> None:
    """Attach and hold the first version until killed."""
    p = Policy()
    reader = rlsync.HostSharedReader(name, p, timeout=30)
    out.put(("holding", reader.version))
    while True:
        time.sleep(1)


def test_readers_in_other_processes_see_whole_versions_and_a_killed_one_leaves_nothing() -> None:
    name = arena_name()
    last = 40
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    trainer, rollout = Policy(), Policy()

    async def main() -> None:
        link, tx, rx = await start(name, trainer, rollout)
        holder = ctx.Process(target=holder_process, args=(name, out))
        holder.start()
        assert (await asyncio.to_thread(out.get, True, 60)) == ("holding", 0)
        readers = [ctx.Process(target=reader_process, args=(name, last, out)) for _ in range(2)]
        for r in readers:
            r.start()
        try:
            # The holder keeps version 0's buffer: version 1 goes to the other one, version 2 must wait for it.
            set_version(trainer, 1)
            await tx.sync(trainer.state_dict(), link.send, 1)
            assert await rx.apply(rollout, link.recv, timeout=30) == 1
            set_version(trainer, 2)
            await tx.sync(trainer.state_dict(), link.send, 2)
            with pytest.raises(rlsync.RlsyncError, match=str(holder.pid)):
                await rx.apply(rollout, link.recv, timeout=0.3)
            assert whole(rollout) == 1, "the held buffer was not written"
            os.kill(holder.pid, signal.SIGKILL)
            holder.join(timeout=30)
            assert await rx.apply(rollout, link.recv, timeout=30) == 2, "the dead reader's slot was cleared"
            for v in range(3, last + 1):
                set_version(trainer, v)
                await tx.sync(trainer.state_dict(), link.send, v)
                assert await rx.apply(rollout, link.recv, timeout=30) == v
            got = [await asyncio.to_thread(out.get, True, 60) for _ in readers]
        finally:
            for r in [holder, *readers]:
                r.join(timeout=30)
                if r.is_alive():
                    r.kill()
        for pid, seen in got:
            assert isinstance(seen, list), f"reader {pid}: {seen}"
            assert seen == sorted(seen) and seen[-1] == last, f"reader {pid} saw {seen}"
        await rx.close()

    asyncio.run(main())
    assert not os.path.exists(shm(name))


def test_a_reader_checks_the_model_and_waits_boundedly() -> None:
    name = arena_name()
    with pytest.raises(rlsync.RlsyncError, match="did not appear"):
        rlsync.HostSharedReader(name, Policy(), timeout=0.05)
    trainer, rollout = Policy(), Policy()

    async def main() -> None:
        link, tx, rx = await start(name, trainer, rollout)
        with pytest.raises(ValueError, match="not in arena"):
            rlsync.HostSharedReader(name, torch.nn.Linear(2, 2), timeout=5)
        with rlsync.HostSharedReader(name, Policy(), timeout=5) as reader:
            t0 = time.monotonic()
            with pytest.raises(rlsync.RlsyncError, match="no version newer than 0"):
                reader.wait_newer(0, timeout=0.1)
            assert time.monotonic() - t0 < 5
        dropped = Policy()
        reader = rlsync.HostSharedReader(name, dropped, timeout=5)
        del reader
        gc.collect()
        assert whole(dropped) == 0, "the model's views keep the mapping (and the slot) alive"
        await rx.close()

    asyncio.run(main())
