"""Noise masks and odd latent sizes in Weft's H3 transformer, against diffusers' transformer fed by hand.

The per-row timesteps are restated here from the reference sampler's rule, not taken from Weft:
a target row under noise-mask value m runs at t = 1 - m * sigma of its stream, capped at the level the
stream's condition rows use: max(1 - sigma_video, 0.999) for video, max(1 - sigma_audio, 1) for audio, so
a kept row (m = 0) of video sits at 0.999 while sigma is large and a kept audio row at 1. Values are used
as they are (no rounding), and a mask at or above 1 - 1e-3 everywhere counts as no mask. A latent with an
odd height or width is padded at its end circularly (the added row or column repeats the first one),
run, and cropped back.
"""
from __future__ import annotations

import pytest
import torch

from models.h3 import packing
from models.h3.make_tiny import build_tiny

pytest.importorskip("diffusers", minversion="0.42.1")
from tests.models.h3.test_h3_diffusers_parity import inputs, to_diffusers  # noqa: E402


def reference_forward(model, video, audio, text, t_text, t_audio_rows, t_video_rows):
    """diffusers' transformer on [text | audio | video] with the given per-row timesteps (t = 1 - sigma)."""
    _, lt, lh, lw = video.shape
    layout = packing.build_layout(text.shape[0], lt, lh, lw, audio.shape[-1])
    assert [s.role for s in layout.segments] == ["text", "audio", "video"]
    rows_t = torch.cat([torch.full((text.shape[0],), float(t_text)), t_audio_rows.float(), t_video_rows.float()])
    values, index = torch.unique(rows_t, return_inverse=True)
    tags = torch.cat([torch.full((text.shape[0],), 1), torch.full((t_audio_rows.numel(),), 2),
                      torch.full((t_video_rows.numel(),), 0)])
    n_text, n_audio = text.shape[0], t_audio_rows.numel()
    seq = rows_t.numel()
    with torch.no_grad():
        out_v, out_a = model(
            hidden_states=packing.patchify_video(video)[None], audio_hidden_states=packing.pack_audio(audio)[None],
            encoder_hidden_states=text[None], timestep=values, timestep_indices=index, token_tags=tags,
            position_ids=layout.positions.float(), video_indices=torch.arange(n_text + n_audio, seq),
            audio_indices=torch.arange(n_text, n_text + n_audio), text_indices=torch.arange(n_text), return_dict=False)
    return packing.unpatchify_video(out_v[0], lt, lh // 2, lw // 2, video.shape[0]), packing.unpack_audio(out_a[0])


@pytest.fixture(scope="module")
def models():
    weft = build_tiny("transformer").float()
    return weft, to_diffusers(weft)


@pytest.mark.parametrize("sigma_v,sigma_a", [(0.7, 0.4), (0.0004, 0.0002)])
def test_masked_rows_run_at_the_reference_timesteps(models, sigma_v, sigma_a):
    weft, ref = models
    video, audio, text = inputs(11, lt=2, lh=4, lw=6, at=5)
    gen = torch.Generator().manual_seed(12)
    video_mask = torch.rand(1, 2, 2, 3, generator=gen)                  # the patch grid, values kept as they are
    video_mask[0, 0, 0, :2] = 0.0                                        # kept rows
    video_mask[0, 1, 1, 2] = 1.0
    audio_mask = torch.tensor([[0.0, 0.3, 1.0, 0.0, 0.77]])
    with torch.no_grad():
        v, a = weft(video[None], audio[None], text[None], sigma_v, sigma_a, video_mask=video_mask, audio_mask=audio_mask)

    t_v, t_a = 1.0 - sigma_v, 1.0 - sigma_a
    m_v = video_mask[0].reshape(-1).double()
    t_video = torch.minimum(1.0 - m_v * sigma_v, torch.tensor(max(t_v, 0.999), dtype=torch.float64))
    m_a = audio_mask[0].double().repeat(2)                               # both lanes of a frame share its value
    t_audio = torch.minimum(1.0 - m_a * sigma_a, torch.tensor(max(t_a, 1.0), dtype=torch.float64))
    if sigma_v > 0.01:
        assert t_video[0] == pytest.approx(0.999) and t_audio[0] == 1.0
    rv, ra = reference_forward(ref, video, audio, text, t_v, t_audio, t_video)
    assert torch.allclose(v[0], rv, atol=1e-5, rtol=0), (v[0] - rv).abs().max()
    assert torch.allclose(a[0], ra, atol=1e-5, rtol=0), (a[0] - ra).abs().max()


def test_a_mask_that_generates_everything_is_no_mask(models):
    weft, ref = models
    video, audio, text = inputs(13, lt=2, lh=4, lw=4, at=4)
    with torch.no_grad():
        v, a = weft(video[None], audio[None], text[None], 0.6, 0.3,
                    video_mask=torch.full((1, 2, 2, 2), 0.9995), audio_mask=torch.full((1, 4), 0.9999))
    rv, ra = reference_forward(ref, video, audio, text, 0.4, torch.full((8,), 0.7), torch.full((8,), 0.4))
    assert torch.allclose(v[0], rv, atol=1e-5, rtol=0) and torch.allclose(a[0], ra, atol=1e-5, rtol=0)


@pytest.mark.parametrize("lh,lw", [(5, 6), (4, 7), (5, 7)])
def test_odd_latent_sizes_are_padded_circularly_and_cropped(models, lh, lw):
    weft, ref = models
    video, audio, text = inputs(14, lt=2, lh=lh, lw=lw, at=4)
    with torch.no_grad():
        v, a = weft(video[None], audio[None], text[None], 0.5, 0.3)
    assert v.shape[-2:] == (lh, lw)
    padded = video
    if lh % 2:
        padded = torch.cat([padded, padded[:, :, :1]], dim=2)
    if lw % 2:
        padded = torch.cat([padded, padded[:, :, :, :1]], dim=3)
    rows_v = 2 * (padded.shape[2] // 2) * (padded.shape[3] // 2)
    rv, ra = reference_forward(ref, padded, audio, text, 0.5, torch.full((8,), 0.7), torch.full((rows_v,), 0.5))
    assert torch.allclose(v[0], rv[:, :, :lh, :lw], atol=1e-5, rtol=0), (v[0] - rv[:, :, :lh, :lw]).abs().max()
    assert torch.allclose(a[0], ra, atol=1e-5, rtol=0)
