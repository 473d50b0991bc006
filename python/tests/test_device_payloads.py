"""Device payloads (``PatchWeightSyncer(transport_device="cuda")`` over CUDA state dicts) on a machine without a
GPU: what the routing does around them. The payloads themselves (build, fill, verify, install on the GPU) are
tested in the core on the reference kernels and on a GPU by ``scripts/gpu_check.sh``'s ``payload`` stage."""

from __future__ import annotations

import asyncio

import pytest
import torch

import rlsync
from rlsync import _native
from rlsync import syncer as rs
from test_api_timeouts import make, state


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
        s, r = make("patch"), make("patch")
        await asyncio.gather(
            s.init_sender(tx_sd, ["w", "b"], ln.send, ln.up_recv), r.init_receiver(rx_sd, ln.recv, ln.up_send)
        )
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
        s = rlsync.PatchWeightSyncer(transport_device="cuda", init_sync_enabled=True)
        r = make("patch")
        assert s._wants_device_payloads()
        await asyncio.gather(
            s.init_sender(tx_sd, ["w", "b"], ln.send, ln.up_recv), r.init_receiver(rx_sd, ln.recv, ln.up_send)
        )
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


def test_device_payloads_that_cannot_start_leave_host_coded_payloads(link, monkeypatch: pytest.MonkeyPatch) -> None:
    """Init is done when device payloads would start: if they cannot (here: no CUDA driver behind what looks like
    a CUDA state dict), a warning says so and the payloads stay host-coded, so the receivers still get them."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)

    class Stream:
        cuda_stream = 0

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    real = rs._synced

    def as_if_on_a_gpu(state_dict, keys):  # the descriptions a CUDA state dict would give
        return [d[:6] + ("cuda:0",) for d in real(state_dict, keys)]

    monkeypatch.setattr(rs, "_synced", as_if_on_a_gpu)

    _observe_moves(monkeypatch)

    async def main() -> None:
        ln = link()
        tx_sd, rx_sd = state(1), state(2)
        s = rlsync.PatchWeightSyncer(transport_device="cuda", init_sync_enabled=True)
        r = make("patch")
        with pytest.warns(RuntimeWarning, match="device payloads could not start"):
            await asyncio.gather(
                s.init_sender(tx_sd, ["w", "b"], ln.send, ln.up_recv), r.init_receiver(rx_sd, ln.recv, ln.up_send)
            )
        assert s._dev_tx is None and s._native.end == "sender"
        with torch.no_grad():
            tx_sd["b"] += 0.5
        await s.sync(tx_sd, ln.send, 2)
        assert await r.apply(rx_sd, ln.recv, timeout=5) == 2
        assert r.checksum(rx_sd) == s.checksum(tx_sd)

    asyncio.run(main())
