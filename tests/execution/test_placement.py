"""The choice of worker in a pool, the files a prompt names, and settling that spares other workers' jobs."""
from __future__ import annotations

import threading
import time

from execution.job_runner import JobHooks, JobRunner
from execution.job_store import JobStore
from execution.paths import Paths, settle_staged, staging_token
from execution.placement import Candidate, choose, named_files
from execution.scheduler import JobControl
from execution.worker import JobOutcome, Worker
from nodes.registry import builtin_registry

SHARED, OTHER = ("checkpoints", "a.safetensors"), ("vae", "b.safetensors")


def test_the_rule_prefers_ready_then_held_models_then_least_held_then_not_where_it_died():
    plain = Candidate(0, True)
    holder = Candidate(1, True, held={SHARED: 100})
    assert choose([plain, holder], [SHARED]).index == 1  # affinity beats the pool's order
    assert choose([plain, holder], [OTHER]).index == 0  # otherwise the cheapest eviction
    starting = Candidate(1, False, held={SHARED: 100})
    assert choose([plain, starting], [SHARED]).index == 0  # a worker that is up goes first
    assert choose([Candidate(0, True, died_on_last_attempt=True), Candidate(1, True)], []).index == 1
    lacking = Candidate(1, True, held={SHARED: 100}, missing=(OTHER,))
    assert choose([plain, lacking], [SHARED, OTHER]).index == 0
    assert choose([lacking], [SHARED, OTHER]) is None


def test_named_files_are_the_file_choices_a_prompt_makes(tmp_path):
    from execution import context as run_context

    paths = Paths(tmp_path).ensure()
    run_context.configure(paths)
    (paths.models / "vae" / "v.safetensors").write_bytes(b"x")
    (paths.input / "clip.png").write_bytes(b"png")
    prompt = {"1": {"class_type": "VAELoader", "inputs": {"vae_name": "v.safetensors"}},
              "2": {"class_type": "LoadImage", "inputs": {"image": "clip.png [input]"}},
              "3": {"class_type": "LoadImage", "inputs": {"image": "absent.png"}},
              "4": {"class_type": "PrimitiveString", "inputs": {"value": "v.safetensors"}}}
    found = named_files(prompt, builtin_registry(), paths)
    assert found.models == (("vae", "v.safetensors"),) and found.media == (("input", "clip.png"),)


def test_settling_keeps_the_staged_files_of_jobs_still_running(tmp_path):
    mine, theirs = tmp_path / f".weft-staged-{staging_token('dead')}-a.png", \
        tmp_path / f".weft-staged-{staging_token('alive')}-b.png"
    mine.write_bytes(b"1")
    theirs.write_bytes(b"2")
    report = settle_staged([tmp_path], set(), keep={staging_token("alive")})
    assert report == {"committed": 0, "removed": 1} and theirs.exists() and not mine.exists()


class HeldWorker(Worker):
    """Runs a job by waiting on its gate; records which jobs it ran."""

    def __init__(self, name: str, gates: dict) -> None:
        self.name, self.gates, self.ran = name, gates, []

    def start(self) -> None:
        pass

    def run(self, request, control, *, validated=None, handed_over=None) -> JobOutcome:
        handed_over()
        self.ran.append(request.prompt_id)
        self.gates[request.prompt_id].wait(10)
        return JobOutcome("success", profile={"1": {"class_type": "X"}})

    def free(self, unload_models: bool) -> None:
        pass

    def stop(self, timeout: float = 30.0) -> None:
        pass


def test_two_workers_run_two_jobs_at_once_and_each_record_names_its_worker(tmp_path):
    store = JobStore(tmp_path / "jobs.sqlite3")
    gates = {name: threading.Event() for name in ("a", "b", "c")}
    workers = [HeldWorker("w0", gates), HeldWorker("w1", gates)]
    runner = JobRunner(store, JobHooks(validate=None, run=None, make_control=JobControl), workers=workers)
    for number, name in enumerate(("a", "b", "c")):
        store.add(name, {}, number=number)
    runner.start()
    deadline = time.monotonic() + 10
    while len(runner.running()) < 2:  # a and b run together; c waits for a free worker
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert store.get("c").status == "pending"
    for gate in gates.values():
        gate.set()
    while store.get("c").status != "success":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    runner.stop()
    assert {store.get(n).worker for n in "ab"} == {"w0", "w1"}
    assert store.get("a").profile == {"worker": store.get("a").worker, "nodes": {"1": {"class_type": "X"}}}
    assert sorted(workers[0].ran + workers[1].ran) == ["a", "b", "c"]
