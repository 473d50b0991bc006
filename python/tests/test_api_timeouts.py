"""Per-call timeouts (issue 25 item 1): ``apply`` / ``stage`` / ``sync`` / ``flush`` / ``init_*`` ``timeout=``
raise :class:`rlsync.Timeout` naming what was awaited, change no weights, and leave the syncer usable."""

from __future__ import annotations

import asyncio
import os
import tempfile
import time

import pytest
import torch

import rlsync


def state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 16, generator=g), "b": torch.randn(16, generator=g)}


def make(kind: str) -> rlsync.WeightSyncer:
    if kind == "patch":
        return rlsync.PatchWeightSyncer(init_sync_enabled=True)
    return rlsync.BucketWeightSyncer(bucket_size=1024)  # several buckets per version


async def shm_pair(kind: str, path: str, receivers: int = 1, slots: int = 4):
    """A sender and ``receivers`` receivers of rlsync's shm channel in this process, initialised."""
    tx_sd = state(1)
    rx_sds = [state(10 + r) for r in range(receivers)]
    tx_end, *rx_ends = await asyncio.gather(
        rlsync.shm_sender(path, receivers, timeout=30, slots=slots),
        *(rlsync.shm_receiver(path, r, timeout=30) for r in range(receivers)),
    )
    s = make(kind)
    rs = [make(kind) for _ in range(receivers)]
    await asyncio.gather(
        s.init_sender(tx_sd, ["w", "b"], tx_end),
        *(r.init_receiver(sd, end) for r, sd, end in zip(rs, rx_sds, rx_ends)),
    )
    return s, tx_sd, tx_end, rs, rx_sds, rx_ends


@pytest.mark.parametrize("kind", ["patch", "bucket"])
def test_apply_times_out_on_the_shm_channel_then_applies(kind: str) -> None:
    async def main() -> None:
        with tempfile.TemporaryDirectory() as d:
            s, tx_sd, tx_end, (r,), (rx_sd,), (rx_end,) = await shm_pair(kind, os.path.join(d, "s.sock"))
            before = {k: v.clone() for k, v in rx_sd.items()}
            t0 = time.monotonic()
            with pytest.raises(rlsync.Timeout) as info:
                await r.apply(rx_sd, rx_end, timeout=0.3)
            took = time.monotonic() - t0
            assert 0.25 < took < 5.0  # the call's bound, not the channel's 30 s
            e = info.value
            assert isinstance(e, rlsync.TransportError)
            assert e.awaited == "payload of version after 0 from the sender"
            assert (e.rank, e.ranks, e.version) == (None, [], None)
            assert e.seconds == pytest.approx(0.3)
            assert all(torch.equal(before[k], rx_sd[k]) for k in rx_sd) and r.version == 0
            # Still usable: the next version arrives and installs.
            with torch.no_grad():
                tx_sd["w"][3] += 1.0
            await s.sync(tx_sd, tx_end, 1)
            assert await r.apply(rx_sd, rx_end, timeout=10) == 1
            assert r.checksum(rx_sd) == s.checksum(tx_sd)
            await s.flush(timeout=10)

    asyncio.run(main())


def test_flush_and_sync_time_out_naming_the_receiver_and_change_nothing() -> None:
    async def main() -> None:
        with tempfile.TemporaryDirectory() as d:
            s, tx_sd, tx_end, (r,), (rx_sd,), (rx_end,) = await shm_pair("patch", os.path.join(d, "s.sock"), slots=1)
            with torch.no_grad():
                tx_sd["w"][0] += 1.0
            await s.sync(tx_sd, tx_end, 1)
            with pytest.raises(rlsync.Timeout) as info:
                await s.flush(timeout=0.3)
            assert (info.value.rank, info.value.ranks, info.value.version) == (0, [0], 1)
            assert "receiver rank 0" in info.value.awaited
            # One slot, not released: the next sync times out before it touches the snapshot.
            with torch.no_grad():
                tx_sd["w"][1] += 1.0
            with pytest.raises(rlsync.Timeout) as info:
                await s.sync(tx_sd, tx_end, 2, timeout=0.3)
            assert info.value.version == 2 and info.value.rank == 0
            assert s.version == 1
            # The receiver catches up: version 1, then version 3 carries both changes.
            assert await r.apply(rx_sd, rx_end, timeout=10) == 1
            await s.sync(tx_sd, tx_end, 3, timeout=10)
            assert await r.apply(rx_sd, rx_end, timeout=10) == 3
            assert r.checksum(rx_sd) == s.checksum(tx_sd)
            assert torch.equal(rx_sd["w"], tx_sd["w"])
            await s.flush(timeout=10)

    asyncio.run(main())


@pytest.mark.parametrize("kind", ["patch", "bucket"])
def test_bridge_apply_timeout_bounds_the_callers_recv_and_stays_usable(kind: str, link) -> None:
    async def main() -> None:
        ln = link()
        tx_sd, rx_sd = state(1), state(2)
        s, r = make(kind), make(kind)
        await asyncio.gather(
            s.init_sender(tx_sd, ["w", "b"], ln.send, ln.up_recv),
            r.init_receiver(rx_sd, ln.recv, ln.up_send, timeout=10),
        )
        before = {k: v.clone() for k, v in rx_sd.items()}
        with pytest.raises(rlsync.Timeout) as info:
            await r.apply(rx_sd, ln.recv, timeout=0.2)
        e = info.value
        assert e.awaited == f"payload of version after {r.version} from the sender"
        assert (e.rank, e.version) == (None, None) and e.seconds == pytest.approx(0.2)
        assert all(torch.equal(before[k], rx_sd[k]) for k in rx_sd)
        with torch.no_grad():
            tx_sd["b"] += 2.0
        await s.sync(tx_sd, ln.send, 5)
        assert await r.apply(rx_sd, ln.recv, timeout=5) == 5
        assert r.checksum(rx_sd) == s.checksum(tx_sd)

    asyncio.run(main())


def test_bridge_sync_timeout_names_the_receiver(link) -> None:
    async def main() -> None:
        ln = link()
        tx_sd, rx_sd = state(1), state(2)
        s, r = make("bucket"), make("bucket")
        await asyncio.gather(
            s.init_sender(tx_sd, ["w", "b"], ln.send, ln.up_recv), r.init_receiver(rx_sd, ln.recv, ln.up_send)
        )

        async def stuck_send(payload: bytes) -> None:
            await asyncio.sleep(30)

        with pytest.raises(rlsync.Timeout) as info:
            await s.sync(tx_sd, stuck_send, 1, timeout=0.2)
        assert (info.value.rank, info.value.version) == (0, 1)
        # The sender stays usable; the receiver takes the next version whole.
        await s.sync(tx_sd, ln.send, 2)
        assert await r.apply(rx_sd, ln.recv, timeout=5) == 2
        assert r.checksum(rx_sd) == s.checksum(tx_sd)

    asyncio.run(main())


def test_init_timeout_and_bad_timeouts(link) -> None:
    async def main() -> None:
        ln = link()
        r = make("patch")
        with pytest.raises(rlsync.Timeout) as info:
            await r.init_receiver(state(2), ln.recv, ln.up_send, timeout=0.2)
        assert "during init" in info.value.awaited
        assert r.receiver_initialized() is False  # a failed init leaves it uninitialised, ready for another
        for bad in (0, -1.0, float("nan"), float("inf")):
            with pytest.raises(ValueError):
                await r.apply(state(2), ln.recv, timeout=bad)

    asyncio.run(main())
