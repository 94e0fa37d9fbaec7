"""The H3 video VAE: a causal 3-D convolutional encoder (f16, t4, 24 channels) and a transformer decoder.

Encoder: clips of 17 frames, each padded at its end with its last frame, give 5 latents each (the clip's
first frame, then one latent per 4 frames); the last 3 latents of the whole sequence are dropped, so
17n+5 frames give 5n+2 latents. Every convolution pads with zeros only in front in time and by
reflection in space, and GroupNorm statistics are per frame, so latent 0 depends only on frame 0; the
last clip is therefore encoded only through its 5th frame (the 2 latents it keeps), which gives what the
whole padded clip would, up to float rounding, at 5/17 of the cost (a 5-frame guide is one such clip).

Decoder: a ViT over latent tokens (each token -> 4 frames x 16 x 16 pixels) that decodes in overlapping
temporal chunks of 7 tokens (a 17-frame clip plus the 2 tokens that start the next one, whose 5 frames
are blended linearly with the next chunk) and in spatial tiles of 256 pixels overlapping by at least 64
(the window it was trained on; leftover overlap spread in 16-pixel steps; tiles composed in sequence with
a linear ramp over the whole overlap, as the reference VAEs do: models/h3/tiling.py), written
straight into one preallocated output canvas. Up to 4 tiles go through the decoder per call, as many as
the free device memory allows at the measured cost of one tile; an out-of-memory error halves the batch
and retries. A lone latent (T' = 1, an image) is decoded as a 2-latent clip whose first frame is kept;
a VAE whose metadata sets `h3_t1_direct` decodes it directly. Every weight reaches its op through the
memory manager's take/release (models/memory.py), so decoding works under a small memory budget.

Latents are normalised with per-channel `latents_mean` / `latents_std` stored with the weights. Pixels
are ImageNet-normalised on the way in and out. Parameter names are the original checkpoint's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from kernels.prologues import Prologue
from models import memory, ops, parallel
from models.h3 import tiling
from models.h3.latents import pixel_frames
from models.h3.layers import FrameGroupNorm, attention, compute_device, rms_norm, rope_split_half

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass
class VideoVAEConfig:
    """Shape of the H3 video VAE. Defaults are the released model's."""
    image_channels: int = 3
    latent_channels: int = 24
    base_channels: int = 128                                   # encoder width at full resolution
    channel_mult: tuple[int, ...] = (1, 2, 2, 4, 4, 8)         # encoder width per level (x base_channels)
    res_blocks: tuple[int, ...] = (2, 2, 2, 2, 2, 2)           # residual blocks per encoder level
    space_down: tuple[int, ...] = (2, 2, 2, 2, 1, 1)           # spatial stride after each level (16 in all)
    time_down: tuple[int, ...] = (1, 2, 2, 1, 1, 1)            # temporal stride after each level (4 in all)
    norm_groups: int = 32                                      # GroupNorm groups (fewer when a layer is narrower)
    decoder_layers: int = 36
    decoder_head_dim: int = 64                                 # decoder width = heads * 64 (2048)
    decoder_heads: int = 32
    decoder_ffn_mult: int = 4                                  # gated SiLU FFN width = 4 * decoder width
    decoder_rope_ratio: float = 0.75                           # share of each head's dims rotated (3 axes)
    decoder_rope_theta: float = 100.0
    register_tokens: int = 4
    decoder_eps: float = 1e-5
    clip_frames: int = 17                                      # pixel frames per causal clip
    dropped_latents: int = 3                                   # latents dropped at the end of the sequence
    tile_size: int = 256                                       # decoder window, pixels
    tile_overlap: int = 64                                     # minimum overlap between windows, pixels

    @property
    def spatial_ratio(self) -> int:
        """Pixels per latent pixel (16)."""
        return math.prod(self.space_down)

    @property
    def time_ratio(self) -> int:
        """Pixel frames per latent token in the decoder (4)."""
        return math.prod(self.time_down)

    @property
    def decoder_dim(self) -> int:
        """Decoder width."""
        return self.decoder_heads * self.decoder_head_dim


TINY_CONFIG = VideoVAEConfig(base_channels=8, channel_mult=(1, 1, 2, 2, 4, 4), res_blocks=(1, 1, 1, 1, 1, 1),
                             decoder_layers=2, decoder_heads=1)



def _norm(groups: int, channels: int) -> FrameGroupNorm:
    # The released model's layers are all multiples of 32 channels wide; narrower (tiny) layers use one group per channel.
    return FrameGroupNorm(min(groups, channels), channels, eps=1e-6)


class StridedCausalConv3d(ops.Conv3d):
    """A strided causal conv (parameters as nn.Conv3d): zeros in front in time; spatial stride 2 pads one
    row and column at the far side by reflection, as the released encoder's downsampling does."""

    def __init__(self, channels: int, time_stride: int, space_stride: int):
        super().__init__(channels, channels, kernel_size=3, stride=(time_stride, space_stride, space_stride), padding=0)
        self.front = 2                                                   # causal: kernel_t - 1 zero frames in front
        self.spatial_pad = (0, 1, 0, 1) if space_stride == 2 else (1, 1, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, t, h, w = x.shape
        pl, pr, pt, pb = self.spatial_pad
        x = F.pad(x.reshape(b, c * t, h, w), self.spatial_pad, mode="reflect").reshape(b, c, t, h + pt + pb, w + pl + pr)
        return super().forward(F.pad(x, (0, 0, 0, 0, self.front, 0)))


def _causal_conv(in_channels: int, out_channels: int, kernel: int) -> nn.Module:
    # models/ops.CausalConv3d: zero padding in front in time, reflect padding in space, and an optional fused
    # per-frame GroupNorm + SiLU before and residual after the convolution.
    return ops.CausalConv3d(in_channels, out_channels, kernel)


class ResnetBlock3D(nn.Module):
    """GroupNorm-SiLU-conv twice, with a 1x1x1 shortcut when the width changes."""

    def __init__(self, in_channels: int, out_channels: int, groups: int):
        super().__init__()
        self.norm1 = _norm(groups, in_channels)
        self.conv1 = _causal_conv(in_channels, out_channels, 3)
        self.norm2 = _norm(groups, out_channels)
        self.conv2 = _causal_conv(out_channels, out_channels, 3)
        if in_channels != out_channels:
            self.nin_shortcut = _causal_conv(in_channels, out_channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(x, norm=self.norm1, silu=True)
        shortcut = self.nin_shortcut(x) if hasattr(self, "nin_shortcut") else x
        return self.conv2(h, norm=self.norm2, silu=True, residual=shortcut)


class Downsample3D(nn.Module):
    """Strided causal conv (f2 in space, f1 or f2 in time)."""

    def __init__(self, channels: int, time_stride: int, space_stride: int):
        super().__init__()
        self.conv = StridedCausalConv3d(channels, time_stride, space_stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


class Encoder3D(nn.Module):
    """Causal convolutional encoder: (B, 3, T, H, W) -> moments (B, 2 * latent, T', H/16, W/16)."""

    def __init__(self, cfg: VideoVAEConfig):
        super().__init__()
        widths = [cfg.base_channels * m for m in cfg.channel_mult]
        self.conv_in = _causal_conv(cfg.image_channels, widths[0], 3)
        self.down = nn.ModuleList()
        prev = widths[0]
        for level, width in enumerate(widths):
            stage = nn.Module()
            stage.block = nn.ModuleList()
            for k in range(cfg.res_blocks[level]):
                stage.block.append(ResnetBlock3D(prev if k == 0 else width, width, cfg.norm_groups))
                prev = width
            if cfg.space_down[level] * cfg.time_down[level] > 1:
                stage.downsample = Downsample3D(width, cfg.time_down[level], cfg.space_down[level])
            self.down.append(stage)
        self.norm_out = _norm(cfg.norm_groups, widths[-1])
        self.conv_out = _causal_conv(widths[-1], 2 * cfg.latent_channels, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(x)
        for stage in self.down:
            for block in stage.block:
                h = block(h)
            if hasattr(stage, "downsample"):
                h = stage.downsample(h)
        return self.conv_out(h, norm=self.norm_out, silu=True)


class DecoderAttention(nn.Module):
    """Fused qkv (per-head interleaved q|k|v), non-affine q/k RMSNorm, partial 3-axis RoPE."""

    def __init__(self, heads: int, head_dim: int, eps: float):
        super().__init__()
        self.heads, self.head_dim, self.eps = heads, head_dim, eps
        dim = heads * head_dim
        self.to_qkv = ops.Linear(dim, 3 * dim, bias=True)
        self.to_out = ops.Linear(dim, dim, bias=True)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], norm: nn.Module,
                scale: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.to_qkv(x, prologue=Prologue.RMS_NORM, prologue_weight=norm, eps=self.eps)
        q, k, v = qkv.view(b, s, self.heads, 3 * self.head_dim).chunk(3, dim=-1)  # each (B, S, H, D)
        q = rope_split_half(rms_norm(q, None, self.eps), *rope)
        k = rope_split_half(rms_norm(k, None, self.eps), *rope)
        out = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))  # (B, H, S, D)
        out = torch.nan_to_num(out.transpose(1, 2).reshape(b, s, -1))
        return self.to_out(out, residual=x, residual_scale=scale.to(x.dtype))


class DecoderFeedForward(nn.Module):
    """Gated SiLU FFN; w1 holds gate and value halves."""

    def __init__(self, dim: int, mult: int, eps: float):
        super().__init__()
        self.eps = eps
        self.w1 = ops.Linear(dim, 2 * mult * dim, bias=True)
        self.w2 = ops.Linear(mult * dim, dim, bias=True)

    def forward(self, x: torch.Tensor, norm: nn.Module, scale: torch.Tensor) -> torch.Tensor:
        h = self.w1(x, prologue=Prologue.RMS_NORM, prologue_weight=norm, eps=self.eps)
        return self.w2(h, prologue=Prologue.SWIGLU, residual=x, residual_scale=scale.to(x.dtype))


class DecoderBlock(nn.Module):
    """Pre-norm attention and FFN with learned per-channel residual scales."""

    def __init__(self, cfg: VideoVAEConfig):
        super().__init__()
        dim = cfg.decoder_dim
        self.norm1 = ops.RMSNorm(dim, eps=cfg.decoder_eps)
        self.attn = DecoderAttention(cfg.decoder_heads, cfg.decoder_head_dim, cfg.decoder_eps)
        self.scale1 = nn.Parameter(torch.ones(dim))
        self.norm2 = ops.RMSNorm(dim, eps=cfg.decoder_eps)
        self.ff = DecoderFeedForward(dim, cfg.decoder_ffn_mult, cfg.decoder_eps)
        self.scale2 = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        with memory.using_named(self, dtype=x.dtype) as own:  # the residual scales, taken like every weight
            x = self.attn(x, rope, self.norm1, own["scale1"])
            return self.ff(x, self.norm2, own["scale2"])


class ViTDecoder(nn.Module):
    """Latent tokens (B, C, t, h, w) -> raw pixels (B, 3, 4t, 16h, 16w) (ImageNet-normalised)."""

    def __init__(self, cfg: VideoVAEConfig):
        super().__init__()
        self.cfg = cfg
        dim = cfg.decoder_dim
        self.x_embedder = ops.Linear(cfg.latent_channels, dim, bias=True)
        self.register_tokens = nn.Parameter(torch.zeros(1, cfg.register_tokens, dim))
        self.register_buffer("mask_token", torch.zeros(1, 1, dim))  # unused at inference; part of the checkpoint
        self.transformer_blocks = nn.ModuleList([DecoderBlock(cfg) for _ in range(cfg.decoder_layers)])
        self.norm_out = ops.LayerNorm(dim, eps=cfg.decoder_eps)
        self.proj_out = ops.Linear(dim, cfg.image_channels * cfg.time_ratio * cfg.spatial_ratio ** 2, bias=True)
        self.make_buffers()

    def make_buffers(self) -> None:
        """(Re)compute the non-persistent RoPE frequencies (called again after meta-device loading)."""
        rope_dim = int(self.cfg.decoder_head_dim * self.cfg.decoder_rope_ratio)
        step = 2 * 3 / rope_dim
        inv = 1.0 / self.cfg.decoder_rope_theta ** torch.arange(0, 1, step, dtype=torch.float32)
        self.register_buffer("inv_freq", inv, persistent=False)

    def rope(self, t: int, h: int, w: int, device: torch.device,
             inv_freq: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (S, 3 * freqs) for t*h*w tokens at centred [-1, 1] coordinates plus the suffix tokens at 0."""
        inv_freq = self.inv_freq if inv_freq is None else inv_freq
        axes = [(torch.arange(n, dtype=torch.float32, device=device) + 0.5) / n * 2.0 - 1.0 for n in (t, h, w)]
        ids = torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1).reshape(-1, 3)
        ids = torch.cat([ids, torch.zeros(self.cfg.register_tokens + 1, 3, device=device)])
        angles = (2.0 * math.pi * ids[:, :, None] * inv_freq.float().to(device)).flatten(1)  # (S, 3 * F)
        return torch.cos(angles), torch.sin(angles)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        b, _, t, h, w = z.shape
        dtype = self.x_embedder.weight.dtype
        x = self.x_embedder(z.flatten(2).transpose(1, 2).to(dtype))  # (B, N, dim)
        n = x.shape[1]
        # The register tokens and RoPE frequencies reach the device through the memory manager (float32).
        with memory.using_named(self, dtype=torch.float32) as own:
            registers = own["register_tokens"].to(dtype).expand(b, -1, -1)
            rope = self.rope(t, h, w, z.device, own["inv_freq"])
        x = torch.cat([x, registers, torch.zeros_like(x[:, :1])], dim=1)
        del registers
        for block in self.transformer_blocks:
            x = block(x, rope)
        out = self.proj_out(self.norm_out(x[:, :n]))
        pt, ps = cfg.time_ratio, cfg.spatial_ratio
        out = out.view(b, t, h, w, cfg.image_channels, pt, ps, ps).permute(0, 4, 1, 5, 2, 6, 3, 7)
        return out.reshape(b, cfg.image_channels, t * pt, h * ps, w * ps)


# The decoder's temporal windows: every window is decoded in spatial tiles and written straight into the canvas.
@dataclass(frozen=True)
class _Window:
    tokens: torch.Tensor                   # (B, C, t, h, w) latent tokens decoded together (denormalised, on the device)
    keep: tuple[tuple[int, int], ...]      # decoded frame ranges [a, b) that reach the output, in order
    start: int                             # output frame of the first kept frame
    weights: torch.Tensor                  # (kept frames,) temporal blend weight of each kept frame


class _CanvasWriter:
    """Blends decoded tiles into the one preallocated output canvas (B, T, H, W, 3), float32 on the CPU.

    Each tile is turned into pixels ([0, 1] scale), multiplied by its spatial x temporal blend weight and
    added in place into its region: no full-frame intermediate and no concatenation of tiles. Because the
    weights sum to 1 over every pixel (models/h3/tiling.py), the affine pixel de-normalisation
    commutes with the blend; clamping to [0, 1] happens once, at the end, in place.
    """

    def __init__(self, canvas: torch.Tensor, plan_h: tiling.TilePlan, plan_w: tiling.TilePlan,
                 pixel_mean: torch.Tensor, pixel_std: torch.Tensor):
        self.canvas = canvas
        self.plan_h, self.plan_w = plan_h, plan_w
        self.mean = pixel_mean.float().view(1, -1, 1, 1, 1)
        self.std = pixel_std.float().view(1, -1, 1, 1, 1)
        self._weights: dict[tuple[int, int, torch.device], torch.Tensor] = {}

    def _spatial(self, i: int, j: int, device: torch.device) -> torch.Tensor:
        key = (i, j, device)
        if key not in self._weights:
            self._weights[key] = tiling.blend_weights_2d(self.plan_h, self.plan_w, i, j).to(device)
        return self._weights[key]

    def add(self, decoded: torch.Tensor, tiles: list[tuple[int, int]], batch: int, window: _Window) -> None:
        """Blend the kept frames of `decoded` (len(tiles) * batch, 3, F, th, tw), tile-major, into the canvas."""
        device = decoded.device
        mean, std = self.mean.to(device), self.std.to(device)
        ph, pw = self.plan_h, self.plan_w
        out, done = window.start, 0
        for a, b in window.keep:
            # Only the kept frames are read (views): the rest of a decoded tile never reaches the canvas.
            frames = min(b - a, self.canvas.shape[1] - out)
            if frames <= 0:
                return
            time_w = window.weights[done:done + frames].to(device).view(1, 1, frames, 1, 1)
            for n, (i, j) in enumerate(tiles):
                part = decoded[n * batch:(n + 1) * batch, :, a:a + frames] * std     # (B, 3, F, th, tw)
                part.add_(mean).mul_(self._spatial(i, j, device) * time_w)
                y0, x0 = ph.starts[i], pw.starts[j]
                region = self.canvas[:, out:out + frames, y0:y0 + ph.size, x0:x0 + pw.size]
                region.add_(part.permute(0, 2, 3, 4, 1).to(self.canvas.device))
                del part
            out += frames
            done += frames

    def finish(self) -> torch.Tensor:
        """Clamp to [0, 1] in place (the blend weights already sum to 1 everywhere); the canvas."""
        return self.canvas.clamp_(0.0, 1.0)


class VideoVAE(nn.Module):
    """Encode frames to normalised H3 video latents and decode them back (see module docstring)."""

    MAX_TILE_BATCH = 4
    TILE_MEMORY_SHARE = 0.8   # share of the free device memory one batch of tiles may use

    def __init__(self, config: VideoVAEConfig | None = None):
        super().__init__()
        cfg = self.config = config or VideoVAEConfig()
        self.encoder = Encoder3D(cfg)
        self.quant_conv = ops.Conv3d(2 * cfg.latent_channels, 2 * cfg.latent_channels, 1)
        self.post_quant_conv = ops.Conv3d(cfg.latent_channels, cfg.latent_channels, 1)
        self.decoder = ViTDecoder(cfg)
        self.register_buffer("latents_mean", torch.zeros(cfg.latent_channels))
        self.register_buffer("latents_std", torch.ones(cfg.latent_channels))
        # A VAE fine-tuned to decode a lone latent frame directly (metadata flag h3_t1_direct).
        self.t1_direct = False
        # Measured activation bytes of decoding one tile, per (tokens_t, tile_h, tile_w, batch, dtype, device).
        self.tile_costs: dict[tuple, int] = {}
        # What the last decode did: the tile batch of every decoder call, and its out-of-memory retries.
        self.last_tile_batches: list[int] = []
        self.last_tile_batch_fallbacks = 0
        self.make_buffers()

    def make_buffers(self) -> None:
        """(Re)compute the non-persistent pixel statistics."""
        self.register_buffer("pixel_mean", torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1, 1), persistent=False)
        self.register_buffer("pixel_std", torch.tensor(IMAGENET_STD).view(1, 3, 1, 1, 1), persistent=False)

    @property
    def last_tile_batch(self) -> int:
        """The largest tile batch the last decode used (0 before any decode)."""
        return max(self.last_tile_batches, default=0)

    # Encoding -----------------------------------------------------------------------------------

    def encode(self, images: torch.Tensor, *, progress: Callable[[int, int], None] | None = None) -> torch.Tensor:
        """Frames (T, H, W, 3) or (B, T, H, W, 3) in [0, 1] -> normalised latents (B, 24, T', H/16, W/16).
        progress(clips done, clips) is called after each clip is encoded."""
        cfg = self.config
        x = images if images.dim() == 5 else images.unsqueeze(0)
        if x.dim() != 5 or x.shape[-1] != 3:
            raise ValueError(f"video VAE encode expects frames (T, H, W, 3) or (B, T, H, W, 3), got {tuple(images.shape)}")
        ratio = cfg.spatial_ratio
        if x.shape[2] % ratio or x.shape[3] % ratio or x.shape[2] < 2 * ratio or x.shape[3] < 2 * ratio:
            raise ValueError(f"video VAE encode needs frame sizes that are multiples of {ratio} and at least "
                             f"{2 * ratio}; got {x.shape[3]}x{x.shape[2]}")
        with torch.no_grad(), memory.using_named(self, dtype=torch.float32) as stats:
            device = compute_device(self)
            x = x.to(device=device, dtype=torch.float32).permute(0, 4, 1, 2, 3)  # (B, 3, T, H, W)
            x = (x - stats["pixel_mean"]) / stats["pixel_std"]
            frames = x.shape[2]
            if frames == 1:
                moments = self._encode_tiled(x)
            else:
                clips = []
                starts = range(0, frames, cfg.clip_frames)
                tail = self._tail_frames()
                for start in starts:
                    last = start == starts[-1]
                    # The last clip's dropped latents are never computed: the encoder is causal, so its kept
                    # latents come from its first `tail` frames alone, whatever follows them.
                    length = tail if last and tail else cfg.clip_frames
                    clip = x[:, :, start:start + length]
                    if clip.shape[2] < length:
                        # The last clip is completed by repeating its last frame.
                        clip = torch.cat([clip, clip[:, :, -1:].expand(-1, -1, length - clip.shape[2], -1, -1)], 2)
                    clips.append(self._encode_tiled(clip))
                    if progress is not None:
                        progress(len(clips), len(starts))
                moments = torch.cat(clips, dim=2)
                if cfg.dropped_latents and not tail:
                    moments = moments[:, :, :-cfg.dropped_latents]
            mean = moments[:, :cfg.latent_channels].float()
            return (mean - stats["latents_mean"].view(1, -1, 1, 1, 1)) / stats["latents_std"].view(1, -1, 1, 1, 1)

    def _tail_frames(self) -> int:
        """Frames of the last clip its kept latents depend on (5 of 17: latents 0 and 1 of 5, the other 3
        dropped); 0 when the last clip keeps none, and is then encoded whole before the drop."""
        cfg = self.config
        kept = 1 + (cfg.clip_frames - 1) // cfg.time_ratio - cfg.dropped_latents   # latent 0, then one per 4 frames
        return 1 + (kept - 1) * cfg.time_ratio if kept > 0 else 0

    def _encode_moments(self, x: torch.Tensor) -> torch.Tensor:
        dtype = self.quant_conv.weight.dtype
        return self.quant_conv(self.encoder(x.to(dtype))).float()

    def _encode_tiled(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        ratio = cfg.spatial_ratio
        ph = tiling.plan_tiles(x.shape[3], cfg.tile_size, cfg.tile_overlap, ratio)
        pw = tiling.plan_tiles(x.shape[4], cfg.tile_size, cfg.tile_overlap, ratio)
        if len(ph.starts) == 1 and len(pw.starts) == 1:
            return self._encode_moments(x)
        lh, lw = ph.scaled(1 / ratio), pw.scaled(1 / ratio)
        out = None
        for i, y0 in enumerate(ph.starts):
            for j, x0 in enumerate(pw.starts):
                tile = self._encode_moments(x[..., y0:y0 + ph.size, x0:x0 + pw.size])
                if out is None:
                    out = torch.zeros(*tile.shape[:3], lh.length, lw.length, dtype=tile.dtype, device=tile.device)
                weight = tiling.blend_weights_2d(lh, lw, i, j).to(tile.device)
                out[..., lh.starts[i]:lh.starts[i] + lh.size, lw.starts[j]:lw.starts[j] + lw.size] += tile * weight
        return out

    # Decoding -----------------------------------------------------------------------------------

    def decode(self, latents: torch.Tensor, *, tile_batch: int | None = None, tile_size: int | None = None,
               tile_overlap: int | None = None, progress: Callable[[int, int], None] | None = None) -> torch.Tensor:
        """Normalised latents (B, 24, T', h, w) -> frames (B, T, 16h, 16w, 3) in [0, 1], float32 on the CPU.

        T = 17n+5 for T' = 5n+2; a lone latent frame (T' = 1) gives one image, decoded as the start of a
        2-latent clip (a short clip's decode) unless the VAE carries the `h3_t1_direct` flag.
        tile_size / tile_overlap: spatial window and its minimum overlap in pixels, multiples of 16
        (default 256 / 64, the decoder's trained window). tile_batch: tiles per decoder call (None: chosen
        from the free device memory and the measured cost of one tile, at most 4; halved and retried after
        an out-of-memory error). The batch never changes the pixels. progress(tiles done, tiles) is called
        after each decoder call, counting every spatial tile of every temporal window.
        """
        cfg = self.config
        ratio = cfg.spatial_ratio
        if latents.dim() != 5 or latents.shape[1] != cfg.latent_channels:
            raise ValueError(f"video VAE decode expects latents (B, {cfg.latent_channels}, T, H, W), got {tuple(latents.shape)}")
        if latents.shape[2] < 1 or latents.shape[3] < 1 or latents.shape[4] < 1:
            raise ValueError(f"video VAE decode got an empty latent {tuple(latents.shape)}")
        tile_size = cfg.tile_size if tile_size is None else int(tile_size)
        tile_overlap = cfg.tile_overlap if tile_overlap is None else int(tile_overlap)
        if tile_size < ratio or tile_size % ratio or tile_overlap < 0 or tile_overlap % ratio:
            raise ValueError(f"video VAE decode: tile_size ({tile_size}) and tile_overlap ({tile_overlap}) must be "
                             f"multiples of {ratio} pixels, tile_size at least {ratio}")
        if tile_overlap >= tile_size:
            raise ValueError(f"video VAE decode: tile_overlap ({tile_overlap}) must be smaller than tile_size ({tile_size})")
        if tile_batch is not None and int(tile_batch) < 1:
            raise ValueError(f"video VAE decode: tile_batch must be at least 1, got {tile_batch}")
        b, _, t, h, w = latents.shape
        # Seams get the leftover overlap in whole latent pixels, i.e. 16-pixel steps.
        plan_h = tiling.plan_tiles(h, tile_size // ratio, tile_overlap // ratio, 1)
        plan_w = tiling.plan_tiles(w, tile_size // ratio, tile_overlap // ratio, 1)
        self.last_tile_batches = []
        self.last_tile_batch_fallbacks = 0
        windows = 1 if t == 1 else self._temporal_plan(t)[1]
        state = {"cap": min(int(tile_batch), self.MAX_TILE_BATCH) if tile_batch is not None else self.MAX_TILE_BATCH,
                 "explicit": tile_batch is not None, "progress": progress, "done": 0,
                 "total": windows * len(plan_h.starts) * len(plan_w.starts)}
        with torch.no_grad(), memory.using_named(self, dtype=torch.float32) as stats:
            device = compute_device(self)
            z = latents.to(device=device, dtype=torch.float32)
            z = z * stats["latents_std"].view(1, -1, 1, 1, 1) + stats["latents_mean"].view(1, -1, 1, 1, 1)
            # The one output buffer: every tile of every temporal window is blended straight into it.
            canvas = torch.zeros(b, pixel_frames(t), h * ratio, w * ratio, 3, dtype=torch.float32)
            writer = _CanvasWriter(canvas, plan_h.scaled(ratio), plan_w.scaled(ratio), stats["pixel_mean"],
                                   stats["pixel_std"])
            comm = parallel.communicator()
            for number, window in enumerate(self._windows(z)):
                # In a rank group each rank decodes every N-th window; the blend is a sum into the canvas,
                # so adding the ranks' canvases gives the one device's canvas.
                if comm is None or number % comm.size == comm.rank:
                    self._decode_window(window, plan_h, plan_w, writer, state)
            if comm is not None:
                comm.all_reduce_sum(canvas)
            return writer.finish()

    def _temporal_plan(self, z_len: int) -> tuple[int, int, int, int, int, int]:
        """(pad_tokens, chunks, chunk_tokens, overlap_tokens, pre_pad_frames, overlap_frames) for z_len latents."""
        cfg = self.config
        rt = cfg.time_ratio
        chunk_tokens = math.ceil(cfg.clip_frames / rt)                # 5 latents per clip
        pre_pad = (-cfg.clip_frames) % rt                             # 3 padding frames decoded before a clip's first frame
        overlap_tokens = (-cfg.dropped_latents) % chunk_tokens        # 2 tokens that start the next clip
        overlap_frames = max(overlap_tokens * rt - pre_pad, 0)        # 5 frames blended between chunks
        # Pad with the last latent until the chunks tile the sequence (the canvas keeps only the real frames).
        total = z_len + cfg.dropped_latents
        pad = (-total) % chunk_tokens
        chunks = (total + pad) // chunk_tokens - int(cfg.dropped_latents > 0)
        if chunks < 1:
            pad += chunk_tokens
            chunks += 1
        return pad, chunks, chunk_tokens, overlap_tokens, pre_pad, overlap_frames

    def _windows(self, z: torch.Tensor) -> Iterator[_Window]:
        """The temporal windows of denormalised latents z (B, C, T', h, w), in output order."""
        cfg = self.config
        rt = cfg.time_ratio
        pad, chunks, chunk_tokens, overlap_tokens, pre_pad, overlap_frames = self._temporal_plan(max(z.shape[2], 2))
        one = torch.ones(1)
        if z.shape[2] == 1:
            if self.t1_direct:
                # Fine-tuned for lone latents: decode the token alone; its last decoded frame is the image.
                yield _Window(z, ((pre_pad, pre_pad + 1),), 0, one)
            else:
                # A lone latent means "clip start", and the decoder needs temporal context: decode it as the
                # 2-latent clip [z, z] (whose first window is z repeated) and keep only that clip's first
                # frame. Tiles are cut to that one frame before blending, so the canvas holds one frame.
                tokens = min(2 + pad, chunk_tokens + overlap_tokens)
                yield _Window(z.expand(-1, -1, tokens, -1, -1), ((pre_pad, pre_pad + 1),), 0, one)
            return
        if pad:
            z = torch.cat([z, z[:, :, -1:].expand(-1, -1, pad, -1, -1)], dim=2)
        clip_out = chunk_tokens * rt
        main = (pre_pad, clip_out)                                              # this clip's frames (17)
        carry = (clip_out + pre_pad, (chunk_tokens + overlap_tokens) * rt)        # the next clip's first 5
        main_frames = clip_out - pre_pad
        for i in range(chunks):
            tokens = z[:, :, i * chunk_tokens:i * chunk_tokens + chunk_tokens + overlap_tokens]
            keep = (main, carry) if tokens.shape[2] > chunk_tokens and carry[1] > carry[0] else (main,)
            weights = torch.ones(sum(b - a for a, b in keep))
            # Linear cross-fade over the frames two neighbouring windows both decode.
            ramp = torch.arange(overlap_frames, dtype=torch.float32) / max(overlap_frames, 1)
            if i > 0:
                weights[:overlap_frames] = ramp
            if i < chunks - 1:
                weights[main_frames:main_frames + overlap_frames] = 1.0 - ramp
            yield _Window(tokens, keep, i * main_frames, weights)

    def _decode_window(self, window: _Window, plan_h: tiling.TilePlan, plan_w: tiling.TilePlan,
                       writer: _CanvasWriter, state: dict) -> None:
        """Decode one temporal window in batches of spatial tiles and blend them into the canvas."""
        z = window.tokens
        b, _, t, _, _ = z.shape
        tiles = [(i, j) for i in range(len(plan_h.starts)) for j in range(len(plan_w.starts))]
        cost_key = (t, plan_h.size, plan_w.size, b, self.post_quant_conv.weight.dtype, str(z.device))
        k = 0
        while k < len(tiles):
            measure = not state["explicit"] and cost_key not in self.tile_costs
            batch = 1 if measure else min(state["cap"], len(tiles) - k)
            if not (measure or state["explicit"]):
                batch = min(batch, self.tile_batch_for(self.tile_costs[cost_key]))
            group = tiles[k:k + batch]
            parts = [z[..., plan_h.starts[i]:plan_h.starts[i] + plan_h.size, plan_w.starts[j]:plan_w.starts[j] + plan_w.size]
                     for i, j in group]
            x = torch.cat(parts) if len(parts) > 1 else parts[0]
            try:
                if measure:
                    decoded, cost = tiling.measure_peak_bytes(lambda: self._decode_pixels(x), z.device)
                    self.tile_costs[cost_key] = cost
                else:
                    decoded = self._decode_pixels(x)
            except (torch.OutOfMemoryError, RuntimeError) as err:
                # Out of memory: retry with half the tiles per call (down to 1) instead of failing the job.
                if not tiling.is_out_of_memory(err) or batch == 1:
                    raise
                del x, parts
                state["cap"] = max(1, batch // 2)
                self.last_tile_batch_fallbacks += 1
                if z.device.type == "cuda":
                    torch.cuda.empty_cache()
                continue
            del x, parts
            writer.add(decoded, group, b, window)
            del decoded
            self.last_tile_batches.append(len(group))
            k += len(group)
            state["done"] += len(group)
            if state["progress"] is not None:
                state["progress"](state["done"], state["total"])

    def _decode_pixels(self, z: torch.Tensor) -> torch.Tensor:
        """Denormalised latent tokens (N, C, t, h, w) -> raw ImageNet-normalised pixels (N, 3, 4t, 16h, 16w), float32."""
        dtype = self.post_quant_conv.weight.dtype
        return self.decoder(self.post_quant_conv(z.to(dtype))).float()

    def tile_batch_for(self, tile_cost_bytes: int) -> int:
        """Tiles per decoder call (1 to 4) whose measured cost fits in the share of free device memory allowed."""
        allowed = int(tiling.free_bytes() * self.TILE_MEMORY_SHARE)
        return int(max(1, min(self.MAX_TILE_BATCH, allowed // max(1, int(tile_cost_bytes)))))
