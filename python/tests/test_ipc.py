"""The same-host GPU channel's Python face: exported, documented, and on a machine without CUDA every entry point
raises rlsync.CudaError (the device path itself runs in python/bench/gpu_check_ipc.py on a GPU machine)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import rlsync


def test_the_channel_is_exported() -> None:
    for name in ("cuda_ipc_sender", "cuda_ipc_receiver", "CudaIpcSender", "CudaIpcReceiver"):
        assert name in rlsync.__all__ and hasattr(rlsync, name)
    assert "Bootstrap" in (rlsync.ipc.__doc__ or "")


@pytest.mark.skipif(rlsync.cuda_available()[0], reason="this machine has CUDA: the GPU check covers it")
def test_without_cuda_every_call_raises_cuda_error(tmp_path: Path) -> None:
    sd = {"w": torch.zeros(4, dtype=torch.bfloat16), "b": torch.zeros(3)}
    sock = tmp_path / "gpu.sock"
    with pytest.raises(rlsync.CudaError):
        rlsync.cuda_ipc_sender(sock, sd, receivers=1)
    with pytest.raises(rlsync.CudaError):
        rlsync.cuda_ipc_sender(sock, sd, receivers=1, snapshot_device="cpu")
    with pytest.raises(rlsync.CudaError):
        rlsync.cuda_ipc_receiver(sock, 0, sd, timeout=0.1)
    with pytest.raises(rlsync.CudaError):
        rlsync.CudaIpcSender(sock, {}, 0)
    assert not sock.exists(), "nothing was bound"
    assert issubclass(rlsync.CudaError, rlsync.RlsyncError)
