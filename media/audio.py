"""AUDIO values: checking, resampling, channel and length fitting, decoding any file, writing FLAC, MP3 and Opus."""
from __future__ import annotations

from collections.abc import Mapping

import json
import math
import os
from pathlib import Path
from typing import Any

import av
import numpy as np
import torch

from media.limits import FLOAT_BYTES, DecodeLimits, decode_limits
from media.staging import staged_file

FLAC_SAMPLES_PER_FRAME = 1 << 16  # samples handed to the FLAC encoder per call


def check_audio(node: str, audio: Any, name: str = "audio") -> dict:
    """`audio` as a plain dict when it is an AUDIO mapping with a (B, C, S) waveform and a positive integer
    rate; else an error. Packs hand over other mappings (a lazily loading one from a video loader): the
    copy made here is what nodes keep."""
    if audio is None:
        raise ValueError(f"{node}: nothing arrived on input '{name}' (is there a sound track upstream?)")
    if not isinstance(audio, Mapping) or "waveform" not in audio or "sample_rate" not in audio:
        raise TypeError(f"{node}: input '{name}' takes AUDIO, a dict with 'waveform' and 'sample_rate'; "
                        f"got {type(audio).__name__}")
    waveform = audio["waveform"]
    if not isinstance(waveform, torch.Tensor) or waveform.dim() != 3 or 0 in waveform.shape[:2]:
        got = tuple(waveform.shape) if isinstance(waveform, torch.Tensor) else type(waveform).__name__
        raise TypeError(f"{node}: the waveform on input '{name}' should be a (batch, channels, samples) tensor; "
                        f"got {got}")
    rate = audio["sample_rate"]
    if isinstance(rate, bool) or not isinstance(rate, (int, np.integer)) or rate <= 0:
        raise TypeError(f"{node}: the sample_rate on input '{name}' should be a whole number of Hz above 0; "
                        f"got {rate!r}")
    return audio if type(audio) is dict else {**audio, "waveform": waveform, "sample_rate": rate}


def resample_waveform(waveform: torch.Tensor, from_hz: int, to_hz: int) -> torch.Tensor:
    """(..., S) at `from_hz` as float32 (..., round(S * to_hz / from_hz)) at `to_hz`, on the same device.

    FFmpeg's resampler does the work, one row at a time as a mono signal: given a multi-channel layout
    it would also remix the channels, which a plain rate change must not do.
    """
    if from_hz == to_hz:
        return waveform
    limits = decode_limits()
    limits.check_sample_rate(int(from_hz), "sound to be resampled")
    limits.check_sample_rate(int(to_hz), "a resampling target")
    length = waveform.shape[-1]
    wanted = int(round(length * to_hz / from_hz))
    rows_count = math.prod(waveform.shape[:-1])
    limits.check_bytes(rows_count * wanted * FLOAT_BYTES, f"sound resampled from {from_hz} to {to_hz} Hz")
    rows = waveform.detach().reshape(-1, length).float().cpu().numpy()
    result = np.zeros((rows.shape[0], wanted), dtype=np.float32)
    for row_index, row in enumerate(rows):
        source = av.AudioFrame.from_ndarray(np.ascontiguousarray(row[None]), format="fltp", layout="mono")
        source.sample_rate = int(from_hz)
        converter = av.AudioResampler(format="fltp", layout="mono", rate=int(to_hz))
        pieces = [out.to_ndarray()[0] for out in converter.resample(source) + converter.resample(None)]
        converted = np.concatenate(pieces) if pieces else np.zeros(0, np.float32)
        kept = min(wanted, converted.shape[0])
        result[row_index, :kept] = converted[:kept]
    return torch.from_numpy(result).reshape(*waveform.shape[:-1], wanted).to(waveform.device)


def resample_audio(audio: dict, sample_rate_hz: int) -> dict:
    """A new AUDIO dict holding `audio` at `sample_rate_hz` (`audio` itself is not modified)."""
    audio = check_audio("resample_audio", audio)
    waveform = resample_waveform(audio["waveform"], int(audio["sample_rate"]), int(sample_rate_hz))
    return {"waveform": waveform, "sample_rate": int(sample_rate_hz)}


def match_channels(waveform: torch.Tensor, channels: int, *, node: str = "audio") -> torch.Tensor:
    """(..., C, S) with `channels` channels: one channel is copied to all, several are averaged down to one."""
    present = waveform.shape[-2]
    if present == channels:
        return waveform
    if present == 1:
        return waveform.expand(*waveform.shape[:-2], channels, waveform.shape[-1])
    if channels == 1:
        return waveform.mean(dim=-2, keepdim=True)
    raise ValueError(f"{node}: cannot turn {present} channels into {channels}; give mono or stereo sound")


def fit_length(waveform: torch.Tensor, samples: int) -> torch.Tensor:
    """The last axis cut, or extended with silence, to exactly `samples`."""
    present = waveform.shape[-1]
    if present >= samples:
        return waveform[..., :samples]
    silence = torch.zeros(*waveform.shape[:-1], samples - present, dtype=waveform.dtype, device=waveform.device)
    return torch.cat([waveform, silence], dim=-1)


def decode_audio(path: str | os.PathLike, limits: DecodeLimits | None = None) -> dict | None:
    """The first sound track of a media file as AUDIO (one clip, float), or None when the file has none.

    A file FFmpeg cannot read, or one over the decoding caps (`media.limits`), raises ValueError; the
    caps are checked against what the file declares before decoding and against what has been decoded
    as decoding goes."""
    try:
        return _decode_audio(Path(path), limits or decode_limits())
    except av.FFmpegError as exc:
        raise ValueError(f"cannot read {Path(path).name!r}: {exc}") from exc


def declared_seconds(container: Any, track: Any) -> float | None:
    """The duration a container states for `track` (else for itself), in seconds; None when it states none."""
    if track.duration is not None and track.time_base is not None and track.duration > 0:
        return float(track.duration * track.time_base)
    if container.duration is not None and container.duration > 0:
        return container.duration / av.time_base
    return None


def _decode_audio(path: Path, limits: DecodeLimits) -> dict | None:
    what = f"the sound of {path.name!r}"
    with av.open(str(path)) as container:
        if not container.streams.audio:
            return None
        track = container.streams.audio[0]
        rate = int(track.codec_context.sample_rate or track.rate or 0)
        if rate <= 0:
            raise ValueError(f"{path.name}: its sound track states no sample rate")
        limits.check_sample_rate(rate, what)
        seconds = declared_seconds(container, track)
        limits.check_seconds(seconds, what)
        channels = max(1, int(track.codec_context.channels or 1))
        if seconds is not None:
            limits.check_bytes(int(seconds * rate) * channels * FLOAT_BYTES, what)
        to_float = av.AudioResampler(format="fltp")  # keeps the track's own rate and channel layout
        blocks = []
        decoded_bytes = 0
        for decoded in container.decode(track):
            for out in to_float.resample(decoded):
                block = out.to_ndarray()
                # Counted as float32 (what the waveform is held as), whatever the block's own type.
                decoded_bytes += block.shape[0] * block.shape[1] * FLOAT_BYTES
                limits.check_bytes(decoded_bytes, what)
                blocks.append(block)
        blocks.extend(out.to_ndarray() for out in to_float.resample(None))
    if not blocks:
        raise ValueError(f"{path.name}: its sound track holds no samples")
    waveform = torch.from_numpy(np.concatenate(blocks, axis=1).astype(np.float32, copy=False))  # (C, S)
    return {"waveform": waveform.unsqueeze(0), "sample_rate": rate}


def channel_layout(channels: int) -> str:
    """FFmpeg's layout name for a channel count."""
    return {1: "mono", 2: "stereo"}.get(channels, f"{channels}c")


def available_encoder(label: str, candidates: tuple[str, ...]) -> str:
    """The first of `candidates` this PyAV build can encode with; a ValueError naming them all otherwise."""
    for name in candidates:
        if name not in av.codecs_available:
            continue
        try:
            av.Codec(name, "w")
        except Exception:  # present, but only as a decoder
            continue
        return name
    raise ValueError(
        f"this PyAV/FFmpeg build has no {label} encoder (looked for {', '.join(candidates)}); "
        f"install a PyAV wheel that ships one (the PyPI 'av' wheels carry libx264 and aac)"
    )


# The lossy formats SaveAudioAdvanced writes: container, encoder candidates, the sample rates the encoder
# takes (None: any), and per quality name either a constant bit rate or a LAME VBR level ("V0" is level 0).
LOSSY_FORMATS: dict[str, dict[str, Any]] = {
    "mp3": {"container": "mp3", "encoders": ("libmp3lame", "mp3"), "rates": None,
            "qualities": {"V0": ("vbr", 0), "128k": ("cbr", 128_000), "320k": ("cbr", 320_000)}},
    "opus": {"container": "ogg", "encoders": ("libopus", "opus"), "rates": (48000, 24000, 16000, 12000, 8000),
             "qualities": {name: ("cbr", int(name[:-1]) * 1000) for name in ("64k", "96k", "128k", "192k", "320k")}},
}
_LAME_QUALITY_STEP = 118  # FFmpeg's lambda per quality unit: global_quality = level * this


def write_lossy(path: Path, waveform: torch.Tensor, sample_rate_hz: int, *, format: str, quality: str,
                metadata: dict[str, Any] | None = None) -> None:
    """Write one clip (C, S) as MP3 or Opus (`LOSSY_FORMATS`) at `path`, with `metadata` as JSON tags.

    Opus takes only a few sample rates: other sounds are resampled to 48 kHz first."""
    spec = LOSSY_FORMATS[format]
    mode, amount = spec["qualities"][quality]
    channels = int(waveform.shape[0])
    if not 1 <= channels <= 2:
        raise ValueError(f"{format} is written here with 1 or 2 channels; this sound has {channels}")
    rate = int(sample_rate_hz)
    if spec["rates"] is not None and rate not in spec["rates"]:
        waveform, rate = resample_waveform(waveform, rate, 48000), 48000
    layout = channel_layout(channels)
    samples = np.ascontiguousarray(waveform.detach().float().clamp(-1, 1).cpu().numpy())
    with staged_file(path) as staging, av.open(str(staging), mode="w", format=spec["container"]) as container:
        for key, value in (metadata or {}).items():
            container.metadata[str(key)] = json.dumps(value)
        track = container.add_stream(available_encoder(format, spec["encoders"]), rate=rate, layout=layout)
        if mode == "vbr":
            track.codec_context.options = {"flags": "+qscale", "global_quality": str(amount * _LAME_QUALITY_STEP)}
        else:
            track.codec_context.bit_rate = amount
        block = av.AudioFrame.from_ndarray(samples, format="fltp", layout=layout)
        block.sample_rate = rate
        block.pts = 0
        for packet in track.encode(block):
            container.mux(packet)
        for packet in track.encode(None):
            container.mux(packet)


def write_flac(path: Path, waveform: torch.Tensor, sample_rate_hz: int, *,
               metadata: dict[str, Any] | None = None) -> None:
    """Write one clip (C, S) as 16-bit FLAC at `path`, with `metadata` values stored as JSON tags."""
    channels = int(waveform.shape[0])
    if not 1 <= channels <= 8:
        raise ValueError(f"FLAC stores 1 to 8 channels; this sound has {channels}")
    layout = channel_layout(channels)
    samples = np.ascontiguousarray(waveform.detach().float().clamp(-1, 1).cpu().numpy())
    with staged_file(path) as staging, av.open(str(staging), mode="w", format="flac") as container:
        for key, value in (metadata or {}).items():
            container.metadata[str(key)] = json.dumps(value)
        track = container.add_stream(available_encoder("FLAC", ("flac",)), rate=int(sample_rate_hz), layout=layout)
        track.codec_context.format = "s16"
        for start in range(0, samples.shape[1], FLAC_SAMPLES_PER_FRAME):
            block = av.AudioFrame.from_ndarray(
                np.ascontiguousarray(samples[:, start:start + FLAC_SAMPLES_PER_FRAME]), format="fltp", layout=layout)
            block.sample_rate = int(sample_rate_hz)
            block.pts = start
            for packet in track.encode(block):
                container.mux(packet)
        for packet in track.encode(None):
            container.mux(packet)
