"""Host-shared weights: the rollouts of a host act on one double-buffered copy of the weights in shared memory.

One process per host receives (``init_receiver(..., host_shared="name")`` on a :class:`rlsync.PatchWeightSyncer`
or :class:`rlsync.BucketWeightSyncer`): each version is installed into the arena's back buffer, then the buffers
swap at the version boundary. Every other process of the host attaches a reader to its model::

    with rlsync.HostSharedReader("run1.arena", policy) as weights:   # policy's tensors now view the arena
        while True:
            weights.refresh()            # between steps: the newest version, swapped in place
            act(policy, obs)

A reader's model tensors are views of the shared buffer it holds (``param.data = view``: the parameters keep
their identity, no copy). The applier never writes a buffer a live reader holds, so a reader only ever sees
whole versions; a reader killed at any moment leaves nothing behind (the applier clears its slot). The views
are read-only memory: write to them and the process faults. The views keep the reader's slot and mapping
alive (a reader dropped without closing holds its buffer while its model does);
:meth:`HostSharedReader.close` gives the model a private copy of the held version, then frees the slot and
unmaps the arena (views kept elsewhere must not be used after it).
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Any

from . import _native
from .syncer import StateDictLike, _state_dict

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["HostSharedReader", "unlink"]


def unlink(name: str) -> bool:
    """Remove arena ``name`` from ``/dev/shm`` (processes that mapped it keep their mapping); whether it existed."""
    return _native.host_shared_unlink(name)


def _view(addr: int, nbytes: int, dtype: str, shape: tuple[int, ...], owner: Any) -> "torch.Tensor":
    """A tensor over ``nbytes`` of shared memory at ``addr`` (no copy) that keeps ``owner`` (the native reader:
    its mapping and its slot) alive as long as the tensor lives."""
    import torch

    torch_dtype = getattr(torch, dtype)
    if nbytes == 0:
        return torch.empty(shape, dtype=torch_dtype)
    memory = (ctypes.c_char * nbytes).from_address(addr)
    memory._owner = owner  # type: ignore[attr-defined]  # torch.frombuffer keeps `memory` alive
    numel = nbytes // torch.empty((), dtype=torch_dtype).element_size()
    return torch.frombuffer(memory, dtype=torch_dtype, count=numel).view(shape)


class HostSharedReader:
    """A reader of host-shared arena ``name`` bound to ``model`` (a ``torch.nn.Module`` or a state dict of its
    tensors): every tensor of it becomes a view of the held buffer, and :meth:`refresh` / :meth:`wait_newer`
    swap them to a newer version in place. Waits up to ``timeout`` seconds for the arena to be created and a
    first version published. The model must hold exactly the arena's tensors (names, dtypes, shapes; tied
    parameters once), on the CPU."""

    def __init__(self, name: str, model: StateDictLike, *, timeout: float = 60.0) -> None:
        self._name = name
        self._native = _native.HostSharedReader(name, float(timeout))
        try:
            self._targets, self._views = self._prepare(model)
        except BaseException:
            self._native.close()
            raise
        self._bind(self._native.held[3])

    def _prepare(self, model: StateDictLike) -> tuple[list[tuple[Any, str]], tuple[dict, dict]]:
        """The model's tensors to rebind (with their arena names) and both buffers' views, checked."""
        import torch

        views: tuple[dict, dict] = ({}, {})
        for name, dtype, shape, addr_a, addr_b, nbytes in self._native.layout():
            views[0][name] = _view(addr_a, nbytes, dtype, tuple(shape), self._native)
            views[1][name] = _view(addr_b, nbytes, dtype, tuple(shape), self._native)
        targets: list[tuple[Any, str]] = []
        bound: dict[int, str] = {}
        for key, t in _state_dict(model).items():
            if not isinstance(t, torch.Tensor):
                continue  # modules' extra state
            if id(t) in bound:
                continue  # a tied alias: bound through its first name
            view = views[0].get(key)
            if view is None:
                raise ValueError(f"tensor '{key}' of the model is not in arena {self._name!r}")
            if t.device.type != "cpu" or t.dtype != view.dtype or tuple(t.shape) != tuple(view.shape):
                raise ValueError(
                    f"tensor '{key}' is {t.dtype} {tuple(t.shape)} on {t.device}; arena {self._name!r} holds "
                    f"{view.dtype} {tuple(view.shape)} on the CPU"
                )
            targets.append((t, key))
            bound[id(t)] = key
        missing = sorted(set(views[0]) - set(bound.values()))
        if missing:
            raise ValueError(f"arena {self._name!r} holds tensors the model lacks: {missing}")
        return targets, views

    def _bind(self, buffer: int) -> None:
        import torch

        views = self._views[buffer]
        with torch.no_grad():
            for t, key in self._targets:
                t.data = views[key]
        self._bound = buffer

    @property
    def name(self) -> str:
        return self._name

    @property
    def version(self) -> int:
        """The version the model holds now."""
        return self._native.held[0]

    @property
    def checksum(self) -> int | None:
        """The state checksum the applier published for the held version (``None`` when it does not verify)."""
        return self._native.held[2]

    def refresh(self) -> int | None:
        """Between steps: swap the model to the newest published version if it is not the held one (never
        blocks); returns the new version, or ``None`` when nothing newer was published."""
        held = self._native.refresh()
        if held is None:
            return None
        self._bind(held[3])
        return held[0]

    def wait_newer(self, than: int, *, timeout: float = 60.0) -> int:
        """Block (up to ``timeout`` seconds, other Python threads run) until a version newer than ``than`` is
        published, swap the model to it and return it; :class:`rlsync.Timeout` when none came in time."""
        try:
            held = self._native.wait_newer(int(than), float(timeout))
        except BaseException:
            # The native wait flips its slot to every version published meanwhile, also when none is newer
            # than ``than`` (the same version published again, or ``than`` ahead of the held one). The model
            # must view the buffer the slot names: the applier writes the other one.
            buffer = self._native.held[3] if not self._native.closed else self._bound
            if buffer != self._bound:
                self._bind(buffer)
            raise
        self._bind(held[3])
        return held[0]

    def close(self) -> None:
        """Give the model a private copy of the held version, then free the slot and unmap the arena."""
        if self._native.closed:
            return
        import torch

        with torch.no_grad():
            for t, _ in self._targets:
                t.data = t.data.clone()
        self._views = ({}, {})
        self._native.close()

    @property
    def closed(self) -> bool:
        return self._native.closed

    def __enter__(self) -> "HostSharedReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"version {self.version}"
        return f"HostSharedReader({self._name!r}, {state})"
