"""Weight sync across hosts, emulated: a trainer and a receiver in two network namespaces joined by a veth pair
capped at ``--rate`` (tc tbf on both ends): rlsync patch over TCP against TorchRL's schemes that cross hosts.

    sudo python python/bench/netns_bench.py --params 268435456 --steps 3            # 512 MiB bf16, 1 Gbit/s
    sudo python python/bench/netns_bench.py --params 1048576 --steps 2              # a quick check

Needs root (``ip netns``, ``ip link``, ``tc``). The namespaces ``rlsb<pid>a`` / ``rlsb<pid>b``, the veth pair
and its addresses (``--subnet``, default 10.231.0.1 / 10.231.0.2) are created here and removed on every exit
path (normal end, an error, SIGINT/SIGTERM); no traffic leaves them. Methods (each a fresh trainer + receiver):

- ``rlsync-patch``: ``rlsync.PatchWeightSyncer`` over ``rlsync.tcp_sender`` / ``tcp_receiver`` (authenticated),
  ``sync(..., wait="applied")``: returns once the receiver installed and acknowledged the version;
- ``rlsync-bucket``: the same with ``BucketWeightSyncer`` (every byte each version: the link's floor);
- ``torchrl-distributed``: TorchRL's ``DistributedWeightSyncScheme(backend="gloo")``: the TCPStore says "update",
  the weights go as gloo point-to-point sends, the receiver applies them and acknowledges through the store, and
  ``send`` waits for that ack.

Not run: TorchRL's ``RPCWeightSyncScheme`` — it is only usable from TorchRL's ``RPCCollector`` (its
``init_on_sender`` requires the collector's ``collector_infos`` / ``collector_rrefs`` / ``collector_class``) and
moves the same full state per version over torch.distributed.rpc; ``RayWeightSyncScheme`` needs Ray.

The state and update are ``sync_bench.py``'s (bf16 matrices, an Adam-like step at ``--lr`` on fp32 masters);
the time is median over ``--steps`` versions after one warm-up, from the trainer's call until the receiver's ack.
After the last version the receiver hashes every byte of its weights: "verified" = equal to the trainer's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sync_bench import AdamLike, make_module, state_hash  # noqa: E402

import torch  # noqa: E402

TOKEN = "netns-bench-token"
METHODS = ["rlsync-patch", "rlsync-bucket", "torchrl-distributed"]
LABELS = {
    "rlsync-patch": "rlsync patch over TCP (`tcp_sender` / `tcp_receiver`)",
    "rlsync-bucket": "rlsync bucket over TCP",
    "torchrl-distributed": "TorchRL `DistributedWeightSyncScheme` (gloo over TCP)",
}


# ---------------------------------------------------------------------------------------------------- namespaces


class Netns:
    """Two namespaces joined by a veth pair capped at ``rate`` on both ends; removed by :meth:`close`."""

    def __init__(self, subnet: str, rate: str) -> None:
        tag = f"rlsb{os.getpid()}"
        self.a, self.b = f"{tag}a", f"{tag}b"
        base = subnet.rsplit(".", 1)[0]
        self.addr_a, self.addr_b = f"{base}.1", f"{base}.2"
        self.rate = rate
        self.made: list[str] = []

    @staticmethod
    def _ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, text=True)

    def open(self) -> None:
        for ns in (self.a, self.b):
            self._ip("netns", "add", ns)
            self.made.append(ns)
        self._ip("link", "add", self.a, "netns", self.a, "type", "veth", "peer", "name", self.b, "netns", self.b)
        for ns, dev, addr in ((self.a, self.a, self.addr_a), (self.b, self.b, self.addr_b)):
            self._ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            self._ip("-n", ns, "link", "set", dev, "up")
            self._ip("-n", ns, "link", "set", "lo", "up")
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate",
                            self.rate, "burst", "512kb", "latency", "50ms"], check=True, capture_output=True)

    def close(self) -> None:
        """Delete the namespaces (the veth pair goes with them). Idempotent."""
        while self.made:
            ns = self.made.pop()
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)

    def exec(self, ns: str, *cmd: str, **kw: Any) -> subprocess.Popen:
        return subprocess.Popen(["ip", "netns", "exec", ns, *cmd], **kw)


# ---------------------------------------------------------------------------------------------------- roles


def emit(obj: dict[str, Any]) -> None:
    print("RESULT " + json.dumps(obj), flush=True)


def trainer(args: argparse.Namespace) -> None:
    model = make_module(args.params, args.tensors, seed=1)
    opt = AdamLike(model, args.lr)
    times: list[float] = []
    if args.method.startswith("rlsync-"):
        import rlsync

        async def run() -> None:
            syncer = (rlsync.PatchWeightSyncer(init_sync_enabled=True) if args.method == "rlsync-patch"
                      else rlsync.BucketWeightSyncer(bucket_size=64 << 20))
            tx = await rlsync.tcp_sender(f"{args.addr}:{args.port}", 1, token=TOKEN, timeout=600)
            await syncer.init_sender(model.state_dict(), list(model.state_dict()), tx, timeout=600)
            if args.method == "rlsync-bucket":
                await syncer.sync(model.state_dict(), tx, 0, timeout=600, wait="applied")
            for v in range(1, args.steps + 2):
                opt.step()
                t0 = time.perf_counter()
                await syncer.sync(model.state_dict(), tx, v, timeout=600, wait="applied")
                times.append(time.perf_counter() - t0)
                report = syncer.last_report()
            await syncer.flush(timeout=600)
            emit({"times": times, "hash": state_hash(model), "payload_bytes": report.get("payload_bytes")})

        asyncio.run(run())
        return
    from torchrl.weight_update import DistributedWeightSyncScheme
    from tensordict import TensorDict

    scheme = DistributedWeightSyncScheme(backend="gloo", timeout=600)
    scheme.init_on_sender(model_id="policy", num_workers=1, model=model)
    Path(args.store_file).write_text(json.dumps({"host": args.addr, "port": scheme._store_port}))
    scheme.connect()
    weights = TensorDict.from_module(model)
    for _ in range(args.steps + 1):
        opt.step()
        t0 = time.perf_counter()
        scheme.send(weights)
        times.append(time.perf_counter() - t0)
    emit({"times": times, "hash": state_hash(model), "payload_bytes": args.params * 2})
    sys.stdin.readline()  # the receiver hashed its weights: now the process group may go
    scheme.shutdown()


class _Context:
    """What the scheme resolves the model from on a receiver (TorchRL's collectors pass themselves)."""

    def __init__(self, policy: torch.nn.Module) -> None:
        self.policy = policy


def receiver(args: argparse.Namespace) -> None:
    model = make_module(args.params, args.tensors, seed=None)
    if args.method.startswith("rlsync-"):
        import rlsync

        async def run() -> None:
            syncer = (rlsync.PatchWeightSyncer(init_sync_enabled=True) if args.method == "rlsync-patch"
                      else rlsync.BucketWeightSyncer(bucket_size=64 << 20))
            rx = await rlsync.tcp_receiver(f"{args.addr}:{args.port}", 0, token=TOKEN, timeout=600)
            await syncer.init_receiver(model.state_dict(), rx, timeout=600)
            for _ in range(args.steps + 1 + (args.method == "rlsync-bucket")):
                await syncer.apply(model, rx, timeout=600)

        asyncio.run(run())
    else:
        from torchrl.weight_update import DistributedWeightSyncScheme

        deadline = time.monotonic() + 600
        while not Path(args.store_file).exists() or not Path(args.store_file).read_text():
            if time.monotonic() > deadline:
                raise TimeoutError("the trainer never published its TCPStore")
            time.sleep(0.05)
        scheme = DistributedWeightSyncScheme(backend="gloo", timeout=600)
        scheme._store_info = json.loads(Path(args.store_file).read_text())
        scheme._num_workers = 1
        context = _Context(model)
        scheme.init_on_receiver(model_id="policy", context=context, worker_idx=1)
        scheme.connect(worker_idx=1)
    sys.stdin.readline()  # the driver says the trainer's last version was acknowledged
    emit({"hash": state_hash(model)})
    os._exit(0)  # the torchrl receiver's background thread and process group need no orderly end here


# ---------------------------------------------------------------------------------------------------- driver


def result_of(proc: subprocess.Popen, what: str, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("RESULT "):
            return json.loads(line[7:])
        if time.monotonic() > deadline:
            break
    raise RuntimeError(f"the {what} ended without a result (exit {proc.wait()})")


def run_method(net: Netns, method: str, args: argparse.Namespace, store_file: str) -> dict[str, Any]:
    common = [sys.executable, __file__, "--method", method, "--params", str(args.params), "--tensors",
              str(args.tensors), "--steps", str(args.steps), "--lr", str(args.lr), "--addr", net.addr_a, "--port",
              str(args.port), "--store-file", store_file]
    env = dict(os.environ, MASTER_ADDR=net.addr_a, MASTER_PORT=str(args.port + 1))
    if Path(store_file).exists():
        Path(store_file).unlink()
    procs = []
    try:
        kw: dict[str, Any] = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "text": True}
        rx = net.exec(net.b, *common, "--role", "receiver", env=dict(env, GLOO_SOCKET_IFNAME=net.b), **kw)
        procs.append(rx)
        tx = net.exec(net.a, *common, "--role", "trainer", env=dict(env, GLOO_SOCKET_IFNAME=net.a), **kw)
        procs.append(tx)
        sent = result_of(tx, "trainer", 3600)
        assert rx.stdin is not None and tx.stdin is not None
        rx.stdin.write("done\n")
        rx.stdin.flush()
        got = result_of(rx, "receiver", 900)
        tx.stdin.write("done\n")
        tx.stdin.flush()
        times = sent["times"][1:]  # the first version is a warm-up
        return {"e2e_ms": 1e3 * statistics.median(times), "min_ms": 1e3 * min(times),
                "payload_mib": (sent.get("payload_bytes") or 0) / 2**20, "verified": got["hash"] == sent["hash"]}
    finally:
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def driver(args: argparse.Namespace) -> int:
    if os.geteuid() != 0:
        print("netns_bench needs root (ip netns / tc)", file=sys.stderr)
        return 2
    net = Netns(args.subnet, args.rate)

    def on_signal(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_signal)
    store_file = f"/tmp/netns-bench-{os.getpid()}.store"
    results = []
    try:
        net.open()
        print(f"# {args.params} bf16 params ({args.params * 2 / 2**20:.0f} MiB) in {args.tensors} tensors, Adam-like "
              f"lr {args.lr}, {args.steps} timed versions; {net.a} {net.addr_a} <-> {net.b} {net.addr_b}, tbf "
              f"{args.rate} on both ends; load average {os.getloadavg()[0]:.1f}", flush=True)
        print("| method | e2e ms (median) | min ms | payload MiB | verified | load |\n|---|---|---|---|---|---|",
              flush=True)
        for method in args.methods:
            try:
                r = run_method(net, method, args, store_file)
            except Exception as e:  # report and go on with the other methods
                r = {"error": f"{type(e).__name__}: {e}"[:300]}
            r.update(method=method, load=round(os.getloadavg()[0], 1))
            results.append(r)
            if "error" in r:
                print(f"| {LABELS[method]} | failed: {r['error']} | | | | {r['load']} |", flush=True)
            else:
                print(f"| {LABELS[method]} | {r['e2e_ms']:.1f} | {r['min_ms']:.1f} | {r['payload_mib']:.2f} | "
                      f"{r['verified']} | {r['load']} |", flush=True)
    finally:
        net.close()
        if Path(store_file).exists():
            Path(store_file).unlink()
    by = {r["method"]: r for r in results if "error" not in r}
    if "rlsync-patch" in by and "torchrl-distributed" in by:
        print(f"- TorchRL distributed / rlsync patch: "
              f"{by['torchrl-distributed']['e2e_ms'] / by['rlsync-patch']['e2e_ms']:.1f}x (goal >= 10x)")
    return 0 if len(by) == len(results) and all(r["verified"] for r in by.values()) else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=int, default=268435456)
    ap.add_argument("--tensors", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3, help="timed versions (after one warm-up)")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--rate", default="1gbit", help="tc tbf rate on both ends of the veth pair")
    ap.add_argument("--subnet", default="10.231.0.0", help="a /24 of your own: .1 is the trainer, .2 the receiver")
    ap.add_argument("--port", type=int, default=29731, help="the trainer's port (+1: torch.distributed's master)")
    ap.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    ap.add_argument("--role", choices=["trainer", "receiver"], help=argparse.SUPPRESS)
    ap.add_argument("--method", help=argparse.SUPPRESS)
    ap.add_argument("--addr", help=argparse.SUPPRESS)
    ap.add_argument("--store-file", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "trainer":
        trainer(args)
        return 0
    if args.role == "receiver":
        receiver(args)
        return 0
    try:
        return driver(args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
