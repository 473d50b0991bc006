"""Blocking calls into rlsync's async syncer API, for the adapters whose host frameworks are synchronous.

TorchRL's schemes, NeMo-RL's synchronizers and RL-Kernel's bridges call plain methods; rlsync's syncers are
async (RLinf's interface). :class:`Runner` owns one private event loop and runs a coroutine to completion on it
from the thread that owns the runner. It refuses to run inside a thread that already runs an event loop (that
would deadlock it) and says so.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class Runner:
    """One private event loop, created on first use, closed by :meth:`close` (idempotent)."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._owner: int | None = None

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            coro.close()
            raise RuntimeError(
                "this rlsync adapter call blocks; it was made from a running event loop (call it from a "
                "thread without one, e.g. through asyncio.to_thread)"
            )
        if self._loop is None or self._loop.is_closed():
            self._loop = asyncio.new_event_loop()
            self._owner = threading.get_ident()
        elif self._owner != threading.get_ident():
            # An event loop runs in one thread at a time; each thread of an adapter gets its own runner.
            coro.close()
            raise RuntimeError("an rlsync Runner is used from one thread only (create one per thread)")
        return self._loop.run_until_complete(coro)

    def close(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.close()
        self._loop = None
        self._owner = None
