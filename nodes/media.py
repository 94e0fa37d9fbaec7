"""Video and audio: the VIDEO and AUDIO value types, PyAV encode/decode helpers and the media nodes.

Value types (ComfyUI's, so plugins interoperate):
- AUDIO: ``{"waveform": float Tensor (B, C, S) in -1..1, "sample_rate": int}``.
- VIDEO: a `Video`. `VideoComponents` holds frames in memory (T, H, W, C) in 0..1, an optional AUDIO
  and a frame rate; `VideoFile` reads a file lazily; `VideoConcat` plays clips one after another.
  All answer `get_components()`, `get_dimensions()`, `get_frame_count()`, `get_frame_rate()`,
  `get_audio()`, `iter_frame_chunks(n)` and `save_to(path)`.

MP4 output is H.264 video plus AAC stereo audio at 32 kHz (the H3 family's audio format), written
through PyAV in chunks of frames taken straight from the source tensor, under a temporary name that
is renamed when the file is complete.
"""
from __future__ import annotations

import abc
import dataclasses
import json
import math
import os
import uuid
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import av
import numpy as np
import torch

from execution.context import current
from nodes.image import (
    annotated_folder, annotated_path, check_image, check_input_file, file_metadata, file_sha256, input_folder,
    list_input_files, output_target,
    temp_prefix,
)
from nodes.spec import Input, NodeOutput, NodeSpec, Output

MP4_AUDIO_SAMPLE_RATE_HZ = 32000  # the rate SaveVideo writes AAC at
MP4_AUDIO_CHANNELS = 2
VIDEO_EXTENSIONS = (".mp4", ".webm", ".mkv", ".mov", ".avi", ".m4v")
AUDIO_EXTENSIONS = (".wav", ".flac", ".mp3", ".ogg", ".opus", ".m4a", ".aac")
VIDEO_FORMATS = ("auto", "mp4")
VIDEO_CODECS = ("auto", "h264")
FRAMES_PER_CHUNK = 16  # frames converted to 8-bit at a time while encoding
_H264_ENCODERS = ("libx264", "h264")  # "h264" resolves to the build's default H.264 encoder
_AAC_ENCODERS = ("aac", "libfdk_aac")


# ---------------------------------------------------------------------- encoders
def pick_encoder(label: str, candidates: Sequence[str]) -> str:
    """The first encoder in `candidates` this PyAV build can open for writing, or a clear refusal."""
    for name in candidates:
        if name not in av.codecs_available:
            continue
        try:
            av.Codec(name, "w")
        except Exception:  # listed as a decoder only
            continue
        return name
    raise ValueError(
        f"this PyAV/FFmpeg build has no {label} encoder (looked for {', '.join(candidates)}); "
        f"install a PyAV wheel built with them (the PyPI 'av' wheels include libx264 and aac)"
    )


def h264_encoder() -> str:
    """Name of the H.264 encoder SaveVideo uses."""
    return pick_encoder("H.264", _H264_ENCODERS)


def aac_encoder() -> str:
    """Name of the AAC encoder SaveVideo uses."""
    return pick_encoder("AAC", _AAC_ENCODERS)


# ---------------------------------------------------------------------- AUDIO helpers
def check_audio(node: str, audio: Any, name: str = "audio") -> dict:
    """Refuse anything that is not an AUDIO dict with a (B, C, S) float waveform."""
    if audio is None:
        raise ValueError(f"{node}: input '{name}' is empty (the source may have no audio track)")
    if not isinstance(audio, dict) or "waveform" not in audio or "sample_rate" not in audio:
        raise TypeError(f"{node}: input '{name}' must be AUDIO {{'waveform', 'sample_rate'}}, got {type(audio).__name__}")
    waveform = audio["waveform"]
    if not isinstance(waveform, torch.Tensor) or waveform.dim() != 3 or waveform.shape[0] == 0 or waveform.shape[1] == 0:
        shape = tuple(waveform.shape) if isinstance(waveform, torch.Tensor) else type(waveform).__name__
        raise TypeError(f"{node}: input '{name}' waveform must be a tensor (B, C, S), got {shape}")
    rate = audio["sample_rate"]
    if isinstance(rate, bool) or not isinstance(rate, (int, np.integer)) or rate <= 0:
        raise TypeError(f"{node}: input '{name}' sample_rate must be a positive int, got {rate!r}")
    return audio


def resample_waveform(waveform: torch.Tensor, from_hz: int, to_hz: int) -> torch.Tensor:
    """Resample (..., S) from `from_hz` to `to_hz` (FFmpeg's swresample, each channel alone).

    The result has exactly round(S * to_hz / from_hz) samples, float32, on the input's device."""
    if from_hz == to_hz:
        return waveform
    samples = waveform.shape[-1]
    target = int(round(samples * to_hz / from_hz))
    rows = waveform.detach().reshape(-1, samples).float().cpu().numpy()
    out = np.zeros((rows.shape[0], target), dtype=np.float32)
    for index, row in enumerate(rows):
        # Mono per row: swresample would mix channels of a multi-channel layout (e.g. -3 dB upmix).
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(row[None]), format="fltp", layout="mono")
        frame.sample_rate = int(from_hz)
        resampler = av.AudioResampler(format="fltp", layout="mono", rate=int(to_hz))
        parts = [f.to_ndarray()[0] for f in resampler.resample(frame) + resampler.resample(None)]
        got = np.concatenate(parts) if parts else np.zeros(0, np.float32)
        out[index, : min(target, got.shape[0])] = got[:target]
    return torch.from_numpy(out).reshape(*waveform.shape[:-1], target).to(waveform.device)


def resample_audio(audio: dict, sample_rate_hz: int) -> dict:
    """AUDIO at another sample rate (a new dict; the input is left alone)."""
    audio = check_audio("resample_audio", audio)
    waveform = resample_waveform(audio["waveform"], int(audio["sample_rate"]), int(sample_rate_hz))
    return {"waveform": waveform, "sample_rate": int(sample_rate_hz)}


def match_channels(waveform: torch.Tensor, channels: int, *, node: str = "audio") -> torch.Tensor:
    """(..., C, S) to `channels` channels: mono is duplicated, stereo to mono is averaged."""
    have = waveform.shape[-2]
    if have == channels:
        return waveform
    if have == 1:
        return waveform.expand(*waveform.shape[:-2], channels, waveform.shape[-1])
    if channels == 1:
        return waveform.mean(dim=-2, keepdim=True)
    raise ValueError(f"{node}: audio has {have} channels; only mono or stereo audio can become {channels} channels")


def fit_length(waveform: torch.Tensor, samples: int) -> torch.Tensor:
    """Trim or zero-pad the last axis to exactly `samples`."""
    have = waveform.shape[-1]
    if have >= samples:
        return waveform[..., :samples]
    pad = torch.zeros(*waveform.shape[:-1], samples - have, dtype=waveform.dtype, device=waveform.device)
    return torch.cat([waveform, pad], dim=-1)


def decode_audio(path: str | os.PathLike) -> dict | None:
    """The first audio stream of a file as AUDIO (batch 1, float), or None when it has none."""
    with av.open(str(path)) as container:
        if not container.streams.audio:
            return None
        stream = container.streams.audio[0]
        rate = int(stream.codec_context.sample_rate or stream.rate or 0)
        # Only the sample format changes (to float planar); rate and layout stay the source's.
        resampler = av.AudioResampler(format="fltp")
        parts = []
        for frame in container.decode(stream):
            parts.extend(f.to_ndarray() for f in resampler.resample(frame))
        parts.extend(f.to_ndarray() for f in resampler.resample(None))
    if not parts or rate <= 0:
        raise ValueError(f"{Path(path).name}: the audio stream decoded to no samples")
    waveform = torch.from_numpy(np.concatenate(parts, axis=1).astype(np.float32))  # (C, S)
    return {"waveform": waveform.unsqueeze(0), "sample_rate": rate}


def _layout(channels: int) -> str:
    return {1: "mono", 2: "stereo"}.get(channels, f"{channels}c")


def _temporary_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.part")


def _finish(tmp: Path, path: Path) -> None:
    # The library wrote and closed the file; make it durable before it takes its final name.
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def write_audio_file(path: Path, waveform: torch.Tensor, sample_rate_hz: int, *, container_format: str = "flac",
                     metadata: dict[str, Any] | None = None) -> None:
    """Encode one clip (C, S) to `path` (FLAC, 16-bit) under a temporary name, then rename."""
    if container_format != "flac":
        raise ValueError(f"audio format {container_format!r} not supported; only 'flac' is written")
    channels = int(waveform.shape[0])
    if not 1 <= channels <= 8:
        raise ValueError(f"FLAC holds 1 to 8 channels, the audio has {channels}")
    tmp = _temporary_name(path)
    try:
        with av.open(str(tmp), mode="w", format="flac") as container:
            for key, value in (metadata or {}).items():
                container.metadata[str(key)] = json.dumps(value)
            stream = container.add_stream(pick_encoder("FLAC", ("flac",)), rate=int(sample_rate_hz),
                                          layout=_layout(channels))
            stream.codec_context.format = "s16"
            data = np.ascontiguousarray(waveform.detach().float().clamp(-1, 1).cpu().numpy())
            step = 1 << 16
            for start in range(0, data.shape[1], step):
                frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(data[:, start:start + step]), format="fltp",
                                                   layout=_layout(channels))
                frame.sample_rate = int(sample_rate_hz)
                frame.pts = start
                for packet in stream.encode(frame):
                    container.mux(packet)
            for packet in stream.encode(None):
                container.mux(packet)
        _finish(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


# ---------------------------------------------------------------------- VIDEO
def as_frame_rate(value: Any) -> Fraction:
    """A positive frame rate as a Fraction (floats snap to a denominator <= 1001, e.g. 24000/1001)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, Fraction, np.number)):
        raise TypeError(f"frame rate must be a number, got {value!r}")
    if not math.isfinite(float(value)) or value <= 0:
        raise ValueError(f"frame rate must be positive and finite, got {value!r}")
    rate = Fraction(value) if isinstance(value, (int, Fraction)) else Fraction(float(value)).limit_denominator(1001)
    if rate <= 0:  # a tiny float can snap to 0
        raise ValueError(f"frame rate {value!r} is too small")
    return rate


class Video(abc.ABC):
    """The VIDEO value's interface; see the module docstring."""

    bit_depth: int = 8

    @abc.abstractmethod
    def get_components(self) -> "VideoComponents":
        """All frames in memory, with the audio and frame rate."""

    @abc.abstractmethod
    def get_dimensions(self) -> tuple[int, int]:
        """(width, height) in pixels."""

    @abc.abstractmethod
    def get_frame_count(self) -> int:
        """Number of picture frames."""

    @abc.abstractmethod
    def get_frame_rate(self) -> Fraction:
        """Frames per second, exact."""

    @abc.abstractmethod
    def get_audio(self) -> dict | None:
        """The soundtrack as AUDIO, or None for a silent video."""

    @abc.abstractmethod
    def iter_frame_chunks(self, frames_per_chunk: int = FRAMES_PER_CHUNK) -> Iterator[torch.Tensor]:
        """Frames in order, `frames_per_chunk` at a time, as (t, H, W, C) tensors in 0..1."""

    @property
    def nbytes(self) -> int:
        """Memory this value holds (what the RAM-pressure output cache counts)."""
        return 0

    def get_duration(self) -> float:
        """Length of the picture track in seconds."""
        return self.get_frame_count() / float(self.get_frame_rate())

    def save_to(self, path: str | os.PathLike, *, format: str = "auto", codec: str = "auto",
                metadata: dict[str, Any] | None = None,
                progress: Callable[[int, int], None] | None = None) -> None:
        """Write an MP4 (H.264 + AAC 32 kHz stereo) to `path`; see `write_mp4`."""
        if format not in VIDEO_FORMATS:
            raise ValueError(f"video format {format!r} not supported; expected one of {VIDEO_FORMATS}")
        write_mp4(Path(path), self, codec=codec, metadata=metadata, progress=progress)


def _audio_nbytes(audio: dict | None) -> int:
    return 0 if audio is None else audio["waveform"].element_size() * audio["waveform"].nelement()


@dataclass(eq=False)  # identity equality: comparing tensors element-wise is not what `==` should do
class VideoComponents(Video):
    """A video held in memory: frames, optional audio, frame rate."""

    images: torch.Tensor  # (T, H, W, C) float in 0..1
    audio: dict | None = None  # AUDIO or None
    frame_rate: Fraction = Fraction(24)
    bit_depth: int = 8  # 8 or 10: the H.264 profile SaveVideo writes

    def __post_init__(self):
        check_image("VIDEO", self.images, "images")
        self.frame_rate = as_frame_rate(self.frame_rate)
        if self.audio is not None:
            check_audio("VIDEO", self.audio)
        if self.bit_depth not in (8, 10):
            raise ValueError(f"VIDEO: bit depth must be 8 or 10, got {self.bit_depth!r}")

    @property
    def nbytes(self) -> int:
        return self.images.element_size() * self.images.nelement() + _audio_nbytes(self.audio)

    def get_components(self) -> "VideoComponents":
        return self

    def get_dimensions(self) -> tuple[int, int]:
        return int(self.images.shape[2]), int(self.images.shape[1])

    def get_frame_count(self) -> int:
        return int(self.images.shape[0])

    def get_frame_rate(self) -> Fraction:
        return self.frame_rate

    def get_audio(self) -> dict | None:
        return self.audio

    def iter_frame_chunks(self, frames_per_chunk: int = FRAMES_PER_CHUNK) -> Iterator[torch.Tensor]:
        for start in range(0, self.images.shape[0], frames_per_chunk):
            yield self.images[start:start + frames_per_chunk]  # a view: no copy of the video


def _probe_bit_depth(pix_fmt: str | None) -> int:
    return 10 if pix_fmt and any(tag in pix_fmt for tag in ("p10", "p12", "p16", "10le", "12le", "16le")) else 8


class VideoFile(Video):
    """A video file read lazily: the header is probed at once, frames are decoded when asked for."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            with av.open(str(self.path)) as container:
                if not container.streams.video:
                    raise ValueError(f"video file {self.path.name!r} has no video stream")
                stream = container.streams.video[0]
                self._width = int(stream.codec_context.width)
                self._height = int(stream.codec_context.height)
                rate = stream.average_rate or stream.guessed_rate or stream.base_rate
                self._frame_rate = as_frame_rate(Fraction(rate) if rate else Fraction(24))
                self._frames = int(stream.frames or 0)
                self._has_audio = bool(container.streams.audio)
                self.bit_depth = _probe_bit_depth(stream.codec_context.pix_fmt)
        except av.FFmpegError as exc:
            raise ValueError(f"cannot read video file {self.path.name!r}: {exc}") from exc
        self._audio: dict | None = None

    @property
    def nbytes(self) -> int:
        return _audio_nbytes(self._audio)  # frames stay in the file

    def get_dimensions(self) -> tuple[int, int]:
        return self._width, self._height

    def get_frame_rate(self) -> Fraction:
        return self._frame_rate

    def get_frame_count(self) -> int:
        if self._frames <= 0:  # the container did not say: count by decoding once
            self._frames = sum(chunk.shape[0] for chunk in self.iter_frame_chunks(64))
        return self._frames

    def get_audio(self) -> dict | None:
        if self._has_audio and self._audio is None:
            self._audio = decode_audio(self.path)
        return self._audio

    def _decoded_frames(self) -> Iterator[np.ndarray]:
        fmt = "rgb48le" if self.bit_depth > 8 else "rgb24"
        with av.open(str(self.path)) as container:
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"
            for frame in container.decode(stream):
                yield frame.to_ndarray(format=fmt)

    def _to_float(self, frames: np.ndarray) -> torch.Tensor:
        scale = 65535.0 if frames.dtype == np.uint16 else 255.0
        return torch.from_numpy(frames.astype(np.float32)) / scale

    def iter_frame_chunks(self, frames_per_chunk: int = FRAMES_PER_CHUNK) -> Iterator[torch.Tensor]:
        batch: list[np.ndarray] = []
        for frame in self._decoded_frames():
            batch.append(frame)
            if len(batch) == frames_per_chunk:
                yield self._to_float(np.stack(batch))
                batch = []
        if batch:
            yield self._to_float(np.stack(batch))

    def get_components(self) -> VideoComponents:
        # Keep the decoded frames compact (8/16-bit) and fill one float tensor from them.
        frames = list(self._decoded_frames())
        if not frames:
            raise ValueError(f"video file {self.path.name!r} decoded to no frames")
        scale = 65535.0 if frames[0].dtype == np.uint16 else 255.0
        images = torch.empty((len(frames),) + frames[0].shape, dtype=torch.float32)
        for index, frame in enumerate(frames):
            images[index] = torch.from_numpy(frame.astype(np.float32)) / scale
        self._frames = len(frames)
        return VideoComponents(images=images, audio=self.get_audio(), frame_rate=self._frame_rate,
                               bit_depth=self.bit_depth)


class VideoConcat(Video):
    """Clips played one after another (same size and frame rate); nothing is copied until asked."""

    def __init__(self, clips: Sequence[Video], *, audio: dict | None = None, codec: str = "auto"):
        if not clips:
            raise ValueError("ConcatenateVideo: no clips to join")
        first_size, first_rate = clips[0].get_dimensions(), clips[0].get_frame_rate()
        for index, clip in enumerate(clips[1:], start=2):
            size, rate = clip.get_dimensions(), clip.get_frame_rate()
            if size != first_size:
                raise ValueError(
                    f"ConcatenateVideo: clip {index} is {size[0]}x{size[1]} but clip 1 is "
                    f"{first_size[0]}x{first_size[1]}; all clips need the same size")
            if rate != first_rate:
                raise ValueError(
                    f"ConcatenateVideo: clip {index} runs at {float(rate):g} fps but clip 1 at "
                    f"{float(first_rate):g} fps; all clips need the same frame rate")
        if audio is not None:
            check_audio("ConcatenateVideo", audio, "complete_audio")
        self.clips = list(clips)
        self.audio_override = audio
        self.codec = codec
        self.bit_depth = max(clip.bit_depth for clip in self.clips)

    @property
    def nbytes(self) -> int:
        return sum(clip.nbytes for clip in self.clips) + _audio_nbytes(self.audio_override)

    def get_dimensions(self) -> tuple[int, int]:
        return self.clips[0].get_dimensions()

    def get_frame_rate(self) -> Fraction:
        return self.clips[0].get_frame_rate()

    def get_frame_count(self) -> int:
        return sum(clip.get_frame_count() for clip in self.clips)

    def get_audio(self) -> dict | None:
        if self.audio_override is not None:
            return self.audio_override
        tracks = [clip.get_audio() for clip in self.clips]
        present = [t for t in tracks if t is not None]
        if not present:
            return None
        rate = int(present[0]["sample_rate"])
        channels = max(int(t["waveform"].shape[1]) for t in present)
        pieces = []
        for clip, track in zip(self.clips, tracks):
            # Each clip's sound is cut or padded to its picture length so later clips stay in sync.
            samples = int(round(clip.get_duration() * rate))
            if track is None:
                pieces.append(torch.zeros((1, channels, samples)))
                continue
            waveform = match_channels(track["waveform"][:1].float().cpu(), channels, node="ConcatenateVideo")
            waveform = resample_waveform(waveform, int(track["sample_rate"]), rate)
            pieces.append(fit_length(waveform, samples))
        return {"waveform": torch.cat(pieces, dim=-1), "sample_rate": rate}

    def iter_frame_chunks(self, frames_per_chunk: int = FRAMES_PER_CHUNK) -> Iterator[torch.Tensor]:
        for clip in self.clips:
            yield from clip.iter_frame_chunks(frames_per_chunk)

    def get_components(self) -> VideoComponents:
        images = torch.cat([clip.get_components().images for clip in self.clips], dim=0)
        return VideoComponents(images=images, audio=self.get_audio(), frame_rate=self.get_frame_rate(),
                               bit_depth=self.bit_depth)


def check_video(node: str, video: Any, name: str = "video") -> Video:
    """Refuse anything that is not a VIDEO."""
    if not isinstance(video, Video):
        raise TypeError(f"{node}: input '{name}' must be a VIDEO, got {type(video).__name__}")
    return video


# ---------------------------------------------------------------------- MP4 writing
def _chunk_pixels(chunk: torch.Tensor, bit_depth: int, pad_h: int, pad_w: int) -> np.ndarray:
    """One chunk (t, H, W, C) in 0..1 to packed RGB integers, padded to even size by edge repetition."""
    rgb = chunk[..., :3] if chunk.shape[-1] >= 3 else chunk[..., :1].expand(*chunk.shape[:-1], 3)
    if pad_h:
        rgb = torch.cat([rgb, rgb[:, -1:]], dim=1)
    if pad_w:
        rgb = torch.cat([rgb, rgb[:, :, -1:]], dim=2)
    if bit_depth > 8:
        # uint16 has no torch arithmetic on every backend: round in int32, then narrow.
        return (rgb.float().clamp(0, 1) * 65535.0).round().to(torch.int32).cpu().numpy().astype(np.uint16)
    return (rgb.float().clamp(0, 1) * 255.0).round().to(torch.uint8).cpu().numpy()


def _mp4_audio(video: Video, frame_count: int) -> np.ndarray | None:
    """The video's audio as float32 (2, S) at 32 kHz, cut to the picture length."""
    audio = video.get_audio()
    if audio is None:
        return None
    audio = check_audio("SaveVideo", audio)
    rate = int(audio["sample_rate"])
    waveform = audio["waveform"][0]  # (C, S): a VIDEO carries one soundtrack, the first of the batch
    limit = math.ceil(rate * frame_count / float(video.get_frame_rate()))
    waveform = match_channels(waveform[:, :limit].float(), MP4_AUDIO_CHANNELS, node="SaveVideo")
    waveform = resample_waveform(waveform, rate, MP4_AUDIO_SAMPLE_RATE_HZ)
    return np.ascontiguousarray(waveform.clamp(-1, 1).cpu().numpy(), dtype=np.float32)


def write_mp4(path: Path, video: Video, *, codec: str = "auto", metadata: dict[str, Any] | None = None,
              frames_per_chunk: int = FRAMES_PER_CHUNK, progress: Callable[[int, int], None] | None = None) -> None:
    """Encode `video` to an MP4 at `path`: H.264 (yuv420p, or 10-bit) and AAC stereo 32 kHz.

    Frames are converted `frames_per_chunk` at a time straight from the source, so no second
    full-size copy of the video exists. Odd sizes are padded by one edge row/column (4:2:0 needs
    even sizes). The file is written under a temporary name and renamed when complete."""
    if codec not in VIDEO_CODECS:
        raise ValueError(f"video codec {codec!r} not supported; expected one of {VIDEO_CODECS}")
    video_encoder, audio_encoder = h264_encoder(), aac_encoder()
    width, height = video.get_dimensions()
    rate = video.get_frame_rate()
    total = video.get_frame_count()
    bit_depth = video.bit_depth
    pix_fmt = "yuv420p10le" if bit_depth > 8 else "yuv420p"
    formats = [f.name for f in (av.Codec(video_encoder, "w").video_formats or [])]
    if formats and pix_fmt not in formats:
        raise ValueError(f"SaveVideo: {bit_depth}-bit H.264 needs pixel format {pix_fmt}, which encoder "
                         f"{video_encoder} lacks (it has {', '.join(formats)})")
    audio = _mp4_audio(video, total)
    tmp = _temporary_name(path)
    try:
        with av.open(str(tmp), mode="w", format="mp4", options={"movflags": "use_metadata_tags"}) as container:
            for key, value in (metadata or {}).items():
                container.metadata[str(key)] = json.dumps(value)
            # Encoder time bases need a small denominator: 23.976 is stored as 2997/125.
            stream_rate = Fraction(rate).limit_denominator(1001 * 1000)
            vstream = container.add_stream(video_encoder, rate=stream_rate)
            vstream.width, vstream.height = width + width % 2, height + height % 2
            vstream.pix_fmt = pix_fmt
            astream = None
            if audio is not None:
                astream = container.add_stream(audio_encoder, rate=MP4_AUDIO_SAMPLE_RATE_HZ, layout="stereo")
            frame_fmt = "rgb48le" if bit_depth > 8 else "rgb24"
            done, audio_done = 0, 0
            for chunk in video.iter_frame_chunks(frames_per_chunk):
                if chunk.shape[1] != height or chunk.shape[2] != width:
                    raise ValueError(f"SaveVideo: frame {done} is {chunk.shape[2]}x{chunk.shape[1]}, "
                                     f"the video is {width}x{height}")
                pixels = _chunk_pixels(chunk, bit_depth, height % 2, width % 2)
                for offset in range(pixels.shape[0]):
                    frame = av.VideoFrame.from_ndarray(pixels[offset], format=frame_fmt)
                    frame.pts = done + offset
                    for packet in vstream.encode(frame):
                        container.mux(packet)
                done += pixels.shape[0]
                if astream is not None:
                    # Interleave: add the sound up to the end of the frames written so far.
                    upto = min(audio.shape[1], round(done / float(rate) * MP4_AUDIO_SAMPLE_RATE_HZ))
                    audio_done = _encode_audio_span(container, astream, audio, audio_done, upto)
                if progress is not None:
                    progress(done, max(total, done))
            if done == 0:
                raise ValueError("SaveVideo: the video has no frames")
            for packet in vstream.encode(None):
                container.mux(packet)
            if astream is not None:
                _encode_audio_span(container, astream, audio, audio_done, audio.shape[1])
                for packet in astream.encode(None):
                    container.mux(packet)
        _finish(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _encode_audio_span(container, stream, audio: np.ndarray, start: int, stop: int) -> int:
    if stop <= start:
        return start
    frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(audio[:, start:stop]), format="fltp", layout="stereo")
    frame.sample_rate = MP4_AUDIO_SAMPLE_RATE_HZ
    frame.pts = start
    frame.time_base = Fraction(1, MP4_AUDIO_SAMPLE_RATE_HZ)
    for packet in stream.encode(frame):  # PyAV re-chunks to the encoder's 1024-sample frames
        container.mux(packet)
    return stop


# ---------------------------------------------------------------------- node functions
def _as_list(value: Any) -> list:
    return value if isinstance(value, list) else [value]


def _create_video(images: torch.Tensor, fps: float, audio: dict | None = None,
                  bit_depth: int | str = "auto") -> tuple[Video]:
    images = check_image("CreateVideo", images, "images")
    if audio is not None:
        check_audio("CreateVideo", audio)
    depth = 8 if bit_depth == "auto" else int(bit_depth)
    return (VideoComponents(images=images, audio=audio, frame_rate=as_frame_rate(fps), bit_depth=depth),)


def _get_video_components(video: Video) -> tuple[torch.Tensor, dict | None, float]:
    components = check_video("GetVideoComponents", video).get_components()
    return components.images, components.audio, float(components.frame_rate)


def _load_video(file: str) -> tuple[Video]:
    path = annotated_path(file)
    if not path.is_file():
        raise FileNotFoundError(f"LoadVideo: video file {file!r} not found (searched folder: {annotated_folder(file)})")
    return (VideoFile(path),)


def _load_video_fingerprint(file: str, **_other: Any) -> str:
    # Videos are large: size and modification time stand in for a content hash.
    stat = annotated_path(file).stat()
    return f"{stat.st_size}:{stat.st_mtime_ns}"


def _load_video_validate(file: Any = None, **_other: Any) -> bool | str:
    return check_input_file("LoadVideo", "video", file)


def _save_video(video: Video, filename_prefix: str = "video/ComfyUI", format: str = "auto", codec: str = "auto",
                prompt: Any = None, extra_pnginfo: Any = None) -> NodeOutput:
    video = check_video("SaveVideo", video)
    ctx = current()
    width, height = video.get_dimensions()
    path, filename, subfolder = output_target("output", filename_prefix, "mp4", width=width, height=height)
    video.save_to(path, format=format, codec=codec, metadata=file_metadata(prompt, extra_pnginfo),
                  progress=lambda done, total: ctx.progress(done, total))
    return NodeOutput.of(video, ui={"images": [{"filename": filename, "subfolder": subfolder, "type": "output"}],
                                    "animated": (True,)})


def _concatenate_video(videos: dict, codec: Any = "auto", complete_audio: Any = None) -> tuple[Video]:
    # The node takes whole lists (input_is_list), as ComfyUI's does: every value arrives as a list.
    clips = [check_video("ConcatenateVideo", v, name) for name, slot in videos.items() for v in _as_list(slot)]
    codec_name = _as_list(codec)[0] if codec is not None else "auto"
    if codec_name not in VIDEO_CODECS:
        raise ValueError(f"ConcatenateVideo: codec {codec_name!r} not supported; expected one of {VIDEO_CODECS}")
    audio = _as_list(complete_audio)[0] if complete_audio is not None else None
    return (VideoConcat(clips, audio=audio, codec=codec_name),)


def _load_audio(audio: str) -> tuple[dict]:
    path = annotated_path(audio)
    if not path.is_file():
        raise FileNotFoundError(f"LoadAudio: audio file {audio!r} not found (searched folder: {annotated_folder(audio)})")
    try:
        loaded = decode_audio(path)
    except av.FFmpegError as exc:
        raise ValueError(f"LoadAudio: cannot read {audio!r}: {exc}") from exc
    if loaded is None:
        raise ValueError(f"LoadAudio: file {audio!r} has no audio stream")
    return (loaded,)


def _load_audio_fingerprint(audio: str, **_other: Any) -> str:
    return file_sha256(annotated_path(audio))


def _load_audio_validate(audio: Any = None, **_other: Any) -> bool | str:
    return check_input_file("LoadAudio", "audio", audio)


def _save_audio_files(node: str, audio: dict, prefix: str, kind: str, metadata: dict) -> list[dict[str, str]]:
    audio = check_audio(node, audio)
    results = []
    for waveform in audio["waveform"]:
        path, filename, subfolder = output_target(kind, prefix, "flac")
        write_audio_file(path, waveform, int(audio["sample_rate"]), metadata=metadata)
        results.append({"filename": filename, "subfolder": subfolder, "type": kind})
    return results


def _save_audio(audio: dict, filename_prefix: str = "audio/ComfyUI", prompt: Any = None,
                extra_pnginfo: Any = None) -> NodeOutput:
    results = _save_audio_files("SaveAudio", audio, filename_prefix, "output", file_metadata(prompt, extra_pnginfo))
    return NodeOutput.of(audio, ui={"audio": results})


def _preview_audio(audio: dict, prompt: Any = None, extra_pnginfo: Any = None) -> NodeOutput:
    results = _save_audio_files("PreviewAudio", audio, temp_prefix(), "temp", file_metadata(prompt, extra_pnginfo))
    return NodeOutput.of(audio, ui={"audio": results})


def _file_choice(name: str, suffixes: tuple[str, ...], upload_option: str) -> Any:
    spec = Input.combo(name, lambda: list_input_files(suffixes), folder=input_folder)
    return dataclasses.replace(spec, options={**spec.options, upload_option: True})


_HIDDEN_METADATA = [Input.hidden("prompt", "PROMPT"), Input.hidden("extra_pnginfo", "EXTRA_PNGINFO")]

NODES = [
    NodeSpec(
        node_id="CreateVideo", display_name="Create Video", category="video",
        python_module="comfy_extras.nodes_video", description="Create a video from images.",
        execute=_create_video,
        inputs=[
            Input.link("images", "IMAGE", tooltip="The images to create a video from."),
            Input.float("fps", 30.0, min=1.0, max=120.0, step=1.0),
            Input.link("audio", "AUDIO", optional=True, tooltip="The audio to add to the video."),
            Input.combo("bit_depth", ["auto", 8, 10], "auto", optional=True,
                        tooltip="H.264 bit depth when saved; auto means 8-bit."),
        ],
        outputs=[Output("VIDEO")],
        search_aliases=("images to video",),
    ),
    NodeSpec(
        node_id="GetVideoComponents", display_name="Get Video Components", category="video",
        python_module="comfy_extras.nodes_video",
        description="Extracts all components from a video: frames, audio, and framerate.",
        execute=_get_video_components,
        inputs=[Input.link("video", "VIDEO", tooltip="The video to extract components from.")],
        outputs=[Output("IMAGE", "images"), Output("AUDIO", "audio"), Output("FLOAT", "fps")],
        search_aliases=("extract frames", "split video", "video to images", "demux"),
    ),
    NodeSpec(
        node_id="LoadVideo", display_name="Load Video", category="video", python_module="comfy_extras.nodes_video",
        description="Load a video (and its sound) from the input folder; frames are decoded when needed.",
        execute=_load_video, inputs=[_file_choice("file", VIDEO_EXTENSIONS, "video_upload")],
        outputs=[Output("VIDEO")],
        fingerprint=_load_video_fingerprint, validate_inputs=_load_video_validate, validate_takes=frozenset({"file"}),
        search_aliases=("import video", "open video", "video file"),
    ),
    NodeSpec(
        node_id="SaveVideo", display_name="Save Video", category="video", python_module="comfy_extras.nodes_video",
        description="Saves the input video to the output directory as MP4 (H.264, AAC stereo 32 kHz).",
        execute=_save_video, output_node=True,
        inputs=[
            Input.link("video", "VIDEO", tooltip="The video to save."),
            Input.string("filename_prefix", "video/ComfyUI",
                         tooltip="The prefix for the file to save; it may hold a subfolder and %width%/%height%."),
            Input.combo("format", list(VIDEO_FORMATS), "auto", tooltip="The format to save the video as."),
            Input.combo("codec", list(VIDEO_CODECS), "auto", tooltip="The codec to use for the video."),
            *_HIDDEN_METADATA,
        ],
        outputs=[Output("VIDEO", "video", tooltip="The input video, unchanged.")],
        search_aliases=("export video",),
    ),
    NodeSpec(
        node_id="ConcatenateVideo", display_name="Concatenate Video", category="video",
        python_module="comfy_extras.nodes_video",
        description="Joins videos in order, with their sound; all clips need the same size and frame rate.",
        execute=_concatenate_video, input_is_list=True,
        inputs=[
            Input.autogrow("videos", Input.link("video", "VIDEO", tooltip="A video segment to append."),
                           prefix="video", min=1, max=100, tooltip="Video segments to concatenate in input order."),
            Input.combo("codec", list(VIDEO_CODECS), "auto",
                        tooltip="Codec used when the result is saved; auto uses H.264."),
            Input.link("complete_audio", "AUDIO", optional=True,
                       tooltip="Optional soundtrack for the whole result; replaces the clips' own sound."),
        ],
        outputs=[Output("VIDEO", tooltip="The concatenated video.")],
    ),
    NodeSpec(
        node_id="LoadAudio", display_name="Load Audio", category="audio", python_module="comfy_extras.nodes_audio",
        description="Load the sound of an audio or video file from the input folder.",
        execute=_load_audio, inputs=[_file_choice("audio", AUDIO_EXTENSIONS + VIDEO_EXTENSIONS, "audio_upload")],
        outputs=[Output("AUDIO")],
        fingerprint=_load_audio_fingerprint, validate_inputs=_load_audio_validate, validate_takes=frozenset({"audio"}),
        search_aliases=("import audio", "open audio", "audio file"),
    ),
    NodeSpec(
        node_id="SaveAudio", display_name="Save Audio (FLAC)", category="audio",
        python_module="comfy_extras.nodes_audio", description="Saves the input audio to the output directory as FLAC.",
        execute=_save_audio, output_node=True,
        inputs=[Input.link("audio", "AUDIO"), Input.string("filename_prefix", "audio/ComfyUI"), *_HIDDEN_METADATA],
        outputs=[Output("AUDIO", "audio")],
        search_aliases=("export flac",),
    ),
    NodeSpec(
        node_id="PreviewAudio", display_name="Preview Audio", category="audio",
        python_module="comfy_extras.nodes_audio",
        description="Preview the audio without saving it to the output directory.",
        execute=_preview_audio, output_node=True,
        inputs=[Input.link("audio", "AUDIO"), *_HIDDEN_METADATA],
        outputs=[Output("AUDIO", "audio")],
        search_aliases=("preview", "preview audio", "play audio"),
    ),
]
