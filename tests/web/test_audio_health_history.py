"""Through a real server: a saved sound's check lands in the output's /history entry and the job's record."""
from __future__ import annotations

import math

import pytest
import torch

from media.audio import write_flac
from tests.web.conftest import get_json, new_id, post_json, wait_terminal


def test_sound_check_reaches_history_and_the_job_record(server):
    t = torch.arange(16000) / 32000
    left = 0.4 * torch.sin(2 * math.pi * 330 * t)
    write_flac(server.runtime.paths.input / "inverted.flac", torch.stack([left, -left]), 32000)
    prompt = {"1": {"class_type": "LoadAudio", "inputs": {"audio": "inverted.flac"}},
              "2": {"class_type": "SaveAudio", "inputs": {"audio": ["1", 0], "filename_prefix": "health/take"}}}
    prompt_id = new_id()
    status, reply = post_json(server.url + "/prompt", {"prompt": prompt, "prompt_id": prompt_id})
    assert status == 200, reply
    record = wait_terminal(server.url, prompt_id, timeout=120)
    assert record["status"]["status_str"] == "success"
    output = record["outputs"]["2"]
    (entry,) = output["audio_health"]
    assert entry["file"] == f"health/{output['audio'][0]['filename']}"
    assert entry["channel_correlation"] == pytest.approx(-1.0, abs=1e-3) and not entry["healthy"]
    assert any("inverted" in line for line in entry["warnings"])
    status, job = get_json(f"{server.url}/api/jobs/{prompt_id}")
    assert status == 200 and job["outputs"]["2"]["audio_health"] == output["audio_health"]
    assert job["outputs_count"] == 1  # the check describes the file; it is not an output of its own
