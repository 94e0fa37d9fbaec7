"""VIDEO values and MP4 writing.

Every VIDEO is a `Video`: `VideoComponents` keeps frames (T, H, W, C) in 0..1 in memory with an optional
AUDIO and an exact frame rate; `VideoFile` probes a file at once and decodes frames only when asked;
`VideoConcat` plays several clips back to back. They share the interface ComfyUI node packs call
(`get_components()`, `get_dimensions()`, `get_frame_count()`, `get_frame_rate()`, `get_audio()`,
`save_to(path)`), plus `iter_frame_chunks(n)`, which lets the writer stream frames.

`write_mp4` stores H.264 picture and AAC stereo sound at 32 kHz, the sound format of the H3 models. It
converts a few frames at a time straight from the source, so a long clip is never copied whole, and
the file appears under its name only once it is complete. A joined video's clips are encoded one by one
and their packets copied into the file; `EncodedPieces` keeps those pieces for clips still in memory,
and the last few sound tracks written, so writing the joined clip again after its last part changed
encodes only that part's pictures and the sound from a little before the first changed sample.
"""
from __future__ import annotations

import abc
import io
import json
import math
import os
import weakref
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import av
import numpy as np
import torch

from media.audio import (
    available_encoder, check_audio, declared_seconds, decode_audio, fit_length, match_channels, resample_waveform,
)
from media.image import check_image
from media.limits import FLOAT_BYTES, PICTURE_CHANNELS, DecodeLimits, decode_limits
from media.staging import staged_file

MP4_AUDIO_SAMPLE_RATE_HZ = 32000
MP4_AUDIO_CHANNELS = 2
VIDEO_EXTENSIONS = (".mp4", ".webm", ".mkv", ".mov", ".avi", ".m4v")
AUDIO_EXTENSIONS = (".wav", ".flac", ".mp3", ".ogg", ".opus", ".m4a", ".aac")
VIDEO_FORMATS = ("auto", "mp4")
VIDEO_CODECS = ("auto", "h264")
FRAMES_PER_CHUNK = 16  # frames turned into 8- or 16-bit pixels per step of the writer
FRAME_RATE_MAX_DENOMINATOR = 1001  # NTSC rates such as 24000/1001 stay exact when given as floats
_H264_ENCODERS = ("libx264", "h264")  # "h264" is whatever H.264 encoder the FFmpeg build defaults to
_AAC_ENCODERS = ("aac", "libfdk_aac")
_DEEP_PIXEL_TAGS = ("p10", "p12", "p16", "10le", "12le", "16le")  # pixel formats above 8 bits per sample


def pick_encoder(label: str, candidates: Sequence[str]) -> str:
    """The first of `candidates` this PyAV build can encode with; a ValueError naming them all otherwise."""
    return available_encoder(label, tuple(candidates))


def h264_encoder() -> str:
    """The H.264 encoder MP4 files are written with."""
    return pick_encoder("H.264", _H264_ENCODERS)


def aac_encoder() -> str:
    """The AAC encoder MP4 sound is written with."""
    return pick_encoder("AAC", _AAC_ENCODERS)


def as_frame_rate(value: Any) -> Fraction:
    """A positive, finite frame rate as an exact Fraction; floats snap to the nearest x/1001 or simpler."""
    if isinstance(value, bool) or not isinstance(value, (int, float, Fraction, np.number)):
        raise TypeError(f"a frame rate is a number, not {value!r}")
    if not math.isfinite(float(value)) or value <= 0:
        raise ValueError(f"a frame rate must be finite and above 0, not {value!r}")
    if isinstance(value, (int, Fraction)):
        rate = Fraction(value)
    else:
        rate = Fraction(float(value)).limit_denominator(FRAME_RATE_MAX_DENOMINATOR)
    if rate <= 0:  # a float close enough to 0 snaps to 0
        raise ValueError(f"frame rate {value!r} is too close to 0")
    return rate


def _audio_nbytes(audio: dict | None) -> int:
    return 0 if audio is None else audio["waveform"].element_size() * audio["waveform"].nelement()


class Video(abc.ABC):
    """What a VIDEO wire carries; see the module docstring for the three kinds."""

    bit_depth: int = 8

    @abc.abstractmethod
    def get_components(self) -> "VideoComponents":
        """Every frame in memory, with the sound and the frame rate."""

    @abc.abstractmethod
    def get_dimensions(self) -> tuple[int, int]:
        """(width, height) in pixels."""

    @abc.abstractmethod
    def get_frame_count(self) -> int:
        """How many pictures the video has."""

    @abc.abstractmethod
    def get_frame_rate(self) -> Fraction:
        """Pictures per second, exact."""

    @abc.abstractmethod
    def get_audio(self) -> dict | None:
        """The sound as AUDIO, or None when the video is silent."""

    @abc.abstractmethod
    def iter_frame_chunks(self, frames_per_chunk: int = FRAMES_PER_CHUNK) -> Iterator[torch.Tensor]:
        """The frames in order as (t, H, W, C) tensors in 0..1, at most `frames_per_chunk` per tensor."""

    @property
    def nbytes(self) -> int:
        """Bytes of memory this value keeps alive (counted by the RAM-bounded output cache)."""
        return 0

    def get_duration(self) -> float:
        """Seconds of picture."""
        return self.get_frame_count() / float(self.get_frame_rate())

    def save_to(self, path: str | os.PathLike, *, format: str = "auto", codec: str = "auto",
                metadata: dict[str, Any] | None = None,
                progress: Callable[[int, int], None] | None = None,
                pieces: "EncodedPieces | None" = None) -> None:
        """Write this video as an MP4 file at `path` (see `write_mp4`)."""
        if format not in VIDEO_FORMATS:
            raise ValueError(f"video format {format!r} cannot be written; the choices are {VIDEO_FORMATS}")
        write_mp4(Path(path), self, codec=codec, metadata=metadata, progress=progress, pieces=pieces)


@dataclass(eq=False)  # compared by identity: `==` on tensors would compare element by element
class VideoComponents(Video):
    """A video in memory: its frames, its sound (or None) and its frame rate."""

    images: torch.Tensor  # (T, H, W, C) float, 0..1
    audio: dict | None = None  # AUDIO
    frame_rate: Fraction = Fraction(24)
    bit_depth: int = 8  # 8 or 10: the H.264 sample depth used when written

    def __post_init__(self):
        check_image("VIDEO", self.images, "images")
        self.frame_rate = as_frame_rate(self.frame_rate)
        if self.audio is not None:
            self.audio = check_audio("VIDEO", self.audio)
        if self.bit_depth not in (8, 10):
            raise ValueError(f"VIDEO: the bit depth is 8 or 10, not {self.bit_depth!r}")

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
        for first in range(0, self.images.shape[0], frames_per_chunk):
            yield self.images[first:first + frames_per_chunk]  # slices share the frames' storage


def _frames_to_float(frames: np.ndarray) -> torch.Tensor:
    full_scale = 65535.0 if frames.dtype == np.uint16 else 255.0
    return torch.from_numpy(frames.astype(np.float32)) / full_scale


class VideoFile(Video):
    """A video file: size, rate and length are read from its header now, pictures when they are needed.

    Opening refuses a frame size or a declared duration over the decoding caps (`media.limits`);
    decoding every picture at once (`get_components`) refuses, before it starts, a declared frame count
    whose pictures would pass the byte cap, and counts the pictures it decodes against that cap."""

    def __init__(self, path: str | os.PathLike, limits: DecodeLimits | None = None):
        self.path = Path(path)
        self.limits = limits or decode_limits()
        try:
            with av.open(str(self.path)) as container:
                if not container.streams.video:
                    raise ValueError(f"video file {self.path.name!r} holds no picture track")
                track = container.streams.video[0]
                self._width = int(track.codec_context.width)
                self._height = int(track.codec_context.height)
                self._check_frame_size(self._width, self._height)
                stated = track.average_rate or track.guessed_rate or track.base_rate
                self._frame_rate = as_frame_rate(Fraction(stated) if stated else Fraction(24))
                self.limits.check_seconds(declared_seconds(container, track), f"video file {self.path.name!r}")
                self._frames = int(track.frames or 0)  # 0 when the container does not record it
                self._has_audio = bool(container.streams.audio)
                pix_fmt = track.codec_context.pix_fmt or ""
                self.bit_depth = 10 if any(tag in pix_fmt for tag in _DEEP_PIXEL_TAGS) else 8
        except av.FFmpegError as exc:
            raise ValueError(f"cannot read video file {self.path.name!r}: {exc}") from exc
        self._audio: dict | None = None

    def _check_frame_size(self, width: int, height: int) -> None:
        if width * height > self.limits.max_frame_pixels:
            raise ValueError(f"video file {self.path.name!r} has {width}x{height} frames, over the limit of "
                             f"{self.limits.max_frame_pixels // 1_000_000} MP per frame")

    def _picture_bytes(self, frames: int) -> int:
        return frames * self._width * self._height * PICTURE_CHANNELS * FLOAT_BYTES

    @property
    def nbytes(self) -> int:
        return _audio_nbytes(self._audio)  # the pictures stay on disk

    def get_dimensions(self) -> tuple[int, int]:
        return self._width, self._height

    def get_frame_rate(self) -> Fraction:
        return self._frame_rate

    def get_frame_count(self) -> int:
        if self._frames <= 0:
            self._frames = sum(chunk.shape[0] for chunk in self.iter_frame_chunks(64))
        return self._frames

    def get_audio(self) -> dict | None:
        if self._has_audio and self._audio is None:
            self._audio = decode_audio(self.path, self.limits)
        return self._audio

    def _decoded_frames(self) -> Iterator[np.ndarray]:
        """Each picture as packed RGB integers (8- or 16-bit, following the file's depth)."""
        packing = "rgb48le" if self.bit_depth > 8 else "rgb24"
        with av.open(str(self.path)) as container:
            track = container.streams.video[0]
            track.thread_type = "AUTO"
            for frame in container.decode(track):
                # A stream may change size midway: each frame is checked before it is converted.
                self._check_frame_size(frame.width, frame.height)
                yield frame.to_ndarray(format=packing)

    def iter_frame_chunks(self, frames_per_chunk: int = FRAMES_PER_CHUNK) -> Iterator[torch.Tensor]:
        pending: list[np.ndarray] = []
        for frame in self._decoded_frames():
            pending.append(frame)
            if len(pending) == frames_per_chunk:
                yield _frames_to_float(np.stack(pending))
                pending = []
        if pending:
            yield _frames_to_float(np.stack(pending))

    def get_components(self) -> VideoComponents:
        what = f"video file {self.path.name!r}"
        self.limits.check_bytes(self._picture_bytes(self._frames), what)  # the declared count (0: unknown)
        # Decoded pictures stay 8/16-bit until the one float tensor is filled, so only one float copy exists.
        frames = []
        for frame in self._decoded_frames():
            frames.append(frame)
            self.limits.check_bytes(len(frames) * frame.shape[0] * frame.shape[1] * PICTURE_CHANNELS * FLOAT_BYTES,
                                    what)
        if not frames:
            raise ValueError(f"video file {self.path.name!r} holds no decodable pictures")
        images = torch.empty((len(frames),) + frames[0].shape, dtype=torch.float32)
        for index, frame in enumerate(frames):
            images[index] = _frames_to_float(frame)
        self._frames = len(frames)
        return VideoComponents(images=images, audio=self.get_audio(), frame_rate=self._frame_rate,
                               bit_depth=self.bit_depth)


class VideoConcat(Video):
    """Clips of one size and frame rate played back to back; nothing is decoded or copied until asked for."""

    def __init__(self, clips: Sequence[Video], *, audio: dict | None = None, codec: str = "auto"):
        if not clips:
            raise ValueError("there are no clips to join")
        size, rate = clips[0].get_dimensions(), clips[0].get_frame_rate()
        for number, clip in enumerate(clips[1:], start=2):
            other_size, other_rate = clip.get_dimensions(), clip.get_frame_rate()
            if other_size != size:
                raise ValueError(f"clip {number} is {other_size[0]}x{other_size[1]} but clip 1 is "
                                 f"{size[0]}x{size[1]}; joined clips must share one size")
            if other_rate != rate:
                raise ValueError(f"clip {number} runs at {float(other_rate):g} fps but clip 1 at "
                                 f"{float(rate):g} fps; joined clips must share one frame rate")
        if audio is not None:
            audio = check_audio("VIDEO", audio, "complete_audio")
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
        sounding = [track for track in tracks if track is not None]
        if not sounding:
            return None
        rate = int(sounding[0]["sample_rate"])
        channels = max(int(track["waveform"].shape[1]) for track in sounding)
        parts = []
        for clip, track in zip(self.clips, tracks):
            # Each part lasts exactly as long as its clip's pictures, silent or not, so the sound of
            # later clips starts with their first frame.
            span = int(round(clip.get_duration() * rate))
            if track is None:
                parts.append(torch.zeros((1, channels, span)))
                continue
            waveform = match_channels(track["waveform"][:1].float().cpu(), channels, node="VIDEO")
            waveform = resample_waveform(waveform, int(track["sample_rate"]), rate)
            parts.append(fit_length(waveform, span))
        return {"waveform": torch.cat(parts, dim=-1), "sample_rate": rate}

    def iter_frame_chunks(self, frames_per_chunk: int = FRAMES_PER_CHUNK) -> Iterator[torch.Tensor]:
        for clip in self.clips:
            yield from clip.iter_frame_chunks(frames_per_chunk)

    def get_components(self) -> VideoComponents:
        images = torch.cat([clip.get_components().images for clip in self.clips], dim=0)
        return VideoComponents(images=images, audio=self.get_audio(), frame_rate=self.get_frame_rate(),
                               bit_depth=self.bit_depth)


class VideoTrim(Video):
    """A stretch of another video: the frames shown from `start` seconds on, for `duration` seconds (0: to the end).

    A frame belongs to the stretch when its start time lies in [start, start + duration); the sound is cut
    to the same times. Nothing is decoded until the frames are asked for.
    """

    def __init__(self, source: Video, start: float, duration: float = 0.0):
        if start < 0 or duration < 0:
            raise ValueError(f"a trim's start and duration cannot be negative (got {start} and {duration})")
        self.source = source
        self.start = float(start)
        self.duration = float(duration)
        rate = source.get_frame_rate()
        total = source.get_frame_count()
        self.first = min(total, math.ceil(self.start * rate - 1e-9))
        stop = total if not self.duration else math.ceil((self.start + self.duration) * rate - 1e-9)
        self.stop = max(self.first, min(total, stop))
        if self.stop <= self.first:
            raise ValueError(f"the video is {source.get_duration():.3f} s long; nothing of it starts at or after "
                             f"{self.start:g} s")
        self.bit_depth = source.bit_depth

    @property
    def nbytes(self) -> int:
        return self.source.nbytes

    def get_dimensions(self) -> tuple[int, int]:
        return self.source.get_dimensions()

    def get_frame_rate(self) -> Fraction:
        return self.source.get_frame_rate()

    def get_frame_count(self) -> int:
        return self.stop - self.first

    def get_audio(self) -> dict | None:
        audio = self.source.get_audio()
        if audio is None:
            return None
        rate = int(audio["sample_rate"])
        seconds_per_frame = 1 / float(self.get_frame_rate())
        begin = round(self.first * seconds_per_frame * rate)
        end = round(self.stop * seconds_per_frame * rate)
        return {**audio, "waveform": audio["waveform"][..., begin:end]}

    def iter_frame_chunks(self, frames_per_chunk: int = FRAMES_PER_CHUNK) -> Iterator[torch.Tensor]:
        seen = 0
        for chunk in self.source.iter_frame_chunks(frames_per_chunk):
            begin, end = max(self.first - seen, 0), min(self.stop - seen, chunk.shape[0])
            if begin < end:
                yield chunk[begin:end]
            seen += chunk.shape[0]
            if seen >= self.stop:
                break

    def get_components(self) -> VideoComponents:
        images = torch.cat(list(self.iter_frame_chunks(64)), dim=0)
        return VideoComponents(images=images, audio=self.get_audio(), frame_rate=self.get_frame_rate(),
                               bit_depth=self.bit_depth)


def check_video(node: str, video: Any, name: str = "video") -> Video:
    """`video` when it is a VIDEO; a TypeError naming the node and input otherwise."""
    if not isinstance(video, Video):
        raise TypeError(f"{node}: input '{name}' takes a VIDEO; got {type(video).__name__}")
    return video


# ---------------------------------------------------------------------- MP4
def _rgb_pixels(chunk: torch.Tensor, bit_depth: int, extra_row: int, extra_col: int) -> np.ndarray:
    """A chunk (t, H, W, C) in 0..1 as packed RGB integers, one edge row/column repeated when asked."""
    rgb = chunk[..., :3] if chunk.shape[-1] >= 3 else chunk[..., :1].expand(*chunk.shape[:-1], 3)
    if extra_row:
        rgb = torch.cat([rgb, rgb[:, -1:]], dim=1)
    if extra_col:
        rgb = torch.cat([rgb, rgb[:, :, -1:]], dim=2)
    levels = 65535.0 if bit_depth > 8 else 255.0
    quantised = (rgb.float().clamp(0, 1) * levels).round()
    if bit_depth > 8:
        # torch lacks uint16 arithmetic on some backends: round in int32, narrow in numpy.
        return quantised.to(torch.int32).cpu().numpy().astype(np.uint16)
    return quantised.to(torch.uint8).cpu().numpy()


def _mp4_sound(video: Video, frame_count: int) -> np.ndarray | None:
    """The video's sound as float32 (2, S) at 32 kHz, no longer than its pictures; None when silent."""
    audio = video.get_audio()
    if audio is None:
        return None
    audio = check_audio("VIDEO", audio)
    rate = int(audio["sample_rate"])
    waveform = audio["waveform"][0]  # (C, S): a video has one sound track, the batch's first clip
    picture_samples = math.ceil(rate * frame_count / float(video.get_frame_rate()))
    waveform = match_channels(waveform[:, :picture_samples].float(), MP4_AUDIO_CHANNELS, node="VIDEO")
    waveform = resample_waveform(waveform, rate, MP4_AUDIO_SAMPLE_RATE_HZ)
    return np.ascontiguousarray(waveform.clamp(-1, 1).cpu().numpy(), dtype=np.float32)


@dataclass(frozen=True)
class _SoundPacket:
    """One encoded AAC frame as it went into a file: its bytes and timing (in `time_base` units)."""
    data: bytes
    pts: int
    dts: int
    duration: int
    time_base: Fraction


@dataclass
class _EncodedSound:
    """A whole sound track as written: the samples the encoder was given and the packets it made."""
    encoder: str
    samples: np.ndarray  # (2, S) float32 at 32 kHz
    packets: list[_SoundPacket]

    @property
    def nbytes(self) -> int:
        return self.samples.nbytes + sum(len(packet.data) for packet in self.packets)


SOUND_SPLICE_PRIMING_FRAMES = 4  # encoder frames fed, and their packets dropped, before a splice point


class _SoundTrack:
    """Writes a video's sound into its AAC track, interleaved with the pictures by `write_until`.

    Given an earlier encoding of a sound that begins with the same samples, it copies that encoding's
    packets up to a splice point a little before the first changed sample and encodes only from there:
    the encoder starts `SOUND_SPLICE_PRIMING_FRAMES` frames before the splice point and its packets
    before it are dropped, so every packet kept was made from the samples it stands for (an AAC frame
    sees its own samples and the frame before; the margin also covers the encoder's look-ahead). The
    encoder's rate control starts anew there, so the few frames after the splice point are coded a little
    differently from a whole encode: their error stays within what the whole encode makes at its worst
    moment (tests/media/test_video_values.py).
    """

    def __init__(self, container, track, sound: np.ndarray, earlier: "_EncodedSound | None", encoder: str) -> None:
        self.container, self.track, self.sound, self.encoder = container, track, sound, encoder
        self.copied: list[_SoundPacket] = []
        self.copied_count = 0  # packets taken from the earlier encoding
        self.splice_pts: int | None = None  # packets of the fresh encode before this are dropped
        self.fed = 0  # samples handed to the encoder so far
        self.written: list[_SoundPacket] = []
        if earlier is not None:
            self._plan_splice(earlier)

    def _plan_splice(self, earlier: "_EncodedSound") -> None:
        frame = self.track.codec_context.frame_size or 1024
        common = _common_prefix(earlier.samples, self.sound)
        if common == self.sound.shape[1] == earlier.samples.shape[1]:
            self.copied, self.fed = list(earlier.packets), common  # the same sound: every packet as it was
            return
        # Packet k (pts (k - 1) * frame) holds samples up to (k + 1) * frame; one frame more of margin.
        splice_frame = common // frame - 2
        if splice_frame <= SOUND_SPLICE_PRIMING_FRAMES:
            return
        self.splice_pts = (splice_frame - 1) * frame
        self.copied = [p for p in earlier.packets if p.time_base == Fraction(1, MP4_AUDIO_SAMPLE_RATE_HZ)
                       and p.pts < self.splice_pts]
        if len(self.copied) != splice_frame:  # not the encoding this plan assumes: encode it all
            self.copied, self.splice_pts = [], None
            return
        self.fed = (splice_frame - SOUND_SPLICE_PRIMING_FRAMES) * frame

    def _mux(self, packet: _SoundPacket) -> None:
        self.written.append(packet)
        out = av.Packet(packet.data)
        out.pts, out.dts, out.duration, out.time_base = packet.pts, packet.dts, packet.duration, packet.time_base
        out.stream = self.track
        self.container.mux(out)

    def _take(self, packets) -> None:
        for packet in packets:
            if packet.pts is None:
                continue
            kept = _SoundPacket(bytes(packet), packet.pts, packet.dts, packet.duration, packet.time_base)
            if self.splice_pts is None or kept.pts >= self.splice_pts:
                self._mux(kept)

    def write_until(self, stop: int) -> None:
        """Write the sound up to sample `stop` (copied packets first, then freshly encoded samples)."""
        while self.copied and self.copied[0].pts < stop:
            self._mux(self.copied.pop(0))
            self.copied_count += 1
        stop = min(stop, self.sound.shape[1])
        if stop <= self.fed:
            return
        block = av.AudioFrame.from_ndarray(np.ascontiguousarray(self.sound[:, self.fed:stop]), format="fltp",
                                           layout="stereo")
        block.sample_rate = MP4_AUDIO_SAMPLE_RATE_HZ
        block.pts = self.fed
        block.time_base = Fraction(1, MP4_AUDIO_SAMPLE_RATE_HZ)
        self._take(self.track.encode(block))  # PyAV splits the block into the encoder's own frame size
        self.fed = stop

    def finish(self) -> _EncodedSound:
        """Write the rest and flush the encoder; the whole track as written."""
        self.write_until(self.sound.shape[1])
        while self.copied:
            self._mux(self.copied.pop(0))
            self.copied_count += 1
        self._take(self.track.encode(None))  # nothing when every packet was copied
        return _EncodedSound(self.encoder, self.sound, self.written)


def _common_prefix(first: np.ndarray, second: np.ndarray) -> int:
    """How many leading samples (all channels) two sounds share."""
    if first.shape[0] != second.shape[0]:
        return 0
    length = min(first.shape[1], second.shape[1])
    differ = np.flatnonzero((first[:, :length] != second[:, :length]).any(axis=0))
    return int(differ[0]) if differ.size else length


@dataclass(frozen=True)
class _PictureSettings:
    """How pictures are encoded: what a stored piece must have been encoded with to be reused."""
    encoder: str
    pix_fmt: str
    width: int
    height: int
    rate: Fraction
    bit_depth: int


def _picture_settings(video: Video, codec: str) -> _PictureSettings:
    if codec not in VIDEO_CODECS:
        raise ValueError(f"video codec {codec!r} cannot be written; the choices are {VIDEO_CODECS}")
    picture_encoder = h264_encoder()
    width, height = video.get_dimensions()
    deep = video.bit_depth > 8
    pix_fmt = "yuv420p10le" if deep else "yuv420p"
    offered = [f.name for f in (av.Codec(picture_encoder, "w").video_formats or [])]
    if offered and pix_fmt not in offered:
        raise ValueError(f"{video.bit_depth}-bit H.264 is written as {pix_fmt}, which encoder {picture_encoder} "
                         f"does not offer (it offers {', '.join(offered)})")
    return _PictureSettings(picture_encoder, pix_fmt, width, height, Fraction(video.get_frame_rate()), video.bit_depth)


def _add_picture_stream(container, settings: _PictureSettings):
    # Encoders want a time base with a modest denominator; e.g. 24000/1001 fps is kept as 2997/125.
    picture = container.add_stream(settings.encoder, rate=settings.rate.limit_denominator(1001 * 1000))
    picture.width, picture.height = settings.width + settings.width % 2, settings.height + settings.height % 2
    picture.pix_fmt = settings.pix_fmt
    return picture


def _encode_pictures(container, picture, video: Video, settings: _PictureSettings, frames_per_chunk: int,
                     after_chunk: Callable[[int], None]) -> int:
    """Encode every frame of `video` into `picture` (not flushed); `after_chunk(frames so far)` per chunk."""
    packing = "rgb48le" if settings.bit_depth > 8 else "rgb24"
    width, height = settings.width, settings.height
    written = 0
    for chunk in video.iter_frame_chunks(frames_per_chunk):
        if chunk.shape[1] != height or chunk.shape[2] != width:
            raise ValueError(f"frame {written} is {chunk.shape[2]}x{chunk.shape[1]} in a video of "
                             f"{width}x{height}")
        pixels = _rgb_pixels(chunk, settings.bit_depth, height % 2, width % 2)
        for offset in range(pixels.shape[0]):
            frame = av.VideoFrame.from_ndarray(pixels[offset], format=packing)
            frame.pts = written + offset
            for packet in picture.encode(frame):
                container.mux(packet)
        written += pixels.shape[0]
        after_chunk(written)
    return written


def write_mp4(path: Path, video: Video, *, codec: str = "auto", metadata: dict[str, Any] | None = None,
              frames_per_chunk: int = FRAMES_PER_CHUNK, progress: Callable[[int, int], None] | None = None,
              pieces: "EncodedPieces | None" = None) -> None:
    """Write `video` to `path` as MP4: H.264 (yuv420p, or yuv420p10le for 10-bit) and AAC stereo at 32 kHz.

    Pictures go through `frames_per_chunk` at a time. 4:2:0 chroma needs even sizes, so an odd width
    or height gains a copy of its last column or row. `progress(done, total)` is called per chunk (per
    clip for a joined video).
    A joined video (`VideoConcat`) has each clip's pictures encoded on their own (each starts with a key
    frame) and copied into the file one after another, so `pieces` can hand back the clips encoded by an
    earlier write: re-writing a joined clip whose last part changed encodes that part only.
    """
    settings = _picture_settings(video, codec)
    total = video.get_frame_count()
    sound = _mp4_sound(video, total)
    rate = settings.rate
    joined = isinstance(video, VideoConcat) and len(video.clips) > 1
    encoded: list[bytes] = []
    for clip in video.clips if joined else ():
        encoded.append(_encoded_piece(clip, settings, frames_per_chunk, pieces))
        if progress is not None:  # a joined clip's work is its parts' encoding: one step per part
            done = sum(part.get_frame_count() for part in video.clips[:len(encoded)])
            progress(done, max(total, done))
    with staged_file(path) as staging, \
            av.open(str(staging), mode="w", format="mp4", options={"movflags": "use_metadata_tags"}) as container:
        for key, value in (metadata or {}).items():
            container.metadata[str(key)] = json.dumps(value)
        sources = [av.open(io.BytesIO(piece), mode="r") for piece in encoded]
        try:
            picture = (container.add_stream_from_template(sources[0].streams.video[0]) if joined
                       else _add_picture_stream(container, settings))
            voice = None
            if sound is not None:
                sound_encoder = aac_encoder()
                track = container.add_stream(sound_encoder, rate=MP4_AUDIO_SAMPLE_RATE_HZ, layout="stereo")
                earlier = pieces.find_sound(sound, sound_encoder) if pieces is not None else None
                voice = _SoundTrack(container, track, sound, earlier, sound_encoder)

            def after_chunk(written: int) -> None:
                if voice is not None:
                    # Keep sound and pictures interleaved: write the sound up to the last picture so far.
                    voice.write_until(round(written / float(rate) * MP4_AUDIO_SAMPLE_RATE_HZ))
                if progress is not None and not joined:
                    progress(written, max(total, written))

            if joined:
                written = _copy_pieces(container, picture, sources, [clip.get_frame_count() for clip in video.clips],
                                       rate, after_chunk)
            else:
                written = _encode_pictures(container, picture, video, settings, frames_per_chunk, after_chunk)
                for packet in picture.encode(None):
                    container.mux(packet)
        finally:
            for source in sources:
                source.close()
        if written == 0:
            raise ValueError("the video has no frames to write")
        if voice is not None:
            written_sound = voice.finish()
            if pieces is not None:
                pieces.keep_sound(written_sound)
                pieces.sound_packets_copied += voice.copied_count


# ---------------------------------------------------------------------- joined clips, piece by piece
def _encode_piece(clip: Video, settings: _PictureSettings, frames_per_chunk: int) -> bytes:
    """One clip's pictures alone, as an in-memory MP4 (H.264 only, starting with a key frame)."""
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as container:
        picture = _add_picture_stream(container, settings)
        _encode_pictures(container, picture, clip, settings, frames_per_chunk, lambda written: None)
        for packet in picture.encode(None):
            container.mux(packet)
    return buffer.getvalue()


def _encoded_piece(clip: Video, settings: _PictureSettings, frames_per_chunk: int,
                   pieces: "EncodedPieces | None") -> bytes:
    found = pieces.find(clip, settings) if pieces is not None else None
    if found is None:
        found = _encode_piece(clip, settings, frames_per_chunk)
        if pieces is not None:
            pieces.keep(clip, settings, found)
    return found


def _copy_pieces(container, picture, sources: list, frame_counts: list[int], rate: Fraction,
                 after_chunk: Callable[[int], None]) -> int:
    """Copy the pieces' H.264 packets into `picture` one after another, each shifted to start where the
    frames before it end; the frames written."""
    first = sources[0].streams.video[0].codec_context.extradata
    written = 0
    for number, (source, count) in enumerate(zip(sources, frame_counts), start=1):
        stream = source.streams.video[0]
        if stream.codec_context.extradata != first:
            # One file holds one set of H.264 parameters: pieces encoded alike always share it.
            raise ValueError(f"clip {number} was encoded with other H.264 parameters than clip 1; "
                             "the joined clip cannot be written from its parts")
        shift = Fraction(written) / rate / stream.time_base
        if shift.denominator != 1:
            raise ValueError(f"clip {number} starts at frame {written}, which falls between two ticks of "
                             f"the file's time base {stream.time_base}")
        for packet in source.demux(stream):
            if packet.dts is None:  # the demuxer's end-of-stream marker
                continue
            packet.pts += int(shift)
            packet.dts += int(shift)
            packet.stream = picture
            container.mux(packet)
        written += count
        after_chunk(written)
    return written


class EncodedPieces:
    """Encoded pictures of in-memory clips (`VideoComponents`), kept while the clips' frames live and at
    most `max_bytes` in all (the oldest go first), so writing a joined clip again encodes only the clips
    that are new; and the last `SOUNDS_KEPT` sound tracks written, each with the samples it was made from
    (compared sample by sample with a new track, so a stored track is never taken for a different sound).

    A stored piece equals a fresh encode when: the clip's frames are the same tensor object (held weakly:
    a live object's id is its own), unchanged since (torch's version counter, which every in-place write
    bumps), written with the same settings (encoder, pixel format, size, frame rate, bit depth) by the
    same encoder library in this process. Clips of other kinds (files, trims) are encoded every time.
    """

    SOUNDS_KEPT = 4  # sound tracks kept for splicing: the latest few saves

    def __init__(self, max_bytes: int = 256 << 20) -> None:
        self.max_bytes = max_bytes
        # id(frames) -> (weak reference to the frames, their version, settings, piece), oldest first. Keyed by
        # id: a tensor's `==` compares elements. The reference's callback forgets the entry with the frames.
        self._pieces: dict[int, tuple[weakref.ref, int, _PictureSettings, bytes]] = {}
        self._sounds: list[_EncodedSound] = []  # the latest last
        self.hits = 0  # pictures of a clip reused
        self.sound_packets_copied = 0  # sound packets reused

    @staticmethod
    def _frames(clip: Video) -> torch.Tensor | None:
        return clip.images if isinstance(clip, VideoComponents) else None

    def find(self, clip: Video, settings: _PictureSettings) -> bytes | None:
        """The clip's stored piece when it still equals a fresh encode, else None."""
        frames = self._frames(clip)
        found = self._pieces.get(id(frames)) if frames is not None else None
        if found is None or found[0]() is not frames or found[1] != frames._version or found[2] != settings:
            return None
        self.hits += 1
        return found[3]

    def keep(self, clip: Video, settings: _PictureSettings, data: bytes) -> None:
        """Store a clip's piece (nothing for clips that are not in memory, or larger than the whole store)."""
        frames = self._frames(clip)
        if frames is None or len(data) > self.max_bytes:
            return
        key = id(frames)
        pieces = self._pieces

        def forget(ref: weakref.ref) -> None:
            if key in pieces and pieces[key][0] is ref:
                del pieces[key]

        pieces.pop(key, None)
        pieces[key] = (weakref.ref(frames, forget), frames._version, settings, data)
        total = sum(len(entry[3]) for entry in pieces.values())
        for old in list(pieces):  # insertion order: the oldest first
            if total <= self.max_bytes:
                break
            total -= len(pieces.pop(old)[3])

    def find_sound(self, sound: np.ndarray, encoder: str) -> "_EncodedSound | None":
        """The stored sound track sharing the longest beginning with `sound` (compared sample by sample, so
        a stored track is never stale), or None."""
        best, best_common = None, 0
        for stored in self._sounds:
            common = _common_prefix(stored.samples, sound) if stored.encoder == encoder else 0
            if common > best_common:
                best, best_common = stored, common
        return best

    def keep_sound(self, written: "_EncodedSound") -> None:
        """Store a sound track as written; the oldest go past `SOUNDS_KEPT` or the byte budget."""
        if written.nbytes > self.max_bytes:
            return
        self._sounds.append(written)
        while len(self._sounds) > self.SOUNDS_KEPT or sum(s.nbytes for s in self._sounds) > self.max_bytes:
            self._sounds.pop(0)

    def clear(self) -> None:
        """Forget every stored piece and sound."""
        self._pieces.clear()
        self._sounds.clear()

    def __len__(self) -> int:
        return len(self._pieces)
