"""A Python trainer's own state in rlsync checkpoints: optimizer, critic, schedules, running statistics.

rlsync saves the tensors of ``Trainer.model()`` in ``model.safetensors``. A trainer that defines
``state_dict()`` (and ``load_state_dict(sd)``), as PyTorch modules, optimizers and LR schedulers do, gets the rest
of what resuming needs saved next to it, in ``optimizer.safetensors`` (the name the built-in learner uses for its
Adam moments), and restored on ``runner.resume_dir`` right after the weights, before the first step::

    class Trainer:
        def state_dict(self) -> dict:
            return {"optimizer": self.optim.state_dict(), "critic": self.critic.state_dict(),
                    "schedule": self.sched.state_dict(), "ret_rms": self.ret_rms}
        def load_state_dict(self, sd: dict) -> None:
            self.optim.load_state_dict(sd["optimizer"]); self.critic.load_state_dict(sd["critic"]); ...

What ``state_dict()`` may return: nested dicts (``str`` or ``int`` keys, as an optimizer's ``state``), lists,
tuples, ``torch.Tensor`` (any device: saved from the CPU, restored on the CPU, as ``torch.load(...,
map_location="cpu")`` gives them; ``torch.optim.Optimizer.load_state_dict`` moves them to its parameters'
device), ``numpy.ndarray``, numbers, strings, bools and ``None``. Anything else raises ``TypeError`` naming
where it is.

The file is an ordinary safetensors file: every tensor under its dotted path (``optimizer.state.0.exp_avg``,
``critic.0.weight``, ``ret_rms``), and in the string metadata ``format: rlsync_checkpoint``, ``format_version``,
``global_step``, ``version`` and ``trainer_state``: a JSON tree of the nesting (see :func:`flatten_state`). Read
it back with :func:`load_trainer_state` (no extra packages), or with the ``safetensors`` package::

    from safetensors import safe_open
    with safe_open(path, "pt") as f:
        sd = rlsync.checkpoint.unflatten_state({k: f.get_tensor(k) for k in f.keys()},
                                               f.metadata()["trainer_state"])
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

__all__ = [
    "TRAINER_STATE_FILE",
    "STRUCTURE_KEY",
    "flatten_state",
    "unflatten_state",
    "save_trainer_state",
    "load_trainer_state",
]

TRAINER_STATE_FILE = "optimizer.safetensors"
"""File name of a Python trainer's state inside ``checkpoints/global_step_<n>/``."""
STRUCTURE_KEY = "trainer_state"
"""Metadata key of the file that holds the JSON tree of the nesting."""


def _path(parts: list[str]) -> str:
    return ".".join(parts) if parts else "<root>"


def flatten_state(state: Any) -> tuple[dict[str, Any], str]:
    """Split a nested trainer state into its tensors (by dotted path) and a JSON tree of everything else.

    The tree's nodes: ``{"tensor": name}`` (a ``torch.Tensor`` stored under ``name``), ``{"ndarray": name}`` (a
    ``numpy.ndarray`` stored as a tensor), ``{"dict": [[key, node], ...]}`` (keys keep their type, ``str`` or
    ``int``), ``{"list": [node, ...]}``, ``{"tuple": [node, ...]}`` and ``{"value": v}`` (``None``, ``bool``,
    ``int``, ``float``, ``str``). Tensors come back detached, contiguous CPU copies.
    """
    import numpy as np
    import torch

    tensors: dict[str, torch.Tensor] = {}

    def store(parts: list[str], t: torch.Tensor, kind: str) -> dict:
        name = _path(parts)
        if name in tensors:
            raise ValueError(f"trainer state: two tensors at '{name}' (keys that contain dots collide with nesting)")
        tensors[name] = t.detach().to("cpu").contiguous().clone()
        return {kind: name}

    def walk(obj: Any, parts: list[str]) -> dict:
        if isinstance(obj, torch.Tensor):
            return store(parts, obj, "tensor")
        if isinstance(obj, np.ndarray):
            try:
                t = torch.from_numpy(np.ascontiguousarray(obj))
            except TypeError as e:
                raise TypeError(f"trainer state at '{_path(parts)}': numpy dtype {obj.dtype} cannot be saved ({e})") from None
            return store(parts, t, "ndarray")
        if isinstance(obj, np.generic):
            return {"value": obj.item()}
        if obj is None or isinstance(obj, (bool, int, float, str)):
            return {"value": obj}
        if isinstance(obj, Mapping):
            items = []
            for k, v in obj.items():
                if isinstance(k, bool) or not isinstance(k, (str, int)):
                    raise TypeError(f"trainer state at '{_path(parts)}': key {k!r} is a {type(k).__name__} (keys must be str or int)")
                items.append([k, walk(v, [*parts, str(k)])])
            return {"dict": items}
        if isinstance(obj, (list, tuple)):
            kind = "tuple" if isinstance(obj, tuple) else "list"
            return {kind: [walk(v, [*parts, str(i)]) for i, v in enumerate(obj)]}
        raise TypeError(
            f"trainer state at '{_path(parts)}' is a {type(obj).__name__}: state_dict() may hold tensors, numpy arrays, "
            "numbers, strings, bools, None, and dicts, lists and tuples of them"
        )

    tree = walk(state, [])
    return tensors, json.dumps(tree)


def unflatten_state(tensors: Mapping[str, Any], structure: str) -> Any:
    """Rebuild what :func:`flatten_state` split: ``tensors`` by name and the JSON tree ``structure``."""

    def build(node: dict) -> Any:
        (kind, body), = node.items()
        if kind == "value":
            return body
        if kind in ("tensor", "ndarray"):
            if body not in tensors:
                raise KeyError(f"trainer state: tensor '{body}' is missing from the file")
            t = tensors[body]
            return t.numpy() if kind == "ndarray" else t
        if kind == "dict":
            return {k: build(v) for k, v in body}
        if kind == "list":
            return [build(v) for v in body]
        if kind == "tuple":
            return tuple(build(v) for v in body)
        raise ValueError(f"trainer state: unknown node kind '{kind}'")

    return build(json.loads(structure))


def _tensor(dtype: str, shape: list[int], data: bytes) -> Any:
    import torch

    dt = getattr(torch, dtype)
    if not data:
        return torch.empty(shape, dtype=dt)
    return torch.frombuffer(bytearray(data), dtype=dt).reshape(shape)


def load_trainer_state(checkpoint_dir: str | os.PathLike[str]) -> Any:
    """The trainer state saved in ``checkpoint_dir`` (``<run>/checkpoints/global_step_<n>``), as the trainer's
    ``state_dict()`` returned it (tensors on the CPU, numpy arrays as numpy arrays)."""
    from . import _native

    items, structure = _native.read_trainer_state(os.fspath(checkpoint_dir))
    return unflatten_state({name: _tensor(dtype, shape, data) for name, dtype, shape, data in items}, structure)


def save_trainer_state(
    checkpoint_dir: str | os.PathLike[str], state: Any, *, global_step: int = 0, version: int = 0
) -> None:
    """Write ``state`` (what a trainer's ``state_dict()`` returns) to ``<checkpoint_dir>/optimizer.safetensors``
    as rlsync's checkpoints do (the directory is created if needed); :func:`load_trainer_state` reads it."""
    from . import _native
    from .syncer import _describe

    tensors, structure = flatten_state(state)
    _native.write_trainer_state(os.fspath(checkpoint_dir), _describe(tensors), structure, global_step, version)
