"""The durable job queue and history (SQLite in WAL mode under the user directory), and its worker.

One table holds every accepted job from acceptance to its terminal record:

    pending   accepted (committed before the HTTP 200), waiting to run
    running   claimed by the worker; `attempts` counts how many times it was started
    success | error | cancelled | interrupted   terminal: written once, never overwritten

Every state change is one `UPDATE ... WHERE status = <expected>` in its own transaction, so a job has
exactly one terminal record whatever happens: a job found `running` at start-up was cut short by a
crash; it goes back to `pending` once (`attempts` < MAX_ATTEMPTS) and is marked `interrupted` the next
time, so a job that kills the process is never replayed forever. History is capped: past
`history_cap` terminal records the oldest are deleted first. The store never imports torch or nodes.
"""
from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Callable, Iterable

logger = logging.getLogger(__name__)

class JobState(StrEnum):
    """A job's state in the store; the values are what the database and the wire hold."""

    PENDING = "pending"
    RUNNING = "running"
    SUCCESS = "success"
    ERROR = "error"
    CANCELLED = "cancelled"
    INTERRUPTED = "interrupted"


TERMINAL = (JobState.SUCCESS, JobState.ERROR, JobState.CANCELLED, JobState.INTERRUPTED)
ACTIVE = (JobState.PENDING, JobState.RUNNING)
MAX_ATTEMPTS = 2  # a job running at a crash is started at most this many times in all
DEFAULT_HISTORY_CAP = 10_000  # terminal records kept; the oldest go first

# The jobs interface's status names (what the editor's queue and history panels show).
API_STATUS = {"pending": "pending", "running": "in_progress", "success": "completed", "error": "failed",
              "cancelled": "cancelled", "interrupted": "failed"}
API_TO_STORE = {"pending": ("pending",), "in_progress": ("running",), "completed": ("success",),
                "failed": ("error", "interrupted"), "cancelled": ("cancelled",)}

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    number REAL NOT NULL,
    status TEXT NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    client_id TEXT,
    prompt TEXT NOT NULL,
    extra_data TEXT NOT NULL,
    outputs_to_execute TEXT NOT NULL,
    partial_targets TEXT,
    create_time INTEGER NOT NULL,
    start_time INTEGER,
    end_time INTEGER,
    outputs TEXT,
    messages TEXT,
    meta TEXT,
    error TEXT,
    worker TEXT,
    profile TEXT
);
CREATE INDEX IF NOT EXISTS jobs_status ON jobs (status, number, seq);
CREATE INDEX IF NOT EXISTS jobs_end ON jobs (end_time, seq);
"""

_COLUMNS = ("seq", "id", "number", "status", "attempts", "client_id", "prompt", "extra_data",
            "outputs_to_execute", "partial_targets", "create_time", "start_time", "end_time", "outputs",
            "messages", "meta", "error", "worker", "profile")
_JSON_COLUMNS = ("prompt", "extra_data", "outputs_to_execute", "partial_targets", "outputs", "messages", "meta",
                 "error", "profile")
_ADDED_COLUMNS = (("worker", "TEXT"), ("profile", "TEXT"))  # columns a store written by an older Weft lacks


def now_ms() -> int:
    """Milliseconds since the epoch (the timestamps of the protocol)."""
    return int(time.time() * 1000)


@dataclass
class Job:
    """One row of the store, JSON columns decoded."""

    seq: int
    id: str
    number: float
    status: JobState
    attempts: int
    client_id: str | None
    prompt: dict
    extra_data: dict
    outputs_to_execute: list[str]
    partial_targets: list[str] | None
    create_time: int
    start_time: int | None = None
    end_time: int | None = None
    outputs: dict | None = None
    messages: list | None = None
    meta: dict | None = None
    error: dict | None = None
    worker: str | None = None  # the worker it was handed to (the last attempt's)
    profile: dict | None = None  # per node: class_type, wall_ms, cpu_ms, ... (execution.profile)

    @property
    def terminal(self) -> bool:
        """Has the job its terminal record?"""
        return self.status in TERMINAL

    @property
    def api_status(self) -> str:
        """The status name of the jobs interface."""
        return API_STATUS[self.status]

    def queue_item(self) -> list:
        """ComfyUI's queue entry: [number, prompt_id, prompt, extra_data, outputs_to_execute]."""
        number = int(self.number) if float(self.number).is_integer() else self.number
        return [number, self.id, self.prompt, self.extra_data, self.outputs_to_execute]

    def history_record(self) -> dict:
        """ComfyUI's history entry for this (terminal) job."""
        messages = [list(m) for m in (self.messages or [])]
        if self.status == "interrupted" and not any(m[0] == "execution_interrupted" for m in messages):
            messages.append(["execution_interrupted", dict(self.error or {}, prompt_id=self.id)])
        return {
            "prompt": self.queue_item(),
            "outputs": self.outputs or {},
            "status": {"status_str": "success" if self.status == "success" else "error",
                       "completed": self.status == "success", "messages": messages},
            "meta": self.meta or {},
        }


def _row_to_job(row: sqlite3.Row | tuple) -> Job:
    values = dict(zip(_COLUMNS, row))
    for name in _JSON_COLUMNS:
        if values[name] is not None:
            values[name] = json.loads(values[name])
    values["status"] = JobState(values["status"])
    return Job(**values)


@dataclass
class _PendingInsert:
    """One accepted job waiting for the group commit that writes it."""

    row: tuple
    done: bool = False
    seq: int = 0
    error: Exception | None = None


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), default=repr)


class JobStore:
    """Every accepted job and its history record, in one SQLite file (WAL, synchronous=FULL)."""

    def __init__(self, path: str | Path, *, history_cap: int = DEFAULT_HISTORY_CAP) -> None:
        if history_cap < 1:
            raise ValueError(f"history_cap must be at least 1, got {history_cap}")
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.history_cap = history_cap
        self._lock = threading.Lock()
        self._group = threading.Condition()  # group commit of accepted jobs (see add)
        self._queued: list[_PendingInsert] = []
        self._committing = False
        self._db = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None, timeout=30)
        self._db.execute("PRAGMA journal_mode=WAL")
        # FULL: an accepted job's commit is fsynced before it returns, so it survives power loss, not only
        # a killed process.
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)
        present = {row[1] for row in self._db.execute("PRAGMA table_info(jobs)").fetchall()}
        for name, kind in _ADDED_COLUMNS:
            if name not in present:
                self._db.execute(f"ALTER TABLE jobs ADD COLUMN {name} {kind}")
        self._number = self._max_number()

    def close(self) -> None:
        """Close the database connection."""
        with self._lock:
            self._db.close()

    # ------------------------------------------------------------------ helpers
    def _max_number(self) -> float:
        row = self._db.execute("SELECT MAX(number) FROM jobs").fetchone()
        return float(row[0]) if row and row[0] is not None else 0.0

    def _write(self, sql: str, params: Iterable[Any] = ()) -> int:
        """One statement in its own committed transaction; returns the rows changed.

        Worker-side changes (start, finish, cancel) commit without their own fsync: they survive a
        process crash at once, and the next accepted job's fsync (or a checkpoint) makes them survive
        power loss too. Only accepting a job waits for the disk."""
        with self._lock:
            self._db.execute("PRAGMA synchronous=NORMAL")
            try:
                cursor = self._db.execute(sql, tuple(params))
                return cursor.rowcount
            finally:
                self._db.execute("PRAGMA synchronous=FULL")

    def _select(self, sql: str, params: Iterable[Any] = ()) -> list[Job]:
        with self._lock:
            rows = self._db.execute(sql, tuple(params)).fetchall()
        return [_row_to_job(r) for r in rows]

    # ------------------------------------------------------------------ accepting
    def next_number(self, *, front: bool = False) -> float:
        """ComfyUI's queue number: increasing, or below every pending job when `front` is asked."""
        with self._lock:
            if front:
                row = self._db.execute("SELECT MIN(number) FROM jobs WHERE status='pending'").fetchone()
                low = row[0] if row and row[0] is not None else self._number
                return min(float(low), 0.0) - 1.0
            self._number += 1
            return self._number

    def add(self, prompt_id: str, prompt: dict, *, number: float, client_id: str | None = None,
            extra_data: dict | None = None, outputs_to_execute: list[str] | None = None,
            partial_targets: list[str] | None = None) -> Job:
        """Accept a job: committed (and fsynced) before this returns. A duplicate id raises ValueError.

        Concurrent callers share commits (group commit): whoever finds no commit running writes every
        job queued so far in one transaction, so fifty clients cost a few fsyncs, not fifty."""
        created = now_ms()
        extra = dict(extra_data or {})
        extra.setdefault("create_time", created)
        if client_id is not None:
            extra["client_id"] = client_id
        row = (prompt_id, float(number), client_id, _dumps(prompt), _dumps(extra), _dumps(outputs_to_execute or []),
               None if partial_targets is None else _dumps(partial_targets), created)
        pending = _PendingInsert(row)
        with self._group:
            self._queued.append(pending)
            while not pending.done:
                if self._committing:
                    self._group.wait()
                    continue
                self._committing = True
                batch, self._queued = self._queued, []
                self._group.release()
                try:
                    self._insert(batch)
                finally:
                    self._group.acquire()
                    self._committing = False
                    for item in batch:
                        item.done = True
                    self._group.notify_all()
        if pending.error is not None:
            raise pending.error
        return Job(pending.seq, prompt_id, float(number), JobState.PENDING, 0, client_id, prompt, extra,
                   list(outputs_to_execute or []), partial_targets, created)

    def _insert(self, batch: list["_PendingInsert"]) -> None:
        try:
            with self._lock:
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    for item in batch:
                        cursor = self._db.execute(
                            "INSERT OR IGNORE INTO jobs (id, number, status, attempts, client_id, prompt, extra_data, "
                            "outputs_to_execute, partial_targets, create_time) VALUES (?, ?, 'pending', 0, ?, ?, ?, ?, ?, ?)",
                            item.row)
                        if cursor.rowcount == 0:
                            item.error = ValueError(f"prompt_id {item.row[0]!r} was already used by another job")
                        else:
                            item.seq = cursor.lastrowid
                            self._number = max(self._number, item.row[1])
                    self._db.execute("COMMIT")
                except BaseException:
                    self._db.execute("ROLLBACK")
                    raise
        except Exception as exc:  # the disk failed: nobody in this batch was accepted
            for item in batch:
                item.error = item.error or exc

    # ------------------------------------------------------------------ the worker's side
    def claim_next(self, *, worker: str | None = None) -> Job | None:
        """Mark the first pending job running (one more attempt, handed to `worker`) and return it;
        None when none waits."""
        with self._lock:
            row = self._db.execute(
                "SELECT seq FROM jobs WHERE status='pending' ORDER BY number, seq LIMIT 1").fetchone()
            if row is None:
                return None
            return self._claim_seq(row[0], worker)

    def claim(self, prompt_id: str, *, worker: str | None = None) -> Job | None:
        """Mark one pending job running, handed to `worker`; None when it is no longer pending."""
        with self._lock:
            row = self._db.execute("SELECT seq FROM jobs WHERE id=? AND status='pending'", (prompt_id,)).fetchone()
            return None if row is None else self._claim_seq(row[0], worker)

    def _claim_seq(self, seq: int, worker: str | None) -> Job | None:
        """(Under the lock.) The claim itself: one conditional UPDATE, so a job is handed over once."""
        self._db.execute("PRAGMA synchronous=NORMAL")  # see _write
        try:
            changed = self._db.execute("UPDATE jobs SET status='running', attempts=attempts+1, start_time=?, worker=? "
                                       "WHERE seq=? AND status='pending'", (now_ms(), worker, seq)).rowcount
        finally:
            self._db.execute("PRAGMA synchronous=FULL")
        if not changed:
            return None
        job = self._db.execute(f"SELECT {', '.join(_COLUMNS)} FROM jobs WHERE seq=?", (seq,)).fetchone()
        return _row_to_job(job)

    def pending(self, limit: int) -> list[Job]:
        """The first `limit` pending jobs in queue order."""
        return self._select(f"SELECT {', '.join(_COLUMNS)} FROM jobs WHERE status='pending' ORDER BY number, seq "
                            "LIMIT ?", (max(0, int(limit)),))

    def finish(self, prompt_id: str, status: str, *, outputs: dict | None = None, messages: list | None = None,
               meta: dict | None = None, error: dict | None = None, profile: dict | None = None) -> bool:
        """Write a running job's terminal record; False when it was not running (no second record)."""
        if status not in TERMINAL:
            raise ValueError(f"terminal status must be one of {TERMINAL}, got {status!r}")
        changed = self._write(
            "UPDATE jobs SET status=?, end_time=?, outputs=?, messages=?, meta=?, error=?, profile=? "
            "WHERE id=? AND status='running'",
            (status, now_ms(), _dumps(outputs or {}), _dumps(messages or []), _dumps(meta or {}),
             None if error is None else _dumps(error), None if profile is None else _dumps(profile), prompt_id))
        if changed:
            self._prune()
        return bool(changed)

    def requeue(self, prompt_id: str) -> bool:
        """Put a running job back in the queue without counting the attempt (a clean shutdown stopped it)."""
        return bool(self._write("UPDATE jobs SET status='pending', attempts=MAX(attempts-1, 0), start_time=NULL "
                                "WHERE id=? AND status='running'", (prompt_id,)))

    def recover(self) -> dict[str, list[str]]:
        """After a crash: jobs left running go back to pending once, then are marked interrupted."""
        with self._lock:
            rows = self._db.execute("SELECT id FROM jobs WHERE status='running'").fetchall()
        report: dict[str, list[str]] = {"retried": [], "interrupted": []}
        for (prompt_id,) in rows:
            outcome = self.release_crashed(prompt_id, prune=False)
            if outcome is not None:
                report[outcome].append(prompt_id)
        if report["interrupted"]:
            self._prune()
        return report

    def release_crashed(self, prompt_id: str, *, prune: bool = True, cause: str = "the server stopped") -> str | None:
        """A running job whose process died: back to pending if it has attempts left ("retried"), else
        its `interrupted` record ("interrupted"); None when it was not running."""
        with self._lock:
            row = self._db.execute("SELECT attempts FROM jobs WHERE id=? AND status='running'", (prompt_id,)).fetchone()
        if row is None:
            return None
        attempts = row[0]
        if attempts < MAX_ATTEMPTS:
            if self._write("UPDATE jobs SET status='pending', start_time=NULL WHERE id=? AND status='running'",
                           (prompt_id,)):
                return "retried"
            return None
        error = {"prompt_id": prompt_id, "node_id": None, "node_type": None, "executed": [],
                 "exception_type": "ServerCrashed",
                 "exception_message": f"{cause} {attempts} times while this job was running; "
                                      "it was not started again", "timestamp": now_ms()}
        message = ["execution_interrupted", error]
        if self._write("UPDATE jobs SET status='interrupted', end_time=?, outputs='{}', messages=?, meta='{}', "
                       "error=? WHERE id=? AND status='running'",
                       (now_ms(), _dumps([message]), _dumps(error), prompt_id)):
            if prune:
                self._prune()
            return "interrupted"
        return None

    def recent_terminal_ids(self, limit: int = 8) -> list[str]:
        """Ids of the jobs that got their terminal record last (newest first)."""
        terminal = ", ".join(f"'{s}'" for s in TERMINAL)
        with self._lock:
            rows = self._db.execute(f"SELECT id FROM jobs WHERE status IN ({terminal}) "
                                    "ORDER BY end_time DESC, seq DESC LIMIT ?", (limit,)).fetchall()
        return [r[0] for r in rows]

    # ------------------------------------------------------------------ cancelling and deleting
    def cancel_pending(self, prompt_ids: Iterable[str] | None = None) -> list[str]:
        """Give pending jobs (all when `prompt_ids` is None) their terminal `cancelled` record."""
        if prompt_ids is None:
            with self._lock:
                ids = [r[0] for r in self._db.execute("SELECT id FROM jobs WHERE status='pending'").fetchall()]
        else:
            ids = [str(i) for i in prompt_ids]
        cancelled = []
        for prompt_id in ids:
            message = ["execution_interrupted", {"prompt_id": prompt_id, "node_id": None, "node_type": None,
                                                 "executed": [], "timestamp": now_ms()}]
            if self._write("UPDATE jobs SET status='cancelled', end_time=?, outputs='{}', messages=?, meta='{}' "
                           "WHERE id=? AND status='pending'", (now_ms(), _dumps([message]), prompt_id)):
                cancelled.append(prompt_id)
        if cancelled:
            self._prune()
        return cancelled

    def delete_history(self, prompt_ids: Iterable[str] | None = None) -> int:
        """Forget terminal records (all when `prompt_ids` is None); active jobs are never deleted."""
        terminal = ", ".join(f"'{s}'" for s in TERMINAL)
        if prompt_ids is None:
            return self._write(f"DELETE FROM jobs WHERE status IN ({terminal})")
        removed = 0
        for prompt_id in prompt_ids:
            removed += self._write(f"DELETE FROM jobs WHERE id=? AND status IN ({terminal})", (str(prompt_id),))
        return removed

    def _prune(self) -> None:
        terminal = ", ".join(f"'{s}'" for s in TERMINAL)
        with self._lock:
            count = self._db.execute(f"SELECT COUNT(*) FROM jobs WHERE status IN ({terminal})").fetchone()[0]
            excess = count - self.history_cap
            if excess > 0:
                self._db.execute(
                    f"DELETE FROM jobs WHERE seq IN (SELECT seq FROM jobs WHERE status IN ({terminal}) "
                    f"ORDER BY end_time, seq LIMIT ?)", (excess,))

    # ------------------------------------------------------------------ reading
    def get(self, prompt_id: str) -> Job | None:
        """One job by id, or None."""
        jobs = self._select(f"SELECT {', '.join(_COLUMNS)} FROM jobs WHERE id=?", (str(prompt_id),))
        return jobs[0] if jobs else None

    def active(self) -> tuple[list[Job], list[Job]]:
        """(running, pending) in queue order."""
        jobs = self._select(f"SELECT {', '.join(_COLUMNS)} FROM jobs WHERE status IN ('pending', 'running') "
                            "ORDER BY number, seq")
        return [j for j in jobs if j.status == "running"], [j for j in jobs if j.status == "pending"]

    def queue_remaining(self) -> int:
        """Jobs pending or running (what the websocket's status message reports)."""
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM jobs WHERE status IN ('pending', 'running')").fetchone()[0]

    def history(self, *, max_items: int | None = None, offset: int = 0) -> list[Job]:
        """Terminal jobs, oldest first; `max_items` keeps the most recent ones (after skipping `offset`)."""
        terminal = ", ".join(f"'{s}'" for s in TERMINAL)
        limit = -1 if max_items is None else max(0, int(max_items))
        jobs = self._select(f"SELECT {', '.join(_COLUMNS)} FROM jobs WHERE status IN ({terminal}) "
                            "ORDER BY end_time DESC, seq DESC LIMIT ? OFFSET ?", (limit, max(0, int(offset))))
        return jobs[::-1]

    def list(self, statuses: Iterable[str], *, limit: int | None = None, offset: int = 0,
             sort_by: str = "create_time", descending: bool = True,
             workflow_id: str | None = None) -> tuple[list[Job], int]:
        """Jobs in the given store statuses, sorted and paged in SQL, with the total before paging."""
        statuses = [s for s in statuses if s in ACTIVE + TERMINAL]
        if not statuses:
            return [], 0
        where = f"status IN ({', '.join('?' for _ in statuses)})"
        params: list[Any] = list(statuses)
        if workflow_id is not None:
            where += " AND json_extract(extra_data, '$.extra_pnginfo.workflow.id') = ?"
            params.append(workflow_id)
        if sort_by == "execution_duration":
            key = "CASE WHEN start_time IS NULL THEN -1 ELSE COALESCE(end_time, ?) - start_time END"
            order_params: list[Any] = [now_ms()]
        elif sort_by == "create_time":
            key, order_params = "create_time", []
        else:
            raise ValueError(f"sort_by must be create_time or execution_duration, got {sort_by!r}")
        direction = "DESC" if descending else "ASC"
        with self._lock:
            total = self._db.execute(f"SELECT COUNT(*) FROM jobs WHERE {where}", params).fetchone()[0]
        jobs = self._select(
            f"SELECT {', '.join(_COLUMNS)} FROM jobs WHERE {where} ORDER BY {key} {direction}, seq {direction} "
            "LIMIT ? OFFSET ?", [*params, *order_params, -1 if limit is None else max(0, int(limit)),
                                 max(0, int(offset))])
        return jobs, total

    def counts(self) -> dict[str, int]:
        """Number of jobs per store status."""
        with self._lock:
            rows = self._db.execute("SELECT status, COUNT(*) FROM jobs GROUP BY status").fetchall()
        return {status: n for status, n in rows}


def workflow_id_of(job: Job) -> str | None:
    """The editor's workflow id, when the job carried its workflow."""
    workflow = ((job.extra_data or {}).get("extra_pnginfo") or {}).get("workflow")
    if isinstance(workflow, dict) and isinstance(workflow.get("id"), str):
        return workflow["id"]
    return None


# ---------------------------------------------------------------------- the runner
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
    worker: Any
    assigned: Job | None = None  # handed over, running or about to
    running: RunningJob | None = None
    files: Any = None  # the assigned job's NamedFiles
    held: dict = field(default_factory=dict)  # (model folder, name) -> bytes: models it loaded
    jobs_run: int = 0
    thread: threading.Thread | None = None

    @property
    def name(self) -> str:
        """The worker's name in records and /system_stats."""
        return getattr(self.worker, "name", None) or f"worker-{self.index}"


PENDING_LOOKAHEAD = 32  # pending jobs the dispatcher considers when the first cannot run on an idle worker


class JobRunner:
    """Hands queued jobs to its workers, one job per worker at a time; every job ends in its one
    terminal record. Without workers given, jobs run in this process through the hooks' functions.

    A dispatcher thread claims jobs and gives each to an idle worker (with several, by the rule of
    `execution.placement`); each worker has a thread that runs its job through it. A job's outputs
    are staged under its token and given their final names after its record is written
    (`execution.paths`); after a process died, `settle_staged` finishes or removes them, leaving the
    staged files of jobs other workers are still running."""

    def __init__(self, store: JobStore, hooks: JobHooks, *, worker: Any = None, workers: Any = None,
                 output_folders: tuple[Path, ...] = ()) -> None:
        from execution.worker import InProcessWorker

        self.store = store
        self.hooks = hooks
        chosen = list(workers) if workers else [worker or InProcessWorker(hooks.validate, hooks.run, free=hooks.free)]
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
    def worker(self) -> Any:
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
            describe = getattr(slot.worker, "describe", None)
            row = dict(describe() if callable(describe) else {})
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
        check = getattr(slot.worker, "is_ready", None)
        return bool(check()) if callable(check) else True

    @staticmethod
    def _missing(slot: WorkerSlot, models: Any) -> list:
        if not models:
            return []
        check = getattr(slot.worker, "missing_models", None)
        try:
            return list(check(models)) if callable(check) else []
        except Exception:  # a worker that cannot answer cannot be chosen for this job
            logger.exception("worker %s: could not list its model files", slot.name)
            return list(models)

    def _fail_unplaceable(self, job: Job, missing: tuple[str, str]) -> None:
        """The record of a job no worker of the pool can run: it names a model file none of them has."""
        from execution.worker import failure_outcome

        folder, name = missing
        exc = FileNotFoundError(f"model file {name!r} (models/{folder}) is on the server but on none of its "
                                f"{len(self.slots)} workers; copy it to the same folder on a worker's machine")
        outcome = failure_outcome(job.id, exc)
        self._validated.pop(job.id, None)
        self.hooks.on_start(job)
        self.hooks.emit("execution_error", outcome.error)
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
        from execution.paths import settle_staged, staging_token

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
        error = dict((record.error if record else None) or {}, prompt_id=job.id)
        self.hooks.emit("execution_interrupted", error)
        self.hooks.emit("executing", {"node": None, "display_node": None, "prompt_id": job.id})

    def _run(self, job: Job, slot: WorkerSlot) -> None:
        from execution.paths import commit_staged, staging_token
        from execution.worker import JobRequest, WorkerDied, WorkerStartFailed, failure_outcome

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
        try:
            outcome = slot.worker.run(request, control, validated=self._validated.pop(job.id, None))
        except WorkerDied as exc:  # the crash rule: started again once (elsewhere when it can), then interrupted
            with self._wake:
                slot.running = None
            slot.held.clear()
            self._died_on[job.id] = slot.index
            logger.warning("job %s on %s: %s", job.id, slot.name, exc)
            self._settle_outputs(dropping=job.id)
            released = self.store.release_crashed(job.id, cause="its worker process died")
            if released == "interrupted":
                self._died_on.pop(job.id, None)
                self._announce_interrupted(job)
            self.hooks.on_finish(job, "requeued" if released == "retried" else JobState.INTERRUPTED)
            self.hooks.on_queue_change()
            self._restart(slot)
            return
        except WorkerStartFailed as exc:
            outcome = failure_outcome(job.id, exc)
        with self._wake:
            slot.running = None
        self._died_on.pop(job.id, None)
        if outcome.killed:
            slot.held.clear()
            self._settle_outputs(dropping=job.id)  # the killed attempt's files go
        if running.stop_for_shutdown and outcome.status == "interrupted" and self.store.requeue(job.id):
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
