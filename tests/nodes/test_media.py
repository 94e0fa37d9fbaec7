"""Media nodes: VIDEO/AUDIO values, MP4 (H.264 + AAC 32 kHz stereo) and FLAC written through PyAV."""
from __future__ import annotations

import json
import math
import shutil
from fractions import Fraction

import av
import numpy as np
import pytest
import torch

import media.video as media
from execution.context import ExecutionInterrupted, RunContext, activate, deactivate
from execution.paths import Paths, UnsafePathError
from nodes.media import NODES
from web.object_info import node_info

SPECS = {spec.node_id: spec for spec in NODES}
SR = media.MP4_AUDIO_SAMPLE_RATE_HZ



def run(node_id, **kwargs):
    return SPECS[node_id].execute(**kwargs)


def sine(seconds, rate, channels=2, freq=440.0):
    t = torch.arange(int(round(seconds * rate))) / rate
    rows = [0.5 * torch.sin(2 * math.pi * freq * (c + 1) * t) for c in range(channels)]
    return {"waveform": torch.stack(rows)[None].float(), "sample_rate": rate}


def frames(count, height=32, width=48, seed=0):
    # Flat colours per frame: survive lossy H.264 well enough to compare.
    values = torch.rand(count, 1, 1, 3, generator=torch.Generator().manual_seed(seed))
    return values.expand(count, height, width, 3).contiguous()


def probe(path):
    """(video streams, audio streams, metadata) of a media file, with decoded counts."""
    with av.open(str(path)) as container:
        video = [(s.codec_context.name, s.codec_context.width, s.codec_context.height, s.codec_context.pix_fmt)
                 for s in container.streams.video]
        audio = [(s.codec_context.name, s.codec_context.channels, s.codec_context.sample_rate,
                  float(s.duration * s.time_base)) for s in container.streams.audio]
        meta = dict(container.metadata)
    with av.open(str(path)) as container:
        decoded = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)] if video else []
    return video, audio, meta, decoded


def save(video, prefix="video/clip", **hidden):
    out = run("SaveVideo", video=video, filename_prefix=prefix, format="auto", codec="auto", **hidden)
    entry = out.ui["images"][0]
    return out, entry


# ---------------------------------------------------------------------- MP4
def test_save_video_mp4_h264_and_aac_stereo_32k(ctx, events):
    images = frames(22)
    audio = sine(22 / 24 + 0.2, 44100, channels=1)  # mono 44.1 kHz, longer than the picture
    (video,) = run("CreateVideo", images=images, fps=24.0, audio=audio)
    out, entry = save(video, prompt={"5": {"class_type": "SaveVideo"}}, extra_pnginfo={"workflow": {"v": 1}})
    assert out.values[0] is video
    assert entry == {"filename": "clip_00001_.mp4", "subfolder": "video", "type": "output"}
    assert out.ui["animated"] == (True,)
    path = ctx.paths.output / "video" / entry["filename"]
    assert sorted(p.name for p in path.parent.iterdir()) == [entry["filename"]]  # no temporary left behind
    vstreams, astreams, meta, decoded = probe(path)
    assert vstreams == [("h264", 48, 32, "yuv420p")]
    assert len(decoded) == 22
    assert np.abs(decoded[5].astype(np.float32) / 255 - images[5].numpy()).mean() < 0.02
    ((codec, channels, rate, duration),) = astreams
    assert (codec, channels, rate) == ("aac", 2, SR)
    assert abs(duration - 22 / 24) <= 1024 / SR  # cut to the picture length, within one AAC frame
    assert json.loads(meta["prompt"]) == {"5": {"class_type": "SaveVideo"}}
    assert json.loads(meta["workflow"]) == {"v": 1}
    assert [e for e, _ in events].count("progress") >= 2


def test_mp4_audio_content_survives(ctx):
    (video,) = run("CreateVideo", images=frames(24, 16, 16), fps=24.0, audio=sine(1.0, 48000, freq=500.0))
    _, entry = save(video)
    path = ctx.paths.output / "video" / entry["filename"]
    with av.open(str(path)) as container:
        samples = np.concatenate([f.to_ndarray() for f in container.decode(audio=0)], axis=1)
    spectrum = np.abs(np.fft.rfft(samples[0, 4000:20000]))
    peak_hz = np.argmax(spectrum) * SR / 16000
    assert abs(peak_hz - 500.0) < 5  # left channel is the 500 Hz tone after resampling 48k -> 32k
    assert samples.shape[0] == 2


def test_save_video_without_audio_odd_size_and_10_bit(ctx):
    (video,) = run("CreateVideo", images=frames(5, 15, 21), fps=30.0)
    _, entry = save(video)
    vstreams, astreams, _, decoded = probe(ctx.paths.output / "video" / entry["filename"])
    assert vstreams == [("h264", 22, 16, "yuv420p")] and astreams == [] and len(decoded) == 5
    (deep,) = run("CreateVideo", images=frames(3), fps=24.0, bit_depth=10)
    _, entry = save(deep, prefix="deep")
    vstreams, _, _, decoded = probe(ctx.paths.output / entry["filename"])
    assert vstreams[0][3] == "yuv420p10le" and len(decoded) == 3


class StreamedVideo(media.Video):
    """Frames made chunk by chunk; asking for all of them at once is an error."""

    def __init__(self, count, height=16, width=16):
        self.count, self.height, self.width = count, height, width
        self.chunk_sizes = []

    def get_dimensions(self):
        return self.width, self.height

    def get_frame_count(self):
        return self.count

    def get_frame_rate(self):
        return Fraction(25)

    def get_audio(self):
        return None

    def get_components(self):
        raise AssertionError("the writer asked for the whole video")

    def iter_frame_chunks(self, frames_per_chunk=media.FRAMES_PER_CHUNK):
        for start in range(0, self.count, frames_per_chunk):
            size = min(frames_per_chunk, self.count - start)
            self.chunk_sizes.append(size)
            yield torch.full((size, self.height, self.width, 3), start / self.count)


def test_save_video_encodes_in_chunks_without_full_copy(ctx):
    video = StreamedVideo(40)
    _, entry = save(video)
    assert max(video.chunk_sizes) <= media.FRAMES_PER_CHUNK and sum(video.chunk_sizes) == 40
    _, _, _, decoded = probe(ctx.paths.output / "video" / entry["filename"])
    assert len(decoded) == 40
    # In-memory videos hand out views of their frames, never copies.
    images = frames(20)
    chunks = list(media.VideoComponents(images=images).iter_frame_chunks(8))
    assert [c.shape[0] for c in chunks] == [8, 8, 4]
    assert all(c.untyped_storage().data_ptr() == images.untyped_storage().data_ptr() for c in chunks)


def test_save_video_refusals_leave_no_file(ctx):
    (video,) = run("CreateVideo", images=frames(3), fps=24.0)
    with pytest.raises(ValueError, match="codec 'vp9'"):
        run("SaveVideo", video=video, filename_prefix="bad", format="auto", codec="vp9")
    with pytest.raises(ValueError, match="format 'webm'"):
        run("SaveVideo", video=video, filename_prefix="bad", format="webm", codec="auto")
    with pytest.raises(UnsafePathError):
        run("SaveVideo", video=video, filename_prefix="../escape", format="auto", codec="auto")
    with pytest.raises(TypeError, match="SaveVideo"):
        run("SaveVideo", video=frames(3), filename_prefix="x", format="auto", codec="auto")
    assert list(ctx.paths.output.rglob("*")) == []


def test_save_video_interrupted_leaves_no_partial_file(tmp_path):
    context = RunContext(prompt_id="job", node_id="1", display_node_id="1", paths=Paths(tmp_path).ensure(),
                         is_interrupted=lambda: True)
    token = activate(context)
    try:
        with pytest.raises(ExecutionInterrupted):
            save(StreamedVideo(40))
    finally:
        deactivate(token)
    assert [p for p in context.paths.output.rglob("*") if p.is_file()] == []


# ---------------------------------------------------------------------- components, LoadVideo
def test_get_video_components():
    audio = sine(0.5, SR)
    (video,) = run("CreateVideo", images=frames(12), fps=23.976, audio=audio)
    images, got_audio, fps = run("GetVideoComponents", video=video)
    assert images.shape == (12, 32, 48, 3) and got_audio is audio
    assert video.get_frame_rate() == Fraction(2997, 125) and fps == pytest.approx(23.976)
    assert video.get_dimensions() == (48, 32) and video.get_frame_count() == 12
    assert video.get_duration() == pytest.approx(12 / 23.976)
    assert video.nbytes == images.nelement() * 4 + audio["waveform"].nelement() * 4  # what the RAM cache counts


def test_load_video_round_trip(ctx):
    (video,) = run("CreateVideo", images=frames(22), fps=24.0, audio=sine(22 / 24, SR))
    _, entry = save(video)
    shutil.copy(ctx.paths.output / "video" / entry["filename"], ctx.paths.input / "in.mp4")
    (ctx.paths.input / "notes.txt").write_text("x")
    assert SPECS["LoadVideo"].input("file").choice_list() == ["in.mp4"]
    assert node_info(SPECS["LoadVideo"])["input"]["required"]["file"][1]["video_upload"] is True
    (loaded,) = run("LoadVideo", file="in.mp4")
    assert loaded.get_dimensions() == (48, 32) and loaded.get_frame_rate() == 24
    assert loaded.get_frame_count() == 22
    images, audio, fps = run("GetVideoComponents", video=loaded)
    assert images.shape == (22, 32, 48, 3) and fps == 24.0
    assert (images - frames(22)).abs().mean() < 0.02
    assert audio["sample_rate"] == SR and audio["waveform"].shape[:2] == (1, 2)
    assert abs(audio["waveform"].shape[-1] - SR * 22 / 24) <= 1024
    # Re-saving a loaded video streams it from the file.
    _, again = save(loaded, prefix="again")
    assert len(probe(ctx.paths.output / again["filename"])[3]) == 22


def test_load_video_fingerprint_validation_and_confinement(ctx, tmp_path):
    (video,) = run("CreateVideo", images=frames(2), fps=24.0)
    _, entry = save(video)
    shutil.copy(ctx.paths.output / "video" / entry["filename"], ctx.paths.input / "a.mp4")
    spec = SPECS["LoadVideo"]
    first = spec.fingerprint(file="a.mp4")
    with open(ctx.paths.input / "a.mp4", "ab") as handle:
        handle.write(b"\0" * 16)
    assert spec.fingerprint(file="a.mp4") != first
    assert spec.validate_inputs(file="a.mp4") is True
    message = spec.validate_inputs(file="gone.mp4")
    assert "gone.mp4" in message and str(ctx.paths.input) in message
    assert "invalid video file" in spec.validate_inputs(file="../a.mp4")
    with pytest.raises(UnsafePathError):
        run("LoadVideo", file="../../etc/passwd")
    (ctx.paths.input / "fake.mp4").write_bytes(b"not a video")
    with pytest.raises(ValueError, match="fake.mp4"):
        run("LoadVideo", file="fake.mp4")


# ---------------------------------------------------------------------- ConcatenateVideo
def test_concatenate_video_joins_pictures_and_sound(ctx):
    (a,) = run("CreateVideo", images=frames(10, seed=1), fps=24.0, audio=sine(10 / 24, SR))
    (b,) = run("CreateVideo", images=frames(6, seed=2), fps=24.0)  # silent clip in the middle
    (c,) = run("CreateVideo", images=frames(8, seed=3), fps=24.0, audio=sine(1.0, 16000, channels=1))
    (joined,) = run("ConcatenateVideo", videos={"video0": [a], "video1": [b], "video2": [c]}, codec=["auto"])
    assert joined.get_frame_count() == 24 and joined.get_dimensions() == (48, 32)
    audio = joined.get_audio()
    assert audio["sample_rate"] == SR and audio["waveform"].shape == (1, 2, SR)
    middle = audio["waveform"][..., round(10 / 24 * SR):round(16 / 24 * SR)]
    assert middle.abs().max() == 0  # the silent clip stays silent, later sound stays in sync
    assert audio["waveform"][..., -1000:].abs().max() > 0.1
    images, _, _ = run("GetVideoComponents", video=joined)
    assert torch.equal(images[10:16], b.images)
    _, entry = save(joined)
    vstreams, astreams, _, decoded = probe(ctx.paths.output / "video" / entry["filename"])
    assert len(decoded) == 24 and astreams[0][:3] == ("aac", 2, SR)
    assert abs(astreams[0][3] - 1.0) <= 1024 / SR


def test_concatenate_video_complete_audio_and_refusals():
    (a,) = run("CreateVideo", images=frames(4), fps=24.0)
    soundtrack = sine(0.3, SR)
    (joined,) = run("ConcatenateVideo", videos={"video0": [a, a]}, codec=["h264"], complete_audio=[soundtrack])
    assert joined.get_frame_count() == 8 and joined.get_audio() is soundtrack
    (small,) = run("CreateVideo", images=frames(4, 16, 16), fps=24.0)
    with pytest.raises(ValueError, match=r"clip 2 is 16x16 but clip 1 is 48x32"):
        run("ConcatenateVideo", videos={"video0": [a], "video1": [small]}, codec=["auto"])
    (fast,) = run("CreateVideo", images=frames(4), fps=30.0)
    with pytest.raises(ValueError, match=r"clip 2 runs at 30 fps but clip 1 at 24 fps"):
        run("ConcatenateVideo", videos={"video0": [a], "video1": [fast]}, codec=["auto"])


# ---------------------------------------------------------------------- audio
def test_save_and_load_audio_flac_round_trip(ctx):
    audio = sine(0.25, 44100)
    audio["waveform"] = torch.cat([audio["waveform"], -audio["waveform"]])  # a batch of two clips
    out = run("SaveAudio", audio=audio, filename_prefix="audio/take", prompt={"1": {}},
              extra_pnginfo={"workflow": {"w": 2}})
    assert out.values[0] is audio
    assert out.ui["audio"] == [
        {"filename": "take_00001_.flac", "subfolder": "audio", "type": "output"},
        {"filename": "take_00002_.flac", "subfolder": "audio", "type": "output"},
    ]
    # One sound check per file, in the files' order; the second clip is the first inverted, not a fault.
    assert [entry["file"] for entry in out.ui["audio_health"]] == ["audio/take_00001_.flac", "audio/take_00002_.flac"]
    assert all(entry["healthy"] for entry in out.ui["audio_health"])
    folder = ctx.paths.output / "audio"
    assert sorted(p.name for p in folder.iterdir()) == ["take_00001_.flac", "take_00002_.flac"]
    with av.open(str(folder / "take_00002_.flac")) as container:
        assert json.loads(container.metadata["workflow"]) == {"w": 2}
    shutil.copy(folder / "take_00002_.flac", ctx.paths.input / "take.flac")
    assert SPECS["LoadAudio"].input("audio").choice_list() == ["take.flac"]
    (loaded,) = run("LoadAudio", audio="take.flac")
    assert loaded["sample_rate"] == 44100 and loaded["waveform"].shape == (1, 2, audio["waveform"].shape[-1])
    assert (loaded["waveform"][0] - audio["waveform"][1]).abs().max() < 2 / 32768


def test_load_audio_from_video_file_validation_and_fingerprint(ctx):
    (video,) = run("CreateVideo", images=frames(12), fps=24.0, audio=sine(0.5, SR))
    _, entry = save(video)
    shutil.copy(ctx.paths.output / "video" / entry["filename"], ctx.paths.input / "v.mp4")
    (audio,) = run("LoadAudio", audio="v.mp4")
    assert audio["sample_rate"] == SR and audio["waveform"].shape[1] == 2
    spec = SPECS["LoadAudio"]
    assert spec.validate_inputs(audio="v.mp4") is True
    assert str(ctx.paths.input) in spec.validate_inputs(audio="missing.wav")
    assert "invalid audio file" in spec.validate_inputs(audio="/abs/x.wav")
    first = spec.fingerprint(audio="v.mp4")
    (ctx.paths.input / "v.mp4").write_bytes((ctx.paths.input / "v.mp4").read_bytes() + b"x")
    assert spec.fingerprint(audio="v.mp4") != first
    (silent,) = run("CreateVideo", images=frames(2), fps=24.0)
    _, entry = save(silent, prefix="silent")
    shutil.copy(ctx.paths.output / entry["filename"], ctx.paths.input / "silent.mp4")
    with pytest.raises(ValueError, match="no audio stream"):
        run("LoadAudio", audio="silent.mp4")


def test_preview_audio_goes_to_temp(ctx):
    out = run("PreviewAudio", audio=sine(0.1, SR, channels=1))
    (entry,) = out.ui["audio"]
    assert entry["type"] == "temp" and (ctx.paths.temp / entry["filename"]).is_file()
    with pytest.raises(ValueError, match="PreviewAudio"):
        run("PreviewAudio", audio=None)


def test_declarations_match_comfyui():
    def info(node_id):
        return node_info(SPECS[node_id])

    assert info("SaveVideo")["input_order"] == {
        "required": ["video", "filename_prefix", "format", "codec"], "hidden": ["prompt", "extra_pnginfo"]}
    assert info("SaveVideo")["input"]["required"]["filename_prefix"][1]["default"] == "video/ComfyUI"
    assert info("CreateVideo")["input_order"] == {"required": ["images", "fps"], "optional": ["audio", "bit_depth"]}
    assert info("CreateVideo")["input"]["required"]["fps"][1]["default"] == 30.0
    assert info("GetVideoComponents")["output_name"] == ["images", "audio", "fps"]
    assert info("ConcatenateVideo")["is_input_list"] is True
    assert info("LoadAudio")["input"]["required"]["audio"][1]["audio_upload"] is True
    assert info("SaveAudio")["input"]["required"]["filename_prefix"][1]["default"] == "audio/ComfyUI"


def test_video_workflow_runs_through_executor(runner, paths):
    prompt = {
        "1": {"class_type": "EmptyImage", "inputs": {"width": 32, "height": 16, "batch_size": 6, "color": 0x3366FF}},
        "2": {"class_type": "CreateVideo", "inputs": {"images": ["1", 0], "fps": 12.0}},
        "3": {"class_type": "SaveVideo", "inputs": {"video": ["2", 0], "filename_prefix": "video/wf",
                                                     "format": "auto", "codec": "auto"}},
    }
    result = runner.run(prompt)
    assert result.status == "success", result.error
    entry = result.outputs["3"]["images"][0]
    vstreams, _, meta, decoded = probe(paths.output / entry["subfolder"] / entry["filename"])
    assert vstreams[0][:3] == ("h264", 32, 16) and len(decoded) == 6
    assert json.loads(meta["prompt"])["3"]["class_type"] == "SaveVideo"
