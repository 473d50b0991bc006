"""rlsync's GPU path checked on one machine in a few minutes: one JSON file of results (issue 24, item 8).

    scripts/gpu_check.sh [--cpu] [--out FILE] [--budget SECONDS]      # the wrapper (installs dist/*.whl first)
    python python/bench/gpu_check.py --cpu --out /tmp/check.json      # the script itself, rlsync importable

Stages, one after another, each appending its record to the results JSON (rewritten after every stage, so a run
stopped by a timeout keeps what ran) and freeing its GPU memory before the next:

- ``env``: GPU name, driver, torch / CUDA versions, rlsync's version and ``rlsync.cuda_available()``;
- ``kernels``: ``scripts/kernel_check.cpp`` (driver API, no binding) checks every kernel of the committed PTX
  against its host model (``xxh3_chunks`` against an independent host XXH3) and times them against a D2D copy;
- ``rooflines``: device-to-device copy of a ~13.5 GB bf16 state, a read-only pass, a compare pass (what a diff
  must read), pinned host<->device copies of 1 GiB (CUDA events, median of 5);
- ``density``: a small real AdamW run (2-layer MLP, fp32 master weights, bf16 copies, lr 1e-6, std 0.02 init):
  the share of bf16 elements whose bits change per step, used as the density of the next stage;
- ``timing_7b``: Llama-2-7B's 291 tensors in bf16 (random weights), updates at that density (the bits of that
  share of the elements flipped): rlsync's patch sync (sender build/encode from ``last_report()``, end to end
  sender sync + receiver apply into a second set of tensors, install, the receiver's state checksum hashed on
  the GPU and checked against the sender's host-hashed one), RLinf's algorithm (its exact torch-op
  sequence, transcribed below from RLinf's source, GPU-snapshot and CPU-snapshot builders + its apply) and a
  full copy (``load_state_dict`` and a plain device-to-device ``copy_``);
- ``correctness``: a ~1.5B-shaped state (Qwen2-1.5B's tensors) with fp32 master weights + AdamW on synthetic
  gradients, 30 syncs per syncer (patch with each ``snapshot_device``, bucket, and patch from the fp32 master
  weights themselves to bf16 receivers, cast on the GPU before the diff): after every sync the receiver is
  bitwise equal to the sender (its bf16 copy for the casting run) and the syncers' checksums agree; every 10th sync a second sync of the unchanged
  state must carry no change (the sender's snapshot equals its state); a payload corrupted in flight is
  rejected with the receiver untouched, and the intact one installs afterwards;
- ``gym_ppo``: the gym_ppo example through the ``rlsync`` binary with its policies on the device
  (``actor.worker.device`` / ``rollout.worker.device``) for a few updates: behav KL from the run's metrics,
  each worker's sync path from its log (on a GPU: the patch built and installed on the device); then the
  same with the bucket syncer packing and installing on the device (``bucket_device=cuda``);
- ``sanitizer``: a tiny sync under ``compute-sanitizer`` (when it is installed), its summary line.

``--cpu`` runs every stage with small sizes on CPU tensors (the RLinf transcription too), so the script is
dry-run where there is no GPU (``python/tests/test_gpu_check.py``). A stage whose prerequisite is missing (no
GPU, rlsync not importable, no mujoco, no binary) is recorded as ``skipped`` with a note; a stage that raises
is recorded as ``error`` with the exception; nothing stops the stages after it. An internal budget
(``--budget``) gives each stage at most its share and skips what no longer fits. Exit status: 0 unless a
stage failed or raised.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import gc
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parents[2]

# RLinf's weight syncer transcribed below from RLinf/RLinf at this commit (2026-08-22):
# rlinf/hybrid_engines/weight_syncer/patch_syncer.py (PatchBuilder.delta_encode/delta_decode,
# downscale_nonnegative_indices, as_coo_2d_view, GPUSnapshotPatchBuilder / CPUSnapshotPatchBuilder.create_patch,
# PatchWeightSyncer.sync / apply) and compressor.py (IdentityCompressor, compression "none").
RLINF_COMMIT = "a3816b596478dcd8a5c69a6ec1468c9519f77b5b"

SCHEMA_VERSION = 1

# Stage: (name, share of the budget in seconds at most, seconds it needs at least to start).
STAGES: list[tuple[str, float, float]] = [
    ("env", 5, 1),
    ("kernels", 60, 8),
    ("rooflines", 15, 5),
    ("density", 10, 3),
    ("timing_7b", 110, 20),
    ("correctness", 50, 10),
    ("ipc", 50, 25),
    ("gym_ppo", 60, 15),
    ("sanitizer", 45, 15),
]


class Skip(Exception):
    """A stage's prerequisite is missing: the stage is recorded as skipped with this note."""


# -------------------------------------------------------------------------------------------------------------
# the run: device, budget, results file


@dataclass
class Ctx:
    cpu: bool
    dev: torch.device
    out: Path
    deadline: float  # the stage's own deadline (time.monotonic())
    results: dict[str, Any]
    bin: Path

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def sync(self) -> None:
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def write_results(path: Path, results: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(results, indent=2, sort_keys=False, default=str) + "\n")
    os.replace(tmp, path)


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def rlsync_module() -> Any:
    """The rlsync package, or Skip naming why it cannot be imported."""
    try:
        import rlsync
    except Exception as e:  # noqa: BLE001 - any import failure is the note
        raise Skip(f"rlsync is not importable: {type(e).__name__}: {e}") from None
    return rlsync


def need_gpu(ctx: Ctx) -> None:
    if ctx.dev.type == "cuda" and not torch.cuda.is_available():
        raise Skip("no CUDA device: torch.cuda.is_available() is False")


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def timed(ctx: Ctx, fn: Callable[[], Any], reps: int, warm: int = 1) -> list[float]:
    """Seconds per call of ``fn`` (CUDA events on a GPU, perf_counter on the CPU), ``warm`` calls untimed."""
    for _ in range(warm):
        fn()
    ctx.sync()
    out = []
    for _ in range(reps):
        if ctx.dev.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return out


def wall(ctx: Ctx, fn: Callable[[], Any]) -> tuple[float, Any]:
    """Wall seconds of ``fn`` from a synchronized device to a synchronized device."""
    ctx.sync()
    t0 = time.perf_counter()
    r = fn()
    ctx.sync()
    return time.perf_counter() - t0, r


# -------------------------------------------------------------------------------------------------------------
# model shapes


def llama2_7b_shapes(cpu: bool) -> list[tuple[str, tuple[int, ...]]]:
    """Llama-2-7B's 291 tensors (hidden 4096, MLP 11008, vocab 32000, 32 layers); ``cpu``: the same layout with
    hidden 128, MLP 344, vocab 1000, 2 layers."""
    h, f, v, layers = (128, 344, 1000, 2) if cpu else (4096, 11008, 32000, 32)
    out = [("model.embed_tokens.weight", (v, h))]
    for i in range(layers):
        p = f"model.layers.{i}"
        out += [(f"{p}.self_attn.{n}_proj.weight", (h, h)) for n in "qkvo"]
        out += [(f"{p}.mlp.gate_proj.weight", (f, h)), (f"{p}.mlp.up_proj.weight", (f, h))]
        out += [(f"{p}.mlp.down_proj.weight", (h, f))]
        out += [(f"{p}.input_layernorm.weight", (h,)), (f"{p}.post_attention_layernorm.weight", (h,))]
    out += [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]
    return out


def qwen2_1p5b_shapes(cpu: bool) -> list[tuple[str, tuple[int, ...]]]:
    """Qwen2-1.5B's tensors (hidden 1536, 2 KV heads of 128, MLP 8960, vocab 151936, 28 layers, q/k/v biases,
    tied embeddings: 1.54 B elements); ``cpu``: hidden 64, KV 16, MLP 172, vocab 500, 2 layers."""
    h, kv, f, v, layers = (64, 16, 172, 500, 2) if cpu else (1536, 256, 8960, 151936, 28)
    out = [("model.embed_tokens.weight", (v, h))]
    for i in range(layers):
        p = f"model.layers.{i}"
        out += [(f"{p}.self_attn.q_proj.weight", (h, h)), (f"{p}.self_attn.q_proj.bias", (h,))]
        out += [(f"{p}.self_attn.k_proj.weight", (kv, h)), (f"{p}.self_attn.k_proj.bias", (kv,))]
        out += [(f"{p}.self_attn.v_proj.weight", (kv, h)), (f"{p}.self_attn.v_proj.bias", (kv,))]
        out += [(f"{p}.self_attn.o_proj.weight", (h, h))]
        out += [(f"{p}.mlp.gate_proj.weight", (f, h)), (f"{p}.mlp.up_proj.weight", (f, h))]
        out += [(f"{p}.mlp.down_proj.weight", (h, f))]
        out += [(f"{p}.input_layernorm.weight", (h,)), (f"{p}.post_attention_layernorm.weight", (h,))]
    out += [("model.norm.weight", (h,))]
    return out


def numel(shapes: list[tuple[str, tuple[int, ...]]]) -> int:
    total = 0
    for _, s in shapes:
        n = 1
        for d in s:
            n *= d
        total += n
    return total


def random_state(shapes, dev: torch.device, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    """Weights of a real model's scale: normal(0, 0.02), norms at 1."""
    g = torch.Generator(device=dev).manual_seed(seed)
    out = {}
    for name, shape in shapes:
        if "norm" in name:
            out[name] = torch.ones(shape, device=dev, dtype=dtype)
        else:
            t = torch.empty(shape, device=dev, dtype=torch.float32 if dtype != torch.float32 else dtype)
            t.normal_(0.0, 0.02, generator=g)
            out[name] = t.to(dtype) if t.dtype != dtype else t
    return out


def as_module(state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A module whose ``state_dict()`` holds exactly these tensors under these names (as parameters)."""
    root = torch.nn.Module()
    for name, t in state.items():
        *path, leaf = name.split(".")
        m = root
        for part in path:
            if not hasattr(m, part):
                m.add_module(part, torch.nn.Module())
            m = getattr(m, part)
        m.register_parameter(leaf, torch.nn.Parameter(t, requires_grad=False))
    return root


def perturb(state: dict[str, torch.Tensor], density: float, gen: torch.Generator) -> None:
    """Flip the lowest bit of ``density`` of the elements of every tensor (each flipped element changes)."""
    for t in state.values():
        mask = torch.rand(t.shape, device=t.device, generator=gen) < density
        bits = t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)
        bits.bitwise_xor_(mask.to(bits.dtype))


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.view(view), b.view(view))


def states_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(bit_equal(a[k], b[k]) for k in a)


class Link:
    """An in-process transport between one sender and one receiver (as python/tests' conftest): a queue per
    direction; ``corrupt`` flips one byte of the next downstream payload."""

    def __init__(self) -> None:
        self.to_rx: asyncio.Queue = asyncio.Queue()
        self.to_tx: asyncio.Queue = asyncio.Queue()

    async def send(self, payload: Any) -> None:
        await self.to_rx.put(payload)

    async def recv(self) -> Any:
        return await self.to_rx.get()

    async def up_send(self, payload: Any) -> None:
        await self.to_tx.put(payload)

    async def up_recv(self) -> Any:
        return await self.to_tx.get()

    def drain(self) -> list[Any]:
        out = []
        while not self.to_rx.empty():
            out.append(self.to_rx.get_nowait())
        return out


def rlsync_pair(rlsync: Any, kind: str, device: str, **kw: Any) -> tuple[Any, Any]:
    if kind == "patch":
        return (rlsync.PatchWeightSyncer(snapshot_device=device, **kw),
                rlsync.PatchWeightSyncer(snapshot_device=device, **kw))
    # bucket_device='cuda': the sender packs (and casts) its CUDA tensors' buckets on the GPU; 'cpu' stages
    # them through host copies of the whole state.
    return (rlsync.BucketWeightSyncer(bucket_device=device, **kw),
            rlsync.BucketWeightSyncer(bucket_device=device, **kw))


async def rlsync_init(tx: Any, rx: Any, tx_state: dict, rx_state: dict, link: Link) -> None:
    await asyncio.gather(
        tx.init_sender(tx_state, list(tx_state), link.send, link.up_recv),
        rx.init_receiver(rx_state, link.recv, link.up_send),
    )


def error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


# -------------------------------------------------------------------------------------------------------------
# RLinf's patch syncer, transcribed (RLINF_COMMIT): the same torch ops in the same order. Differences: no
# DTensor (materialize_tensor is the identity for plain tensors), ``Worker.torch_platform`` is torch.cuda (or
# nothing on the CPU), the payload object is handed to the receiver in process (zero-cost transport: RLinf's
# own goes over its channel / NCCL), compression "none" (IdentityCompressor: the patch as it is), and its
# host-side argument checks (key sets, shapes, devices: no device work) left out.


def rlinf_downscale_nonnegative_indices(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.numel() == 0:
        return tensor.to(torch.uint8)
    max_value = int(tensor.max().item())
    if max_value <= torch.iinfo(torch.uint8).max:
        return tensor.to(torch.uint8)
    if max_value <= torch.iinfo(torch.int32).max:
        return tensor.to(torch.int32)
    return tensor.to(torch.int64)


def rlinf_as_coo_2d_view(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Size]:
    original_shape = tensor.shape
    if tensor.ndim == 0:
        view = tensor.unsqueeze(0).unsqueeze(0)
    elif tensor.ndim == 1:
        view = tensor.unsqueeze(0)
    elif tensor.ndim == 2:
        view = tensor
    else:
        view = tensor.view(tensor.shape[0], -1)
    return view, original_shape


def rlinf_delta_encode(rows: torch.Tensor, cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    assert rows.numel() > 0, "No indices to encode"
    assert rows.numel() == cols.numel(), "Rows and columns must have the same number of elements"
    if rows.numel() == 1:
        return rows, cols
    row_deltas = torch.empty_like(rows)
    col_deltas = torch.empty_like(cols)
    row_deltas[0] = rows[0]
    col_deltas[0] = cols[0]
    row_deltas[1:] = rows[1:] - rows[:-1]
    same_row = rows[1:] == rows[:-1]
    col_deltas[1:] = torch.where(same_row, cols[1:] - cols[:-1], cols[1:])
    return row_deltas, col_deltas


def rlinf_delta_decode(rows_delta: torch.Tensor, cols_delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if rows_delta.numel() == 0:
        raise ValueError("No indices to decode")
    if rows_delta.numel() != cols_delta.numel():
        raise ValueError("Rows and columns must have the same number of elements")
    rows = torch.cumsum(rows_delta, dim=0, dtype=torch.int64)
    start_mask = torch.zeros_like(rows_delta, dtype=torch.bool)
    start_mask[0] = True
    start_mask[1:] = rows_delta[1:] != 0
    idx = torch.arange(rows_delta.numel(), device=rows_delta.device, dtype=torch.int64)
    start_idx = torch.where(start_mask, idx, torch.zeros_like(idx))
    start_idx = torch.cummax(start_idx, dim=0).values
    cum_cols = torch.cumsum(cols_delta, dim=0, dtype=torch.int64)
    base = (cum_cols - cols_delta)[start_idx]
    cols = cum_cols - base
    return rows, cols


@dataclass
class RlinfEmptyPatch:
    version: torch.Tensor

    def to(self, device: torch.device, non_blocking: bool = False) -> "RlinfEmptyPatch":
        return RlinfEmptyPatch(version=self.version.to(device=device, non_blocking=non_blocking))


@dataclass
class RlinfPatch:
    version: torch.Tensor
    ordinals: torch.Tensor
    nnz_per_tensor: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor
    values: torch.Tensor

    def to(self, device: torch.device, non_blocking: bool = False) -> "RlinfPatch":
        return RlinfPatch(*(getattr(self, f).to(device=device, non_blocking=non_blocking) for f in
                            ("version", "ordinals", "nnz_per_tensor", "rows", "cols", "values")))

    def nbytes(self) -> int:
        return sum(getattr(self, f).numel() * getattr(self, f).element_size() for f in
                   ("version", "ordinals", "nnz_per_tensor", "rows", "cols", "values"))


class RlinfSyncer:
    """RLinf's PatchWeightSyncer (sender: ``init_sender`` snapshot + ``create_patch`` of the GPU- or
    CPU-snapshot builder + ``sync``'s transport move; receiver: ``apply``), on one device."""

    def __init__(self, snapshot_device: str, dev: torch.device, delta_encoding: bool = True) -> None:
        self.snapshot_device = torch.device(snapshot_device if snapshot_device == "cpu" else dev)
        self.dev = dev
        self.transport_device = dev  # RLinf: transport_device None -> the worker's device
        self.delta_encoding = delta_encoding
        self.accel = dev.type == "cuda"
        self._copy_stream = None

    # -- sender --
    @torch.no_grad()
    def init_sender(self, state_dict: dict[str, torch.Tensor], receiver_state: dict[str, torch.Tensor]) -> None:
        self.ordered_keys = list(receiver_state)
        self.original_shapes = {k: v.shape for k, v in receiver_state.items()}
        receiver_dtypes = {k: v.dtype for k, v in receiver_state.items()}
        self.param_names_need_sync = list(state_dict)
        self.ordinals = {n: i for i, n in enumerate(self.ordered_keys) if n in set(self.param_names_need_sync)}
        snapshot = {}
        for key in self.param_names_need_sync:
            value_2dview, _ = rlinf_as_coo_2d_view(state_dict[key])
            snapshot_device = value_2dview.device if self.snapshot_device.type != "cpu" else self.snapshot_device
            snapshot_value = value_2dview.detach().to(device=snapshot_device, dtype=receiver_dtypes[key], copy=True)
            snapshot[key] = (snapshot_value.pin_memory() if self.snapshot_device.type == "cpu" and self.accel
                             else snapshot_value)
        self.snapshot = snapshot

    def _chunk(self, key: str, compare_value: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor,
               values: torch.Tensor, out: dict[str, list]) -> None:
        if self.delta_encoding:
            rows, cols = rlinf_delta_encode(rows, cols)
        out["ordinals"].append(torch.tensor(self.ordinals[key], dtype=torch.int32, device=self.transport_device))
        out["nnz"].append(torch.tensor(values.numel(), dtype=torch.int32, device=self.transport_device))
        out["rows"].append(rows.contiguous().to(device=self.transport_device, non_blocking=False))
        out["cols"].append(cols.contiguous().to(device=self.transport_device, non_blocking=False))
        out["values"].append(values.contiguous().view(torch.uint8).to(device=self.transport_device, non_blocking=False))

    def _finish(self, version: int, out: dict[str, list]) -> RlinfPatch | RlinfEmptyPatch:
        if out["rows"]:
            return RlinfPatch(
                version=torch.tensor(version, dtype=torch.int64, device=out["rows"][0].device),
                ordinals=torch.stack(out["ordinals"]),
                nnz_per_tensor=torch.stack(out["nnz"]),
                rows=rlinf_downscale_nonnegative_indices(torch.cat(out["rows"], dim=0)),
                cols=rlinf_downscale_nonnegative_indices(torch.cat(out["cols"], dim=0)),
                values=torch.cat(out["values"], dim=0),
            )
        return RlinfEmptyPatch(version=torch.tensor(version, dtype=torch.int64, device=self.transport_device))

    @torch.no_grad()
    def create_patch(self, state_dict: dict[str, torch.Tensor], version: int) -> RlinfPatch | RlinfEmptyPatch:
        if self.snapshot_device.type == "cpu":
            return self._create_patch_cpu_snapshot(state_dict, version)
        return self._create_patch_gpu_snapshot(state_dict, version)

    def _create_patch_gpu_snapshot(self, state_dict, version):
        # GPUSnapshotPatchBuilder.create_patch
        out: dict[str, list] = {"ordinals": [], "nnz": [], "rows": [], "cols": [], "values": []}
        for key in self.param_names_need_sync:
            value_2dview, _ = rlinf_as_coo_2d_view(state_dict[key])
            snapshot_value = self.snapshot[key]
            compare_value = value_2dview.to(device=snapshot_value.device, dtype=snapshot_value.dtype,
                                            non_blocking=True, copy=False)
            changed = compare_value.ne(snapshot_value)
            rows, cols = changed.nonzero(as_tuple=True)
            if rows.numel() == 0:
                continue
            rows = rows.to(torch.int64)
            cols = cols.to(torch.int64)
            values = compare_value[rows, cols]
            snapshot_value[rows, cols] = values
            self._chunk(key, compare_value, rows, cols, values, out)
        return self._finish(version, out)

    def _prefetch(self, state_dict, ordinal: int):
        # CPUSnapshotPatchBuilder._prefetch_snapshot: the snapshot of the next tensor is copied H2D on a copy
        # stream while this one is compared.
        key = self.param_names_need_sync[ordinal]
        state_2dview, _ = rlinf_as_coo_2d_view(state_dict[key])
        snapshot_value = self.snapshot[key]
        if self.accel:
            if self._copy_stream is None:
                self._copy_stream = torch.cuda.Stream(device=state_2dview.device)
            with torch.cuda.stream(self._copy_stream):
                on_device = snapshot_value.to(device=state_2dview.device, non_blocking=True, copy=True)
                done = torch.cuda.Event()
                done.record(self._copy_stream)
        else:
            on_device = snapshot_value.to(device=state_2dview.device, non_blocking=True, copy=True)
            done = None
        return key, state_2dview, snapshot_value, on_device, done

    def _create_patch_cpu_snapshot(self, state_dict, version):
        # CPUSnapshotPatchBuilder.create_patch
        out: dict[str, list] = {"ordinals": [], "nnz": [], "rows": [], "cols": [], "values": []}
        n = len(self.param_names_need_sync)
        prefetched = self._prefetch(state_dict, 0)
        for ordinal in range(n):
            current = prefetched
            prefetched = self._prefetch(state_dict, ordinal + 1) if ordinal + 1 < n else None
            key, state_2dview, snapshot_value, on_device, done = current
            if self.accel:
                compute_stream = torch.cuda.current_stream(state_2dview.device)
                compute_stream.wait_event(done)
                on_device.record_stream(compute_stream)
            compare_value = state_2dview.to(device=state_2dview.device, dtype=snapshot_value.dtype,
                                            non_blocking=True, copy=False)
            changed = compare_value.ne(on_device)
            rows, cols = changed.nonzero(as_tuple=True)
            if rows.numel() == 0:
                continue
            rows = rows.to(torch.int64)
            cols = cols.to(torch.int64)
            values = compare_value[rows, cols]
            # _update_snapshot: three blocking D2H copies, then a CPU index_put into the pinned snapshot
            rows_cpu = rows.to(device="cpu", non_blocking=False)
            cols_cpu = cols.to(device="cpu", non_blocking=False)
            values_cpu = values.to(device="cpu", non_blocking=False)
            snapshot_value[rows_cpu, cols_cpu] = values_cpu
            self._chunk(key, compare_value, rows, cols, values, out)
        return self._finish(version, out)

    def sync(self, state_dict, version: int):
        patch = self.create_patch(state_dict, version)
        return patch.to(device=self.transport_device, non_blocking=self.transport_device.type != "cpu")

    # -- receiver --
    @torch.no_grad()
    def apply(self, model: torch.nn.Module, payload: RlinfPatch | RlinfEmptyPatch) -> int:
        if isinstance(payload, RlinfEmptyPatch):
            return int(payload.version.item())
        patch = payload  # IdentityCompressor.decompress
        applied_version = int(patch.version.item())
        total_nnz = int(patch.nnz_per_tensor.to(torch.int64).sum().item())
        assert patch.rows.numel() == patch.cols.numel()
        assert patch.rows.numel() == total_nnz
        state_dict = model.state_dict()
        offset = 0
        value_byte_offset = 0
        for patch_idx in range(patch.ordinals.numel()):
            key = self.ordered_keys[patch.ordinals[patch_idx].item()]
            value = state_dict[key]
            value_2dview, _ = rlinf_as_coo_2d_view(value)
            nnz = int(patch.nnz_per_tensor[patch_idx].item())
            start_offset = offset
            next_offset = start_offset + nnz
            row_slice = patch.rows[start_offset:next_offset].clone()
            col_slice = patch.cols[start_offset:next_offset].clone()
            offset = next_offset
            value_nbytes = nnz * value_2dview.element_size()
            value_byte_slice = patch.values[value_byte_offset: value_byte_offset + value_nbytes]
            value_byte_offset += value_nbytes
            if self.delta_encoding:
                row_delta, col_delta = row_slice, col_slice
                if row_delta.device != value_2dview.device:
                    row_delta = row_delta.to(device=value_2dview.device, non_blocking=False)
                if col_delta.device != value_2dview.device:
                    col_delta = col_delta.to(device=value_2dview.device, non_blocking=False)
                rows, cols = rlinf_delta_decode(row_delta, col_delta)
            else:
                rows = row_slice.to(device=value_2dview.device, dtype=torch.int64, non_blocking=False)
                cols = col_slice.to(device=value_2dview.device, dtype=torch.int64, non_blocking=False)
            value_slice = value_byte_slice.clone().view(value_2dview.dtype)
            value_2dview[rows, cols] = value_slice.to(device=value_2dview.device, non_blocking=False)
        assert offset == patch.rows.numel(), "Patch offsets do not match payload size"
        return applied_version


# -------------------------------------------------------------------------------------------------------------
# stages


def stage_env(ctx: Ctx) -> dict[str, Any]:
    out: dict[str, Any] = {
        "python": sys.version.split()[0],
        "python_executable": sys.executable,
        "platform": platform.platform(),
        "glibc": "-".join(platform.libc_ver()),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available_torch": torch.cuda.is_available(),
        "install": os.environ.get("RLSYNC_CHECK_INSTALL", ""),
    }
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        out.update(gpu=p.name, gpu_memory_bytes=p.total_memory, sm_count=p.multi_processor_count,
                   capability=f"{p.major}.{p.minor}", cudnn=torch.backends.cudnn.version())
    if shutil.which("nvidia-smi"):
        try:
            q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                                "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
            out["nvidia_smi"] = q.stdout.strip() or q.stderr.strip()
            out["driver"] = q.stdout.split(",")[1].strip() if q.returncode == 0 and "," in q.stdout else None
        except (OSError, subprocess.SubprocessError) as e:
            out["nvidia_smi"] = error_text(e)
    for tool in ("nvcc", "compute-sanitizer"):
        path = shutil.which(tool)
        out[tool.replace("-", "_")] = path
    if shutil.which("nvcc"):
        v = subprocess.run(["nvcc", "--version"], capture_output=True, text=True, timeout=20).stdout.strip()
        out["nvcc_version"] = v.splitlines()[-1] if v else None
    try:
        import rlsync

        out["rlsync_version"] = rlsync.__version__
        out["rlsync_path"] = str(Path(rlsync.__file__).parent)
        probe = getattr(rlsync, "cuda_available", None)
        if probe is None:
            out["rlsync_cuda_available"] = None
            out["rlsync_cuda_note"] = "this rlsync has no cuda_available() (built before the GPU backend)"
        else:
            ok, reason = probe()
            out["rlsync_cuda_available"] = bool(ok)
            out["rlsync_cuda_reason"] = reason
    except Exception as e:  # noqa: BLE001
        out["rlsync_import_error"] = error_text(e)
    for mod in ("gymnasium", "mujoco"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception as e:  # noqa: BLE001
            out[mod] = None
            out[f"{mod}_note"] = error_text(e)
    out["rlsync_bin"] = str(ctx.bin) if ctx.bin.exists() else None
    return out


def stage_rooflines(ctx: Ctx) -> dict[str, Any]:
    need_gpu(ctx)
    n = (13_500_000_000 // 2) if not ctx.cpu else (32 << 20)  # bf16 elements: 13.5 GB on a GPU, 64 MiB on CPU
    src = torch.empty(n, device=ctx.dev, dtype=torch.bfloat16)
    src.view(torch.int16).random_(0, 0x7F00)  # finite positive bf16 values: no NaN for torch.equal
    dst = torch.empty_like(src)
    nbytes = n * 2
    out: dict[str, Any] = {"state_bytes": nbytes, "reps": 5}
    t = timed(ctx, lambda: dst.copy_(src), 5)
    out["d2d_copy"] = {"median_s": median(t), "all_s": t, "gbps_read_plus_write": 2 * nbytes / median(t) / 1e9}
    t = timed(ctx, lambda: src.view(torch.int16).max(), 5)
    out["read_pass"] = {"op": "int16 max", "median_s": median(t), "gbps": nbytes / median(t) / 1e9}
    t = timed(ctx, lambda: torch.equal(src, dst), 5)
    out["compare_pass"] = {"op": "torch.equal (reads both)", "median_s": median(t),
                           "gbps": 2 * nbytes / median(t) / 1e9}
    del src, dst
    free_memory()
    if ctx.dev.type == "cuda":
        size = 1 << 30
        host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(size, dtype=torch.uint8, device=ctx.dev)
        t = timed(ctx, lambda: dev.copy_(host, non_blocking=True), 5)
        out["h2d_pinned_1gib"] = {"median_s": median(t), "gbps": size / median(t) / 1e9}
        t = timed(ctx, lambda: host.copy_(dev, non_blocking=True), 5)
        out["d2h_pinned_1gib"] = {"median_s": median(t), "gbps": size / median(t) / 1e9}
    else:
        out["h2d_pinned_1gib"] = out["d2h_pinned_1gib"] = None
        out["note"] = "--cpu: a 64 MiB state copied in host memory; no pinned host<->device copies"
    return out


def stage_density(ctx: Ctx) -> dict[str, Any]:
    need_gpu(ctx)
    d_model, hidden, batch = (128, 512, 32) if ctx.cpu else (1024, 4096, 256)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(d_model, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, d_model))
    for m in model:
        if isinstance(m, torch.nn.Linear):
            torch.nn.init.normal_(m.weight, 0.0, 0.02)
            torch.nn.init.zeros_(m.bias)
    model = model.to(ctx.dev)  # fp32 master weights
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, betas=(0.9, 0.999), weight_decay=0.01)
    x = torch.randn(batch, d_model, device=ctx.dev)
    y = torch.randn(batch, d_model, device=ctx.dev)
    warm, steps = (2, 4) if ctx.cpu else (3, 12)
    prev = [p.detach().to(torch.bfloat16) for p in model.parameters()]
    per_step = []
    for step in range(warm + steps):
        xb = x + 0.1 * torch.randn_like(x)
        loss = torch.nn.functional.mse_loss(model(xb), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        cur = [p.detach().to(torch.bfloat16) for p in model.parameters()]
        if step >= warm:
            changed = sum(int((a.view(torch.int16) != b.view(torch.int16)).sum()) for a, b in zip(cur, prev))
            total = sum(a.numel() for a in cur)
            per_step.append(changed / total)
        prev = cur
    return {
        "model": f"MLP {d_model}-{hidden}-{d_model}, fp32 master, AdamW lr 1e-6 wd 0.01, init N(0, 0.02)",
        "params": sum(p.numel() for p in model.parameters()),
        "warmup_steps": warm,
        "per_step": per_step,
        "density": statistics.mean(per_step),
    }


def _rlsync_7b(ctx: Ctx, rlsync: Any, tx_state: dict, rx_state: dict, snapshot_device: str, density: float,
               gen: torch.Generator, version: list[int], until: float,
               transport_device: Any = None) -> dict[str, Any]:
    """rlsync's patch sync of the state at ``density`` per step: timed end to end, then checked. With a CUDA
    ``transport_device`` the payloads are device payloads (handed over in process, as RLinf's variant's)."""
    out: dict[str, Any] = {"snapshot_device": snapshot_device}
    if transport_device is not None:
        out["transport_device"] = str(transport_device)
        out["transport"] = "in process (the payload tensor handed over, no copy)"
    rx_module = as_module(rx_state)

    async def main() -> None:
        if transport_device is None:
            tx, rx = rlsync_pair(rlsync, "patch", snapshot_device)
        else:
            tx, rx = (rlsync.PatchWeightSyncer(snapshot_device=snapshot_device, transport_device=transport_device),
                      rlsync.PatchWeightSyncer(snapshot_device=snapshot_device))
        link = Link()
        t0 = time.perf_counter()
        await rlsync_init(tx, rx, tx_state, rx_module, link)
        ctx.sync()
        out["init_s"] = time.perf_counter() - t0
        reps = []
        # The first sync carries one-time costs (the device snapshot's upload, staging allocations): the next
        # one is planned from the last, not the slowest.
        while len(reps) < 4 and (not reps or time.monotonic() + 1.5 * reps[-1]["e2e_s"] < until):
            perturb(tx_state, density, gen)
            version[0] += 1
            ctx.sync()
            t0 = time.perf_counter()
            await tx.sync(tx_state, link.send, version[0])
            ctx.sync()
            t1 = time.perf_counter()
            got = await rx.apply(rx_module, link.recv)
            ctx.sync()
            t2 = time.perf_counter()
            assert got == version[0], (got, version[0])
            reps.append({"sender_s": t1 - t0, "receiver_s": t2 - t1, "e2e_s": t2 - t0,
                         "sender_report": tx.last_report(), "receiver_report": rx.last_report()})
        timed_reps = reps[1:] if len(reps) > 1 else reps  # the first is a warm-up when there are more
        out["reps"] = reps
        out["timed_reps"] = len(timed_reps)
        for k in ("sender_s", "receiver_s", "e2e_s"):
            out[f"{k[:-2]}_median_s"] = median([r[k] for r in timed_reps])
        for side, key in (("sender", "build_s"), ("sender", "encode_s"), ("sender", "fill_s"),
                          ("receiver", "decode_s"), ("receiver", "read_s"), ("receiver", "check_s"),
                          ("receiver", "apply_s")):
            vals = [r[f"{side}_report"].get(key) for r in timed_reps if r[f"{side}_report"].get(key) is not None]
            out[f"{side}_{key[:-2]}_median_s"] = median(vals)
        out["install_median_s"] = out.get("receiver_apply_median_s")
        out["payload_bytes"] = median([r["sender_report"].get("payload_bytes", 0) for r in timed_reps])
        out["changed"] = median([r["sender_report"].get("changed", 0) for r in timed_reps])
        out["paths"] = sorted({f"{r['sender_report'].get('device')} -> {r['receiver_report'].get('device')}"
                               for r in reps})
        out["full_payloads"] = sum(1 for r in reps if r["sender_report"].get("full"))
        out["receiver_equal"] = states_equal(tx_state, rx_state)
        # The receiver's checksum of CUDA tensors is hashed on the GPU (xxh3_chunks), the sender's is of its
        # snapshot, hashed on the host: equal only if the kernel is XXH3.
        ctx.sync()
        t0 = time.perf_counter()
        rx_sum = rx.checksum(rx_module)
        out["receiver_checksum_s"] = time.perf_counter() - t0
        out["checksums_equal"] = tx.checksum(tx_state) == rx_sum

    asyncio.run(main())
    return out


def _rlinf_7b(ctx: Ctx, tx_state: dict, rx_state: dict, snapshot_device: str, density: float,
              gen: torch.Generator, version: list[int], until: float) -> dict[str, Any]:
    out: dict[str, Any] = {"snapshot_device": snapshot_device, "transport_device": str(ctx.dev),
                           "transport": "in process (the payload object handed over, no copy)"}
    rx_module = as_module(rx_state)
    syncer = RlinfSyncer(snapshot_device, ctx.dev)
    receiver = RlinfSyncer(snapshot_device, ctx.dev)
    t, _ = wall(ctx, lambda: syncer.init_sender(tx_state, rx_state))
    receiver.ordered_keys = list(rx_module.state_dict())
    out["init_s"] = t
    reps = []
    while len(reps) < 3 and (not reps or time.monotonic() + 1.5 * max(r["e2e_s"] for r in reps) < until):
        perturb(tx_state, density, gen)
        version[0] += 1
        build, patch = wall(ctx, lambda: syncer.sync(tx_state, version[0]))
        install, got = wall(ctx, lambda: receiver.apply(rx_module, patch))
        assert got == version[0], (got, version[0])
        reps.append({"sender_s": build, "receiver_s": install, "e2e_s": build + install,
                     "payload_bytes": patch.nbytes() if isinstance(patch, RlinfPatch) else 8})
        del patch
    out["reps"] = reps
    for k in ("sender_s", "receiver_s", "e2e_s"):
        out[f"{k[:-2]}_median_s"] = median([r[k] for r in reps])
    out["receiver_equal"] = states_equal(tx_state, rx_state)
    del syncer
    return out


def stage_timing_7b(ctx: Ctx) -> dict[str, Any]:
    need_gpu(ctx)
    density_rec = ctx.results["stages"].get("density", {})
    density = density_rec.get("density") if density_rec.get("status") == "ok" else None
    out: dict[str, Any] = {"density_source": "density stage" if density else "fallback 0.01 (no density stage)"}
    density = float(density or 0.01)
    out["density"] = density
    shapes = llama2_7b_shapes(ctx.cpu)
    out["tensors"] = len(shapes)
    out["elements"] = numel(shapes)
    out["state_bytes"] = 2 * out["elements"]
    gen = torch.Generator(device=ctx.dev).manual_seed(7)
    t0 = time.perf_counter()
    tx_state = random_state(shapes, ctx.dev, torch.bfloat16, seed=1)
    rx_state = {k: v.clone() for k, v in tx_state.items()}
    ctx.sync()
    out["setup_s"] = time.perf_counter() - t0
    version = [0]
    variants: list[tuple[str, Callable[[float], dict]]] = []

    def full_copy(until: float) -> dict[str, Any]:
        rx_module = as_module(rx_state)
        tx_list, rx_list = list(tx_state.values()), list(rx_state.values())
        res: dict[str, Any] = {}
        t = timed(ctx, lambda: rx_module.load_state_dict(tx_state), 3)
        res["load_state_dict"] = {"median_s": median(t), "all_s": t}
        t = timed(ctx, lambda: [d.copy_(s) for d, s in zip(rx_list, tx_list)], 3)
        res["d2d_copy_per_tensor"] = {"median_s": median(t), "all_s": t}
        t = timed(ctx, lambda: torch._foreach_copy_(rx_list, tx_list), 3)
        res["d2d_foreach_copy"] = {"median_s": median(t), "all_s": t}
        return res

    # Quick first; then the GPU snapshot (rlsync, RLinf), then the CPU snapshot (rlsync, RLinf's default).
    variants.append(("full_copy", full_copy))
    try:
        rlsync = rlsync_module()
    except Skip as e:
        rlsync = None
        out["rlsync_note"] = str(e)
    # On the GPU: the snapshot on the GPU only (the correctness stage runs snapshot_device=cpu; at 7B its
    # one-time pinning of the snapshot copy would eat the stage's time).
    snap_devices = ["cuda"] if ctx.dev.type == "cuda" else ["cpu"]
    # Device payloads (transport_device on the GPU: RLinf's interface without the host round trip) first: the
    # host-coded run after it is the slow one.
    if rlsync is not None and ctx.dev.type == "cuda":
        variants.append(("rlsync_patch_device_payload",
                         lambda until: _rlsync_7b(ctx, rlsync, tx_state, rx_state, "cuda", density, gen, version,
                                                  until, transport_device=ctx.dev)))
    for sd in snap_devices:
        if rlsync is not None:
            variants.append((f"rlsync_patch_snapshot_{sd}",
                             lambda until, sd=sd: _rlsync_7b(ctx, rlsync, tx_state, rx_state, sd, density, gen,
                                                             version, until)))
        variants.append((f"rlinf_snapshot_{sd}",
                         lambda until, sd=sd: _rlinf_7b(ctx, tx_state, rx_state, sd, density, gen, version, until)))
    # Dense buckets of the whole 7B state: packed on the GPU (bucket_device='cuda') against host-staged ('cpu').
    if rlsync is not None and ctx.dev.type == "cuda":
        for bd in ("cuda", "cpu"):
            variants.append((f"rlsync_bucket_device_{bd}",
                             lambda until, bd=bd: _rlsync_bucket_7b(ctx, rlsync, tx_state, rx_state, bd, until)))
    # RLSYNC_CHECK_7B_VARIANTS=name,name keeps only those variants (a short rerun of one of them).
    keep = [v for v in os.environ.get("RLSYNC_CHECK_7B_VARIANTS", "").split(",") if v]
    if keep:
        variants = [(n, f) for n, f in variants if n in keep]
        out["variants_kept"] = keep
    # Each variant gets an equal share of what is left.
    for i, (name, run) in enumerate(variants):
        left = ctx.left()
        if left < 3:
            out[name] = {"status": "skipped", "note": f"budget: {left:.1f} s left in the stage"}
            continue
        until = time.monotonic() + left / (len(variants) - i)
        try:
            out[name] = {"status": "ok", **run(until)}
        except Exception as e:  # noqa: BLE001 - each variant on its own
            out[name] = {"status": "error", "error": error_text(e), "traceback": traceback.format_exc()[-2000:]}
        # A failed or partial variant may leave rx behind tx: realign for the next one.
        with torch.no_grad():
            for k in tx_state:
                rx_state[k].copy_(tx_state[k])
        free_memory()
    # The side-by-side ratios the goals name.
    summary: dict[str, Any] = {}
    ours = out.get("rlsync_patch_snapshot_cuda" if ctx.dev.type == "cuda" else "rlsync_patch_snapshot_cpu", {})
    theirs = out.get("rlinf_snapshot_cuda" if ctx.dev.type == "cuda" else "rlinf_snapshot_cpu", {})
    copy = out.get("full_copy", {})
    roof = ctx.results["stages"].get("rooflines", {}).get("d2d_copy", {}).get("median_s")
    if ours.get("e2e_median_s"):
        if theirs.get("e2e_median_s"):
            summary["rlinf_over_rlsync_e2e"] = theirs["e2e_median_s"] / ours["e2e_median_s"]
        if copy.get("load_state_dict", {}).get("median_s"):
            summary["load_state_dict_over_rlsync_e2e"] = copy["load_state_dict"]["median_s"] / ours["e2e_median_s"]
        build = ours.get("sender_build_median_s")
        if roof and build:
            summary["rlsync_build_over_roofline_copy"] = build / roof
        if build and copy.get("d2d_foreach_copy", {}).get("median_s"):
            summary["rlsync_build_over_state_copy"] = build / copy["d2d_foreach_copy"]["median_s"]
        summary["rlsync_install_s"] = ours.get("install_median_s")
    dev_p = out.get("rlsync_patch_device_payload", {})
    if dev_p.get("e2e_median_s"):
        if theirs.get("e2e_median_s"):
            summary["rlinf_over_rlsync_device_payload_e2e"] = theirs["e2e_median_s"] / dev_p["e2e_median_s"]
        if copy.get("load_state_dict", {}).get("median_s"):
            summary["load_state_dict_over_rlsync_device_payload_e2e"] = (
                copy["load_state_dict"]["median_s"] / dev_p["e2e_median_s"])
        if ours.get("e2e_median_s"):
            summary["host_coded_over_device_payload_e2e"] = ours["e2e_median_s"] / dev_p["e2e_median_s"]
        summary["rlsync_device_payload_install_s"] = dev_p.get("install_median_s")
    gpu_b, host_b = out.get("rlsync_bucket_device_cuda", {}), out.get("rlsync_bucket_device_cpu", {})
    if gpu_b.get("sender_sync_median_s") and host_b.get("sender_sync_median_s"):
        summary["bucket_host_over_gpu_staged_sender"] = host_b["sender_sync_median_s"] / gpu_b["sender_sync_median_s"]
        summary["bucket_host_over_gpu_staged_e2e"] = host_b["e2e_median_s"] / gpu_b["e2e_median_s"]
        summary["bucket_host_over_gpu_staged_apply"] = host_b["apply_median_s"] / gpu_b["apply_median_s"]
    out["summary"] = summary
    return out


def _rlsync_bucket_7b(ctx: Ctx, rlsync: Any, tx_state: dict, rx_state: dict, bucket_device: str,
                      until: float) -> dict[str, Any]:
    """Dense bucket syncs of the 7B state (1 GiB buckets, bf16 on the wire): the sender's sync (pack, hash,
    publish into the in-process link), the receiver's apply, and the end-to-end time; bitwise equal after."""
    tx, rx = rlsync_pair(rlsync, "bucket", bucket_device, bucket_size=1 << 30)
    link = Link()
    res: dict[str, Any] = {"bucket_device": bucket_device}
    t_send, t_apply, t_e2e = [], [], []

    async def main() -> None:
        await rlsync_init(tx, rx, tx_state, rx_state, link)
        first = next(iter(tx_state))
        for v in range(1, 6):
            if v > 2 and time.monotonic() > until:
                break
            with torch.no_grad():
                tx_state[first].view(-1)[v] += 1
            ctx.sync()
            t0 = time.perf_counter()
            await tx.sync(tx_state, link.send, v)
            t1 = time.perf_counter()
            got = await rx.apply(rx_state, link.recv)
            ctx.sync()
            t2 = time.perf_counter()
            if got != v:
                raise RuntimeError(f"apply returned {got}, not {v}")
            t_send.append(t1 - t0)
            t_apply.append(t2 - t1)
            t_e2e.append(t2 - t0)
        res["last_sender_report"] = tx.last_report()
        res["last_receiver_report"] = rx.last_report()

    asyncio.run(main())
    res["syncs"] = len(t_e2e)
    res["sender_sync_median_s"] = median(t_send)
    res["apply_median_s"] = median(t_apply)
    res["e2e_median_s"] = median(t_e2e)
    res["sender_sync_all_s"] = t_send
    res["bitwise_equal"] = states_equal(tx_state, rx_state)
    if not res["bitwise_equal"]:
        raise RuntimeError("the receiver differs from the sender after the bucket syncs")
    return res


def _correctness_run(ctx: Ctx, rlsync: Any, kind: str, device: str, shapes, master: list, params: dict,
                     opt: torch.optim.Optimizer, syncs: int, until: float) -> dict[str, Any]:
    res: dict[str, Any] = {"kind": kind, "device": device, "syncs_planned": syncs}
    rx_state = {k: torch.zeros_like(v) for k, v in params.items()}
    # "patch-cast": the sender syncs the fp32 master weights themselves to bf16 receivers (the device build
    # casts them first); the receivers must hold exactly the bf16 copies (`params`, cast by torch, RNE).
    cast = kind == "patch-cast"
    kind = "patch" if cast else kind
    sender = {name: p.detach() for name, p in zip(params, master)} if cast else params
    kw: dict[str, Any] = {"init_sync_enabled": True} if kind == "patch" else {"bucket_size": 256 << 20}
    if kind == "bucket" and device == "cuda":
        # bf16 state, f32 on the wire: the GPU pack casts every floating tensor (exact both ways).
        kw["bucket_dtype"] = torch.float32
    tx, rx = rlsync_pair(rlsync, kind, device, **kw)
    link = Link()
    failures: list[str] = []

    def step() -> None:
        for p in master:
            p.grad.normal_(0.0, 1e-2)
        opt.step()
        with torch.no_grad():
            for p, name in zip(master, params):
                params[name].copy_(p)

    # On the GPU (patch, and bucket with bucket_device='cuda'): a CPU twin sender syncs host copies of the same
    # states; its payloads must be the GPU sender's bytes exactly (the device build feeds the same encoder, the
    # GPU bucket pack casts bit for bit as the host does).
    twin_syncs = 5 if (device == "cuda" and not ctx.cpu) else 0
    twin_state = {k: v.detach().cpu().clone() for k, v in sender.items()} if twin_syncs else {}

    async def main() -> None:
        await rlsync_init(tx, rx, sender, rx_state, link)
        if kind == "patch" and not states_equal(params, rx_state):
            failures.append("after init (init_sync bootstrap) the receiver differs from the sender")
        twin, twin_link = None, Link()
        if twin_syncs:
            make = rlsync.PatchWeightSyncer if kind == "patch" else rlsync.BucketWeightSyncer
            twin, twin_rx = make(**kw), make(**kw)
            await rlsync_init(twin, twin_rx, twin_state, {k: v.cpu().clone() for k, v in rx_state.items()}, twin_link)
            twin_link.drain()
        res["bytes_equal_cpu_twin"] = []
        version, done, empty_checks, t_sync = 0, 0, 0, []
        for i in range(syncs):
            if time.monotonic() > until and done > 0:
                break
            step()
            version += 1
            t0 = time.perf_counter()
            await tx.sync(sender, link.send, version)
            if twin is not None and i < twin_syncs:
                sent = link.drain()
                for p in sent:
                    await link.to_rx.put(p)
                for k, v in sender.items():
                    twin_state[k].copy_(v)
                await twin.sync(twin_state, twin_link.send, version)
                same = [bytes(memoryview(a)) == bytes(memoryview(b)) for a, b in zip(sent, twin_link.drain())]
                res["bytes_equal_cpu_twin"].append(bool(same) and all(same))
                if not (same and all(same)):
                    failures.append(f"sync {version}: the GPU sender's payload differs from the CPU sender's")
            got = await rx.apply(rx_state, link.recv)
            ctx.sync()
            t_sync.append(time.perf_counter() - t0)
            done += 1
            if got != version:
                failures.append(f"sync {version}: apply returned {got}")
            if not states_equal(params, rx_state):
                bad = [k for k in params if not bit_equal(params[k], rx_state[k])]
                failures.append(f"sync {version}: receiver differs in {len(bad)} tensors, first {bad[0]}")
            if tx.checksum(sender) != rx.checksum(rx_state):
                failures.append(f"sync {version}: checksums differ")
            if kind == "patch" and (i + 1) % 10 == 0:
                # The snapshot equals the state: syncing the unchanged state carries no change.
                version += 1
                await tx.sync(sender, link.send, version)
                report = tx.last_report()
                if report.get("changed") != 0:
                    failures.append(f"sync {version} of an unchanged state carried {report.get('changed')} changes")
                if await rx.apply(rx_state, link.recv) != version:
                    failures.append(f"sync {version}: the empty patch did not apply")
                empty_checks += 1
        res["syncs_done"] = done
        res["empty_patch_checks"] = empty_checks
        if kind == "bucket" and device == "cuda" and not ctx.cpu:
            # The GPU pack ran (not the host staging of CUDA tensors).
            res["sender_device_path"] = tx.last_report().get("device")
            if res["sender_device_path"] != "cuda (device bucket pack)":
                failures.append(f"bucket_device='cuda' sender ran {res['sender_device_path']!r}, not the GPU pack")
            res["receiver_device_path"] = rx.last_report().get("device")
            if res["receiver_device_path"] != "cuda (device bucket install)":
                failures.append(f"bucket_device='cuda' receiver ran {res['receiver_device_path']!r}, not the GPU install")
        if kind == "patch" and device == "cuda" and not ctx.cpu:
            # The device build ran (casting first for patch-cast), not the host staging of CUDA tensors.
            res["sender_device_path"] = tx.last_report().get("device")
            if res["sender_device_path"] != "cuda (device build/install)":
                failures.append(f"patch sender ran {res['sender_device_path']!r}, not the device build")
        res["sync_median_s"] = median(t_sync)
        res["last_sender_report"] = tx.last_report()
        # A payload corrupted in flight: rejected, the receiver's weights and version untouched.
        step()
        version += 1
        await tx.sync(sender, link.send, version)
        payloads = link.drain()
        res["corrupt_payloads_in_version"] = len(payloads)
        before = {k: v.clone() for k, v in rx_state.items()}
        before_version = rx.version
        bad = bytearray(bytes(memoryview(payloads[-1])))
        bad[len(bad) // 2] ^= 0x5A
        for p in payloads[:-1]:
            await link.to_rx.put(p)
        await link.to_rx.put(bytes(bad))
        rejected = False
        try:
            await rx.apply(rx_state, link.recv)
        except rlsync.PayloadRejected as e:
            rejected = True
            res["corrupt_error"] = str(e)[:300]
        link.drain()
        res["corrupt_rejected"] = rejected
        res["corrupt_receiver_untouched"] = states_equal(before, rx_state) and rx.version == before_version
        if not rejected:
            failures.append("a corrupted payload was installed")
        if not res["corrupt_receiver_untouched"]:
            failures.append("a rejected payload changed the receiver")
        for p in payloads:
            await link.to_rx.put(p)
        got = await rx.apply(rx_state, link.recv)
        res["intact_after_corrupt_applied"] = got == version and states_equal(params, rx_state)
        if not res["intact_after_corrupt_applied"]:
            failures.append("the intact payload did not install after the rejection")

    try:
        asyncio.run(main())
    except Exception as e:  # noqa: BLE001 - recorded as a failure of this run
        failures.append(f"raised {error_text(e)}")
        res["traceback"] = traceback.format_exc()[-2000:]
    res["failures"] = failures[:20]
    res["failure_count"] = len(failures)
    res["passed"] = not failures and res.get("syncs_done", 0) > 0
    if res.get("syncs_done", 0) < syncs and not failures:
        res["note"] = f"budget: {res.get('syncs_done')} of {syncs} syncs ran"
    return res


def _payload_spots(head: bytes) -> list[int]:
    """Bytes of a device payload that its checks cover (rlsync's gpu/payload/wire.rs layout): one in the header,
    then per width a directory count and, where it has changes, an index and a value."""
    import struct

    nwidths = head[7]
    spots = [9]
    for k in range(nwidths):
        at = 80 + 64 * k
        _ntiles, entries, dir_off, idx_off, vals_off = struct.unpack_from("<5Q", head, at + 8)
        spots.append(dir_off + 8)
        if entries:
            spots += [idx_off, vals_off + 5]
    return spots


def _transport_cuda_run(ctx: Ctx, rlsync: Any, params: dict, snapshot_device: str = "cuda",
                        syncs: int = 3, mixed: bool = False) -> dict[str, Any]:
    """``PatchWeightSyncer(transport_device=<the GPU>)``: every payload handed to ``send`` is a 1-D uint8 tensor
    on that GPU (RLinf's ``transport_device``), the receiver takes it as it comes and ends equal to the sender.
    ``mixed``: every other tensor of the receiver's state dict is a CPU tensor (each device installs its own)."""
    res: dict[str, Any] = {"kind": "patch", "transport_device": str(ctx.dev), "snapshot_device": snapshot_device,
                           "receiver_devices": "cuda+cpu" if mixed else "cuda"}
    failures: list[str] = []
    tx_state = {k: v.clone() for k, v in params.items()}
    rx_state = {k: torch.zeros_like(v, device="cpu" if mixed and i % 2 else None)
                for i, (k, v) in enumerate(params.items())}
    tx = rlsync.PatchWeightSyncer(snapshot_device=snapshot_device, transport_device=ctx.dev, init_sync_enabled=True)
    rx = rlsync.PatchWeightSyncer(snapshot_device="cuda", init_sync_enabled=True)
    link = Link()
    kinds: set[str] = set()

    async def send(p: Any) -> None:
        kinds.add(f"{type(p).__name__}:{getattr(p, 'device', '-')}:{getattr(p, 'dtype', '-')}")
        await link.send(p)

    async def main() -> None:
        await asyncio.gather(tx.init_sender(tx_state, list(tx_state), send, link.up_recv),
                             rx.init_receiver(rx_state, link.recv, link.up_send))
        gen = torch.Generator(device=ctx.dev).manual_seed(7)
        for v in range(1, syncs + 1):
            perturb(tx_state, 0.01, gen)
            await tx.sync(tx_state, send, v)
            if await rx.apply(rx_state, link.recv) != v:
                failures.append(f"sync {v}: another version applied")
            if not states_equal(tx_state, rx_state):
                failures.append(f"sync {v}: the receiver differs from the sender")
            if tx.checksum(tx_state) != rx.checksum(rx_state):
                failures.append(f"sync {v}: the checksums differ")
        res["sender_path"] = tx.last_report().get("device")
        res["receiver_path"] = rx.last_report().get("device")
        want = "cuda+cpu (device payload)" if mixed else "cuda (device payload)"
        if res["sender_path"] != "cuda (device payload)" or res["receiver_path"] != want:
            failures.append(f"not device payloads: {res['sender_path']} -> {res['receiver_path']}")
        # Device payloads corrupted in transit: a byte of the header, of the first width's directory, of its
        # pools; each rejected with the receiver untouched, then the intact payload installs.
        perturb(tx_state, 0.01, gen)
        v = syncs + 1
        await tx.sync(tx_state, send, v)
        good = (await link.recv()).clone()
        spots = _payload_spots(bytes(good[:512].cpu().tolist()))
        rejected = 0
        for at in spots:
            bad = good.clone()
            bad[at] ^= 0x10
            before = {k: t.clone() for k, t in rx_state.items()}
            await link.send(bad)
            try:
                await rx.apply(rx_state, link.recv)
                failures.append(f"a payload with byte {at} flipped was installed")
            except rlsync.PayloadRejected:
                rejected += 1
            if not states_equal(before, rx_state):
                failures.append(f"a rejected payload (byte {at}) changed the receiver")
        res["corrupted_rejected"] = f"{rejected}/{len(spots)}"
        await link.send(good)
        if await rx.apply(rx_state, link.recv) != v or not states_equal(tx_state, rx_state):
            failures.append("the intact payload after the corrupted ones did not install")
        # A payload lost in transit: the next one is full and the receiver catches up.
        perturb(tx_state, 0.01, gen)

        async def lose(p: Any) -> None:
            raise ConnectionError("lost in transit (the check's transport)")

        try:
            await tx.sync(tx_state, lose, v + 1)
        except ConnectionError:
            pass
        perturb(tx_state, 0.01, gen)
        await tx.sync(tx_state, send, v + 2)
        res["after_loss_full"] = bool(tx.last_report().get("full"))
        if await rx.apply(rx_state, link.recv) != v + 2 or not states_equal(tx_state, rx_state):
            failures.append("after a lost payload the receiver did not catch up")

    try:
        asyncio.run(main())
    except Exception as e:  # noqa: BLE001 - recorded as a failure of this run
        failures.append(f"raised {error_text(e)}")
    # torch names a device with its index ("cuda:0"); the one asked for may omit it ("cuda").
    index = ctx.dev.index if ctx.dev.index is not None else torch.cuda.current_device()
    want = f"Tensor:{torch.device(ctx.dev.type, index)}:torch.uint8"
    res["payload_kinds"] = sorted(kinds)
    if kinds != {want}:
        failures.append(f"send was handed {sorted(kinds)}, not only {want}")
    res["failures"] = failures[:10]
    res["passed"] = not failures
    return res


def stage_correctness(ctx: Ctx) -> dict[str, Any]:
    need_gpu(ctx)
    rlsync = rlsync_module()
    shapes = qwen2_1p5b_shapes(ctx.cpu)
    out: dict[str, Any] = {"shapes": "Qwen2-1.5B" if not ctx.cpu else "Qwen2-1.5B layout, tiny",
                           "tensors": len(shapes), "elements": numel(shapes)}
    master_state = random_state(shapes, ctx.dev, torch.float32, seed=3)
    master = [torch.nn.Parameter(t) for t in master_state.values()]
    for p in master:
        p.grad = torch.zeros_like(p)
    opt = torch.optim.AdamW(master, lr=1e-6, weight_decay=0.01, fused=ctx.dev.type == "cuda")
    params = {name: p.detach().to(torch.bfloat16) for name, p in zip(master_state, master)}
    del master_state
    # ("bucket", "cuda"): bucket_device='cuda', packed and cast on the GPU; ("bucket", "cpu"): host-staged.
    runs = [("patch", "cuda"), ("bucket", "cuda"), ("patch-cast", "cuda"), ("patch", "cpu"), ("bucket", "cpu")] \
        if ctx.dev.type == "cuda" else [("patch", "cpu"), ("bucket", "cpu"), ("patch-cast", "cpu")]
    results = []
    # The first run (the GPU path on a GPU) gets half the stage, the others share the rest.
    weights = [2.0] + [1.0] * (len(runs) - 1)
    for i, (kind, device) in enumerate(runs):
        left = ctx.left()
        if left < 3:
            results.append({"kind": kind, "device": device, "status": "skipped",
                            "note": f"budget: {left:.1f} s left in the stage"})
            continue
        until = time.monotonic() + left * weights[i] / sum(weights[i:])
        results.append(_correctness_run(ctx, rlsync, kind, device, shapes, master, params, opt, 30, until))
        free_memory()
    # Device payloads with the snapshot copy on the GPU, then in pinned host memory (RLinf's default).
    for sd in ("cuda", "cpu"):
        if ctx.dev.type == "cuda" and ctx.left() > 3:
            results.append(_transport_cuda_run(ctx, rlsync, params, sd))
            free_memory()
    # A receiver on the GPU and the CPU (the CPU share checks every payload by the kernels' reference on the
    # host: a few small tensors keep that short).
    if ctx.dev.type == "cuda" and ctx.left() > 3:
        small = dict(list((k, v) for k, v in params.items() if v.numel() <= 1 << 22)[:16])
        results.append(_transport_cuda_run(ctx, rlsync, small, "cuda", mixed=True))
        free_memory()
    out["runs"] = results
    ran = [r for r in results if "passed" in r]
    out["passed"] = bool(ran) and all(r["passed"] for r in ran)
    out["syncs_verified"] = sum(r.get("syncs_done", 0) for r in ran)
    out["corrupt_rejected"] = f"{sum(bool(r.get('corrupt_rejected')) for r in ran)}/{len(ran)}"
    if not out["passed"]:
        out["status"] = "failed"
    return out


SANITIZER_CHILD = r"""
import asyncio, sys, torch, rlsync
dev = sys.argv[1]
tx_sd = {"w": torch.randn(300, 70, device=dev).to(torch.bfloat16), "b": torch.randn(70, device=dev)}
rx_sd = {k: torch.zeros_like(v) for k, v in tx_sd.items()}
async def main():
    q_rx, q_tx = asyncio.Queue(), asyncio.Queue()
    for kind in ("patch", "bucket"):
        for k in rx_sd: rx_sd[k].zero_()
        dkey = "snapshot_device" if kind == "patch" else "bucket_device"
        make = rlsync.PatchWeightSyncer if kind == "patch" else rlsync.BucketWeightSyncer
        extra = {"init_sync_enabled": True} if kind == "patch" else {}
        where = dev  # bucket: packed (cast_gather) on the GPU
        tx, rx = make(**{dkey: where}, **extra), make(**{dkey: where}, **extra)
        await asyncio.gather(tx.init_sender(tx_sd, list(tx_sd), q_rx.put, q_tx.get), rx.init_receiver(rx_sd, q_rx.get, q_tx.put))
        for v in range(1, 4):
            with torch.no_grad():
                tx_sd["w"][v] += 1; tx_sd["b"][v] -= 1
            await tx.sync(tx_sd, q_rx.put, v)
            assert await rx.apply(rx_sd, q_rx.get) == v
            assert all(torch.equal(tx_sd[k], rx_sd[k]) for k in tx_sd), kind
    torch.cuda.synchronize()
    print("sanitizer child: ok")
asyncio.run(main())
"""


def stage_sanitizer(ctx: Ctx) -> dict[str, Any]:
    if ctx.cpu:
        raise Skip("--cpu: compute-sanitizer needs a GPU")
    need_gpu(ctx)
    tool = shutil.which("compute-sanitizer")
    if tool is None:
        raise Skip("compute-sanitizer is not on PATH")
    rlsync_module()
    with tempfile.TemporaryDirectory() as d:
        child = Path(d) / "sanitizer_child.py"
        child.write_text(SANITIZER_CHILD)
        cmd = [tool, "--tool", "memcheck", "--leak-check", "no", "--error-exitcode", "3",
               sys.executable, str(child), "cuda"]
        limit = max(5.0, ctx.left() - 1)
        t0 = time.perf_counter()
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, env=os.environ.copy())
        except subprocess.TimeoutExpired as e:
            tail = (e.stdout or b"")
            tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
            return {"status": "failed", "note": f"timed out after {limit:.0f} s", "output_tail": tail[-2000:]}
    text = p.stdout + p.stderr
    summary = [line for line in text.splitlines() if "ERROR SUMMARY" in line]
    out = {"returncode": p.returncode, "wall_s": time.perf_counter() - t0,
           "summary": summary[-1] if summary else None, "child_ok": "sanitizer child: ok" in text,
           "output_tail": text[-2000:]}
    if p.returncode != 0 or not out["child_ok"]:
        out["status"] = "failed"
    return out


def gym_run(ctx: Ctx, device: str, steps: int, extra: list[str]) -> dict[str, Any]:
    """One run of the gym_ppo example through the binary: its behav KL and sync checks from the metrics, each
    worker's sync path from its log."""
    run_dir = Path(tempfile.mkdtemp(prefix="rlsync-gpu-check-gym-"))
    cmd = [str(ctx.bin), "train_embodied", "--config-name", "gym_reacher",
           f"actor.worker.device={device}", f"rollout.worker.device={device}",
           f"actor.worker.python={sys.executable}", f"rollout.worker.python={sys.executable}",
           f"runner.max_steps={steps}", "runner.val_check_interval=-1", f"hydra.run.dir={run_dir / 'run'}", *extra]
    if ctx.cpu:
        cmd += ["env.train.total_num_envs=4", "rollout.chunk_steps=32", "algorithm.update_epoch=2",
                "actor.global_batch_size=64"]
    limit = max(5.0, ctx.left() - 1)
    t0 = time.perf_counter()
    out: dict[str, Any] = {"command": " ".join(cmd[1:]), "device": device}
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, cwd=ROOT)
    except subprocess.TimeoutExpired:
        shutil.rmtree(run_dir, ignore_errors=True)
        return {**out, "status": "failed", "note": f"timed out after {limit:.0f} s"}
    out["wall_s"] = time.perf_counter() - t0
    out["returncode"] = p.returncode
    rows = []
    metrics = run_dir / "run" / "metrics.jsonl"
    if metrics.exists():
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    kl = [r["actor/behav_approx_kl"] for r in rows if "actor/behav_approx_kl" in r]
    out["updates"] = len(kl)
    out["behav_kl"] = kl
    out["behav_kl_max_abs"] = max((abs(k) for k in kl), default=None)
    out["weights_match"] = [r["actor/weights_match"] for r in rows if "actor/weights_match" in r]
    out["sync_verified"] = all(r["sync/verified"] for r in rows if "sync/verified" in r)
    # Which sync path each worker took (its log says so when its syncs run on the device).
    paths = {}
    for log in sorted((run_dir / "run" / "logs").glob("*.log")):
        said = [line.split("from now on: ", 1)[1].strip() for line in log.read_text(errors="replace").splitlines()
                if "from now on: " in line]
        paths[log.stem] = said[-1] if said else "host copies"
    out["sync_paths"] = paths
    if p.returncode != 0 or not kl:
        out["status"] = "failed"
        out["stderr_tail"] = p.stderr[-3000:]
    elif device == "cuda" and not (paths and all("device" in v for v in paths.values())):
        out["status"] = "failed"
        out["note"] = "a worker synced its CUDA model through host copies, not on the device"
    elif device == "cpu" and any(v != "host copies" for v in paths.values()):
        out["status"] = "failed"
        out["note"] = "a worker with a CPU model claims a device sync path"
    shutil.rmtree(run_dir, ignore_errors=True)
    return out


def stage_gym_ppo(ctx: Ctx) -> dict[str, Any]:
    """The example on the device with the patch syncer (3 updates), then with the bucket syncer packing and
    installing on the device (``bucket_device=cuda``, 2 updates; on the CPU it stages on the host), then over
    the same-host GPU channel (``transport_device=cuda``, 3 updates; GPU only)."""
    need_gpu(ctx)
    for mod in ("gymnasium", "mujoco"):
        try:
            __import__(mod)
        except Exception as e:  # noqa: BLE001
            raise Skip(f"{mod} is not importable ({error_text(e)}): bring its wheels (scripts/gpu_wheels.sh)")
    rlsync_module()
    if not ctx.bin.exists():
        raise Skip(f"the rlsync binary is missing: {ctx.bin}")
    device = "cuda" if ctx.dev.type == "cuda" else "cpu"
    out = gym_run(ctx, device, 3, [])
    if ctx.left() < 10:
        out["bucket"] = {"status": "skipped", "note": f"{ctx.left():.0f} s left of the stage's share"}
        return out
    bucket = gym_run(ctx, device, 2, ["weight_syncer=bucket_syncer", "weight_syncer.bucket.bucket_device=cuda"])
    out["bucket"] = bucket
    if bucket.get("status") == "failed" and out.get("status") != "failed":
        out["status"] = "failed"
        out["note"] = f"the bucket run failed: {bucket.get('note') or 'see bucket'}"
    # The same-host GPU channel (transport_device=cuda) needs the models on the GPU: the runtime's own
    # device-to-device path, after a host handshake and bootstrap.
    if device != "cuda":
        out["gpu_channel"] = {"status": "skipped", "note": "the GPU channel needs the models on a GPU"}
    elif ctx.left() < 10:
        out["gpu_channel"] = {"status": "skipped", "note": f"{ctx.left():.0f} s left of the stage's share"}
    else:
        channel = gym_run(ctx, device, 3, ["weight_syncer.patch.transport_device=cuda",
                                           "weight_syncer.patch.snapshot_device=cuda"])
        if channel.get("status") != "failed" and not all(
                "GPU channel" in v for v in channel.get("sync_paths", {}).values()):
            channel["status"] = "failed"
            channel["note"] = "a worker did not sync over the same-host GPU channel"
        out["gpu_channel"] = channel
        if channel.get("status") == "failed" and out.get("status") != "failed":
            out["status"] = "failed"
            out["note"] = f"the GPU channel run failed: {channel.get('note') or 'see gpu_channel'}"
    return out


def json_lines(text: str) -> list[Any]:
    """The lines of ``text`` that are JSON values (kernel_check prints one object per line)."""
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def stage_kernels(ctx: Ctx) -> dict[str, Any]:
    """The committed PTX on the device, without the binding: scripts/kernel_check.cpp (driver API) checks every
    kernel and width against its host model, then times diff_compact against a D2D copy; memcheck and
    racecheck run its small mode when compute-sanitizer is there."""
    if ctx.cpu:
        raise Skip("--cpu: the kernels need a GPU (their CPU reference runs in cargo test)")
    need_gpu(ctx)
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise Skip("no C++ compiler on PATH")
    cuda_home = os.environ.get("CUDA_HOME") or ("/usr/local/cuda" if Path("/usr/local/cuda").exists() else None)
    if cuda_home is None and shutil.which("nvcc"):
        cuda_home = str(Path(shutil.which("nvcc")).resolve().parent.parent)
    if cuda_home is None:
        raise Skip("no CUDA toolkit (CUDA_HOME, /usr/local/cuda, nvcc)")
    ptx = ROOT / "crates/rlsync-core/kernels/rlsync.ptx"
    out: dict[str, Any] = {"ptx": str(ptx)}
    with tempfile.TemporaryDirectory() as d:
        exe = Path(d) / "kernel_check"
        build = subprocess.run([cxx, "-O2", "-std=c++17", f"-I{cuda_home}/include", str(ROOT / "scripts/kernel_check.cpp"),
                                "-o", str(exe), f"-L{cuda_home}/lib64/stubs", "-lcuda"],
                               capture_output=True, text=True, timeout=60)
        if build.returncode != 0:
            return {"status": "failed", "note": "kernel_check did not build", "output_tail": build.stderr[-2000:]}
        # Correctness first (small sizes), under the sanitizers, then the full run with its timings.
        runs = [("check_small", [str(exe), str(ptx), "--small"])]
        tool = shutil.which("compute-sanitizer")
        if tool:
            runs += [(f"sanitizer_{t}", [tool, "--tool", t, "--error-exitcode", "3", str(exe), str(ptx), "--small"])
                     for t in ("memcheck", "racecheck")]
        runs.append(("check_and_timing", [str(exe), str(ptx)]))
        failed = False
        for name, cmd in runs:
            limit = max(3.0, ctx.left() - 1)
            try:
                p = subprocess.run(cmd, capture_output=True, text=True, timeout=limit)
            except subprocess.TimeoutExpired as e:
                # kernel_check's stdout is line-buffered: what it printed before the limit is kept.
                partial = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
                out[name] = {"status": "timeout", "limit_s": limit, "results": json_lines(partial)}
                failed = True
                break
            summary = [x for x in (p.stdout + p.stderr).splitlines() if "ERROR SUMMARY" in x or "RACECHECK SUMMARY" in x]
            out[name] = {"returncode": p.returncode, "results": json_lines(p.stdout), "summary": summary[-1:] or None,
                         "stderr_tail": p.stderr[-1500:]}
            failed |= p.returncode != 0
    if failed:
        out["status"] = "failed"
    return out


def stage_ipc(ctx: Ctx) -> dict[str, Any]:
    """The same-host GPU channel (python/bench/gpu_check_ipc.py): 7B bf16 to 1 and 2 receiver processes."""
    # Imported here, so the two modules never import each other half-loaded.
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import gpu_check_ipc

    return gpu_check_ipc.stage_ipc(ctx.results, cpu=ctx.cpu, deadline=ctx.deadline)


STAGE_FNS: dict[str, Callable[[Ctx], dict[str, Any]]] = {
    "env": stage_env,
    "ipc": stage_ipc,
    "kernels": stage_kernels,
    "rooflines": stage_rooflines,
    "density": stage_density,
    "timing_7b": stage_timing_7b,
    "correctness": stage_correctness,
    "sanitizer": stage_sanitizer,
    "gym_ppo": stage_gym_ppo,
}


# -------------------------------------------------------------------------------------------------------------
# driver


def default_bin() -> Path:
    if os.environ.get("RLSYNC_BIN"):
        return Path(os.environ["RLSYNC_BIN"])
    shipped = ROOT / "dist" / "rlsync"
    return shipped if shipped.exists() else ROOT / "target" / "release" / "rlsync"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="every stage with small sizes on CPU tensors (a dry run)")
    ap.add_argument("--out", type=Path, default=None, help="the results JSON (default gpu_check.json / "
                    "gpu_check_cpu.json in the current directory)")
    ap.add_argument("--budget", type=float, default=280.0, help="seconds for all stages (default 280)")
    ap.add_argument("--stages", default=",".join(s for s, _, _ in STAGES),
                    help="comma-separated stages to run, in the fixed order (default all)")
    ap.add_argument("--bin", type=Path, default=default_bin(),
                    help="the rlsync binary (default $RLSYNC_BIN, else dist/rlsync, else target/release/rlsync)")
    args = ap.parse_args(argv)
    wanted = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = [s for s in wanted if s not in STAGE_FNS]
    if unknown:
        ap.error(f"unknown stages {unknown}; known: {list(STAGE_FNS)}")
    out = args.out or Path("gpu_check_cpu.json" if args.cpu else "gpu_check.json")
    start = time.monotonic()
    end = start + args.budget
    dev = torch.device("cpu" if args.cpu else "cuda")
    results: dict[str, Any] = {
        "schema": SCHEMA_VERSION,
        "script": "python/bench/gpu_check.py",
        "mode": "cpu" if args.cpu else "gpu",
        "started": now_iso(),
        "budget_s": args.budget,
        "rlinf_commit": RLINF_COMMIT,
        "stage_order": [s for s, _, _ in STAGES],
        "stages": {},
    }
    write_results(out, results)
    if not args.cpu and not torch.cuda.is_available():
        results["note"] = "no CUDA device (torch.cuda.is_available() is False): the GPU stages are skipped; " \
                          "--cpu runs them on the CPU"
    bad = False
    for name, share, least in STAGES:
        if name not in wanted:
            continue
        left = end - time.monotonic()
        rec: dict[str, Any]
        if left < least:
            rec = {"status": "skipped", "note": f"budget: {left:.1f} s left, the stage needs {least:.0f} s"}
        else:
            ctx = Ctx(cpu=args.cpu, dev=dev, out=out, deadline=time.monotonic() + min(share, left),
                      results=results, bin=args.bin)
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            print(f"gpu_check: {name} (at most {min(share, left):.0f} s)", file=sys.stderr, flush=True)
            try:
                rec = STAGE_FNS[name](ctx)
                rec = {"status": rec.pop("status", "ok"), **rec}
            except Skip as e:
                rec = {"status": "skipped", "note": str(e)}
            except Exception as e:  # noqa: BLE001 - a stage's crash is recorded, the next stages still run
                rec = {"status": "error", "error": error_text(e), "traceback": traceback.format_exc()[-3000:]}
            free_memory()
            rec["elapsed_s"] = round(time.perf_counter() - t0, 3)
            if torch.cuda.is_available():
                rec["peak_gpu_bytes"] = torch.cuda.max_memory_allocated()
        results["stages"][name] = rec
        bad |= rec["status"] in ("failed", "error")
        print(f"gpu_check: {name}: {rec['status']}" + (f" ({rec.get('note') or rec.get('error')})"
              if rec["status"] != "ok" else ""), file=sys.stderr, flush=True)
        write_results(out, results)
    results["finished"] = now_iso()
    results["elapsed_s"] = round(time.monotonic() - start, 3)
    write_results(out, results)
    print(f"gpu_check: results in {out}", file=sys.stderr, flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
