"""Rejected payloads leave weights and version untouched; bad input gets a clear error naming what is wrong."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

import rlsync
from conftest import Link


def state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(8, 16, generator=g).to(torch.bfloat16),
        "b": torch.randn(16, generator=g),
        "n": torch.tensor(0, dtype=torch.int64),
    }


async def pair(kind: str, tx_sd: Any, rx_sd: Any) -> tuple[rlsync.WeightSyncer, rlsync.WeightSyncer, Link]:
    make = {
        "patch": lambda: rlsync.PatchWeightSyncer(init_sync_enabled=True),
        "bucket": lambda: rlsync.BucketWeightSyncer(bucket_size=1 << 20),
    }[kind]
    tx, rx, link = make(), make(), Link()
    await asyncio.gather(
        tx.init_sender(tx_sd, list(tx_sd), link.send, link.up_recv),
        rx.init_receiver(rx_sd, link.recv, link.up_send),
    )
    return tx, rx, link


def snapshot(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in sd.items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


def bump(sd: dict[str, torch.Tensor], v: int) -> None:
    with torch.no_grad():
        sd["w"][v % 8, :3] += 1
        sd["b"][v] -= 1
        sd["n"] += 1


@pytest.mark.parametrize("kind", ["patch", "bucket"])
def test_corrupt_truncated_replayed_and_stale_payloads_are_rejected(kind: str) -> None:
    tx_sd, rx_sd = state(1), state(1)

    async def main() -> None:
        tx, rx, link = await pair(kind, tx_sd, rx_sd)
        bump(tx_sd, 1)
        await tx.sync(tx_sd, link.send, 1)
        v1 = link.taps[-1]
        assert await rx.apply(rx_sd, link.recv) == 1
        bump(tx_sd, 2)
        await tx.sync(tx_sd, link.send, 2)
        v2 = link.to_rx.get_nowait()  # intercept version 2
        assert link.to_rx.empty()
        before = snapshot(rx_sd)

        async def rejected(payload: bytes, match: str) -> None:
            await link.to_rx.put(payload)
            with pytest.raises(rlsync.PayloadRejected, match=match):
                await rx.apply(rx_sd, link.recv)
            assert rx.version == 1
            assert same(rx_sd, before), "a rejected payload changes nothing"

        flipped = bytearray(v2)
        flipped[len(flipped) // 2] ^= 0x5A
        await rejected(bytes(flipped), "rejected payload")
        await rejected(v2[: len(v2) - 7], "rejected payload")
        await rejected(v2[:10], "rejected payload")
        await rejected(v1, "not newer|replayed or stale")
        # The intact payload still applies afterwards: the syncer survived every rejection.
        await link.to_rx.put(v2)
        assert await rx.apply(rx_sd, link.recv) == 2
        assert same(rx_sd, {k: v.to(rx_sd[k].dtype) for k, v in tx_sd.items()})
        # Replaying the version just applied, and an older one, are rejected too.
        await rejected_after(rx, rx_sd, link, v2)

    async def rejected_after(rx: rlsync.WeightSyncer, sd: Any, link: Link, payload: bytes) -> None:
        before = snapshot(sd)
        await link.to_rx.put(payload)
        with pytest.raises(rlsync.PayloadRejected, match="not newer|replayed or stale"):
            await rx.apply(sd, link.recv)
        assert rx.version == 2 and same(sd, before)

    asyncio.run(main())


@pytest.mark.parametrize("corrupt", ["last", "middle", "first"])
def test_a_corrupt_bucket_undoes_the_buckets_of_its_version_installed_before_it(corrupt: str) -> None:
    """``load_instant`` installs each verified bucket at once, into the tensors' own memory; a corrupt bucket
    later in the same version undoes them, and the last bucket is installed only once it is verified."""
    tx_sd, rx_sd = state(1), state(1)

    async def main() -> None:
        tx, rx, link = rlsync.BucketWeightSyncer(bucket_size=64), rlsync.BucketWeightSyncer(bucket_size=64), Link()
        await asyncio.gather(
            tx.init_sender(tx_sd, list(tx_sd), link.send, link.up_recv),
            rx.init_receiver(rx_sd, link.recv, link.up_send),
        )
        bump(tx_sd, 1)
        await tx.sync(tx_sd, link.send, 1)
        assert await rx.apply(rx_sd, link.recv) == 1
        bump(tx_sd, 2)
        await tx.sync(tx_sd, link.send, 2)
        buckets = []
        while not link.to_rx.empty():
            buckets.append(link.to_rx.get_nowait())
        assert len(buckets) == 3, "one bucket per tensor at this bucket size"
        before = snapshot(rx_sd)
        bad = {"last": 2, "middle": 1, "first": 0}[corrupt]
        for i, payload in enumerate(buckets[: bad + 1]):
            if i == bad:
                flipped = bytearray(payload)
                flipped[-1] ^= 0x5A
                payload = bytes(flipped)
            await link.to_rx.put(payload)
        with pytest.raises(rlsync.PayloadRejected):
            await rx.apply(rx_sd, link.recv)
        assert rx.version == 1
        assert same(rx_sd, before), "a rejected version changes nothing, not even its verified buckets"
        for payload in buckets:
            await link.to_rx.put(payload)
        assert await rx.apply(rx_sd, link.recv) == 2
        assert same(rx_sd, tx_sd)

    asyncio.run(main())


def test_patch_for_another_base_version_is_rejected() -> None:
    """A receiver that missed version 1 cannot apply version 2's patch (built on sync #1): rejected, untouched."""
    tx_sd, rx_sd = state(3), state(3)

    async def main() -> None:
        tx, rx, link = await pair("patch", tx_sd, rx_sd)
        bump(tx_sd, 1)
        await tx.sync(tx_sd, link.send, 1)
        link.to_rx.get_nowait()  # lost on the way
        bump(tx_sd, 2)
        await tx.sync(tx_sd, link.send, 2)
        before = snapshot(rx_sd)
        with pytest.raises(rlsync.PayloadRejected, match="based on sync #1"):
            await rx.apply(rx_sd, link.recv)
        assert rx.version == 0 and same(rx_sd, before)

    asyncio.run(main())


def test_the_sender_takes_any_version_as_rlinf_does() -> None:
    sd, rsd = state(4), state(4)

    async def main() -> None:
        tx, rx, link = await pair("patch", sd, rsd)
        # The same version again (an evaluation's sync) and a lower one are sent; the receiver applies both.
        for v in [3, 3, torch.tensor(4), 2]:  # RLinf passes tensors too
            await tx.sync(sd, link.send, v)
            assert await rx.apply(rsd, link.recv) == int(v)

    asyncio.run(main())


def test_a_failing_transport_raises_its_error_and_keeps_the_syncer() -> None:
    tx_sd, rx_sd = state(5), state(5)

    async def main() -> None:
        tx, rx, link = await pair("patch", tx_sd, rx_sd)

        async def broken_recv() -> bytes:
            raise ConnectionResetError("peer went away")

        with pytest.raises(ConnectionResetError, match="peer went away"):
            await rx.apply(rx_sd, broken_recv)
        bump(tx_sd, 1)
        await tx.sync(tx_sd, link.send, 1)
        assert await rx.apply(rx_sd, link.recv) == 1, "the syncer is usable after its transport failed"

        async def timeout_recv() -> bytes:
            await asyncio.sleep(10)
            return b""

        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(rx.apply(rx_sd, timeout_recv), 0.05)
        bump(tx_sd, 2)
        await tx.sync(tx_sd, link.send, 2)
        assert await rx.apply(rx_sd, link.recv) == 2, "and after a cancelled apply"

    asyncio.run(main())


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda sd: sd.pop("b"), "key 'b' is in the sender's state dict but not the receiver's"),
        (lambda sd: sd.update(extra=torch.zeros(2)), "key 'extra' is in the receiver's state dict but not the sender's"),
        (lambda sd: sd.update(b=torch.zeros(4, 4)), r"key 'b' has shape \[16\] on the sender and \[4, 4\] on the receiver"),
        (lambda sd: sd.update(n=torch.tensor(0.0)), "key 'n' has dtype int64 on the sender and float32 on the receiver"),
    ],
)
def test_differing_state_dicts_name_the_first_mismatch_at_init(change: Any, match: str) -> None:
    tx_sd, rx_sd = state(6), state(6)
    change(rx_sd)

    async def main() -> None:
        tx, rx, link = rlsync.PatchWeightSyncer(), rlsync.PatchWeightSyncer(), Link()
        results = await asyncio.gather(
            tx.init_sender(tx_sd, list(tx_sd), link.send, link.up_recv),
            rx.init_receiver(rx_sd, link.recv, link.up_send),
            return_exceptions=True,
        )
        assert isinstance(results[0], rlsync.HandshakeError), results
        assert isinstance(results[1], rlsync.HandshakeError), results
        for r in results:
            assert r is not None and __import__("re").search(match, str(r)), str(r)

    asyncio.run(main())


def test_a_failed_init_leaves_the_syncer_uninitialised_and_ready_for_another() -> None:
    tx_sd, rx_sd = state(10), state(10)
    other = {k: v for k, v in state(10).items() if k != "b"}

    async def main() -> None:
        tx, rx, link = rlsync.PatchWeightSyncer(), rlsync.PatchWeightSyncer(), Link()
        results = await asyncio.gather(
            tx.init_sender(tx_sd, list(tx_sd), link.send, link.up_recv),
            rx.init_receiver(other, link.recv, link.up_send),
            return_exceptions=True,
        )
        assert all(isinstance(r, rlsync.HandshakeError) for r in results), results
        assert not tx.sender_initialized() and not rx.receiver_initialized()
        assert "uninitialised" in repr(tx)
        with pytest.raises(rlsync.RlsyncError, match="not initialised as a sender"):
            await tx.sync(tx_sd, link.send, 1)
        # A handshake of matching state dicts then makes them the two ends.
        link = Link()
        await asyncio.gather(
            tx.init_sender(tx_sd, list(tx_sd), link.send, link.up_recv),
            rx.init_receiver(rx_sd, link.recv, link.up_send),
        )
        assert tx.sender_initialized() and rx.receiver_initialized()
        bump(tx_sd, 1)
        await tx.sync(tx_sd, link.send, 1)
        assert await rx.apply(rx_sd, link.recv) == 1
        assert rx.checksum(rx_sd) == tx.checksum(tx_sd)

    asyncio.run(main())


def bad_tensor_cases() -> list[tuple[str, Any, str]]:
    base = torch.zeros(4, 6)
    return [
        ("non-contiguous", {"w": base.t()}, "tensor 'w' is not contiguous"),
        ("non-cpu", {"w": torch.empty(3, device="meta")}, "tensor 'w' is on device 'meta'"),
        ("overlapping views", {"a": base, "b": base[1]}, "tensors 'a' and 'b' overlap"),
        ("unsupported dtype", {"c": torch.zeros(2, dtype=torch.complex64)}, "dtype complex64"),
        ("not a tensor", {"x": [1, 2]}, "state_dict\\['x'\\] is a list"),
        ("sparse", {"s": torch.zeros(3, 3).to_sparse()}, "layout"),
    ]


@pytest.mark.parametrize("name, sd, match", bad_tensor_cases(), ids=[c[0] for c in bad_tensor_cases()])
def test_bad_tensors_get_clear_errors(name: str, sd: Any, match: str) -> None:
    async def main() -> None:
        link = Link()
        with pytest.raises((ValueError, TypeError), match=match):
            await rlsync.PatchWeightSyncer().init_sender(sd, list(sd), link.send, link.up_recv)
        with pytest.raises((ValueError, TypeError), match=match):
            await rlsync.BucketWeightSyncer().init_receiver(sd, link.recv, link.up_send)

    asyncio.run(main())


def test_misuse_is_reported() -> None:
    sd = state(7)

    async def main() -> None:
        link = Link()
        s = rlsync.PatchWeightSyncer()
        with pytest.raises(rlsync.RlsyncError, match="not initialised as a sender"):
            await s.sync(sd, link.send, 1)
        with pytest.raises(rlsync.RlsyncError, match="not initialised as a receiver"):
            await s.apply(sd, link.recv)
        with pytest.raises(ValueError, match="needs a recv function"):
            await s.init_sender(sd, list(sd), link.send)
        with pytest.raises(ValueError, match="'nope' is not a key"):
            await s.init_sender(sd, ["nope"], link.send, link.up_recv)
        if not torch.cuda.is_available():
            with pytest.raises(ValueError, match=r"transport_device=cuda: payloads are handed to send as CUDA "
                               r"tensors there, but torch sees 0 CUDA device\(s\) here"):
                rlsync.PatchWeightSyncer(transport_device="cuda")
        with pytest.raises(ValueError, match="transport_device: unsupported device 'xla'"):
            rlsync.PatchWeightSyncer(transport_device="xla")
        rlsync.PatchWeightSyncer(snapshot_device="cuda")  # where a sender of CUDA tensors keeps its snapshot
        with pytest.raises(ValueError, match="compression_algorithm"):
            rlsync.PatchWeightSyncer(compression_algorithm="zstd")
        with pytest.raises(ValueError, match="bucket_dtype"):
            rlsync.BucketWeightSyncer(bucket_dtype=torch.int8)
        with pytest.raises(ValueError, match="bucket_size"):
            rlsync.BucketWeightSyncer(bucket_size=0)

    asyncio.run(main())


def test_a_different_state_dict_layout_after_init_is_refused() -> None:
    tx_sd, rx_sd = state(8), state(8)

    async def main() -> None:
        tx, rx, link = await pair("patch", tx_sd, rx_sd)
        with pytest.raises(ValueError, match="differs from the one given at init"):
            await tx.sync({"w": tx_sd["w"]}, link.send, 1)
        with pytest.raises(ValueError, match="differs from the one given at init"):
            await rx.apply({**rx_sd, "z": torch.zeros(1)}, link.recv)

    asyncio.run(main())


def test_an_operation_dropped_midway_gives_the_syncer_back() -> None:
    tx_sd, rx_sd = state(9), state(9)

    async def main() -> None:
        tx, rx, link = await pair("patch", tx_sd, rx_sd)
        pending = rx.apply(rx_sd, link.recv)  # a coroutine never awaited: its op is never even started
        pending.close()
        bump(tx_sd, 1)
        await tx.sync(tx_sd, link.send, 1)
        task = asyncio.ensure_future(rx.apply(rx_sd, link.recv))
        assert await task == 1

    asyncio.run(main())


def test_cuda_tensors_without_a_driver_or_backend_are_a_clear_cuda_error():
    """A CUDA tensor where no CUDA can be used raises rlsync.CudaError saying why (never a crash); where CUDA
    works, cuda_available says so. The description below is what the binding receives for a CUDA tensor."""
    ok, why = rlsync.cuda_available()
    assert isinstance(ok, bool) and why
    s = rlsync.PatchWeightSyncer()
    keep = torch.zeros(4)
    desc = [("w", keep, 4096, "float32", (4,), (1,), "cuda:0")]
    if ok:
        return  # a machine with a GPU: the GPU check script covers it (scripts/gpu_check.sh)
    with pytest.raises(rlsync.CudaError) as e:
        s._native.checksum(desc)
    assert why in str(e.value)
    assert "libcuda" in why or "built without CUDA" in why
    # The other device strings keep their own errors.
    with pytest.raises(ValueError, match="cannot read its device"):
        s._native.checksum([("w", keep, 4096, "float32", (4,), (1,), "cuda:x")])


def test_a_cuda_transport_device_hands_send_cuda_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    """RLinf's ``transport_device``: with a CUDA device the payloads reach ``send`` as uint8 tensors moved there
    (tensors whatever ``payload_type`` says); the core still codes them on the host. Without a GPU the move is
    exercised with the CPU as the target, and the CUDA device is accepted where torch reports one."""
    from rlsync import syncer as rs

    got: list = []

    async def send(p: object) -> None:
        got.append(p)

    asyncio.run(rs._tensor_send(send, torch.device("cpu"))(b"\x01\x02\x03"))
    assert isinstance(got[0], torch.Tensor) and got[0].dtype == torch.uint8 and got[0].tolist() == [1, 2, 3]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    s = rlsync.PatchWeightSyncer(transport_device="cuda:1")
    assert s.transport_device == torch.device("cuda:1")
    assert s.payload_type == "tensor", "payloads on a CUDA transport device are tensors"
    with pytest.raises(ValueError, match=r"transport_device=cuda:2: .* torch sees 2 CUDA device\(s\)"):
        rlsync.PatchWeightSyncer(transport_device="cuda:2")
    assert rlsync.PatchWeightSyncer(transport_device="cpu").payload_type == "bytes"
