"""ModelAttentionBackend and BlockSparseAttention: ComfyUI's inputs, validation, and what the MODEL they return does."""
from __future__ import annotations

import pytest
import torch

from models.h3.sparse_attention import SparseAttentionSettings, percent_to_sigma
from nodes.attention import _attention_backend, _block_sparse_attention
from tests.nodes.test_h3_nodes import H3Env, configured_paths, h3, probe, t2va_prompt, tiny_weights  # noqa: F401
from web.object_info import object_info


def test_inputs_are_comfyuis(registry):
    info = object_info(registry)
    sparse = info["BlockSparseAttention"]
    assert sparse["display_name"] == "Model Sparse Attention" and sparse["category"] == "model/patch"
    assert sparse["input_order"]["required"] == [
        "model", "selection", "start_percent", "end_percent", "dense_blocks", "min_tokens", "extra_tokens",
        "sink_conditioning", "verbose"]
    required = sparse["input"]["required"]
    assert required["min_tokens"][1]["default"] == 12288 and required["extra_tokens"][1]["default"] == 256
    assert required["sink_conditioning"][1]["default"] == "exact_kv_and_rows"
    backend = info["ModelAttentionBackend"]
    assert backend["input_order"]["required"] == ["model", "attention"]
    assert backend["input"]["required"]["attention"][0] == ["pytorch attention", "comfy kitchen attention"]


def _patched_prompt(selection: dict, *, dense_blocks: str = "", backend: str = "comfy kitchen attention",
                    start: float = 0.0, min_tokens: int = 0) -> dict:
    prompt = t2va_prompt(steps=2, save_video=False)
    prompt["shift"] = {"class_type": "MiniMaxH3SigmaShift",
                       "inputs": {"model": ["unet", 0], "shift_video": 10.0, "shift_audio": 3.0}}
    prompt["backend"] = {"class_type": "ModelAttentionBackend", "inputs": {"model": ["shift", 0], "attention": backend}}
    prompt["sparse"] = {"class_type": "BlockSparseAttention", "inputs": {
        "model": ["backend", 0], **selection, "start_percent": start, "end_percent": 1.0,
        "dense_blocks": dense_blocks, "min_tokens": min_tokens, "extra_tokens": 256,
        "sink_conditioning": "exact_kv_and_rows", "verbose": False}}
    prompt["sched"]["inputs"]["model"] = ["sparse", 0]
    prompt["guider"]["inputs"]["model"] = ["sparse", 0]
    return prompt


VSA = {"selection": "vsa", "selection.keep_percent": 10.0}


def test_a_bad_block_list_is_refused_naming_the_input(h3):
    with pytest.raises(Exception) as failure:
        h3.validate(_patched_prompt(VSA, dense_blocks="0, 3-x"))
    text = str(getattr(failure.value, "node_errors", failure.value)) + str(failure.value)
    assert "dense_blocks" in text and "3-x" in text


def test_any_backend_name_validates_and_an_unknown_one_falls_back_to_pytorch(h3):
    h3.validate(_patched_prompt(VSA, backend="some other attention"))
    from nodes.loaders import _unet_loader
    (model,) = _unet_loader(h3_unet_name(), "default")
    (fallback,) = _attention_backend(model, "some other attention")
    assert fallback.options["attention_backend"] == "sdpa"
    with pytest.raises(TypeError, match="ModelAttentionBackend: input 'model'"):
        _attention_backend(object(), "pytorch attention")


@pytest.mark.parametrize("selection", [VSA, {"selection": "sla", "selection.keep_percent": 30.0},
                                       {"selection": "sol-attn", "selection.tau": 1.0}],
                         ids=["vsa", "sla", "sol-attn"])
def test_sparse_model_runs_and_differs_from_dense_only_while_active(h3, selection):
    dense = probe(h3.run(_patched_prompt(selection, min_tokens=1 << 20)), "probe_latent")
    sparse = probe(h3.run(_patched_prompt(selection)), "probe_latent")
    assert torch.isfinite(sparse["samples"]).all() and torch.isfinite(sparse["audio_samples"]).all()
    assert not torch.equal(sparse["samples"], dense["samples"])
    everything_dense = probe(h3.run(_patched_prompt(selection, dense_blocks="0-99")), "probe_latent")
    assert torch.equal(everything_dense["samples"], dense["samples"])


def test_settings_follow_the_inputs_and_the_shift(h3):
    from nodes.h3 import _sigma_shift
    from nodes.loaders import _unet_loader

    (model,) = _unet_loader(h3_unet_name(), "default")
    (shifted,) = _sigma_shift(model, 10.0, 3.0)
    (kitchen,) = _attention_backend(shifted, "comfy kitchen attention")
    (patched,) = _block_sparse_attention(kitchen, {"selection": "vsa", "keep_percent": 10.0}, 0.2, 1.0,
                                         "0, 1, 47-49", 12288, 256, "exact_kv_and_rows", False)
    settings = patched.options["sparse_attention"]
    assert isinstance(settings, SparseAttentionSettings)
    assert settings.method == "vsa" and settings.keep_ratio == pytest.approx(0.1)
    assert settings.sigma_start == pytest.approx(percent_to_sigma(0.2, 10.0)) and settings.sigma_end == 0.0
    assert settings.dense_blocks == {0, 1, 47, 48, 49}
    assert patched.options["attention_backend"] == "int8"
    assert patched.h3_shifts == (10.0, 3.0)
    assert "sparse_attention" not in model.options          # the loaded model is unchanged


def h3_unet_name() -> str:
    from tests.nodes.test_h3_nodes import TINY_NAMES
    return TINY_NAMES["transformer"][1]
