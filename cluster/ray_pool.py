"""Job workers as Ray actors: the same worker as the local worker process, behind a second transport.

Topology. The aiohttp server (the front door) keeps the SQLite job store and its job runner; the
runner's dispatcher hands each job to one idle worker of the pool (`execution/job_runner.py`, chosen by
`execution/placement.py`). A worker here is a `RemoteWorker` whose transport, `RayTransport`, reaches
one `WorkerActor`: an actor that builds its own runtime (registry, executor, output cache, model
cache) from the server's recipe and serves it with the same `WorkerHost` the local worker process
uses. `--workers N` starts a local Ray instance with N CPU workers; `--ray-address ADDR` joins a
cluster, with one worker per GPU (`num_gpus=1` each) unless --workers says otherwise.

What travels where (the typed messages of `execution/worker_messages.py`, as for a local worker):

    front door -> actor   each message pickled by the front door (so a job that cannot be encoded
                          fails there, before it is sent), through `WorkerActor.deliver`; a RunJob
                          comes with the job's input files, put in the object store by the front door
    actor -> front door   one streaming generator (`WorkerActor.messages`) yielding batches of the
                          worker's messages: WorkerReady, JobEvents in order, OutputFiles, JobResult
                          (or WorkerFailure when the runtime could not be built or a job not read)

The actor writes into its own scratch folders (input, output, temp, user), never into the front
door's. A file a node reported in its `executed` event is shipped right before that event; the rest
right before the result. The front door writes each one under the job's staging name (temporary
name, then rename), with the next free counter when its name is a numbered one (`name_00001_.png`),
and rewrites the event and the outputs to the names it gave. The runner then writes the record and
only then gives the files their final names, as for a local worker.

Faults: the generator raising (process killed, machine gone) is `WorkerDied`: the runner re-queues
the job once, on another worker when one is idle, then records it interrupted; a fresh actor replaces
the dead one at once. Interrupts go to the actor as messages; a node that ignores one past the grace
period gets its actor killed and replaced, as a local worker's process is.
"""
from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import pickle
import queue
import re
import shutil
import sys
import tempfile
import threading
from pathlib import Path, PurePosixPath
from typing import Any, Callable

import ray

from execution.events import EventBus
from execution.paths import STAGING_PREFIX, atomic_write_bytes, confine, next_output_name, staging_token
from execution.placement import named_files
from execution.worker import (DEFAULT_INTERRUPT_GRACE_S, RemoteWorker, RuntimeRecipe, Transport, WorkerDied,
                              WorkerHost, WorkerPool, start_failure)
from execution.worker_messages import (FromWorker, JobEvent, JobResult, OutputFile, OutputFiles, RunJob, StopWorker,
                                       ToWorker)

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[1]
NUMBERED = re.compile(r"(?P<stem>.+)_(?P<counter>\d{5})_\.(?P<ext>[^./]+)")  # next_output_name's file names
MODEL_CHECK_TIMEOUT_S = 30.0
_STREAM_END = object()  # the actor's outbox ends here (never leaves the actor)


class _Ended:
    """The transport's note that the actor's stream ended (it never comes from the actor)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
_naming_lock = threading.Lock()  # several workers' files arrive at once; each name is picked and written under it


# ---------------------------------------------------------------------- the actor's side
def _scratch_args(args: argparse.Namespace, scratch: Path) -> argparse.Namespace:
    """The server's flags with the folders a job writes moved to the worker's own scratch folder."""
    changed = copy.copy(args)
    for flag in ("input", "output", "temp", "user"):
        folder = scratch / flag
        folder.mkdir(parents=True, exist_ok=True)
        setattr(changed, f"{flag}_directory", folder)
    return changed


def _devices() -> list[str]:
    """The accelerators this actor was given (torch's names when it is loaded, else Ray's ids)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return [f"gpu:{i}" for i in ray.get_gpu_ids()] or ["cpu"]


def _picklable(value: Any) -> Any:
    """`value` when it pickles, else what the websocket would show of it (a node's UI output may hold
    anything; one that does not pickle must not end the worker's message stream)."""
    try:
        pickle.dumps(value)
        return value
    except Exception:
        return json.loads(json.dumps(value, default=repr))


class _ActorConnection:
    """The pipe `WorkerHost` expects, over two queues; ships the job's files back as bytes."""

    def __init__(self, paths: Any) -> None:
        self.paths = paths
        self.inbox: queue.Queue = queue.Queue()
        self.outbox: queue.Queue = queue.Queue()
        self.token: str | None = None

    def recv(self) -> ToWorker:
        """The next message from the front door (it arrives pickled; see WorkerActor.deliver)."""
        message = pickle.loads(self.inbox.get())
        if isinstance(message, RunJob):
            self.token = message.request.staging_token
        return message

    def send(self, message: FromWorker) -> None:
        if isinstance(message, JobEvent) and message.event == "executed":
            files = self._take_reported(message.data.get("output") or {})
            if files:
                self.outbox.put(OutputFiles(files))
            message = JobEvent("executed", _picklable(message.data))
        elif isinstance(message, JobResult):
            outcome = message.outcome
            files = [item for item in (self._take(Path(final), Path(staged)) for staged, final in outcome.staged)
                     if item is not None]
            outcome.staged = []
            outcome.outputs = _picklable(outcome.outputs)
            if files:
                self.outbox.put(OutputFiles(files))
        self.outbox.put(message)

    def close(self) -> None:
        self.outbox.put(_STREAM_END)

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
        for item in _file_items(ui):
            final = self.paths.folder(item["type"]) / item.get("subfolder", "") / item["filename"]
            staged = final.with_name(f"{STAGING_PREFIX}{self.token}-{final.name}") if self.token else final
            taken = self._take(final, staged)
            if taken is not None:
                files.append(taken)
        return files


@ray.remote(concurrency_groups={"stream": 1}, max_concurrency=1, max_restarts=0)
class WorkerActor:
    """One job worker inside a Ray actor: its own runtime, served by the local worker's host.

    Its message stream runs in a concurrency group of its own; every other call runs one at a time,
    in the order the front door sent it."""

    def __init__(self, recipe: RuntimeRecipe, name: str, scratch_root: str | None, threads: int | None) -> None:
        if threads:
            os.environ["OMP_NUM_THREADS"] = str(threads)
        self.scratch = Path(tempfile.mkdtemp(prefix=f"weft-{name}-", dir=scratch_root))
        try:
            runtime = RuntimeRecipe(recipe.factory, _scratch_args(recipe.args, self.scratch)).build()
        except Exception as exc:  # said on the message stream, as a local worker says it on its pipe
            logger.exception("the job worker could not build its runtime")
            self.paths, self.connection = None, _ActorConnection(None)
            self.connection.send(start_failure(exc))
            self.connection.close()
            shutil.rmtree(self.scratch, ignore_errors=True)
            return
        torch = sys.modules.get("torch")
        if threads and torch is not None:
            torch.set_num_threads(threads)
        self.paths = runtime.paths
        self.connection = _ActorConnection(runtime.paths)
        info = {"node": ray.util.get_node_ip_address(), "devices": _devices()}
        self.host = WorkerHost(self.connection, runtime, info=info)
        threading.Thread(target=self._serve, name="weft-actor-host", daemon=True).start()

    def _serve(self) -> None:
        try:
            self.host.serve()
        finally:
            self.connection.close()
            shutil.rmtree(self.scratch, ignore_errors=True)

    @ray.method(concurrency_group="stream")
    def messages(self):
        """The worker's messages, in order, in batches, until it stops (a streaming generator)."""
        outbox = self.connection.outbox
        while True:
            batch = [outbox.get()]
            while True:
                try:
                    batch.append(outbox.get_nowait())
                except queue.Empty:
                    break
            ended = batch[-1] is _STREAM_END
            if ended:
                batch.pop()
            if batch:
                yield batch
            if ended:
                return

    def deliver(self, message: bytes, media: list | None = None) -> None:
        """One pickled message from the front door (decoded by the host's reader, which reports a job it
        cannot decode); a job's input files arrive with its RunJob."""
        if self.paths is None:  # the runtime was never built: nothing reads the inbox
            return
        for kind, relative, data in media or ():
            target = confine(self.paths.folder(kind), relative)
            target.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(target, data)
        self.connection.inbox.put(message)

    def missing_models(self, models: list[tuple[str, str]]) -> list[tuple[str, str]]:
        """The (folder, name) model files this machine's folders lack (all, when its runtime never started)."""
        if self.paths is None:
            return list(models)
        missing = []
        for folder, name in models:
            try:
                self.paths.model_path(folder, name)
            except (FileNotFoundError, ValueError):
                missing.append((folder, name))
        return missing

    def pid(self) -> int:
        """The actor's process id (tests kill it)."""
        return os.getpid()


# ---------------------------------------------------------------------- the front door's side
def _file_items(ui: dict):
    """The file entries ({filename, subfolder, type}) of a node's UI output."""
    for value in ui.values():
        if isinstance(value, list):
            for item in value:
                if isinstance(item, dict) and isinstance(item.get("filename"), str) \
                        and item.get("type", "output") in ("output", "temp"):
                    item.setdefault("type", "output")
                    yield item


def rename_outputs(outputs: dict, renamed: dict[tuple[str, str], str]) -> None:
    """Point the file entries of `outputs` (node -> UI output) at the names the front door gave."""
    for ui in outputs.values():
        if not isinstance(ui, dict):
            continue
        for item in _file_items(ui):
            relative = PurePosixPath(item.get("subfolder") or "", item["filename"]).as_posix()
            new = renamed.get((item["type"], relative))
            if new is not None:
                path = PurePosixPath(new)
                item["filename"] = path.name
                item["subfolder"] = "" if str(path.parent) == "." else path.parent.as_posix()


class RayTransport(Transport):
    """The server's end of one `WorkerActor`: messages in order, files written on arrival."""

    def __init__(self, actor_class: Any, recipe: RuntimeRecipe, name: str, paths: Any, *,
                 options: dict, scratch_root: str | None, threads: int | None,
                 media_of: Callable[[dict], list[tuple[str, str]]]) -> None:
        self.actor_class = actor_class
        self.recipe = recipe
        self.name = name
        self.paths = paths  # the front door's folders
        self.options = options
        self.scratch_root = scratch_root
        self.threads = threads
        self.media_of = media_of
        self.actor = None
        self.messages: queue.Queue = queue.Queue()
        self.reader: threading.Thread | None = None
        self.token: str | None = None
        self.staged: list[tuple[str, str]] = []  # this attempt's files, written under staging names here
        self.renamed: dict[tuple[str, str], str] = {}  # (kind, worker's name) -> the name given here
        self.has_models: set[tuple[str, str]] = set()  # model files it was found to have

    def start(self) -> None:
        """Create the actor and read its message stream on a thread."""
        self.actor = self.actor_class.options(**self.options).remote(self.recipe, self.name, self.scratch_root,
                                                                      self.threads)
        stream = self.actor.messages.remote()
        self.reader = threading.Thread(target=self._read, args=(stream,), name=f"weft-{self.name}-reader",
                                       daemon=True)
        self.reader.start()

    def _read(self, stream: Any) -> None:
        try:
            for reference in stream:
                for message in ray.get(reference):
                    self.messages.put(message)
            self.messages.put(_Ended("its actor stopped"))
        except Exception as exc:  # the actor died (killed, its machine gone) or never started
            self.messages.put(_Ended(f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc) else ''}"))

    def send(self, message: ToWorker) -> None:
        """Deliver one message; a RunJob carries the job's input files through the object store. The
        message is pickled here, so one that cannot be (a prompt nested too deep) fails before it leaves."""
        if self.actor is None:
            raise WorkerDied(f"the Ray worker {self.name} is not running")
        encoded = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        media = None
        if isinstance(message, RunJob):
            request = message.request
            self.token, self.staged, self.renamed = request.staging_token, [], {}
            items = []
            for kind, relative in self.media_of(request.prompt):
                items.append((kind, relative, confine(self.paths.folder(kind), relative).read_bytes()))
            media = ray.put(items) if items else None
        try:
            self.actor.deliver.remote(encoded, media)
        except Exception as exc:  # the actor handle is gone
            raise WorkerDied(f"the Ray worker {self.name} is gone: {exc}") from None

    def receive(self, timeout: float) -> FromWorker | None:
        """The next message for the worker; files are written here and never returned."""
        wait = timeout
        while True:
            try:
                message = self.messages.get(timeout=wait) if wait > 0 else self.messages.get_nowait()
            except queue.Empty:
                return None
            if isinstance(message, _Ended):
                self.messages.put(message)  # it stays dead for every later call
                raise WorkerDied(f"the Ray worker {self.name} ended ({message.reason})")
            if isinstance(message, OutputFiles):
                self._write_files(message.files)
                wait = 0.0
                continue
            if isinstance(message, JobEvent) and message.event == "executed":
                rename_outputs({"node": message.data.get("output") or {}}, self.renamed)
            elif isinstance(message, JobResult):
                outcome = message.outcome
                rename_outputs(outcome.outputs, self.renamed)
                outcome.staged, self.staged = self.staged, []
            return message

    def _write_files(self, files: list[OutputFile]) -> None:
        """Write arriving files under the job's staging names (temporary name, then rename)."""
        for item in files:
            kind, relative, data = item.kind, item.relative, item.data
            folder = self.paths.folder(kind)
            path = PurePosixPath(relative)
            numbered = NUMBERED.fullmatch(path.name)
            with _naming_lock:
                if numbered is not None:
                    prefix = (path.parent / numbered["stem"]).as_posix()
                    final, name, subfolder = next_output_name(folder, prefix, numbered["ext"])
                    given = PurePosixPath(subfolder, name).as_posix() if subfolder else name
                else:
                    final, given = confine(folder, relative), relative
                    final.parent.mkdir(parents=True, exist_ok=True)
                token = self.token or staging_token(self.name)
                staged = final.with_name(f"{STAGING_PREFIX}{token}-{final.name}")
                atomic_write_bytes(staged, data)
            self.staged.append((str(staged), str(final)))
            self.renamed[(kind, relative)] = given

    def missing_models(self, models: list[tuple[str, str]]) -> list[tuple[str, str]]:
        """Asked of the actor (its machine's folders); files once found are not asked about again."""
        unknown = [m for m in models if tuple(m) not in self.has_models]
        if not unknown:
            return []
        missing = ray.get(self.actor.missing_models.remote(unknown), timeout=MODEL_CHECK_TIMEOUT_S)
        self.has_models.update(tuple(m) for m in unknown if tuple(m) not in {tuple(x) for x in missing})
        return [tuple(m) for m in missing]

    def kill(self) -> None:
        """End the actor at once (no Ray restart: the worker starts a fresh one)."""
        actor, self.actor = self.actor, None
        if actor is not None:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already gone
                pass

    def stop(self, timeout: float) -> None:
        """Ask the actor to stop, then kill it after `timeout`."""
        if self.actor is None:
            return
        try:
            self.actor.deliver.remote(pickle.dumps(StopWorker()), None)
        except Exception:
            pass
        if self.reader is not None:
            self.reader.join(timeout)
        self.kill()

    def pid(self) -> int:
        """The actor's process id."""
        return ray.get(self.actor.pid.remote(), timeout=30)


# ---------------------------------------------------------------------- the pool
def start_ray(address: str | None, *, num_cpus: int | None = None, object_store_bytes: int | None = None) -> bool:
    """Connect to `address` or start a local Ray instance; False when this process was connected already."""
    if ray.is_initialized():
        return False
    path = os.environ.get("PYTHONPATH", "")
    # Workers import Weft's modules (the recipe's factory) from the folder this server runs from.
    runtime_env = {"env_vars": {"PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), path) if p)}}
    if address:
        ray.init(address=address, runtime_env=runtime_env, logging_level=logging.WARNING)
    else:
        ray.init(num_cpus=num_cpus, object_store_memory=object_store_bytes, include_dashboard=False,
                 runtime_env=runtime_env, logging_level=logging.WARNING)
    return True


def ray_pool(runtime: Any, recipes: list[RuntimeRecipe], *, grace_s: float = DEFAULT_INTERRUPT_GRACE_S,
             gpus_per_worker: float = 0.0, cpus_per_worker: float = 1.0, threads: int | None = None,
             scratch_root: str | None = None, shutdown: Callable[[], None] | None = None) -> WorkerPool:
    """One Ray worker per recipe (Ray must be initialised), relaying events to `runtime.events`."""
    options = {"num_cpus": cpus_per_worker, "num_gpus": gpus_per_worker}
    events: EventBus = runtime.events

    def media_of(prompt: dict) -> list[tuple[str, str]]:
        return list(named_files(prompt, runtime.registry, runtime.paths).media)

    workers = []
    for index, recipe in enumerate(recipes):
        name = f"ray-{index}"
        workers.append(RemoteWorker(
            lambda recipe=recipe, name=name: RayTransport(WorkerActor, recipe, name, runtime.paths, options=options,
                                                          scratch_root=scratch_root, threads=threads,
                                                          media_of=media_of),
            events, grace_s=grace_s, name=name, kind="ray"))
    return WorkerPool(workers, close=shutdown)


def pool_from_args(args: argparse.Namespace) -> Callable[[Any, Any], WorkerPool]:
    """The server's worker pool for --workers / --ray-address: (runtime, server config) -> WorkerPool.
    Ray starts (or is joined) when the server builds the pool; the server's close shuts it down."""
    def build(runtime: Any, config: Any) -> WorkerPool:
        if config.worker_recipe is None:
            raise ValueError("Ray workers build their runtime from the server's recipe; none was given")
        local_count = args.workers or 1
        started = start_ray(args.ray_address, num_cpus=None if args.ray_address else max(local_count, os.cpu_count() or 1))
        gpus = float(ray.cluster_resources().get("GPU", 0))
        per_worker = args.worker_gpus if args.worker_gpus is not None else (1.0 if gpus else 0.0)
        count = args.workers or (max(1, int(gpus // per_worker)) if per_worker else 1)
        logger.info("%d Ray worker(s), %g GPU each, on %s", count, per_worker, args.ray_address or "a local Ray")
        return ray_pool(runtime, [config.worker_recipe] * count, grace_s=config.interrupt_grace_s,
                        gpus_per_worker=per_worker, threads=args.worker_threads,
                        shutdown=ray.shutdown if started else None)
    return build
