"""Weight sync inside TorchRL's ``MultiSyncCollector``: rlsync's scheme against TorchRL's own (issue 26 item 3).

    python python/bench/collector_bench.py --params 268435456 --workers 1 4 --steps 3   # 512 MiB bf16
    python python/bench/collector_bench.py --smoke                                     # small, every method, quick

One trainer process and a ``MultiSyncCollector`` of 1 or N worker processes, each running a tiny mock
environment (TorchRL's ``ContinuousActionVecMockEnv``) with a policy that holds ``--params`` bf16 elements in
``--tensors`` matrices (the forward reads a handful of them: the env is not what is timed). The trainer trains
its own copy of the policy (fp32 master weights, an Adam-like step at ``--lr`` cast to bf16, the emulation of
``sync_bench.py``), collects a batch, steps, and calls ``collector.update_policy_weights_(weights)`` with its
weights; the collector hands them to the scheme under test:

- ``rlsync-patch`` / ``rlsync-bucket``: ``rlsync.torchrl.RlsyncWeightSyncScheme("patch" | "bucket")`` over
  rlsync's shared-memory channel; each worker holds its own copy and installs in place;
- ``rlsync-patch-host-shared`` / ``rlsync-bucket-host-shared``: ``RlsyncWeightSyncScheme("patch" | "bucket",
  host_shared=True)``: the workers act on one double-buffered copy in shared memory; worker 0 applies each
  version to the back buffer, then every worker swaps its parameters to the published buffer (its ack to the
  trainer follows the swap);
- ``torchrl-shared``: TorchRL's ``SharedMemWeightSyncScheme()``: the collector's policy becomes one shared
  buffer that every worker's module is a view of; a send copies the weights into it (one memcpy) and notifies;
- ``torchrl-mp``: TorchRL's ``MultiProcessWeightSyncScheme()``: the weights go through a queue (torch's
  shared-memory pickling) and each worker copies them into its module.

The time is that of ``update_policy_weights_`` (median over ``--steps`` versions after one warm-up). Every scheme
here is synchronous and acknowledges only after the worker applied the version (rlsync: the ack follows the
install; TorchRL: the worker's background thread copies/applies, then puts "updated" on its ack queue, which
``send`` waits for), so the call's return is the moment every worker holds it. After the last version the
trainer asks each worker, through its policy's forward (a probe file), for a hash of every byte of its weights:
"verified" = every worker holds exactly the last version sent; then one more trainer step that is not sent:
"isolated" = it does not show up in the workers. The table also gives the trainer's and the largest worker's
peak RSS and the most /dev/shm in use (sampled after each version).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sync_bench import AdamLike, ShmWatch, peak_rss_mib, reset_peak_rss, state_hash  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

if hasattr(faulthandler, "register"):  # `kill -USR1 <pid>` prints every thread's stack (trainer and workers)
    import signal

    faulthandler.register(signal.SIGUSR1, all_threads=True)

SHAPE_COLS = 4096
ACT = 7  # ContinuousActionVecMockEnv's observation and action size


class BigPolicy(nn.Module):
    """A policy with ``params`` bf16 elements in ``tensors`` matrices; its action reads the first row of the first
    matrix. When ``probe_dir/request`` names a token it has not answered, it writes a hash of all its weights (and
    its process's peak RSS) to ``probe_dir/<pid>.json`` (that is how the trainer reads a worker's weights)."""

    def __init__(self, params: int, tensors: int, probe_dir: str, seed: int | None = None) -> None:
        super().__init__()
        rows = max(1, params // tensors // SHAPE_COLS)
        g = torch.Generator().manual_seed(seed) if seed is not None else None
        for i in range(tensors):
            if g is None:
                t = torch.zeros(rows, SHAPE_COLS, dtype=torch.bfloat16)
            else:
                t = (torch.randn(rows, SHAPE_COLS, generator=g) * 0.02).to(torch.bfloat16)
            self.register_parameter(f"layer{i}_weight", nn.Parameter(t, requires_grad=False))
        self.probe_dir = probe_dir
        self._answered = ""

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        self._probe()
        w = self.layer0_weight[0, :ACT].float()
        return (observation[..., :ACT] * w).clamp(-1, 1)

    def _probe(self) -> None:
        try:
            token = Path(self.probe_dir, "request").read_text()
        except OSError:
            return
        if not token or token == self._answered:
            return
        self._answered = token
        out = Path(self.probe_dir, f"{os.getpid()}.json")
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps({"token": token, "hash": state_hash(self), "rss_mib": peak_rss_mib()}))
        tmp.rename(out)


def make_env() -> Any:
    from torchrl.testing.mocking_classes import ContinuousActionVecMockEnv

    return ContinuousActionVecMockEnv()


def make_scheme(method: str, socket_dir: str, timeout: float) -> Any:
    if method.startswith("rlsync-"):
        from rlsync.torchrl import RlsyncWeightSyncScheme

        strategy = method.split("-")[1]  # rlsync-<patch|bucket>[-host-shared]
        host_shared = method.endswith("-host-shared")
        return RlsyncWeightSyncScheme(strategy, socket_dir=socket_dir, timeout=timeout, host_shared=host_shared)
    from torchrl.weight_update import MultiProcessWeightSyncScheme, SharedMemWeightSyncScheme

    return MultiProcessWeightSyncScheme() if method == "torchrl-mp" else SharedMemWeightSyncScheme()


def probe_workers(it: Any, probe_dir: str, n: int, timeout: float = 900.0) -> list[dict[str, Any]]:
    """Ask every worker for its weights' hash: set a fresh token, collect batches until ``n`` answered it."""
    token = uuid.uuid4().hex
    for f in Path(probe_dir).glob("*.json"):
        f.unlink()
    Path(probe_dir, "request").write_text(token)
    deadline = time.monotonic() + timeout
    while True:
        answers = []
        for f in Path(probe_dir).glob("*.json"):
            a = json.loads(f.read_text())
            if a["token"] == token:
                answers.append(a)
        if len(answers) >= n:
            return answers
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(answers)} of {n} workers answered the weights probe")
        next(it)


def run(method: str, n: int, args: argparse.Namespace) -> dict[str, Any]:
    from tensordict import TensorDict
    from tensordict.nn import TensorDictModule
    from torchrl.collectors import MultiSyncCollector

    reset_peak_rss()
    watch = ShmWatch()
    with tempfile.TemporaryDirectory(prefix="collector-bench-") as probe_dir:
        trainer, policy = (
            TensorDictModule(BigPolicy(args.params, args.tensors, probe_dir, seed=1), ["observation"], ["action"])
            for _ in range(2)
        )
        opt = AdamLike(trainer, args.lr)
        weights = TensorDict.from_module(trainer)  # the trainer's live weights (views): what every version sends
        # rlsync's waits are bounded: a worker that stops acknowledging fails the row instead of hanging the run
        # (10 minutes for the full size on a loaded host; 2 for the smoke).
        scheme = make_scheme(method, probe_dir, timeout=120 if args.smoke else 600)
        collector = MultiSyncCollector(
            [make_env] * n,
            policy,
            frames_per_batch=8 * n,
            total_frames=-1,
            weight_sync_schemes={"policy": scheme},
        )
        try:
            it = iter(collector)
            next(it)
            watch.sample()
            times = []
            for v in range(1, args.steps + 2):
                next(it)
                opt.step()
                t0 = time.perf_counter()
                collector.update_policy_weights_(weights)
                t1 = time.perf_counter()
                watch.sample()
                if v > 1:  # the first version is a warm-up
                    times.append(t1 - t0)
            sent = state_hash(trainer)
            answers = probe_workers(it, probe_dir, n)
            opt.step()  # not sent: a worker holding its own copy must not see it
            after = state_hash(trainer)
            later = probe_workers(it, probe_dir, n)
            return {
                "e2e_ms": 1e3 * statistics.median(times),
                "min_ms": 1e3 * min(times),
                "verified": len(answers) == n and all(a["hash"] == sent for a in answers),
                "isolated": all(a["hash"] != after for a in later),
                "worker_rss_mib": max(a["rss_mib"] for a in later),
                "trainer_rss_mib": peak_rss_mib(),
                "shm_mib": watch.peak / 2**20,
            }
        finally:
            collector.shutdown()
            if hasattr(scheme, "shutdown"):
                try:
                    scheme.shutdown()
                except Exception:
                    pass


def floors(args: argparse.Namespace) -> dict[str, float]:
    """This host's floor for one version on one thread: a memcpy of the state (what TorchRL's shared-memory scheme
    does per send), median of 3 after a warm-up."""
    src = BigPolicy(args.params, args.tensors, "", seed=1)
    dst = BigPolicy(args.params, args.tensors, "", seed=None)
    pairs = list(zip(dst.parameters(), src.parameters()))
    ts = []
    with torch.no_grad():
        for _ in range(4):
            t0 = time.perf_counter()
            for d, s in pairs:
                d.copy_(s)
            ts.append(time.perf_counter() - t0)
    return {"memcpy_ms": 1e3 * statistics.median(ts[1:])}


LABELS = {
    "rlsync-patch": "rlsync patch (`RlsyncWeightSyncScheme(\"patch\")`, shm)",
    "rlsync-bucket": "rlsync bucket (`RlsyncWeightSyncScheme(\"bucket\")`, shm)",
    "rlsync-patch-host-shared": "rlsync host-shared patch (`RlsyncWeightSyncScheme(\"patch\", host_shared=True)`)",
    "rlsync-bucket-host-shared": "rlsync host-shared bucket (`RlsyncWeightSyncScheme(\"bucket\", host_shared=True)`)",
    "torchrl-shared": "TorchRL `SharedMemWeightSyncScheme`",
    "torchrl-mp": "TorchRL `MultiProcessWeightSyncScheme`",
}
METHODS = list(LABELS)


def print_table(results: list[dict[str, Any]], workers: list[int]) -> None:
    by = {(r["method"], r["workers"]): r for r in results}
    cols = " | ".join(f"{n} worker{'s' if n > 1 else ''}" for n in workers)
    print(f"\n| method | {cols} |\n|---|{'---|' * len(workers)}")
    for m in METHODS:
        if not any((m, n) in by for n in workers):
            continue
        cells = []
        for n in workers:
            r = by.get((m, n))
            if r is None:
                cells.append("–")
            elif "error" in r:
                cells.append("failed")
            else:
                cells.append(f"{r['e2e_ms']:.1f} ms" + ("" if r["verified"] else " NOT verified"))
        print(f"| {LABELS[m]} | " + " | ".join(cells) + " |")
    ok = lambda k: k in by and "error" not in by[k]  # noqa: E731
    for n in workers:
        for m in ("rlsync-patch", "rlsync-bucket", "rlsync-patch-host-shared", "rlsync-bucket-host-shared"):
            if ok((m, n)) and ok(("torchrl-shared", n)):
                print(f"- {n} worker(s): {m} / TorchRL shared-memory: "
                      f"{by[(m, n)]['e2e_ms'] / by[('torchrl-shared', n)]['e2e_ms']:.2f}x")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=int, default=268435456, help="bf16 elements in the policy (default 268 M)")
    ap.add_argument("--tensors", type=int, default=64)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--steps", type=int, default=3, help="timed versions (after one warm-up)")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    ap.add_argument("--smoke", action="store_true", help="a small state (1 M elements), 2 workers, 2 versions")
    ap.add_argument("--json", action="store_true", help="one JSON object per line instead of tables")
    args = ap.parse_args()
    if args.smoke:
        args.params, args.tensors, args.workers, args.steps = 1 << 20, 8, [2], 2
    print(f"# {args.params} bf16 params ({args.params * 2 / 2**20:.0f} MiB) in {args.tensors} tensors, Adam-like lr "
          f"{args.lr}, {args.steps} timed versions, MultiSyncCollector; {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    if not args.json:
        print("| method | workers | update_policy_weights_ ms (median) | verified | isolated | notes |\n"
              "|---|---|---|---|---|---|", flush=True)
    results = []
    failed = False
    fl = floors(args)
    if args.json:
        print(json.dumps({"floors": fl}), flush=True)
    else:
        print(f"# floor, one thread: a memcpy of the state {fl['memcpy_ms']:.1f} ms", flush=True)
    for n in args.workers:
        for method in args.methods:
            try:
                r = run(method, n, args)
            except Exception as e:  # report and go on with the other methods
                r = {"error": f"{type(e).__name__}: {e}"[:300]}
            r.update(method=method, workers=n, load=round(os.getloadavg()[0], 1))
            failed |= "error" in r or not r.get("verified", False)
            results.append(r)
            if args.json:
                print(json.dumps(r), flush=True)
            elif "error" in r:
                print(f"| {method} | {n} | – | – | – | failed: {r['error']} |", flush=True)
            else:
                notes = (f"min {r['min_ms']:.1f} ms; trainer peak RSS {r['trainer_rss_mib'] / 1024:.2f} GiB; largest "
                         f"worker peak RSS {r['worker_rss_mib'] / 1024:.2f} GiB; /dev/shm {r['shm_mib'] / 1024:.2f} "
                         f"GiB; load {r['load']}")
                print(f"| {method} | {n} | {r['e2e_ms']:.1f} | {r['verified']} | {r['isolated']} | {notes} |",
                      flush=True)
    if not args.json:
        print_table(results, args.workers)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
