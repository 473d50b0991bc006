"""Start a multi-node rlsync run on a Ray cluster: one ``rlsync`` process per Ray node, as srun or torchrun would.

Ray is the scheduler here, not a cluster manager of rlsync's: this launcher reserves one bundle per node with a
``STRICT_SPREAD`` placement group, starts one small actor in each bundle, and each actor runs the same ``rlsync``
command line with its node's rank (``cluster.node_rank``), node 0's address (``cluster.master_addr``) and a
rendezvous port (``cluster.master_port``); ``RLSYNC_RUN_TOKEN`` is passed to every node (generated unless set).
From there the run is rlsync's own: node 0 orchestrates, the others are node agents, weights cross nodes along
rlsync's TCP chain. Each node's output reaches the driver through Ray's log forwarding, prefixed by its actor.

::

    python -m rlsync.ray_launch --nodes 4 -- train_embodied cluster.slots_per_node=8 \\
        cluster.component_placement.rollout=1-31

Exit status: 0 when every node exited 0; else node 0's status if it failed, else the first failing node's.
Ctrl-C or SIGTERM stops every node (SIGTERM to each ``rlsync``, which stops its workers); an ``rlsync`` whose
actor dies is sent SIGTERM by the kernel (parent-death signal), so nothing outlives the launch.

Needs ``ray`` (``pip install ray``; not a dependency of this package). ``--address`` (or ``RAY_ADDRESS``) names
the cluster; by default the local one (``ray start --head`` on this host).
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import Any

# Keys the launcher sets per node: the user's command line must leave them to it.
_LAUNCHER_KEYS = ("cluster.node_rank", "cluster.master_addr", "cluster.master_port")
_PR_SET_PDEATHSIG = 1
# A node's status when its actor died (its node's process was killed with it): as for SIGKILL.
_ACTOR_DIED = 128 + signal.SIGKILL
# Lines of a failed node's output the launcher prints itself.
_TAIL_LINES = 20


class LaunchError(Exception):
    """The launch cannot go ahead (bad arguments, no such cluster, not enough nodes)."""


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the actor process that started it dies (even by SIGKILL)."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class NodeProcess:
    """The Ray actor on one node: starts that node's ``rlsync`` and reports on it. Its methods return at once
    (the process is polled), so ``stop`` is served while the run goes on, and the child is started from the
    actor's main thread, whose death its parent-death signal follows."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.proc: subprocess.Popen[bytes] | None = None
        self.reader: threading.Thread | None = None
        self.last_lines: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)

    def __repr__(self) -> str:  # Ray prefixes the node's forwarded output with it
        return f"rlsync node {self.rank}"

    def address(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def free_port(self) -> int:
        """A TCP port free on this node now, for node 0's rendezvous listener."""
        with socket.socket() as s:
            s.bind((self.address(), 0))
            return int(s.getsockname()[1])

    def start(self, argv: list[str], env: dict[str, str]) -> int:
        full = dict(os.environ)
        full.update(env)
        self.proc = subprocess.Popen(
            argv, env=full, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent
        )
        self.reader = threading.Thread(target=self._forward, args=(self.proc.stdout,), daemon=True)
        self.reader.start()
        return self.proc.pid

    def _forward(self, out: Any) -> None:
        """The node's output to this actor's stdout (Ray forwards it to the driver, asynchronously) and into
        the tail that the launcher prints itself when the node fails (so a fast failure is never lost)."""
        for line in out:
            sys.stdout.buffer.write(line)
            sys.stdout.flush()
            self.last_lines.append(line.decode(errors="replace").rstrip("\n"))

    def poll(self, wait_s: float) -> int | None:
        """The exit status once the process ended (a signal as 128 + its number), else None after ``wait_s``."""
        assert self.proc is not None, "start() first"
        try:
            rc = self.proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            return None
        if self.reader is not None:
            self.reader.join(timeout=2.0)  # the rest of its output (workers may hold the pipe a moment longer)
        return 128 - rc if rc < 0 else rc

    def tail(self) -> list[str]:
        """The node's last lines of output."""
        return list(self.last_lines)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)


def _num_nodes(nodes: int | None, overrides: Sequence[str]) -> tuple[int, list[str]]:
    """The node count (``--nodes`` or ``cluster.num_nodes=`` on the command line; they must agree) and the
    command line with ``cluster.num_nodes`` on it."""
    given = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") == "cluster.num_nodes"]
    for o in overrides:
        key = o.split("=", 1)[0].lstrip("+~")
        if key in _LAUNCHER_KEYS:
            raise LaunchError(f"{o}: the launcher sets {key} for each node; leave it out")
    from_cli = None
    if given:
        value = given[-1].split("=", 1)[1] if "=" in given[-1] else ""
        if not value.isdigit() or int(value) < 1:
            raise LaunchError(f"{given[-1]}: cluster.num_nodes must be a positive integer")
        from_cli = int(value)
    if nodes is None and from_cli is None:
        raise LaunchError("say how many nodes: --nodes N (or cluster.num_nodes=N on the rlsync command line)")
    if nodes is not None and from_cli is not None and nodes != from_cli:
        raise LaunchError(f"--nodes {nodes} but cluster.num_nodes={from_cli} on the command line")
    n = nodes if nodes is not None else from_cli
    assert n is not None
    if n < 1:
        raise LaunchError(f"--nodes {n}: at least one node")
    return n, list(overrides) if given else [*overrides, f"cluster.num_nodes={n}"]


def _rlsync_binary(given: str | None) -> str:
    path = given or os.environ.get("RLSYNC_BIN")
    if path is None:
        from shutil import which

        path = which("rlsync")
    if path is None:
        raise LaunchError("no rlsync binary: pass --rlsync PATH (the same path on every node) or put rlsync on PATH")
    return os.path.abspath(path)


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m rlsync.ray_launch",
        description="Run one rlsync process per Ray node (node 0 orchestrates, the others are node agents).",
        epilog="Everything after -- is rlsync's command line, e.g. -- train_embodied cluster.slots_per_node=8",
    )
    p.add_argument("--address", default=None, help="Ray cluster address (default: RAY_ADDRESS, else the local one)")
    p.add_argument("--nodes", type=int, default=None, help="nodes of the run (default: cluster.num_nodes=...)")
    p.add_argument("--cpus-per-node", type=float, default=1.0, help="CPUs reserved per node's bundle (default 1)")
    p.add_argument("--rlsync", default=None, help="rlsync binary, same path on every node (default: RLSYNC_BIN, PATH)")
    p.add_argument("--master-port", type=int, default=None, help="rendezvous port on node 0 (default: a free one)")
    p.add_argument(
        "--reserve-timeout-s", type=float, default=60.0, help="how long to wait for the nodes (default 60 s)"
    )
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- rlsync's command line")
    args = p.parse_args(argv)
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    if not args.command:
        p.error("no rlsync command line: add -- train_embodied ... (or train_async ...)")
    return args


def launch(argv: Sequence[str]) -> int:
    """Run the launch described by ``argv`` (this module's command line); the exit status."""
    args = _parse(argv)
    nodes, command = _num_nodes(args.nodes, args.command)
    binary = _rlsync_binary(args.rlsync)
    try:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    except ImportError as e:
        raise LaunchError(f"rlsync.ray_launch needs Ray: pip install ray ({e})") from e

    token = os.environ.get("RLSYNC_RUN_TOKEN") or secrets.token_hex(32)
    ray.init(address=args.address or os.environ.get("RAY_ADDRESS") or "auto", log_to_driver=True)
    pg = placement_group([{"CPU": args.cpus_per_node}] * nodes, strategy="STRICT_SPREAD")
    actors: list[Any] = []
    stopping: list[str] = []

    def on_signal(signum: int, _frame: Any) -> None:
        stopping.append(signal.Signals(signum).name)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        ready, _ = ray.wait([pg.ready()], timeout=args.reserve_timeout_s)
        if not ready:
            alive = [n for n in ray.nodes() if n.get("Alive")]
            free = ", ".join(
                f"{n.get('NodeManagerAddress')} ({n.get('Resources', {}).get('CPU', 0):g} CPU)" for n in alive
            )
            raise LaunchError(
                f"the Ray cluster did not give {nodes} bundles of {args.cpus_per_node:g} CPU on {nodes} different "
                f"nodes within {args.reserve_timeout_s:g} s (it has {len(alive)} node(s): {free})"
            )
        remote = ray.remote(NodeProcess)
        actors = [
            remote.options(
                num_cpus=args.cpus_per_node,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=rank
                ),
            ).remote(rank)
            for rank in range(nodes)
        ]
        master_addr = ray.get(actors[0].address.remote())
        port = args.master_port or ray.get(actors[0].free_port.remote())
        print(
            f"rlsync.ray_launch: {nodes} node(s), node 0 at {master_addr}:{port}; "
            f"{' '.join(ray.get([a.address.remote() for a in actors]))}",
            flush=True,
        )
        for rank, actor in enumerate(actors):
            argv_n = [
                binary,
                *command,
                f"cluster.node_rank={rank}",
                f"cluster.master_addr={master_addr}",
                f"cluster.master_port={port}",
            ]
            try:
                ray.get(actor.start.remote(argv_n, {"RLSYNC_RUN_TOKEN": token}))
            except ray.exceptions.RayTaskError as e:
                raise LaunchError(f"node {rank}: cannot start {binary}: {e.cause}") from e
        status: dict[int, int] = {}
        signalled = False
        while len(status) < nodes:
            if stopping and not signalled:
                print(f"rlsync.ray_launch: {stopping[0]}: stopping every node", file=sys.stderr, flush=True)
                ray.get([a.stop.remote() for a in actors])
                signalled = True
            pending = [r for r in range(nodes) if r not in status]
            polls = {r: actors[r].poll.remote(0.5) for r in pending}
            for r, ref in polls.items():
                try:
                    rc = ray.get(ref)
                except ray.exceptions.RayActorError as e:
                    # Its rlsync got SIGTERM from the kernel (parent-death signal) and stops its workers.
                    print(f"rlsync.ray_launch: node {r}: its Ray actor died ({e})", file=sys.stderr, flush=True)
                    rc = _ACTOR_DIED
                if rc is not None:
                    status[r] = rc
        failed = {r: rc for r, rc in sorted(status.items()) if rc != 0}
        for r, rc in failed.items():
            try:
                tail = ray.get(actors[r].tail.remote())
            except ray.exceptions.RayActorError:
                tail = []
            lines = "".join(f"\n  | {line}" for line in tail)
            print(f"rlsync.ray_launch: node {r} exited with status {rc}{lines}", file=sys.stderr, flush=True)
        if failed:
            return failed.get(0, next(iter(failed.values())))
        return 0
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        for a in actors:
            ray.kill(a)
        remove_placement_group(pg)
        ray.shutdown()


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return launch(sys.argv[1:] if argv is None else argv)
    except LaunchError as e:
        print(f"rlsync.ray_launch: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
