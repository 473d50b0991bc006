"""The package imports, documents itself, and one patch round trip over the caller's send/recv works."""

from __future__ import annotations

import ast
import asyncio
import pydoc
from pathlib import Path

import torch

import rlsync
from conftest import Link


def test_import_and_help_are_readable() -> None:
    assert rlsync.__version__
    doc = rlsync.WeightSyncer.__doc__ or ""
    assert "RLinf" in doc
    for name in ("init_sender", "init_receiver", "sync", "apply"):
        assert getattr(rlsync.WeightSyncer, name).__doc__, name
    assert issubclass(rlsync.PayloadRejected, rlsync.RlsyncError)
    assert issubclass(rlsync.RlsyncError, RuntimeError)


def test_patch_round_trip_keeps_parameter_identity() -> None:
    torch.manual_seed(0)
    trainer, rollout = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)
    weight, ptr = rollout.weight, rollout.weight.data_ptr()

    async def main() -> None:
        link = Link()
        tx = rlsync.PatchWeightSyncer(init_sync_enabled=True)
        rx = rlsync.PatchWeightSyncer(init_sync_enabled=True)
        await asyncio.gather(
            tx.init_sender(trainer.state_dict(), rlsync.param_names_need_sync(trainer), link.send, link.up_recv),
            rx.init_receiver(rollout.state_dict(), link.recv, link.up_send),
        )
        assert torch.equal(rollout.weight, trainer.weight)
        for version in (1, 2):
            with torch.no_grad():
                trainer.weight[0, version] += 1.0
            await tx.sync(trainer.state_dict(), link.send, version)
            assert await rx.apply(rollout, link.recv) == version
            assert torch.equal(rollout.weight, trainer.weight)
            assert tx.checksum(trainer.state_dict()) == rx.checksum(rollout.state_dict())
        assert rx.version == 2 and tx.version == 2

    asyncio.run(main())
    assert rollout.weight is weight and rollout.weight.data_ptr() == ptr


def test_help_renders_the_whole_interface() -> None:
    text = pydoc.render_doc(rlsync, renderer=pydoc.plaintext)
    for name in ("PatchWeightSyncer", "BucketWeightSyncer", "param_names_need_sync", "shm_sender",
                 "load_trainer_state", "PayloadRejected", "HandshakeError"):
        assert name in text, name
    patch = pydoc.render_doc(rlsync.PatchWeightSyncer, renderer=pydoc.plaintext)
    assert "async init_sender(self, state_dict" in patch and "async apply(self, model" in patch
    assert "compression_algorithm: 'str' = 'none'" in patch, "signatures keep their type hints and defaults"
    assert "Rust cause" in pydoc.render_doc(rlsync.RlsyncError, renderer=pydoc.plaintext)


def test_the_native_module_has_type_stubs_for_every_public_name() -> None:
    from rlsync import _native

    stub = ast.parse(Path(rlsync.__file__).with_name("_native.pyi").read_text())
    declared: dict[str, set[str]] = {}
    for node in stub.body:
        if isinstance(node, ast.ClassDef):
            declared[node.name] = {f.name for f in node.body if isinstance(f, ast.FunctionDef)} - {"__init__"}
        elif isinstance(node, ast.FunctionDef):
            declared[node.name] = set()
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            declared[node.target.id] = set()
    public = {n for n in dir(_native) if not n.startswith("_")} | {"__version__"}
    assert public <= set(declared), public - set(declared)
    for name, members in declared.items():
        if name in ("Desc", "Array"):
            continue
        assert hasattr(_native, name), f"the stub declares {name}, the module has none"
        for m in members:
            assert hasattr(getattr(_native, name), m), f"{name}.{m}"
