"""A rank group: several processes that run one job together, as one worker of the pool.

Every rank builds the same runtime and runs the same job in lockstep; inside the models they share the
work through a torch.distributed process group (models/parallel.py: the H3 transformer splits its rows,
the video VAE its temporal windows). Rank 0 speaks for the group: its events and its outputs are the
job's. The other ranks write their copies of the outputs into a private scratch folder and their events
are dropped.

`RankGroupTransport` is a `Transport` (execution/worker.py) over N rank transports (local worker
processes here; `RemoteWorker` drives it like any other), so the fault rules are a single worker's:

- the group is ready when every rank is;
- a rank that ends, or a job that failed because a collective failed (`RankFailure`: a rank died or
  hung past the group's timeout), is `WorkerDied`: the runner's crash rule applies (retry once, then
  interrupted) and the next job gets a fresh group;
- a job that did not succeed (an error in a node, an interrupt) leaves ranks that may still sit inside a
  collective, so the group is restarted before the next job.

This module imports no torch: a rank joins its process group while its runtime is built, from the
`RankSpec` its recipe carries (main.Runtime does that).
"""
from __future__ import annotations

import argparse
import copy
import logging
import shutil
import socket
import tempfile
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from execution.events import EventBus
from execution.worker import (DEFAULT_INTERRUPT_GRACE_S, LocalProcessTransport, RemoteWorker, RuntimeRecipe,
                              Transport, WorkerDied, WorkerPool)
from execution.worker_messages import (FromWorker, JobEvent, JobResult, RunJob, ToWorker, WorkerFailure,
                                       WorkerReady)

logger = logging.getLogger(__name__)

COLLECTIVE_FAILURE = "RankFailure"   # models.parallel.RankFailure's name, as a failure payload carries it
DEFAULT_RANK_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class RankSpec:
    """Which rank a runtime is and where its group meets (carried in the rank's runtime flags)."""

    rank: int
    size: int
    address: str          # tcp://host:port of rank 0's rendezvous
    timeout_s: float      # how long a collective waits for a missing rank


def free_local_address() -> str:
    """A rendezvous address on 127.0.0.1 with a port free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def rank_args(args: argparse.Namespace, spec: RankSpec, scratch: Path | None) -> argparse.Namespace:
    """The server's flags for one rank: its RankSpec, and for ranks other than 0 private output and temp folders."""
    changed = copy.copy(args)
    changed.rank_group = spec
    if scratch is not None:
        for flag in ("output", "temp"):
            folder = scratch / flag
            folder.mkdir(parents=True, exist_ok=True)
            setattr(changed, f"{flag}_directory", folder)
    return changed


def _failed_collectively(data: dict | None) -> bool:
    return bool(data) and data.get("exception_type") == COLLECTIVE_FAILURE


class RankGroupTransport(Transport):
    """N rank transports behind one: rank 0's messages are the group's (see the module docstring)."""

    def __init__(self, recipe: RuntimeRecipe, size: int, *, timeout_s: float = DEFAULT_RANK_TIMEOUT_S,
                 make_rank: Callable[[RuntimeRecipe], Transport] = LocalProcessTransport,
                 private_folders: bool = True) -> None:
        if size < 2:
            raise ValueError(f"a rank group needs at least 2 ranks, got {size}")
        self.recipe, self.size, self.timeout_s, self.make_rank = recipe, size, float(timeout_s), make_rank
        # Ranks other than 0 write into scratch folders of their own (a Ray actor has its own already).
        self.private_folders = private_folders
        self.ranks: list[Transport] = []
        self._scratch: Path | None = None
        self._ready: set[int] = set()
        self._root_ready: WorkerReady | None = None
        self._held: deque[FromWorker] = deque()    # rank 0's messages waiting for the other ranks
        self._result: JobResult | None = None       # rank 0's result, until every rank has finished
        self._finished: set[int] = set()
        self._result_since = 0.0

    # -- lifecycle -----------------------------------------------------------------------------
    def rendezvous(self) -> str:
        """Where the group's ranks meet (this machine's loopback: local ranks)."""
        return free_local_address()

    def rank_transport(self, rank: int, recipe: RuntimeRecipe) -> Transport:
        """The transport of one rank (a local worker process here)."""
        return self.make_rank(recipe)

    def start(self) -> None:
        """Start every rank (a fresh rendezvous address each time, so a restarted group never meets an old one)."""
        address = self.rendezvous()
        self._scratch = Path(tempfile.mkdtemp(prefix="weft-ranks-")) if self.private_folders else None
        self.ranks = []
        for rank in range(self.size):
            spec = RankSpec(rank, self.size, address, self.timeout_s)
            scratch = self._scratch / f"rank{rank}" if rank and self._scratch is not None else None
            recipe = RuntimeRecipe(self.recipe.factory, rank_args(self.recipe.args, spec, scratch))
            self.ranks.append(self.rank_transport(rank, recipe))
        for transport in self.ranks:
            transport.start()
        self._ready, self._root_ready, self._held = set(), None, deque()
        self._result, self._finished = None, set()

    def _restart(self) -> None:
        self.kill()
        self.start()

    def kill(self) -> None:
        """Kill every rank."""
        for transport in self.ranks:
            transport.kill()
        self._drop_scratch()

    def stop(self, timeout: float) -> None:
        """Ask every rank to end, then kill what is left after `timeout`."""
        for transport in self.ranks:
            transport.stop(timeout)
        self._drop_scratch()

    def _drop_scratch(self) -> None:
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None

    # -- messages ------------------------------------------------------------------------------
    def send(self, message: ToWorker) -> None:
        """Every rank gets every message (each runs the job; each must stop at an interrupt)."""
        if isinstance(message, RunJob):
            self._result, self._finished = None, set()
        for transport in self.ranks:
            transport.send(message)

    def _lost(self, rank: int, why: str) -> WorkerDied:
        return WorkerDied(f"rank {rank} of the {self.size}-rank group {why}; the group is lost with it")

    def _drain_others(self) -> FromWorker | None:
        """Read what ranks 1.. sent (without waiting); a start failure of any rank is the group's."""
        for rank, transport in enumerate(self.ranks[1:], start=1):
            while True:
                try:
                    message = transport.receive(0.0)
                except WorkerDied as exc:
                    raise self._lost(rank, f"ended ({exc})") from None
                if message is None:
                    break
                if isinstance(message, WorkerReady):
                    self._ready.add(rank)
                elif isinstance(message, WorkerFailure) and message.stage == "start":
                    return message
                elif isinstance(message, JobResult):
                    self._finished.add(rank)
                    if _failed_collectively(message.outcome.error):
                        raise self._lost(rank, f"saw a collective fail: {message.outcome.error.get('exception_message')}")
                # JobEvent, MemoryFreed, OutputFiles: rank 0 speaks for the group.
        return None

    def receive(self, timeout: float) -> FromWorker | None:
        """The group's next message (rank 0's, held back until the others agree), or None after `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            failure = self._drain_others()
            if failure is not None:
                return failure
            released = self._release()
            if released is not None:
                return released
            try:
                message = self.ranks[0].receive(min(0.02, max(0.0, deadline - time.monotonic())))
            except WorkerDied as exc:
                raise self._lost(0, f"ended ({exc})") from None
            if message is not None:
                handled = self._from_root(message)
                if handled is not None:
                    return handled
            if time.monotonic() >= deadline:
                return None

    def _from_root(self, message: FromWorker) -> FromWorker | None:
        if isinstance(message, WorkerReady):
            self._ready.add(0)
            self._root_ready = message
            return None
        if isinstance(message, JobEvent) and message.event == "execution_error" and _failed_collectively(message.data):
            raise self._lost(0, f"saw a collective fail: {message.data.get('exception_message')}")
        if isinstance(message, JobResult):
            if _failed_collectively(message.outcome.error):
                raise self._lost(0, f"saw a collective fail: {message.outcome.error.get('exception_message')}")
            self._result, self._result_since = message, time.monotonic()
            return None
        return message

    def _release(self) -> FromWorker | None:
        if self._root_ready is not None and len(self._ready) == self.size:
            ready, self._root_ready = self._root_ready, None
            pids = [getattr(getattr(t, "process", None), "pid", None) for t in self.ranks]
            return WorkerReady({**ready.info, "ranks": self.size,
                                "rank_processes": [{"rank": r, "pid": pid} for r, pid in enumerate(pids)]})
        if self._result is None:
            return None
        result = self._result
        if result.outcome.status != "success":
            # Other ranks may be inside a collective rank 0 left: a fresh group for the next job.
            self._result = None
            self._restart()
            return result
        if len(self._finished) == self.size - 1:
            self._result = None
            return result
        if time.monotonic() - self._result_since > self.timeout_s:
            missing = sorted(set(range(1, self.size)) - self._finished)
            raise self._lost(missing[0], f"did not finish the job within {self.timeout_s:g} s of rank 0")
        return None

    def missing_models(self, models: list[tuple[str, str]]) -> list[tuple[str, str]]:
        """Asked of rank 0 (every local rank reads the same folders)."""
        return self.ranks[0].missing_models(models) if self.ranks else []


def local_group_pool(ranks: int, *, timeout_s: float = DEFAULT_RANK_TIMEOUT_S) -> Callable[[Any, Any], WorkerPool]:
    """The server's pool for --ranks-per-worker N without Ray: one worker, a group of N local processes."""
    def build(runtime: Any, config: Any) -> WorkerPool:
        if config.worker_recipe is None:
            raise ValueError("a rank group builds its runtimes from the server's recipe; none was given")
        recipe = config.worker_recipe
        events: EventBus = runtime.events
        worker = RemoteWorker(lambda: RankGroupTransport(recipe, ranks, timeout_s=timeout_s), events,
                              grace_s=getattr(config, "interrupt_grace_s", DEFAULT_INTERRUPT_GRACE_S),
                              name="group-0", kind=f"rank group of {ranks} processes")
        return WorkerPool([worker])
    return build
