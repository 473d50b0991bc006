"""RLinf's unit tests, one by one (issue 23 items 4 and 8), and the bucket syncer without a handshake.

RLinf's ``tests/unit_tests/test_weight_syncer.py`` (RLinf/RLinf, Apache-2.0; read for behaviour, not copied) test
by test -> its rlsync counterpart (``file::test``; this file's tests by bare name), or why there is none:

- test_collect_param_names_need_sync_keeps_tied_aliases_and_persistent_buffers
  -> test_syncer_roundtrip::test_param_names_need_sync_lists_tied_aliases_and_persistent_buffers
- test_as_coo_2d_view_for_supported_ranks -> test_patch_round_trips_tensors_of_every_rank
  (RLinf's helper views a tensor as 2-D for its torch patch builder; rlsync's builder is Rust: what the helper is
  for, a patch over 0-d, 1-d, 2-d and 3-d tensors, is tested here)
- test_as_coo_2d_view_raises_for_nonviewable_high_rank_tensor -> test_patch_round_trips_tensors_of_every_rank
  (a non-contiguous 3-D tensor: rlsync reads tensors in place and refuses it with a clear error)
- test_downscale_nonnegative_indices_selects_expected_dtype -> test_patch_indices_of_every_width_round_trip
  (RLinf's helper picks the index dtype; rlsync's Rust encoder picks the index width: changes at indices that
  need 1, 2 and 4 bytes round trip exactly; the 8-byte case needs a tensor of 2^31 elements, left out for size;
  the width choice itself: wire.rs::narrowest_width_picks_smallest in rlsync-core)
- test_patch_weight_syncer_roundtrip_delta_enabled / _delta_disabled -> test_patch_round_trip_on_the_cpu
  (RLinf runs them on the accelerator; the same steps on the CPU here)
- test_patch_weight_syncer_inactive_sender_returns_empty_patch -> test_rlinf_ranks::
  test_an_inactive_sender_without_recv_never_communicates and test_syncer_roundtrip::test_non_source_rank_is_silent
  (RLinf's ``create_patch`` / ``snapshot`` / ``patch_builder`` are internals rlsync does not have: its inactive
  sender keeps no snapshot and its ``sync`` sends nothing)
- test_patch_weight_syncer_roundtrip_cuda_delta_enabled / _cuda_delta_disabled, _cpu_snapshot_cuda_state_roundtrip,
  test_cpu_snapshot_patch_builder_matches_gpu_snapshot_under_allocator_pressure, _roundtrip_cuda_nvcomp
  -> needs a GPU: CUDA state dicts, a GPU snapshot, nvCOMP (rlsync's CUDA path is tested by test_worker_device.py
  and the core's gpu tests on a device machine)
- test_patch_weight_syncer_uses_receiver_dtypes_for_snapshot
  -> test_syncer_roundtrip::test_patch_snapshot_in_receiver_dtype_and_empty_patch_carries_version
- test_patch_weight_syncer_init_sync_bootstraps_selected_prefixes / _full_state_dict
  -> test_patch_init_sync_bootstraps_prefixes_or_everything
- test_patch_weight_syncer_preserves_nonfloating_buffers -> test_patch_round_trip_on_the_cpu (int64 and bool
  buffers) and test_syncer_roundtrip::test_round_trip_every_tensor_kind
- test_patch_weight_syncer_empty_patch_still_applies_version
  -> test_syncer_roundtrip::test_patch_snapshot_in_receiver_dtype_and_empty_patch_carries_version
- test_patch_weight_syncer_uses_receiver_key_order -> test_patch_uses_the_receivers_key_order
- the key-mismatch case at the end of the key-order test (a state dict missing a key)
  -> test_rlinf_keys::test_a_missing_or_extra_key_is_an_error_naming_it
- test_bucket_weight_syncer_roundtrip_load_instant_true / _false -> test_one_bucket_object_syncs_and_applies
- test_bucket_weight_syncer_preserves_original_dtypes_when_bucket_dtype_none
  -> test_bucket_dtype_none_keeps_every_dtype_and_init_sender_may_run_twice
- test_iter_named_tensor_buckets_supports_custom_dtype_resolver -> no counterpart: ``iter_named_tensor_buckets``
  and its per-key dtype resolver are RLinf internals; rlsync's interface has ``bucket_dtype`` only (tested next)
- test_bucket_weight_syncer_preserves_nonfloating_dtypes_when_bucket_dtype_set
  -> test_bucket_dtype_casts_floating_tensors_only_without_a_handshake (and test_syncer_roundtrip::
  test_bucket_dtype_casts_floating_tensors_only with one)
- test_bucket_weight_syncer_loads_across_model_and_bucket_devices -> needs a GPU: CUDA models and buckets
- test_bucket_weight_syncer_rejects_metadata_key_collision -> test_keys_named_like_rlinfs_metadata_are_ordinary:
  a difference: rlsync's version and bucket count travel in its headers, so ``total_buckets`` and
  ``syncer_version`` are ordinary keys that sync (RLinf refuses them)
- test_bucket_weight_syncer_metadata_dtypes_are_nccl_safe -> test_tensor_payloads_are_uint8 (rlsync's payload is
  one uint8 tensor with ``payload_type="tensor"``: NCCL carries it)
- test_bucket_weight_syncer_skips_frozen_params_but_syncs_persistent_buffers
  -> test_bucket_skips_frozen_parameters_and_syncs_persistent_buffers
- test_weight_syncer_factory_builds_patch_and_bucket -> test_rlinf_interface::
  test_create_reads_rlinfs_config_from_omegaconf and test_rlinf_interface::test_create_takes_rlinfs_key_aliases
- test_weight_syncer_factory_builds_shared_comm_options
  -> test_rlinf_interface::test_comm_options_come_from_the_top_level_keys
- test_weight_syncer_factory_rejects_unknown_type -> test_unknown_type_is_refused (and the last case of
  test_rlinf_interface::test_create_reads_rlinfs_config_from_omegaconf)

Beyond RLinf's tests, the bucket syncer without a handshake is held to rlsync's rules here: corrupt, truncated,
replayed and stale versions are rejected whole, a key the receiver lacks or another shape is an error naming it
before anything is written, and a handshake end paired with one without is a clear error, not a hang.
"""

from __future__ import annotations

import asyncio
import copy
from collections import OrderedDict
from typing import Any

import pytest
import torch

import rlsync
from conftest import Link


class Tiny(torch.nn.Module):
    """RLinf's small test model: a linear layer, a 3-D parameter and two float buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)
        self.tensor3d = torch.nn.Parameter(torch.arange(24, dtype=torch.float32).view(2, 3, 4).clone())
        self.register_buffer("scalar_buf", torch.tensor(1.5))
        self.register_buffer("vector_buf", torch.tensor([2.0, 4.0, 8.0]))


class Dtypes(torch.nn.Module):
    """fp32 and bf16 parameters, an int64 buffer past 2^40 and a bool buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.fp32_param = torch.nn.Parameter(torch.arange(6, dtype=torch.float32).view(2, 3).clone() + 0.1)
        self.bf16_param = torch.nn.Parameter(torch.arange(6, dtype=torch.bfloat16).view(2, 3).clone())
        self.register_buffer("int64_buf", torch.tensor([2**40 + 123, -(2**39 + 17)], dtype=torch.int64))
        self.register_buffer("bool_buf", torch.tensor([True, False, True]))


class Queue:
    """RLinf's in-memory transport: ``send`` appends, ``recv`` pops the oldest (empty: an error, not a wait)."""

    def __init__(self) -> None:
        self.items: list[Any] = []

    async def send(self, data: Any) -> None:
        self.items.append(data)

    async def recv(self) -> Any:
        assert self.items, "the transport queue is empty"
        return self.items.pop(0)


async def unused_send(_: Any) -> None:
    raise AssertionError("init_sender without a handshake sends nothing")


def snapshot(model: torch.nn.Module) -> "OrderedDict[str, torch.Tensor]":
    return OrderedDict((k, v.detach().clone()) for k, v in model.state_dict().items())


def assert_equal(a: "OrderedDict[str, torch.Tensor]", b: "OrderedDict[str, torch.Tensor]") -> None:
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


# -- bucket -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("load_instant", [True, False])
def test_one_bucket_object_syncs_and_applies(load_instant: bool) -> None:
    sender = Tiny()
    receiver = copy.deepcopy(sender)
    q = Queue()
    syncer = rlsync.BucketWeightSyncer(bucket_size=32, bucket_dtype=torch.float32, load_instant=load_instant)
    with torch.no_grad():
        sender.linear.weight[0, 1] = 42.0
        sender.tensor3d[1, 0, 0] = -17.0
        sender.scalar_buf.mul_(2.0)

    async def main() -> int:
        await syncer.init_sender(sender.state_dict(), rlsync.param_names_need_sync(sender), unused_send)
        assert syncer.sender_initialized() and not syncer.receiver_initialized()
        await syncer.sync(sender.state_dict(), q.send, version=5)
        assert len(q.items) > 2, "a manifest and several buckets (bucket_size 32)"
        applied = await syncer.apply(receiver, q.recv)
        assert syncer.receiver_initialized() and not q.items
        # Again on the same object, explicitly initialised as a receiver this time (a second object beside it).
        other = rlsync.BucketWeightSyncer(bucket_size=32, bucket_dtype=torch.float32, load_instant=load_instant)
        await other.init_sender(sender.state_dict(), rlsync.param_names_need_sync(sender), unused_send)
        await other.init_receiver(receiver.state_dict(), q.recv)
        with torch.no_grad():
            sender.vector_buf[2] = 256.0
        await other.sync(sender.state_dict(), q.send, version=9)
        assert await other.apply(receiver, q.recv) == 9
        return applied

    assert asyncio.run(main()) == 5
    assert_equal(snapshot(sender), snapshot(receiver))


def test_bucket_dtype_none_keeps_every_dtype_and_init_sender_may_run_twice() -> None:
    sender = Dtypes()
    receiver = copy.deepcopy(sender)
    q = Queue()
    syncer = rlsync.BucketWeightSyncer(bucket_size=32, bucket_dtype=None, load_instant=False)
    with torch.no_grad():
        sender.fp32_param[0, 0] = 123.25
        sender.bf16_param[1, 2] += 3.0
        sender.int64_buf[0] = 2**42 + 999
        sender.bool_buf.logical_not_()

    async def main() -> int:
        names = rlsync.param_names_need_sync(sender)
        await syncer.init_sender(sender.state_dict(), names, unused_send)
        await syncer.sync(sender.state_dict(), q.send, version=10)
        await syncer.init_sender(sender.state_dict(), names, unused_send)  # RLinf's test initialises twice
        await syncer.sync(sender.state_dict(), q.send, version=11)
        assert await syncer.apply(receiver, q.recv) == 10
        return await syncer.apply(receiver, q.recv)  # the second sender's sequence follows the first's

    assert asyncio.run(main()) == 11
    assert_equal(snapshot(sender), snapshot(receiver))


def test_bucket_dtype_casts_floating_tensors_only_without_a_handshake() -> None:
    sender = Dtypes()
    receiver = copy.deepcopy(sender)
    q = Queue()
    syncer = rlsync.BucketWeightSyncer(bucket_size=32, bucket_dtype=torch.bfloat16)
    with torch.no_grad():
        sender.fp32_param[1, 1] = 1.0 + 2**-12  # not a bf16 value: arrives rounded
        sender.int64_buf[1] = -(2**41 + 7)  # not a float: every bit arrives

    async def main() -> None:
        await syncer.init_sender(sender.state_dict(), rlsync.param_names_need_sync(sender), unused_send)
        await syncer.sync(sender.state_dict(), q.send, version=12)
        assert await syncer.apply(receiver, q.recv) == 12

    asyncio.run(main())
    assert receiver.fp32_param.dtype == torch.float32
    assert torch.equal(receiver.fp32_param, sender.fp32_param.to(torch.bfloat16).to(torch.float32))
    assert receiver.fp32_param[1, 1].item() == 1.0
    for k in ("bf16_param", "int64_buf", "bool_buf"):
        assert torch.equal(getattr(receiver, k), getattr(sender, k)), k


def test_bucket_skips_frozen_parameters_and_syncs_persistent_buffers() -> None:
    sender = Tiny()
    receiver = copy.deepcopy(sender)
    q = Queue()
    syncer = rlsync.BucketWeightSyncer(bucket_size=32, bucket_dtype=torch.float32)
    sender.linear.weight.requires_grad_(False)

    async def main() -> None:
        await syncer.init_sender(sender.state_dict(), rlsync.param_names_need_sync(sender), unused_send)
        with torch.no_grad():
            sender.linear.weight.fill_(77.0)
            sender.linear.bias.add_(5.0)
            sender.scalar_buf.mul_(3.0)
        await syncer.sync(sender.state_dict(), q.send, version=15)
        assert await syncer.apply(receiver, q.recv) == 15

    asyncio.run(main())
    assert not torch.equal(sender.linear.weight, receiver.linear.weight), "a frozen parameter is not synced"
    assert torch.equal(sender.linear.bias, receiver.linear.bias)
    assert torch.equal(sender.scalar_buf, receiver.scalar_buf)


def test_keys_named_like_rlinfs_metadata_are_ordinary() -> None:
    sd = {"w": torch.randn(3), "total_buckets": torch.tensor(4), "syncer_version": torch.tensor(2)}
    rx_sd = {k: torch.zeros_like(v) for k, v in sd.items()}
    q = Queue()

    async def main() -> None:
        s = rlsync.BucketWeightSyncer(bucket_size=8)
        await s.init_sender(sd, list(sd), unused_send)
        await s.sync(sd, q.send, version=1)
        assert await s.apply(rx_sd, q.recv) == 1

    asyncio.run(main())
    for k in sd:
        assert torch.equal(rx_sd[k], sd[k]), k


def test_tensor_payloads_are_uint8() -> None:
    model = Tiny()
    q = Queue()

    async def main() -> None:
        s = rlsync.BucketWeightSyncer(bucket_size=32, bucket_dtype=torch.bfloat16, payload_type="tensor")
        await s.init_sender(model.state_dict(), rlsync.param_names_need_sync(model), unused_send)
        await s.sync(model.state_dict(), q.send, version=13)
        assert q.items and all(isinstance(p, torch.Tensor) and p.dtype == torch.uint8 for p in q.items)

    asyncio.run(main())


def tiny_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a.weight": torch.randn(8, 16, generator=g),
        "a.bias": torch.randn(16, generator=g).to(torch.bfloat16),
        "steps": torch.tensor(seed, dtype=torch.int64),
        "mask": torch.rand(5, generator=g) > 0.5,
    }


@pytest.mark.parametrize("load_instant", [True, False])
def test_without_a_handshake_bad_versions_are_rejected_whole(load_instant: bool) -> None:
    tx_sd = tiny_state(1)
    rx_sd = {k: v.clone() for k, v in tiny_state(2).items()}
    rx_sd["rollout_only"] = torch.full((2,), 7.0)  # never sent: stays as it is (strict=False)

    async def main() -> None:
        link = Link()
        tx = rlsync.BucketWeightSyncer(bucket_size=64, load_instant=load_instant)
        rx = rlsync.BucketWeightSyncer(bucket_size=64, load_instant=load_instant)
        await tx.init_sender(tx_sd, list(tx_sd), link.send)
        await rx.init_receiver(rx_sd, link.recv)
        await tx.sync(tx_sd, link.send, 0)
        assert await rx.apply(rx_sd, link.recv) == 0
        old = list(link.taps)
        tx_sd["a.weight"] += 1.0
        link.taps.clear()
        await tx.sync(tx_sd, link.send, 1)
        good = list(link.taps)
        while not link.to_rx.empty():
            link.to_rx.get_nowait()
        before = {k: v.clone() for k, v in rx_sd.items()}

        async def expect_rejected(msgs: list[bytes], what: str) -> None:
            for m in msgs:
                await link.to_rx.put(m)
            with pytest.raises(rlsync.PayloadRejected):
                await rx.apply(rx_sd, link.recv)
            assert rx.version == 0, what
            for k, v in before.items():
                assert torch.equal(rx_sd[k], v), f"{what}: {k} changed"

        corrupt = bytearray(good[-1])
        corrupt[-1] ^= 1
        await expect_rejected(good[:-1] + [bytes(corrupt)], "corrupt last bucket")
        await expect_rejected(old, "replayed older version")
        while not link.to_rx.empty():  # what the rejections left unread
            link.to_rx.get_nowait()
        for m in good:
            await link.to_rx.put(m)
        assert await rx.apply(rx_sd, link.recv) == 1
        for k in tx_sd:
            assert torch.equal(rx_sd[k], tx_sd[k]), k
        assert torch.equal(rx_sd["rollout_only"], torch.full((2,), 7.0))
        applied = {k: v.clone() for k, v in rx_sd.items()}
        for m in good:  # the applied version again: a replay
            await link.to_rx.put(m)
        with pytest.raises(rlsync.PayloadRejected, match="replayed or stale"):
            await rx.apply(rx_sd, link.recv)
        for k, v in applied.items():
            assert torch.equal(rx_sd[k], v), k

    asyncio.run(main())


@pytest.mark.parametrize("change, key", [("drop", "a.bias"), ("reshape", "a.weight")])
def test_without_a_handshake_a_key_the_receiver_lacks_or_another_shape_is_named(change: str, key: str) -> None:
    tx_sd = tiny_state(3)
    rx_sd = {k: v.clone() for k, v in tiny_state(4).items()}
    if change == "drop":
        del rx_sd[key]
    else:
        rx_sd[key] = torch.zeros(16, 8)
    before = {k: v.clone() for k, v in rx_sd.items()}

    async def main() -> None:
        q = Queue()
        tx = rlsync.BucketWeightSyncer(bucket_size=64)
        rx = rlsync.BucketWeightSyncer(bucket_size=64)
        await tx.init_sender(tx_sd, list(tx_sd), unused_send)
        await rx.init_receiver(rx_sd, q.recv)
        await tx.sync(tx_sd, q.send, 3)
        with pytest.raises(rlsync.PayloadRejected, match=f"'{key}'"):
            await rx.apply(rx_sd, q.recv)
        assert rx.version == 0

    asyncio.run(main())
    for k, v in before.items():
        assert torch.equal(rx_sd[k], v), k


def test_a_handshake_receiver_paired_with_a_sender_without_one_is_told() -> None:
    sd = tiny_state(5)

    async def main() -> None:
        link = Link()
        tx = rlsync.BucketWeightSyncer()
        rx = rlsync.BucketWeightSyncer()
        await tx.init_sender(sd, list(sd), link.send)
        await tx.sync(sd, link.send, 0)
        with pytest.raises(rlsync.HandshakeError, match="without a handshake"):
            await rx.init_receiver({k: v.clone() for k, v in sd.items()}, link.recv, link.up_send)

    asyncio.run(main())


def test_patch_still_needs_its_handshake() -> None:
    sd = tiny_state(6)

    async def main() -> None:
        with pytest.raises(ValueError, match="needs a recv function"):
            await rlsync.PatchWeightSyncer().init_sender(sd, list(sd), unused_send)
        with pytest.raises(ValueError, match="needs a send function"):
            await rlsync.PatchWeightSyncer().init_receiver(sd, Queue().recv)

    asyncio.run(main())


def test_unknown_type_is_refused() -> None:
    with pytest.raises(ValueError, match="Unsupported weight syncer type"):
        rlsync.WeightSyncer.create({"type": "unknown"})


# -- patch on the CPU -------------------------------------------------------------------------------------


async def patch_pair(tx_sd: Any, rx_sd: Any, names: list[str], **kw: Any) -> tuple[Any, Any, Link]:
    link = Link()
    tx, rx = rlsync.PatchWeightSyncer(**kw), rlsync.PatchWeightSyncer(**kw)
    await asyncio.gather(
        tx.init_sender(tx_sd, names, link.send, link.up_recv),
        rx.init_receiver(rx_sd, link.recv, link.up_send),
    )
    return tx, rx, link


@pytest.mark.parametrize("delta", [True, False])
def test_patch_round_trip_on_the_cpu(delta: bool) -> None:
    sender = Dtypes()
    sender.tiny = Tiny()
    receiver = copy.deepcopy(sender)

    async def main() -> int:
        names = rlsync.param_names_need_sync(sender)
        tx, rx, link = await patch_pair(sender.state_dict(), receiver.state_dict(), names, delta_encoding=delta)
        with torch.no_grad():
            sender.tiny.linear.weight[0, 0] += 3.0
            sender.tiny.tensor3d[1, 2, 3] = -99.0
            sender.tiny.scalar_buf.add_(4.0)
            sender.int64_buf[1] += 5
            sender.bool_buf[1] = True
        await tx.sync(sender.state_dict(), link.send, version=11)
        return await rx.apply(receiver, link.recv)

    assert asyncio.run(main()) == 11
    assert_equal(snapshot(sender), snapshot(receiver))


def test_patch_round_trips_tensors_of_every_rank() -> None:
    tx_sd = {
        "scalar": torch.tensor(3.0),
        "vector": torch.arange(5, dtype=torch.float32),
        "matrix": torch.arange(6, dtype=torch.float32).view(2, 3),
        "tensor3d": torch.arange(24, dtype=torch.float32).view(2, 3, 4),
    }
    rx_sd = {k: v.clone() for k, v in tx_sd.items()}

    async def main() -> None:
        tx, rx, link = await patch_pair(tx_sd, rx_sd, list(tx_sd))
        for step in range(3):
            for t in tx_sd.values():
                t.view(-1)[step % t.numel()] += 1.5
            await tx.sync(tx_sd, link.send, step)
            assert await rx.apply(rx_sd, link.recv) == step
            for k in tx_sd:
                assert torch.equal(rx_sd[k], tx_sd[k]), k
        bad = dict(tx_sd, tensor3d=tx_sd["tensor3d"].transpose(1, 2))
        with pytest.raises(ValueError, match="tensor3d"):
            await tx.sync(bad, link.send, 9)

    asyncio.run(main())


def test_patch_indices_of_every_width_round_trip() -> None:
    n = 70_000  # indices past 2^16: the widest index this test can afford
    tx_sd = {"w": torch.zeros(n)}
    rx_sd = {"w": torch.zeros(n)}

    async def main() -> None:
        tx, rx, link = await patch_pair(tx_sd, rx_sd, ["w"], delta_encoding=False)
        for step, idx in enumerate([[0, 7, 255], [0, 256, 1024], [0, 65_535, 65_536, n - 1]]):
            tx_sd["w"][idx] += step + 1.0
            await tx.sync(tx_sd, link.send, step)
            assert await rx.apply(rx_sd, link.recv) == step
            assert torch.equal(rx_sd["w"], tx_sd["w"])

    asyncio.run(main())


def test_patch_uses_the_receivers_key_order() -> None:
    sender = Tiny()
    tx_sd = sender.state_dict()
    rx_sd = OrderedDict((k, v.detach().clone()) for k, v in reversed(list(tx_sd.items())))

    async def main() -> None:
        tx, rx, link = await patch_pair(tx_sd, rx_sd, rlsync.param_names_need_sync(sender))
        with torch.no_grad():
            sender.linear.bias[0] = 9.0
            sender.vector_buf[1] = -1.0
        await tx.sync(sender.state_dict(), link.send, 4)
        assert await rx.apply(rx_sd, link.recv) == 4

    asyncio.run(main())
    for k, v in sender.state_dict().items():
        assert torch.equal(rx_sd[k], v), k


class ValueHead(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = torch.nn.Linear(4, 4)
        self.value_head = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))


@pytest.mark.parametrize("prefixes", [["value_head"], None])
def test_patch_init_sync_bootstraps_prefixes_or_everything(prefixes: list[str] | None) -> None:
    torch.manual_seed(0)
    sender, receiver = ValueHead(), ValueHead()
    backbone_before = {k: v.clone() for k, v in receiver.backbone.state_dict().items()}

    async def main() -> None:
        await patch_pair(
            sender.state_dict(), receiver.state_dict(), rlsync.param_names_need_sync(sender),
            init_sync_enabled=True, init_sync_prefixes=prefixes, init_sync_bucket_size=64,
        )

    asyncio.run(main())
    for k, v in sender.value_head.state_dict().items():
        assert torch.equal(receiver.value_head.state_dict()[k], v), k
    for k, v in receiver.backbone.state_dict().items():
        want = sender.backbone.state_dict()[k] if prefixes is None else backbone_before[k]
        assert torch.equal(v, want), k
