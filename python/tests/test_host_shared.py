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
        # A device payload (a sender on a GPU with transport_device="cuda") is refused by name.
        await link.to_rx.put(b"RLDP" + bytes(300))
        with pytest.raises(rlsync.RlsyncError, match="host-shared receiver installs host-coded payloads"):
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
            with pytest.raises(rlsync.Timeout, match=str(holder.pid)) as held:
                await rx.apply(rollout, link.recv, timeout=0.3)
            assert str(holder.pid) in held.value.awaited and held.value.seconds >= 0.3
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
    with pytest.raises(rlsync.Timeout, match="did not appear"):
        rlsync.HostSharedReader(name, Policy(), timeout=0.05)
    trainer, rollout = Policy(), Policy()

    async def main() -> None:
        link, tx, rx = await start(name, trainer, rollout)
        with pytest.raises(ValueError, match="not in arena"):
            rlsync.HostSharedReader(name, torch.nn.Linear(2, 2), timeout=5)
        with rlsync.HostSharedReader(name, Policy(), timeout=5) as reader:
            t0 = time.monotonic()
            with pytest.raises(rlsync.Timeout, match="no version newer than 0") as ran_out:
                reader.wait_newer(0, timeout=0.1)
            assert ran_out.value.version == 1 and ran_out.value.seconds >= 0.1
            assert time.monotonic() - t0 < 5
        dropped = Policy()
        reader = rlsync.HostSharedReader(name, dropped, timeout=5)
        del reader
        gc.collect()
        assert whole(dropped) == 0, "the model's views keep the mapping (and the slot) alive"
        await rx.close()

    asyncio.run(main())


def asker_process(name: str, out: "mp.Queue") -> None:
    """Attach; while a thread waits in ``wait_newer``, ask the reader from this one (it took the GIL back)."""
    import threading

    try:
        reader = rlsync.HostSharedReader(name, Policy(), timeout=30)
        waiting = threading.Event()

        def wait() -> None:
            waiting.set()
            try:
                reader.wait_newer(reader.version + 100, timeout=1.5)
            except rlsync.Timeout:
                pass

        t = threading.Thread(target=wait)
        t.start()
        waiting.wait()
        time.sleep(0.3)  # the thread is inside the native wait now
        asked = (reader.version, reader.closed)
        t.join()
        reader.close()
        out.put(("asked", asked, reader.closed))
    except BaseException as e:  # report instead of hanging the parent
        out.put(("failed", repr(e), None))


def test_another_thread_may_ask_a_reader_while_one_waits_in_it() -> None:
    """A thread in ``wait_newer`` holds the reader for its wait and needs the GIL back at its end: another
    thread asking the reader meanwhile must wait for it without the GIL (holding the GIL, it deadlocked)."""
    name = arena_name()
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    trainer, rollout = Policy(), Policy()

    async def main() -> None:
        link, tx, rx = await start(name, trainer, rollout)
        asker = ctx.Process(target=asker_process, args=(name, out))
        asker.start()
        try:
            got = await asyncio.to_thread(out.get, True, 60)
        finally:
            asker.join(timeout=30)
            if asker.is_alive():
                asker.kill()
        assert got == ("asked", (0, False), True), got
        await rx.close()

    asyncio.run(main())


def test_a_wait_that_runs_out_leaves_the_model_on_the_buffer_its_slot_holds() -> None:
    """``wait_newer(than)`` flips the reader's slot to every version published meanwhile, also when none is newer
    than ``than``; when it then runs out, the model must view that buffer too: the applier writes the other one
    next (the model stayed on it, and showed the next version while the slot said it held this one)."""
    name = arena_name()
    trainer, rollout, other = Policy(), Policy(), Policy()

    async def main() -> None:
        link, tx, rx = await start(name, trainer, rollout)
        with rlsync.HostSharedReader(name, other, timeout=5) as reader:
            for v in (1, 2):
                set_version(trainer, v)
                await tx.sync(trainer.state_dict(), link.send, v)
                assert await rx.apply(rollout, link.recv) == v
                if v == 1:
                    assert reader.refresh() == 1 and whole(other) == 1
            with pytest.raises(rlsync.RlsyncError, match="no version newer than 5"):
                reader.wait_newer(5, timeout=0.1)  # sees version 2 on the way, not newer than 5
            assert reader.version == 2 and whole(other) == 2
            set_version(trainer, 3)
            await tx.sync(trainer.state_dict(), link.send, 3)
            assert await rx.apply(rollout, link.recv) == 3  # into version 1's buffer, held by no one
            assert whole(other) == 2, "the model views the buffer its slot holds"
            assert reader.refresh() == 3 and whole(other) == 3
        await rx.close()

    asyncio.run(main())
    assert not os.path.exists(shm(name))


def test_a_forked_child_gets_its_own_runtime() -> None:
    """A child forked after rlsync's runtime started inherits it without its worker thread: its own first call
    must build a runtime of its own (with the inherited one, a bounded wait never woke up and the child hung)."""
    import warnings

    name = arena_name()
    with pytest.raises(rlsync.Timeout):
        rlsync.HostSharedReader(name, Policy(), timeout=0.05)  # starts this process's runtime
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # "fork() of a multi-threaded process"
        pid = os.fork()
    if pid == 0:
        code = 1
        try:
            t0 = time.monotonic()
            rlsync.HostSharedReader(name, Policy(), timeout=0.2)
        except rlsync.Timeout:
            code = 0 if time.monotonic() - t0 < 10 else 2
        except BaseException:
            code = 3
        os._exit(code)
    deadline = time.monotonic() + 30
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child's bounded wait never returned")
        time.sleep(0.05)
    assert os.waitstatus_to_exitcode(status) == 0
