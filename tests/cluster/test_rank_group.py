"""A rank group of 2 local processes as the server's one worker (--ranks-per-worker 2, no Ray).

The official text-to-video template (tiny released-format models) runs end to end through the server on
the group with the events and outputs of a single worker's run; /system_stats shows the group and its
ranks; a rank killed mid-job is the worker lost (the job is retried once, on a fresh group, and ends
once), and the next job runs.
"""
from __future__ import annotations

import os
import signal
import sqlite3
import time

import av
import numpy
import pytest

from cluster.rank_group import local_group_pool
from execution.convert import ui_to_api
from tests.official_templates import T2V, official_template
from tests.test_templates import fit_to_tiny, link_tree, nodes_of
from tests.web.conftest import get_json, new_id, post_json, wait_terminal
from tests.web.serve import ServerThread

RANKS = 2
JOB_TIMEOUT_S = 900


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    from models.h3.tiny_released import write_released

    root = tmp_path_factory.mktemp("released_models")
    write_released(root)
    return root


def _server(base, released, *, group: bool) -> ServerThread:
    link_tree(released, base / "models")

    def changes(config):
        config.worker_pool = local_group_pool(RANKS, timeout_s=60)
    return ServerThread(base, config_changes=changes if group else None)


@pytest.fixture(scope="module")
def single(tmp_path_factory, released):
    server = _server(tmp_path_factory.mktemp("single"), released, group=False)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def grouped(tmp_path_factory, released):
    server = _server(tmp_path_factory.mktemp("group"), released, group=True)
    try:
        yield server
    finally:
        server.stop()


def t2v_prompt(server) -> dict:
    prompt = ui_to_api(official_template(T2V), server.runtime.registry)
    fit_to_tiny(prompt, turbo=False)
    return prompt


def submit(server, prompt: dict) -> str:
    prompt_id = new_id()
    status, reply = post_json(server.url + "/prompt", {"prompt": prompt, "prompt_id": prompt_id})
    assert status == 200, reply
    return prompt_id


def frames_of(server, record: dict, node: str) -> numpy.ndarray:
    [item] = [f for f in record["outputs"][node].get("images", []) + record["outputs"][node].get("files", [])
              if f.get("filename", "").endswith(".mp4")] or record["outputs"][node]["images"]
    path = server.runtime.paths.output / item["subfolder"] / item["filename"]
    with av.open(str(path)) as container:
        return numpy.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)])


def event_names(record: dict) -> list[str]:
    return [message[0] for message in record["status"]["messages"]]


def attempts(server, prompt_id: str) -> int:
    database = sqlite3.connect(server.runtime.paths.user / "jobs.sqlite3")
    try:
        return database.execute("SELECT attempts FROM jobs WHERE id = ?", (prompt_id,)).fetchone()[0]
    finally:
        database.close()


def test_the_t2v_template_runs_on_the_group_with_a_single_workers_events_and_outputs(single, grouped):
    records, ids = {}, {}
    for name, server in (("single", single), ("group", grouped)):
        prompt = t2v_prompt(server)
        ids[name] = submit(server, prompt)
        records[name] = (server, wait_terminal(server.url, ids[name], JOB_TIMEOUT_S), prompt)
    (_, one, prompt), (_, group, _) = records["single"], records["group"]
    assert one["status"]["status_str"] == "success", one["status"]
    assert group["status"]["status_str"] == "success", group["status"]
    assert event_names(group) == event_names(one)
    # The profile names the group and its ranks.
    status, detail = get_json(f"{grouped.url}/jobs/{ids['group']}")
    assert detail["worker"] == "group-0", detail
    assert [r["rank"] for r in detail["profile"]["ranks"]] == [0, 1], detail["profile"].keys()
    assert sorted(group["outputs"]) == sorted(one["outputs"])
    (save,) = nodes_of(prompt, "SaveVideo")
    frames_one, frames_group = frames_of(single, one, save), frames_of(grouped, group, save)
    assert frames_one.shape == frames_group.shape
    # Each rank computes with its own threads, so rounding may differ a little from the single process.
    assert numpy.abs(frames_one.astype(int) - frames_group.astype(int)).mean() < 1.0


def test_system_stats_show_the_group_and_its_ranks(grouped):
    status, stats = get_json(grouped.url + "/system_stats")
    assert status == 200
    [worker] = stats["workers"]
    assert "rank group of 2" in worker["kind"]
    assert worker["ranks"] == RANKS and [r["rank"] for r in worker["rank_processes"]] == [0, 1]


def long_t2v_prompt(server, steps: int = 24) -> dict:
    """The tiny T2V run with many more sampling steps: long enough that a kill lands inside it on any machine."""
    prompt = t2v_prompt(server)
    for node_id in nodes_of(prompt, "PrimitiveInt"):
        prompt[node_id]["inputs"]["value"] = steps
    return prompt


def rank_pids(server) -> list[int] | None:
    """The group's rank process ids once the group is up, else None (it starts with its first job)."""
    status, stats = get_json(server.url + "/system_stats")
    ranks = stats["workers"][0].get("rank_processes") or []
    pids = [r.get("pid") for r in ranks]
    return pids if len(pids) == RANKS and all(pids) else None


def test_a_rank_killed_mid_job_is_the_worker_lost_and_the_next_job_runs(grouped):
    prompt_id = submit(grouped, long_t2v_prompt(grouped))
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while prompt_id not in {job.id for job in grouped.state.store.active()[0]} or rank_pids(grouped) is None:
        assert time.monotonic() < deadline, "the job never started on a group"
        time.sleep(0.05)
    rank1 = rank_pids(grouped)[1]
    time.sleep(1.0)  # inside the job (loading or sampling its 24 steps): the rank dies while it holds the job
    os.kill(rank1, signal.SIGKILL)
    record = wait_terminal(grouped.url, prompt_id, JOB_TIMEOUT_S)
    assert record["status"]["status_str"] == "success", record["status"]
    assert attempts(grouped, prompt_id) == 2
    # The fresh group has other processes; the next job runs on it.
    status, stats = get_json(grouped.url + "/system_stats")
    assert stats["workers"][0]["rank_processes"][1]["pid"] != rank1
    following = wait_terminal(grouped.url, submit(grouped, t2v_prompt(grouped)), JOB_TIMEOUT_S)
    assert following["status"]["status_str"] == "success", following["status"]
