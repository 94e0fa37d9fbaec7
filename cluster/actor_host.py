"""The child process a Ray worker actor runs its worker host in (no Ray here: the child never needs it).

Why a child: Python's lock is per process. When the worker host ran in the actor's own process, a node
that held the lock in one long C call (a huge integer power, an extension that does not release it)
also stopped the actor's message stream, so the events and files the node had sent before that call
waited in the actor until it ended. Here the node runs in this child; everything the host sends is
written to the pipe at once, and the actor's relay (in its own process, with its own lock) forwards it
while the node still holds this child's lock.

The child builds the runtime from the recipe (with the actor's scratch folders), tells the actor its
folders (`RuntimeFolders`, the first message, which never leaves the actor) or why it could not start,
then serves the same `WorkerHost` as a local worker process. Files a job writes leave as bytes
(`OutputFiles`): those a node reported in its `executed` event right before that event, the rest right
before the job's result, as `cluster/ray_pool.py` describes. The child dies with the thread of the
actor that started it (a parent-death signal), so killing the actor ends the node too.
"""
from __future__ import annotations

import json
import logging
import os
import pickle
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from execution.paths import STAGING_PREFIX
from execution.worker import RuntimeRecipe, WorkerHost, start_failure
from execution.worker_messages import FromWorker, JobEvent, JobResult, OutputFile, OutputFiles, RunJob, ToWorker

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RuntimeFolders:
    """The child's first message once its runtime is built: its folders (the actor writes a job's input
    files into them and answers model questions from them)."""

    paths: Any


def file_items(ui: dict):
    """The file entries ({filename, subfolder, type}) of a node's UI output."""
    for value in ui.values():
        if isinstance(value, list):
            for item in value:
                if isinstance(item, dict) and isinstance(item.get("filename"), str) \
                        and item.get("type", "output") in ("output", "temp"):
                    item.setdefault("type", "output")
                    yield item


def picklable(value: Any) -> Any:
    """`value` when it pickles, else what the websocket would show of it (a node's UI output may hold
    anything; one that does not pickle must not end the worker's message stream)."""
    try:
        pickle.dumps(value)
        return value
    except Exception:
        return json.loads(json.dumps(value, default=repr))


class ShippingConnection:
    """The pipe `WorkerHost` expects, to the actor; ships the job's files back as bytes."""

    def __init__(self, pipe: Any, paths: Any) -> None:
        self.pipe = pipe
        self.paths = paths
        self.token: str | None = None

    def recv(self) -> ToWorker:
        """The next message from the front door, as it pickled it (decoded here, so the host's reader
        reports a job it cannot decode)."""
        message = pickle.loads(self.pipe.recv_bytes())
        if isinstance(message, RunJob):
            self.token = message.request.staging_token
        return message

    def send(self, message: FromWorker) -> None:
        if isinstance(message, JobEvent) and message.event == "executed":
            files = self._take_reported(message.data.get("output") or {})
            if files:
                self.pipe.send(OutputFiles(files))
            message = JobEvent("executed", picklable(message.data))
        elif isinstance(message, JobResult):
            outcome = message.outcome
            files = [item for item in (self._take(Path(final), Path(staged)) for staged, final in outcome.staged)
                     if item is not None]
            outcome.staged = []
            outcome.outputs = picklable(outcome.outputs)
            if files:
                self.pipe.send(OutputFiles(files))
        self.pipe.send(message)

    def _take(self, final: Path, staged: Path) -> OutputFile | None:
        """One written file (folder kind, name relative to it, bytes), which leaves this machine."""
        source = staged if staged.is_file() else final
        if not source.is_file():
            return None
        for kind in ("output", "temp"):
            try:
                relative = final.relative_to(self.paths.folder(kind)).as_posix()
            except ValueError:
                continue
            data = source.read_bytes()
            source.unlink(missing_ok=True)
            return OutputFile(kind, relative, data)
        return None

    def _take_reported(self, ui: dict) -> list[OutputFile]:
        files = []
        for item in file_items(ui):
            final = self.paths.folder(item["type"]) / item.get("subfolder", "") / item["filename"]
            staged = final.with_name(f"{STAGING_PREFIX}{self.token}-{final.name}") if self.token else final
            taken = self._take(final, staged)
            if taken is not None:
                files.append(taken)
        return files


def _devices(ray_gpu_ids: list) -> list[str]:
    """The accelerators this worker was given (torch's names when it is loaded, else Ray's ids)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return [f"gpu:{i}" for i in ray_gpu_ids] or ["cpu"]


def serve_actor_child(pipe: Any, recipe_pickle: bytes, threads: int | None, node: str, ray_gpu_ids: list,
                      actor_pid: int) -> None:
    """The child's entry point: build the runtime from the recipe (pickled by the actor with Ray's
    cloudpickle), report its folders, serve jobs over `pipe`."""
    import signal

    from cluster.reaper import set_parent_death_signal

    set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != actor_pid:  # the actor died before the signal was asked for
        return
    from execution import isolation

    isolation.protect()  # as in a local worker: packs the runtime loads here may reorder sys.path too
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s (ray worker): %(message)s")
    try:
        recipe: RuntimeRecipe = pickle.loads(recipe_pickle)
        runtime = recipe.build()
    except BaseException as exc:
        logger.exception("the job worker could not build its runtime")
        pipe.send(start_failure(exc))
        return
    torch = sys.modules.get("torch")
    if threads and torch is not None:
        torch.set_num_threads(threads)
    pipe.send(RuntimeFolders(runtime.paths))
    info = {"node": node, "devices": _devices(ray_gpu_ids), "actor_pid": actor_pid}
    WorkerHost(ShippingConnection(pipe, runtime.paths), runtime, info=info).serve()
    pipe.close()
