"""Shared helpers of the rlsync Python tests: an in-memory transport (a queue per direction) and a runner."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest


class Link:
    """A loss-free in-memory transport between one sender and one receiver: ``to_rx`` carries payloads,
    ``to_tx`` carries the receiver's upstream messages (metadata). ``taps`` records every downstream payload."""

    def __init__(self) -> None:
        self.to_rx: asyncio.Queue[bytes] = asyncio.Queue()
        self.to_tx: asyncio.Queue[bytes] = asyncio.Queue()
        self.taps: list[bytes] = []

    async def send(self, payload: bytes) -> None:  # sender -> receiver
        self.taps.append(bytes(payload))
        await self.to_rx.put(payload)

    async def recv(self) -> Any:  # receiver <- sender
        return await self.to_rx.get()

    async def up_send(self, payload: bytes) -> None:  # receiver -> sender
        await self.to_tx.put(payload)

    async def up_recv(self) -> Any:  # sender <- receiver
        return await self.to_tx.get()


def run(coro: Awaitable[Any]) -> Any:
    return asyncio.run(coro)  # type: ignore[arg-type]


@pytest.fixture
def link() -> Callable[[], Link]:
    return Link


@pytest.fixture
def sock_dir():
    """A private directory with a short path for a test's Unix sockets: a socket's path holds at most 107 bytes,
    and ``tmp_path`` under pytest-xdist (``/tmp/pytest-of-<user>/pytest-<n>/popen-gw<k>/<test name>/``) leaves
    too little of them for a socket name."""
    import shutil
    import tempfile

    d = tempfile.mkdtemp(prefix="rls", dir="/tmp")
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)
