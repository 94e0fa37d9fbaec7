"""The durable job store and its worker: one terminal record per job, recovery after crashes, capped history."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import pytest

from execution.jobs import MAX_ATTEMPTS, JobHooks, JobRunner, JobStore
from execution.scheduler import JobControl


def test_accepted_job_is_on_disk_before_add_returns(tmp_path):
    store = JobStore(tmp_path / "jobs.sqlite3")
    store.add("a", {"1": {"class_type": "X", "inputs": {}}}, number=store.next_number(), client_id="c",
              outputs_to_execute=["1"])
    # A second connection (another process after a crash) sees it at once.
    other = JobStore(tmp_path / "jobs.sqlite3")
    job = other.get("a")
    assert job is not None and job.status == "pending" and job.client_id == "c" and job.extra_data["client_id"] == "c"
    assert other.queue_remaining() == 1
    with pytest.raises(ValueError, match="already used"):
        other.add("a", {}, number=2)


def test_a_job_gets_exactly_one_terminal_record(tmp_path):
    store = JobStore(tmp_path / "jobs.sqlite3")
    store.add("a", {}, number=1)
    assert store.finish("a", "success") is False  # not running yet: no record
    claimed = store.claim_next()
    assert claimed.id == "a" and claimed.status == "running" and claimed.attempts == 1
    assert store.finish("a", "success", outputs={"1": {"images": []}}) is True
    assert store.finish("a", "error") is False
    assert store.cancel_pending(["a"]) == []
    assert store.get("a").status == "success"
    with pytest.raises(ValueError):
        store.finish("a", "done")


def test_queue_order_number_then_arrival_and_front(tmp_path):
    store = JobStore(tmp_path / "jobs.sqlite3")
    for name in "abc":
        store.add(name, {}, number=store.next_number())
    store.add("urgent", {}, number=store.next_number(front=True))
    assert [store.claim_next().id for _ in range(4)] == ["urgent", "a", "b", "c"]
    assert store.claim_next() is None


def test_crash_while_running_retries_once_then_marks_interrupted(tmp_path):
    path = tmp_path / "jobs.sqlite3"
    store = JobStore(path)
    store.add("poison", {}, number=1)
    for attempt in range(1, MAX_ATTEMPTS + 1):
        job = store.claim_next()
        assert job.id == "poison" and job.attempts == attempt
        store.close()  # the process dies here, the job still running
        store = JobStore(path)
        report = store.recover()
        if attempt < MAX_ATTEMPTS:
            assert report == {"retried": ["poison"], "interrupted": []}
            assert store.get("poison").status == "pending"
    assert report == {"retried": [], "interrupted": ["poison"]}
    job = store.get("poison")
    assert job.status == "interrupted" and job.api_status == "failed"
    record = job.history_record()
    assert record["status"]["status_str"] == "error" and record["status"]["messages"][0][0] == "execution_interrupted"
    assert store.claim_next() is None and store.recover() == {"retried": [], "interrupted": []}


def test_history_is_capped_oldest_first(tmp_path):
    store = JobStore(tmp_path / "jobs.sqlite3", history_cap=3)
    for index in range(5):
        store.add(f"j{index}", {}, number=index + 1)
        store.claim_next()
        store.finish(f"j{index}", "success")
    assert [j.id for j in store.history()] == ["j2", "j3", "j4"]
    assert store.get("j0") is None and store.get("j1") is None
    store.add("waiting", {}, number=10)  # active jobs are never pruned
    store.cancel_pending()
    assert [j.id for j in store.history()] == ["j3", "j4", "waiting"]
    assert store.history(max_items=1)[0].id == "waiting"


def test_listing_filters_sorts_and_pages(tmp_path):
    store = JobStore(tmp_path / "jobs.sqlite3")
    for index in range(5):
        store.add(f"j{index}", {}, number=index + 1,
                  extra_data={"extra_pnginfo": {"workflow": {"id": "wf-odd" if index % 2 else "wf-even"}}})
    store.claim_next()
    store.finish("j0", "error", error={"exception_message": "boom"})
    jobs, total = store.list(["pending"], limit=2, offset=1, descending=False)
    assert total == 4 and [j.id for j in jobs] == ["j2", "j3"]
    jobs, total = store.list(["pending", "error"], workflow_id="wf-odd")
    assert total == 2 and {j.id for j in jobs} == {"j1", "j3"}
    assert store.list([], limit=5) == ([], 0)
    assert store.counts() == {"error": 1, "pending": 4}


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
