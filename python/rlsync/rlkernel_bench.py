"""RL-Kernel's weight-bridge benchmark row for rlsync: ``python -m rlsync.rlkernel_bench --smoke --mode rlsync``.

Prints one JSON row with the columns of RL-Kernel's ``benchmarks/benchmark_weight_sync_bridge.py`` (``timestamp``,
``candidate_id``, ``mode``, ``status``, ``environment``, ``tensor_count``, ``total_nbytes``, ``publish_ms``,
``import_ms``, ``ack_ms``, ``release_ms``, ``active_weight_version``, ``notes``) for the same model (``--hidden-dim``
× ``--layers`` Linear + LayerNorm blocks); ``--output FILE.csv`` appends it as CSV too. The import and
acknowledge run in a fresh process that knows only the manifest, as a rollout worker would.
"""

from __future__ import annotations

import argparse
import csv
import json
import multiprocessing as mp
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

CSV_COLUMNS = [
    "timestamp",
    "candidate_id",
    "mode",
    "status",
    "environment",
    "tensor_count",
    "total_nbytes",
    "publish_ms",
    "import_ms",
    "ack_ms",
    "release_ms",
    "active_weight_version",
    "notes",
]


def _model(hidden_dim: int, layers: int) -> Any:
    import torch

    modules: list[Any] = []
    for _ in range(layers):
        modules += [torch.nn.Linear(hidden_dim, hidden_dim), torch.nn.LayerNorm(hidden_dim)]
    modules.append(torch.nn.Linear(hidden_dim, hidden_dim, bias=False))
    return torch.nn.Sequential(*modules)


def _environment() -> str:
    import torch

    if torch.cuda.is_available():
        return f"torch={torch.__version__};cuda={torch.version.cuda};gpu={torch.cuda.get_device_name(0)}"
    return f"torch={torch.__version__};cuda={torch.version.cuda or ''};gpu=none"


def _consumer(manifest: Any, queue: Any) -> None:
    from rlsync.rlkernel import RlsyncTensorBridge

    bridge = RlsyncTensorBridge(source_worker="benchmark-rollout", source_rank=1)
    try:
        t0 = time.perf_counter()
        tensors = bridge.import_update(manifest)
        t1 = time.perf_counter()
        bridge.acknowledge(manifest.update_id)
        t2 = time.perf_counter()
        queue.put(
            {
                "import_ms": (t1 - t0) * 1000,
                "ack_ms": (t2 - t1) * 1000,
                "tensor_count": len(tensors),
                "active_weight_version": bridge.active_weight_version,
            }
        )
        bridge.release(manifest.update_id)
    except Exception as exc:  # reported as the row's status
        queue.put({"error": f"{type(exc).__name__}: {exc}"})
    finally:
        bridge.close()


def run(args: argparse.Namespace) -> dict[str, Any]:
    from rlsync.rlkernel import RlsyncTensorBridge

    model = _model(args.hidden_dim, args.layers)
    bridge = RlsyncTensorBridge(source_worker="benchmark-training", source_rank=0)
    row: dict[str, Any] = {
        "timestamp": datetime.now(timezone.utc).isoformat(),
        "candidate_id": "rlsync",
        "mode": args.mode,
        "environment": _environment(),
    }
    try:
        t0 = time.perf_counter()
        manifest = bridge.publish(model, weight_version=args.weight_version, metadata={"benchmark": "weight_sync_bridge"})
        publish_ms = (time.perf_counter() - t0) * 1000
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        child = ctx.Process(target=_consumer, args=(manifest, queue))
        child.start()
        result = queue.get(timeout=300)
        child.join(timeout=60)
        t1 = time.perf_counter()
        bridge.release(manifest.update_id)
        release_ms = (time.perf_counter() - t1) * 1000
        if "error" in result:
            raise RuntimeError(result["error"])
        if result["tensor_count"] != manifest.tensor_count:
            raise RuntimeError("imported tensor count did not match the manifest")
        row.update(
            status="pass",
            tensor_count=manifest.tensor_count,
            total_nbytes=manifest.total_nbytes,
            publish_ms=publish_ms,
            import_ms=result["import_ms"],
            ack_ms=result["ack_ms"],
            release_ms=release_ms,
            active_weight_version=result["active_weight_version"],
            notes="rlsync bucket payloads in one 0600 shm segment; a fresh process imported and verified them "
            "from the manifest alone (checksummed, copied into staging).",
        )
    except Exception as exc:
        row.update(
            status="fail",
            tensor_count=0,
            total_nbytes=0,
            publish_ms=0.0,
            import_ms=0.0,
            ack_ms=0.0,
            release_ms=0.0,
            active_weight_version=None,
            notes=f"{type(exc).__name__}: {exc}",
        )
    finally:
        bridge.close()
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="the small default model (RL-Kernel's flag)")
    parser.add_argument("--mode", choices=["rlsync"], default="rlsync")
    parser.add_argument("--hidden-dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--weight-version", type=int, default=1)
    parser.add_argument("--output", type=Path, default=None, help="also append the row to this CSV file")
    args = parser.parse_args(argv)
    row = run(args)
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        new = not args.output.exists() or args.output.stat().st_size == 0
        with args.output.open("a", newline="", encoding="utf-8") as handle:
            writer = csv.DictWriter(handle, fieldnames=CSV_COLUMNS)
            if new:
                writer.writeheader()
            writer.writerow(row)
    print(json.dumps(row, sort_keys=True))
    return 0 if row["status"] == "pass" else 1


if __name__ == "__main__":
    sys.exit(main())
