"""The worker interface: running a request, the grace period before a kill, and messages without server paths."""
from __future__ import annotations

import threading

from execution.events import EventBus
from execution.scheduler import JobControl
from execution.worker import JobRequest, RemoteWorker, Transport, WorkerDied, run_request
from execution.worker_messages import InterruptJob, JobEvent, JobOutcome, JobResult, RunJob, WorkerReady


def test_errors_name_files_relative_to_the_base_folder(tmp_path):
    base = tmp_path / "studio"

    def run(validated, *, prompt_id, extra_data, control):
        raise FileNotFoundError(f"model file {base}/models/checkpoints/x.safetensors is missing")

    outcome = run_request(lambda prompt, targets: prompt, run, JobRequest("j", {}), JobControl(), base=base)
    assert outcome.status == "error"
    assert outcome.error["exception_message"] == "model file models/checkpoints/x.safetensors is missing"
    assert str(base) not in repr(outcome.messages)


class ScriptedTransport(Transport):
    """A worker that says it is ready, then plays `script` for a run, and can be told to ignore interrupts."""

    def __init__(self, script: list, *, honours_interrupt: bool = True) -> None:
        self.script = list(script)
        self.honours_interrupt = honours_interrupt
        self.outbox: list = [WorkerReady()]
        self.sent: list = []
        self.killed = False
        self.lock = threading.Lock()

    def start(self) -> None:
        pass

    def send(self, message) -> None:
        if self.killed:
            raise WorkerDied("gone")
        self.sent.append(message)
        if isinstance(message, RunJob):
            self.outbox.extend(self.script)
        elif isinstance(message, InterruptJob) and self.honours_interrupt:
            from execution.worker import interrupted_outcome

            self.outbox.append(JobResult(interrupted_outcome(message.prompt_id, "Interrupted", "stopped")))

    def receive(self, timeout: float):
        if self.killed:
            raise WorkerDied("gone")
        if self.outbox:
            return self.outbox.pop(0)
        import time

        time.sleep(min(timeout, 0.01))
        return None

    def kill(self) -> None:
        self.killed = True

    def stop(self, timeout: float) -> None:
        self.killed = True


def test_remote_worker_relays_events_and_returns_the_result():
    bus, seen = EventBus(), []
    bus.subscribe(lambda event, data: seen.append(event))
    transport = ScriptedTransport([JobEvent("executing", {"node": "1"}), JobResult(JobOutcome("success"))])
    worker = RemoteWorker(lambda: transport, bus, grace_s=5)
    outcome = worker.run(JobRequest("j", {}), JobControl())
    assert outcome.status == "success" and seen == ["executing"] and isinstance(transport.sent[0], RunJob)


def test_an_interrupt_that_is_not_honoured_kills_the_worker_after_the_grace_period():
    transports = []

    def make():
        transports.append(ScriptedTransport([JobEvent("executing", {"node": "1"})], honours_interrupt=False))
        return transports[-1]

    worker = RemoteWorker(make, EventBus(), grace_s=0.2)
    control = JobControl()
    threading.Timer(0.1, control.interrupt).start()
    outcome = worker.run(JobRequest("j", {}), control)
    assert outcome.killed and outcome.status == "interrupted" and outcome.error["exception_type"] == "WorkerKilled"
    assert transports[0].killed and InterruptJob("j") in transports[0].sent
    # The next job gets a fresh worker; an honoured interrupt kills nothing.
    transports.clear()
    control = JobControl()
    control.interrupt()
    worker.make_transport = lambda: transports.append(ScriptedTransport([])) or transports[-1]
    outcome = worker.run(JobRequest("k", {}), control)
    assert not outcome.killed and outcome.status == "interrupted" and not transports[0].killed


class NeverStarts(ScriptedTransport):
    """A worker whose runtime fails to build: it ends before saying it is ready."""

    def __init__(self) -> None:
        super().__init__([])
        self.outbox = []

    def receive(self, timeout: float):
        raise WorkerDied("the job worker process ended (exit code 1)")


def test_a_worker_that_cannot_start_fails_its_job_with_the_reason(tmp_path):
    import time

    from execution.job_runner import JobHooks, JobRunner
    from execution.job_store import JobStore

    store = JobStore(tmp_path / "jobs.sqlite3")
    worker = RemoteWorker(NeverStarts, EventBus(), grace_s=1)
    runner = JobRunner(store, JobHooks(validate=None, run=None, make_control=JobControl), worker=worker)
    store.add("a", {}, number=1)
    store.add("b", {}, number=2)
    runner.start()
    deadline = time.monotonic() + 10
    while store.get("b").status in ("pending", "running"):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    runner.stop()
    for job_id in ("a", "b"):
        job = store.get(job_id)
        # Never started: the job reached no worker, so no attempt was counted.
        assert job.status == "error" and job.attempts == 0
        assert "could not start" in job.error["exception_message"]


class SaysItCannotStart(ScriptedTransport):
    """A worker whose runtime fails to build and says why before it ends."""

    def __init__(self) -> None:
        super().__init__([])
        from execution.worker_messages import WorkerFailure

        self.outbox = [WorkerFailure("start", "ModuleNotFoundError", "No module named 'brokenpack'")]

    def receive(self, timeout: float):
        if self.outbox:
            return self.outbox.pop(0)
        raise WorkerDied("the job worker process ended (exit code 1)")


def test_a_worker_that_says_why_it_cannot_start_fails_the_job_with_that_reason_at_once(tmp_path):
    from execution.worker import WorkerStartFailed

    made = []
    worker = RemoteWorker(lambda: made.append(SaysItCannotStart()) or made[-1], EventBus(), grace_s=1)
    handed = []
    try:
        worker.run(JobRequest("j", {}), JobControl(), handed_over=lambda: handed.append(1))
        raise AssertionError("the run should have failed")
    except WorkerStartFailed as exc:
        assert "ModuleNotFoundError: No module named 'brokenpack'" in str(exc)
    assert len(made) == 1 and made[0].killed and handed == []


def test_a_job_the_worker_cannot_read_ends_with_its_reason():
    from execution.worker_messages import WorkerFailure

    transport = ScriptedTransport([WorkerFailure("job", "UnpicklingError", "truncated message")])
    handed = []
    outcome = RemoteWorker(lambda: transport, EventBus(), grace_s=5).run(
        JobRequest("j", {}), JobControl(), handed_over=lambda: handed.append(1))
    assert outcome.status == "error" and handed == [1] and not transport.killed
    assert outcome.error["exception_type"] == "UnpicklingError"
    assert outcome.error["exception_message"] == "the worker could not read the job: truncated message"


def test_a_job_that_does_not_pickle_is_never_sent_and_fails_with_the_reason():
    class Pickling(ScriptedTransport):
        def send(self, message) -> None:
            import pickle

            pickle.dumps(message)
            super().send(message)

    nested: object = 0
    for _ in range(2000):
        nested = [nested]
    transport = Pickling([])
    handed = []
    outcome = RemoteWorker(lambda: transport, EventBus(), grace_s=5).run(
        JobRequest("deep", {"1": {"inputs": {"v": nested}}}), JobControl(), handed_over=lambda: handed.append(1))
    assert outcome.status == "error" and outcome.error["exception_type"] == "RecursionError"
    assert "could not be handed to its worker" in outcome.error["exception_message"]
    assert transport.sent == [] and handed == [1] and not transport.killed  # counted: it was about to go
