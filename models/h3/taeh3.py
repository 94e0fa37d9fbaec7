"""taeh3: the tiny autoencoder of the TAEHV family for H3's video latents, used to draw live previews.

Architecture (the TAEHV design, github.com/madebyollin/taehv, `taehv.py`; the weights file is
`models/vae_approx/taeh3.safetensors`). Only the decoder is used here; it is one sequence of layers, and
the file's keys are `decoder.<index>.<...>` by position in it:

    0 clamp (3 * tanh(x / 3))   1 conv3x3 latent -> w0   2 ReLU
    3-5 memory blocks (w0)      6 nearest 2x upsample    7 time grow (w0, stride 1)   8 conv3x3 w0 -> w1, no bias
    9-11 memory blocks (w1)     12 upsample              13 time grow (w1, stride 2)  14 conv3x3 w1 -> w2, no bias
    15-17 memory blocks (w2)    18 upsample              19 time grow (w2, stride 2)  20 conv3x3 w2 -> w3, no bias
    21 ReLU                     22 conv3x3 w3 -> 3 * patch^2, then pixel shuffle by patch and clamp to [0, 1]

A memory block sees its input and its input one latent frame earlier (zeros before the first):
`ReLU(convs(cat[x, previous]) + skip(x))`, where `convs` is conv3x3 (2w -> w), ReLU, conv3x3, ReLU, conv3x3
(keys `conv.0`, `conv.2`, `conv.4`) and `skip` is identity at equal widths. A time grow is a 1x1 conv
(w -> w * stride, key `conv.weight`, no bias) whose output channels split into `stride` consecutive frames.
Widths are read from the file (w = 256, 128, 64, 64 in the TAEHV models; the tiny taeh3 is narrower), the
patch from the last conv. A checkpoint whose first time grow stores stride-2 weights is used through its
last w0 output channels, as the reference loader does for a model that does not grow time there.

How latents map to frames: spatially 2 x 2 x 2 upsampling times the pixel shuffle of 2 is H3's 16. In
time, two stride-2 grows make 4 frames per latent frame, and the first 3 frames of a decode are dropped,
so k latents give 4k - 3 frames: a latent that starts a sequence stands for one frame and every later one
for four, which is H3's causal layout within one 17-frame clip (5 latents). H3 encodes every clip on its
own (models/h3/video_vae.py), so latents are decoded clip by clip, each from empty memory: 5n + 2 latents
give 17n + 5 frames, as the H3 VAE's do. The latents are the diffusion model's own (no mean/std applied).
"""
from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from kernels.conv2d import conv2d
from models.h3.latents import CLIP_LATENTS  # latent frames per 17-frame clip of the H3 video VAE

logger = logging.getLogger(__name__)

FRAMES_DROPPED = 3  # a decode's first frames that precede the first latent's own frame
TIME_GROW_LAYERS = (7, 13, 19)
MEMORY_BLOCKS = (3, 4, 5, 9, 10, 11, 15, 16, 17)


@dataclass(frozen=True)
class TAEH3Config:
    """Shape of a taeh3 decoder; defaults are the TAEHV family's."""

    latent_channels: int = 24  # H3's video latent channels
    widths: tuple[int, int, int, int] = (256, 128, 64, 64)  # feature widths of the three stages and the last conv
    patch: int = 2  # pixel shuffle at the end (x 2 x 2 x 2 upsampling = 16)
    time_strides: tuple[int, int, int] = (1, 2, 2)  # frames per input frame of each time grow


TINY_CONFIG = TAEH3Config(widths=(16, 8, 8, 8))


class _Clamp(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x / 3.0) * 3.0


class _Conv(nn.Conv2d):
    """A stride-1 Conv2d run through kernels.conv2d, which picks ATen's own kernel for the small calls a
    preview makes on the CPU (oneDNN's set-up costs more than their arithmetic there)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return conv2d(x, self.weight, self.bias, padding=self.padding[0])


def _conv(n_in: int, n_out: int, bias: bool = True) -> nn.Conv2d:
    return _Conv(n_in, n_out, 3, padding=1, bias=bias)


class MemoryBlock(nn.Module):
    """Three 3x3 convs over a frame and its predecessor, plus a skip of the frame."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv = nn.Sequential(_conv(2 * width, width), nn.ReLU(), _conv(width, width), nn.ReLU(),
                                  _conv(width, width))

    def forward(self, x: torch.Tensor, frames: int) -> torch.Tensor:
        # x: (N * frames, C, H, W), frames consecutive per item; previous: each frame's predecessor, zeros first.
        grouped = x.unflatten(0, (-1, frames))
        previous = torch.cat([torch.zeros_like(grouped[:, :1]), grouped[:, :-1]], dim=1).flatten(0, 1)
        return F.relu(self.conv(torch.cat([x, previous], dim=1)) + x)


class TimeGrow(nn.Module):
    """A 1x1 conv whose output channels become `stride` consecutive frames."""

    def __init__(self, width: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        self.conv = _Conv(width, width * stride, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        grown = self.conv(x)  # (N * T, C * stride, H, W): the stride frames of each input frame, side by side
        return grown.view(-1, x.shape[1], *x.shape[2:])  # (N * T * stride, C, H, W)


class _LastFrame(nn.Module):
    """A decoder's `last_frame` as a module's forward (what tracing and freezing take)."""

    def __init__(self, decoder: "TAEH3Decoder", frames: int) -> None:
        super().__init__()
        self.decoder = decoder
        self.frames = frames  # the latents' frame count, which a trace holds fixed

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        return self.decoder._last_frame(latents, self.frames)


def _trace_last_frame(decoder: "TAEH3Decoder", example: torch.Tensor):
    """`decoder.last_frame` traced on `example` and frozen, or None when torch cannot (logged once per shape)."""
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")  # torch.jit says it is deprecated; the graph works in this torch
            traced = torch.jit.trace(_LastFrame(decoder, example.shape[2]).eval(), (example,), check_trace=False)
            return torch.jit.freeze(traced)
    except Exception as exc:  # noqa: BLE001 - any failure leaves the op-by-op path, which always works
        logger.info("taeh3 previews run op by op: tracing the decoder for %s latents failed (%s)",
                    tuple(example.shape), exc)
        return None


class TAEH3Decoder(nn.Module):
    """The taeh3 decoder (`decoder.<index>` keys, see the module docstring)."""

    def __init__(self, config: TAEH3Config = TAEH3Config()) -> None:
        super().__init__()
        self.config = config
        w0, w1, w2, w3 = config.widths
        layers: list[nn.Module] = [_Clamp(), _conv(config.latent_channels, w0), nn.ReLU()]
        for width, stride, next_width in ((w0, config.time_strides[0], w1), (w1, config.time_strides[1], w2),
                                          (w2, config.time_strides[2], w3)):
            layers += [MemoryBlock(width), MemoryBlock(width), MemoryBlock(width), nn.Upsample(scale_factor=2),
                       TimeGrow(width, stride), _conv(width, next_width, bias=False)]
        layers += [nn.ReLU(), _conv(w3, 3 * config.patch ** 2)]
        self.decoder = nn.Sequential(*layers)

    def on(self, device: torch.device | str) -> "TAEH3Decoder":
        """This decoder on `device`: itself where it already is, else a copy made once and kept with it (the
        previews decode the sampler's latents where they are; the decoder is a few MiB)."""
        device = torch.device(device)
        here = next(self.parameters()).device
        if device == here:
            return self
        copies = self.__dict__.setdefault("_copies_by_device", {})
        if device not in copies:
            copy = TAEH3Decoder(self.config)
            copy.load_state_dict(self.state_dict())
            copies[device] = copy.to(device).eval().requires_grad_(False)
        return copies[device]

    @property
    def spatial_ratio(self) -> int:
        """Pixels per latent pixel along each side."""
        return 8 * self.config.patch

    def decode_clip(self, latents: torch.Tensor) -> torch.Tensor:
        """(B, C, k, h, w) latents of one clip, from its start -> (B, 4k - 3, 16h, 16w, 3) frames in [0, 1]."""
        b, c, frames, h, w = latents.shape
        x = latents.permute(0, 2, 1, 3, 4).reshape(b * frames, c, h, w)
        for layer in self.decoder:
            if isinstance(layer, MemoryBlock):
                x = layer(x, frames)
                continue
            x = layer(x)
            if isinstance(layer, TimeGrow):
                frames *= layer.stride
        x = F.pixel_shuffle(x, self.config.patch).clamp_(0.0, 1.0)
        x = x.view(b, frames, 3, x.shape[-2], x.shape[-1])[:, FRAMES_DROPPED:]
        return x.permute(0, 1, 3, 4, 2)

    def _frames_kept(self, frames: int) -> list[int]:
        """How many trailing frames each layer's input must hold for the last output frame of a clip whose
        input has `frames` latent frames (index i: the input of layer i; the last entry: the output).

        Counted from the end: the last frame needs 1; a memory block needs one frame more than it gives
        (each output frame reads its predecessor); a time grow of stride s needs ceil(n / s) of its input
        frames for n of its output frames; every other layer works frame by frame. Never more than the
        layer has."""
        available = [frames]
        for layer in self.decoder:
            available.append(available[-1] * (layer.stride if isinstance(layer, TimeGrow) else 1))
        kept = [1]
        for layer, held in zip(reversed(self.decoder), reversed(available[:-1])):
            needed = kept[0]
            if isinstance(layer, MemoryBlock):
                needed += 1
            elif isinstance(layer, TimeGrow):
                needed = -(-needed // layer.stride)
            kept.insert(0, min(needed, held))
        return kept

    def last_frame(self, latents: torch.Tensor) -> torch.Tensor:
        """(1, C, k, h, w) latents of one clip, from its start -> its last frame, (16h, 16w, 3) in [0, 1].

        Equal to `decode_clip(latents)[0, -1]`, for a fraction of the work: each layer runs on the trailing
        frames the last one depends on (`_frames_kept`), so the last stage's memory blocks see 4, 3 and 2
        frames instead of twice the latents, and the layers after the last time grow one frame instead of
        four per latent. A memory block run on a window that does not start at
        the clip's first frame gets no true predecessor for the window's first frame, so that frame's
        output is dropped (it is one the next layer does not need)."""
        return self._last_frame(latents, latents.shape[2])

    def _last_frame(self, latents: torch.Tensor, frames: int) -> torch.Tensor:
        # Frame counts are followed as plain numbers from `frames`, never read back from shapes, so that
        # tracing (which turns shapes into tensors) records this very computation (`frame_at`).
        kept = self._frames_kept(frames)
        x = latents[0].permute(1, 0, 2, 3)[frames - kept[0]:]  # (kept frames, C, h, w)
        held, count = frames, kept[0]  # frames of the clip the current layer's input has; frames x holds
        for index, layer in enumerate(self.decoder):
            x, count = x[count - kept[index]:], kept[index]
            if isinstance(layer, MemoryBlock):
                x = layer(x, count)
                if count != held:  # the window does not start the clip: its first frame has no predecessor
                    x, count = x[1:], count - 1
                continue
            x = layer(x)
            if isinstance(layer, TimeGrow):
                held, count = held * layer.stride, count * layer.stride
        x = F.pixel_shuffle(x[-1:], self.config.patch).clamp_(0.0, 1.0)  # (1, 3, 16h, 16w)
        return x[0].permute(1, 2, 0)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """(B, C, T', h, w) H3 video latents -> (B, frames, 16h, 16w, 3), clip by clip (17 frames per 5 latents)."""
        if latents.dim() != 5 or latents.shape[1] != self.config.latent_channels:
            raise ValueError(f"taeh3 decodes (B, {self.config.latent_channels}, T, h, w) latents, got "
                             f"{tuple(latents.shape)}")
        parts = [self.decode_clip(latents[:, :, start:start + CLIP_LATENTS])
                 for start in range(0, latents.shape[2], CLIP_LATENTS)]
        return torch.cat(parts, dim=1)

    def frame_at(self, latents: torch.Tensor, index: int) -> torch.Tensor:
        """The last frame latent `index` stands for, decoded from the start of its clip: (16h, 16w, 3).

        Runs `last_frame` as one graph made for the window's shape (`_graph_for`) where one can be made."""
        start = index - index % CLIP_LATENTS
        window = latents[:1, :, start:index + 1]
        with torch.no_grad():
            graph = self._graph_for(window)
            return graph(window) if graph is not None else self.last_frame(window)

    def _graph_for(self, window: torch.Tensor):
        """`last_frame` for latents of `window`'s shape, dtype and device as one frozen TorchScript graph,
        traced on first use and kept; None where it cannot be made (then the caller runs it op by op).

        Why a graph: previews are drawn on a thread beside the sampler's, and both hold Python's lock
        between torch ops. Run from Python, a picture's 150-odd small ops take the lock back at every op,
        each time waiting for the sampler's thread to let go of it: decoding tiny taeh3 pictures without
        pause slowed a loop of small torch ops on another thread 3.6-4x. A graph call lets go of the lock
        once for the whole decode (1.01-1.03x in the same measurement), and is faster besides: 2.5 ms a
        picture against 4.3 op by op, one thread. A trace holds only for the shapes it saw, hence one
        graph per window shape (a sampler run previews one)."""
        key = (tuple(window.shape), window.dtype, window.device)
        graphs = self.__dict__.setdefault("_graphs", {})
        if key not in graphs:
            graphs[key] = _trace_last_frame(self, torch.zeros(key[0], dtype=key[1], device=key[2]))
        return graphs[key]


def config_from_state(state: dict[str, torch.Tensor]) -> TAEH3Config:
    """The decoder's shape recovered from its weights; ValueError naming the key that does not fit."""
    def weight(index: int, leaf: str = "weight") -> torch.Tensor:
        key = f"decoder.{index}.{leaf}"
        if key not in state:
            raise ValueError(f"not a taeh3 (TAEHV) file: {key} is missing")
        return state[key]

    first = weight(1)
    widths = (int(first.shape[0]), int(weight(8).shape[0]), int(weight(14).shape[0]), int(weight(20).shape[0]))
    out_channels = int(weight(22).shape[0])
    patch = int(round((out_channels / 3) ** 0.5))
    if 3 * patch * patch != out_channels or patch != 2:
        raise ValueError(f"decoder.22.weight makes {out_channels} output channels; a taeh3 file makes 12 (3 colours "
                         "x a 2x2 pixel shuffle, 16x in all)")
    strides = []
    for index, width in zip(TIME_GROW_LAYERS, widths[:3]):
        grown = int(weight(index, "conv.weight").shape[0])
        strides.append(grown // width)
    strides[0] = 1  # H3 grows time in the last two stages only (4 frames per latent); see load_state
    if tuple(strides[1:]) != (2, 2):
        raise ValueError("decoder.13/19 time grows must each double the frames (4 per latent, as H3's VAE); "
                         f"this file's make {strides[1]} and {strides[2]}")
    return TAEH3Config(latent_channels=int(first.shape[1]), widths=widths, patch=patch, time_strides=tuple(strides))


def load_state(decoder: TAEH3Decoder, state: dict[str, torch.Tensor]) -> None:
    """Copy a file's `decoder.*` tensors in (its `encoder.*` ones are not used); ValueError naming a bad key."""
    own = decoder.state_dict()
    wanted = {key: tensor for key, tensor in state.items() if key.startswith("decoder.")}
    first_grow = f"decoder.{TIME_GROW_LAYERS[0]}.conv.weight"
    if first_grow in wanted and wanted[first_grow].shape[0] > own[first_grow].shape[0]:
        # Stored growing time 2x: keep the channels of its last frame, the only one a stride-1 grow makes.
        wanted[first_grow] = wanted[first_grow][-own[first_grow].shape[0]:]
    missing = sorted(set(own) - set(wanted))
    extra = sorted(set(wanted) - set(own))
    if missing or extra:
        raise ValueError(f"not a taeh3 decoder: missing {missing[:3]}, unexpected {extra[:3]}")
    for key, tensor in wanted.items():
        if tuple(tensor.shape) != tuple(own[key].shape):
            raise ValueError(f"taeh3 key {key} has shape {tuple(tensor.shape)}, expected {tuple(own[key].shape)}")
    decoder.load_state_dict({key: tensor.float() for key, tensor in wanted.items()})


def load_taeh3(path: str | Path) -> TAEH3Decoder:
    """The taeh3 decoder stored at `path` (safetensors), in float32 on the CPU, ready to run."""
    from models.loading import load_state_dict  # the checked safetensors reader; it imports models.h3

    state = load_state_dict(str(path))
    decoder = TAEH3Decoder(config_from_state(state))
    load_state(decoder, state)
    return decoder.eval().requires_grad_(False)
