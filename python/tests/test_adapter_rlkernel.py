"""rlsync.rlkernel.RlsyncTensorBridge against RL-Kernel's weight-bridge contract, written from what its tests
(tests/test_weight_sync_bridge.py) require of a bridge: manifest fields, the publish → import → acknowledge |
reject → release lifecycle, monotonic versions, layout validation, checksum re-validation, import from the
manifest alone in a fresh process; plus rlsync's own guarantees (corrupt, truncated, replayed updates rejected
whole, no segment left behind)."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
from dataclasses import replace

import pytest

import torch  # noqa: E402

from rlsync.rlkernel import (  # noqa: E402
    RlsyncTensorBridge,
    TensorDescriptor,
    WeightBridgeUnavailableError,
    WeightManifestValidationError,
    WeightUpdateRejectedError,
)


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4, bias=False))
    model.register_buffer("steps", torch.tensor([3], dtype=torch.int64))
    return model


def _segments() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("rlsync-rlk-")}


@pytest.fixture
def bridge():
    b = RlsyncTensorBridge(source_worker="trainer-0", source_rank=0)
    yield b
    b.close()


def test_publish_returns_manifest_with_tensor_metadata(bridge):
    model = _model()
    manifest = bridge.publish(model, weight_version=7, metadata={"step": 3})
    assert (manifest.source_worker, manifest.source_rank, manifest.weight_version) == ("trainer-0", 0, 7)
    assert manifest.transport == "rlsync-bucket"
    assert manifest.metadata["step"] == 3
    assert manifest.metadata["layout"] == {
        "kind": "full-state",
        "world_size": 1,
        "rank": 0,
        "tensor_parallel_size": 1,
        "data_parallel_size": 1,
        "zero_stage": 0,
        "node_count": 1,
        "rdma_enabled": False,
    }
    assert set(manifest.tensors) == set(model.state_dict())
    assert manifest.tensor_count == len(model.state_dict()) and manifest.total_nbytes > 0
    for name, tensor in model.state_dict().items():
        assert manifest.tensors[name] == TensorDescriptor.from_tensor(name, tensor)
        assert len(manifest.tensors[name].sha256) == 64
    segment = manifest.metadata["weight_bridge"]["segment"]
    assert os.stat(segment).st_mode & 0o777 == 0o600


def test_import_acknowledge_release_lifecycle(bridge):
    model = _model()
    manifest = bridge.publish(model, weight_version=1)
    imported = bridge.import_update(manifest)
    assert bridge.update_status(manifest.update_id) == "imported"
    assert set(imported) == set(model.state_dict())
    for name, original in model.state_dict().items():
        assert torch.equal(imported[name], original)
        assert imported[name].data_ptr() != original.data_ptr()  # staging, not the publisher's memory
    assert bridge.import_update(manifest).keys() == imported.keys()  # importing again is allowed
    bridge.acknowledge(manifest.update_id)
    assert (bridge.active_weight_version, bridge.active_update_id) == (1, manifest.update_id)
    assert bridge.update_status(manifest.update_id) == "acknowledged"
    segment = manifest.metadata["weight_bridge"]["segment"]
    bridge.release(manifest.update_id)
    bridge.release(manifest.update_id)  # idempotent
    assert bridge.update_status(manifest.update_id) == "released"
    assert bridge.active_update_id is None and bridge.active_weight_version == 1
    assert not os.path.exists(segment)


def test_reject_keeps_the_active_version(bridge):
    first = bridge.publish(_model(0), weight_version=1)
    bridge.import_update(first)
    bridge.acknowledge(first.update_id)
    second = bridge.publish(_model(1), weight_version=2)
    bridge.import_update(second)
    bridge.reject(second.update_id, "consumer validation failed")
    assert bridge.update_status(second.update_id) == "rejected"
    assert (bridge.active_weight_version, bridge.active_update_id) == (1, first.update_id)
    with pytest.raises(WeightUpdateRejectedError, match="rejected"):
        bridge.import_update(second)
    with pytest.raises(WeightUpdateRejectedError, match="rejected"):
        bridge.acknowledge(second.update_id)
    with pytest.raises(WeightUpdateRejectedError, match="cannot reject acknowledged"):
        bridge.reject(first.update_id, "too late")


def test_acknowledge_requires_an_import(bridge):
    manifest = bridge.publish(_model(), weight_version=1)
    with pytest.raises(WeightUpdateRejectedError, match="before import_update"):
        bridge.acknowledge(manifest.update_id)
    with pytest.raises(WeightUpdateRejectedError, match="unknown weight update"):
        bridge.acknowledge("no-such-update")


def test_acknowledge_revalidates_the_staged_content(bridge):
    manifest = bridge.publish(_model(), weight_version=1)
    imported = bridge.import_update(manifest)
    next(iter(imported.values())).add_(1)  # the staged weights change between import and acknowledge
    with pytest.raises(WeightManifestValidationError, match="checksum mismatch"):
        bridge.acknowledge(manifest.update_id)
    assert bridge.active_weight_version is None and bridge.active_update_id is None


def test_descriptor_mismatch_rejects_import():
    publisher = RlsyncTensorBridge()
    consumer = RlsyncTensorBridge(source_worker="rollout", source_rank=1)
    try:
        manifest = publisher.publish(_model(), weight_version=1)
        name, descriptor = next(iter(manifest.tensors.items()))
        mutated = replace(manifest, tensors={**dict(manifest.tensors), name: replace(descriptor, shape=(999,))})
        with pytest.raises(WeightManifestValidationError, match="descriptor mismatch"):
            publisher.import_update(mutated)  # the publisher knows the real manifest
        with pytest.raises(WeightManifestValidationError, match="descriptor mismatch|rejected by rlsync"):
            consumer.import_update(mutated)  # a consumer meeting it first: the payloads disagree
        assert publisher.update_status(manifest.update_id) == "published"
        assert consumer.active_weight_version is None
    finally:
        publisher.close()
        consumer.close()


def test_corrupt_truncated_and_replayed_updates_are_rejected_whole():
    publisher = RlsyncTensorBridge()
    consumer = RlsyncTensorBridge(source_worker="rollout", source_rank=1)
    try:
        v1 = publisher.publish(_model(0), weight_version=1)
        v2 = publisher.publish(_model(1), weight_version=2)
        meta = v2.metadata["weight_bridge"]
        # Truncated: the manifest lists fewer payloads than the version has.
        short = replace(v2, metadata={**v2.metadata, "weight_bridge": {**meta, "payloads": meta["payloads"][:-1]}})
        assert len(meta["payloads"]) > 1  # rlsync's manifest payload, then the bucket(s)
        with pytest.raises(WeightManifestValidationError, match="truncated"):
            consumer.import_update(short)
        # Corrupt: one byte of the segment flipped.
        with open(meta["segment"], "r+b") as f:
            offset, length = meta["payloads"][0]
            f.seek(offset + length // 2)
            byte = f.read(1)
            f.seek(offset + length // 2)
            f.write(bytes([byte[0] ^ 0x5A]))
        with pytest.raises(WeightManifestValidationError, match="checksum mismatch"):
            consumer.import_update(v2)
        assert consumer.update_status(v2.update_id) == "released"  # nothing recorded
        with open(meta["segment"], "r+b") as f:  # repaired: it imports
            f.seek(offset + length // 2)
            f.write(byte)
        consumer.import_update(v2)
        consumer.acknowledge(v2.update_id)
        # Replayed / older: version 1 after version 2 from the same publisher.
        with pytest.raises(WeightManifestValidationError, match="replayed or stale"):
            consumer.import_update(v1)
        assert consumer.active_weight_version == 2
    finally:
        publisher.close()
        consumer.close()


def test_publish_versions_increase(bridge):
    bridge.publish(_model(), weight_version=3)
    with pytest.raises(WeightManifestValidationError, match="monotonically"):
        bridge.publish(_model(), weight_version=3)


def test_layouts(bridge):
    manifest = bridge.publish(_model(), weight_version=1, metadata={"layout": {"zero_stage": 3}})
    assert manifest.metadata["layout"]["kind"] == "full-state" and manifest.metadata["layout"]["zero_stage"] == 3
    with pytest.raises(WeightBridgeUnavailableError, match="weight layout"):
        bridge.publish(_model(), weight_version=2, metadata={"layout": {"kind": "zero-shard"}})
    with pytest.raises(WeightBridgeUnavailableError, match="tensor-parallel"):
        bridge.publish(_model(), weight_version=2, metadata={"layout": {"tensor_parallel_size": 2}})
    with pytest.raises(WeightBridgeUnavailableError, match="multi-node/RDMA"):
        bridge.publish(_model(), weight_version=2, metadata={"layout": {"node_count": 2}})
    with pytest.raises(WeightManifestValidationError, match="reserved"):
        bridge.publish(_model(), weight_version=2, metadata={"weight_bridge": {}})


def test_empty_tensors(bridge):
    model = _model()
    model.register_buffer("empty", torch.zeros(0, 3))
    manifest = bridge.publish(model, weight_version=1)
    imported = bridge.import_update(manifest)
    assert imported["empty"].shape == (0, 3)
    bridge.acknowledge(manifest.update_id)


def _import_in_fresh_process(manifest, queue) -> None:
    consumer = RlsyncTensorBridge(source_worker="rollout", source_rank=1)
    try:
        tensors = consumer.import_update(manifest)
        consumer.acknowledge(manifest.update_id)
        # Plain lists: torch would share tensors through file descriptors that die with this process.
        queue.put({k: v.flatten().tolist() for k, v in tensors.items()} | {"__version__": consumer.active_weight_version})
        consumer.release(manifest.update_id)
    except Exception as exc:
        queue.put({"__error__": f"{type(exc).__name__}: {exc}"})
    finally:
        consumer.close()


def test_fresh_process_imports_from_the_manifest_alone(bridge):
    model = _model(5)
    manifest = bridge.publish(model, weight_version=4)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_import_in_fresh_process, args=(manifest, queue))
    child.start()
    got = queue.get(timeout=120)
    child.join(timeout=60)
    assert "__error__" not in got, got.get("__error__")
    assert got.pop("__version__") == 4
    for name, tensor in model.state_dict().items():
        assert got[name] == tensor.flatten().tolist()
    assert os.path.exists(manifest.metadata["weight_bridge"]["segment"])  # the consumer does not unlink it


_PUBLISH_AND_DIE = """
import os, sys, torch
from rlsync.rlkernel import RlsyncTensorBridge
b = RlsyncTensorBridge()
m = b.publish(torch.nn.Linear(4, 4), weight_version=1)
print(m.metadata["weight_bridge"]["segment"], flush=True)
os.kill(os.getpid(), 9)
"""


def test_a_killed_publisher_leaves_no_segment_behind():
    out = subprocess.run([sys.executable, "-c", _PUBLISH_AND_DIE], capture_output=True, text=True, timeout=120)
    assert out.returncode == -signal.SIGKILL
    segment = out.stdout.strip()
    assert os.path.exists(segment)  # killed before release: still there ...
    RlsyncTensorBridge().close()  # ... until the next bridge on this host starts
    assert not os.path.exists(segment)


def test_close_unlinks_every_segment():
    before = _segments()
    b = RlsyncTensorBridge()
    b.publish(_model(), weight_version=1)
    b.publish(_model(), weight_version=2)
    assert len(_segments() - before) == 2
    b.close()
    assert _segments() == before


def test_benchmark_prints_one_json_row(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "rlsync.rlkernel_bench", "--smoke", "--mode", "rlsync", "--output", str(tmp_path / "b.csv")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    row = json.loads(out.stdout.strip().splitlines()[-1])
    assert row["status"] == "pass" and row["mode"] == "rlsync"
    assert row["tensor_count"] == 4 * 4 + 1 and row["active_weight_version"] == 1
    for key in ("publish_ms", "import_ms", "ack_ms", "release_ms"):
        assert row[key] >= 0
    assert (tmp_path / "b.csv").read_text().splitlines()[0].startswith("timestamp,candidate_id,mode,status")
