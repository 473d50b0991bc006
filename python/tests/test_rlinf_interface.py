"""RLinf's interface details (issue 23 item 6): signatures, parameter names and defaults as RLinf's syncers have
them, RLinf's attributes, ``comm_options`` and ``create(cfg)`` with RLinf's config keys and aliases."""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf

import rlsync
from conftest import Link

_REQUIRED = inspect.Parameter.empty

# RLinf's public signatures (rlinf/hybrid_engines/weight_syncer/{base,patch_syncer,bucket_syncer}.py):
# (name, default) of every parameter after ``self``, in order.
RLINF_METHODS: dict[str, list[tuple[str, Any]]] = {
    "sync": [("state_dict", _REQUIRED), ("send", _REQUIRED), ("version", _REQUIRED)],
    "apply": [("model", _REQUIRED), ("recv", _REQUIRED)],
    "init_sender": [
        ("state_dict", _REQUIRED),
        ("param_names_need_sync", _REQUIRED),
        ("send", _REQUIRED),
        ("recv", None),
        ("is_sender", True),
    ],
    "init_receiver": [("state_dict", _REQUIRED), ("recv", _REQUIRED), ("send", None)],
    "sender_initialized": [],
    "receiver_initialized": [],
}
RLINF_PATCH_INIT = [
    ("snapshot_device", "cpu"),
    ("transport_device", None),
    ("delta_encoding", True),
    ("compression_algorithm", "none"),
    ("init_sync_enabled", False),
    ("init_sync_prefixes", None),
    ("init_sync_bucket_size", 128 * 1024 * 1024),
]
RLINF_BUCKET_INIT = [
    ("bucket_size", _REQUIRED),
    ("bucket_dtype", _REQUIRED),
    ("bucket_device", _REQUIRED),
    ("is_agent", False),
    ("load_instant", True),
]


def _positional(fn: Any) -> list[inspect.Parameter]:
    params = list(inspect.signature(fn).parameters.values())
    return [p for p in params if p.name != "self" and p.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD]


def _check(fn: Any, expected: list[tuple[str, Any]]) -> None:
    params = _positional(fn)
    assert [p.name for p in params] == [n for n, _ in expected], fn.__qualname__
    for p, (name, default) in zip(params, expected):
        # Where RLinf has a default, rlsync has the same one; where RLinf has none, rlsync may add one
        # (rlsync's older callers rely on it) but every RLinf call still binds the same way.
        if default is not _REQUIRED:
            assert p.default == default, f"{fn.__qualname__}({name}) default {p.default!r} != RLinf's {default!r}"
    extra = [p for p in inspect.signature(fn).parameters.values() if p.kind not in (
        inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]
    assert not extra, f"{fn.__qualname__} takes *args/**kwargs: {extra}"
    for p in inspect.signature(fn).parameters.values():
        if p.kind == inspect.Parameter.KEYWORD_ONLY:
            assert p.default is not _REQUIRED, f"{fn.__qualname__}: keyword-only {p.name} must be optional"


@pytest.mark.parametrize("cls", [rlsync.PatchWeightSyncer, rlsync.BucketWeightSyncer])
def test_public_signatures_match_rlinfs(cls: type) -> None:
    for name, expected in RLINF_METHODS.items():
        fn = getattr(cls, name)
        _check(fn, expected)
        if name in ("sync", "apply", "init_sender", "init_receiver"):
            assert inspect.iscoroutinefunction(fn), name
    _check(cls.__init__, RLINF_PATCH_INIT if cls is rlsync.PatchWeightSyncer else RLINF_BUCKET_INIT)
    assert list(inspect.signature(cls.create).parameters)[0] == "config"


def _pair() -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(3)
    return torch.nn.Linear(6, 3), torch.nn.Linear(6, 3)


async def _init(tx: rlsync.WeightSyncer, rx: rlsync.WeightSyncer, trainer: Any, rollout: Any, link: Link) -> None:
    await asyncio.gather(
        tx.init_sender(trainer.state_dict(), rlsync.param_names_need_sync(trainer), link.send, link.up_recv),
        rx.init_receiver(rollout.state_dict(), link.recv, link.up_send),
    )


@pytest.mark.parametrize("kind", ["patch", "bucket"])
def test_apply_takes_rlinfs_keywords_and_the_old_one(kind: str) -> None:
    trainer, rollout = _pair()

    async def main() -> None:
        link = Link()
        tx, rx = (rlsync.WeightSyncer.create({"type": kind}) for _ in range(2))
        assert not tx.sender_initialized() and not rx.receiver_initialized()
        await _init(tx, rx, trainer, rollout, link)
        assert tx.sender_initialized() and not tx.receiver_initialized()
        assert rx.receiver_initialized() and not rx.sender_initialized()
        for version, call in enumerate(("rlinf", "positional", "old"), start=1):
            with torch.no_grad():
                trainer.weight.add_(1.0)
            await tx.sync(state_dict=trainer.state_dict(), send=link.send, version=version)
            if call == "rlinf":
                got = await rx.apply(model=rollout, recv=link.recv)
            elif call == "positional":
                got = await rx.apply(rollout, link.recv)
            else:
                got = await rx.apply(model_or_state_dict=rollout.state_dict(), recv=link.recv)
            assert got == version
            assert torch.equal(rollout.weight, trainer.weight)
        with pytest.raises(TypeError, match="both"):
            await rx.apply(model=rollout, recv=link.recv, model_or_state_dict=rollout)
        with pytest.raises(TypeError, match="'model'"):
            await rx.apply(recv=link.recv)
        with pytest.raises(TypeError, match="'recv'"):
            await rx.apply(rollout)
        assert rx.version == 3, "a refused call changes nothing"

    asyncio.run(main())


def test_patch_attributes_are_rlinfs() -> None:
    s = rlsync.PatchWeightSyncer()
    assert s.snapshot_device == torch.device("cpu") and isinstance(s.snapshot_device, torch.device)
    assert s.transport_device == torch.device("cpu"), "None is rlsync's transport: the CPU"
    assert s.delta_encoding is True and s.compression_algorithm == "none"
    assert s.init_sync_enabled is False and s.init_sync_prefixes is None
    assert s.init_sync_bucket_size == 128 * 1024 * 1024
    assert s.comm_options is None

    s = rlsync.PatchWeightSyncer(
        snapshot_device=torch.device("cpu"),
        transport_device="cpu",
        delta_encoding=False,
        compression_algorithm="lz4",
        init_sync_enabled=True,
        init_sync_prefixes=("value_head",),
        init_sync_bucket_size=64,
    )
    assert (s.delta_encoding, s.compression_algorithm, s.init_sync_enabled) == (False, "lz4", True)
    assert s.init_sync_prefixes == ["value_head"] and s.init_sync_bucket_size == 64
    with pytest.raises(AttributeError):
        s.init_sync_enabled = False  # type: ignore[misc]  # set once: the native syncer was built from it
    with pytest.raises(ValueError, match="must not be empty"):
        rlsync.PatchWeightSyncer(init_sync_enabled=True, init_sync_prefixes=[])
    rlsync.PatchWeightSyncer(init_sync_enabled=False, init_sync_prefixes=[])  # RLinf checks only when enabled


def test_bucket_attributes_are_rlinfs() -> None:
    b = rlsync.BucketWeightSyncer(bucket_size=128, bucket_dtype="fp32", bucket_device="cpu")
    assert b.bucket_size == 128 and b.bucket_dtype is torch.float32
    assert b.bucket_device == torch.device("cpu") and isinstance(b.bucket_device, torch.device)
    assert b.is_agent is False and b.load_instant is True and b.comm_options is None
    b = rlsync.BucketWeightSyncer(256, torch.bfloat16, "cpu", True, False)
    assert (b.bucket_size, b.bucket_dtype, b.is_agent, b.load_instant) == (256, torch.bfloat16, True, False)
    assert rlsync.BucketWeightSyncer(bucket_dtype="BF16").bucket_dtype is torch.bfloat16
    assert rlsync.BucketWeightSyncer().bucket_dtype is None
    with pytest.raises(ValueError, match="bucket_dtype"):
        rlsync.BucketWeightSyncer(bucket_dtype=torch.int8)


def test_bucket_device_cuda_is_accepted_and_cpu_tensors_stage_on_the_host() -> None:
    """bucket_device="cuda" (RLinf's default) packs CUDA tensors' buckets on the GPU; a CPU model's buckets
    are staged on the host, so the key works here without a GPU, with the same payloads as "cpu"."""
    trainer, rollout = _pair()
    b = rlsync.BucketWeightSyncer(bucket_size=64, bucket_dtype=torch.bfloat16, bucket_device="cuda")
    assert b.bucket_device == torch.device("cuda")

    async def main() -> None:
        payloads = {}
        for device in ("cuda", "cpu"):
            link = Link()
            tx = rlsync.BucketWeightSyncer(bucket_size=64, bucket_dtype=torch.bfloat16, bucket_device=device)
            rx = rlsync.BucketWeightSyncer(bucket_size=64, bucket_dtype=torch.bfloat16, bucket_device=device)
            target = torch.nn.Linear(6, 3)
            await _init(tx, rx, trainer, target, link)
            await tx.sync(trainer.state_dict(), link.send, 1)
            sent = []
            while not link.to_rx.empty():
                sent.append(bytes(memoryview(link.to_rx.get_nowait())))
            for p in sent:
                await link.to_rx.put(p)
            assert await rx.apply(target, link.recv) == 1
            assert torch.equal(target.weight, trainer.weight.to(torch.bfloat16).float())
            payloads[device] = sent
        assert payloads["cuda"] == payloads["cpu"] and payloads["cpu"]

    asyncio.run(main())


def test_create_reads_rlinfs_config_from_omegaconf() -> None:
    patch_cfg = OmegaConf.create(
        {
            "type": "patch",
            "patch": {
                "snapshot_device": "cpu",
                "transport_device": "cpu",
                "delta_encoding": False,
                "compression": "none",
                "init_sync": {"enabled": True, "prefixes": ["value_head"], "bucket_size": 4096},
            },
        }
    )
    p = rlsync.WeightSyncer.create(patch_cfg)
    assert isinstance(p, rlsync.PatchWeightSyncer)
    assert p.comm_options is None and p.delta_encoding is False
    assert p.init_sync_enabled is True and p.init_sync_prefixes == ["value_head"] and p.init_sync_bucket_size == 4096

    bucket_cfg = OmegaConf.create(
        {
            "type": "bucket",
            "bucket": {"bucket_size": 128, "bucket_dtype": "fp32", "bucket_device": "cpu", "is_agent": False,
                       "load_instant": False},
        }
    )
    b = rlsync.WeightSyncer.create(bucket_cfg)
    assert isinstance(b, rlsync.BucketWeightSyncer) and b.comm_options is None
    assert (b.bucket_size, b.bucket_dtype, b.load_instant) == (128, torch.float32, False)

    with pytest.raises(ValueError, match="Unsupported weight syncer type"):
        rlsync.WeightSyncer.create(OmegaConf.create({"type": "unknown"}))
    with pytest.raises(TypeError, match="weight_syncer config"):
        rlsync.WeightSyncer.create(["patch"])


def test_create_takes_rlinfs_key_aliases() -> None:
    def patch(p: dict[str, Any]) -> rlsync.PatchWeightSyncer:
        s = rlsync.WeightSyncer.create({"type": "patch", "patch": p})
        assert isinstance(s, rlsync.PatchWeightSyncer)
        return s

    assert patch({"compression": "lz4"}).compression_algorithm == "lz4"
    assert patch({"compression_algorithm": "lz4"}).compression_algorithm == "lz4"
    # RLinf reads compression_algorithm first and falls back to compression.
    assert patch({"compression_algorithm": "lz4", "compression": "none"}).compression_algorithm == "lz4"
    assert patch({"compression_algorithm": "none", "compression": "lz4"}).compression_algorithm == "none"
    assert patch({"init_sync": {"buckets_size": 77}}).init_sync_bucket_size == 77
    assert patch({"init_sync": {"bucket_size": 5, "buckets_size": 77}}).init_sync_bucket_size == 5
    assert patch({}).init_sync_bucket_size == 128 * 1024 * 1024


@pytest.mark.parametrize("kind", ["patch", "bucket"])
def test_comm_options_come_from_the_top_level_keys(kind: str) -> None:
    base: dict[str, Any] = {"type": kind, kind: {}}
    for cfg in (base, OmegaConf.create(base)):
        assert rlsync.WeightSyncer.create(cfg).comm_options is None
    full = {**base, "use_ring_sync": True, "nccl_max_ctas": 8, "nccl_min_ctas": 2}
    for cfg in (full, OmegaConf.create(full)):
        opts = rlsync.WeightSyncer.create(cfg).comm_options
        assert isinstance(opts, rlsync.CollectiveGroupOptions)
        assert (opts.use_ring_broadcast, opts.accel_max_ctas, opts.accel_min_ctas) == (True, 8, 2)
        assert opts.accel_cluster_size is None and opts.is_high_priority_stream is False
        assert not opts.is_empty_options()
    only_max = rlsync.WeightSyncer.create({**base, "nccl_max_ctas": 4}).comm_options
    assert only_max is not None and (only_max.use_ring_broadcast, only_max.accel_max_ctas) == (False, 4)
    assert rlsync.WeightSyncer.create({**base, "use_ring_sync": False}).comm_options is None
    assert rlsync.CollectiveGroupOptions().is_empty_options()
