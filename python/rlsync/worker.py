"""Run your PyTorch trainer and your Python simulator as rlsync's workers.

rlsync starts ``PYTHON -m rlsync.worker --role trainer|rollout --rank N --run-dir DIR`` for a role whose
config selects ``worker@actor.worker=python`` / ``worker@rollout.worker=python``. This module imports the
role's ``entry`` (``package.module:Attr``; with no ``:Attr``, the module's ``Trainer`` or ``Rollout``) and
hands it to rlsync's Rust worker, which does everything else exactly as for a built-in worker: the handshake,
the weight channel (the trainer sends, every rollout receives and installs in place), checksum verification,
the command loop, metrics and failure reports.

Your classes::

    class Trainer:
        def __init__(self, cfg: dict): ...                      # the resolved job config, as plain data
        def model(self) -> torch.nn.Module: ...                 # the weights rlsync sends to the rollouts
        def train(self, batches: list[dict[str, np.ndarray]]) -> dict[str, float]: ...
            # one update on the chunks of trajectories (one dict per chunk, as your rollouts returned them);
            # must return "loss"; every other key is logged as actor/<key> (keys with a "/" as they are)
        # optional: state_dict() -> dict and load_state_dict(sd): what resuming needs besides model()'s
        #   tensors (optimizer, critic, LR schedules, running statistics); saved with every checkpoint in
        #   optimizer.safetensors and handed back on runner.resume_dir (see rlsync.checkpoint)

    class Rollout:
        def __init__(self, cfg: dict, rank: int, num_rollouts: int): ...
        def model(self) -> torch.nn.Module: ...                 # rlsync installs the trainer's weights into it
        def rollout(self, steps: int) -> tuple[dict[str, np.ndarray], dict[str, float]]: ...
            # act `steps` steps in each of your envs; the arrays (any names, numeric or bool dtypes) go to the
            # trainer; stats["return"] (mean return of episodes finished in the chunk) is logged as
            # rollout/return (without one, the chunk's reward per env from an array named "rewards")
        # optional: env_steps(arrays) -> int, when your arrays are not time-major [steps, envs, ...]
        # optional: evaluate() -> dict, deterministic episodes with the weights held now (runs every
        #   runner.val_check_interval steps): "return" and optionally "episodes", "success_rate", "episode_len",
        #   logged as eval/<key> pooled over the rollouts (without the method: no episodes)

Which tensors are synced: :func:`rlsync.param_names_need_sync` of ``model()`` (trainable parameters, tied
aliases included, and persistent buffers); the rest of the state dict is aligned once at start-up. The model's
tensors must stay contiguous and in place (optimizers update in place; do not rebind parameters).
With ``weight_syncer.host_shared=true`` the rollouts of a host share one copy of the weights: a rollout's
``model()`` tensors become views of the shared buffer it holds (``param.data`` swapped between chunks, the
Parameter objects kept); a rollout must not write them.

Device: ``actor.worker.device`` / ``rollout.worker.device`` (``cpu`` by default, ``cuda`` or ``cuda:N``) is
where the role's model lives. Before your class is built the worker checks that torch sees that GPU (a clear
error otherwise; ``cuda:N`` becomes torch's current device), and after it is built it moves ``model()`` there
(parameters keep their identity, so an optimizer made before still updates them; ``cpu`` moves nothing, it
leaves ``model()`` where your code put it). Everything else is yours:
read the same key from ``cfg`` (or call :func:`worker_device`) and put your other modules and your inputs on
it; arrays a rollout returns may be CUDA tensors (they are copied to the host to travel).
"""

from __future__ import annotations

import importlib
import json
import math
import sys
from typing import Any

import numpy as np

from . import _native
from .checkpoint import TRAINER_STATE_FILE, _tensor, flatten_state, unflatten_state
from .host_shared import _view
from .syncer import _describe, param_names_need_sync

__all__ = ["main", "load_entry", "worker_device"]


def load_entry(entry: str, role: str) -> Any:
    """Import ``package.module:Attr`` (or ``package.module``, taking ``Trainer`` / ``Rollout`` by role)."""
    module_name, _, attr = entry.partition(":")
    attr = attr or ("Trainer" if role == "trainer" else "Rollout")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ImportError(
            f"cannot import the {role} worker entry '{entry}': {e} (sys.path: {sys.path})"
        ) from e
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ImportError(
                f"the {role} worker entry '{entry}': module '{module_name}' has no attribute '{attr}'"
            ) from None
    return obj


def worker_device(cfg: dict, role: str) -> Any:
    """The ``torch.device`` of ``role``'s model (``"trainer"`` reads ``actor.worker.device``, ``"rollout"``
    ``rollout.worker.device``; ``cpu`` when unset), checked: ``cuda`` needs a GPU that torch sees, ``cuda:N``
    one of its GPUs (then made torch's current device). Raises ``ValueError`` / ``RuntimeError`` naming the key
    and what is missing."""
    import torch

    section = "actor" if role == "trainer" else "rollout"
    key = f"{section}.worker.device"
    name = str(((cfg.get(section) or {}).get("worker") or {}).get("device") or "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"{key}={name!r} is not a device: expected cpu, cuda or cuda:N")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            raise RuntimeError(
                f"{key}={name}: CUDA is not available to this worker (torch {torch.__version__}, {build}, "
                f"reports torch.cuda.is_available() = False: no NVIDIA GPU or driver here); set {key}=cpu"
            )
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise RuntimeError(f"{key}={name}: torch sees {count} CUDA device(s) here (cuda:0 .. cuda:{count - 1})")
        if device.index is not None:
            torch.cuda.set_device(device)
        else:
            device = torch.device("cuda", torch.cuda.current_device())
    return device


def _host(value: Any) -> Any:
    """An array a rollout returned, on the host: torch tensors (CUDA ones too) as numpy arrays."""
    if hasattr(value, "detach") and hasattr(value, "cpu"):
        return value.detach().cpu().numpy()
    return value.numpy() if hasattr(value, "numpy") else value


def _arrays_out(arrays: dict) -> list[tuple[str, str, tuple[int, ...], bytes]]:
    if not isinstance(arrays, dict):
        raise TypeError(f"rollout() must return (dict of arrays, dict of stats), got {type(arrays).__name__}")
    out = []
    for name, value in arrays.items():
        a = np.ascontiguousarray(_host(value))
        if a.dtype.byteorder == ">" or (a.dtype.byteorder == "=" and sys.byteorder == "big"):
            a = a.astype(a.dtype.newbyteorder("<"))
        dtype = a.dtype.str.replace("=", "<")
        out.append((str(name), dtype, tuple(int(d) for d in a.shape), a.tobytes()))
    return out


def _arrays_in(items: list) -> dict[str, np.ndarray]:
    return {name: np.frombuffer(data, dtype=np.dtype(dtype)).reshape(shape) for name, dtype, shape, data in items}


class _Adapter:
    """What the native worker calls: uniform methods over the user's object."""

    def __init__(self, user: Any, role: str, device: Any = None) -> None:
        self.user = user
        self.role = role
        # Host-shared mode: tensor views of each shared buffer, by buffer (see bind_shared).
        self._shared_views: dict[int, dict[str, Any]] = {}
        # Where model()'s tensors were when rlsync described them: (data_ptr, device) by name.
        self._memory: dict[str, tuple[int, str]] = {}
        # The GPUs model() lives on (from describe), waited for after the user's code (_settle).
        self._gpus: list[str] = []
        for method in ("model", "train") if role == "trainer" else ("model", "rollout"):
            if not callable(getattr(user, method, None)):
                raise TypeError(f"the {role} worker object {type(user).__name__} has no method {method}()")
        if device is not None and device.type != "cpu":
            self._place(device)

    def _place(self, device: Any) -> None:
        """Move ``model()`` to ``device`` unless all of it is there (``Module.to`` keeps the parameters' identity:
        it swaps their data)."""
        model = self.user.model()
        tensors = list(model.parameters()) + list(model.buffers())
        if any(t.device != device for t in tensors):
            model.to(device)

    def bind_shared(self, key: int, items: list) -> None:
        """Host-shared mode (``weight_syncer.host_shared``): make ``model()``'s tensors views of the host's
        shared buffer this rollout holds now — ``items`` are ``(name, address, nbytes, dtype, shape)`` of that
        buffer's tensors, ``key`` names the buffer. The views of each buffer are built once; a flip swaps every
        tensor's ``.data``, so the Parameter objects (and whatever holds them) keep their identity. The buffer
        is never written by a rollout (it may be mapped read-only)."""
        import torch

        views = self._shared_views.get(key)
        if views is None:
            # The native worker's reader maps the arena for the whole life of this process.
            views = {name: _view(addr, nbytes, dtype, tuple(shape), None) for name, addr, nbytes, dtype, shape in items}
            self._shared_views[key] = views
        tensors = self.user.model().state_dict(keep_vars=True)
        with torch.no_grad():
            for name, view in views.items():
                tensor = tensors.get(name)
                if tensor is not None:
                    tensor.data = view

    def describe(self) -> tuple[list[tuple], list[str]]:
        model = self.user.model()
        descs = _describe(model)
        self._memory = {name: (ptr, str(tensor.device)) for name, tensor, ptr, *_ in descs}
        self._gpus = sorted({device for _, device in self._memory.values() if device.startswith("cuda")})
        return descs, param_names_need_sync(model)

    def _returned(self, method: str) -> None:
        """After the user's ``method()``: its GPU work has finished (:meth:`_settle`) and ``model()``'s tensors are
        still where rlsync holds them (:meth:`_check_in_place`)."""
        self._settle()
        self._check_in_place(method)

    def _settle(self) -> None:
        """Wait for every GPU the model lives on. rlsync's copies, builds and installs run on the legacy default
        stream, which waits for torch's default stream but not for streams the user's code made
        (``torch.cuda.Stream()`` is non-blocking): an optimizer step or a forward pass queued there could still be
        writing or reading the weights when rlsync reads or installs them."""
        if self._gpus:
            import torch

            for device in self._gpus:
                torch.cuda.synchronize(device)

    def _check_in_place(self, method: str) -> None:
        """After the user's ``method()``: ``model()``'s tensors still live where rlsync reads and installs them
        (it holds their memory since ``describe``). A tensor given new memory (``p.data = ...``, ``model.to(...)``,
        ``load_state_dict(assign=True)``) would leave rlsync writing memory the model no longer uses (or that
        another tensor got since): a clear error instead. Host-shared rollouts' views are rlsync's own rebinding."""
        memory = self._memory
        if not memory or self._shared_views:
            return
        now = {name: t for name, t in self.user.model().state_dict(keep_vars=True).items() if name in memory}
        for name, (ptr, device) in memory.items():
            t = now.get(name)
            if t is None:
                raise RuntimeError(
                    f"{method}() removed model tensor {name!r} from model(): rlsync syncs the tensors model() had "
                    "when the worker started, in place"
                )
            if t.data_ptr() != ptr or str(t.device) != device:
                raise RuntimeError(
                    f"{method}() gave model tensor {name!r} new memory ({device} {ptr:#x} -> {t.device} "
                    f"{t.data_ptr():#x}): rlsync reads and installs the model's tensors in place, so update them in "
                    "place (optimizer.step(), tensor.copy_(), load_state_dict()) instead of assigning new tensors "
                    "(param.data = ..., model.to(...), load_state_dict(assign=True))"
                )

    def train(self, chunks: list) -> tuple[float, list[tuple[str, float]]]:
        stats = self.user.train([_arrays_in(c) for c in chunks])
        self._returned("train")
        if not isinstance(stats, dict) or "loss" not in stats:
            raise TypeError("train() must return a dict of floats with a 'loss' key")
        loss = float(stats["loss"])
        if not math.isfinite(loss):
            raise FloatingPointError(f"train() returned loss={loss}: the update diverged")
        metrics = [(k if "/" in k else f"actor/{k}", float(v)) for k, v in stats.items() if k != "loss"]
        return loss, metrics

    def rollout(self, steps: int, version: int) -> tuple[list, int, float]:
        out = self.user.rollout(steps)
        self._returned("rollout")
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError("rollout() must return (dict of arrays, dict of stats)")
        arrays, stats = out
        items = _arrays_out(arrays)
        counter = getattr(self.user, "env_steps", None)
        if callable(counter):
            env_steps = int(counter(arrays))
        else:
            shape = items[0][2] if items else ()
            env_steps = int(shape[0] * shape[1]) if len(shape) >= 2 else int(shape[0]) if shape else 0
        mean_return = stats.get("return") if isinstance(stats, dict) else None
        if mean_return is None or not math.isfinite(float(mean_return)):
            # No episode finished in this chunk: the reward collected per env, as rlsync's own rollouts log.
            rewards = arrays.get("rewards")
            rewards = np.asarray(_host(rewards)) if rewards is not None else None
            envs = rewards.shape[1] if rewards is not None and rewards.ndim >= 2 else 1
            mean_return = float(rewards.sum()) / envs if rewards is not None else 0.0
        return items, env_steps, float(mean_return)

    def trainer_state(self) -> tuple[list[tuple], str] | None:
        """The trainer's optional ``state_dict()`` (optimizer, critic, schedules, ...) flattened for
        ``optimizer.safetensors``: (tensor descriptions, JSON tree); ``None`` without the method."""
        hook = getattr(self.user, "state_dict", None)
        if not callable(hook):
            return None
        tensors, structure = flatten_state(hook())
        # The file is written from host memory: CUDA state (optimizer moments of a model on the GPU) is
        # copied to the CPU first (the descriptions hold the copies while the file is written).
        tensors = {k: (v.detach().cpu() if getattr(v, "is_cuda", False) else v) for k, v in tensors.items()}
        return _describe(tensors), structure

    def load_trainer_state(self, items: list | None, structure: str | None) -> None:
        """On ``runner.resume_dir``, after the weights: hand the saved trainer state to the trainer's
        ``load_state_dict()``. A mismatch between the two (a state saved but no method, or the reverse) is
        reported in the worker's log, not an error: the weights alone still resume."""
        hook = getattr(self.user, "load_state_dict", None)
        name = type(self.user).__name__
        if structure is None:
            if callable(hook):
                print(f"rlsync: the checkpoint has no trainer state ({TRAINER_STATE_FILE}): "
                      f"{name}.load_state_dict() is not called; the optimizer starts afresh", file=sys.stderr, flush=True)
            return
        if not callable(hook):
            print(f"rlsync: the checkpoint's trainer state ({TRAINER_STATE_FILE}) is ignored: "
                  f"{name} has no load_state_dict()", file=sys.stderr, flush=True)
            return
        state = unflatten_state({n: _tensor(d, shape, data) for n, d, shape, data in items or []}, structure)
        hook(state)

    def evaluate(self) -> tuple[int, float, float, float] | None:
        """The user's ``evaluate()`` (optional): deterministic episodes with the weights the rollout holds now,
        as a dict with ``return`` and optionally ``episodes`` (default 1), ``success_rate``, ``episode_len``
        (default 0). Without the method, an evaluation reports no episodes."""
        hook = getattr(self.user, "evaluate", None)
        if not callable(hook):
            return None
        stats = hook()
        self._returned("evaluate")
        if not isinstance(stats, dict) or "return" not in stats:
            raise TypeError("evaluate() must return a dict of floats with a 'return' key")
        values = (float(stats["return"]), float(stats.get("success_rate", 0.0)), float(stats.get("episode_len", 0.0)))
        if not all(math.isfinite(v) for v in values):
            raise FloatingPointError(f"evaluate() returned non-finite values: {stats}")
        return (int(stats.get("episodes", 1)), *values)


def _factory(job_json: str, placement: dict) -> _Adapter:
    cfg = json.loads(job_json) or {}
    role = placement["role"]
    section = cfg.get("actor" if role == "trainer" else "rollout", {})
    entry = (section.get("worker") or {}).get("entry")
    if not entry:
        raise ValueError(f"no {'actor' if role == 'trainer' else 'rollout'}.worker.entry in the job config")
    # The device first: a GPU that is not there is named before the user's class runs.
    device = worker_device(cfg, role)
    cls = load_entry(entry, role)
    if role == "trainer":
        user = cls(cfg)
    else:
        user = cls(cfg, placement["rank"], placement["rollouts"])
    return _Adapter(user, role, device)


def main(argv: list[str] | None = None) -> int:
    """``python -m rlsync.worker --role R --rank N --run-dir D`` (started by rlsync's supervisor)."""
    args = sys.argv[1:] if argv is None else argv
    try:
        _native.run_worker(args, _factory)
    except _native.RlsyncError as e:
        print(f"rlsync worker failed: {e}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
