"""Weft's H3 transformer against diffusers' own MiniMax-H3 transformer on the same tiny weights.

The tiny checkpoint goes through diffusers' single-file converter
(`convert_minimax_h3_transformer_checkpoint_to_diffusers`), loads strictly into
`MiniMaxH3Transformer3DModel`, and both models see the same packed sequence. Any drift in the
architecture (modulation order, RoPE convention, SwiGLU halves, fused qkv order, norms) shows here.
"""
from __future__ import annotations

import pytest
import torch

from models.h3 import packing
from models.h3.make_tiny import build_tiny

diffusers = pytest.importorskip("diffusers", minversion="0.42.1")
from diffusers.loaders.single_file_utils import convert_minimax_h3_transformer_checkpoint_to_diffusers  # noqa: E402
from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3Transformer3DModel  # noqa: E402


def diffusers_config(cfg) -> dict:
    """The diffusers constructor arguments of a Weft H3TransformerConfig."""
    return dict(
        num_attention_heads=cfg.num_heads, attention_head_dim=cfg.head_dim, hidden_size=cfg.hidden_size,
        num_layers=cfg.num_layers, num_refiner_layers=cfg.refiner_layers, ffn_dim=cfg.ffn_size,
        in_channels=cfg.video_channels, audio_in_channels=cfg.audio_channels, patch_size=tuple(cfg.patch_size),
        text_dim=cfg.text_dim, freq_dim=cfg.time_freq_dim, time_embed_hidden_dim=cfg.time_hidden_size,
        time_embed_dim=cfg.time_embed_dim, rope_freq_dim=cfg.rope_freqs_per_axis, norm_eps=cfg.norm_eps,
        qk_norm_eps=cfg.qk_norm_eps, final_norm_eps=cfg.final_norm_eps)


def to_diffusers(weft_model, *, qkv_layout: str = "stacked") -> MiniMaxH3Transformer3DModel:
    """A diffusers model holding weft_model's weights, loaded strictly through diffusers' converter."""
    config = diffusers_config(weft_model.config)
    checkpoint = {k: v.clone() for k, v in weft_model.state_dict().items()}
    converted = convert_minimax_h3_transformer_checkpoint_to_diffusers(checkpoint, config, qkv_layout=qkv_layout)
    model = MiniMaxH3Transformer3DModel(**config).eval()
    model.load_state_dict(converted, strict=True)
    return model


def diffusers_inputs(video, audio, text, sigma_video, sigma_audio, items=()) -> dict:
    """The keyword arguments of diffusers' transformer for the packed sequence Weft builds for one batch element."""
    _, lt, lh, lw = video.shape
    layout = packing.build_layout(text.shape[0], lt, lh, lw, audio.shape[-1], list(items))
    t_rows, tags = packing.row_timesteps(layout, sigma_video, sigma_audio)
    t_values, t_index = torch.unique(t_rows.float(), return_inverse=True)
    video_rows, audio_rows, video_idx, audio_idx = [], [], [], []
    for seg in layout.segments:
        idx = torch.arange(seg.start, seg.stop)
        if seg.role in ("video", "cond_video", "ref_video"):
            lat = video if seg.role == "video" else items[seg.item].video
            video_rows.append(packing.patchify_video(lat))
            video_idx.append(idx)
        elif seg.role != "text":
            lat = audio if seg.role == "audio" else items[seg.item].audio
            audio_rows.append(packing.pack_audio(lat))
            audio_idx.append(idx)
    text_seg = layout.segment("text")
    return dict(
        hidden_states=torch.cat(video_rows)[None], audio_hidden_states=torch.cat(audio_rows)[None],
        encoder_hidden_states=text[None], timestep=t_values, timestep_indices=t_index, token_tags=tags,
        position_ids=layout.positions.float(), video_indices=torch.cat(video_idx),
        audio_indices=torch.cat(audio_idx), text_indices=torch.arange(text_seg.start, text_seg.stop),
        return_dict=False)


def diffusers_outputs(out_v, out_a, video, audio):
    """diffusers' packed velocities as Weft's (video (24, T, H, W), audio (32, 2, Ta)) of the targets."""
    # The targets are the last audio and video segments; their rows come last in each index list.
    _, lt, lh, lw = video.shape
    n_video = lt * (lh // 2) * (lw // 2)
    n_audio = 2 * audio.shape[-1]
    video_v = packing.unpatchify_video(out_v[0, -n_video:], lt, lh // 2, lw // 2, video.shape[0])
    return video_v, packing.unpack_audio(out_a[0, -n_audio:])


def diffusers_forward(model, video, audio, text, sigma_video, sigma_audio, items=()):
    """Run diffusers' transformer on the packed sequence Weft builds for one batch element; (video, audio) velocities."""
    with torch.no_grad():
        out_v, out_a = model(**diffusers_inputs(video, audio, text, sigma_video, sigma_audio, items))
    return diffusers_outputs(out_v, out_a, video, audio)


@pytest.fixture(scope="module")
def models():
    weft = build_tiny("transformer").float()
    return weft, to_diffusers(weft)


def inputs(seed: int, lt: int = 2, lh: int = 4, lw: int = 6, at: int = 5, text_len: int = 7):
    gen = torch.Generator().manual_seed(seed)
    cfg = build_tiny("transformer").config
    return (torch.randn(cfg.video_channels, lt, lh, lw, generator=gen),
            torch.randn(cfg.audio_channels, 2, at, generator=gen),
            torch.randn(text_len, cfg.text_dim, generator=gen))


@pytest.mark.parametrize("sigmas", [(0.9, 0.6), (0.35, 0.35)])
def test_weft_transformer_matches_diffusers(models, sigmas):
    weft, ref = models
    video, audio, text = inputs(1)
    with torch.no_grad():
        v, a = weft(video[None], audio[None], text[None], *sigmas)
    rv, ra = diffusers_forward(ref, video, audio, text, *sigmas)
    assert v[0].shape == rv.shape and a[0].shape == ra.shape
    assert torch.allclose(v[0], rv, atol=1e-5, rtol=0), (v[0] - rv).abs().max()
    assert torch.allclose(a[0], ra, atol=1e-5, rtol=0), (a[0] - ra).abs().max()


def test_weft_transformer_matches_diffusers_with_condition_rows(models):
    # Condition rows carry their own noise level (clean audio: t = 1) and shift the targets' rotary clock.
    # (Visual condition rows get Weft's fixed noise augmentation, which is sampling policy, not architecture.)
    weft, ref = models
    video, audio, text = inputs(2)
    gen = torch.Generator().manual_seed(3)
    ref_audio = packing.ConditionItem("reference", audio=torch.randn(32, 2, 3, generator=gen), kind="audio")
    with torch.no_grad():
        v, a = weft(video[None], audio[None], text[None], 0.7, 0.4, conditions=[[ref_audio]])
    rv, ra = diffusers_forward(ref, video, audio, text, 0.7, 0.4, items=(ref_audio,))
    assert torch.allclose(v[0], rv, atol=1e-5, rtol=0), (v[0] - rv).abs().max()
    assert torch.allclose(a[0], ra, atol=1e-5, rtol=0), (a[0] - ra).abs().max()


def interleave_qkv(state: dict, heads: int) -> dict:
    """The MiniMaxAI shards' row order: for each head its q rows, then its k rows, then its v rows."""
    out = dict(state)
    for key, weight in state.items():
        if key.endswith(".attn.qkv_proj.weight"):
            q, k, v = weight.chunk(3, dim=0)
            per_head = [part.reshape(heads, -1, weight.shape[1]) for part in (q, k, v)]
            out[key] = torch.cat([torch.cat([p[h] for p in per_head]) for h in range(heads)]).contiguous()
    return out


def test_hand_merged_interleaved_qkv_reads_as_diffusers_reads_it(tmp_path):
    from safetensors.torch import save_file

    from models.loading import load_model
    weft = build_tiny("transformer").float()
    cfg = weft.config
    merged = interleave_qkv({k: v.detach().clone().contiguous() for k, v in weft.state_dict().items()}, cfg.num_heads)
    assert not torch.equal(merged["blocks.0.attn.qkv_proj.weight"], weft.state_dict()["blocks.0.attn.qkv_proj.weight"])
    plain, marked = tmp_path / "merged.safetensors", tmp_path / "marked.safetensors"
    save_file(merged, str(plain))
    save_file(merged, str(marked), metadata={"qkv_layout": "interleaved"})

    # diffusers' converter reading the same file as interleaved is the reference.
    reference = MiniMaxH3Transformer3DModel(**diffusers_config(cfg)).eval()
    reference.load_state_dict(convert_minimax_h3_transformer_checkpoint_to_diffusers(
        dict(merged), diffusers_config(cfg), qkv_layout="interleaved"), strict=True)
    video, audio, text = inputs(4)
    rv, ra = diffusers_forward(reference, video, audio, text, 0.8, 0.5)
    for loaded in (load_model(plain, qkv_layout="interleaved").model, load_model(marked).model):
        with torch.no_grad():
            v, a = loaded.float()(video[None], audio[None], text[None], 0.8, 0.5)
        assert torch.allclose(v[0], rv, atol=1e-5, rtol=0) and torch.allclose(a[0], ra, atol=1e-5, rtol=0)

    # Read as stacked (the default for an unmarked file) the same rows give another model.
    with torch.no_grad():
        v, _ = load_model(plain).model.float()(video[None], audio[None], text[None], 0.8, 0.5)
    assert (v[0] - rv).abs().max() > 1e-2
    with pytest.raises(ValueError, match="declares its fused qkv rows interleaved"):
        load_model(marked, qkv_layout="stacked")
    with pytest.raises(ValueError, match="expected one of stacked, interleaved"):
        load_model(plain, qkv_layout="per-head")
