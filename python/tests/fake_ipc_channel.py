"""A stand-in for rlsync's GPU channel in the CPU test of gpu_check's ``ipc`` stage: the same calls and the same
lifecycle (bind, admit at bootstrap, ack per sync with the receiver's phase times, the receivers see the close),
the tensors' bytes pickled over a Unix socket; the report has the real one's keys. ``FAKE_IPC_SKIP=<version>``
makes the receivers ack that version without installing it."""

from __future__ import annotations

import os
import time
from multiprocessing.connection import Client, Listener
from typing import Any

import torch


class TransportError(Exception):
    pass


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16).reshape(-1)


class _Sender:
    def __init__(self, path: str, state: dict, receivers: int, timeout: float = 60.0, elastic: bool = False,
                 dtype: torch.dtype | None = None) -> None:
        self._listener = Listener(path, family="AF_UNIX")
        self._state, self._n, self._conns, self._seq = state, receivers, {}, 0
        self._elastic, self._version, self._dtype = elastic, 0, dtype

    def _send(self, version: int, full: bool, ranks: list[int] | None = None) -> dict[str, Any]:
        # The receivers hold floating tensors in ``dtype`` (2-byte dtypes here, as the stage's).
        held = {k: t if self._dtype is None or not t.is_floating_point() else t.to(self._dtype)
                for k, t in self._state.items()}
        payload = {k: _bits(t).numpy().tobytes() for k, t in held.items()}
        self._seq += 1
        self._version = version
        sent = time.monotonic_ns()
        ranks = sorted(self._conns) if ranks is None else ranks
        per, dropped = [], []
        for rank in ranks:
            try:
                self._conns[rank].send(("sync", version, sent, payload))
            except OSError:
                dropped.append(rank)
        for rank in ranks:
            if rank in dropped:
                continue
            try:
                ack = self._conns[rank].recv()
            except (EOFError, OSError):
                dropped.append(rank)
                continue
            read = time.monotonic_ns()
            if ack[:2] != ("ack", version):
                raise TransportError(f"ack {ack}")
            phases, ack_sent = ack[2], ack[3]
            per.append({"rank": rank, "total_s": (ack_sent - sent) * 1e-9, **phases,
                        "reply_s": (read - ack_sent) * 1e-9})
        if dropped and not self._elastic:
            raise TransportError(f"receiver(s) {dropped} closed the channel")
        for rank in dropped:
            self._conns.pop(rank).close()
        return {"seq": self._seq, "version": version, "full": full, "build_s": 0.0, "acks_s": 0.0,
                "receivers": len(ranks), "fallbacks": 0, "widths": [(2, 1, False)], "checksums": [self._seq],
                "per_receiver": per, "settled": [], "dropped": sorted(dropped)}

    def _accept(self) -> int:
        c = self._listener.accept()
        _, rank = c.recv()  # hello
        self._conns[rank] = c
        return rank

    def bootstrap(self, version: int = 0) -> dict[str, Any]:
        while len(self._conns) < self._n:
            self._accept()
        return self._send(version, True)

    def sync(self, version: int) -> dict[str, Any]:
        return self._send(version, False)

    def rejoin(self, rank: int) -> dict[str, Any]:
        old = self._conns.pop(rank, None)
        if old is not None:
            old.close()
        while self._accept() != rank:
            pass
        return self._send(self._version, True, [rank])

    def close(self) -> None:
        for c in self._conns.values():
            c.close()
        self._listener.close()


class _Receiver:
    def __init__(self, path: str, rank: int, state: dict, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.01)
        self._conn = Client(path, family="AF_UNIX")
        self._conn.send(("hello", rank))
        self._state = state
        self._skip = int(os.environ.get("FAKE_IPC_SKIP", "-1"))

    def apply(self, timeout: float = 60.0) -> int:
        try:
            _, version, sent, payload = self._conn.recv()
        except (EOFError, OSError) as e:
            raise TransportError(f"the sender closed the channel ({type(e).__name__})") from None
        t0 = time.monotonic_ns()
        if version != self._skip:
            for k, b in payload.items():
                _bits(self._state[k]).copy_(torch.frombuffer(bytearray(b), dtype=torch.int16))
        t1 = time.monotonic_ns()
        phases = {"wake_s": (t0 - sent) * 1e-9, "drain_s": 0.0, "check_s": 0.0, "apply_s": (t1 - t0) * 1e-9}
        self._conn.send(("ack", version, phases, time.monotonic_ns()))
        return version

    def close(self) -> None:
        self._conn.close()


cuda_ipc_sender = _Sender
cuda_ipc_receiver = _Receiver
