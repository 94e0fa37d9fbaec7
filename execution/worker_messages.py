"""The messages between the job runner's side and a worker's runtime: one typed set for every worker kind.

A local worker process (a pipe), a Ray actor (a call in, a streaming generator out) and a rank group
(rank 0 speaking for the group) all carry these, pickled, between Weft's own processes; no file or
network input is ever in a pickle (a job's prompt arrived as JSON and was validated first).

    to the worker      RunJob | InterruptJob | FreeMemory | StopWorker
    from the worker    WorkerReady | JobEvent | OutputFiles | JobResult | MemoryFreed | WorkerFailure

A worker answers a RunJob with JobEvents, then one JobResult (or, when it could not even read the job,
one WorkerFailure). A worker on another machine sends the files a job wrote as OutputFiles before the
event or result that names them; a local worker writes them into the shared folders itself.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class JobRequest:
    """What a worker needs to run one job."""

    prompt_id: str
    prompt: dict
    partial_targets: list[str] | None = None
    extra_data: dict = field(default_factory=dict)
    staging_token: str | None = None  # None: outputs are written under their final names at once


@dataclass
class JobOutcome:
    """How one attempt of a job ended."""

    status: str  # success | error | interrupted
    outputs: dict = field(default_factory=dict)
    messages: list = field(default_factory=list)
    meta: dict = field(default_factory=dict)
    error: dict | None = None
    staged: list = field(default_factory=list)  # (staging path, final path) of the files it wrote
    killed: bool = False  # the worker was killed after the grace period: the node never stopped
    profile: dict = field(default_factory=dict)  # per node: class_type, wall_ms, cpu_ms, ... (execution.profile)


# ---------------------------------------------------------------------- to the worker
@dataclass(frozen=True)
class RunJob:
    """Run this job (the worker holds one at a time)."""

    request: JobRequest


@dataclass(frozen=True)
class InterruptJob:
    """Stop the job `prompt_id` at its next check point (ignored when it is not the running one)."""

    prompt_id: str


@dataclass(frozen=True)
class FreeMemory:
    """Between jobs: clear the output cache, and unload the models when asked; answered by MemoryFreed."""

    unload_models: bool


@dataclass(frozen=True)
class StopWorker:
    """End the runtime."""


# ---------------------------------------------------------------------- from the worker
@dataclass(frozen=True)
class WorkerReady:
    """The runtime is built and takes jobs; `info` is what /system_stats shows of it (host, pid, devices)."""

    info: dict = field(default_factory=dict)


@dataclass(frozen=True)
class JobEvent:
    """One event of the running job, for the server's event stream (`executing`, `progress`, ...)."""

    event: str
    data: dict


@dataclass(frozen=True)
class OutputFile:
    """A file the job wrote on a machine that does not share the server's folders."""

    kind: str  # the folder: output | temp
    relative: str  # its name under that folder, as the job's events and outputs name it
    data: bytes


@dataclass(frozen=True)
class OutputFiles:
    """Files the job wrote, sent before the event or result that names them."""

    files: list[OutputFile]


@dataclass(frozen=True)
class JobResult:
    """The job's outcome; the last message of a job."""

    outcome: JobOutcome


@dataclass(frozen=True)
class MemoryFreed:
    """The answer to FreeMemory."""


@dataclass(frozen=True)
class WorkerFailure:
    """The worker could not do what it was asked: build its runtime (`stage` "start", sent before it
    ends) or read a job it was sent (`stage` "job": the job ends with this error)."""

    stage: str  # start | job
    exception_type: str
    message: str


ToWorker = RunJob | InterruptJob | FreeMemory | StopWorker
FromWorker = WorkerReady | JobEvent | OutputFiles | JobResult | MemoryFreed | WorkerFailure
