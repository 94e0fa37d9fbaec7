"""The H3 audio VAE: 32 kHz stereo <-> (B, 32, 2, T) latents at 40 latent frames per second (hop 800).

Each stereo lane is processed separately (lanes fold into the batch). Encoder: a strided 1-D
convolutional waveform encoder (strides 2, 4, 4, 5, 5: hop 800) with Snake activations, then a small
causal attention head down to 32 channels and a 1x1 mean projection. Decoder: a 1x1 input projection and a
vocoder-style stack of transposed convolutions (rates 5, 5, 2, 2, 2, 2, 2: 800 in all) with multi-kernel
residual blocks and anti-aliased SnakeBeta activations. Latents are normalised with per-channel
`latents_mean` / `latents_std` stored with the weights. Parameter names are the original checkpoint's.

Long audio is decoded in overlapping chunks (each with context frames on both sides, neighbours
cross-faded linearly) written into one preallocated output; unless the caller fixes the chunk length,
it is sized from the free device memory and the measured per-frame cost of the first chunk. Every
weight, including the activations' alpha/beta and the attention biases, reaches its op through the
memory manager's take/release (models/memory.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from models import memory, parallel
from models.h3 import tiling
from models import ops
from models.h3.layers import attention, compute_device

SAMPLE_RATE = 32000


@dataclass
class AudioVAEConfig:
    """Shape of the H3 audio VAE. Defaults are the released model's."""
    encoder_dim: int = 64                                   # width of the first encoder conv (doubles per block)
    encoder_rates: tuple[int, ...] = (2, 4, 4, 5, 5)        # encoder strides: 800 samples per latent
    latent_dim: int = 2048                                  # encoder output / decoder input width
    attn_heads: int = 8                                     # heads of the encoder's attention head
    latent_channels: int = 32
    decoder_dim: int = 1024                                 # decoder width after conv_pre (halves per stage)
    upsample_rates: tuple[int, ...] = (5, 5, 2, 2, 2, 2, 2)  # 800 samples per latent
    upsample_kernels: tuple[int, ...] = (9, 9, 4, 4, 4, 4, 4)
    resblock_kernels: tuple[int, ...] = (3, 7, 11)
    resblock_dilations: tuple[int, ...] = (1, 3, 5)          # a checkpoint with fewer dilated convs uses the first ones
    sample_rate: int = SAMPLE_RATE

    @property
    def hop(self) -> int:
        """Waveform samples per latent frame (800)."""
        return math.prod(self.encoder_rates)


TINY_CONFIG = AudioVAEConfig(encoder_dim=4, latent_dim=256, decoder_dim=128, resblock_kernels=(3,), resblock_dilations=(1,))



def _snake(x: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    # x + sin^2(alpha x) / beta
    return x + torch.sin(alpha * x).pow(2) / (beta + 1e-9)


class Snake1d(nn.Module):
    """Snake activation with a per-channel alpha (1, C, 1)."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1, channels, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with memory.using_named(self, dtype=x.dtype) as own:
            a = own["alpha"]
            return _snake(x, a, a)


class SnakeBeta(nn.Module):
    """x + sin^2(alpha x) / beta with log-scale per-channel alpha and beta."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with memory.using_named(self, dtype=torch.float32) as own:  # exp in float32, then the activation's dtype
            alpha = own["alpha"].exp().to(x.dtype).view(1, -1, 1)
            beta = own["beta"].exp().to(x.dtype).view(1, -1, 1)
        return _snake(x, alpha, beta)


def kaiser_sinc(cutoff: float, half_width: float, kernel_size: int) -> torch.Tensor:
    """A Kaiser-windowed sinc low-pass filter (kernel_size,) normalised to unit sum."""
    half = kernel_size // 2
    atten = 2.285 * (half - 1) * math.pi * 4 * half_width + 7.95
    if atten > 50.0:
        beta = 0.1102 * (atten - 8.7)
    elif atten >= 21.0:
        beta = 0.5842 * (atten - 21) ** 0.4 + 0.07886 * (atten - 21.0)
    else:
        beta = 0.0
    window = torch.kaiser_window(kernel_size, beta=beta, periodic=False)
    time = (torch.arange(-half, half) + 0.5) if kernel_size % 2 == 0 else (torch.arange(kernel_size) - half)
    filt = 2 * cutoff * window * torch.sinc(2 * cutoff * time)
    return filt / filt.sum()


class AntiAliasedActivation(nn.Module):
    """Upsample x2 (windowed sinc), pointwise SnakeBeta, low-pass and downsample x2."""

    KERNEL = 12

    def __init__(self, channels: int):
        super().__init__()
        self.act = SnakeBeta(channels)
        self.make_buffers()

    def make_buffers(self) -> None:
        """(Re)compute the fixed resampling filter (not stored in checkpoints)."""
        self.register_buffer("filter", kaiser_sinc(0.25, 0.3, self.KERNEL), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, c, length = x.shape
        k = self.KERNEL
        with memory.using_named(self, dtype=x.dtype) as own:
            filt = own["filter"].view(1, 1, k)
        # Channels fold into the batch so the single-channel filter runs as a plain (fast) convolution.
        x = x.reshape(n * c, 1, length)
        # Upsample by 2: transposed conv of the replicate-padded signal, cropped to exactly 2x the input.
        pad = k // 2 - 1
        up = F.conv_transpose1d(F.pad(x, (pad, pad), mode="replicate"), filt, stride=2) * 2
        left = pad * 2 + (k - 2) // 2
        right = pad * 2 + (k - 2 + 1) // 2
        up = up[..., left:up.shape[-1] - right].reshape(n, c, 2 * length)
        y = self.act(up).reshape(n * c, 1, 2 * length)
        y = F.pad(y, (k // 2 - 1, k // 2), mode="replicate")
        return F.conv1d(y, filt, stride=2).reshape(n, c, length)


class ResidualUnit(nn.Module):
    """Snake, dilated conv k7, Snake, conv k1, plus the input."""

    def __init__(self, dim: int, dilation: int):
        super().__init__()
        pad = 3 * dilation
        self.block = nn.Sequential(Snake1d(dim), ops.Conv1d(dim, dim, 7, dilation=dilation, padding=pad),
                                   Snake1d(dim), ops.Conv1d(dim, dim, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x) + x


class EncoderBlock(nn.Module):
    """Three residual units (dilations 1, 3, 9) then a strided conv doubling the width."""

    def __init__(self, dim: int, stride: int):
        super().__init__()
        self.block = nn.Sequential(
            ResidualUnit(dim // 2, 1), ResidualUnit(dim // 2, 3), ResidualUnit(dim // 2, 9), Snake1d(dim // 2),
            ops.Conv1d(dim // 2, dim, 2 * stride, stride=stride, padding=math.ceil(stride / 2)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


class WaveEncoder(nn.Module):
    """Mono waveform (N, 1, L) -> (N, latent_dim, L / hop)."""

    def __init__(self, cfg: AudioVAEConfig):
        super().__init__()
        d = cfg.encoder_dim
        layers: list[nn.Module] = [ops.Conv1d(1, d, 7, padding=3)]
        for stride in cfg.encoder_rates:
            d *= 2
            layers.append(EncoderBlock(d, stride))
        layers += [Snake1d(d), ops.Conv1d(d, cfg.latent_dim, 3, padding=1)]
        self.block = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


class GeGluMlp(nn.Module):
    """LayerNorm then GELU(tanh)-gated MLP."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.norm = ops.LayerNorm(dim)
        self.w0 = ops.Linear(dim, hidden)
        self.w1 = ops.Linear(dim, hidden)
        self.w2 = ops.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x)
        return self.w2(F.gelu(self.w0(x), approximate="tanh") * self.w1(x))


class CausalAttention(nn.Module):
    """Causal attention whose head outputs are averaged and pooled down to the latent width."""

    def __init__(self, in_dim: int, out_dim: int, heads: int):
        super().__init__()
        self.heads, self.head_dim, self.out_dim = heads, in_dim // heads, out_dim
        self.qkv = ops.Linear(in_dim, 3 * in_dim, bias=False)
        self.q_bias = nn.Parameter(torch.zeros(in_dim))
        self.v_bias = nn.Parameter(torch.zeros(in_dim))
        self.register_buffer("zero_k_bias", torch.zeros(in_dim))
        self.proj = ops.Linear(out_dim, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        with memory.using_named(self, dtype=x.dtype) as own:
            bias = torch.cat([own["q_bias"], own["zero_k_bias"], own["v_bias"]])
        qkv = self.qkv(x) + bias
        q, k, v = qkv.view(b, n, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)  # (B, H, N, D)
        out = attention(q, k, v, causal=True).mean(dim=1)  # (B, N, D)
        return self.proj(F.adaptive_avg_pool1d(out, self.out_dim))


class AttnProjection(nn.Module):
    """(N, T, latent_dim) -> (N, T, latent_channels): projected skip + causal attention, then a GeGLU MLP."""

    def __init__(self, in_dim: int, out_dim: int, heads: int):
        super().__init__()
        self.norm1 = ops.LayerNorm(in_dim)
        self.attn = CausalAttention(in_dim, out_dim, heads)
        self.proj = ops.Linear(in_dim, out_dim)
        self.norm3 = ops.LayerNorm(in_dim)
        self.norm2 = ops.LayerNorm(out_dim)
        self.mlp = GeGluMlp(out_dim, 2 * out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(self.norm3(x)) + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class AMPBlock(nn.Module):
    """Residual pairs (dilated conv, conv), each conv preceded by an anti-aliased SnakeBeta."""

    def __init__(self, channels: int, kernel: int, dilations: tuple[int, ...]):
        super().__init__()
        self.convs1 = nn.ModuleList([ops.Conv1d(channels, channels, kernel, dilation=d, padding=(kernel * d - d) // 2)
                                     for d in dilations])
        self.convs2 = nn.ModuleList([ops.Conv1d(channels, channels, kernel, padding=(kernel - 1) // 2)
                                     for _ in dilations])
        self.activations = nn.ModuleList([AntiAliasedActivation(channels) for _ in range(2 * len(dilations))])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for n, (c1, c2) in enumerate(zip(self.convs1, self.convs2)):
            x = c2(self.activations[2 * n + 1](c1(self.activations[2 * n](x)))) + x
        return x


class Vocoder(nn.Module):
    """(N, latent_dim, T) -> waveform (N, 1, T * 800) in [-1, 1]."""

    def __init__(self, cfg: AudioVAEConfig):
        super().__init__()
        self.num_kernels = len(cfg.resblock_kernels)
        ch = cfg.decoder_dim
        self.conv_pre = ops.Conv1d(cfg.latent_dim, ch, 7, padding=3)
        self.ups = nn.ModuleList()
        self.resblocks = nn.ModuleList()
        for i, (rate, kernel) in enumerate(zip(cfg.upsample_rates, cfg.upsample_kernels)):
            self.ups.append(nn.ModuleList([ops.ConvTranspose1d(ch // 2 ** i, ch // 2 ** (i + 1), kernel, rate,
                                                                 padding=(kernel - rate) // 2)]))
        for i in range(len(self.ups)):
            width = ch // 2 ** (i + 1)
            for kernel in cfg.resblock_kernels:
                self.resblocks.append(AMPBlock(width, kernel, tuple(cfg.resblock_dilations)))
        self.activation_post = AntiAliasedActivation(width)
        self.conv_post = ops.Conv1d(width, 1, 7, padding=3, bias=False)

    def forward(self, x: torch.Tensor, clamp: bool = True) -> torch.Tensor:
        x = self.conv_pre(x)
        for i, up in enumerate(self.ups):
            x = up[0](x)
            blocks = self.resblocks[i * self.num_kernels:(i + 1) * self.num_kernels]
            x = sum(block(x) for block in blocks) / self.num_kernels
        x = self.conv_post(self.activation_post(x))
        return x.clamp(-1.0, 1.0) if clamp else x


class AudioVAE(nn.Module):
    """Stereo 32 kHz waveforms (B, 2, S) <-> normalised audio latents (B, 32, 2, T)."""

    def __init__(self, config: AudioVAEConfig | None = None):
        super().__init__()
        cfg = self.config = config or AudioVAEConfig()
        if cfg.hop != math.prod(cfg.upsample_rates):
            raise ValueError(f"encoder hop {cfg.hop} != decoder upsampling {math.prod(cfg.upsample_rates)}")
        self.encoder = WaveEncoder(cfg)
        self.pre_block = AttnProjection(cfg.latent_dim, cfg.latent_channels, cfg.attn_heads)
        self.mean_proj = ops.Conv1d(cfg.latent_channels, cfg.latent_channels, 1)
        self.logs_proj = ops.Conv1d(cfg.latent_channels, cfg.latent_channels, 1)  # posterior log-std, unused at inference
        self.dec_in_proj = ops.Conv1d(cfg.latent_channels, cfg.latent_dim, 1)
        self.decoder = Vocoder(cfg)
        self.register_buffer("latents_mean", torch.zeros(cfg.latent_channels))
        self.register_buffer("latents_std", torch.ones(cfg.latent_channels))
        # Measured activation bytes per decoded latent frame, per (lanes x batch, dtype, device).
        self.frame_costs: dict[tuple, int] = {}
        # The [start, stop) latent frames of each chunk the last decode wrote.
        self.last_chunks: list[tuple[int, int]] = []

    @property
    def sample_rate(self) -> int:
        """Waveform sample rate in Hz (32000)."""
        return self.config.sample_rate

    @parallel.on_root_in_group  # a rank group decodes and encodes sound on rank 0
    def encode(self, waveform: torch.Tensor) -> torch.Tensor:
        """(B, 2, S) or (2, S) at 32 kHz in [-1, 1] -> (B, 32, 2, ceil(S / 800)); S is zero-padded to whole hops."""
        w = waveform if waveform.dim() == 3 else waveform.unsqueeze(0)
        if w.dim() != 3 or w.shape[1] != 2:
            raise ValueError(f"audio VAE encode expects stereo (B, 2, S) waveforms, got {tuple(waveform.shape)}")
        hop = self.config.hop
        b, lanes, length = w.shape
        if length == 0:
            raise ValueError("audio VAE encode got an empty waveform")
        with torch.no_grad(), memory.using_named(self, dtype=torch.float32) as stats:
            dtype = self.mean_proj.weight.dtype
            x = F.pad(w.float(), (0, (-length) % hop)).reshape(b * lanes, 1, -1)
            x = x.to(device=compute_device(self), dtype=dtype)
            h = self.encoder(x)                                     # (N, latent_dim, T)
            h = self.pre_block(h.transpose(1, 2)).transpose(1, 2)   # (N, 32, T)
            z = self.mean_proj(h).float()
            z = (z - stats["latents_mean"].view(1, -1, 1)) / stats["latents_std"].view(1, -1, 1)
            return z.reshape(b, lanes, z.shape[1], z.shape[2]).permute(0, 2, 1, 3)

    @parallel.on_root_in_group  # a rank group decodes and encodes sound on rank 0
    def decode(self, latents: torch.Tensor, *, chunk_frames: int | None = None, overlap_frames: int = 8,
               progress: Callable[[int, int], None] | None = None) -> torch.Tensor:
        """(B, 32, 2, T) -> (B, 2, T * 800) float32 waveform at 32 kHz in [-1, 1], on the CPU.

        Decoded in chunks of `chunk_frames` latent frames, each with `overlap_frames` of context on both
        sides, neighbouring chunks cross-faded linearly over `overlap_frames`. chunk_frames=None sizes the
        chunks automatically: the first (AUTO_FIRST_CHUNK frames) is measured, the rest fit in the free
        device memory at that measured per-frame cost (audio this short or memory this plentiful is one
        chunk, i.e. one shot). An out-of-memory error halves the chunk and retries. progress(latent frames
        done, latent frames) is called after each chunk.
        """
        cfg = self.config
        if latents.dim() != 4 or latents.shape[1] != cfg.latent_channels or latents.shape[2] != 2:
            raise ValueError(f"audio VAE decode expects latents (B, {cfg.latent_channels}, 2, T), got {tuple(latents.shape)}")
        b, c, lanes, t = latents.shape
        if t == 0:
            return torch.zeros(b, lanes, 0)  # an image workflow's audio stream: no frames, no samples
        if overlap_frames < 1:
            raise ValueError(f"audio decode overlap ({overlap_frames} frames) must be at least 1 frame")
        if chunk_frames is not None and chunk_frames < t and chunk_frames < 2 * overlap_frames:
            raise ValueError(f"audio decode chunk ({chunk_frames} frames) must be at least twice its overlap "
                             f"({overlap_frames}), and the overlap at least 1 frame")
        with torch.no_grad(), memory.using_named(self, dtype=torch.float32) as stats:
            z = latents.permute(0, 2, 1, 3).reshape(b * lanes, c, t).to(compute_device(self), torch.float32)
            z = z * stats["latents_std"].view(1, -1, 1) + stats["latents_mean"].view(1, -1, 1)
            wave = self._decode_chunked(z, chunk_frames, overlap_frames, progress)
            return wave.reshape(b, lanes, -1)

    def _decode_frames(self, z: torch.Tensor) -> torch.Tensor:
        """Denormalised latents (N, 32, T) -> waveform (N, T * hop), float32."""
        dtype = self.dec_in_proj.weight.dtype
        return self.decoder(self.dec_in_proj(z.to(dtype))).float()[:, 0]  # (N, T * hop)

    AUTO_FIRST_CHUNK = 400       # latent frames (10 s) of the first, measured chunk when the cost is not known yet
    AUTO_MAX_CHUNK = 6000        # latent frames (2.5 min): the longest automatic chunk
    CHUNK_MEMORY_SHARE = 0.8     # share of the free device memory one chunk may use

    def chunk_frames_for(self, frame_cost_bytes: int, overlap: int) -> int:
        """Latent frames per chunk (context excluded) that fit the free device memory at a measured per-frame cost."""
        allowed = int(tiling.free_bytes() * self.CHUNK_MEMORY_SHARE) // max(1, int(frame_cost_bytes))
        return int(max(2 * overlap, min(self.AUTO_MAX_CHUNK, allowed - 2 * overlap)))

    def _decode_chunked(self, z: torch.Tensor, chunk: int | None, overlap: int,
                        progress: Callable[[int, int], None] | None = None) -> torch.Tensor:
        # Chunk [start, stop) is decoded with `overlap` frames of context on each side; the next chunk starts
        # `overlap` frames before this one stops, and the shared frames are cross-faded linearly. Every chunk
        # is added straight into the one output buffer.
        hop = self.config.hop
        n, _, t = z.shape
        out = torch.zeros(n, t * hop, dtype=torch.float32)
        cost_key = (n, self.dec_in_proj.weight.dtype, str(z.device))
        fade = overlap * hop
        ramp = torch.arange(fade, dtype=torch.float32, device=z.device) / fade
        self.last_chunks: list[tuple[int, int]] = []
        cap = self.AUTO_MAX_CHUNK if chunk is None else int(chunk)
        start = 0
        while True:
            measure = chunk is None and cost_key not in self.frame_costs
            if chunk is not None:
                size = cap
            elif measure:
                size = min(cap, self.AUTO_FIRST_CHUNK)
            else:
                size = min(cap, self.chunk_frames_for(self.frame_costs[cost_key], overlap))
            stop = min(start + size, t)
            lo, hi = max(0, start - overlap), min(t, stop + overlap)
            piece = z[:, :, lo:hi]
            try:
                if measure:
                    wave, peak = tiling.measure_peak_bytes(lambda: self._decode_frames(piece), z.device)
                    self.frame_costs[cost_key] = max(1, peak // (hi - lo))
                else:
                    wave = self._decode_frames(piece)
            except (torch.OutOfMemoryError, RuntimeError) as err:
                # Out of memory: retry with half the chunk (down to twice the overlap) instead of failing the job.
                if not tiling.is_out_of_memory(err) or size <= 2 * overlap:
                    raise
                cap = max(2 * overlap, size // 2)
                if z.device.type == "cuda":
                    torch.cuda.empty_cache()
                continue
            wave = wave[:, (start - lo) * hop:(stop - lo) * hop]
            if start > 0:
                wave[:, :fade] *= ramp
            if stop < t:
                wave[:, -fade:] *= 1.0 - ramp
            out[:, start * hop:stop * hop] += wave.to(out.device)
            self.last_chunks.append((start, stop))
            del wave
            if progress is not None:
                progress(stop, t)
            if stop >= t:
                return out
            start = stop - overlap
