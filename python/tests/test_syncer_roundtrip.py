"""API round trips over the caller's send/recv: patch and bucket, every tensor kind the core syncs."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

import rlsync
from conftest import Link


def mixed_state(seed: int) -> dict[str, torch.Tensor]:
    """0-d / 1-d / N-d tensors in f32, bf16, f16, int64 and bool, plus a tied pair (two names, one tensor)."""
    g = torch.Generator().manual_seed(seed)
    tied = torch.randn(6, 5, generator=g)
    return {
        "emb.weight": tied,
        "scalar": torch.randn((), generator=g),
        "bias": torch.randn(7, generator=g).to(torch.bfloat16),
        "conv.weight": torch.randn(3, 2, 4, 5, generator=g).to(torch.float16),
        "bn.num_batches_tracked": torch.tensor(seed, dtype=torch.int64),
        "mask": torch.rand(9, generator=g) > 0.5,
        "frozen": torch.randn(4, generator=g),
        "head.weight": tied,  # tied to emb.weight
        "empty": torch.zeros(0, 3),
    }


SYNCED = ["emb.weight", "scalar", "bias", "conv.weight", "bn.num_batches_tracked", "mask", "head.weight", "empty"]


def update(sd: dict[str, torch.Tensor], step: int) -> None:
    """A sparse, realistic change of the synced tensors (the tied pair changes through one name)."""
    with torch.no_grad():
        sd["emb.weight"][step % 6, :2] += 0.25
        sd["scalar"] += 1.0
        sd["bias"][step % 7] -= 0.5
        sd["conv.weight"][1, 0, step % 4] *= 1.5
        sd["bn.num_batches_tracked"] += 1
        sd["mask"][step % 9] = ~sd["mask"][step % 9]


def assert_synced(tx_sd: dict[str, torch.Tensor], rx_sd: dict[str, torch.Tensor], keys: list[str]) -> None:
    for k in keys:
        want = tx_sd[k].to(rx_sd[k].dtype)
        assert torch.equal(rx_sd[k], want), k


async def connect(tx: rlsync.WeightSyncer, rx: rlsync.WeightSyncer, tx_sd: Any, rx_sd: Any, names: list[str]) -> Link:
    link = Link()
    await asyncio.gather(
        tx.init_sender(tx_sd, names, link.send, link.up_recv),
        rx.init_receiver(rx_sd, link.recv, link.up_send),
    )
    return link


SYNCERS = {
    "patch": lambda: rlsync.PatchWeightSyncer(init_sync_enabled=True),
    "patch-lz4": lambda: rlsync.PatchWeightSyncer(init_sync_enabled=True, compression_algorithm="lz4"),
    "patch-coo": lambda: rlsync.PatchWeightSyncer(init_sync_enabled=True, delta_encoding=False),
    "bucket": lambda: rlsync.BucketWeightSyncer(bucket_size=64),
    "bucket-staged": lambda: rlsync.BucketWeightSyncer(bucket_size=1 << 20, load_instant=False),
}


@pytest.mark.parametrize("kind", list(SYNCERS))
def test_round_trip_every_tensor_kind(kind: str) -> None:
    tx_sd, rx_sd = mixed_state(1), mixed_state(2)
    ids = {k: (id(v), v.data_ptr()) for k, v in rx_sd.items()}

    async def main() -> None:
        tx, rx = SYNCERS[kind](), SYNCERS[kind]()
        link = await connect(tx, rx, tx_sd, rx_sd, SYNCED)
        assert tx.synced_keys == rx.synced_keys
        assert "head.weight" not in tx.synced_keys, "a tied alias is synced once, under its first name"
        if kind.startswith("patch"):
            assert torch.equal(rx_sd["frozen"], tx_sd["frozen"]), "init bootstrap aligns frozen tensors"
        for version in range(1, 4):
            update(tx_sd, version)
            await tx.sync(tx_sd, link.send, version)
            assert await rx.apply(rx_sd, link.recv) == version
            assert_synced(tx_sd, rx_sd, SYNCED)
            assert tx.checksum(tx_sd) == rx.checksum(rx_sd)
            assert rx_sd["head.weight"] is rx_sd["emb.weight"]

    asyncio.run(main())
    assert {k: (id(v), v.data_ptr()) for k, v in rx_sd.items()} == ids, "tensors are updated in place"


def test_patch_snapshot_in_receiver_dtype_and_empty_patch_carries_version() -> None:
    """A float32 trainer syncs to a bfloat16 rollout: changes are judged in bfloat16 (a change too small to
    show in bfloat16 sends nothing), yet every version arrives, even as an empty patch."""
    tx_sd = {"w": torch.linspace(-2, 2, 64), "b": torch.ones(4)}
    rx_sd = {"w": torch.zeros(64, dtype=torch.bfloat16), "b": torch.zeros(4, dtype=torch.bfloat16)}

    async def main() -> None:
        tx = rlsync.PatchWeightSyncer(init_sync_enabled=True)
        rx = rlsync.PatchWeightSyncer(init_sync_enabled=True)
        link = await connect(tx, rx, tx_sd, rx_sd, ["w", "b"])
        assert torch.equal(rx_sd["w"], tx_sd["w"].to(torch.bfloat16))
        # No change at all: an empty patch still moves the version.
        await tx.sync(tx_sd, link.send, 1)
        assert await rx.apply(rx_sd, link.recv) == 1
        assert rx.last_report()["changed"] == 0
        # A change below bfloat16's resolution: nothing to send in the receiver's dtype.
        tx_sd["b"] += 1e-6
        await tx.sync(tx_sd, link.send, 2)
        assert await rx.apply(rx_sd, link.recv) == 2
        assert rx.last_report()["changed"] == 0
        tx_sd["w"][3] += 1.0
        await tx.sync(tx_sd, link.send, 5)
        assert await rx.apply(rx_sd, link.recv) == 5
        assert rx.last_report()["changed"] == 1
        assert torch.equal(rx_sd["w"], tx_sd["w"].to(torch.bfloat16))
        assert tx.checksum(tx_sd) == rx.checksum(rx_sd)

    asyncio.run(main())


def test_bucket_dtype_casts_floating_tensors_only() -> None:
    tx_sd = {
        "w": torch.randn(5, 3),
        "steps": torch.tensor([2**40 + 1, -3], dtype=torch.int64),
        "flags": torch.tensor([True, False, True]),
    }
    rx_sd = {k: torch.zeros_like(v) for k, v in tx_sd.items()}

    async def main() -> None:
        tx = rlsync.BucketWeightSyncer(bucket_dtype=torch.bfloat16)
        rx = rlsync.BucketWeightSyncer(bucket_dtype=torch.bfloat16)
        link = await connect(tx, rx, tx_sd, rx_sd, list(tx_sd))
        await tx.sync(tx_sd, link.send, 1)
        assert await rx.apply(rx_sd, link.recv) == 1
        assert rx_sd["w"].dtype == torch.float32
        assert torch.equal(rx_sd["w"], tx_sd["w"].to(torch.bfloat16).to(torch.float32)), "floats travel as bf16"
        assert torch.equal(rx_sd["steps"], tx_sd["steps"]), "int64 buffers are not cast"
        assert torch.equal(rx_sd["flags"], tx_sd["flags"]), "bool buffers are not cast"
        assert tx.checksum(tx_sd) == rx.checksum(rx_sd)

    asyncio.run(main())


def test_module_parameters_keep_identity_and_optimizer_sees_new_values() -> None:
    torch.manual_seed(0)
    trainer = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    rollout = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    params = list(rollout.parameters())
    rollout_opt = torch.optim.SGD(rollout.parameters(), lr=0.0)
    names = rlsync.param_names_need_sync(trainer)
    assert "1.running_mean" in names and "1.num_batches_tracked" in names
    opt = torch.optim.Adam(trainer.parameters(), lr=1e-3)

    async def main() -> None:
        tx = rlsync.PatchWeightSyncer(init_sync_enabled=True)
        rx = rlsync.PatchWeightSyncer(init_sync_enabled=True)
        link = await connect(tx, rx, trainer.state_dict(), rollout.state_dict(), names)
        for version in range(1, 4):
            trainer.train()
            loss = trainer(torch.randn(16, 6)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            await tx.sync(trainer.state_dict(), link.send, version)
            assert await rx.apply(rollout, link.recv) == version
            for (k, a), b in zip(trainer.state_dict().items(), rollout.state_dict().values()):
                assert torch.equal(a, b), k

    asyncio.run(main())
    assert all(a is b for a, b in zip(rollout.parameters(), params))
    assert all(p is q for p, q in zip(rollout_opt.param_groups[0]["params"], params))


def test_param_names_need_sync_lists_tied_aliases_and_persistent_buffers() -> None:
    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(5, 3)
            self.head = torch.nn.Linear(3, 5, bias=False)
            self.head.weight = self.emb.weight
            self.frozen = torch.nn.Linear(3, 3)
            self.frozen.requires_grad_(False)
            self.register_buffer("stat", torch.zeros(3))
            self.register_buffer("scratch", torch.zeros(3), persistent=False)

    assert rlsync.param_names_need_sync(Net()) == ["emb.weight", "head.weight", "stat"]


def test_create_from_rlinf_config() -> None:
    from omegaconf import OmegaConf

    cfg = OmegaConf.create(
        {"type": "patch", "patch": {"snapshot_device": "cpu", "transport_device": "cpu", "delta_encoding": True,
                                    "compression": "lz4", "init_sync": {"enabled": True, "prefixes": None,
                                                                        "bucket_size": 1024}}}
    )
    assert isinstance(rlsync.WeightSyncer.create(cfg), rlsync.PatchWeightSyncer)
    b = rlsync.WeightSyncer.create({"type": "bucket", "bucket": {"bucket_size": 4096, "bucket_dtype": "bfloat16"}})
    assert isinstance(b, rlsync.BucketWeightSyncer)
    with pytest.raises(ValueError, match="Unsupported weight syncer type"):
        rlsync.WeightSyncer.create({"type": "nccl"})


def test_non_source_rank_is_silent() -> None:
    sd = {"w": torch.ones(3)}

    async def main() -> None:
        tx = rlsync.PatchWeightSyncer()
        taken: list[bytes] = []

        async def never(*_: Any) -> Any:
            raise AssertionError("a non-source rank sends nothing")

        async def metadata() -> bytes:
            # RLinf's rollout rank 0 sends its metadata to every actor rank: a non-source rank takes it once.
            taken.append(b"metadata")
            return b"metadata"

        await tx.init_sender(sd, ["w"], never, metadata, is_sender=False)
        await tx.sync(sd, never, 1)
        assert tx.sender_initialized()
        assert taken == [b"metadata"]

    asyncio.run(main())


def test_rlinf_config_keys_and_comm_options() -> None:
    # RLinf's create() reads compression_algorithm (or compression) and init_sync.buckets_size (old spelling).
    p = rlsync.WeightSyncer.create(
        {"type": "patch", "patch": {"compression_algorithm": "lz4", "init_sync": {"enabled": True, "buckets_size": 4096}}}
    )
    assert p._config["patch"]["compression"] == "lz4"
    assert p._config["patch"]["init_sync"] == {"enabled": True, "prefixes": None, "bucket_size": 4096}
    assert p.comm_options is None, "no NCCL collective options: rlsync moves bytes itself"
    assert not p.sender_initialized() and not p.receiver_initialized()


@pytest.mark.parametrize("wrap", ["bytearray", "memoryview", "numpy", "torch"])
def test_recv_may_return_any_bytes_like_object(wrap: str) -> None:
    import numpy as np

    convert = {
        "bytearray": bytearray,
        "memoryview": memoryview,
        "numpy": lambda b: np.frombuffer(b, dtype=np.uint8),
        "torch": lambda b: torch.frombuffer(bytearray(b), dtype=torch.uint8),
    }[wrap]
    tx_sd, rx_sd = mixed_state(3), mixed_state(4)

    async def main() -> None:
        tx, rx = SYNCERS["patch"](), SYNCERS["patch"]()
        link = Link()

        async def recv() -> Any:
            return convert(await link.recv())

        async def up_recv() -> Any:
            return convert(await link.up_recv())

        await asyncio.gather(tx.init_sender(tx_sd, SYNCED, link.send, up_recv), rx.init_receiver(rx_sd, recv, link.up_send))
        update(tx_sd, 1)
        await tx.sync(tx_sd, link.send, 1)
        assert await rx.apply(rx_sd, recv) == 1
        assert_synced(tx_sd, rx_sd, SYNCED)

    asyncio.run(main())
