"""The job runner: jobs in order with one record each, failures at run time, cancel, interrupt and a clean stop."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from execution.job_runner import JobHooks, JobRunner
from execution.job_store import JobStore
from execution.scheduler import JobControl


@dataclass
class FakeResult:
    status: str
    outputs: dict = field(default_factory=dict)
    messages: list = field(default_factory=list)
    meta: dict = field(default_factory=dict)
    error: dict | None = None


def _runner(store, run, **hooks) -> JobRunner:
    return JobRunner(store, JobHooks(validate=lambda prompt, targets: prompt, run=run, make_control=JobControl, **hooks))


def _wait(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_runner_runs_jobs_in_order_and_records_each(tmp_path):
    store = JobStore(tmp_path / "jobs.sqlite3")
    seen, finished = [], []

    def run(validated, *, prompt_id, extra_data, control):
        seen.append(prompt_id)
        if prompt_id == "bad":
            return FakeResult("error", error={"exception_message": "boom"})
        return FakeResult("success", outputs={"1": {"values": [prompt_id]}})

    runner = _runner(store, run, on_finish=lambda job, status: finished.append((job.id, status)))
    for name in ("a", "bad", "c"):
        store.add(name, {"n": name}, number=store.next_number())
    runner.start()
    _wait(lambda: len(finished) == 3)
    runner.stop()
    assert seen == ["a", "bad", "c"] and finished == [("a", "success"), ("bad", "error"), ("c", "success")]
    assert store.get("c").outputs == {"1": {"values": ["c"]}} and store.get("bad").error["exception_message"] == "boom"


def test_runner_validation_failure_at_run_time_is_an_error_record(tmp_path):
    store = JobStore(tmp_path / "jobs.sqlite3")

    def validate(prompt, targets):
        raise ValueError("node type 'Gone' is not installed any more")

    runner = JobRunner(store, JobHooks(validate=validate, run=None, make_control=JobControl))
    store.add("a", {}, number=1)
    runner.start()
    _wait(lambda: store.get("a").status != "pending" and store.get("a").status != "running")
    runner.stop()
    job = store.get("a")
    assert job.status == "error" and "not installed" in job.error["exception_message"]


def test_runner_cancel_and_interrupt_and_clean_stop_requeues(tmp_path):
    store = JobStore(tmp_path / "jobs.sqlite3")
    started = threading.Event()

    def run(validated, *, prompt_id, extra_data, control):
        started.set()
        while not control.interrupted:
            time.sleep(0.005)
        return FakeResult("interrupted")

    runner = _runner(store, run)
    for name in ("long", "waiting", "later"):
        store.add(name, {}, number=store.next_number())
    runner.start()
    assert started.wait(10)
    assert runner.cancel(["waiting"]) == ["waiting"]
    assert store.get("waiting").status == "cancelled"
    assert runner.interrupt("not-running") is False
    assert runner.interrupt("long") is True
    _wait(lambda: store.get("long").status == "cancelled")
    _wait(lambda: runner.current is not None and runner.current.job.id == "later")
    runner.stop()  # a clean stop puts the running job back, without counting the attempt
    job = store.get("later")
    assert job.status == "pending" and job.attempts == 0


def test_a_worker_that_raises_still_leaves_its_job_a_record_and_the_runner_serving(tmp_path):
    from execution.worker import Worker
    from execution.worker_messages import JobOutcome

    class Faulty(Worker):
        def __init__(self) -> None:
            self.stopped = 0

        def start(self) -> None:
            pass

        def run(self, request, control, *, validated=None, handed_over=None):
            if request.prompt_id == "before":
                raise ValueError("cannot encode this job")
            handed_over()
            if request.prompt_id == "after":
                raise RuntimeError("lost track of the job")
            return JobOutcome("success")

        def free(self, unload_models: bool) -> None:
            pass

        def stop(self, timeout: float = 30.0) -> None:
            self.stopped += 1

    store = JobStore(tmp_path / "jobs.sqlite3")
    worker = Faulty()
    runner = JobRunner(store, JobHooks(validate=None, run=None, make_control=JobControl), worker=worker)
    for number, name in enumerate(("before", "after", "fine")):
        store.add(name, {}, number=number)
    runner.start()
    _wait(lambda: store.get("fine").terminal)
    restarted = worker.stopped  # the worker that may still hold "after" was stopped and started afresh
    runner.stop()
    before, after = store.get("before"), store.get("after")
    assert (before.status, before.attempts, before.error["exception_type"]) == ("error", 0, "ValueError")
    assert (after.status, after.attempts, after.error["exception_type"]) == ("error", 1, "RuntimeError")
    assert store.get("fine").status == "success"
    assert restarted == 1


def test_the_runner_takes_only_workers():
    import pytest

    with pytest.raises(TypeError, match="execution.worker.Worker"):
        JobRunner(None, JobHooks(validate=None, run=None, make_control=JobControl), workers=[object()])


def test_a_worker_started_with_the_runner_reports_ready_before_any_job(tmp_path):
    """The pool's workers start with the server; each says it is ready (in /system_stats) once its runtime
    is up, with no job needed to read that."""
    from execution.worker import RemoteWorker
    from execution.worker_messages import WorkerReady
    from tests.execution.test_worker import ScriptedTransport

    class SlowBoot(ScriptedTransport):
        def __init__(self) -> None:
            super().__init__([])
            self.outbox = []
            self.booted = threading.Event()

        def receive(self, timeout: float):
            if self.booted.is_set() and not self.outbox:
                self.outbox.append(WorkerReady(info={"pid": 42}))
                self.booted.clear()
            return super().receive(timeout)

    transport = SlowBoot()
    worker = RemoteWorker(lambda: transport, events=None, name="w-0")
    runner = JobRunner(JobStore(tmp_path / "jobs.sqlite3"), JobHooks(validate=None, run=None, make_control=JobControl),
                       worker=worker)
    runner.start()
    try:
        time.sleep(0.2)
        assert worker.describe()["ready"] is False  # still starting
        transport.booted.set()
        _wait(lambda: worker.describe()["ready"], timeout=5.0)
        assert worker.describe()["pid"] == 42
    finally:
        runner.stop()
