"""The worker interface: running a request, the grace period before a kill, and messages without server paths."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

from execution.events import EventBus
from execution.scheduler import JobControl
from execution.worker import JobRequest, RemoteWorker, Transport, WorkerDied, run_request


@dataclass
class FakeResult:
    status: str
    outputs: dict = field(default_factory=dict)
    messages: list = field(default_factory=list)
    meta: dict = field(default_factory=dict)
    error: dict | None = None


def test_errors_name_files_relative_to_the_base_folder(tmp_path):
    base = tmp_path / "studio"

    def run(validated, *, prompt_id, extra_data, control):
        raise FileNotFoundError(f"model file {base}/models/checkpoints/x.safetensors is missing")

    outcome = run_request(lambda prompt, targets: prompt, run, JobRequest("j", {}), JobControl(), base=base)
    assert outcome.status == "error"
    assert outcome.error["exception_message"] == "model file models/checkpoints/x.safetensors is missing"
    assert str(base) not in repr(outcome.messages)


class ScriptedTransport(Transport):
    """A worker that answers "ready", then plays `script` for a run, and can be told to ignore interrupts."""

    def __init__(self, script: list, *, honours_interrupt: bool = True) -> None:
        self.script = list(script)
        self.honours_interrupt = honours_interrupt
        self.outbox: list = [("ready",)]
        self.sent: list = []
        self.killed = False
        self.lock = threading.Lock()

    def start(self) -> None:
        pass

    def send(self, message: tuple) -> None:
        if self.killed:
            raise WorkerDied("gone")
        self.sent.append(message)
        if message[0] == "run":
            self.outbox.extend(self.script)
        elif message[0] == "interrupt" and self.honours_interrupt:
            from execution.worker import interrupted_outcome

            self.outbox.append(("result", interrupted_outcome(message[1], "Interrupted", "stopped")))

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
    from execution.worker import JobOutcome

    bus, seen = EventBus(), []
    bus.subscribe(lambda event, data: seen.append(event))
    transport = ScriptedTransport([("event", "executing", {"node": "1"}), ("result", JobOutcome("success"))])
    worker = RemoteWorker(lambda: transport, bus, grace_s=5)
    outcome = worker.run(JobRequest("j", {}), JobControl())
    assert outcome.status == "success" and seen == ["executing"] and transport.sent[0][0] == "run"


def test_an_interrupt_that_is_not_honoured_kills_the_worker_after_the_grace_period():
    transports = []

    def make():
        transports.append(ScriptedTransport([("event", "executing", {"node": "1"})], honours_interrupt=False))
        return transports[-1]

    worker = RemoteWorker(make, EventBus(), grace_s=0.2)
    control = JobControl()
    threading.Timer(0.1, control.interrupt).start()
    outcome = worker.run(JobRequest("j", {}), control)
    assert outcome.killed and outcome.status == "interrupted" and outcome.error["exception_type"] == "WorkerKilled"
    assert transports[0].killed and ("interrupt", "j") in transports[0].sent
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

    from execution.jobs import JobHooks, JobRunner, JobStore

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
        assert job.status == "error" and job.attempts == 1
        assert "could not start" in job.error["exception_message"]
