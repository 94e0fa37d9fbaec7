"""Job workers as Ray actors: the same worker as the local worker process, behind a second transport.

Topology. The aiohttp server (the front door) keeps the SQLite job store and its job runner; the
runner's dispatcher hands each job to one idle worker of the pool (`execution/job_runner.py`, chosen by
`execution/placement.py`). A worker here is a `RemoteWorker` whose transport, `RayTransport`, reaches
one `WorkerActor`: an actor whose child process (`cluster/actor_host.py`) builds its own runtime
(registry, executor, output cache, model cache) from the server's recipe and serves it with the same
`WorkerHost` the local worker process uses; the actor relays between that child's pipe and Ray. `--workers N` starts a local Ray instance with N CPU workers; `--ray-address ADDR` joins a
cluster, with one worker per GPU (`num_gpus=1` each) unless --workers says otherwise.

What travels where (the typed messages of `execution/worker_messages.py`, as for a local worker):

    front door -> actor   each message pickled by the front door (so a job that cannot be encoded
                          fails there, before it is sent), through `WorkerActor.deliver`, which passes
                          the bytes down the pipe (the child decodes them); a RunJob comes with the
                          job's input files, put in the object store by the front door
    actor -> front door   one streaming generator (`WorkerActor.messages`) yielding batches of the
                          worker's messages, each as the child pickled it (the actor never decodes
                          them): WorkerReady, JobEvents in order, OutputFiles, JobResult (or
                          WorkerFailure when the runtime could not be built or a job not read)

The actor writes into its own scratch folders (input, output, temp, user), never into the front
door's. A file a node reported in its `executed` event is shipped right before that event; the rest
right before the result. The front door writes each one under the job's staging name (temporary
name, then rename), with the next free counter when its name is a numbered one (`name_00001_.png`),
and rewrites the event and the outputs to the names it gave. The runner then writes the record and
only then gives the files their final names, as for a local worker.

Why a child process: Python's lock is per process. A node that holds it in one long C call (a huge
integer power, an extension that does not release it) stops every thread of its own process, so when
the host ran in the actor's process the events and files a node sent before such a call waited there
until it ended. Now the node runs in the child, whose host writes each message to the pipe as it is
sent; the actor's relay thread reads the pipe with the actor's own lock and streams on. The child is
started by that relay thread and dies with it (a parent-death signal), so killing the actor (an ignored
interrupt, a SIGKILL) ends the node as before, and a child that dies ends the actor's stream with an
error, which the front door reads as the worker dying.

Faults: the generator raising (process killed, machine gone, child dead) is `WorkerDied`: the runner re-queues
the job once, on another worker when one is idle, then records it interrupted; a fresh actor replaces
the dead one at once. Interrupts go to the actor as messages; a node that ignores one past the grace
period gets its actor killed and replaced, as a local worker's process is.
"""
from __future__ import annotations

import argparse
import copy
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

from cluster.rank_group import RankGroupTransport, free_local_address
from execution.paths import STAGING_PREFIX, atomic_write_bytes, confine, next_output_name, staging_token
from execution.placement import named_files
from cluster.actor_host import file_items
from execution.worker import (DEFAULT_INTERRUPT_GRACE_S, RemoteWorker, RuntimeRecipe, Transport, WorkerDied,
                              WorkerPool, start_failure)
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


# Ray's notice, on every start of a local instance, that it turned token authentication on (as it should:
# it stays on). The notice that it is off is a warning about a real risk and is left alone.
RAY_TOKEN_LOGGER = "ray._private.authentication.authentication_token_setup"  # provenance: interface
RAY_TOKEN_ON_NOTICE = "Token authentication is enabled for this Ray cluster"  # provenance: interface
CHILD_STOP_S = 10.0  # how long the actor waits for its child to end after the pipe closed


@ray.remote(concurrency_groups={"stream": 1}, max_concurrency=1, max_restarts=0)
class WorkerActor:
    """One job worker inside a Ray actor: a child process runs the local worker's host on its own runtime
    (`cluster/actor_host.py`); the actor relays the child's messages and writes a job's input files.

    Its message stream runs in a concurrency group of its own; every other call runs one at a time,
    in the order the front door sent it. The relay is a thread of the actor's process, so a node that
    holds the child's Python lock never holds it back."""

    def __init__(self, recipe: RuntimeRecipe, name: str, scratch_root: str | None, threads: int | None) -> None:
        if threads:
            os.environ["OMP_NUM_THREADS"] = str(threads)  # the child inherits it
        self.scratch = Path(tempfile.mkdtemp(prefix=f"weft-{name}-", dir=scratch_root))
        self.recipe = RuntimeRecipe(recipe.factory, _scratch_args(recipe.args, self.scratch))
        self.threads = threads
        self.paths = None  # the child's folders, once its runtime is built
        self.pipe = None
        self.child = None
        self.child_exit: int | None = None
        self.outbox: queue.Queue = queue.Queue()
        started = threading.Event()
        # The child is started by the relay thread, which lives as long as the child: its parent-death
        # signal fires when the thread that started it ends, so it must be this long-lived one.
        threading.Thread(target=self._relay, args=(started,), name="weft-actor-relay", daemon=True).start()
        started.wait()  # the runtime is built (or failed, or the child died) before the actor takes calls

    def _relay(self, started: threading.Event) -> None:
        """Start the child, then forward what it sends, as the pickled bytes it wrote, until it ends. The
        recipe goes to the child as Ray pickled it to the actor (by value where its factory was defined
        in the server's main script, which the child cannot import), so it is pickled here the same way."""
        import multiprocessing

        from ray import cloudpickle

        from cluster.actor_host import RuntimeFolders, serve_actor_child

        try:
            context = multiprocessing.get_context("spawn")
            parent, child_end = context.Pipe(duplex=True)
            self.child = context.Process(
                target=serve_actor_child, name="weft-ray-worker",
                args=(child_end, cloudpickle.dumps(self.recipe), self.threads, ray.util.get_node_ip_address(),
                      list(ray.get_gpu_ids()), os.getpid()))
            self.child.start()
            child_end.close()
            self.pipe = parent
            first = parent.recv()  # RuntimeFolders, or the WorkerFailure saying why it could not start
            if isinstance(first, RuntimeFolders):
                self.paths = first.paths
            else:
                self.outbox.put(pickle.dumps(first, protocol=pickle.HIGHEST_PROTOCOL))
            started.set()
            while True:
                self.outbox.put(parent.recv_bytes())
        except (EOFError, OSError):  # the child ended
            pass
        except Exception as exc:  # the child could not be started
            logger.exception("the job worker's process could not be started")
            self.outbox.put(pickle.dumps(start_failure(exc), protocol=pickle.HIGHEST_PROTOCOL))
        finally:
            started.set()
            if self.child is not None:
                self.child.join(CHILD_STOP_S)
                if self.child.is_alive():
                    self.child.kill()
                    self.child.join()
                self.child_exit = self.child.exitcode
            shutil.rmtree(self.scratch, ignore_errors=True)
            self.outbox.put(_STREAM_END)

    @ray.method(concurrency_group="stream")
    def messages(self):
        """The worker's messages (each as the child pickled it), in order, in batches, until it stops (a
        streaming generator); a child that died raises here, which the front door reads as WorkerDied."""
        outbox = self.outbox
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
                if self.child_exit:
                    raise RuntimeError(f"the worker process ended with exit code {self.child_exit}")
                return

    def deliver(self, message: bytes, media: list | None = None) -> None:
        """One pickled message from the front door, passed to the child as it is (the child's host
        decodes it and reports a job it cannot decode); a job's input files arrive with its RunJob."""
        if self.paths is None:  # the runtime was never built: nothing reads the pipe
            return
        for kind, relative, data in media or ():
            target = confine(self.paths.folder(kind), relative)
            target.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(target, data)
        try:
            self.pipe.send_bytes(message)
        except (OSError, ValueError):  # the child ended; the message stream says so
            pass

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
        """The actor's process id (tests kill it; its child dies with it)."""
        return os.getpid()


# ---------------------------------------------------------------------- the front door's side
def rename_outputs(outputs: dict, renamed: dict[tuple[str, str], str]) -> None:
    """Point the file entries of `outputs` (node -> UI output) at the names the front door gave."""
    for ui in outputs.values():
        if not isinstance(ui, dict):
            continue
        for item in file_items(ui):
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
                 media_of: Callable[[dict], list[tuple[str, str]]], keep_files: bool = True) -> None:
        self.keep_files = keep_files  # False: a rank other than 0 of a group, whose files are not the job's
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
                for encoded in ray.get(reference):
                    self.messages.put(pickle.loads(encoded))  # written by Weft's own worker process
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
                if self.keep_files:
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


# ---------------------------------------------------------------------- rank groups of actors
class RayRankGroup(RankGroupTransport):
    """A rank group of Ray actors: one placement group of N bundles on one machine (STRICT_PACK), one actor
    per bundle; rank 0's actor speaks for the group (cluster/rank_group.py has the rules)."""

    def __init__(self, recipe: RuntimeRecipe, size: int, name: str, paths: Any, *, timeout_s: float,
                 bundle: dict, scratch_root: str | None, threads: int | None,
                 media_of: Callable[[dict], list[tuple[str, str]]]) -> None:
        super().__init__(recipe, size, timeout_s=timeout_s, private_folders=False)
        self.name, self.paths, self.bundle = name, paths, bundle
        self.scratch_root, self.threads, self.media_of = scratch_root, threads, media_of
        self.group = None

    def start(self) -> None:
        """Reserve the group's bundles (waits until the cluster has them), then start one actor per rank."""
        from ray.util.placement_group import placement_group

        self.group = placement_group([dict(self.bundle) for _ in range(self.size)], strategy="STRICT_PACK")
        ray.get(self.group.ready())
        super().start()

    def rendezvous(self) -> str:
        """The group's machine (every bundle is on it), at a port free on the server's machine now."""
        from ray.util.placement_group import placement_group_table

        node_id = placement_group_table(self.group)["bundles_to_node_id"][0]
        host = next((node["NodeManagerAddress"] for node in ray.nodes() if node["NodeID"] == node_id), "127.0.0.1")
        return f"tcp://{host}:{free_local_address().rsplit(':', 1)[1]}"

    def rank_transport(self, rank: int, recipe: RuntimeRecipe) -> Transport:
        """The actor of rank `rank`, scheduled into its bundle."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        options = {"num_cpus": self.bundle.get("CPU", 0), "num_gpus": self.bundle.get("GPU", 0),
                   "scheduling_strategy": PlacementGroupSchedulingStrategy(
                       placement_group=self.group, placement_group_bundle_index=rank)}
        return RayTransport(WorkerActor, recipe, f"{self.name}-rank{rank}", self.paths, options=options,
                            scratch_root=self.scratch_root, threads=self.threads, media_of=self.media_of,
                            keep_files=rank == 0)

    def _release_group(self) -> None:
        from ray.util.placement_group import remove_placement_group

        group, self.group = self.group, None
        if group is not None:
            try:
                remove_placement_group(group)
            except Exception:  # Ray already gone
                pass

    def kill(self) -> None:
        """Kill every actor and give the bundles back."""
        super().kill()
        self._release_group()

    def stop(self, timeout: float) -> None:
        """Stop every actor and give the bundles back."""
        super().stop(timeout)
        self._release_group()


def _remote_pool(runtime: Any, recipes: list[RuntimeRecipe], prefix: str, kind: str, transport_for, *,
                 grace_s: float, shutdown: Callable[[], None] | None) -> WorkerPool:
    """One RemoteWorker per recipe, named `prefix-N`, over the transport `transport_for(recipe, name, media_of)`
    makes; `media_of` tells a transport which input files a prompt names, to send them along."""
    def media_of(prompt: dict) -> list[tuple[str, str]]:
        return list(named_files(prompt, runtime.registry, runtime.paths).media)

    workers = [RemoteWorker(lambda recipe=recipe, name=f"{prefix}-{index}": transport_for(recipe, name, media_of),
                            runtime.events, grace_s=grace_s, name=f"{prefix}-{index}", kind=kind)
               for index, recipe in enumerate(recipes)]
    return WorkerPool(workers, close=shutdown)


def ray_group_pool(runtime: Any, recipes: list[RuntimeRecipe], ranks: int, *, timeout_s: float,
                   grace_s: float = DEFAULT_INTERRUPT_GRACE_S, gpus_per_rank: float = 0.0, cpus_per_rank: float = 1.0,
                   threads: int | None = None, scratch_root: str | None = None,
                   shutdown: Callable[[], None] | None = None) -> WorkerPool:
    """One rank group of `ranks` Ray actors per recipe (Ray must be initialised), relaying rank 0's events."""
    bundle = {"CPU": cpus_per_rank, **({"GPU": gpus_per_rank} if gpus_per_rank else {})}
    return _remote_pool(
        runtime, recipes, "ray-group", f"ray rank group of {ranks} actors",
        lambda recipe, name, media_of: RayRankGroup(recipe, ranks, name, runtime.paths, timeout_s=timeout_s,
                                                    bundle=bundle, scratch_root=scratch_root, threads=threads,
                                                    media_of=media_of),
        grace_s=grace_s, shutdown=shutdown)


# ---------------------------------------------------------------------- the pool
LOCAL_POOL_RECORD = "ray_local_pool.json"  # under the user folder: the local pool's processes (cluster.reaper)


class _DropTokenOnNotice(logging.Filter):
    """Drops Ray's "token authentication is enabled" notice; every other record of its logger passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(RAY_TOKEN_ON_NOTICE)


def _quiet_token_notice() -> None:
    token_logger = logging.getLogger(RAY_TOKEN_LOGGER)
    if not any(isinstance(f, _DropTokenOnNotice) for f in token_logger.filters):
        token_logger.addFilter(_DropTokenOnNotice())


def _bind_to_loopback() -> None:
    """Make a local Ray listen on 127.0.0.1 only. Ray resolves a node address of 127.0.0.1 to the
    machine's outward address unless it believes clusters are off; with that switch off every service
    it starts (control service, raylet, agents, workers) binds loopback. The switch is read from the
    environment by the processes Ray starts and from its constants module by this one."""
    from ray._private import ray_constants

    os.environ[ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False


class LocalPoolWatch:
    """The reaper process watching a local Ray pool (see `cluster.reaper`), and its record."""

    def __init__(self, record: Path) -> None:
        import subprocess

        from cluster import reaper

        self.record = record
        self.process = subprocess.Popen(
            [sys.executable, "-m", "cluster.reaper", str(record), str(os.getpid())], cwd=REPO_ROOT,
            preexec_fn=reaper.set_parent_death_signal, stdin=subprocess.DEVNULL)

    def close(self) -> None:
        """After Ray's own shutdown: stop the reaper and end anything still recorded."""
        from cluster import reaper

        self.process.kill()
        self.process.wait()
        reaper.end_recorded(self.record)


def start_ray(address: str | None, *, num_cpus: int | None = None, object_store_bytes: int | None = None,
              record_dir: Path | None = None) -> Callable[[], None] | None:
    """Connect to `address` or start a local Ray instance; returns the function that shuts down what
    was started here, or None when this process was connected already.

    A local instance binds 127.0.0.1 only. With `record_dir`, its processes are recorded there and end
    when this process dies (`cluster.reaper`); what a killed predecessor left is ended first."""
    if ray.is_initialized():
        return None
    path = os.environ.get("PYTHONPATH", "")
    # Workers import Weft's modules (the recipe's factory) from the folder this server runs from.
    runtime_env = {"env_vars": {"PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), path) if p)}}
    if address:
        ray.init(address=address, runtime_env=runtime_env, logging_level=logging.WARNING)
        return ray.shutdown
    watch = None
    if record_dir is not None:
        from cluster import reaper

        record = Path(record_dir) / LOCAL_POOL_RECORD
        left = reaper.end_recorded(record)
        if left:
            logger.warning("ended %d Ray process(es) a previous server left running", left)
    _bind_to_loopback()
    _quiet_token_notice()
    ray.init(num_cpus=num_cpus, object_store_memory=object_store_bytes, include_dashboard=False,
             _node_ip_address="127.0.0.1", runtime_env=runtime_env, logging_level=logging.WARNING)
    if record_dir is not None:
        watch = LocalPoolWatch(record)

    def shutdown() -> None:
        ray.shutdown()
        if watch is not None:
            watch.close()
    return shutdown


def ray_pool(runtime: Any, recipes: list[RuntimeRecipe], *, grace_s: float = DEFAULT_INTERRUPT_GRACE_S,
             gpus_per_worker: float = 0.0, cpus_per_worker: float = 1.0, threads: int | None = None,
             scratch_root: str | None = None, shutdown: Callable[[], None] | None = None) -> WorkerPool:
    """One Ray worker per recipe (Ray must be initialised), relaying events to `runtime.events`."""
    options = {"num_cpus": cpus_per_worker, "num_gpus": gpus_per_worker}
    return _remote_pool(
        runtime, recipes, "ray", "ray",
        lambda recipe, name, media_of: RayTransport(WorkerActor, recipe, name, runtime.paths, options=options,
                                                    scratch_root=scratch_root, threads=threads, media_of=media_of),
        grace_s=grace_s, shutdown=shutdown)


def pool_from_args(args: argparse.Namespace) -> Callable[[Any, Any], WorkerPool]:
    """The server's worker pool for --workers / --ray-address: (runtime, server config) -> WorkerPool.
    Ray starts (or is joined) when the server builds the pool; the server's close shuts it down."""
    def build(runtime: Any, config: Any) -> WorkerPool:
        if config.worker_recipe is None:
            raise ValueError("Ray workers build their runtime from the server's recipe; none was given")
        local_count = args.workers or 1
        shutdown = start_ray(args.ray_address, num_cpus=None if args.ray_address
                             else max(local_count * getattr(args, "ranks_per_worker", 1), os.cpu_count() or 1),
                             record_dir=runtime.paths.user)
        gpus = float(ray.cluster_resources().get("GPU", 0))
        per_worker = args.worker_gpus if args.worker_gpus is not None else (1.0 if gpus else 0.0)
        count = args.workers or (max(1, int(gpus // per_worker)) if per_worker else 1)
        ranks = getattr(args, "ranks_per_worker", 1)
        if ranks > 1:
            # Each worker is a group of `ranks` actors with `per_worker` GPUs each.
            count = args.workers or (max(1, int(gpus // (per_worker * ranks))) if per_worker else 1)
            logger.info("%d Ray rank group(s) of %d actors, %g GPU each, on %s", count, ranks, per_worker,
                        args.ray_address or "a local Ray")
            return ray_group_pool(runtime, [config.worker_recipe] * count, ranks, timeout_s=args.rank_timeout,
                                  grace_s=config.interrupt_grace_s, gpus_per_rank=per_worker,
                                  threads=args.worker_threads, shutdown=shutdown)
        logger.info("%d Ray worker(s), %g GPU each, on %s", count, per_worker, args.ray_address or "a local Ray")
        return ray_pool(runtime, [config.worker_recipe] * count, grace_s=config.interrupt_grace_s,
                        gpus_per_worker=per_worker, threads=args.worker_threads,
                        shutdown=shutdown)
    return build
