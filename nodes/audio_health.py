"""The sound check on what Weft writes, and the AudioHealth node that hands its figures to a workflow.

Every node that writes or previews sound (SaveAudio, PreviewAudio, SaveVideo, and the V3 `ui` helpers
packs save sound with) calls `checked_sound` on each sound it writes. The figures
(`media.audio_health`) go into the node's UI output under `AUDIO_HEALTH_KEY`, one entry per sound
written, in the order of the files, so they reach the `executed` event, the job's record and its
`/history` entry. A sound that crosses a threshold also gives one warning line: shown on the node in
the editor (progress text, for jobs that draw previews, as the editor's do), written to the server's log (INFO, relayed from the worker), and printed
by `main.py run` after the run (from the same entries).
"""
from __future__ import annotations

import logging
from typing import Any

import torch

from execution.context import current
from execution.types import AUDIO_HEALTH_KEY
from media.audio import check_audio
from media.audio_health import check_sound
from media.video import Video, check_video
from nodes.preview_settings import resolve_method
from nodes.spec import Input, NodeOutput, NodeSpec, Output

logger = logging.getLogger(__name__)


def checked_sound(node: str, waveform: torch.Tensor, sample_rate_hz: int, *, what: str,
                  video_seconds: float | None = None) -> dict:
    """Check one written sound (C, S); warn when a threshold is crossed; its UI entry (`what` names it)."""
    health = check_sound(waveform, int(sample_rate_hz), video_seconds=video_seconds)
    if not health.healthy:
        ctx = current()
        # INFO: the server's log shows it; `main.py run` prints its own warning line after the run.
        logger.info("node %s (%s) %s: sound check: %s", ctx.display_node_id, node, what, "; ".join(health.warnings))
        # A progress text is a binary frame, which a client that never asked for previews does not expect
        # (one API client takes such frames for its images): only jobs that draw previews, as the editor's
        # do, get the line on the node.
        if resolve_method(ctx.runtime, ctx.extra_data) != "none":
            ctx.show(text="sound check: " + "; ".join(health.warnings))
    return {"file": what, **health.as_dict()}


def checked_clips(node: str, audio: dict, written: list[dict]) -> list[dict]:
    """`checked_sound` for each clip of an AUDIO batch, written as the files `written` (same order)."""
    rate = int(audio["sample_rate"])
    return [checked_sound(node, clip, rate, what=_file_name(item)) for clip, item in zip(audio["waveform"], written)]


def checked_video_sound(node: str, video: Video, written: dict) -> list[dict]:
    """The check of a video's sound track against its pictures' length; [] for a video without sound."""
    audio = video.get_audio()
    if audio is None:
        return []
    audio = check_audio(node, audio, "video")
    # The sound as it arrives: the file cuts a longer one to the pictures, which is what the length check flags.
    return [checked_sound(node, audio["waveform"][0], int(audio["sample_rate"]), what=_file_name(written),
                          video_seconds=video.get_duration())]


def _file_name(item: dict) -> str:
    subfolder = item.get("subfolder") or ""
    return f"{subfolder}/{item['filename']}" if subfolder else str(item["filename"])


# ---------------------------------------------------------------------- the AudioHealth node
_NODE = "AudioHealth"


def _audio_health(audio: dict, video: Video | None = None) -> NodeOutput:
    audio = check_audio(_NODE, audio)
    video_seconds = None
    if video is not None:
        video_seconds = check_video(_NODE, video).get_duration()
    rate = int(audio["sample_rate"])
    entries = []
    for index, clip in enumerate(audio["waveform"]):
        what = "the sound" if audio["waveform"].shape[0] == 1 else f"clip {index + 1} of the batch"
        entries.append(checked_sound(_NODE, clip, rate, what=what, video_seconds=video_seconds))
    # A batch reports its worst clip on each figure.
    correlations = [e["channel_correlation"] for e in entries if e["channel_correlation"] is not None]
    mismatches = [e["duration_mismatch_s"] for e in entries if e["duration_mismatch_s"] is not None]
    warnings = "\n".join(f"{e['file']}: {w}" for e in entries for w in e["warnings"])
    values = (
        all(e["healthy"] for e in entries),
        max(e["dc_offset"] for e in entries),
        max(e["clipping_ratio"] for e in entries),
        min(e["rms_dbfs"] for e in entries),
        any(e["silent"] for e in entries),
        max(e["click_rate_hz"] for e in entries),
        min(correlations) if correlations else 1.0,
        max(mismatches, key=abs) if mismatches else 0.0,
        warnings,
    )
    return NodeOutput.of(*values, ui={AUDIO_HEALTH_KEY: entries, "text": [warnings or "the sound passed every check"]})


NODES = [
    NodeSpec(
        node_id=_NODE, display_name="Audio Health", category="audio",
        description="Measures the sound for the faults that break it silently: an offset from zero, clipping, "
                    "silence, clicks and pops, an inverted channel, and a length that does not match the video. "
                    "The same check runs on every sound Weft saves; this node hands its figures to the workflow, "
                    "to branch on. For a batch, each figure is the worst clip's. The thresholds are listed in "
                    "docs/usage.md.",
        execute=_audio_health,
        inputs=[
            Input.link("audio", "AUDIO", tooltip="The sound to check."),
            Input.link("video", "VIDEO", optional=True,
                       tooltip="Pictures the sound goes with: their length is compared with the sound's."),
        ],
        outputs=[
            Output("BOOLEAN", "healthy", tooltip="True when no figure crossed its threshold."),
            Output("FLOAT", "dc_offset", tooltip="Largest offset of a channel's mean from zero (full scale 1.0); "
                                                 "a fault above 0.02."),
            Output("FLOAT", "clipping_ratio", tooltip="Share of samples at full scale (0 to 1); a fault above "
                                                      "0.001."),
            Output("FLOAT", "rms_dbfs", tooltip="Level in dB of full scale, offset removed; -120 for digital "
                                                "silence."),
            Output("BOOLEAN", "silent", tooltip="True when the level is below -60 dBFS."),
            Output("FLOAT", "click_rate", tooltip="Clicks and pops per second; a fault above 0.25."),
            Output("FLOAT", "channel_correlation",
                   tooltip="Correlation of the first two channels (-1 to 1); below -0.5 one looks inverted. "
                           "1.0 for mono sound or a silent channel."),
            Output("FLOAT", "duration_mismatch",
                   tooltip="Seconds the sound is longer (positive) or shorter (negative) than the video; 0 "
                           "without a video. A fault beyond 0.1 s either way."),
            Output("STRING", "warnings", tooltip="One line per fault found; empty when the sound passed."),
        ],
        search_aliases=("audio check", "sound check", "clipping", "lip sync"),
    ),
]
