"""Weight-sync benchmark, side by side: one trainer process -> N rollout processes on this host.

    python python/bench/sync_bench.py --params 268435456 --receivers 1 4 --steps 3   # 512 MiB bf16, the issue's size
    python python/bench/sync_bench.py --params 33554432                               # a smaller state (64 MiB)

Methods (each in its own set of processes, same state, same updates):
- ``rlsync-patch`` / ``rlsync-bucket``: rlsync's Python API (``PatchWeightSyncer`` / ``BucketWeightSyncer``)
  on rlsync's shared-memory channel (``rlsync.shm_sender`` / ``shm_receiver``); every rollout process holds its
  own copy of the weights, installed in place;
- ``rlsync-patch-host-shared`` / ``rlsync-bucket-host-shared``: the same syncers, host-shared (``rlsync.host_shared``):
  rollout 0 is the host's one receiver and applies each version into one double-buffered copy in shared memory,
  the other rollouts' parameters are views of it, swapped to each version it publishes (``HostSharedReader``);
  a rollout counts as applied when it acts on the version (the applier: published; a reader: swapped);
- ``rlsync-patch-threads`` / ``rlsync-bucket-threads``: the same, but the rollouts are threads of the trainer's
  process (each with its own model and event loop), which is how ``rlsync bench_sync`` runs its receivers: the
  same topology as the ``rust-*`` rows, so the ratio of the two is the Python API's own overhead;
- ``rust-patch`` / ``rust-bucket``: the same syncers through ``rlsync bench_sync`` (``--rlsync-bin``, default
  ``target/release/rlsync``; its receivers are threads of the sender's process; it gets the same size, tensor
  count, lr and transport, but its model has its own shape mix and its update its own Adam emulation, so its
  changed share differs a little: the rows print it). Its receivers own their tensors, so a bucket installs by
  swapping storages where the Python API copies into the torch tensors' memory;
- ``rust-patch-borrowed`` / ``rust-bucket-borrowed``: the same, its receivers over memory they do not own
  (``bench.receiver_memory=borrowed``), so a bucket is copied in as the Python API copies into torch's memory;
- ``torchrl-shared``: TorchRL's ``SharedMemWeightSyncScheme(sync=True)`` with a shared buffer that is not the
  trainer's module (as when the trainer trains on a GPU, or must not write into what the rollouts act with):
  each ``send`` copies the new weights into the buffer, notifies every worker and waits for its ack; the
  workers' modules *are* that one buffer (TorchRL replaces their parameters by it at ``connect``);
- ``torchrl-shared-alias``: the same scheme initialised with the trainer's own parameters, as TorchRL's examples
  do with a CPU policy: the buffer *is* the trainer's module, so no data moves at ``send`` at all, and the
  rollouts read the trainer's live parameters (its optimizer step changes them mid-rollout); "isolated" is
  False. Shown for reference: it is not a sync;
- ``torchrl-mp``: ``MultiProcessWeightSyncScheme(sync=True)``, sent a fresh CPU copy of the weights per version
  (made before the clock starts; sending the module's own tensors would alias them as above): the copy goes
  through torch's shared-memory pickling and each worker copies it into its module;
- ``load_state_dict``: a plain in-process ``model.load_state_dict`` copy of the whole state (per rollout).

The update between versions emulates one Adam step at ``--lr`` (fp32 master weights, momentum of uniform
noise, bias-corrected, cast to bf16), so a patch carries the share of changed elements such an update makes.
"e2e" is from the trainer's call until the trainer knows that every rollout has the version installed (rlsync:
each rollout's message after ``apply`` returned; TorchRL: the acks ``send`` waits for); the update itself is not
timed. The first version after init is a warm-up and not counted. After the last version every method is
checked: "verified" = each rollout holds exactly the last version sent (a hash of all its bytes); "isolated" =
an update the trainer makes afterwards without sending does not show up in the rollouts.

Memory (P bf16 elements, 2P bytes; 512 MiB at P = 268 M): the trainer holds the model (2P), fp32 master
weights and momentum (8P), for patch a snapshot (2P), for TorchRL a separate buffer (2P); each rollout process
holds its model (2P) plus its Python + torch (~0.4 GiB); rlsync's shm channel holds up to ``slots`` (2 here)
payloads (bucket: 2P each). Peak at P = 268 M, 4 rollouts: about 5 + 1 + 4 x 0.9 = 9.6 GiB (bucket), well
inside 24 GiB; the methods run one after another and free their memory. The table reports the trainer's and
the largest rollout's peak RSS and the largest /dev/shm use seen.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import multiprocessing as mp
import os
import queue
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: no spinning OpenMP teams on a shared machine

import torch  # noqa: E402

SHAPE_COLS = 4096
ROOT = Path(__file__).resolve().parents[2]


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


def state_hash(module: torch.nn.Module) -> str:
    """A hash of every byte of the module's parameters (exact, dtype-agnostic)."""
    h = hashlib.blake2b(digest_size=16)
    for p in module.parameters():
        h.update(p.detach().contiguous().view(torch.uint8).numpy())
    return h.hexdigest()


def peak_rss_mib() -> float:
    """This process's peak resident set since the last :func:`reset_peak_rss` (VmHWM)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def reset_peak_rss() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    except OSError:
        pass


class ShmWatch:
    """The largest /dev/shm use seen (sampled after each version) above the level at the start."""

    def __init__(self) -> None:
        self.base = self._used()
        self.peak = 0

    @staticmethod
    def _used() -> int:
        try:
            return shutil.disk_usage("/dev/shm").used
        except OSError:
            return 0

    def sample(self) -> None:
        self.peak = max(self.peak, self._used() - self.base)


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


def rlsync_rollout(kind: str, path: str, rank: int, versions: int, params: int, tensors: int, q: Any, cmd: Any,
                   arena: str | None = None, verify: bool = True) -> None:
    """One rollout (a process, or a thread of the trainer's process): init, ``versions`` applies, then the hash.
    With ``arena`` (host-shared): rank 0 is the host's one receiver and applies into the arena; the other ranks are
    readers whose parameters are views of it, swapped to each version the applier publishes; ``verify``: the
    applier checksums each version it publishes (the bench hashes every rollout's weights at the end either way)."""
    import rlsync

    async def main() -> None:
        model = make_module(params, tensors, seed=None)
        if arena is not None and rank > 0:
            reader = rlsync.HostSharedReader(arena, model, timeout=600)
            v = reader.version  # a reader attaching late may already hold version 1 (or later)
            for target in range(1, versions + 1):
                while v < target:
                    v = reader.wait_newer(v, timeout=600)
                q.put(("applied", rank, v, None))
            cmd.wait()
            q.put(("end", rank, state_hash(model), peak_rss_mib()))
            reader.close()
            return
        syncer = _rlsync_syncer(kind)
        rx = await rlsync.shm_receiver(path, rank, timeout=600)
        if arena is not None:
            await syncer.init_receiver(model, rx, host_shared=arena, verify=verify)
        else:
            await syncer.init_receiver(model.state_dict(), rx)
        for _ in range(versions):
            v = await syncer.apply(model, rx)
            q.put(("applied", rank, v, syncer.last_report()))
        cmd.wait()  # the trainer made one more update, not sent
        q.put(("end", rank, state_hash(model), peak_rss_mib()))
        if arena is not None:
            await syncer.close()  # the arena unlinked

    try:
        asyncio.run(main())
    except BaseException as e:
        q.put(("error", rank, repr(e)))


def _get(q: Any, want: str) -> tuple:
    msg = q.get(timeout=900)
    if msg[0] == "error":
        raise RuntimeError(f"rollout {msg[1]}: {msg[2]}")
    if msg[0] != want:
        raise RuntimeError(f"expected a '{want}' message, got {msg[:2]}")
    return msg


def run_rlsync(kind: str, n: int, args: argparse.Namespace, ctx: Any, threads: bool = False,
               host_shared: bool = False) -> dict[str, Any]:
    """rlsync's Python API; the rollouts are processes, or with ``threads`` threads of this (the trainer's)
    process; with ``host_shared`` they act on one double-buffered copy per host (rank 0 receives and applies)."""
    import rlsync

    versions = args.steps + 1
    if threads:
        q, cmd = queue.Queue(), threading.Event()
    else:
        q, cmd = ctx.Queue(), ctx.Event()
    watch = ShmWatch()
    reset_peak_rss()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "w.sock")
        arena = f"rlsync-bench-{os.getpid()}.arena" if host_shared else None
        rollout_args = [(kind, path, r, versions, args.params, args.tensors, q, cmd, arena, args.host_shared_verify)
                        for r in range(n)]
        if threads:
            procs = [threading.Thread(target=rlsync_rollout, args=a, daemon=True) for a in rollout_args]
        else:
            procs = [ctx.Process(target=rlsync_rollout, args=a) for a in rollout_args]
        for p in procs:
            p.start()
        model = make_module(args.params, args.tensors, seed=1)
        opt = AdamLike(model, args.lr)

        async def trainer() -> dict[str, Any]:
            syncer = _rlsync_syncer(kind)
            tx = await rlsync.shm_sender(path, 1 if host_shared else n, timeout=600, slots=2)
            await syncer.init_sender(model.state_dict(), list(model.state_dict()), tx)
            e2e, send_s, reports = [], [], []
            for v in range(1, versions + 1):
                opt.step()
                t0 = time.perf_counter()
                await syncer.sync(model.state_dict(), tx, v)
                t_sent = time.perf_counter()
                done = [_get(q, "applied") for _ in range(n)]
                t_done = time.perf_counter()
                watch.sample()
                if any(m[2] != v for m in done):
                    raise RuntimeError(f"version {v}: rollouts applied {[m[2] for m in done]}")
                if v > 1:
                    e2e.append(t_done - t0)
                    send_s.append(t_sent - t0)
                    reports.append(next(m[3] for m in done if m[3] is not None))
            await syncer.flush()
            sent = state_hash(model)
            opt.step()  # not sent: private copies must not see it
            cmd.set()
            ends = [_get(q, "end") for _ in range(n)]
            return {
                "e2e_ms": 1e3 * statistics.median(e2e),
                "sender_ms": 1e3 * statistics.median(send_s),
                "verified": all(e[2] == sent for e in ends),
                "isolated": all(e[2] != state_hash(model) for e in ends),
                "changed": statistics.median(r["changed"] for r in reports),
                "payload_bytes": statistics.median(r["payload_bytes"] for r in reports),
                "rollout_rss_mib": max(e[3] for e in ends),
            }

        try:
            out = asyncio.run(trainer())
        finally:
            cmd.set()
            for p in procs:
                p.join(timeout=60)
                if p.is_alive() and not threads:
                    p.kill()
            if arena is not None:
                rlsync.host_shared.unlink(arena)  # gone even when the applier died
    out.update(trainer_rss_mib=peak_rss_mib(), shm_mib=watch.peak / 2**20)
    if threads:
        out.pop("rollout_rss_mib", None)  # one process: its peak is the trainer's
    return out


def run_rust(kind: str, n: int, args: argparse.Namespace, borrowed: bool = False) -> dict[str, Any]:
    """``rlsync bench_sync`` with the same size, update and transport (its receivers are threads); ``borrowed``:
    its receivers install into memory they do not own (``bench.receiver_memory=borrowed``), as the API does."""
    exe = Path(args.rlsync_bin)
    if not exe.is_file():
        raise FileNotFoundError(f"{exe} is missing (cargo build --release, or pass --rlsync-bin)")
    cmd = [
        str(exe), "bench_sync", f"bench.params={args.params}", f"bench.tensors={args.tensors}", "bench.dtype=bf16",
        "bench.update=adam",
        f"bench.adam_lr={args.rust_lr if args.rust_lr is not None else args.lr}", "bench.transport=shm",
        f"bench.receivers={n}", f"bench.steps={args.steps + 1}",
        "bench.format=json", f"bench.receiver_memory={'borrowed' if borrowed else 'owned'}",
        "weight_syncer=patch_syncer" if kind == "patch" else "weight_syncer=bucket_syncer",
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, cwd=ROOT)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[1:])}: exit {p.returncode}: {p.stderr.strip()[-300:]}")
    summary = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{") and '"summary"' in line]
    if not summary:
        raise RuntimeError(f"no summary line in the output of {' '.join(cmd[1:])}")
    s = summary[-1]
    return {"e2e_ms": s["total_ms"], "verified": bool(s["verified"]), "payload_bytes": s.get("payload_bytes"),
            "density": s.get("density"), "memcpy_ms": s.get("memcpy_ms"), "scan_ms": s.get("scan_ms")}


# ---------------------------------------------------------------------------------------------------- torchrl


def _scheme(name: str) -> Any:
    from torchrl.weight_update import MultiProcessWeightSyncScheme, SharedMemWeightSyncScheme

    return MultiProcessWeightSyncScheme(sync=True) if name == "mp" else SharedMemWeightSyncScheme(sync=True)


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
        q.put(("end", rank, state_hash(model), peak_rss_mib()))
    except BaseException as e:
        q.put(("error", rank, repr(e)))


def run_torchrl(name: str, n: int, args: argparse.Namespace, ctx: Any) -> dict[str, Any]:
    from tensordict import TensorDict

    reset_peak_rss()
    watch = ShmWatch()
    model = make_module(args.params, args.tensors, seed=1)
    opt = AdamLike(model, args.lr)
    scheme = _scheme(name)
    live = TensorDict.from_module(model)
    # "shared-alias": the trainer's own parameters become the shared buffer (no copy at send, no isolation).
    initial = live if name == "shared-alias" else live.data.clone()
    scheme.init_on_sender(model_id="policy", weights=initial, devices=[torch.device("cpu")] * n, num_workers=n, ctx=ctx)
    q, stop = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=torchrl_rollout, args=(scheme, r, args.params, args.tensors, stop, q)) for r in range(n)]
    for p in procs:
        p.start()
    try:
        scheme.connect(weights=initial)
        for _ in range(n):
            _get(q, "ready")
        e2e = []
        for v in range(1, args.steps + 2):
            opt.step()
            # mp: a fresh CPU copy per version, made before the clock starts (sending the module's own tensors
            # would make the workers alias them after the first send).
            weights = live.data.clone() if name == "mp" else live
            t0 = time.perf_counter()
            scheme.send(weights)
            t1 = time.perf_counter()
            watch.sample()
            del weights
            if v > 1:
                e2e.append(t1 - t0)
        sent = state_hash(model)
        opt.step()  # not sent
        stop.set()
        ends = [_get(q, "end") for _ in range(n)]
        return {
            "e2e_ms": 1e3 * statistics.median(e2e),
            "verified": all(e[2] == sent for e in ends),
            "isolated": all(e[2] != state_hash(model) for e in ends),
            "rollout_rss_mib": max(e[3] for e in ends),
            "trainer_rss_mib": peak_rss_mib(),
            "shm_mib": watch.peak / 2**20,
        }
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
    reset_peak_rss()
    src = make_module(args.params, args.tensors, seed=1)
    dst = make_module(args.params, args.tensors, seed=None)
    times = []
    for _ in range(args.steps + 1):
        t0 = time.perf_counter()
        for _ in range(n):
            dst.load_state_dict(src.state_dict())
        times.append(time.perf_counter() - t0)
    return {"e2e_ms": 1e3 * statistics.median(times[1:]), "verified": state_hash(src) == state_hash(dst),
            "isolated": True, "trainer_rss_mib": peak_rss_mib()}


# ---------------------------------------------------------------------------------------------------- report

LABELS = {
    "rlsync-patch": "rlsync patch, Python API (shm), rollouts are processes",
    "rlsync-patch-threads": "rlsync patch, Python API (shm), rollouts are threads of the trainer's process",
    "rust-patch": "rlsync patch, `rlsync bench_sync` (shm), receivers are threads of the sender's process",
    "rust-patch-borrowed": "rlsync patch, `rlsync bench_sync` (shm), receiver threads over memory they do not own",
    "rlsync-patch-host-shared": "rlsync patch, Python API (shm), host-shared: rollout 0 applies, the others read",
    "rlsync-bucket": "rlsync bucket, Python API (shm), rollouts are processes",
    "rlsync-bucket-host-shared": "rlsync bucket, Python API (shm), host-shared: rollout 0 applies, the others read",
    "rlsync-bucket-threads": "rlsync bucket, Python API (shm), rollouts are threads of the trainer's process",
    "rust-bucket": "rlsync bucket, `rlsync bench_sync` (shm), receivers are threads of the sender's process",
    "rust-bucket-borrowed": "rlsync bucket, `rlsync bench_sync` (shm), receiver threads over memory they do not own",
    "torchrl-shared": "TorchRL `SharedMemWeightSyncScheme` (buffer separate from the trainer's module)",
    "torchrl-shared-alias": "TorchRL `SharedMemWeightSyncScheme`, buffer = the trainer's parameters (not isolated)",
    "torchrl-mp": "TorchRL `MultiProcessWeightSyncScheme` (a fresh CPU copy per version)",
    "load_state_dict": "`load_state_dict` copy (in process, per rollout)",
}
METHODS = list(LABELS)


def cell(r: dict[str, Any]) -> str:
    if "error" in r:
        return "failed"
    text = f"{r['e2e_ms']:.1f} ms"
    if r.get("payload_bytes") and "patch" in r["method"]:
        text += f" (payload {r['payload_bytes'] / 2**20:.2f} MiB)"
    if not r.get("verified", False):
        text += " NOT verified"
    return text


def print_summary(results: list[dict[str, Any]], receivers: list[int]) -> None:
    """README's table: one row per method, one column per rollout count; then the issue's two ratios."""
    by = {(r["method"], r["rollouts"]): r for r in results}
    cols = " | ".join(f"{n} rollout{'s' if n > 1 else ''}" for n in receivers)
    print(f"\n| method | {cols} |\n|---|{'---|' * len(receivers)}")
    for m in METHODS:
        if any((m, n) in by for n in receivers):
            print(f"| {LABELS[m]} | " + " | ".join(cell(by[(m, n)]) if (m, n) in by else "–" for n in receivers) + " |")
    for n in receivers:
        ok = lambda k: k in by and "error" not in by[k]  # noqa: E731
        for kind in ("patch", "bucket"):
            for py, what in ((f"rlsync-{kind}-threads", "same topology, rollouts threads"),
                             (f"rlsync-{kind}", "Python rollouts processes")):
                for rust, install in ((f"rust-{kind}", ""), (f"rust-{kind}-borrowed", ", Rust receivers over borrowed memory")):
                    if ok((py, n)) and ok((rust, n)):
                        print(f"- {n} rollout(s): Python API / Rust bench, {kind} ({what}{install}): "
                              f"{by[(py, n)]['e2e_ms'] / by[(rust, n)]['e2e_ms']:.2f}x (goal <= 1.2x)")
        if ok(("rlsync-patch", n)) and ok(("torchrl-shared", n)):
            print(f"- {n} rollout(s): TorchRL shared-memory / rlsync patch: "
                  f"{by[('torchrl-shared', n)]['e2e_ms'] / by[('rlsync-patch', n)]['e2e_ms']:.2f}x (goal >= 5x)")
        scan = next((by[(m, n)]["scan_ms"] for m in ("rust-patch", "rust-patch-borrowed")
                     if ok((m, n)) and by[(m, n)].get("scan_ms")), None)
        if scan and ok(("torchrl-shared", n)):
            # A patch build reads the state and its snapshot to find what changed: no patch here beats that read.
            print(f"- {n} rollout(s): the most any snapshot-diff patch can reach on this host, TorchRL shared-memory / "
                  f"one read of state + snapshot ({scan:.1f} ms): {by[('torchrl-shared', n)]['e2e_ms'] / scan:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=int, default=268435456, help="bf16 elements in the state (default 268 M)")
    ap.add_argument("--tensors", type=int, default=64, help="tensors in the state (default 64, as bench_sync's)")
    ap.add_argument("--receivers", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--steps", type=int, default=3, help="timed versions (after one warm-up)")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--rust-lr", type=float, default=None,
                    help="bench_sync's lr (default --lr); its model's shapes and init scales make the same lr change "
                         "more elements (2.6 %% vs 1.3 %% at 512 MiB, lr 1e-6): 4.3e-7 matches this bench's share")
    ap.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    ap.add_argument("--rlsync-bin", default=str(ROOT / "target" / "release" / "rlsync"),
                    help="the rlsync executable for the rust-* methods")
    ap.add_argument("--json", action="store_true", help="one JSON object per line instead of tables")
    ap.add_argument("--host-shared-verify", action=argparse.BooleanOptionalAction, default=True,
                    help="host-shared methods: the applier checksums every version it publishes (default: on; "
                         "off shows what that pass over the state costs)")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    print(f"# {args.params} bf16 params ({args.params * 2 / 2**20:.0f} MiB) in {args.tensors} tensors, "
          f"Adam-like lr {args.lr}, {args.steps} timed versions; {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    if not args.json:
        print("| method | rollouts | e2e ms (median) | verified | isolated | notes |\n|---|---|---|---|---|---|", flush=True)
    results = []
    for n in args.receivers:
        for method in args.methods:
            try:
                if method.startswith("rlsync-"):
                    r = run_rlsync(method.split("-")[1], n, args, ctx, threads=method.endswith("-threads"),
                                   host_shared=method.endswith("-host-shared"))
                elif method.startswith("rust-"):
                    r = run_rust(method.split("-")[1], n, args, borrowed=method.endswith("-borrowed"))
                elif method.startswith("torchrl-"):
                    r = run_torchrl(method.split("-", 1)[1], n, args, ctx)
                else:
                    r = run_load_state_dict(n, args)
            except Exception as e:  # report and go on with the other methods
                r = {"error": f"{type(e).__name__}: {e}"[:300]}
            r.update(method=method, rollouts=n, load=round(os.getloadavg()[0], 1))
            results.append(r)
            if args.json:
                print(json.dumps(r), flush=True)
            elif "error" in r:
                print(f"| {method} | {n} | – | – | – | failed: {r['error']} |", flush=True)
            else:
                notes = []
                if "changed" in r:
                    notes.append(f"{r['changed'] / args.params:.2%} changed, payload {r['payload_bytes'] / 2**20:.2f} MiB, "
                                 f"trainer's sync call {r['sender_ms']:.1f} ms")
                if r.get("density") is not None:
                    notes.append(f"{r['density']:.2%} changed, its memcpy of the state {r['memcpy_ms']:.1f} ms, "
                                 f"its scan of state + snapshot {r['scan_ms']:.1f} ms")
                for key, what in (("trainer_rss_mib", "trainer peak RSS"), ("rollout_rss_mib", "largest rollout peak RSS"),
                                  ("shm_mib", "/dev/shm")):
                    if r.get(key) is not None:
                        notes.append(f"{what} {r[key] / 1024:.2f} GiB")
                notes.append(f"load {r['load']}")
                print(f"| {method} | {n} | {r['e2e_ms']:.1f} | {r['verified']} | {r.get('isolated', '–')} | "
                      f"{'; '.join(notes)} |", flush=True)
    if not args.json:
        print_summary(results, args.receivers)


if __name__ == "__main__":
    sys.exit(main())
