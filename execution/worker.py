"""Where jobs run: one worker interface, and transports that reach a worker's runtime.

The HTTP server never runs node code. The job runner (`execution/job_runner.py`) hands each job to a
`Worker`, which holds (or reaches) a runtime: the node registry, the executor, its output cache and
the model cache. The runner knows nothing else of a worker. Two workers exist here:

    InProcessWorker   runs the job on the calling thread (`--in-process-jobs` and embedders that
                      give no runtime recipe);
    RemoteWorker      sends the job over a `Transport` to a runtime elsewhere and relays its events.

A transport carries the typed messages of `execution/worker_messages.py` both ways and can kill what
it reaches. `LocalProcessTransport` runs `serve_worker` in a child process over a pipe; the Ray actor
transport (`cluster/`) implements the same methods around the same `WorkerHost`; a rank group (several
processes that run one job, rank 0 speaking for them) is one more transport, or one more `Worker`. A
local worker writes outputs under staging names in the shared output folder (`JobOutcome.staged`); a
Ray worker returns their bytes instead (`OutputFiles`), and its transport writes them under the same
staging names on the server before the record. Several workers form a pool: the job runner gives each
its own job (`execution/job_runner.py`, `execution/placement.py`).

Interruption is cooperative first: the worker's executor stops at its next check point. A node that
does not reach one within the grace period gets its worker killed and restarted, and its job ends
`interrupted`. A worker that dies on its own raises `WorkerDied`, and the runner applies the crash rule
(retry once, then interrupted) once the job went to it (`handed_over` was called); a worker that
dies while it boots costs its job no attempt. A job that cannot be handed over (it does not pickle,
the worker cannot read it) ends with an error outcome.
"""
from __future__ import annotations

import logging
import os
import pickle
import signal
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable

from execution.events import EventBus, encode_preview
from execution.failure import ERROR, INTERRUPTED, failure_payload
from execution.paths import begin_staging, end_staging, scrub_base
from execution.worker_messages import (FreeMemory, FromWorker, InterruptJob, JobEvent, JobOutcome, JobRequest,
                                       JobResult, MemoryFreed, RunJob, StopWorker, ToWorker, WorkerFailure,
                                       WorkerReady)

logger = logging.getLogger(__name__)

DEFAULT_INTERRUPT_GRACE_S = 10.0  # a node gets this long to reach a check point after an interrupt
POLL_S = 0.05  # how often the runner looks at its job's interrupt flag while it waits for the worker
MAX_BOOT_DEATHS = 3  # a runtime that dies this many times running before it is ready is a start failure


class WorkerDied(RuntimeError):
    """The worker's process (or actor) ended while it held a job."""


class WorkerStartFailed(RuntimeError):
    """The worker could not build its runtime (a broken plugin, a missing package)."""


@dataclass
class RuntimeRecipe:
    """How a worker builds its own runtime: `factory(args)` (both picklable, e.g. main.Runtime and its
    parsed flags). The server keeps its own runtime for validation and /object_info only."""

    factory: Callable[[Any], Any]
    args: Any

    def build(self) -> Any:
        """The runtime (registry, executor, caches, paths, events)."""
        return self.factory(self.args)


def failure_outcome(prompt_id: str, exc: BaseException | None = None, *, exception_type: str | None = None,
                    message: str | None = None) -> JobOutcome:
    """The record of a job that failed outside any node (validation at run time, an engine fault, a
    job its worker could not be handed): from `exc`, or from its type name and message."""
    more = {}
    if exc is not None:
        exception_type, message = type(exc).__name__, str(exc)
        details = getattr(exc, "to_json", None)
        if callable(details):
            more["details"] = details()
    error = failure_payload(ERROR, prompt_id, exception_type=exception_type, message=message, **more)
    return JobOutcome("error", error=error, messages=[[ERROR, error]])


def interrupted_outcome(prompt_id: str, exception_type: str, message: str, *, killed: bool = False) -> JobOutcome:
    """The record of a job the runner stopped from outside (its worker killed, or never started)."""
    error = failure_payload(INTERRUPTED, prompt_id, exception_type=exception_type, message=message)
    return JobOutcome("interrupted", error=error, messages=[[INTERRUPTED, error]], killed=killed)


def run_request(validate: Callable[[dict, list[str] | None], Any], run: Callable[..., Any], request: JobRequest,
                control: Any, *, validated: Any = None, base: Any = None) -> JobOutcome:
    """Validate (unless given) and run one job; outputs staged under the request's token when it has one."""
    if request.staging_token is not None:
        begin_staging(request.staging_token)
    try:
        if validated is None:
            validated = validate(request.prompt, request.partial_targets)
        result = run(validated, prompt_id=request.prompt_id, extra_data=request.extra_data, control=control)
        outcome = JobOutcome(result.status if result.status in ("success", "interrupted") else "error",
                             outputs=result.outputs, messages=[list(m) for m in result.messages],
                             meta=result.meta, error=result.error, profile=getattr(result, "profile", None) or {})
    except Exception as exc:  # validation at run time (a restart with other nodes) or an engine fault
        outcome = failure_outcome(request.prompt_id, exc)
    finally:
        staged = end_staging() if request.staging_token is not None else []
    outcome.staged = staged
    if base is not None and outcome.status != "success":  # messages name files relative to the base folder
        outcome.error = scrub_base(outcome.error, base)
        outcome.messages = scrub_base(outcome.messages, base)
    return outcome


# ---------------------------------------------------------------------- the interface
# Called when a job goes to a ready runtime, just before it is sent: its attempt counts from then (counted
# before the send, so a job that ran is always counted, even if the server dies right after sending it).
HandedOver = Callable[[], None]


class Worker(ABC):
    """What the job runner needs of a worker (each worker is called from its own runner thread).

    A group of ranks that runs one job together is one Worker: `run` hands the job to the group and
    returns rank 0's outcome; `is_ready` is true when every rank is up; a rank that dies is WorkerDied."""

    name = "local"  # how records, the profile and /system_stats name it

    @abstractmethod
    def start(self) -> None:
        """Get ready to run jobs (a remote worker starts its runtime in the background)."""

    @abstractmethod
    def run(self, request: JobRequest, control: Any, *, validated: Any = None,
            handed_over: HandedOver | None = None) -> JobOutcome:
        """Run one job to its outcome; `control.interrupted` asks it to stop. Calls `handed_over` when the
        job goes to a ready runtime, just before it is sent (a runtime that dies while it boots costs the
        job no attempt). A job that cannot be handed over ends with an error outcome; a runtime that dies
        raises WorkerDied, one that cannot be built WorkerStartFailed."""

    @abstractmethod
    def free(self, unload_models: bool) -> None:
        """Between jobs: clear the output cache (and unload models when asked)."""

    @abstractmethod
    def stop(self, timeout: float = 30.0) -> None:
        """Release the worker (after the current job)."""

    def is_ready(self) -> bool:
        """Whether it can take a job at once (not still starting)."""
        return True

    def missing_models(self, models: list[tuple[str, str]]) -> list[tuple[str, str]]:
        """The (model folder, name) files of `models` it cannot read; a worker on the server's machine
        reads the server's own folders, which validation already checked."""
        return []

    def describe(self) -> dict:
        """What /system_stats shows of it besides its name and state."""
        return {"kind": "in-process"}


class WorkerPool:
    """Several workers behind the one queue, and how to release what they run on."""

    def __init__(self, workers: list[Worker], *, close: Callable[[], None] | None = None) -> None:
        if not workers:
            raise ValueError("a worker pool needs at least one worker")
        self.workers = list(workers)
        self._close = close

    def close(self) -> None:
        """Release the pool's engine (after the workers were stopped)."""
        if self._close is not None:
            close, self._close = self._close, None
            close()


class InProcessWorker(Worker):
    """Runs jobs on the calling thread, with the caller's runtime functions."""

    def __init__(self, validate: Callable[[dict, list[str] | None], Any], run: Callable[..., Any], *,
                 free: Callable[[bool], None] | None = None, base: Any = None) -> None:
        self.validate = validate
        self.run_prompt = run
        self.free_caches = free
        self.base = base

    def start(self) -> None:
        """Nothing to start."""

    def run(self, request: JobRequest, control: Any, *, validated: Any = None,
            handed_over: HandedOver | None = None) -> JobOutcome:
        """Run the job here (it is in this worker's hands at once)."""
        if handed_over is not None:
            handed_over()
        return run_request(self.validate, self.run_prompt, request, control, validated=validated, base=self.base)

    def free(self, unload_models: bool) -> None:
        """Clear the caches here."""
        if self.free_caches is not None:
            self.free_caches(unload_models)

    def stop(self, timeout: float = 30.0) -> None:
        """Nothing to stop."""


class Transport(ABC):
    """A channel to one worker runtime (a child process, a Ray actor) that can also kill it."""

    @abstractmethod
    def start(self) -> None:
        """Start the runtime; it sends WorkerReady once it can take jobs (WorkerFailure if it cannot)."""

    @abstractmethod
    def send(self, message: ToWorker) -> None:
        """Send one message; WorkerDied when the runtime is gone. A message that cannot be encoded
        (pickled) raises what encoding raised, and nothing of it was sent."""

    @abstractmethod
    def receive(self, timeout: float) -> FromWorker | None:
        """The next message, or None after `timeout` seconds; WorkerDied when the runtime is gone."""

    @abstractmethod
    def kill(self) -> None:
        """End the runtime at once, whatever it is doing."""

    @abstractmethod
    def stop(self, timeout: float) -> None:
        """Ask the runtime to end; kill it after `timeout` seconds."""

    def missing_models(self, models: list[tuple[str, str]]) -> list[tuple[str, str]]:
        """The model files of `models` the runtime's machine lacks (a local child shares the server's)."""
        return []


class RemoteWorker(Worker):
    """Runs jobs in a runtime reached through a transport; its events go out on `events`."""

    def __init__(self, make_transport: Callable[[], Transport], events: EventBus, *,
                 grace_s: float = DEFAULT_INTERRUPT_GRACE_S, name: str = "worker", kind: str = "process") -> None:
        self.make_transport = make_transport
        self.events = events
        self.grace_s = grace_s
        self.name = name
        self.kind = kind
        self.transport: Transport | None = None
        self.ready = False
        self.info: dict = {}  # what the runtime said of itself when ready (host, pid, devices)
        self.restarts = 0  # runtimes started after the first (kills and crashes)
        self.boot_deaths = 0  # runtimes in a row that ended before they were ready

    def is_ready(self) -> bool:
        """Up and waiting (reads a pending WorkerReady without blocking)."""
        if self.transport is None:
            return False
        if not self.ready:
            try:
                self._booting(self.transport.receive(0.0))
            except WorkerDied:  # it died while booting with no job: start a fresh one now
                self._discard(kill=True)
                self.boot_deaths += 1
                self.start()
                return False
            except WorkerStartFailed:  # its runtime cannot be built: the next job that comes tries again
                logger.exception("the job worker %s could not start", self.name)
                return False
        return self.ready

    def _booting(self, message: FromWorker | None) -> None:
        """Read one message of a runtime that is not ready yet; raises when it ended or cannot start."""
        if isinstance(message, WorkerReady):
            self.ready, self.info, self.boot_deaths = True, dict(message.info), 0
        elif isinstance(message, WorkerFailure) and message.stage == "start":
            self._discard(kill=True)
            self.boot_deaths = 0
            raise WorkerStartFailed(f"the job worker could not start: {message.exception_type}: {message.message}")

    def missing_models(self, models: list[tuple[str, str]]) -> list[tuple[str, str]]:
        """Asked of the transport (a runtime on another machine has its own model folders)."""
        transport = self.transport
        if transport is None or not models:
            return []
        return transport.missing_models(models)

    def describe(self) -> dict:
        """Kind, restarts and what the runtime reported when it was ready."""
        return {"kind": self.kind, "restarts": self.restarts, "ready": self.ready, **self.info}

    def start(self) -> None:
        """Start the runtime in the background (jobs wait for it to be ready)."""
        if self.transport is None:
            self.transport = self.make_transport()
            self.ready = False
            self.transport.start()

    def _discard(self, *, kill: bool) -> None:
        transport, self.transport, self.ready = self.transport, None, False
        if transport is not None:
            if kill:
                transport.kill()
            else:
                transport.stop(0.0)
            self.restarts += 1

    def _wait_ready(self, control: Any) -> bool:
        """Wait for WorkerReady; False when the job was interrupted meanwhile. A runtime that ends first
        is WorkerDied (the job never reached it), until MAX_BOOT_DEATHS in a row make it WorkerStartFailed."""
        while not self.ready:
            try:
                self._booting(self.transport.receive(POLL_S))
            except WorkerDied as exc:
                self._discard(kill=True)
                self.boot_deaths += 1
                if self.boot_deaths >= MAX_BOOT_DEATHS:
                    self.boot_deaths = 0
                    raise WorkerStartFailed(f"the job worker could not start: it ended {MAX_BOOT_DEATHS} times "
                                            f"before it was ready ({exc})") from None
                raise
            if not self.ready and control is not None and control.interrupted:
                return False
        return True

    def run(self, request: JobRequest, control: Any, *, validated: Any = None,
            handed_over: HandedOver | None = None) -> JobOutcome:
        """Send the job, relay its events, and return its outcome; kill the runtime if an interrupt is
        not honoured within the grace period (the next job starts a fresh one)."""
        self.start()
        if not self._wait_ready(control):
            return interrupted_outcome(request.prompt_id, "Interrupted", "interrupted before it started")
        transport = self.transport
        if handed_over is not None:
            handed_over()
        try:
            try:
                transport.send(RunJob(request))
            except WorkerDied:
                raise
            except Exception as exc:  # the job cannot be encoded for the worker (e.g. nested too deep to pickle)
                logger.warning("job %s could not be handed to worker %s: %s: %s", request.prompt_id, self.name,
                               type(exc).__name__, exc)
                return failure_outcome(request.prompt_id, exception_type=type(exc).__name__,
                                       message=f"the job could not be handed to its worker: {exc}")
            interrupt_sent_at: float | None = None
            while True:
                message = transport.receive(POLL_S)
                if isinstance(message, JobEvent):
                    self.events.emit(message.event, message.data)
                    continue
                if isinstance(message, JobResult):
                    return message.outcome
                if isinstance(message, WorkerFailure):
                    return failure_outcome(request.prompt_id, exception_type=message.exception_type,
                                           message=f"the worker could not read the job: {message.message}")
                if message is not None:
                    continue
                if control.interrupted and interrupt_sent_at is None:
                    transport.send(InterruptJob(request.prompt_id))
                    interrupt_sent_at = time.monotonic()
                elif interrupt_sent_at is not None and time.monotonic() - interrupt_sent_at > self.grace_s:
                    logger.warning("job %s: no check point reached %.1fs after the interrupt; killing its worker",
                                   request.prompt_id, self.grace_s)
                    self._discard(kill=True)
                    return interrupted_outcome(
                        request.prompt_id, "WorkerKilled",
                        f"the running node did not stop within {self.grace_s:g} s of the interrupt; its worker "
                        "process was stopped and restarted", killed=True)
        except WorkerDied:
            self._discard(kill=True)
            raise

    def free(self, unload_models: bool) -> None:
        """Ask the runtime to clear its caches (nothing to do when it has not started)."""
        if self.transport is None or not self.ready:
            return
        try:
            self.transport.send(FreeMemory(unload_models))
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                if isinstance(self.transport.receive(POLL_S), MemoryFreed):
                    return
        except WorkerDied:
            self._discard(kill=True)

    def stop(self, timeout: float = 30.0) -> None:
        """End the runtime."""
        transport, self.transport, self.ready = self.transport, None, False
        if transport is not None:
            transport.stop(timeout)


# ---------------------------------------------------------------------- a local process
class LocalProcessTransport(Transport):
    """A worker runtime in a child process (spawned, so it shares no locks or threads with the server)."""

    def __init__(self, recipe: RuntimeRecipe) -> None:
        self.recipe = recipe
        self.process = None
        self.connection = None

    def start(self) -> None:
        """Spawn the child; it builds its runtime from the recipe."""
        import multiprocessing

        from execution import isolation

        isolation.protect()  # the child imports Weft with this sys.path before any of its code runs
        context = multiprocessing.get_context("spawn")
        parent, child = context.Pipe(duplex=True)
        self.process = context.Process(target=serve_worker, args=(child, self.recipe), name="weft-job-worker")
        self.process.start()
        child.close()
        self.connection = parent

    def _died(self, reason: str) -> WorkerDied:
        code = self.process.exitcode if self.process is not None else None
        return WorkerDied(f"the job worker process {reason} (exit code {code})")

    def send(self, message: ToWorker) -> None:
        """Send one message down the pipe (pickled whole before any byte is written)."""
        try:
            self.connection.send(message)
        except (OSError, EOFError, ValueError):
            raise self._died("is gone") from None

    def receive(self, timeout: float) -> FromWorker | None:
        """The next message from the pipe, or None after `timeout`."""
        try:
            if self.connection.poll(timeout):
                return self.connection.recv()
        except (OSError, EOFError, ValueError):
            self.process.join(1.0)
            raise self._died("ended") from None
        if not self.process.is_alive():
            raise self._died("ended")
        return None

    def kill(self) -> None:
        """SIGKILL the child and reap it."""
        if self.process is not None and self.process.is_alive():
            self.process.kill()
        self._close()

    def stop(self, timeout: float) -> None:
        """Ask the child to end, then kill it after `timeout`."""
        if self.process is None:
            return
        try:
            self.connection.send(StopWorker())
        except (OSError, EOFError, ValueError):
            pass
        self.process.join(timeout)
        self.kill()

    def _close(self) -> None:
        if self.process is not None:
            self.process.join(5.0)
        if self.connection is not None:
            self.connection.close()
            self.connection = None


def _die_with_parent() -> None:
    """Linux: the kernel kills this process when the server's process dies (even by SIGKILL)."""
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class WorkerHost:
    """The worker's side (a child process or a Ray actor): reads messages, runs one job at a time on a thread."""

    def __init__(self, connection: Any, runtime: Any, *, info: dict | None = None) -> None:
        self.connection = connection
        self.runtime = runtime
        self.info = dict(info or {})  # more to say of itself in WorkerReady
        self.base = getattr(getattr(runtime, "paths", None), "base", None)
        self._send_lock = threading.Lock()
        self.control = None
        self.prompt_id: str | None = None
        runtime.events.subscribe(self._forward)
        _LogForwarder.install(self)

    def send(self, message: FromWorker) -> None:
        """Send to the server; the server being gone ends this process."""
        try:
            with self._send_lock:
                self.connection.send(message)
        except (OSError, EOFError, ValueError):
            os._exit(0)
        except (pickle.PicklingError, TypeError, AttributeError):
            if not isinstance(message, JobEvent):
                raise
            import json

            # An event carrying something that does not pickle: send what the websocket would show.
            self.send(JobEvent(message.event, json.loads(json.dumps(message.data, default=repr))))

    def _forward(self, event: str, data: dict) -> None:
        if event == "preview":
            try:
                encoded = encode_preview(data.get("image"))
            except Exception:  # a preview that cannot be encoded is skipped, never fails the job
                return
            if encoded is None:
                return
            data = dict(data, image=encoded)
        elif event == "execution_error" and self.base is not None:
            data = scrub_base(data, self.base)
        self.send(JobEvent(event, data))

    def _run(self, request: JobRequest) -> None:
        outcome = run_request(lambda prompt, targets: self.runtime.validate(prompt, partial_targets=targets),
                              self.runtime.executor.run, request, self.control, base=self.base)
        self.prompt_id = None
        self.send(JobResult(outcome))

    def serve(self) -> None:
        """Answer the server's messages until it says stop or goes away."""
        import socket

        from execution.scheduler import JobControl

        self.send(WorkerReady({"host": socket.gethostname(), "pid": os.getpid(), **self.info}))
        while True:
            try:
                message = self.connection.recv()
            except (OSError, EOFError):
                os._exit(0)  # the server is gone
            except Exception as exc:  # a message this side cannot decode: the job it carried ends with the reason
                logger.exception("a message from the server could not be read")
                self.send(WorkerFailure("job", type(exc).__name__, str(exc)))
                continue
            if isinstance(message, RunJob):
                request = message.request
                self.control, self.prompt_id = JobControl(), request.prompt_id
                threading.Thread(target=self._run, args=(request,), name="weft-job", daemon=True).start()
            elif isinstance(message, InterruptJob):
                if self.control is not None and self.prompt_id == message.prompt_id:
                    self.control.interrupt()
            elif isinstance(message, FreeMemory):
                self.runtime.executor.cache.clear()
                if message.unload_models and callable(getattr(self.runtime, "unload_models", None)):
                    self.runtime.unload_models()
                self.send(MemoryFreed())
            elif isinstance(message, StopWorker):
                return


class _LogForwarder(logging.Handler):
    """Sends the worker's log lines of a running job to the server as `log` events, where they join the
    server's log (its terminal and the editor's logs panel). Such a line is then left out of the worker's
    own stderr, so the terminal shows it once."""

    def __init__(self, host: "WorkerHost") -> None:
        super().__init__(level=logging.INFO)
        self.host = host
        self.setFormatter(logging.Formatter("%(message)s"))

    @classmethod
    def install(cls, host: "WorkerHost") -> None:
        root = logging.getLogger()
        root.handlers.insert(0, cls(host))  # first: it marks what the stream handlers after it skip
        for handler in root.handlers[1:]:
            handler.addFilter(lambda record: not getattr(record, "weft_forwarded", False))

    def emit(self, record: logging.LogRecord) -> None:
        prompt_id = self.host.prompt_id
        if prompt_id is None or record.name == "weft.worker":
            return
        try:
            message = self.format(record)
        except Exception:  # an unformattable record stays in the worker's own output
            return
        record.weft_forwarded = True
        self.host.send(JobEvent("log", {"prompt_id": prompt_id, "level": record.levelno, "name": record.name,
                                        "message": message}))


def start_failure(exc: BaseException) -> WorkerFailure:
    """What a runtime that could not be built tells the server before it ends."""
    return WorkerFailure("start", type(exc).__name__, str(exc))


def serve_worker(connection: Any, recipe: RuntimeRecipe) -> None:
    """The child process's entry point: build the runtime, then serve jobs over `connection`."""
    _die_with_parent()
    # Ctrl-C in the server's terminal reaches this process too (one process group). The server stops its
    # worker itself, and jobs are interrupted by message, so the key press must not end (or print from) it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from execution import isolation

    isolation.protect()  # packs the runtime loads here may reorder sys.path too
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s (worker): %(message)s")
    try:
        runtime = recipe.build()
    except BaseException as exc:
        logger.exception("the job worker could not build its runtime")
        try:
            connection.send(start_failure(exc))
        except (OSError, EOFError, ValueError):
            pass
        raise
    WorkerHost(connection, runtime).serve()
    connection.close()
