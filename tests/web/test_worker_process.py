"""Jobs run in a worker process: the server answers while any node runs, and a node that never
yields is stopped by killing its worker after the grace period."""
from __future__ import annotations

import asyncio
import json
import sqlite3
import time

import aiohttp
import pytest

from tests.web.conftest import const_prompt, get_json, http, new_id, post_json, wait_terminal
from tests.web.serve import ServerThread

GRACE_S = 1.0


@pytest.fixture(scope="module")
def worker_server(tmp_path_factory):
    """A light server whose interrupt grace is one second."""
    running = ServerThread(tmp_path_factory.mktemp("worker"), light=True,
                           extra_args=["--interrupt-grace", str(GRACE_S)])
    yield running
    running.stop()


def _timed_get(url: str) -> tuple[float, dict]:
    started = time.monotonic()
    status, body = get_json(url, timeout=30)
    assert status == 200
    return time.monotonic() - started, body


def _store_rows(server, prompt_id: str) -> list[tuple]:
    database = sqlite3.connect(server.runtime.paths.user / "jobs.sqlite3")
    try:
        return database.execute("SELECT status, attempts FROM jobs WHERE id=?", (prompt_id,)).fetchall()
    finally:
        database.close()


def test_math_expression_runaway_is_refused_at_once(server):
    prompt = {"1": {"class_type": "TestConst", "inputs": {"value": 9}},
              "2": {"class_type": "ComfyMathExpression", "inputs": {"expression": "(a**9999)**2500", "values.a": ["1", 0]}},
              "3": {"class_type": "PreviewAny", "inputs": {"source": ["2", 1]}}}
    status, reply = post_json(server.url + "/prompt", {"prompt": prompt})
    assert status == 200, reply
    record = wait_terminal(server.url, reply["prompt_id"], timeout=60)
    error = dict(record["status"]["messages"])["execution_error"]
    assert "4096 bits" in error["exception_message"] and error["node_id"] == "2"


def test_server_answers_while_a_node_holds_its_process_and_the_job_ends_interrupted(worker_server):
    url = worker_server.url
    prompt_id = new_id()

    async def watch_events(events: list, ready: asyncio.Event):
        async with aiohttp.ClientSession() as session:
            async with session.ws_connect(f"{url}/ws?clientId=runaway-watcher") as ws:
                ready.set()
                async for message in ws:
                    if message.type != aiohttp.WSMsgType.TEXT:
                        continue
                    data = json.loads(message.data)
                    if data["data"].get("prompt_id") == prompt_id:
                        events.append(data["type"])
                        if data["type"] == "executing" and data["data"]["node"] is None:
                            return

    async def scenario():
        events: list[str] = []
        ready = asyncio.Event()
        watcher = asyncio.ensure_future(watch_events(events, ready))
        await ready.wait()
        loop = asyncio.get_running_loop()
        body = {"prompt_id": prompt_id, "client_id": "runaway-watcher",
                "prompt": {"1": {"class_type": "WebTestRunaway", "inputs": {"digits": 30_000_000}}}}
        status, reply = await loop.run_in_executor(None, post_json, url + "/prompt", body)
        assert status == 200, reply
        deadline = time.monotonic() + 60
        while True:  # wait until the node runs (its worker may still be starting)
            _, queue = await loop.run_in_executor(None, _timed_get, url + "/queue")
            if [j[1] for j in queue["queue_running"]] == [prompt_id] and "executing" in events:
                break
            assert time.monotonic() < deadline, "the runaway job never started"
            await asyncio.sleep(0.05)
        for route in ("/queue", "/history", "/prompt", f"/history/{prompt_id}"):
            seconds, _ = await loop.run_in_executor(None, _timed_get, url + route)
            assert seconds < 1.0, (route, seconds)
        started = time.monotonic()
        status, reply = await loop.run_in_executor(None, post_json, url + "/interrupt", {})
        assert status == 200 and reply == {"interrupted": True}
        assert time.monotonic() - started < 1.0
        record = await loop.run_in_executor(None, wait_terminal, url, prompt_id, 60)
        await asyncio.wait_for(watcher, 30)
        return record, events

    record, events = asyncio.run(scenario())
    assert record["status"]["status_str"] == "error"
    interrupted = dict(record["status"]["messages"])["execution_interrupted"]
    assert interrupted["exception_type"] == "WorkerKilled" and f"{GRACE_S:g} s" in interrupted["exception_message"]
    assert _store_rows(worker_server, prompt_id) == [("interrupted", 1)]  # one record, one attempt
    assert events[-2:] == ["execution_interrupted", "executing"]
    # The file it wrote before the runaway step was under a staging name, and is gone with its worker.
    assert not list((worker_server.runtime.paths.output / "runaway").iterdir())
    # A fresh worker takes the next job.
    status, reply = post_json(url + "/prompt", {"prompt": const_prompt(5, "after")})
    assert status == 200
    after = wait_terminal(url, reply["prompt_id"], timeout=60)
    assert after["status"]["status_str"] == "success" and after["outputs"]["2"]["values"] == [5]


def test_a_worker_that_dies_on_its_own_is_retried_once_then_the_job_is_interrupted(worker_server):
    url = worker_server.url
    prompt_id = new_id()
    status, reply = post_json(url + "/prompt", {"prompt_id": prompt_id,
                                                "prompt": {"1": {"class_type": "WebTestCrash", "inputs": {"code": 3}}}})
    assert status == 200, reply
    record = wait_terminal(url, prompt_id, timeout=120)
    assert record["status"]["status_str"] == "error"
    interrupted = dict(record["status"]["messages"])["execution_interrupted"]
    assert "worker process died 2 times" in interrupted["exception_message"]
    assert _store_rows(worker_server, prompt_id) == [("interrupted", 2)]
    runs = (worker_server.runtime.paths.output / "crashes.log").read_text().split()
    assert runs.count(prompt_id) == 2
    status, reply = post_json(url + "/prompt", {"prompt": const_prompt(6, "later")})
    assert wait_terminal(url, reply["prompt_id"], timeout=60)["status"]["status_str"] == "success"


def test_a_running_jobs_output_is_served_before_it_gets_its_final_name(worker_server):
    url = worker_server.url
    runs = worker_server.runtime.paths.output / "runs"

    def names() -> set[str]:  # files written, not the temporary `.part` a write goes through
        return {p.name for p in runs.iterdir() if not p.name.endswith(".part")} if runs.is_dir() else set()

    before = names()
    prompt_id = new_id()
    status, reply = post_json(url + "/prompt", {"prompt_id": prompt_id, "prompt": {
        "1": {"class_type": "WebTestRecordRun", "inputs": {"value": 1, "seconds": 3.0}}}})
    assert status == 200, reply
    deadline = time.monotonic() + 60
    while not names() - before:
        assert time.monotonic() < deadline, "the job never wrote its file"
        time.sleep(0.02)
    [written] = sorted(names() - before)
    final = written.split("-", 3)[-1] if written.startswith(".weft-staged-") else written
    assert written != final, "the running job's file already had its final name"
    status, _, body = http("GET", f"{url}/view?filename={final}&subfolder=runs")
    assert status == 200 and body == prompt_id.encode()
    record = wait_terminal(url, prompt_id, timeout=60)
    assert record["outputs"]["1"]["files"] == [{"filename": final, "subfolder": "runs", "type": "output"}]
    assert sorted(names() - before) == [final]
