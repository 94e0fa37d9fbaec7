"""The durable job store: one terminal record per job, recovery after crashes, capped history, listing."""
from __future__ import annotations

import pytest

from execution.job_store import MAX_ATTEMPTS, JobStore


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
    assert claimed.id == "a" and claimed.status == "running" and claimed.attempts == 0  # not gone to a worker yet
    assert store.begin_attempt("a") and store.get("a").attempts == 1
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
        assert job.id == "poison" and store.begin_attempt("poison") and store.get("poison").attempts == attempt
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


def test_a_crash_before_the_job_reached_a_worker_costs_it_no_attempt(tmp_path):
    """Issue 32 (10): a kill while a fresh worker boots is not an attempt of the job it had not started."""
    path = tmp_path / "jobs.sqlite3"
    store = JobStore(path)
    store.add("j", {}, number=1)
    store.claim_next()
    assert store.begin_attempt("j")  # the first attempt reached a worker, which died with it
    assert store.release_crashed("j", cause="its worker process died") == "retried"
    for _ in range(3):  # claimed again, then the server dies while the fresh worker boots, several times
        assert store.claim_next().id == "j"
        store.close()
        store = JobStore(path)
        assert store.recover() == {"retried": ["j"], "interrupted": []}
    job = store.get("j")
    assert job.status == "pending" and job.attempts == 1
    # A worker that dies while it boots puts the job back without an attempt too.
    store.claim_next()
    assert store.requeue("j", counted=False) and store.get("j").attempts == 1
    assert store.begin_attempt("j") is False  # only a running job gets an attempt
