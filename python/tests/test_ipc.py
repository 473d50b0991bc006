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
    # Restartable receivers and background installs: the sender's rejoin and settle, documented.
    for method in ("rejoin", "settle"):
        assert (getattr(rlsync.CudaIpcSender, method).__doc__ or "").strip(), method
    for word in ("elastic", "detach_acks", "dtype"):
        assert word in (rlsync.cuda_ipc_sender.__doc__ or ""), word


@pytest.mark.skipif(rlsync.cuda_available()[0], reason="this machine has CUDA: the GPU check covers it")
def test_without_cuda_every_call_raises_cuda_error(tmp_path: Path) -> None:
    sd = {"w": torch.zeros(4, dtype=torch.bfloat16), "b": torch.zeros(3)}
    sock = tmp_path / "gpu.sock"
    with pytest.raises(rlsync.CudaError):
        rlsync.cuda_ipc_sender(sock, sd, receivers=1)
    with pytest.raises(rlsync.CudaError):
        rlsync.cuda_ipc_sender(sock, sd, receivers=1, snapshot_device="cpu")
    with pytest.raises(rlsync.CudaError):
        rlsync.cuda_ipc_sender(sock, sd, receivers=2, elastic=True, detach_acks=True)
    with pytest.raises(rlsync.CudaError):
        rlsync.cuda_ipc_receiver(sock, 0, sd, timeout=0.1)
    with pytest.raises(rlsync.CudaError):
        rlsync.CudaIpcSender(sock, {}, 0)
    with pytest.raises(rlsync.CudaError):
        rlsync.cuda_ipc_sender(sock, sd, receivers=1, dtype=torch.bfloat16)
    # A receivers' dtype that is not floating is refused before anything else.
    with pytest.raises(ValueError, match="dtype must be None, torch.bfloat16"):
        rlsync.cuda_ipc_sender(sock, sd, receivers=1, dtype=torch.int8)
    assert not sock.exists(), "nothing was bound"
    assert issubclass(rlsync.CudaError, rlsync.RlsyncError)


def _stage_module():
    import sys

    here = Path(__file__).resolve().parent
    for p in (here, here.parent / "bench"):
        if str(p) not in sys.path:
            sys.path.insert(0, str(p))
    import fake_ipc_channel
    import gpu_check_ipc

    return gpu_check_ipc, fake_ipc_channel


def test_the_ipc_stage_skips_in_cpu_mode() -> None:
    stage, _ = _stage_module()
    rec = stage.stage_ipc({}, cpu=True)
    assert rec["status"] == "skipped" and "CUDA" in rec["note"]


@pytest.mark.parametrize("skip", [None, 2])
def test_the_ipc_stage_drives_its_receiver_processes_and_catches_a_difference(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, skip: int | None
) -> None:
    """The stage's process handling (spawn, shared tensors, acks, close, exit) on the CPU with a fake channel;
    a receiver that skips version 2 is caught by the bitwise check."""
    import time

    stage, fake = _stage_module()
    if skip is not None:
        monkeypatch.setenv("FAKE_IPC_SKIP", str(skip))
    shapes = stage.llama2_7b_shapes(True)
    g = torch.Generator().manual_seed(3)
    state = {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in shapes}
    for n in (1, 2):
        rec = stage._phase(fake, n, shapes, state, 0.01, 3, time.monotonic() + 120, str(tmp_path),
                           module="fake_ipc_channel")
        assert rec["syncs"] == 3 and rec["bootstrap_equal"] == [True] * n, rec
        assert rec["exitcodes"] == [0] * n and rec["socket_removed"], rec
        assert rec["fallbacks"] == 0, rec
        phases = rec["receiver_phases_median_s"]
        assert [p["rank"] for p in phases] == list(range(n)), rec
        for p in phases:
            assert set(p) == {"rank", *stage.PHASES}, p
            assert all(p[k] >= 0 for k in stage.PHASES), p
            assert p["total_s"] >= p["apply_s"], p
        if n == 2:
            # Receiver 1 killed, dropped by the elastic sender, its successor given a full copy, then both synced.
            r = rec["rejoin"]
            assert r["ok"] and r["dropped"] == [1] and r["rejoin_version"] == 4, r
            assert r["killed_exitcode"] not in (None, 0), r
        if skip is None:
            assert rec["all_equal"] and rec["equal_after_each"] == [True] * 3, rec
        else:
            assert not rec["all_equal"] and rec["equal_after_each"][1] is False, rec
    # Casts: an fp32 sender, its receiver in bf16, compared with the sender's tensors cast.
    cast_shapes = shapes[: stage.CAST_TENSORS]
    state32 = {n: torch.randn(s, generator=g) for n, s in cast_shapes}
    rec = stage._phase(fake, 1, cast_shapes, state32, 0.05, 3, time.monotonic() + 120, str(tmp_path),
                       module="fake_ipc_channel", dtype=torch.bfloat16)
    assert rec["cast"] == "float32 -> bfloat16" and rec["exitcodes"] == [0], rec
    if skip is None:
        assert rec["all_equal"] and rec["equal_after_each"] == [True] * 3, rec
    else:
        assert not rec["all_equal"] and rec["equal_after_each"][1] is False, rec
