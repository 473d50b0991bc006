"""FSDP shards (issue 23 item 7): two actor processes hold an FSDP2 model (``fully_shard`` over gloo on the CPU,
``Shard(0)``, uneven shards) and pass ``get_model_state_dict`` (DTensors) to the syncer as RLinf's actor does; both
ranks call ``init_sender`` and every ``sync``, only rank 0 sends, and a rollout process checks after each of 20
steps that what it applied is bitwise equal to the full tensors. Every wait is bounded: a hang fails the test."""

from __future__ import annotations

import asyncio
import datetime
import os
import queue
import time
import traceback
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

import rlsync
from python_runs import free_port

STEPS = 20
WAIT_S = 60.0  # any single wait of a child (a queue get, gloo's collectives)
TEST_S = 240.0  # the whole run


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 5)  # 5 rows over 2 ranks: uneven shards (3 + 2)
        self.b = torch.nn.Linear(5, 3)
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))


def build(seed: int) -> Net:
    torch.manual_seed(seed)
    return Net()


@torch.no_grad()
def train_step(model: torch.nn.Module, step: int) -> None:
    """A deterministic, elementwise update (bitwise the same on shards and on full tensors); it changes a
    different subset of the parameters at each step, so patches are partial and some are empty of a tensor."""
    for i, (_, p) in enumerate(model.named_parameters()):
        if (step + i) % 3 == 0:
            p.mul_(1.25).add_(0.5)
    model.steps += 1


def make(kind: str) -> rlsync.WeightSyncer:
    if kind == "patch":
        return rlsync.PatchWeightSyncer(init_sync_enabled=True)
    return rlsync.BucketWeightSyncer(bucket_size=64, bucket_dtype=None, bucket_device="cpu")


def _put(q: Any, item: Any) -> Any:
    async def put() -> None:
        q.put(item)

    return put()


def _recv(q: Any) -> Any:
    async def recv() -> Any:
        return await asyncio.to_thread(q.get, True, WAIT_S)  # queue.Empty after WAIT_S: the op fails, no hang

    return recv


def actor(rank: int, port: int, kind: str, to_rollout: Any, from_rollout: Any, results: Any) -> None:
    try:
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import DTensor, Shard

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=WAIT_S))
        model = build(seed=0)
        fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
        options = StateDictOptions(full_state_dict=False)
        sd = get_model_state_dict(model, options=options)
        assert isinstance(sd["a.weight"], DTensor) and sd["a.weight"].placements == (Shard(0),)
        assert sd["a.weight"].to_local().shape[0] == (3 if rank == 0 else 2), "uneven shards"

        syncer = make(kind)

        async def main() -> None:
            send = (lambda p: _put(to_rollout, p)) if rank == 0 else (lambda p: _put(to_rollout, ("stray", rank)))
            await syncer.init_sender(
                get_model_state_dict(model, options=options),
                rlsync.param_names_need_sync(model),
                send,
                _recv(from_rollout),
                is_sender=rank == 0,
            )
            for step in range(1, STEPS + 1):
                train_step(model, step)
                await syncer.sync(get_model_state_dict(model, options=options), send, step)

        asyncio.run(main())
        try:  # receivers and checksum take plain tensors: a DTensor there is a clear error, not a hang
            syncer.checksum(get_model_state_dict(model, options=options))
        except ValueError as e:
            assert "'a.weight' is a DTensor" in str(e), e
        else:
            raise AssertionError("checksum of DTensors was accepted")
        dist.barrier()
        dist.destroy_process_group()
        results.put((f"actor{rank}", "ok"))
    except BaseException:
        results.put((f"actor{rank}", traceback.format_exc()))
        raise


def rollout(kind: str, to_rollout: Any, to_actors: list[Any], results: Any) -> None:
    try:
        model = build(seed=99)  # starts from other weights: only what arrives makes it equal
        expected = build(seed=0)
        syncer = make(kind)

        async def send_to_every_actor(payload: Any) -> None:
            for q in to_actors:  # RLinf's rollout rank 0 sends its metadata to every actor rank in turn
                q.put(payload)

        async def main() -> None:
            await syncer.init_receiver(model.state_dict(), _recv(to_rollout), send_to_every_actor)
            for step in range(1, STEPS + 1):
                version = await syncer.apply(model, _recv(to_rollout))
                assert version == step, (version, step)
                train_step(expected, step)
                got, want = model.state_dict(), expected.state_dict()
                for key in want:
                    assert got[key].dtype == want[key].dtype, key
                    assert torch.equal(got[key], want[key]), f"step {step}: {key} differs from the full tensor"
            assert to_rollout.empty(), "the inactive rank sent nothing"

        asyncio.run(main())
        for q in to_actors:
            q.cancel_join_thread()  # metadata an inactive rank left unread must not block this exit
        results.put(("rollout", "ok"))
    except BaseException:
        results.put(("rollout", traceback.format_exc()))
        raise


@pytest.mark.parametrize("kind", ["patch", "bucket"])
def test_fsdp2_shards_sync_from_two_actor_ranks(kind: str) -> None:
    ctx = mp.get_context("spawn")
    to_rollout, results = ctx.Queue(), ctx.Queue()
    to_actors = [ctx.Queue(), ctx.Queue()]
    port = free_port()
    procs = [
        ctx.Process(target=actor, args=(r, port, kind, to_rollout, to_actors[r], results), daemon=True)
        for r in (0, 1)
    ]
    procs.append(ctx.Process(target=rollout, args=(kind, to_rollout, to_actors, results), daemon=True))
    for p in procs:
        p.start()
    outcome: dict[str, str] = {}
    try:
        end = time.monotonic() + TEST_S
        while len(outcome) < 3:
            left = end - time.monotonic()
            if left <= 0:
                break
            try:
                who, what = results.get(timeout=min(left, 5.0))
                outcome[who] = what
            except queue.Empty:
                if all(not p.is_alive() for p in procs):
                    try:
                        while True:
                            who, what = results.get(timeout=1.0)
                            outcome[who] = what
                    except queue.Empty:
                        break
        for p in procs:
            p.join(timeout=max(1.0, end - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
    failures = {who: what for who, what in outcome.items() if what != "ok"}
    assert not failures, "\n".join(f"--- {who}:\n{what}" for who, what in failures.items())
    assert set(outcome) == {"actor0", "actor1", "rollout"}, f"timed out or died without a word: {outcome}"
    assert [p.exitcode for p in procs] == [0, 0, 0]
