"""gpu_check's ``ipc`` stage: the same-host GPU channel (``rlsync.cuda_ipc_sender`` / ``cuda_ipc_receiver``) on
Llama-2-7B's tensors in bf16, to 1 and then 2 receiver processes on cuda:0.

Per phase (1 receiver, then 2, then 1 with casts: an fp32 sender of the first layers, its receiver in bf16)
the sender (this process) binds a socket, the receivers (``multiprocessing``
spawn) allocate zeroed tensors, share them with this process (torch's CUDA IPC, for the check only) and connect;
the bootstrap (full copy) makes them equal to the sender; then ``syncs`` times: flip ``density`` of the sender's
bits, ``sync(version)`` timed end to end (build on the GPU, control message, every receiver's install and ack),
then every receiver compared bitwise (``torch.equal`` on integer views) with the sender. Each ack carries the
receiver's phases (``per_receiver`` of the report: sync sent → read by the receiver, the caller's queued work
on its stream, the pool checksum, the install, the ack's way back): their medians per rank are recorded, so a
run says where the receiver's time goes and whether two receivers' kernels overlap on one GPU. At the end the
sender's buffers are freed and the children exit; the device's free memory must come back.

Call it from gpu_check.py (a ``Ctx``-free function, so the file stands alone)::

    from gpu_check_ipc import stage_ipc
    # lazily, so the two modules never import each other half-initialised:
    STAGE_FNS["ipc"] = lambda ctx: __import__("gpu_check_ipc").stage_ipc(
        ctx.results, cpu=ctx.cpu, deadline=ctx.deadline)
    # and ("ipc", 60, 30) in STAGES, after timing_7b (it reads the density stage's result when there is one)

or run it alone: ``python python/bench/gpu_check_ipc.py [--cpu] [--density 0.01] [--syncs 10]`` (prints JSON).
"""

from __future__ import annotations

import gc
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check import bit_equal, llama2_7b_shapes, perturb  # noqa: E402 - gpu_check's helpers, beside this file


FALLBACK_DENSITY = 0.01
# The cast phase's tensors: the first of the 7B list (the embedding and the first two layers, ~0.5 G elements).
CAST_TENSORS = 19
# The receiver phases an ack reports (the report's ``per_receiver`` entries).
PHASES = ("total_s", "wake_s", "drain_s", "check_s", "apply_s", "reply_s")
TIMEOUT_S = 120.0


def _median(xs: list[float]) -> float | None:
    s = sorted(xs)
    return s[len(s) // 2] if s else None


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _receiver(path: str, rank: int, shapes: list, conn: Any, device: str = "cuda:0", module: str = "rlsync",
              wait: float = TIMEOUT_S, dtype: torch.dtype = torch.bfloat16) -> None:
    """A receiver process: zeroed ``dtype`` tensors on ``device``, shared with the parent, then apply until the
    sender closes. ``module``: the package with ``cuda_ipc_receiver`` (a fake in the CPU test of this stage)."""
    try:
        import importlib

        import torch.multiprocessing as _tmp  # noqa: F401 - registers the CUDA tensor reductions for the pipe

        rl = importlib.import_module(module)
        dev = torch.device(device)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        state = {n: torch.zeros(s, device=dev, dtype=dtype) for n, s in shapes}
        _sync(dev)
        conn.send(("state", state))
        rx = rl.cuda_ipc_receiver(path, rank, state, timeout=wait)
        while True:
            try:
                v = rx.apply(timeout=wait * 3)
            except rl.TransportError as e:  # the sender closed the channel: the phase is over
                conn.send(("closed", str(e)))
                break
            conn.send(("applied", v))
        rx.close()
        conn.recv()  # the parent released its views of our tensors
        del state
    except Exception as e:  # noqa: BLE001 - reported to the parent
        try:
            conn.send(("error", f"{type(e).__name__}: {e}", traceback.format_exc()[-2000:]))
        except Exception:  # noqa: BLE001
            pass


def perturb_values(state: dict[str, torch.Tensor], density: float, gen: torch.Generator) -> None:
    """Scale ``density`` of the elements of every tensor by 1.01 (a change a bf16 copy sees: its epsilon is
    2^-8), as an fp32 master copy's update does."""
    for t in state.values():
        mask = torch.rand(t.shape, device=t.device, generator=gen) < density
        t.mul_(1.0 + 0.01 * mask.to(t.dtype))


def _phase(rlsync: Any, n: int, shapes: list, state: dict[str, torch.Tensor], density: float, syncs: int,
           deadline: float, sock_dir: str, module: str = "rlsync", dtype: torch.dtype | None = None) -> dict[str, Any]:
    """One phase with ``n`` receiver processes on the device of ``state``; its record. ``dtype``: the receivers
    hold the floating tensors in it (the sender casts on its GPU), each compared with ``tensor.to(dtype)``."""
    ctx = mp.get_context("spawn")
    dev = next(iter(state.values())).device
    # Every wait ends by the stage's deadline (at least 15 s, at most TIMEOUT_S): a hang costs no more device time.
    wait = max(15.0, min(TIMEOUT_S, deadline - time.monotonic()))
    tag = "" if dtype is None else f"-{str(dtype).removeprefix('torch.')}"
    path = os.path.join(sock_dir, f"gpu{n}{tag}.sock")
    out: dict[str, Any] = {"receivers": n}
    held = next(iter(state.values())).dtype if dtype is None else dtype
    change = perturb if dtype is None else perturb_values
    cast = {} if dtype is None else {"dtype": dtype}
    if dtype is not None:
        out["cast"] = f"{str(next(iter(state.values())).dtype).removeprefix('torch.')} -> {tag[1:]}"
    # Two receivers: elastic, so one can be killed and rejoin (below).
    tx = rlsync.cuda_ipc_sender(path, state, receivers=n, timeout=wait, elastic=n == 2, **cast)
    out["socket_mode"] = oct(os.stat(path).st_mode & 0o777)
    procs, conns, views = [], [], []
    try:
        for rank in range(n):
            a, b = ctx.Pipe()
            p = ctx.Process(target=_receiver, args=(path, rank, shapes, b, str(dev), module, wait, held),
                            daemon=True)
            p.start()
            procs.append(p)
            conns.append(a)
        for rank, c in enumerate(conns):
            if not c.poll(wait):
                raise RuntimeError(f"receiver {rank} did not start within {wait:.0f} s")
            msg = c.recv()
            if msg[0] != "state":
                raise RuntimeError(f"receiver {rank}: {msg}")
            views.append(msg[1])
        msg = None  # holds no receiver's tensors past the phase

        def check(rank: int, version: int) -> bool:
            c = conns[rank]
            if not c.poll(wait):
                raise RuntimeError(f"receiver {rank} reported nothing after the ack")
            msg = c.recv()
            if msg[0] != "applied" or msg[1] != version:
                raise RuntimeError(f"receiver {rank}: {msg}")
            return all(bit_equal(views[rank][k], t if dtype is None else t.to(dtype)) for k, t in state.items())

        _sync(dev)
        t0 = time.perf_counter()
        rep = tx.bootstrap(0)
        out["bootstrap_s"] = round(time.perf_counter() - t0, 6)
        out["bootstrap_equal"] = [check(r, 0) for r in range(n)]
        gen = torch.Generator(device=dev).manual_seed(1234 + n)
        times, builds, acks, changes, equal = [], [], [], [], []
        phases: dict[int, dict[str, list[float]]] = {}
        for v in range(1, syncs + 1):
            if time.monotonic() > deadline:
                out["note"] = f"budget: stopped after {v - 1} syncs"
                break
            change(state, density, gen)
            _sync(dev)
            t0 = time.perf_counter()
            rep = tx.sync(v)
            times.append(time.perf_counter() - t0)
            builds.append(rep["build_s"])
            acks.append(rep["acks_s"])
            for p in rep.get("per_receiver", []):
                ph = phases.setdefault(p["rank"], {})
                for k in PHASES:
                    ph.setdefault(k, []).append(p[k])
            changes.append(sum(c for _, c, _ in rep["widths"]))
            if any(o for _, _, o in rep["widths"]):
                out.setdefault("overflowed_syncs", []).append(v)
            per_rank = [check(r, v) for r in range(n)]  # every receiver's report drained
            equal.append(all(per_rank))

        def kill_and_rejoin(version: int) -> dict[str, Any]:
            """Receiver 1 is SIGKILLed (this process's views of its tensors released first), a sync goes on
            without it (the elastic sender drops it), a new receiver process of rank 1 rejoins by a full copy of
            that version, and one more sync reaches both, bitwise."""
            rec: dict[str, Any] = {}
            views[1] = None
            gc.collect()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
                torch.cuda.ipc_collect()
            procs[1].kill()
            procs[1].join(30)
            rec["killed_exitcode"] = procs[1].exitcode
            conns[1].close()
            change(state, density, gen)
            _sync(dev)
            rep = tx.sync(version)
            rec["dropped"] = rep.get("dropped")
            rec["survivor_equal"] = check(0, version)
            a, b = ctx.Pipe()
            p = ctx.Process(target=_receiver, args=(path, 1, shapes, b, str(dev), module, wait, held), daemon=True)
            p.start()
            procs[1], conns[1] = p, a
            if not a.poll(wait):
                raise RuntimeError(f"the new receiver 1 did not start within {wait:.0f} s")
            msg = a.recv()
            if msg[0] != "state":
                raise RuntimeError(f"the new receiver 1: {msg}")
            views[1] = msg[1]
            t0 = time.perf_counter()
            rep = tx.rejoin(1)
            rec["rejoin_s"] = round(time.perf_counter() - t0, 6)
            rec["rejoin_version"], rec["rejoin_full"] = rep["version"], rep["full"]
            rec["rejoined_equal"] = check(1, version)
            change(state, density, gen)
            _sync(dev)
            rep = tx.sync(version + 1)
            rec["after_receivers"] = rep["receivers"]
            rec["after_equal"] = [check(r, version + 1) for r in range(2)]
            rec["ok"] = (rec["dropped"] == [1] and rec["survivor_equal"] and rec["rejoin_full"]
                         and rec["rejoin_version"] == version and rec["rejoined_equal"] and all(rec["after_equal"]))
            return rec

        if n == 2:
            if time.monotonic() < deadline:
                out["rejoin"] = kill_and_rejoin(len(times) + 1)
            else:
                out["rejoin_note"] = "budget: the kill-and-rejoin step did not run"
        out.update({
            "syncs": len(times),
            "sync_s": [round(x, 6) for x in times],
            "sync_median_s": _median(times),
            "build_median_s": _median(builds),
            "acks_median_s": _median(acks),
            # Per rank: the median of each phase of its part of a sync (seconds; see the module docs).
            "receiver_phases_median_s": [
                {"rank": r, **{k: _median(v) for k, v in sorted(ph.items())}} for r, ph in sorted(phases.items())
            ],
            "checksums_last": rep.get("checksums"),
            # Syncs the sender sent as a full copy because its own checksum's count disagreed with its diff
            # kernel's (a fault on the sender's device): 0 unless something is wrong.
            "fallbacks": rep.get("fallbacks"),
            # The receivers' device phases (checksum + install) summed over ranks, against the acks' median: near
            # equal with 2 receivers on one GPU means their kernels ran one after the other (time-slicing
            # between processes), near one receiver's means they overlapped.
            "device_phases_sum_s": sum(_median(ph.get(k, [])) or 0.0 for ph in phases.values()
                                       for k in ("check_s", "apply_s")),
            "changes": changes,
            "equal_after_each": equal,
            "all_equal": all(equal) and all(out["bootstrap_equal"]),
        })
    finally:
        views.clear()
        tx.close()
        for c in conns:
            try:
                if c.poll(wait):
                    c.recv()  # "closed" (or an error)
            except (EOFError, OSError):
                pass
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            torch.cuda.ipc_collect()
        for c in conns:
            try:
                c.send("bye")
            except (BrokenPipeError, OSError):
                pass
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        out["exitcodes"] = [p.exitcode for p in procs]
    out["socket_removed"] = not os.path.exists(path)
    return out


def stage_ipc(results: dict[str, Any] | None = None, *, cpu: bool = False, density: float | None = None,
              syncs: int = 10, deadline: float | None = None) -> dict[str, Any]:
    """The stage's record (``status`` ok | failed | skipped, timings in seconds). ``density``: share of elements
    changed per sync (default: the density stage's result in ``results``, else 1 %). ``deadline``:
    ``time.monotonic()`` after which no further sync starts."""
    if cpu:
        return {"status": "skipped", "note": "--cpu: the GPU channel needs CUDA (its protocol is tested by "
                "`cargo test -p rlsync-core gpu::ipc` and python/tests/test_ipc.py)"}
    if not torch.cuda.is_available():
        return {"status": "skipped", "note": "no CUDA device: torch.cuda.is_available() is False"}
    try:
        import rlsync
    except Exception as e:  # noqa: BLE001
        return {"status": "skipped", "note": f"rlsync is not importable: {type(e).__name__}: {e}"}
    ok, why = rlsync.cuda_available()
    if not ok:
        return {"status": "skipped", "note": f"rlsync cannot use CUDA here: {why}"}
    import torch.multiprocessing as _tmp  # noqa: F401 - CUDA tensors through the pipes

    rec: dict[str, Any] = {}
    if density is None:
        d = (results or {}).get("stages", {}).get("density", {})
        density = d.get("density") if d.get("status") == "ok" else None
        rec["density_source"] = "density stage" if density else f"fallback {FALLBACK_DENSITY}"
        density = float(density or FALLBACK_DENSITY)
    rec["density"] = density
    deadline = deadline if deadline is not None else time.monotonic() + 600
    dev = torch.device("cuda:0")
    torch.cuda.synchronize(dev)
    gc.collect()
    torch.cuda.empty_cache()
    free0, total = torch.cuda.mem_get_info(dev)
    shapes = llama2_7b_shapes(False)
    g = torch.Generator(device=dev).manual_seed(7)
    state = {}
    for name, shape in shapes:
        t = torch.empty(shape, device=dev, dtype=torch.float32)
        t.normal_(0.0, 0.02, generator=g)
        state[name] = t.to(torch.bfloat16)
        del t
    rec["elements"] = sum(t.numel() for t in state.values())
    rec["tensors"] = len(state)
    sock_dir = tempfile.mkdtemp(prefix="rlsync-ipc-")
    phases = []
    try:
        for n in (1, 2):
            try:
                phases.append(_phase(rlsync, n, shapes, state, density, syncs, deadline, sock_dir))
            except Exception as e:  # noqa: BLE001 - recorded; the next phase still runs
                phases.append({"receivers": n, "error": f"{type(e).__name__}: {e}",
                               "traceback": traceback.format_exc()[-3000:]})
            gc.collect()
            torch.cuda.empty_cache()
        # Casts: an fp32 master copy of the first layers to one bf16 receiver, cast on the sender's GPU.
        if time.monotonic() < deadline:
            del state
            gc.collect()
            torch.cuda.empty_cache()
            state = {}
            try:
                cast_shapes = shapes[:CAST_TENSORS]
                for name, shape in cast_shapes:
                    state[name] = torch.empty(shape, device=dev, dtype=torch.float32).normal_(0.0, 0.02, generator=g)
                phases.append(_phase(rlsync, 1, cast_shapes, state, density, syncs, deadline, sock_dir,
                                     dtype=torch.bfloat16))
            except Exception as e:  # noqa: BLE001 - recorded
                phases.append({"receivers": 1, "cast": "float32 -> bfloat16", "error": f"{type(e).__name__}: {e}",
                               "traceback": traceback.format_exc()[-3000:]})
        else:
            rec["cast_note"] = "budget: the cast phase did not run"
    finally:
        del state
        gc.collect()
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        try:
            os.rmdir(sock_dir)
        except OSError:
            pass
    free1, _ = torch.cuda.mem_get_info(dev)
    rec["phases"] = phases
    rec["free_gpu_bytes_before"] = free0
    rec["free_gpu_bytes_after"] = free1
    rec["memory_freed"] = free1 >= free0 - (256 << 20)
    # A sender fallback (its own checksum count disagreed with its diff kernel's) is a fault on the device.
    good = all("error" not in p and p.get("all_equal") and p.get("socket_removed") and not p.get("fallbacks")
               and p.get("rejoin", {"ok": True}).get("ok") for p in phases)
    rec["status"] = "ok" if good and rec["memory_freed"] else "failed"
    return rec


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--density", type=float, default=None)
    ap.add_argument("--syncs", type=int, default=10)
    args = ap.parse_args(argv)
    rec = stage_ipc({}, cpu=args.cpu, density=args.density, syncs=args.syncs)
    print(json.dumps(rec, indent=2, default=str))
    return 0 if rec["status"] in ("ok", "skipped") else 1


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
