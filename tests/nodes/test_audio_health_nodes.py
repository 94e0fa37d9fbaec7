"""The sound check on every written sound (SaveAudio, PreviewAudio, SaveVideo) and the AudioHealth node."""
from __future__ import annotations

import math

import pytest
import torch

from execution.context import RunContext, activate, deactivate
from execution.paths import Paths
from execution.types import AUDIO_HEALTH_KEY
from main import sound_warnings
from nodes.audio_health import NODES as HEALTH_NODES
from nodes.media import NODES as MEDIA_NODES
from tests.nodes.conftest import unfolded
from web.object_info import node_info

SPECS = {spec.node_id: spec for spec in [*MEDIA_NODES, *HEALTH_NODES]}
RATE = 32000


def run(node_id, **kwargs):
    return SPECS[node_id].execute(**kwargs)


@pytest.fixture
def ctx(tmp_path, events):
    """As tests/nodes/conftest.py's, for a job that draws previews (as the editor's do): warnings show on the node."""
    context = RunContext(prompt_id="job", node_id="7", display_node_id="7", paths=Paths(tmp_path).ensure(),
                         emit=lambda event, data: events.extend(unfolded(event, data)),
                         extra_data={"preview_method": "latent2rgb"})
    token = activate(context)
    yield context
    deactivate(token)


def test_a_job_that_draws_no_previews_gets_the_entry_but_no_line_on_the_node(tmp_path):
    seen = []
    context = RunContext(prompt_id="job", node_id="7", display_node_id="7", paths=Paths(tmp_path).ensure(),
                         emit=lambda event, data: seen.extend(unfolded(event, data)))
    token = activate(context)
    try:
        out = run("PreviewAudio", audio=tone(0.5, offset=0.3))
    finally:
        deactivate(token)
    assert not out.ui[AUDIO_HEALTH_KEY][0]["healthy"] and texts(seen) == []


def tone(seconds, *, invert=False, offset=0.0, batch=1):
    t = torch.arange(int(round(seconds * RATE))) / RATE
    left = 0.4 * torch.sin(2 * math.pi * 220 * t)
    right = -left if invert else left
    waveform = torch.stack([left, right])[None].repeat(batch, 1, 1) + offset
    return {"waveform": waveform.float(), "sample_rate": RATE}


def frames(count):
    return torch.full((count, 16, 16, 3), 0.5)


def texts(events):
    return [data["text"] for event, data in events if event == "progress_text"]


def test_save_video_reports_its_sound_and_warns_on_a_mismatch(ctx, events):
    # 12 frames at 24 fps last 0.5 s; the sound lasts 1.0 s.
    (video,) = run("CreateVideo", images=frames(12), fps=24.0, audio=tone(1.0))
    out = run("SaveVideo", video=video, filename_prefix="clip", format="auto", codec="auto")
    (entry,) = out.ui[AUDIO_HEALTH_KEY]
    assert entry["file"] == out.ui["images"][0]["filename"]
    assert entry["video_seconds"] == pytest.approx(0.5) and entry["duration_mismatch_s"] == pytest.approx(0.5)
    assert not entry["healthy"] and len(entry["warnings"]) == 1 and "longer than the pictures" in entry["warnings"][0]
    (text,) = texts(events)
    assert text.startswith("sound check:") and "0.50 s longer" in text


def test_save_video_with_matching_sound_is_healthy_and_silent_video_has_no_entry(ctx, events):
    (video,) = run("CreateVideo", images=frames(12), fps=24.0, audio=tone(0.5))
    out = run("SaveVideo", video=video, filename_prefix="clip", format="auto", codec="auto")
    assert out.ui[AUDIO_HEALTH_KEY][0]["healthy"] and texts(events) == []
    (mute,) = run("CreateVideo", images=frames(2), fps=24.0)
    assert AUDIO_HEALTH_KEY not in run("SaveVideo", video=mute, filename_prefix="m", format="auto",
                                       codec="auto").ui


def test_save_audio_checks_every_clip_of_a_batch(ctx, events):
    audio = tone(0.5, batch=2)
    audio["waveform"][1, 1] *= -1  # the second clip's right channel inverted
    out = run("SaveAudio", audio=audio, filename_prefix="a/take")
    first, second = out.ui[AUDIO_HEALTH_KEY]
    assert first["healthy"] and first["file"] == "a/take_00001_.flac"
    assert not second["healthy"] and second["channel_correlation"] == pytest.approx(-1.0)
    assert second["video_seconds"] is None and second["duration_mismatch_s"] is None
    (text,) = texts(events)
    assert "inverted" in text


def test_preview_audio_warns_on_an_offset(ctx, events):
    out = run("PreviewAudio", audio=tone(0.5, offset=0.2))
    (entry,) = out.ui[AUDIO_HEALTH_KEY]
    assert entry["dc_offset"] == pytest.approx(0.2, abs=0.01) and "DC offset" in texts(events)[0]


def test_audio_health_node_outputs_typed_figures(ctx, events):
    (video,) = run("CreateVideo", images=frames(12), fps=24.0)
    out = run("AudioHealth", audio=tone(1.0, invert=True), video=video)
    healthy, dc, clipping, level, silent, click_rate, correlation, mismatch, warnings = out.values
    assert healthy is False and silent is False
    assert isinstance(dc, float) and isinstance(clipping, float) and isinstance(click_rate, float)
    assert correlation == pytest.approx(-1.0) and mismatch == pytest.approx(0.5)
    assert level == pytest.approx(20 * math.log10(0.4 / math.sqrt(2)), abs=0.1)
    assert "inverted" in warnings and "longer than the pictures" in warnings
    clean = run("AudioHealth", audio=tone(0.5))
    assert clean.values[0] is True and clean.values[-1] == "" and clean.values[6] == pytest.approx(1.0)
    assert clean.values[7] == 0.0  # no video: no mismatch
    mono = run("AudioHealth", audio={"waveform": torch.zeros(1, 1, 100), "sample_rate": RATE})
    assert mono.values[4] is True and mono.values[6] == 1.0


def test_audio_health_node_reports_the_worst_clip_of_a_batch(ctx):
    audio = tone(0.5, batch=2)
    audio["waveform"][1] = audio["waveform"][1].clamp(-0.1, 0.1) * 10  # clipped hard
    out = run("AudioHealth", audio=audio)
    assert out.values[0] is False and out.values[2] > 0.1
    assert out.values[-1].startswith("clip 2 of the batch: clipping")
    assert [entry["healthy"] for entry in out.ui[AUDIO_HEALTH_KEY]] == [True, False]


def test_audio_health_node_refuses_what_is_not_audio(ctx):
    with pytest.raises(TypeError, match="AudioHealth: input 'audio' takes AUDIO"):
        run("AudioHealth", audio="loud")
    with pytest.raises(ValueError, match="AudioHealth: nothing arrived on input 'audio'"):
        run("AudioHealth", audio=None)


def test_audio_health_declaration():
    info = node_info(SPECS["AudioHealth"])
    assert info["output"] == ["BOOLEAN", "FLOAT", "FLOAT", "FLOAT", "BOOLEAN", "FLOAT", "FLOAT", "FLOAT", "STRING"]
    assert info["output_name"] == ["healthy", "dc_offset", "clipping_ratio", "rms_dbfs", "silent", "click_rate",
                                   "channel_correlation", "duration_mismatch", "warnings"]
    assert list(info["input"]["required"]) == ["audio"] and list(info["input"]["optional"]) == ["video"]
    assert info["output_node"] is False


def test_cli_prints_one_line_per_unhealthy_sound():
    outputs = {"9": {"audio": [{}, {}], AUDIO_HEALTH_KEY: [
        {"file": "a.flac", "warnings": []},
        {"file": "b.flac", "warnings": ["silent: level -120.0 dBFS (below -60 dBFS)", "DC offset 0.300"]}]},
        "3": {"images": []}}
    assert sound_warnings(outputs, {"9": {"class_type": "SaveAudio"}}) == [
        "node 9 (SaveAudio) b.flac: silent: level -120.0 dBFS (below -60 dBFS); DC offset 0.300"]
