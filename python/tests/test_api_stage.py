"""Stage then commit on receivers (issue 25 item 3): ``stage`` verifies without touching the model, ``commit``
installs in place, ``abort`` drops it and tells the sender on rlsync's channel; misuse is a clear error."""

from __future__ import annotations

import asyncio
import os
import tempfile

import pytest
import torch

import rlsync
from test_api_timeouts import make, shm_pair, state


@pytest.mark.parametrize("kind", ["patch", "bucket"])
def test_stage_leaves_the_model_and_commit_installs_in_place(kind: str, link) -> None:
    async def main() -> None:
        ln = link()
        tx_sd, rx_sd = state(1), state(2)
        s, r = make(kind), make(kind)
        await asyncio.gather(
            s.init_sender(tx_sd, ["w", "b"], ln.send, ln.up_recv), r.init_receiver(rx_sd, ln.recv, ln.up_send)
        )
        w = rx_sd["w"]
        with torch.no_grad():
            tx_sd["w"][5] += 1.0
        await s.sync(tx_sd, ln.send, 7)
        before = {k: v.clone() for k, v in rx_sd.items()}
        v0 = r.version
        assert await r.stage(ln.recv, timeout=5) == 7
        assert r.staged_version == 7 and r.version == v0
        assert all(torch.equal(before[k], rx_sd[k]) for k in rx_sd)  # not touched
        with pytest.raises(rlsync.RlsyncError, match="staged"):
            await r.stage(ln.recv, timeout=0.1)
        with pytest.raises(rlsync.RlsyncError, match="staged"):
            await r.apply(rx_sd, ln.recv, timeout=0.1)
        assert await r.commit() == 7  # into the state dict given at init
        assert rx_sd["w"] is w and r.version == 7 and r.staged_version is None
        assert r.checksum(rx_sd) == s.checksum(tx_sd)
        with pytest.raises(rlsync.RlsyncError, match="no version is staged"):
            await r.commit(rx_sd)
        with pytest.raises(rlsync.RlsyncError, match="no version is staged"):
            await r.abort("nothing")
        # apply == stage + commit
        with torch.no_grad():
            tx_sd["b"] -= 1.0
        await s.sync(tx_sd, ln.send, 8)
        assert await r.apply(rx_sd, ln.recv) == 8
        assert r.checksum(rx_sd) == s.checksum(tx_sd)

    asyncio.run(main())


def test_stage_timeout_keeps_nothing_staged(link) -> None:
    async def main() -> None:
        ln = link()
        tx_sd, rx_sd = state(1), state(2)
        s, r = make("patch"), make("patch")
        await asyncio.gather(
            s.init_sender(tx_sd, ["w", "b"], ln.send, ln.up_recv), r.init_receiver(rx_sd, ln.recv, ln.up_send)
        )
        with pytest.raises(rlsync.Timeout):
            await r.stage(ln.recv, timeout=0.1)
        assert r.staged_version is None
        await s.sync(tx_sd, ln.send, 1)
        assert await r.stage(ln.recv, timeout=5) == 1
        assert await r.commit(rx_sd) == 1

    asyncio.run(main())


def test_commit_and_abort_need_a_receiver() -> None:
    async def main() -> None:
        s = make("patch")
        with pytest.raises(rlsync.RlsyncError):
            await s.abort("x")
        with pytest.raises((rlsync.RlsyncError, TypeError)):
            await s.commit()

    asyncio.run(main())


@pytest.mark.parametrize("kind", ["patch", "bucket"])
def test_abort_on_the_shm_channel_is_counted_by_the_sender(kind: str) -> None:
    async def main() -> None:
        with tempfile.TemporaryDirectory() as d:
            s, tx_sd, tx_end, (r,), (rx_sd,), (rx_end,) = await shm_pair(kind, os.path.join(d, "s.sock"))
            with torch.no_grad():
                tx_sd["w"][0] += 1.0
            await s.sync(tx_sd, tx_end, 1, wait=None)
            assert await r.apply(rx_sd, rx_end, timeout=10) == 1
            with torch.no_grad():
                tx_sd["w"][1] += 1.0
            await s.sync(tx_sd, tx_end, 2)
            before = {k: v.clone() for k, v in rx_sd.items()}
            assert await r.stage(rx_end, timeout=10) == 2
            await r.abort("failed my own check")
            assert r.version == 1 and r.staged_version is None
            assert all(torch.equal(before[k], rx_sd[k]) for k in rx_sd)
            for _ in range(100):  # the report travels upstream on its own
                if s.rejections():
                    break
                await asyncio.sleep(0.02)
            assert s.rejections() == {0: 1}
            assert s.last_rejection() == (0, 2, "failed my own check")
            assert s.acked_versions() == {0: 1}  # the acked version did not advance
            # The sender waiting for version 2 to be applied learns at once that it was declined.
            with torch.no_grad():
                tx_sd["w"][2] += 1.0
            await s.sync(tx_sd, tx_end, 3)
            if kind == "bucket":
                assert await r.apply(rx_sd, rx_end, timeout=10) == 3
                assert r.checksum(rx_sd) == s.checksum(tx_sd)
            else:
                # The next patch builds on the dropped version 2: rejected, weights untouched.
                with pytest.raises(rlsync.PayloadRejected, match="full resync"):
                    await r.apply(rx_sd, rx_end, timeout=10)
                assert r.version == 1
            await s.flush(timeout=10)

    asyncio.run(main())
