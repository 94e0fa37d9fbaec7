"""A local Ray pool (`--workers 2`) as a real server process: it listens on loopback only, its
processes die with a SIGKILLed server, a restarted server ends what a dead one left, and under random
SIGKILLs of the server and of its workers every job still ends in exactly one record with its output
once."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

pytest.importorskip("ray")

from cluster.ray_pool import LOCAL_POOL_RECORD  # noqa: E402
from tests.web.test_durability import ROOT, Server, _free_port, check_durability  # noqa: E402

RAY_START_S = 240  # a local Ray and two actors start in 10-60 s on a busy two-core machine
LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}


def _pool_server(base: Path) -> Server:
    return Server(base, _free_port(), ("--workers", "2", "--worker-threads", "1"), start_timeout_s=RAY_START_S)


def _run_jobs(url: str, count: int = 4) -> None:
    """Run `count` short jobs to their records (the pool's actors are up once they have)."""
    from tests.web.conftest import post_json, wait_terminal

    ids = []
    for value in range(count):
        status, reply = post_json(url + "/prompt", {"prompt": {
            "1": {"class_type": "WebTestRecordRun", "inputs": {"value": value, "seconds": 0.0}}}})
        assert status == 200, reply
        ids.append(reply["prompt_id"])
    for prompt_id in ids:
        assert wait_terminal(url, prompt_id, RAY_START_S)["status"]["status_str"] == "success"


def _listening(processes: list[psutil.Process]) -> dict[int, set[str]]:
    found = {}
    for process in processes:
        try:
            addresses = {c.laddr.ip for c in process.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}
        except psutil.Error:
            continue
        if addresses:
            found[process.pid] = addresses
    return found


def test_local_pool_binds_loopback_and_dies_with_its_server(tmp_path):
    server = _pool_server(tmp_path)
    server.start()
    try:
        _run_jobs(server.url)
        time.sleep(2)  # the reaper's record follows the process tree once a second
        tree = psutil.Process(server.process.pid).children(recursive=True)
        listening = _listening(tree)
        assert listening, "no Ray process was found listening"
        beyond = {pid: addresses - LOOPBACK for pid, addresses in listening.items() if addresses - LOOPBACK}
        assert not beyond, f"Ray listens beyond loopback: {beyond}"
        record = tmp_path / "user" / LOCAL_POOL_RECORD
        recorded = {entry["pid"] for entry in json.loads(record.read_text())}
        assert {p.pid for p in tree} - {server.process.pid} - recorded <= {p.pid for p in tree if "reaper" in
                                                                        " ".join(p.cmdline())}
        server.kill()
        deadline = time.monotonic() + 60
        while True:
            alive = [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
            if not alive:
                break
            assert time.monotonic() < deadline, f"outlived a SIGKILLed server: {[(p.pid, p.name()) for p in alive]}"
            time.sleep(0.5)
        # Whatever escapes anyway (here: a stand-in process in the record) is ended by the next server.
        leftover = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        record.write_text(json.dumps([{"pid": leftover.pid,
                                       "create_time": psutil.Process(leftover.pid).create_time()}]))
        server.start()
        assert leftover.wait(RAY_START_S) == -signal.SIGKILL
    finally:
        server.stop()


def test_durability_with_two_local_ray_workers(tmp_path):
    # Server kills restart Ray each time (tens of seconds here), so fewer kills than the single worker's test.
    check_durability(tmp_path, _pool_server(tmp_path), jobs=40, server_kills=3, worker_kills=5, runs_logged=False,
                     seed=32)


def test_a_quiet_start_and_stop_with_workers_ready_before_any_job(tmp_path):
    """A user's `--workers 1` start and Ctrl-C: the worker reports ready with no job sent, the terminal shows
    neither Ray's token notice nor a traceback nor a leaked-resource warning, and the temporary folder
    keeps no `weft-ray-*` scratch folder afterwards."""
    import shutil
    import tempfile

    temp = Path(tempfile.mkdtemp(prefix="wq"))  # short: Ray's socket paths under it must stay under 108 bytes
    port = _free_port()
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "tests.web.serve", "--light", "--base-directory", str(tmp_path), "--port",
             str(port), "--workers", "1", "--worker-threads", "1"], cwd=ROOT, stdout=log, stderr=log,
            env={**os.environ, "TMPDIR": str(temp)}, start_new_session=True)
        try:
            deadline = time.monotonic() + RAY_START_S
            workers: list = []
            while time.monotonic() < deadline and not (workers and all(w["ready"] for w in workers)):
                time.sleep(0.5)
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/system_stats", timeout=5) as response:
                        workers = json.loads(response.read())["workers"]
                except OSError:
                    pass
                assert process.poll() is None, log_path.read_text(errors="replace")
            assert workers and all(w["ready"] and w.get("pid") for w in workers), workers
            assert any(p.name.startswith("weft-ray-") for p in temp.iterdir())  # the actor's scratch, while up
        finally:
            try:
                os.killpg(process.pid, signal.SIGINT)  # what Ctrl-C in its terminal sends: the whole group
            except ProcessLookupError:  # it ended by itself (the assertion above says why)
                pass
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    text = log_path.read_text(errors="replace")
    left = [p.name for p in temp.iterdir() if p.name.startswith("weft-ray-")]
    shutil.rmtree(temp, ignore_errors=True)
    for noise in ("Token authentication is enabled", "Traceback", "leaked semaphore", "KeyboardInterrupt"):
        assert noise not in text, text
    assert not left
