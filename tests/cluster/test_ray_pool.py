"""The worker pool on a local Ray instance (2 CPU workers, loopback only): every job ends in one record,
outputs match a single-process run, routing by model affinity and model files, a killed worker, an
interrupt, events in order on the websocket, and the worker named in the profile and /system_stats."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import time

import aiohttp
import pytest
import ray

from execution.worker import RuntimeRecipe
from tests.cluster.cluster_nodes import ClusterRuntime
from tests.web.conftest import get_json, new_id, post_json, wait_terminal
from tests.web.serve import ServerThread

JOBS = 40
MODEL_BYTES = {"shared.safetensors": 64, "only0.safetensors": 96, "nowhere.safetensors": 32}


def write_prompt(value: int, seconds: float = 0.05, steps: int = 2) -> dict:
    return {"1": {"class_type": "ClusterWrite", "inputs": {"value": value, "seconds": seconds, "steps": steps}}}


def model_prompt(name: str, value: int) -> dict:
    return {"1": {"class_type": "ClusterModel", "inputs": {"ckpt_name": name, "value": value}}}


def make_models(base, names) -> None:
    folder = base / "models" / "checkpoints"
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        (folder / name).write_bytes(b"\0" * MODEL_BYTES[name])


def submit(url: str, prompt: dict, **extra) -> str:
    prompt_id = extra.pop("prompt_id", None) or new_id()
    status, reply = post_json(url + "/prompt", {"prompt": prompt, "prompt_id": prompt_id, **extra})
    assert status == 200, reply
    return prompt_id


def outputs_by_value(server, records: dict[int, dict]) -> dict[int, bytes]:
    """value -> the bytes of the one file the job wrote (as the server's output folder holds it)."""
    found = {}
    for value, record in records.items():
        [item] = record["outputs"]["1"]["files"]
        found[value] = (server.runtime.paths.output / item["subfolder"] / item["filename"]).read_bytes()
    return found


def store_rows(server) -> dict[str, tuple]:
    database = sqlite3.connect(server.runtime.paths.user / "jobs.sqlite3")
    try:
        return {row[0]: row[1:] for row in database.execute("SELECT id, status, attempts, worker FROM jobs")}
    finally:
        database.close()


def job_worker(server, prompt_id: str) -> str:
    status, detail = get_json(f"{server.url}/jobs/{prompt_id}")
    assert status == 200
    return detail["worker"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The 40 jobs on a single-process server (before the pool's server sets the folders nodes list)."""
    running = ServerThread(tmp_path_factory.mktemp("single"), light=True, extra_args=["--in-process-jobs"])
    running.runtime.registry.register_all(__import__("tests.cluster.cluster_nodes", fromlist=["x"]).CLUSTER_NODES,
                                          origin="tests.cluster.cluster_nodes")
    try:
        ids = {value: submit(running.url, write_prompt(value, 0.0)) for value in range(JOBS)}
        records = {value: wait_terminal(running.url, prompt_id, 60) for value, prompt_id in ids.items()}
        names = sorted(r["outputs"]["1"]["files"][0]["filename"] for r in records.values())
        yield outputs_by_value(running, records), names
    finally:
        running.stop()


@pytest.fixture(scope="module")
def pool(tmp_path_factory, reference):
    """One local Ray (2 CPUs, 100 MB object store) and a server with two Ray workers: worker 0 has the
    shared and the only0 model files, worker 1 only the shared one; the server has all three."""
    from cluster.ray_pool import ray_pool, start_ray

    root = tmp_path_factory.mktemp("pool")
    front, bases = root / "front", [root / "w0", root / "w1"]
    make_models(front, MODEL_BYTES)
    make_models(bases[0], ["shared.safetensors", "only0.safetensors"])
    make_models(bases[1], ["shared.safetensors"])
    started = start_ray(None, num_cpus=2, object_store_bytes=100 * 2**20)
    scratch = root / "scratch"
    scratch.mkdir()

    def build_pool(runtime, config):
        recipes = []
        for base in bases:
            args = type(config.worker_recipe.args)(**vars(config.worker_recipe.args))
            args.base_directory = base
            recipes.append(RuntimeRecipe(ClusterRuntime, args))
        return ray_pool(runtime, recipes, grace_s=2.0, scratch_root=str(scratch), threads=1)

    def configure(config):
        config.worker_pool = build_pool

    running = ServerThread(front, light=True, config_changes=configure)
    running.runtime.registry.register_all(
        __import__("tests.cluster.cluster_nodes", fromlist=["x"]).CLUSTER_NODES, origin="tests.cluster.cluster_nodes")
    try:
        yield running
    finally:
        running.stop()
        if started:
            started()


def wait_idle(server, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while server.state.store.queue_remaining() or not all(s.assigned is None for s in server.state.runner.slots):
        assert time.monotonic() < deadline, "the pool never went idle"
        time.sleep(0.02)


def test_forty_jobs_each_end_once_with_the_single_process_outputs(pool, reference):
    expected, expected_names = reference
    ids = {value: submit(pool.url, write_prompt(value)) for value in range(JOBS)}
    records = {value: wait_terminal(pool.url, prompt_id, 120) for value, prompt_id in ids.items()}
    assert all(r["status"]["status_str"] == "success" for r in records.values())
    assert outputs_by_value(pool, records) == expected
    assert sorted(r["outputs"]["1"]["files"][0]["filename"] for r in records.values()) == expected_names
    rows = store_rows(pool)
    assert [rows[i][:2] for i in ids.values()] == [("success", 1)] * JOBS
    assert {rows[i][2] for i in ids.values()} == {"ray-0", "ray-1"}  # both workers ran jobs
    written = sorted(p.name for p in (pool.runtime.paths.output / "cluster").iterdir())
    assert written == expected_names  # nothing staged or half-written is left, nothing twice


def test_a_job_goes_to_the_idle_worker_that_holds_its_model(pool):
    wait_idle(pool)
    pool.state.runner.free(unload_models=True)
    wait_idle(pool)
    busy = submit(pool.url, write_prompt(900, seconds=1.5))  # ray-0 (first in order) takes it
    deadline = time.monotonic() + 30
    while job_worker(pool, busy) is None:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    first = submit(pool.url, model_prompt("shared.safetensors", 901))  # only ray-1 is idle
    wait_terminal(pool.url, first, 60)
    wait_terminal(pool.url, busy, 60)
    assert job_worker(pool, busy) == "ray-0" and job_worker(pool, first) == "ray-1"
    wait_idle(pool)
    again = submit(pool.url, model_prompt("shared.safetensors", 902))  # both idle: ray-1 holds the model
    record = wait_terminal(pool.url, again, 60)
    assert record["status"]["status_str"] == "success" and job_worker(pool, again) == "ray-1"


def test_a_worker_lacking_a_model_file_is_skipped_and_a_file_no_worker_has_fails_the_job(pool):
    wait_idle(pool)
    busy = submit(pool.url, write_prompt(910, seconds=1.5))
    deadline = time.monotonic() + 30
    while job_worker(pool, busy) is None:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    holder = job_worker(pool, busy)
    if holder != "ray-0":  # the job that needs only0 must wait for ray-0, never go to ray-1
        pytest.fail(f"expected ray-0 to take the first job, got {holder}")
    needs_only0 = submit(pool.url, model_prompt("only0.safetensors", 911))
    record = wait_terminal(pool.url, needs_only0, 60)
    assert record["status"]["status_str"] == "success" and record["outputs"]["1"]["model_bytes"] == [96]
    assert job_worker(pool, needs_only0) == "ray-0"
    nowhere = submit(pool.url, model_prompt("nowhere.safetensors", 912))
    record = wait_terminal(pool.url, nowhere, 60)
    error = dict(record["status"]["messages"])["execution_error"]
    assert "'nowhere.safetensors'" in error["exception_message"] and "none of its 2 workers" in error["exception_message"]


def test_input_files_travel_to_the_worker(pool):
    (pool.runtime.paths.input / "note.txt").write_bytes(b"from the front door\n")
    prompt_id = submit(pool.url, {"1": {"class_type": "ClusterCopyInput", "inputs": {"source": "note.txt", "value": 1}}})
    record = wait_terminal(pool.url, prompt_id, 60)
    assert record["status"]["status_str"] == "success", record
    [item] = record["outputs"]["1"]["files"]
    assert (pool.runtime.paths.output / item["subfolder"] / item["filename"]).read_bytes() == b"from the front door\n"


def test_an_output_that_does_not_pickle_still_reaches_the_record(pool):
    prompt_id = submit(pool.url, {"1": {"class_type": "ClusterOddOutput", "inputs": {"value": 5}}})
    record = wait_terminal(pool.url, prompt_id, 60)
    assert record["status"]["status_str"] == "success" and record["outputs"]["1"]["values"] == [5]
    assert record["outputs"]["1"]["odd"][0].startswith("<function")
    assert store_rows(pool)[prompt_id][:2] == ("success", 1)


def test_a_worker_killed_mid_job_has_its_job_retried_once_and_nothing_else_lost_or_repeated(pool):
    wait_idle(pool)
    before = set((pool.runtime.paths.output / "cluster").iterdir())
    ids = {value: submit(pool.url, write_prompt(value, seconds=1.0)) for value in range(1000, 1006)}
    runner = pool.state.runner
    deadline = time.monotonic() + 30
    while True:
        victim = next((s for s in runner.slots if s.running is not None and s.name == "ray-1"), None)
        if victim is not None and victim.worker.ready:
            break
        assert time.monotonic() < deadline, "ray-1 never took a job"
        time.sleep(0.01)
    os.kill(victim.worker.transport.pid(), signal.SIGKILL)
    records = {value: wait_terminal(pool.url, prompt_id, 120) for value, prompt_id in ids.items()}
    assert all(r["status"]["status_str"] == "success" for r in records.values()), records
    rows = store_rows(pool)
    retried = [i for i in ids.values() if rows[i][1] == 2]
    assert len(retried) == 1  # the job ray-1 was running: started once more, once
    assert {i: rows[i][:2] for i in ids.values()} == {
        i: ("success", 2 if i in retried else 1) for i in ids.values()}
    made = set((pool.runtime.paths.output / "cluster").iterdir()) - before
    assert sorted(p.read_bytes() for p in made) == sorted(outputs_by_value(pool, records).values())
    assert len(made) == len(ids)  # one file per job: the killed attempt left nothing
    wait_idle(pool)
    assert runner.slots[1].worker.restarts == 1
    after = submit(pool.url, write_prompt(1100, 0.0))
    assert wait_terminal(pool.url, after, 60)["status"]["status_str"] == "success"


def test_events_of_a_workers_job_reach_the_websocket_in_order_and_an_interrupt_stops_it(pool):
    url = pool.url
    done_id, stopped_id = new_id(), new_id()
    restarts = [s.worker.restarts for s in pool.state.runner.slots]

    async def scenario():
        seen: dict[str, list] = {done_id: [], stopped_id: []}
        async with aiohttp.ClientSession() as session:
            async with session.ws_connect(f"{url}/ws?clientId=pool-watcher") as ws:
                loop = asyncio.get_running_loop()
                await loop.run_in_executor(None, lambda: submit(url, write_prompt(1200, 0.3, steps=3),
                                                                prompt_id=done_id, client_id="pool-watcher"))
                await loop.run_in_executor(None, lambda: submit(url, write_prompt(1201, 60.0, steps=3),
                                                                prompt_id=stopped_id, client_id="pool-watcher"))
                finished = set()
                interrupted_sent = False
                async for message in ws:
                    if message.type == aiohttp.WSMsgType.BINARY:
                        seen.setdefault("binary", []).append(message.data[:4])
                        continue
                    data = json.loads(message.data)
                    prompt_id = data["data"].get("prompt_id")
                    if prompt_id not in (done_id, stopped_id):
                        continue
                    seen[prompt_id].append((data["type"], data["data"]))
                    if prompt_id == stopped_id and data["type"] == "executing" and data["data"]["node"] == "1" \
                            and not interrupted_sent:
                        interrupted_sent = True
                        status, reply = await loop.run_in_executor(
                            None, post_json, url + "/interrupt", {"prompt_id": stopped_id})
                        assert status == 200 and reply == {"interrupted": True}
                    if data["type"] == "executing" and data["data"]["node"] is None:
                        finished.add(prompt_id)
                        if finished == {done_id, stopped_id}:
                            return seen

    seen = asyncio.run(asyncio.wait_for(scenario(), 90))
    types = [t for t, _ in seen[done_id]]
    assert types[0] == "execution_start" and types[-2:] == ["execution_success", "executing"]
    assert [d["value"] for t, d in seen[done_id] if t == "progress"] == [1, 2, 3]
    assert types.index("executed") > max(i for i, t in enumerate(types) if t == "progress")
    [executed] = [d for t, d in seen[done_id] if t == "executed"]
    record = wait_terminal(url, done_id, 30)
    assert executed["output"]["files"] == record["outputs"]["1"]["files"]  # the name the front door gave
    assert seen.get("binary")  # progress texts came as binary frames
    stopped = [t for t, _ in seen[stopped_id]]
    assert stopped[-2:] == ["execution_interrupted", "executing"]
    assert store_rows(pool)[stopped_id][:2] == ("cancelled", 1)
    assert [s.worker.restarts for s in pool.state.runner.slots] == restarts  # the interrupt killed nothing


def test_profile_and_system_stats_name_the_worker(pool):
    prompt_id = submit(pool.url, write_prompt(1300, 0.0))
    wait_terminal(pool.url, prompt_id, 60)
    status, detail = get_json(f"{pool.url}/jobs/{prompt_id}")
    assert status == 200 and detail["worker"] in ("ray-0", "ray-1")
    assert detail["profile"]["worker"] == detail["worker"]
    assert detail["profile"]["nodes"]["1"]["class_type"] == "ClusterWrite"
    status, stats = get_json(f"{pool.url}/system_stats")
    assert status == 200
    workers = {w["name"]: w for w in stats["workers"]}
    assert sorted(workers) == ["ray-0", "ray-1"]
    for row in workers.values():
        assert row["kind"] == "ray" and row["node"] and row["pid"] > 0 and row["devices"] == ["cpu"]
        assert row["jobs_run"] > 0 and row["state"] in ("idle", "running")
