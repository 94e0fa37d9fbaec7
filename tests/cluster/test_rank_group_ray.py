"""A rank group of 2 Ray actors (local Ray on 127.0.0.1, 2 CPUs, one placement group) as the server's one
worker: the official text-to-video template runs end to end through the server with a single worker's
events and outputs, and /system_stats shows the group and its ranks."""
from __future__ import annotations

import numpy
import pytest

ray = pytest.importorskip("ray")

from tests.cluster.test_rank_group import (JOB_TIMEOUT_S, RANKS, event_names, frames_of, released, single,  # noqa: F401
                                           submit, t2v_prompt)
from execution.paths import STAGING_PREFIX
from tests.test_templates import link_tree, nodes_of
from tests.web.conftest import get_json, wait_terminal
from tests.web.serve import ServerThread


@pytest.fixture(scope="module")
def ray_grouped(tmp_path_factory, released):  # noqa: F811
    from cluster.ray_pool import ray_group_pool, start_ray

    base = tmp_path_factory.mktemp("ray_group")
    link_tree(released, base / "models")
    started = start_ray(None, num_cpus=RANKS, object_store_bytes=100 * 2**20)
    scratch = base / "scratch"
    scratch.mkdir()

    def changes(config):
        config.worker_pool = lambda runtime, cfg: ray_group_pool(runtime, [cfg.worker_recipe], RANKS, timeout_s=60,
                                                                 scratch_root=str(scratch), threads=1)
    server = ServerThread(base, config_changes=changes)
    try:
        yield server
    finally:
        server.stop()
        if started:
            ray.shutdown()


def test_the_t2v_template_runs_on_a_ray_group_with_a_single_workers_events_and_outputs(single, ray_grouped):  # noqa: F811
    prompt = t2v_prompt(single)
    one = wait_terminal(single.url, submit(single, prompt), JOB_TIMEOUT_S)
    group = wait_terminal(ray_grouped.url, submit(ray_grouped, t2v_prompt(ray_grouped)), JOB_TIMEOUT_S)
    assert one["status"]["status_str"] == "success", one["status"]
    assert group["status"]["status_str"] == "success", group["status"]
    assert event_names(group) == event_names(one)
    (save,) = nodes_of(prompt, "SaveVideo")
    frames_one, frames_group = frames_of(single, one, save), frames_of(ray_grouped, group, save)
    assert frames_one.shape == frames_group.shape
    assert numpy.abs(frames_one.astype(int) - frames_group.astype(int)).mean() < 1.0
    # Only rank 0's files reached the server: one video, under its final name, no staged leftovers.
    written = [p.name for p in ray_grouped.runtime.paths.output.rglob("*") if p.is_file()]
    assert len([n for n in written if n.endswith(".mp4")]) == 1 and not [n for n in written if n.startswith(STAGING_PREFIX)]
    status, stats = get_json(ray_grouped.url + "/system_stats")
    [worker] = stats["workers"]
    assert "ray rank group of 2" in worker["kind"] and worker["ranks"] == RANKS
