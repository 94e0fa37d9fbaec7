"""The durable job queue and history (SQLite in WAL mode under the user directory).

One table holds every accepted job from acceptance to its terminal record:

    pending   accepted (committed before the HTTP 200), waiting to run
    running   claimed for a worker; `attempts` counts how many times it went to a ready worker
    success | error | cancelled | interrupted   terminal: written once, never overwritten

Every state change is one `UPDATE ... WHERE status = <expected>` in its own transaction, so a job has
exactly one terminal record whatever happens: a job found `running` at start-up was cut short by a
crash; it goes back to `pending` once (`attempts` < MAX_ATTEMPTS) and is marked `interrupted` the next
time, so a job that kills the process is never replayed forever. History is capped: past
`history_cap` terminal records the oldest are deleted first. The store never imports torch or nodes;
the runner that hands its jobs to workers is `execution/job_runner.py`.
"""
from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, Iterable

from execution.failure import INTERRUPTED, failure_payload

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
STORE_FILE = "jobs.sqlite3"  # the store's file in the user folder
MAX_ATTEMPTS = 2  # a job cut short by a crash goes to a worker at most this many times in all
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
        if self.status == "interrupted" and not any(m[0] == INTERRUPTED for m in messages):
            error = dict(self.error, prompt_id=self.id) if self.error else failure_payload(INTERRUPTED, self.id)
            messages.append([INTERRUPTED, error])
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
        """Mark the first pending job running (claimed for `worker`) and return it; None when none waits.
        The attempt counts only once the job goes to a ready worker (`begin_attempt`)."""
        with self._lock:
            row = self._db.execute(
                "SELECT seq FROM jobs WHERE status='pending' ORDER BY number, seq LIMIT 1").fetchone()
            if row is None:
                return None
            return self._claim_seq(row[0], worker)

    def claim(self, prompt_id: str, *, worker: str | None = None) -> Job | None:
        """Mark one pending job running, claimed for `worker`; None when it is no longer pending."""
        with self._lock:
            row = self._db.execute("SELECT seq FROM jobs WHERE id=? AND status='pending'", (prompt_id,)).fetchone()
            return None if row is None else self._claim_seq(row[0], worker)

    def _claim_seq(self, seq: int, worker: str | None) -> Job | None:
        """(Under the lock.) The claim itself: one conditional UPDATE, so a job is handed over once."""
        self._db.execute("PRAGMA synchronous=NORMAL")  # see _write
        try:
            changed = self._db.execute("UPDATE jobs SET status='running', start_time=?, worker=? "
                                       "WHERE seq=? AND status='pending'", (now_ms(), worker, seq)).rowcount
        finally:
            self._db.execute("PRAGMA synchronous=FULL")
        if not changed:
            return None
        job = self._db.execute(f"SELECT {', '.join(_COLUMNS)} FROM jobs WHERE seq=?", (seq,)).fetchone()
        return _row_to_job(job)

    def begin_attempt(self, prompt_id: str) -> bool:
        """A running job goes to its (ready) worker: one more attempt. A crash before this (a worker
        killed while it booted, the server killed while the job waited for it) costs the job nothing."""
        return bool(self._write("UPDATE jobs SET attempts=attempts+1 WHERE id=? AND status='running'", (prompt_id,)))

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

    def requeue(self, prompt_id: str, *, counted: bool = True) -> bool:
        """Put a running job back in the queue without counting its attempt: a clean shutdown stopped it
        (`counted`: the attempt had been counted, so it is taken back), or it never went to a worker."""
        uncount = "attempts=MAX(attempts-1, 0), " if counted else ""
        return bool(self._write(f"UPDATE jobs SET status='pending', {uncount}start_time=NULL "
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

    def release_crashed(self, prompt_id: str, *, prune: bool = True, cause: str = "the server stopped",
                        exception_type: str = "ServerCrashed") -> str | None:
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
        error = failure_payload(INTERRUPTED, prompt_id, exception_type=exception_type,
                                message=f"{cause} {attempts} times while this job was running; it was not started again")
        message = [INTERRUPTED, error]
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
            message = [INTERRUPTED, failure_payload(INTERRUPTED, prompt_id)]
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


def read_active(path: str | Path) -> tuple[list[Job], list[Job]]:
    """(running, pending) in queue order, read from the store file another process writes.

    Opened read-only and closed again at once: it takes no part in the writer's transactions, and under
    WAL it never waits for one. A file that does not exist (no server has run here) reads as empty."""
    path = Path(path)
    if not path.is_file():
        return [], []
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
    try:
        rows = db.execute(f"SELECT {', '.join(_COLUMNS)} FROM jobs WHERE status IN ('pending', 'running') "
                          "ORDER BY number, seq").fetchall()
    finally:
        db.close()
    jobs = [_row_to_job(row) for row in rows]
    return [j for j in jobs if j.status == "running"], [j for j in jobs if j.status == "pending"]


def workflow_id_of(job: Job) -> str | None:
    """The editor's workflow id, when the job carried its workflow."""
    workflow = ((job.extra_data or {}).get("extra_pnginfo") or {}).get("workflow")
    if isinstance(workflow, dict) and isinstance(workflow.get("id"), str):
        return workflow["id"]
    return None
