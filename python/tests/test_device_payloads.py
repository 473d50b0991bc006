"""Device payloads (``PatchWeightSyncer(transport_device="cuda")`` over CUDA state dicts) on a machine without a
GPU: the routing around them, and the whole Python side end to end with the sending end on the kernels'
reference (``DevicePayloadSender.reference``) and receivers on the CPU. The CUDA kernels' and devices' own work is
tested in the core on the reference kernels and on a GPU by ``scripts/gpu_check.sh``."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import rlsync
from rlsync import _native
from rlsync import syncer as rs
from test_api_timeouts import make, state


async def start(ln, tx_sd: dict, rx_sd: dict, sender: rlsync.WeightSyncer | None = None) -> tuple:
    """A patch sender (by default ``transport_device="cuda"``, asking for device payloads) and a patch receiver
    over ``ln``, initialised over every key of ``tx_sd``."""
    s = sender or rlsync.PatchWeightSyncer(transport_device="cuda", init_sync_enabled=True)
    r = make("patch")
    await asyncio.gather(
        s.init_sender(tx_sd, list(tx_sd), ln.send, ln.up_recv), r.init_receiver(rx_sd, ln.recv, ln.up_send)
    )
    return s, r


def test_device_payloads_are_told_apart_by_their_first_bytes() -> None:
    assert rs._is_device_payload(b"RLDP\x01\x00")
    assert rs._is_device_payload(torch.tensor(list(b"RLDPxyz"), dtype=torch.uint8))
    assert not rs._is_device_payload(b"RLSW\x01\x00"), "host-coded payloads start with RLSW"
    assert not rs._is_device_payload(b"RL")
    assert not rs._is_device_payload(torch.zeros(8, dtype=torch.float32))
    assert not rs._is_device_payload(object())


def test_a_corrupt_device_payload_at_a_cpu_receiver_is_rejected_and_the_receiver_goes_on(link) -> None:
    """A receiver on the CPU takes device payloads (installed by the kernels' reference): one that is not valid is
    ``PayloadRejected`` with the weights and version untouched, and the next (host-coded) payload installs as
    usual."""

    async def main() -> None:
        ln = link()
        tx_sd, rx_sd = state(1), state(2)
        s, r = await start(ln, tx_sd, rx_sd, make("patch"))
        before = {k: v.clone() for k, v in rx_sd.items()}
        await ln.send(b"RLDP" + bytes(200))
        with pytest.raises(rlsync.PayloadRejected, match="device payload rejected"):
            await r.apply(rx_sd, ln.recv, timeout=5)
        assert all(torch.equal(before[k], rx_sd[k]) for k in rx_sd)
        assert r.version == 0 and r.staged_version is None
        await ln.send(torch.tensor(list(b"RLDP" + bytes(100)), dtype=torch.uint8))
        with pytest.raises(rlsync.PayloadRejected):
            await r.stage(ln.recv, timeout=5)
        assert r.staged_version is None
        with torch.no_grad():
            tx_sd["w"][3] += 1.0
        await s.sync(tx_sd, ln.send, 4)
        assert await r.apply(rx_sd, ln.recv, timeout=5) == 4
        assert r.version == 4, "the host end installed the latest version"
        assert r.last_report()["device"] == "cpu"
        assert r.checksum(rx_sd) == s.checksum(tx_sd)

    asyncio.run(main())


def _observe_moves(monkeypatch: pytest.MonkeyPatch) -> list:
    """Host-coded payloads' move to the GPU, observed instead of done (this machine has none): the devices asked
    for, in order."""
    moved: list = []

    def tensor_send(send, device=None):
        async def wrapped(p):
            moved.append(device)
            await send(bytes(p))

        return wrapped

    monkeypatch.setattr(rs, "_tensor_send", tensor_send)
    return moved


def test_a_cpu_state_keeps_host_coded_payloads_under_a_cuda_transport(link, monkeypatch: pytest.MonkeyPatch) -> None:
    """``transport_device="cuda"`` asks for device payloads, which need the synced tensors on a GPU: a CPU state
    dict keeps the host-coded payloads (moved to the transport device as before; here the move is observed)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    moved = _observe_moves(monkeypatch)

    async def main() -> None:
        ln = link()
        tx_sd, rx_sd = state(1), state(2)
        s, r = await start(ln, tx_sd, rx_sd)
        assert s._wants_device_payloads()
        assert s._dev_tx is None, "a CPU state dict keeps host-coded payloads"
        with torch.no_grad():
            tx_sd["w"][1] -= 2.0
        await s.sync(tx_sd, ln.send, 1)
        assert await r.apply(rx_sd, ln.recv, timeout=5) == 1
        assert moved and all(d == torch.device("cuda") for d in moved)
        assert r.checksum(rx_sd) == s.checksum(tx_sd)

    asyncio.run(main())
    lz4 = rlsync.PatchWeightSyncer(transport_device="cuda", compression_algorithm="lz4")
    assert not lz4._wants_device_payloads(), "compression codes on the host"


def test_the_device_ends_need_cuda() -> None:
    """Without a usable driver (this machine) the device payload ends are an ``rlsync.CudaError``, never a crash."""
    t = torch.zeros(4)
    desc = ("w", t, t.data_ptr(), "float32", (4,), (1,), "cuda:0")
    with pytest.raises(rlsync.CudaError):
        _native.DevicePayloadReceiver([desc], 0, 0)
    with pytest.raises(rlsync.CudaError):
        _native.DevicePayloadSender([desc], ["float32"], 0, 0, 0)


def test_a_receiver_has_one_share_per_device_of_its_tensors() -> None:
    """A device payloads' receiver takes one copy of each payload per device its tensors live on: a CPU state dict
    is one share on the CPU; a state dict that also holds CUDA tensors opens their GPU (here: no driver, a clean
    ``CudaError``); the per-share arguments are checked against the shares."""
    w, b = torch.zeros(6, dtype=torch.bfloat16), torch.zeros(3)
    cpu = [("w", w, w.data_ptr(), "bfloat16", (6,), (1,), "cpu"), ("b", b, b.data_ptr(), "float32", (3,), (1,), "cpu")]
    rx = _native.DevicePayloadReceiver(cpu, 0, 0)
    assert rx.devices == ["cpu"]
    assert rx.version == 0 and rx.sequence == 0 and rx.staged_version is None and rx.last_report() == {}
    payload = torch.zeros(64, dtype=torch.int64)
    with pytest.raises(ValueError, match="2 payloads for a receiver on 1 devices"):
        rx.stage([(payload.data_ptr(), 512)] * 2, cpu, [0])
    with pytest.raises(ValueError, match="2 streams"):
        rx.stage([(payload.data_ptr(), 512)], cpu, [0, 0])
    with pytest.raises(rlsync.PayloadRejected, match="device payload rejected"):
        rx.stage([(payload.data_ptr(), 512)], cpu, [0])
    assert rx.abort() is None and rx.version == 0
    other = [cpu[1], cpu[0]]
    with pytest.raises(rlsync.HandshakeError, match="not those the receiver was made for"):
        rx.stage([(payload.data_ptr(), 512)], other, [0])
    mixed = [cpu[0][:6] + ("cuda:0",), cpu[1]]
    with pytest.raises(rlsync.CudaError):
        _native.DevicePayloadReceiver(mixed, 0, 0)
    with pytest.raises(ValueError, match="device payloads install into CUDA or CPU tensors"):
        _native.DevicePayloadReceiver([cpu[0][:6] + ("meta",)], 0, 0)
    assert rs._device_kinds(["cuda:0", "cpu"]) == "cuda+cpu"
    assert rs._device_kinds(["cuda:1", "cuda:0"]) == "cuda" and rs._device_kinds(["cpu"]) == "cpu"


@pytest.mark.parametrize("failure", ["no driver", "ValueError", "HandshakeError"])
def test_device_payloads_that_cannot_start_leave_host_coded_payloads(
    link, monkeypatch: pytest.MonkeyPatch, failure: str
) -> None:
    """Init is done when device payloads would start: if they cannot (no CUDA driver behind what looks like a CUDA
    state dict, or the sender's constructor refusing the tensors), a warning says so and the payloads stay
    host-coded, so the receivers still get them."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)

    class Stream:
        cuda_stream = 0

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    real = rs._synced

    def as_if_on_a_gpu(state_dict, keys):  # the descriptions a CUDA state dict would give
        return [d[:6] + ("cuda:0",) for d in real(state_dict, keys)]

    monkeypatch.setattr(rs, "_synced", as_if_on_a_gpu)
    if failure != "no driver":
        refusal = ValueError("a tensor it cannot take") if failure == "ValueError" else _native.HandshakeError("no")

        def refuse(*args: Any, **kwargs: Any) -> Any:
            raise refusal

        monkeypatch.setattr(rs, "_device_payload_sender", refuse)

    _observe_moves(monkeypatch)

    async def main() -> None:
        ln = link()
        tx_sd, rx_sd = state(1), state(2)
        with pytest.warns(RuntimeWarning, match="device payloads could not start"):
            s, r = await start(ln, tx_sd, rx_sd)
        assert s._dev_tx is None and s._native.end == "sender"
        with torch.no_grad():
            tx_sd["b"] += 0.5
        await s.sync(tx_sd, ln.send, 2)
        assert await r.apply(rx_sd, ln.recv, timeout=5) == 2
        assert r.checksum(rx_sd) == s.checksum(tx_sd)

    asyncio.run(main())


def _gpu_check() -> Any:
    """python/bench/gpu_check.py as a module (its corruption spots are checked here against real payloads)."""
    path = Path(__file__).resolve().parents[1] / "bench" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("rlsync_gpu_check", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _on_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """Device payloads on this machine (no GPU): a CPU state dict is taken for a GPU's, and the sending end is the
    kernels' reference (``DevicePayloadSender.reference``: the same payloads, bit for bit, as the CUDA kernels are
    specified to write), so everything the Python side does around them runs for real."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    _observe_moves(monkeypatch)  # the init's host-coded payloads
    monkeypatch.setattr(rs, "_on_one_gpu", lambda descs: True)
    monkeypatch.setattr(
        rs,
        "_device_payload_sender",
        lambda descs, held, sequence, version, stream, snapshot_device: _native.DevicePayloadSender.reference(
            descs, sequence, version
        ),
    )


def widths_state(seed: int) -> dict[str, torch.Tensor]:
    """Every element width: fp32, bf16, int64, uint8; the larger tensors span several 4096-element tiles."""
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(96, 128, generator=g),
        "h": torch.randn(9000, generator=g).to(torch.bfloat16),
        "steps": torch.arange(5, dtype=torch.int64) * seed,
        "mask": torch.randint(0, 255, (300_000,), generator=g, dtype=torch.uint8),
    }


def nudge(sd: dict[str, torch.Tensor], v: int, many: bool = False) -> None:
    """A step's changes: a few elements of each tensor (``many``: a third of ``mask``, more than its pool holds: 1/16
    of a width's elements, at least 65536)."""
    with torch.no_grad():
        sd["w"].view(-1)[v * 37 % 12288] += 0.5
        sd["h"][v * 101 % 9000] -= 1.0
        sd["steps"][v % 5] += 1
        sd["mask"][(v * 13) % 300_000] ^= 1
        if many:
            sd["mask"][::3] ^= 2


def equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


def test_device_payloads_end_to_end_through_the_python_side(link, monkeypatch: pytest.MonkeyPatch) -> None:
    """RLinf's interface with device payloads, the GPU's work done by the kernels' reference: the sender switches
    after init and releases its host end, each ``sync`` hands ``send`` one uint8 tensor starting ``RLDP``, the
    receiver installs it bit for bit (patches, and a full payload where a width's pool overflows), checksums and
    versions agree; a corrupted payload is rejected with the weights untouched; stage / commit / abort; a
    ``send`` that raised makes the next payload full and the receiver catches up."""
    _on_the_reference(monkeypatch)

    async def main() -> None:
        ln = link()
        tx_sd, rx_sd = widths_state(1), widths_state(2)
        keys = list(tx_sd)
        s, r = await start(ln, tx_sd, rx_sd)
        assert equal(tx_sd, rx_sd), "the init bootstrap (host-coded) made the receiver the sender"
        assert s._dev_tx is not None, "device payloads started after the handshake"
        assert s.synced_keys == keys and s.checksum(tx_sd) == r.checksum(rx_sd)
        sent: list = []

        async def send(p) -> None:
            sent.append(p)
            await ln.send(p)

        for v in range(1, 6):
            nudge(tx_sd, v, many=v == 3)
            await s.sync(tx_sd, send, v)
            p = sent[-1]
            assert isinstance(p, torch.Tensor) and p.dtype == torch.uint8 and p.dim() == 1
            assert bytes(p[:4].tolist()) == b"RLDP"
            tx_report = s.last_report()
            assert tx_report["device"] == "cuda (device payload)" and tx_report["version"] == v
            assert tx_report["full"] == (v == 3), tx_report
            assert await r.apply(rx_sd, ln.recv, timeout=5) == v
            assert equal(tx_sd, rx_sd), f"version {v}"
            rx_report = r.last_report()
            assert rx_report["device"] == "cpu (device payload)" and rx_report["full"] == (v == 3)
            assert rx_report["sequence"] == tx_report["sequence"]
            assert s.version == r.version == v
            assert s.checksum(tx_sd) == r.checksum(rx_sd)
        assert tx_report["changed"] < 10, "a patch carries the changed elements only"

        # Corrupted in transit, at each byte gpu_check's corruption run flips (the header, each width's directory,
        # index and value): each rejected with nothing written; then the intact one installs.
        nudge(tx_sd, 6)
        await s.sync(tx_sd, send, 6)
        good = (await ln.recv()).clone()
        spots = _gpu_check()._payload_spots(bytes(good[:512].tolist()))
        assert len(spots) == 1 + 3 * 4, f"the header, then three spots per width: {spots}"
        before = {k: t.clone() for k, t in rx_sd.items()}
        for at in spots:
            bad = good.clone()
            bad[at] ^= 0x40
            await ln.send(bad)
            with pytest.raises(rlsync.PayloadRejected):
                await r.apply(rx_sd, ln.recv, timeout=5)
            assert equal(before, rx_sd) and r.version == 5, f"byte {at}"
        await ln.send(good)
        assert await r.apply(rx_sd, ln.recv, timeout=5) == 6
        assert equal(tx_sd, rx_sd)

        # Stage, then commit; stage, then abort (weights untouched).
        nudge(tx_sd, 7)
        await s.sync(tx_sd, send, 7)
        assert await r.stage(ln.recv, timeout=5) == 7 and r.staged_version == 7
        assert not equal(tx_sd, rx_sd), "staged, not installed"
        assert await r.commit() == 7 and r.staged_version is None and equal(tx_sd, rx_sd)
        nudge(tx_sd, 8)
        await s.sync(tx_sd, send, 8)
        before = {k: t.clone() for k, t in rx_sd.items()}
        assert await r.stage(ln.recv, timeout=5) == 8
        await r.abort("the rollout keeps version 7")
        assert r.staged_version is None and r.version == 7 and equal(before, rx_sd)

        # The aborted payload counts as lost for this receiver: a send that raised makes the next one full.
        async def lose(p) -> None:
            raise ConnectionError("lost in transit")

        nudge(tx_sd, 9)
        with pytest.raises(ConnectionError):
            await s.sync(tx_sd, lose, 9)
        nudge(tx_sd, 10)
        await s.sync(tx_sd, send, 10)
        assert s.last_report()["full"], "after a lost payload the next one is full"
        assert await r.apply(rx_sd, ln.recv, timeout=5) == 10
        assert equal(tx_sd, rx_sd) and s.checksum(tx_sd) == r.checksum(rx_sd)

    asyncio.run(main())


def test_a_replayed_device_payload_is_rejected(link, monkeypatch: pytest.MonkeyPatch) -> None:
    """A patch applies to the sequence the receiver holds: the same payload again is refused, weights untouched."""
    _on_the_reference(monkeypatch)

    async def main() -> None:
        ln = link()
        tx_sd, rx_sd = widths_state(3), widths_state(4)
        s, r = await start(ln, tx_sd, rx_sd)
        nudge(tx_sd, 1)
        await s.sync(tx_sd, ln.send, 1)
        payload = await ln.recv()
        await ln.send(payload)
        assert await r.apply(rx_sd, ln.recv, timeout=5) == 1
        before = {k: t.clone() for k, t in rx_sd.items()}
        await ln.send(payload)
        with pytest.raises(rlsync.PayloadRejected, match="a replay, or a payload was missed"):
            await r.apply(rx_sd, ln.recv, timeout=5)
        assert equal(before, rx_sd) and r.version == 1

    asyncio.run(main())


def test_gpu_checks_device_payload_runs_work_on_the_reference(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """gpu_check's GPU-only device payload runs (the correctness stage's transport runs, timing_7b's
    ``rlsync_patch_device_payload``), their Python checked here on the kernels' reference before a GPU session
    depends on them. On the CPU the device labels and the payloads' device are the CPU's: those are the only
    failures the transport runs may report; everything they verify (bitwise equality, checksums, every corrupted
    payload rejected, a lost payload's full resync) must hold."""
    _on_the_reference(monkeypatch)
    monkeypatch.setattr(rlsync.PatchWeightSyncer, "_wants_device_payloads", lambda self: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    gc = _gpu_check()
    ctx = gc.Ctx(cpu=True, dev=torch.device("cpu"), out=tmp_path / "check.json", deadline=time.monotonic() + 300,
                 results={"stages": {}}, bin=Path("rlsync"))
    g = torch.Generator().manual_seed(5)
    params = {f"layers.{i}.w": torch.randn(300, 70, generator=g).to(torch.bfloat16) for i in range(4)}
    params["norm"] = torch.randn(70, generator=g).to(torch.bfloat16)
    expected = ("not device payloads: cuda (device payload) -> cpu (device payload)", "send was handed")
    for mixed in (False, True):
        res = gc._transport_cuda_run(ctx, rlsync, params, "cuda", mixed=mixed)
        assert res["corrupted_rejected"] == "4/4", res  # the header, then bf16's directory, index and value
        assert res["after_loss_full"] is True, res
        assert res["failures"] and all(f.startswith(expected) for f in res["failures"]), res["failures"]
    tx_state = {k: v.clone() for k, v in params.items()}
    rx_state = {k: v.clone() for k, v in params.items()}
    out = gc._rlsync_7b(ctx, rlsync, tx_state, rx_state, "cuda", 0.04, torch.Generator().manual_seed(1), [0],
                        time.monotonic() + 60, transport_device=ctx.dev)
    assert out["paths"] == ["cuda (device payload) -> cpu (device payload)"], out["paths"]
    assert out["receiver_equal"] and out["checksums_equal"] and out["full_payloads"] == 0, out
    assert out["timed_reps"] >= 1 and out["changed"] > 0 and out["install_median_s"] is not None
    assert out["sender_fill_median_s"] is not None and out["receiver_check_median_s"] is not None
