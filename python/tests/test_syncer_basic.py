"""The package imports, documents itself, and one patch round trip over the caller's send/recv works."""

from __future__ import annotations

import asyncio

import torch

import rlsync
from conftest import Link


def test_import_and_help_are_readable() -> None:
    assert rlsync.__version__
    doc = rlsync.WeightSyncer.__doc__ or ""
    assert "RLinf" in doc
    for name in ("init_sender", "init_receiver", "sync", "apply"):
        assert getattr(rlsync.WeightSyncer, name).__doc__, name
    assert issubclass(rlsync.PayloadRejected, rlsync.RlsyncError)
    assert issubclass(rlsync.RlsyncError, RuntimeError)


def test_patch_round_trip_keeps_parameter_identity() -> None:
    torch.manual_seed(0)
    trainer, rollout = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)
    weight, ptr = rollout.weight, rollout.weight.data_ptr()

    async def main() -> None:
        link = Link()
        tx = rlsync.PatchWeightSyncer(init_sync_enabled=True)
        rx = rlsync.PatchWeightSyncer(init_sync_enabled=True)
        await asyncio.gather(
            tx.init_sender(trainer.state_dict(), rlsync.param_names_need_sync(trainer), link.send, link.up_recv),
            rx.init_receiver(rollout.state_dict(), link.recv, link.up_send),
        )
        assert torch.equal(rollout.weight, trainer.weight)
        for version in (1, 2):
            with torch.no_grad():
                trainer.weight[0, version] += 1.0
            await tx.sync(trainer.state_dict(), link.send, version)
            assert await rx.apply(rollout, link.recv) == version
            assert torch.equal(rollout.weight, trainer.weight)
            assert tx.checksum(trainer.state_dict()) == rx.checksum(rollout.state_dict())
        assert rx.version == 2 and tx.version == 2

    asyncio.run(main())
    assert rollout.weight is weight and rollout.weight.data_ptr() == ptr
