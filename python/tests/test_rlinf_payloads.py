"""Payloads on RLinf's tensor path (issue 23 item 5): with ``payload_type="tensor"`` the syncer hands ``send`` a
uint8 ``torch.Tensor``; ``recv`` may return bytes or uint8 tensors (any shape, strides or storage offset) in every
mode, read through torch (numpy is not needed); corrupt and replayed tensor payloads are still rejected."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

import rlsync


class TensorLink:
    """The in-memory transport of ``conftest.Link``, recording the type of every payload handed to ``send``;
    ``deliver`` turns what arrives into what ``recv`` returns (the transport's own representation)."""

    def __init__(self, deliver: Any = lambda p: p) -> None:
        self.to_rx: asyncio.Queue[Any] = asyncio.Queue()
        self.to_tx: asyncio.Queue[Any] = asyncio.Queue()
        self.sent: list[Any] = []
        self.deliver = deliver

    async def send(self, payload: Any) -> None:
        self.sent.append(payload)
        await self.to_rx.put(payload)

    async def recv(self) -> Any:
        return self.deliver(await self.to_rx.get())

    async def up_send(self, payload: Any) -> None:
        self.sent.append(payload)
        await self.to_tx.put(payload)

    async def up_recv(self) -> Any:
        return self.deliver(await self.to_tx.get())


def state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(8, 16, generator=g).to(torch.bfloat16),
        "b": torch.randn(16, generator=g),
        "n": torch.tensor(0, dtype=torch.int64),
    }


def make(kind: str, payload_type: str) -> rlsync.WeightSyncer:
    if kind == "patch":
        return rlsync.PatchWeightSyncer(init_sync_enabled=True, payload_type=payload_type)
    return rlsync.BucketWeightSyncer(bucket_size=256, payload_type=payload_type)


def bump(sd: dict[str, torch.Tensor], v: int) -> None:
    with torch.no_grad():
        sd["w"][v % 8, :3] += 1
        sd["b"][v % 16] -= 1
        sd["n"] += 1


def as_bytes(t: torch.Tensor) -> bytes:
    return bytes(t.tolist())


def offset_view(t: Any) -> torch.Tensor:
    """The same bytes as a uint8 tensor that is a 2-D view at a storage offset (as a receive buffer may be)."""
    data = as_bytes(t) if isinstance(t, torch.Tensor) else bytes(t)
    big = torch.zeros(len(data) + 8, dtype=torch.uint8)
    big[3 : 3 + len(data)] = torch.tensor(list(data), dtype=torch.uint8)
    view = big[3 : 3 + len(data)]
    return view.reshape(1, -1) if len(data) else view


DELIVERIES = {
    "as_sent": lambda p: p,
    "bytes": lambda p: as_bytes(p) if isinstance(p, torch.Tensor) else bytes(p),
    "tensor_view": offset_view,
}


@pytest.mark.parametrize("kind", ["patch", "bucket"])
@pytest.mark.parametrize("payload_type", ["tensor", "bytes"])
@pytest.mark.parametrize("delivery", list(DELIVERIES))
def test_round_trip_with_tensor_or_bytes_payloads(kind: str, payload_type: str, delivery: str) -> None:
    tx_sd, rx_sd = state(1), state(2)

    async def main() -> None:
        tx, rx, link = make(kind, payload_type), make(kind, payload_type), TensorLink(DELIVERIES[delivery])
        assert tx.payload_type == payload_type
        await asyncio.gather(
            tx.init_sender(tx_sd, list(tx_sd), link.send, link.up_recv),
            rx.init_receiver(rx_sd, link.recv, link.up_send),
        )
        for version in range(1, 6):
            bump(tx_sd, version)
            await tx.sync(tx_sd, link.send, version)
            assert await rx.apply(rx_sd, link.recv) == version
            for k in tx_sd:
                assert torch.equal(rx_sd[k], tx_sd[k]), k
        assert link.sent, "payloads went through send"
        for p in link.sent:
            if payload_type == "tensor":
                assert isinstance(p, torch.Tensor) and p.dtype == torch.uint8 and p.dim() == 1
                assert p.device.type == "cpu" and p.is_contiguous()
            else:
                assert isinstance(p, bytes)

    asyncio.run(main())


@pytest.mark.parametrize("kind", ["patch", "bucket"])
def test_corrupt_and_replayed_tensor_payloads_are_rejected(kind: str) -> None:
    tx_sd, rx_sd = state(1), state(1)

    async def main() -> None:
        tx, rx, link = make(kind, "tensor"), make(kind, "tensor"), TensorLink()
        await asyncio.gather(
            tx.init_sender(tx_sd, list(tx_sd), link.send, link.up_recv),
            rx.init_receiver(rx_sd, link.recv, link.up_send),
        )
        bump(tx_sd, 1)
        await tx.sync(tx_sd, link.send, 1)
        v1 = [link.to_rx.get_nowait() for _ in range(link.to_rx.qsize())]
        for p in v1:
            await link.to_rx.put(p)
        assert await rx.apply(rx_sd, link.recv) == 1
        bump(tx_sd, 2)
        await tx.sync(tx_sd, link.send, 2)
        v2 = [link.to_rx.get_nowait() for _ in range(link.to_rx.qsize())]
        before = {k: v.clone() for k, v in rx_sd.items()}

        async def rejected(payloads: list[torch.Tensor]) -> None:
            for p in payloads:
                await link.to_rx.put(p)
            with pytest.raises(rlsync.PayloadRejected):
                await rx.apply(rx_sd, link.recv)
            while not link.to_rx.empty():
                link.to_rx.get_nowait()
            assert rx.version == 1
            assert all(torch.equal(rx_sd[k], before[k]) for k in rx_sd), "a rejected payload changes nothing"

        flipped = v2[0].clone()
        flipped[len(flipped) // 2] ^= 0x5A
        await rejected([flipped, *v2[1:]])
        await rejected([v2[0][:-7], *v2[1:]])
        await rejected(v1)  # replayed
        for p in v2:
            await link.to_rx.put(p)
        assert await rx.apply(rx_sd, link.recv) == 2
        assert all(torch.equal(rx_sd[k], tx_sd[k]) for k in rx_sd)

    asyncio.run(main())


def test_bad_payload_types_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="payload_type"):
        rlsync.PatchWeightSyncer(payload_type="pickle")
    with pytest.raises(ValueError, match="payload_type"):
        rlsync.WeightSyncer.create({"type": "bucket", "payload_type": "numpy"})
    assert rlsync.WeightSyncer.create({"type": "bucket", "payload_type": "tensor"}).payload_type == "tensor"
    assert rlsync.WeightSyncer.create({"type": "patch", "payload_type": "tensor"}).payload_type == "tensor"
    assert rlsync.WeightSyncer.create({"type": "patch"}).payload_type == "bytes"
    tx_sd, rx_sd = state(1), state(1)

    async def main() -> None:
        tx, rx, link = make("bucket", "tensor"), make("bucket", "tensor"), TensorLink()
        await asyncio.gather(
            tx.init_sender(tx_sd, list(tx_sd), link.send, link.up_recv),
            rx.init_receiver(rx_sd, link.recv, link.up_send),
        )
        await link.to_rx.put(torch.zeros(8, dtype=torch.float32))
        with pytest.raises(TypeError, match="dtype torch.float32"):
            await rx.apply(rx_sd, link.recv)
        await link.to_rx.put([1, 2, 3])
        with pytest.raises(TypeError, match="list"):
            await rx.apply(rx_sd, link.recv)
        bump(tx_sd, 1)
        await tx.sync(tx_sd, link.send, 1)
        assert await rx.apply(rx_sd, link.recv) == 1, "the receiver survived both errors"

    asyncio.run(main())


NO_NUMPY = textwrap.dedent(
    """
    import asyncio, sys, warnings
    sys.modules["numpy"] = None  # `import numpy` raises ImportError from here on
    warnings.simplefilter("ignore")
    import torch
    import rlsync

    try:
        torch.zeros(1, dtype=torch.uint8).numpy()
    except RuntimeError as e:
        assert "Numpy is not available" in str(e), e
    else:
        raise AssertionError("numpy is still usable")

    async def main(kind):
        q, up = asyncio.Queue(), asyncio.Queue()
        sent = []
        async def send(p):
            sent.append(p)
            await q.put(p)
        async def up_send(p):
            await up.put(p)
        make = {"patch": lambda: rlsync.PatchWeightSyncer(init_sync_enabled=True, payload_type="tensor"),
                "bucket": lambda: rlsync.BucketWeightSyncer(bucket_size=64, payload_type="tensor")}[kind]
        torch.manual_seed(0)
        a, b = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)
        tx, rx = make(), make()
        await asyncio.gather(tx.init_sender(a.state_dict(), rlsync.param_names_need_sync(a), send, up.get),
                             rx.init_receiver(b.state_dict(), q.get, up_send))
        for v in range(1, 4):
            with torch.no_grad():
                a.weight.mul_(1.5)
            await tx.sync(a.state_dict(), send, v)
            assert await rx.apply(b, q.get) == v
            assert torch.equal(a.weight, b.weight) and torch.equal(a.bias, b.bias)
        assert sent and all(isinstance(p, torch.Tensor) and p.dtype == torch.uint8 for p in sent)

    for kind in ("patch", "bucket"):
        asyncio.run(main(kind))
    print("ok without numpy")
    """
)


def test_tensor_payloads_need_no_numpy(tmp_path: Path) -> None:
    script = tmp_path / "no_numpy.py"
    script.write_text(NO_NUMPY)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "ok without numpy" in out.stdout
