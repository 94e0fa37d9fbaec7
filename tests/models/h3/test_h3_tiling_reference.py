"""Spatial tiling of the H3 video VAE against the reference VAEs' composition, re-derived here.

The references (ComfyUI's H3 VAE and diffusers' AutoencoderKLMiniMaxH3) lay tiles over the frame, give the
leftover overlap to the seams in whole latent steps, then walk the tiles in raster order: each tile is
cross-faded with the tile above it over the whole vertical overlap, then with the tile to its left over
the whole horizontal overlap (incoming weight k / overlap at the k-th overlapped row or column; the
neighbours as they came out of the decoder), and is cut where its successors start. This file states that
procedure on its own, checks it against diffusers' `_stitch_tiles` when diffusers is installed, and holds
Weft's batched canvas decode and tiled encode to it.
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from models.h3.make_tiny import build_tiny

RATIO = 16


def split(length: int, tile: int, min_overlap: int, unit: int) -> tuple[list[int], list[int]]:
    """Tile starts and overlaps: fewest tiles with overlaps >= min_overlap, the rest spread in `unit` steps."""
    if tile >= length:
        return [0], []
    n = math.ceil(length / tile)
    while tile * n - min_overlap * (n - 1) < length:
        n += 1
    overlaps = [min_overlap] * (n - 1)
    for k in range((tile * n - sum(overlaps) - length) // unit):
        overlaps[k % (n - 1)] += unit
    starts = [0]
    for o in overlaps:
        starts.append(starts[-1] + tile - o)
    return starts, overlaps


def crossfade(before: torch.Tensor, after: torch.Tensor, overlap: int, dim: int) -> torch.Tensor:
    """`after` with its first `overlap` entries along dim faded in over the last `overlap` of `before`."""
    if overlap == 0:
        return after
    k = torch.arange(overlap, dtype=after.dtype)
    shape = [1] * after.dim()
    shape[dim] = overlap
    k = k.view(shape) / overlap
    head = before.narrow(dim, before.shape[dim] - overlap, overlap) * (1 - k) + after.narrow(dim, 0, overlap) * k
    return torch.cat([head, after.narrow(dim, overlap, after.shape[dim] - overlap)], dim=dim)


def stitch(tiles: list[list[torch.Tensor]], over_h: list[int], over_w: list[int]) -> torch.Tensor:
    """Raster-order composition of a grid of equally sized tiles (..., h, w)."""
    rows = []
    for i, row in enumerate(tiles):
        pieces = []
        for j, tile in enumerate(row):
            if i > 0:
                tile = crossfade(tiles[i - 1][j], tile, over_h[i - 1], dim=-2)
            if j > 0:
                tile = crossfade(row[j - 1], tile, over_w[j - 1], dim=-1)
            if i < len(tiles) - 1:
                tile = tile[..., :tile.shape[-2] - over_h[i], :]
            if j < len(row) - 1:
                tile = tile[..., :tile.shape[-1] - over_w[j]]
            pieces.append(tile)
        rows.append(torch.cat(pieces, dim=-1))
    return torch.cat(rows, dim=-2)


def test_the_restated_composition_is_diffusers():
    diffusers = pytest.importorskip("diffusers", minversion="0.42.1")
    vae_cls = diffusers.AutoencoderKLMiniMaxH3
    gen = torch.Generator().manual_seed(0)
    ref = object.__new__(vae_cls)                     # only the geometry helpers are used: no weights
    ref.spatial_compression_ratio = RATIO
    for length, tile, overlap in [(320, 256, 64), (1040, 256, 64), (80, 48, 32), (112, 64, 16)]:
        starts, overlaps = split(length, tile, overlap, RATIO)
        d_starts, _, d_overlaps = vae_cls._split_tiles(ref, length, tile, overlap)
        assert (starts, overlaps) == (list(d_starts), list(d_overlaps))
    over = [5, 7]
    tiles = [[torch.randn(2, 12, 12, generator=gen) for _ in range(3)] for _ in range(3)]
    torch.testing.assert_close(stitch(tiles, over, over), vae_cls._stitch_tiles(ref, tiles, over, over), rtol=0, atol=0)


@pytest.fixture(scope="module")
def vae():
    return build_tiny("video_vae")


def finalize(raw: torch.Tensor, vae) -> torch.Tensor:
    return raw * vae.pixel_std + vae.pixel_mean


@pytest.mark.parametrize("latent_hw,tile,overlap", [((5, 7), 48, 16), ((5, 5), 48, 32), ((4, 7), 48, 16)],
                         ids=["three-by-two", "crowded-seams", "wide-leftover"])
def test_tiled_decode_composes_like_the_references(vae, latent_hw, tile, overlap):
    gen = torch.Generator().manual_seed(7)
    h, w = latent_hw
    z = torch.randn(1, 24, 2, h, w, generator=gen)
    got = vae.decode(z, tile_size=tile, tile_overlap=overlap, tile_batch=3)      # (1, 5, H, W, 3)

    # Reference: a 2-latent clip is decoded as one padded 7-token window whose frames 3..7 are the video.
    with torch.no_grad():
        zd = z * vae.latents_std.view(1, -1, 1, 1, 1) + vae.latents_mean.view(1, -1, 1, 1, 1)
        zd = torch.cat([zd, zd[:, :, -1:].expand(-1, -1, 5, -1, -1)], dim=2)
        ys, over_h = split(h * RATIO, tile, overlap, RATIO)
        xs, over_w = split(w * RATIO, tile, overlap, RATIO)
        th, tw = min(tile, h * RATIO) // RATIO, min(tile, w * RATIO) // RATIO
        tiles = [[finalize(vae._decode_pixels(zd[..., y // RATIO:y // RATIO + th, x // RATIO:x // RATIO + tw]), vae)[:, :, 3:8]
                  for x in xs] for y in ys]
        want = stitch(tiles, over_h, over_w).clamp(0, 1).permute(0, 2, 3, 4, 1)
    assert len(ys) * len(xs) > 2
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("size_hw,tile,overlap", [((80, 112), 48, 16), ((80, 80), 48, 32)])
def test_tiled_encode_composes_like_the_references(vae, size_hw, tile, overlap):
    gen = torch.Generator().manual_seed(8)
    frame = torch.rand(1, 1, *size_hw, 3, generator=gen)
    tiled = build_tiny("video_vae")
    tiled.config = dataclasses.replace(tiled.config, tile_size=tile, tile_overlap=overlap)
    got = tiled.encode(frame)                                                     # (1, 24, 1, h, w)

    with torch.no_grad():
        x = (frame.permute(0, 4, 1, 2, 3) - vae.pixel_mean) / vae.pixel_std
        ys, over_h = split(size_hw[0], tile, overlap, RATIO)
        xs, over_w = split(size_hw[1], tile, overlap, RATIO)
        tiles = [[vae._encode_moments(x[..., y:y + tile, x0:x0 + tile]) for x0 in xs] for y in ys]
        moments = stitch(tiles, [o // RATIO for o in over_h], [o // RATIO for o in over_w])
        mean = moments[:, :24]
        want = (mean - vae.latents_mean.view(1, -1, 1, 1, 1)) / vae.latents_std.view(1, -1, 1, 1, 1)
    assert len(ys) * len(xs) > 2
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
