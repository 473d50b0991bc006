"""Weight-sync benchmark, side by side: one trainer process -> N rollout processes on this host.

    python python/bench/sync_bench.py                       # 268 M bf16 parameters (512 MiB), 1 and 4 rollouts
    python python/bench/sync_bench.py --params 33554432     # a smaller state (64 MiB)

Methods (each in its own set of processes, same state, same updates):
- ``rlsync-patch`` / ``rlsync-bucket``: rlsync's Python API (``PatchWeightSyncer`` / ``BucketWeightSyncer``)
  on rlsync's shared-memory channel (``rlsync.shm_sender`` / ``shm_receiver``);
- ``torchrl-shared`` / ``torchrl-mp``: TorchRL's ``SharedMemWeightSyncScheme`` / ``MultiProcessWeightSyncScheme``
  (``sync=True``: ``send`` returns once every worker applied the weights);
- ``load_state_dict``: a plain in-process ``model.load_state_dict`` copy of the whole state (per rollout).

The update between versions emulates one Adam step at ``--lr`` (fp32 master weights, momentum of uniform
noise, bias-corrected, cast to bf16), as ``rlsync bench_sync bench.update=adam`` does, so a patch carries the
same share of changed elements. "e2e" is from the trainer's call until the last rollout has the version
installed (clock: ``time.perf_counter``, CLOCK_MONOTONIC, shared by the processes of one host); the update
itself is not timed. The first version after init is a warm-up and not counted. Every rlsync run checks the
rollouts' checksums against the trainer's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: no spinning OpenMP teams on a shared machine

import torch  # noqa: E402

SHAPE_COLS = 4096


def make_module(params: int, tensors: int, seed: int | None) -> torch.nn.Module:
    """A module of ``tensors`` bf16 matrices holding ``params`` elements (seeded N(0, 0.02), or zeros)."""
    m = torch.nn.Module()
    per = params // tensors
    rows = max(1, per // SHAPE_COLS)
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    for i in range(tensors):
        if g is None:
            t = torch.zeros(rows, SHAPE_COLS, dtype=torch.bfloat16)
        else:
            t = (torch.randn(rows, SHAPE_COLS, generator=g) * 0.02).to(torch.bfloat16)
        m.register_parameter(f"layer{i}_weight", torch.nn.Parameter(t, requires_grad=False))
    return m


class AdamLike:
    """One Adam-like step per call on fp32 master weights, cast into the bf16 parameters."""

    def __init__(self, module: torch.nn.Module, lr: float, seed: int = 0) -> None:
        self.params = list(module.parameters())
        self.master = [p.detach().float() for p in self.params]
        self.mom = [torch.zeros_like(m) for m in self.master]
        self.lr = lr
        self.t = 0
        self.g = torch.Generator().manual_seed(seed)

    @torch.no_grad()
    def step(self) -> None:
        self.t += 1
        corr = 1.0 - 0.9 ** min(self.t, 1000)
        scale = self.lr * math.sqrt(3.0) / corr
        for p, x, m in zip(self.params, self.master, self.mom):
            noise = torch.rand(m.shape, generator=self.g).mul_(2).sub_(1)
            m.mul_(0.9).add_(noise, alpha=0.1)
            x.sub_(m, alpha=scale)
            p.copy_(x)


# ---------------------------------------------------------------------------------------------------- rlsync


def _rlsync_syncer(kind: str) -> Any:
    import rlsync

    if kind == "patch":
        return rlsync.PatchWeightSyncer(init_sync_enabled=True)
    return rlsync.BucketWeightSyncer(bucket_size=512 << 20)


def rlsync_rollout(kind: str, path: str, rank: int, versions: int, params: int, tensors: int, q: Any) -> None:
    import rlsync

    async def main() -> None:
        model = make_module(params, tensors, seed=None)
        syncer = _rlsync_syncer(kind)
        rx = await rlsync.shm_receiver(path, rank, timeout=600)
        await syncer.init_receiver(model.state_dict(), rx)
        for _ in range(versions):
            v = await syncer.apply(model, rx)
            q.put(("applied", rank, v, time.perf_counter(), syncer.last_report()))
        q.put(("checksum", rank, syncer.checksum(model.state_dict())))

    try:
        asyncio.run(main())
    except BaseException as e:
        q.put(("error", rank, repr(e)))


def run_rlsync(kind: str, n: int, args: argparse.Namespace, ctx: Any) -> dict[str, Any]:
    import rlsync

    versions = args.steps + 1
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "w.sock")
        procs = [
            ctx.Process(target=rlsync_rollout, args=(kind, path, r, versions, args.params, args.tensors, q))
            for r in range(n)
        ]
        for p in procs:
            p.start()
        model = make_module(args.params, args.tensors, seed=1)
        opt = AdamLike(model, args.lr)

        async def trainer() -> dict[str, Any]:
            syncer = _rlsync_syncer(kind)
            tx = await rlsync.shm_sender(path, n, timeout=600)
            await syncer.init_sender(model.state_dict(), list(model.state_dict()), tx)
            e2e, send_s, reports = [], [], []
            for v in range(1, versions + 1):
                opt.step()
                t0 = time.perf_counter()
                await syncer.sync(model.state_dict(), tx, v)
                t_sent = time.perf_counter()
                done, sums = [], []
                while len(done) < n:
                    msg = q.get(timeout=600)
                    if msg[0] == "error":
                        raise RuntimeError(f"rollout {msg[1]}: {msg[2]}")
                    (done if msg[0] == "applied" else sums).append(msg)
                if v > 1:
                    e2e.append(max(m[3] for m in done) - t0)
                    send_s.append(t_sent - t0)
                    reports.append(done[0][4])
            want = syncer.checksum(model.state_dict())
            sums += [q.get(timeout=600) for _ in range(n - len(sums))]
            verified = all(s[0] == "checksum" and s[2] == want for s in sums)
            changed = statistics.median(r["changed"] for r in reports)
            payload = statistics.median(r["payload_bytes"] for r in reports)
            return {"e2e_ms": 1e3 * statistics.median(e2e), "sender_ms": 1e3 * statistics.median(send_s),
                    "verified": verified, "changed": changed, "payload_bytes": payload}

        try:
            return asyncio.run(trainer())
        finally:
            for p in procs:
                p.join(timeout=60)
                if p.is_alive():
                    p.kill()


# ---------------------------------------------------------------------------------------------------- torchrl


def _scheme(name: str) -> Any:
    from torchrl.weight_update import MultiProcessWeightSyncScheme, SharedMemWeightSyncScheme

    return SharedMemWeightSyncScheme(sync=True) if name == "shared" else MultiProcessWeightSyncScheme(sync=True)


def torchrl_rollout(scheme: Any, rank: int, params: int, tensors: int, stop: Any, q: Any) -> None:
    try:
        model = make_module(params, tensors, seed=None)
        scheme.init_on_receiver(model_id="policy", model=model, worker_idx=rank)
        scheme.connect(worker_idx=rank)
        q.put(("ready", rank))
        if hasattr(scheme, "_background_receive_loop"):
            stop.wait()
        else:
            while not stop.is_set():
                scheme.receive(timeout=0.5)
        q.put(("done", rank, float(next(model.parameters()).float().sum())))
    except BaseException as e:
        q.put(("error", rank, repr(e)))


def run_torchrl(name: str, n: int, args: argparse.Namespace, ctx: Any) -> dict[str, Any]:
    from tensordict import TensorDict

    model = make_module(args.params, args.tensors, seed=1)
    opt = AdamLike(model, args.lr)
    scheme = _scheme(name)
    scheme.init_on_sender(model_id="policy", weights=TensorDict.from_module(model),
                          devices=[torch.device("cpu")] * n, num_workers=n, ctx=ctx)
    q, stop = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=torchrl_rollout, args=(scheme, r, args.params, args.tensors, stop, q)) for r in range(n)]
    for p in procs:
        p.start()
    try:
        scheme.connect(weights=TensorDict.from_module(model))
        for _ in range(n):
            msg = q.get(timeout=600)
            if msg[0] == "error":
                raise RuntimeError(f"torchrl rollout {msg[1]}: {msg[2]}")
        e2e = []
        for v in range(1, args.steps + 2):
            opt.step()
            t0 = time.perf_counter()
            scheme.send(TensorDict.from_module(model))
            if v > 1:
                e2e.append(time.perf_counter() - t0)
        stop.set()
        want = float(next(model.parameters()).float().sum())
        ends = [q.get(timeout=600) for _ in range(n)]
        verified = all(e[0] == "done" and e[2] == want for e in ends)
        return {"e2e_ms": 1e3 * statistics.median(e2e), "verified": verified}
    finally:
        stop.set()
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
        try:
            scheme.shutdown()
        except Exception:
            pass


def run_load_state_dict(n: int, args: argparse.Namespace) -> dict[str, Any]:
    src = make_module(args.params, args.tensors, seed=1)
    dst = make_module(args.params, args.tensors, seed=None)
    times = []
    for _ in range(args.steps + 1):
        t0 = time.perf_counter()
        for _ in range(n):
            dst.load_state_dict(src.state_dict())
        times.append(time.perf_counter() - t0)
    return {"e2e_ms": 1e3 * statistics.median(times[1:]), "verified": all(
        torch.equal(a, b) for a, b in zip(src.parameters(), dst.parameters()))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=int, default=268435456, help="bf16 elements in the state (default 268 M)")
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument("--receivers", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--steps", type=int, default=3, help="timed versions (after one warm-up)")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--methods", nargs="+",
                    default=["rlsync-patch", "rlsync-bucket", "torchrl-shared", "torchrl-mp", "load_state_dict"])
    ap.add_argument("--json", action="store_true", help="one JSON object per line instead of a table")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    print(f"# {args.params} bf16 params ({args.params * 2 / 2**20:.0f} MiB) in {args.tensors} tensors, "
          f"Adam-like lr {args.lr}, {args.steps} timed versions; load average {os.getloadavg()[0]:.1f}", flush=True)
    if not args.json:
        print("| method | rollouts | e2e ms (median) | verified | notes |\n|---|---|---|---|---|", flush=True)
    for n in args.receivers:
        for method in args.methods:
            try:
                if method.startswith("rlsync-"):
                    r = run_rlsync(method.split("-", 1)[1], n, args, ctx)
                elif method.startswith("torchrl-"):
                    r = run_torchrl(method.split("-", 1)[1], n, args, ctx)
                else:
                    r = run_load_state_dict(n, args)
            except Exception as e:  # report and go on with the other methods
                r = {"error": f"{type(e).__name__}: {e}"[:300]}
            r.update(method=method, rollouts=n, load=round(os.getloadavg()[0], 1))
            if args.json:
                print(json.dumps(r), flush=True)
            elif "error" in r:
                print(f"| {method} | {n} | – | – | failed: {r['error']} |", flush=True)
            else:
                notes = []
                if "changed" in r:
                    notes.append(f"{r['changed'] / args.params:.2%} changed, payload {r['payload_bytes'] / 2**20:.2f} MiB, trainer's sync call {r['sender_ms']:.1f} ms")
                notes.append(f"load {r['load']}")
                print(f"| {method} | {n} | {r['e2e_ms']:.1f} | {r['verified']} | {'; '.join(notes)} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
