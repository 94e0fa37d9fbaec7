"""Durable jobs: a server killed with SIGKILL at random moments loses no accepted job, ends each in one
record, and leaves each job's output file exactly once."""
from __future__ import annotations

import json
import os
import random
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
JOBS = 200
KILLS = 20


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """`python -m tests.web.serve --light` as a child process that can be killed and started again."""

    def __init__(self, base: Path, port: int, extra_args: tuple[str, ...] = (), start_timeout_s: float = 60) -> None:
        self.base, self.port = base, port
        self.extra_args, self.start_timeout_s = list(extra_args), start_timeout_s
        self.url = f"http://127.0.0.1:{port}"
        self.process: subprocess.Popen | None = None
        self.log = open(base / "server.log", "ab")

    def start(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.web.serve", "--light", "--base-directory", str(self.base),
             "--port", str(self.port), "--cache-none", *self.extra_args], cwd=ROOT, stdout=self.log, stderr=self.log)
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.url + "/prompt", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, OSError):
                if self.process.poll() is not None:
                    raise RuntimeError(f"server exited with {self.process.returncode}; see {self.base / 'server.log'}")
                time.sleep(0.05)
        raise TimeoutError("server did not start")

    def kill(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


def _post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url + "/prompt", data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


def test_sigkill_at_random_moments_loses_no_accepted_job(tmp_path):
    check_durability(tmp_path, Server(tmp_path, _free_port()), jobs=JOBS, server_kills=KILLS)


def _worker_pids(url: str) -> list[int]:
    with urllib.request.urlopen(url + "/system_stats", timeout=60) as response:
        workers = json.loads(response.read()).get("workers", [])
    return [int(w["pid"]) for w in workers if w.get("pid")]


def check_durability(tmp_path: Path, server: Server, *, jobs: int, server_kills: int, worker_kills: int = 0,
                     runs_logged: bool = True, seed: int = 20) -> None:
    """Submit `jobs` jobs while killing the server `server_kills` times and, between those, one of its
    workers `worker_kills` times (SIGKILL, at random moments); then every accepted job has exactly one
    record, and each success its output file exactly once."""
    rng = random.Random(seed)
    accepted: list[str] = []
    submitted = threading.Event()

    def submit() -> None:
        for index in range(jobs):
            prompt_id = str(uuid.uuid4())
            seconds = rng.choice([0.0, 0.01, 0.03, 0.08])
            body = {"prompt_id": prompt_id, "client_id": "durability", "prompt": {
                "1": {"class_type": "WebTestRecordRun", "inputs": {"value": index, "seconds": seconds}}}}
            while True:
                try:
                    status, reply = _post(server.url, body)
                except (urllib.error.URLError, ConnectionError, OSError, ValueError):
                    time.sleep(0.02)  # the server is down: send the same job (same id) again
                    continue
                if status == 200:
                    accepted.append(prompt_id)
                    break
                # Accepted before a kill cut the answer off: the retry finds the id taken.
                assert status == 400 and "already used" in reply["error"]["message"], reply
                accepted.append(prompt_id)
                break
            time.sleep(rng.uniform(0.0, 0.01))
        submitted.set()

    server.start()
    submitter = threading.Thread(target=submit, daemon=True)
    submitter.start()
    kills = ["server"] * server_kills + ["worker"] * worker_kills
    rng.shuffle(kills)
    try:
        for kind in kills:
            time.sleep(rng.uniform(0.05, 0.6))
            if kind == "server":
                server.kill()
                server.start()
                continue
            try:
                pids = _worker_pids(server.url)
            except (urllib.error.URLError, OSError):
                continue
            if pids:
                try:
                    os.kill(rng.choice(pids), signal.SIGKILL)
                except ProcessLookupError:
                    pass
        assert submitted.wait(300), "the submitter did not finish"
        deadline = time.monotonic() + 300
        while True:
            with urllib.request.urlopen(server.url + "/prompt", timeout=10) as response:
                if json.loads(response.read())["exec_info"]["queue_remaining"] == 0:
                    break
            assert time.monotonic() < deadline, "the queue never drained"
            time.sleep(0.1)
        assert len(accepted) == jobs == len(set(accepted))
        listed: dict[str, list[str]] = {}
        for prompt_id in accepted:
            with urllib.request.urlopen(f"{server.url}/history/{prompt_id}", timeout=10) as response:
                record = json.loads(response.read())[prompt_id]
            assert record["status"]["status_str"] in ("success", "error")
            listed[prompt_id] = [f"{f['subfolder']}/{f['filename']}" for f in record["outputs"].get("1", {}).get("files", [])]
    finally:
        server.stop()
    database = sqlite3.connect(tmp_path / "user" / "jobs.sqlite3")
    rows = database.execute("SELECT id, status, attempts FROM jobs").fetchall()
    database.close()
    by_id = Counter(row[0] for row in rows)
    assert all(by_id[prompt_id] == 1 for prompt_id in accepted), "a job has more than one record"
    statuses = {row[0]: row[1] for row in rows}
    attempts = {row[0]: row[2] for row in rows}
    assert {statuses[p] for p in accepted} <= {"success", "interrupted"}
    # Started at most twice (once more after a crash cut it short).
    assert all(attempts[p] <= 2 for p in accepted), {p: attempts[p] for p in accepted if attempts[p] > 2}
    if runs_logged:  # the node's own log of its starts (a Ray worker writes it in its scratch folder)
        runs = Counter((tmp_path / "output" / "runs.log").read_text().split())
        for prompt_id in accepted:
            assert runs[prompt_id] <= 2, (prompt_id, runs[prompt_id])
            if statuses[prompt_id] == "success":
                assert runs[prompt_id] >= 1
    assert sum(1 for p in accepted if statuses[p] == "success") >= jobs - len(kills)
    # Every job's output exists exactly once: a retried job left nothing of its cut-short attempt.
    output = tmp_path / "output"
    files = sorted(p.relative_to(output).as_posix() for p in (output / "runs").rglob("*") if p.is_file())
    owners = Counter((output / f).read_text() for f in files)
    for prompt_id in accepted:
        if statuses[prompt_id] == "success":
            assert len(listed[prompt_id]) == 1 and owners[prompt_id] == 1, (prompt_id, owners[prompt_id])
            assert (output / listed[prompt_id][0]).read_text() == prompt_id
        else:
            assert listed[prompt_id] == [] and owners[prompt_id] == 0
    assert len(files) == sum(1 for p in accepted if statuses[p] == "success")
