"""The job runner: hands the store's queued jobs to its workers and writes each job's one terminal record.

The runner knows its workers only through the `Worker` interface (`execution/worker.py`): a local
worker process, a Ray actor, or a group of ranks that run one job together all look the same here. A
dispatcher thread claims a job for an idle worker (with several, by the rule of
`execution/placement.py`); each worker has a thread that runs its job through it and writes the record.

An attempt counts when the job goes to a ready worker (`Worker.run` calls `handed_over` just before it
sends the job), not when it is claimed: a worker killed while it boots, or a server killed while the job
waited for one, cost the job no attempt. A job that cannot be handed over at all (it does not pickle, its input files are gone) ends
with an error record at once instead of staying `running`.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from execution.failure import ERROR, INTERRUPTED, failure_payload
from execution.job_store import Job, JobState, JobStore
from execution.paths import commit_staged, settle_staged, staging_token
from execution.worker import (InProcessWorker, JobRequest, Worker, WorkerDied, WorkerStartFailed, failure_outcome)

logger = logging.getLogger(__name__)


@dataclass
class RunningJob:
    """A job a worker is running now."""

    job: Job
    control: Any
    stop_for_shutdown: bool = False


@dataclass
class JobHooks:
    """How the runner reaches the engine and tells the server what changed (called on the runner's threads)."""

    validate: Callable[[dict, list[str] | None], Any]  # (prompt, partial targets) -> validated prompt
    run: Callable[..., Any]  # Executor.run(validated, prompt_id=, extra_data=, control=) -> JobResult
    make_control: Callable[[], Any]  # a fresh JobControl
    on_start: Callable[[Job], None] = lambda job: None
    # After the terminal record is written (status "requeued": the job went back to the queue).
    on_finish: Callable[[Job, str], None] = lambda job, status: None
    on_queue_change: Callable[[], None] = lambda: None
    emit: Callable[[str, dict], None] = lambda event, data: None  # the event stream, for records the runner writes
    free: Callable[[bool], None] | None = None  # in-process: clear caches (unload models when True)
    # With several workers: the files a job names (execution.placement.NamedFiles) and the model files'
    # sizes, for the choice of worker. None: every worker can run every job, and none holds anything.
    files_of: Callable[[Job], Any] | None = None
    model_sizes: Callable[[Any], dict] | None = None


@dataclass
class WorkerSlot:
    """One worker of the runner, the job it holds and the dispatcher's account of its models."""

    index: int
    worker: Worker
    assigned: Job | None = None  # handed over, running or about to
    running: RunningJob | None = None
    files: Any = None  # the assigned job's NamedFiles
    held: dict = field(default_factory=dict)  # (model folder, name) -> bytes: models it loaded
    jobs_run: int = 0
    thread: threading.Thread | None = None

    @property
    def name(self) -> str:
        """The worker's name in records and /system_stats."""
        return self.worker.name or f"worker-{self.index}"


PENDING_LOOKAHEAD = 32  # pending jobs the dispatcher considers when the first cannot run on an idle worker


class JobRunner:
    """Hands queued jobs to its workers, one job per worker at a time; every job ends in its one
    terminal record. Without workers given, jobs run in this process through the hooks' functions.

    A dispatcher thread claims jobs and gives each to an idle worker (with several, by the rule of
    `execution.placement`); each worker has a thread that runs its job through it. A job's outputs
    are staged under its token and given their final names after its record is written
    (`execution.paths`); after a process died, `settle_staged` finishes or removes them, leaving the
    staged files of jobs other workers are still running."""

    def __init__(self, store: JobStore, hooks: JobHooks, *, worker: Worker | None = None,
                 workers: Sequence[Worker] | None = None, output_folders: tuple[Path, ...] = ()) -> None:
        self.store = store
        self.hooks = hooks
        chosen = list(workers) if workers else [worker or InProcessWorker(hooks.validate, hooks.run, free=hooks.free)]
        for given in chosen:
            if not isinstance(given, Worker):
                raise TypeError(f"a job runner's workers implement execution.worker.Worker; got {type(given).__name__}")
        self.slots = [WorkerSlot(index, w) for index, w in enumerate(chosen)]
        self.output_folders = tuple(output_folders)
        self._validated: dict[str, Any] = {}  # prompt id -> validated prompt, for jobs accepted by this process
        self._died_on: dict[str, int] = {}  # prompt id -> the slot its last attempt died on
        self._wake = threading.Condition()
        self._stopping = False
        self._between_jobs: list[Callable[[], None]] = []
        self._thread: threading.Thread | None = None
        self.idle = threading.Event()
        self.idle.set()

    @property
    def worker(self) -> Worker:
        """The first (with one worker, the only) worker."""
        return self.slots[0].worker

    @property
    def current(self) -> RunningJob | None:
        """A running job (the running one, with one worker); None when none runs."""
        return next((s.running for s in self.slots if s.running is not None), None)

    def running(self) -> list[RunningJob]:
        """Every job a worker is running now."""
        return [s.running for s in self.slots if s.running is not None]

    # ------------------------------------------------------------------ control
    def start(self) -> dict[str, list[str]]:
        """Settle the outputs a crash left, recover the jobs it left running, then start the runner's threads."""
        # Settle first: a job still `running` here was cut short, so its files go, while the job that got
        # its record just before the crash keeps them (recover would make the former terminal too).
        self._settle_outputs()
        report = self.store.recover()
        if report["retried"] or report["interrupted"]:
            logger.warning("after a restart: %d job(s) retried, %d marked interrupted",
                           len(report["retried"]), len(report["interrupted"]))
        for slot in self.slots:
            slot.thread = threading.Thread(target=self._serve_slot, args=(slot,), name=f"weft-job-{slot.name}",
                                           daemon=True)
            slot.thread.start()
        self._thread = threading.Thread(target=self._loop, name="weft-job-runner", daemon=True)
        self._thread.start()
        return report

    def stop(self, timeout: float = 30.0) -> None:
        """Stop after the current jobs; a job cut short by the stop goes back to the queue."""
        with self._wake:
            self._stopping = True
            for slot in self.slots:
                if slot.running is not None:
                    slot.running.stop_for_shutdown = True
                    slot.running.control.interrupt()
            self._wake.notify_all()
        deadline = time.monotonic() + timeout
        for thread in [self._thread, *(s.thread for s in self.slots)]:
            if thread is not None:
                thread.join(max(0.0, deadline - time.monotonic()))
        for slot in self.slots:
            slot.worker.stop(timeout=5.0)

    def submitted(self, prompt_id: str, validated: Any) -> None:
        """A job was accepted by this process: keep its validated prompt and wake the runner."""
        with self._wake:
            self._validated[prompt_id] = validated
            self._wake.notify_all()

    def wake(self) -> None:
        """Wake the runner to look at the queue."""
        with self._wake:
            self._wake.notify_all()

    def interrupt(self, prompt_id: str | None = None) -> bool:
        """Interrupt the running job `prompt_id` (every running job when None); False when none was."""
        hit = False
        for running in self.running():
            if prompt_id is None or running.job.id == prompt_id:
                running.control.interrupt()
                hit = True
        return hit

    def cancel(self, prompt_ids: Iterable[str]) -> list[str]:
        """Cancel jobs: pending ones get their record now, running ones are interrupted."""
        ids = [str(i) for i in prompt_ids]
        cancelled = self.store.cancel_pending(ids)
        for prompt_id in cancelled:
            self._validated.pop(prompt_id, None)
        for prompt_id in ids:
            if prompt_id not in cancelled and self.interrupt(prompt_id):
                cancelled.append(prompt_id)
        if cancelled:
            self.hooks.on_queue_change()
        return cancelled

    def between_jobs(self, action: Callable[[], None]) -> None:
        """Run `action` on the runner's thread when no job runs (freeing memory, clearing caches)."""
        with self._wake:
            self._between_jobs.append(action)
            self._wake.notify_all()

    def free(self, *, unload_models: bool) -> None:
        """Between jobs: clear every worker's output cache (and unload its models when asked)."""
        def free_all() -> None:
            for slot in self.slots:
                slot.worker.free(unload_models)
                if unload_models:
                    slot.held.clear()
        self.between_jobs(free_all)

    def describe_workers(self) -> list[dict]:
        """Each worker: name, what it runs, jobs run, restarts, models held, and what the worker says of itself."""
        rows = []
        for slot in self.slots:
            running = slot.running
            row = dict(slot.worker.describe())
            row.update({"name": slot.name, "state": "running" if running is not None else "idle",
                        "prompt_id": running.job.id if running is not None else None, "jobs_run": slot.jobs_run,
                        "models_held": sorted(f"{folder}/{name}" for folder, name in slot.held)})
            rows.append(row)
        return rows

    # ------------------------------------------------------------------ the dispatcher
    def _all_idle(self) -> bool:
        return all(s.assigned is None for s in self.slots)

    def _loop(self) -> None:
        for slot in self.slots:
            try:
                slot.worker.start()
            except Exception:  # a worker that cannot start fails its jobs one by one, with the reason
                logger.exception("the job worker %s did not start", slot.name)
        while True:
            with self._wake:
                if self._stopping:
                    self._wake.notify_all()
                    return
                waiting_actions = bool(self._between_jobs)
                ready_for_actions = waiting_actions and self._all_idle()
                if ready_for_actions:
                    actions, self._between_jobs = self._between_jobs, []
            if waiting_actions:
                if not ready_for_actions:  # no new job starts until every worker is free for them
                    with self._wake:
                        self._wake.wait(timeout=1.0)
                    continue
                for action in actions:
                    try:
                        action()
                    except Exception:  # a failing housekeeping action must not stop the queue
                        logger.exception("between-jobs action failed")
                continue
            idle = [s for s in self.slots if s.assigned is None]
            dispatched = False
            if idle:
                try:
                    dispatched = self._dispatch(idle)
                except Exception:  # the store itself failed: log it and keep serving
                    logger.exception("the dispatcher failed")
            if dispatched:
                continue
            self._read_boot_messages(idle)
            with self._wake:
                if self._all_idle():
                    self.idle.set()
                if not self._stopping and not self._between_jobs:
                    self._wake.wait(timeout=1.0)

    def _assign(self, slot: WorkerSlot, job: Job, files: Any) -> None:
        self.idle.clear()
        with self._wake:
            slot.assigned, slot.files = job, files
            self._wake.notify_all()

    def _dispatch(self, idle: list[WorkerSlot]) -> bool:
        """Hand one pending job to an idle worker; False when none can be handed over now."""
        if len(self.slots) == 1 or self.hooks.files_of is None:
            job = self.store.claim_next(worker=idle[0].name)
            if job is None:
                return False
            self._assign(idle[0], job, None)
            return True
        from execution.placement import Candidate, NamedFiles, choose

        for job in self._pending_in_order():
            try:
                files = self.hooks.files_of(job)
            except Exception:  # a prompt this server cannot read: the worker reports its error
                logger.exception("job %s: the files it names could not be listed", job.id)
                files = NamedFiles()
            candidates = [Candidate(s.index, self._is_ready(s), s.held,
                                    tuple(self._missing(s, files.models)), self._died_on.get(job.id) == s.index)
                          for s in idle]
            picked = choose(candidates, files.models)
            if picked is None:
                busy = [s for s in self.slots if s.assigned is not None]
                if any(not self._missing(s, files.models) for s in busy):
                    continue  # a busy worker has the files: the job waits for it, later jobs may go first
                claimed = self.store.claim(job.id, worker=None)
                if claimed is not None:
                    self._fail_unplaceable(claimed, candidates[0].missing[0])
                return True
            slot = self.slots[picked.index]
            claimed = self.store.claim(job.id, worker=slot.name)
            if claimed is None:  # cancelled meanwhile
                return True
            self._assign(slot, claimed, files)
            return True
        return False

    def _pending_in_order(self):
        """Pending jobs in queue order: the first alone, then the next few only if it had to wait."""
        yield from self.store.pending(1)
        yield from self.store.pending(PENDING_LOOKAHEAD)[1:]

    @staticmethod
    def _is_ready(slot: WorkerSlot) -> bool:
        return slot.worker.is_ready()

    def _read_boot_messages(self, idle: list[WorkerSlot]) -> None:
        """Ask each idle worker that is still starting whether it is ready, so a worker started with the
        server reports ready (in /system_stats) as soon as it is, not when the first job reaches it. Only
        this thread asks an idle worker; a busy one is read by its own slot's thread."""
        for slot in idle:
            try:
                self._is_ready(slot)
            except Exception:  # a worker that cannot answer is asked again on the next pass
                logger.exception("worker %s: could not read whether it is ready", slot.name)

    @staticmethod
    def _missing(slot: WorkerSlot, models: Any) -> list:
        if not models:
            return []
        try:
            return list(slot.worker.missing_models(models))
        except Exception:  # a worker that cannot answer cannot be chosen for this job
            logger.exception("worker %s: could not list its model files", slot.name)
            return list(models)

    def _fail_unplaceable(self, job: Job, missing: tuple[str, str]) -> None:
        """The record of a job no worker of the pool can run: it names a model file none of them has."""
        folder, name = missing
        exc = FileNotFoundError(f"model file {name!r} (models/{folder}) is on the server but on none of its "
                                f"{len(self.slots)} workers; copy it to the same folder on a worker's machine")
        outcome = failure_outcome(job.id, exc)
        self._validated.pop(job.id, None)
        self.hooks.on_start(job)
        self.hooks.emit(ERROR, outcome.error)
        self.hooks.emit("executing", {"node": None, "display_node": None, "prompt_id": job.id})
        self.store.finish(job.id, JobState.ERROR, messages=outcome.messages, error=outcome.error)
        self.hooks.on_finish(job, JobState.ERROR)
        self.hooks.on_queue_change()

    # ------------------------------------------------------------------ a worker's thread
    def _serve_slot(self, slot: WorkerSlot) -> None:
        while True:
            with self._wake:
                while slot.assigned is None and not self._stopping:
                    self._wake.wait()
                job = slot.assigned
                if job is None:
                    return
            try:
                self._run(job, slot)
            except Exception:  # the store itself failed: log it and keep serving
                logger.exception("job %s: the runner failed", job.id)
            with self._wake:
                slot.assigned, slot.running, slot.files = None, None, None
                self._wake.notify_all()

    def _settle_outputs(self, dropping: str | None = None) -> None:
        """Finish or remove outputs a dead process left under staging names: those of `dropping` (the
        attempt that just died) go, those of the other workers' jobs stay until their records."""
        if not self.output_folders:
            return
        committed = {staging_token(i) for i in self.store.recent_terminal_ids()}
        with self._wake:
            others = {staging_token(s.assigned.id) for s in self.slots
                      if s.assigned is not None and s.assigned.id != dropping}
        report = settle_staged(self.output_folders, committed, keep=others)
        if report["committed"] or report["removed"]:
            logger.info("outputs left by a stopped job: %d given their names, %d removed",
                        report["committed"], report["removed"])

    def _announce_interrupted(self, job: Job) -> None:
        record = self.store.get(job.id)
        error = dict(record.error, prompt_id=job.id) if record and record.error else failure_payload(INTERRUPTED, job.id)
        self.hooks.emit(INTERRUPTED, error)
        self.hooks.emit("executing", {"node": None, "display_node": None, "prompt_id": job.id})

    def _run(self, job: Job, slot: WorkerSlot) -> None:
        control = self.hooks.make_control()
        running = RunningJob(job, control)
        with self._wake:
            slot.running = running
            if self._stopping:
                running.stop_for_shutdown = True
                control.interrupt()
        self.hooks.on_start(job)
        self.hooks.on_queue_change()
        request = JobRequest(job.id, job.prompt, job.partial_targets, job.extra_data,
                             staging_token(job.id) if self.output_folders else None)
        handed = False

        def handed_over() -> None:
            nonlocal handed
            handed = True
            self.store.begin_attempt(job.id)

        try:
            outcome = slot.worker.run(request, control, validated=self._validated.pop(job.id, None),
                                      handed_over=handed_over)
        except WorkerDied as exc:
            self._worker_died(job, slot, exc, handed)
            return
        except WorkerStartFailed as exc:
            outcome = failure_outcome(job.id, exc)
        except Exception as exc:  # the worker failed to hand over or run the job: the job still gets its record
            logger.exception("job %s on %s: the worker failed", job.id, slot.name)
            if handed:  # it may still be running there: start that worker afresh
                slot.worker.stop(timeout=0.0)
                self._restart(slot)
            outcome = failure_outcome(job.id, exc)
        self._record(job, slot, running, outcome, handed)

    def _worker_died(self, job: Job, slot: WorkerSlot, exc: WorkerDied, handed: bool) -> None:
        """The crash rule: a job that had gone to the worker is started again once (elsewhere when it
        can), then recorded interrupted; one still waiting for it to boot goes back to the queue without
        an attempt."""
        with self._wake:
            slot.running = None
        slot.held.clear()
        self._died_on[job.id] = slot.index
        logger.warning("job %s on %s: %s", job.id, slot.name, exc)
        if not handed:
            released = "retried" if self.store.requeue(job.id, counted=False) else None
        else:
            self._settle_outputs(dropping=job.id)
            released = self.store.release_crashed(job.id, cause="its worker process died", exception_type="WorkerDied")
        if released == "interrupted":
            self._died_on.pop(job.id, None)
            self._announce_interrupted(job)
        self.hooks.on_finish(job, "requeued" if released == "retried" else JobState.INTERRUPTED)
        self.hooks.on_queue_change()
        self._restart(slot)

    def _record(self, job: Job, slot: WorkerSlot, running: RunningJob, outcome: Any, handed: bool) -> None:
        """Write the terminal record of a job its worker returned (or requeue one a shutdown cut short)."""
        with self._wake:
            slot.running = None
        self._died_on.pop(job.id, None)
        if outcome.killed:
            slot.held.clear()
            self._settle_outputs(dropping=job.id)  # the killed attempt's files go
        if running.stop_for_shutdown and outcome.status == "interrupted" \
                and self.store.requeue(job.id, counted=handed):
            for staged, _ in outcome.staged:  # it runs again from the start
                Path(staged).unlink(missing_ok=True)
            self.hooks.on_finish(job, "requeued")
            return
        if outcome.killed:
            status = JobState.INTERRUPTED
        else:
            status = {"success": JobState.SUCCESS, "interrupted": JobState.CANCELLED}.get(outcome.status,
                                                                                          JobState.ERROR)
        profile = {"worker": slot.name, "nodes": outcome.profile}  # the profile table names who ran it
        ranks = slot.worker.describe().get("rank_processes")
        if ranks:  # a rank group ran it: which ranks (rank 0's nodes are the profile)
            profile["ranks"] = ranks
        recorded = self.store.finish(job.id, status, outputs=outcome.outputs,
                                     messages=[list(m) for m in outcome.messages], meta=outcome.meta,
                                     error=outcome.error, profile=profile)
        if recorded:
            commit_staged(outcome.staged)
        slot.jobs_run += 1
        if not outcome.killed and slot.files is not None and slot.files.models and self.hooks.model_sizes:
            slot.held.update(self.hooks.model_sizes(slot.files.models))
        if outcome.killed:
            self._announce_interrupted(job)
            self._restart(slot)
        self.hooks.on_finish(job, status)
        self.hooks.on_queue_change()

    @staticmethod
    def _restart(slot: WorkerSlot) -> None:
        """Start a dead or killed worker again now, so it is up before its next job."""
        try:
            slot.worker.start()
        except Exception:
            logger.exception("the job worker %s did not restart", slot.name)
