"""End to end on the tiny weights: text -> sample -> decode, for 5, 22 and 124 frames; determinism; masks; guides."""
import pytest
import torch

import models.h3 as h3


@pytest.fixture(scope="module")
def cond(tiny):
    hidden, mask = tiny["text_encoder"].encode(["a red kite over the sea, wind and gulls"])
    return [[hidden, {"attention_mask": mask}]]


@pytest.mark.parametrize("frames,latent_t,audio_t", [(5, 2, 8), (22, 7, 37), (124, 37, 207)])
def test_shapes_end_to_end(tiny, cond, frames, latent_t, audio_t):
    latent = h3.empty_latent(32, 32, frames)
    out = h3.sample(tiny["transformer"], latent, cond, h3.sigmas(2), noise_seed=1, sampler="res_multistep")
    assert out["samples"].shape == (1, 24, latent_t, 2, 2)
    assert out["audio_samples"].shape == (1, 32, 2, audio_t)
    assert torch.isfinite(out["samples"]).all() and torch.isfinite(out["audio_samples"]).all()
    video = tiny["video_vae"].decode(out["samples"])
    audio = tiny["audio_vae"].decode(out["audio_samples"])
    assert video.shape == (1, frames, 32, 32, 3)
    assert audio.shape == (1, 2, audio_t * 800)
    assert audio_t * 800 / 32000 == pytest.approx(frames / 24, abs=0.5 / 40)


def test_same_seed_same_latent_bytes(tiny, cond):
    latent = h3.empty_latent(32, 64, 22)
    runs = [h3.sample(tiny["transformer"], latent, cond, h3.sigmas(3), noise_seed=s, sampler="euler") for s in (5, 5, 6)]
    for key in ("samples", "audio_samples"):
        assert runs[0][key].numpy().tobytes() == runs[1][key].numpy().tobytes()
        assert runs[0][key].numpy().tobytes() != runs[2][key].numpy().tobytes()


def test_batch_elements_match_single_runs(tiny, cond):
    model = tiny["transformer"]
    gen = torch.Generator().manual_seed(0)
    video, audio = torch.randn(2, 24, 2, 2, 4, generator=gen), torch.randn(2, 32, 2, 8, generator=gen)
    text = cond[0][0].expand(2, -1, -1)
    v, a = model(video, audio, text, 0.7, 0.5)
    v1, a1 = model(video[1:], audio[1:], text[1:], 0.7, 0.5)
    torch.testing.assert_close(v[1:], v1, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(a[1:], a1, rtol=1e-4, atol=1e-5)


def test_text_padding_rows_are_ignored(tiny):
    te, model = tiny["text_encoder"], tiny["transformer"]
    hidden, mask = te.encode(["short", "a much longer prompt than the first"])
    alone, _ = te.encode(["short"])
    torch.testing.assert_close(hidden[0, :alone.shape[1]], alone[0], rtol=1e-4, atol=1e-5)
    gen = torch.Generator().manual_seed(1)
    video, audio = torch.randn(1, 24, 2, 2, 2, generator=gen), torch.randn(1, 32, 2, 8, generator=gen)
    padded = model(video, audio, hidden[:1], 0.5, 0.3, context_mask=mask[:1])
    plain = model(video, audio, alone, 0.5, 0.3)
    torch.testing.assert_close(padded[0], plain[0], rtol=1e-4, atol=1e-5)


def test_mask_of_ones_equals_no_mask(tiny, cond):
    latent = h3.empty_latent(32, 32, 5)
    plain = h3.sample(tiny["transformer"], latent, cond, h3.sigmas(3), 3, sampler="res_multistep")
    masked = dict(latent, noise_mask=torch.ones(1, 1, 2, 2, 2), audio_noise_mask=torch.ones(8))
    out = h3.sample(tiny["transformer"], masked, cond, h3.sigmas(3), 3, sampler="res_multistep")
    torch.testing.assert_close(out["samples"], plain["samples"])
    torch.testing.assert_close(out["audio_samples"], plain["audio_samples"])


@pytest.mark.parametrize("sampler", ["euler", "res_multistep"])
def test_zero_mask_keeps_the_input_latent(tiny, cond, sampler):
    gen = torch.Generator().manual_seed(4)
    latent = h3.empty_latent(32, 64, 22)
    latent["samples"] = torch.randn(latent["samples"].shape, generator=gen)
    latent["audio_samples"] = torch.randn(latent["audio_samples"].shape, generator=gen)
    vmask = torch.ones(7, 2, 4)
    vmask[2:5] = 0.0          # keep the middle latent frames
    amask = torch.ones(37)
    amask[10:20] = 0.0
    masked = dict(latent, noise_mask=vmask, audio_noise_mask=amask)
    out = h3.sample(tiny["transformer"], masked, cond, h3.sigmas(4), 9, sampler=sampler)
    torch.testing.assert_close(out["samples"][:, :, 2:5], latent["samples"][:, :, 2:5])
    torch.testing.assert_close(out["audio_samples"][..., 10:20], latent["audio_samples"][..., 10:20])
    assert not torch.allclose(out["samples"][:, :, :2], latent["samples"][:, :, :2])
    assert not torch.allclose(out["audio_samples"][..., :10], latent["audio_samples"][..., :10])


def test_keyframe_guides_change_the_result_and_leave_the_latent_alone(tiny, cond):
    latent = h3.empty_latent(32, 32, 22)
    guide = tiny["video_vae"].encode(torch.rand(1, 32, 32, 3, generator=torch.Generator().manual_seed(2)))
    guided = [[cond[0][0], dict(cond[0][1], keyframes=[{"frame_index": 0, "latent": guide},
                                                       {"frame_index": -1, "latent": guide}])]]
    plain = h3.sample(tiny["transformer"], latent, cond, h3.sigmas(2), 1)
    out = h3.sample(tiny["transformer"], latent, guided, h3.sigmas(2), 1)
    assert not torch.allclose(out["samples"], plain["samples"])
    assert not latent["samples"].any()
    ref = [[cond[0][0], dict(cond[0][1], references=[{"kind": "image", "latent": guide}])]]
    out_ref = h3.sample(tiny["transformer"], latent, ref, h3.sigmas(2), 1)
    assert not torch.allclose(out_ref["samples"], plain["samples"])


def test_conditioning_width_refused(tiny):
    latent = h3.empty_latent(32, 32, 5)
    with pytest.raises(ValueError, match="conditioning width 7"):
        h3.sample(tiny["transformer"], latent, [[torch.zeros(1, 3, 7), {}]], h3.sigmas(2), 0)


def test_embedding_rows_spliced_and_width_checked(tiny):
    te = tiny["text_encoder"]
    emb = torch.randn(2, te.config.hidden_size)
    hidden, mask = te.encode(["a embedding:style b"], embeddings={"style": emb})
    assert hidden.shape[1] == 1 + 2 + 2 + 2 + 1  # BOS, "a ", 2 embedding rows, " b", EOS
    with pytest.raises(ValueError, match="width 5"):
        te.encode(["embedding:bad"], embeddings={"bad": torch.zeros(1, 5)})
    with pytest.raises(ValueError, match="not provided"):
        te.encode(["embedding:missing"])
