"""The worker contract: every worker kind behind the `Worker` interface passes the same suite.

Each test runs once over a local worker process and once over a Ray actor (a local Ray bound to
127.0.0.1 with a small object store, started for this module and stopped after it): the messages a job
produces and the files it stages, an honoured interrupt, an ignored one (the worker killed after the
grace period), the failure payload, the crash rule (a worker that dies mid-job has its job retried once,
then recorded interrupted), a kill while a fresh worker boots (no attempt of the job it had not
started), and a job that cannot be handed to the worker (an error record, at once)."""
from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path

import pytest

from execution.events import EventBus
from execution.failure import ERROR, INTERRUPTED, failure_payload
from execution.job_runner import JobHooks, JobRunner
from execution.job_store import JobStore
from execution.paths import staging_token
from execution.scheduler import JobControl
from execution.worker import JobRequest, LocalProcessTransport, RemoteWorker, RuntimeRecipe, Worker
from tests.execution.worker_contract_nodes import ContractRuntime
from tests.web.serve import parse_args

REPO_ROOT = Path(__file__).resolve().parents[2]
KINDS = ["process", "ray"]
NESTING = 900  # deep enough that pickling the prompt for the worker raises RecursionError


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray on loopback only, with 2 CPUs and a 100 MB object store; shut down after the module."""
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        yield ray
        return
    path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    ray.init(num_cpus=2, object_store_memory=100 * 2**20, include_dashboard=False, _node_ip_address="127.0.0.1",
             runtime_env={"env_vars": {"PYTHONPATH": path}}, logging_level=logging.WARNING)
    try:
        yield ray
    finally:
        ray.shutdown()


class Harness:
    """The server's side of one worker of `kind`: its runtime (folders, events) and the worker."""

    def __init__(self, kind: str, base: Path) -> None:
        self.kind = kind
        self.base = base
        self.args = parse_args(["--base-directory", str(base), "--port", "0", "--cache-none"], light=True)
        self.front = ContractRuntime(self.args)
        self.events: list[tuple[str, dict]] = []
        self.front.events.subscribe(lambda event, data: self.events.append((event, data)))
        self.workers: list[Worker] = []

    def worker(self, *, boot_s: float = 0.0, grace_s: float = 5.0) -> RemoteWorker:
        args = type(self.args)(**vars(self.args))
        args.contract_boot_s = boot_s
        recipe = RuntimeRecipe(ContractRuntime, args)
        if self.kind == "process":
            worker = RemoteWorker(lambda: LocalProcessTransport(recipe), self.front.events, grace_s=grace_s,
                                  name="worker-0", kind="process")
        else:
            from cluster.ray_pool import ray_pool

            scratch = self.base / "scratch"
            scratch.mkdir(exist_ok=True)
            [worker] = ray_pool(self.front, [recipe], grace_s=grace_s, scratch_root=str(scratch), threads=1).workers
        self.workers.append(worker)
        return worker

    def kill_runtime(self, worker: RemoteWorker) -> None:
        """Kill the worker's process from outside (as the OS or an operator would)."""
        transport = worker.transport
        if self.kind == "process":
            os.kill(transport.process.pid, signal.SIGKILL)
        else:
            import ray

            ray.kill(transport.actor, no_restart=True)

    def runner(self, worker: Worker, store: JobStore) -> JobRunner:
        hooks = JobHooks(validate=None, run=None, make_control=JobControl,
                         emit=lambda event, data: self.front.events.emit(event, data))
        return JobRunner(store, hooks, worker=worker,
                         output_folders=(Path(self.front.paths.output), Path(self.front.paths.temp)))

    def close(self) -> None:
        for worker in self.workers:
            worker.stop(timeout=5.0)


@pytest.fixture(params=KINDS)
def harness(request, tmp_path):
    if request.param == "ray":
        request.getfixturevalue("local_ray")
    running = Harness(request.param, tmp_path / "studio")
    try:
        yield running
    finally:
        running.close()


def wait_for(predicate, timeout: float = 120.0, step: float = 0.02):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(step)


def wait_terminal(store: JobStore, prompt_id: str, timeout: float = 120.0):
    wait_for(lambda: store.get(prompt_id).terminal, timeout)
    return store.get(prompt_id)


def write_prompt(value: int, seconds: float = 0.0, steps: int = 2) -> dict:
    return {"1": {"class_type": "ClusterWrite", "inputs": {"value": value, "seconds": seconds, "steps": steps}}}


def first_index(names: list[str], name: str) -> int:
    return names.index(name) if name in names else -1


# ---------------------------------------------------------------------- messages
def test_a_job_streams_its_events_in_order_and_stages_its_file(harness):
    worker = harness.worker()
    handed = []
    outcome = worker.run(JobRequest("j1", write_prompt(5), staging_token=staging_token("j1")), JobControl(),
                         handed_over=lambda: handed.append(True))
    assert outcome.status == "success" and handed == [True] and not outcome.killed
    names = [event for event, data in harness.events if data.get("prompt_id", "j1") == "j1"]
    order = [first_index(names, n) for n in ("execution_start", "executing", "progress", "executed",
                                              "execution_success")]
    assert -1 not in order and order == sorted(order), names
    [(staged, final)] = outcome.staged
    assert Path(staged).read_bytes() == b"value 5\n" * 6 and not Path(final).exists()  # named after the record
    assert Path(final).parent == Path(harness.front.paths.output) / "cluster"
    [file_item] = outcome.outputs["1"]["files"]
    assert Path(final).name == file_item["filename"]
    assert worker.describe()["kind"] == harness.kind and worker.describe()["ready"] is True


# ---------------------------------------------------------------------- interrupt
def test_an_honoured_interrupt_ends_the_job_interrupted_and_keeps_the_worker(harness):
    worker = harness.worker()
    control = JobControl()
    harness.front.events.subscribe(lambda event, data: control.interrupt() if event == "progress" else None)
    outcome = worker.run(JobRequest("slow", write_prompt(1, seconds=60.0, steps=60)), control)
    assert outcome.status == "interrupted" and not outcome.killed and worker.restarts == 0
    assert outcome.error["node_id"] == "1" and outcome.error["node_type"] == "ClusterWrite"
    assert set(outcome.error) == set(failure_payload(INTERRUPTED, "slow"))
    assert [m[0] for m in outcome.messages].count(INTERRUPTED) == 1
    # The same runtime takes the next job.
    assert worker.run(JobRequest("next", write_prompt(2)), JobControl()).status == "success"
    assert worker.restarts == 0


def test_an_ignored_interrupt_kills_the_worker_after_the_grace_period(harness):
    worker = harness.worker(grace_s=1.0)
    control = JobControl()
    harness.front.events.subscribe(
        lambda event, data: control.interrupt() if event == "executing" and data.get("node") == "1" else None)
    stuck = {"1": {"class_type": "ContractIgnoreInterrupts", "inputs": {"seconds": 120.0}}}
    started = time.monotonic()
    outcome = worker.run(JobRequest("stuck", stuck), control)
    assert time.monotonic() - started < 60
    assert outcome.killed and outcome.status == "interrupted" and worker.restarts == 1
    assert outcome.error["exception_type"] == "WorkerKilled"
    assert outcome.error == failure_payload(INTERRUPTED, "stuck", exception_type="WorkerKilled",
                                            message=outcome.error["exception_message"],
                                            timestamp=outcome.error["timestamp"])
    # A fresh runtime takes the next job.
    assert worker.run(JobRequest("after", write_prompt(3)), JobControl()).status == "success"


# ---------------------------------------------------------------------- failure payload
def test_a_node_failure_comes_back_as_the_one_failure_payload(harness):
    worker = harness.worker()
    failing = {"1": {"class_type": "ContractFail", "inputs": {"message": f"broken: {harness.base}/models/x.safetensors"}}}
    outcome = worker.run(JobRequest("bad", failing), JobControl())
    assert outcome.status == "error" and not outcome.killed
    error = outcome.error
    assert set(error) == set(failure_payload(ERROR, "bad", real_node_id="1"))
    assert (error["node_id"], error["node_type"], error["exception_type"]) == ("1", "ContractFail", "ValueError")
    assert error["exception_message"] == "broken: models/x.safetensors"  # no server path leaves the worker
    assert error["traceback"] and error["current_outputs"] == {}
    [event] = [data for event, data in harness.events if event == ERROR]
    assert event == error and outcome.messages[-1] == [ERROR, error]


# ---------------------------------------------------------------------- the crash rule
def test_a_worker_that_dies_mid_job_has_it_retried_once_then_recorded_interrupted(harness):
    store = JobStore(harness.base / "jobs.sqlite3")
    runner = harness.runner(harness.worker(), store)
    store.add("dies", {"1": {"class_type": "ContractDie", "inputs": {"marker": ""}}}, number=1)
    store.add("after", write_prompt(4), number=2)
    runner.start()
    try:
        job = wait_terminal(store, "dies")
        assert job.status == "interrupted" and job.attempts == 2
        assert job.error["exception_type"] == "WorkerDied"
        assert set(job.error) == set(failure_payload(INTERRUPTED, "dies", exception_type="WorkerDied"))
        assert [m[0] for m in job.history_record()["status"]["messages"]] == [INTERRUPTED]
        assert wait_terminal(store, "after").status == "success"  # the restarted worker serves on
    finally:
        runner.stop()
        store.close()


def test_a_kill_while_a_fresh_worker_boots_is_no_attempt_of_the_job(harness):
    """Issue 32 (10): the job's first attempt dies; the fresh worker is killed while it boots with the
    job waiting for it; the job must still run (attempt 2), not be recorded interrupted."""
    store = JobStore(harness.base / "jobs.sqlite3")
    worker = harness.worker(boot_s=4.0)
    runner = harness.runner(worker, store)
    marker = harness.base / "died-once"
    store.add("once", {"1": {"class_type": "ContractDie", "inputs": {"marker": str(marker)}}}, number=1)
    runner.start()
    try:
        wait_for(lambda: marker.exists())
        # The first attempt died; the job is claimed again for the fresh worker, which is still booting.
        # (A transport that is not ready exists only after the dead one was released: see _worker_died.)
        wait_for(lambda: store.get("once").status == "running" and worker.transport is not None and not worker.ready)
        harness.kill_runtime(worker)
        job = wait_terminal(store, "once")
        assert job.status == "success" and job.attempts == 2
        assert worker.restarts >= 2
    finally:
        runner.stop()
        store.close()


# ---------------------------------------------------------------------- a job that cannot be handed over
def deep_prompt(depth: int = NESTING) -> dict:
    nested: object = 0
    for _ in range(depth):
        nested = {"a": nested}
    return {"1": {"class_type": "ClusterWrite", "inputs": {"value": 1, "extra": nested}}}


def test_a_job_that_cannot_be_handed_to_the_worker_ends_with_an_error_record(harness):
    """Issue 32 (3), the runner's part. The prompt goes into the store directly: admission (which bounds
    nesting) is not what is tested here."""
    path = harness.base / "jobs.sqlite3"
    store = JobStore(path)
    # One left `running` by a server killed while handing it over: the restart must not leave it so.
    store.add("left", deep_prompt(), number=1)
    assert store.claim_next().id == "left"
    store.add("deep", deep_prompt(), number=2)
    store.add("fine", write_prompt(6), number=3)
    worker = harness.worker()
    runner = harness.runner(worker, store)
    runner.start()
    try:
        for prompt_id in ("left", "deep"):
            job = wait_terminal(store, prompt_id, 60)
            assert job.status == "error" and job.attempts == 1  # tried once, never left as running
            assert job.error["exception_type"] == "RecursionError"
            assert "could not be handed to its worker" in job.error["exception_message"]
            assert set(job.error) == set(failure_payload(ERROR, prompt_id))
            assert runner.cancel([prompt_id]) == [] and runner.interrupt(prompt_id) is False
        assert wait_terminal(store, "fine").status == "success" and worker.restarts == 0
        assert store.get("deep").status == "error"  # one record, never overwritten
    finally:
        runner.stop()
        store.close()
