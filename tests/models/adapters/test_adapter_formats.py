"""Every community LoRA naming scheme, written by the test, lands on the right weights of a tiny H3 model.

For each format the merged weights must equal base + strength * scale * (up @ down) computed here
(row blocks for diffusers' separate q/k/v, exchanged halves for diffusers' SwiGLU projection), the
on-the-fly forward must equal the merged forward, and the base model must be unchanged.
"""
from __future__ import annotations

import pytest
import torch

from models.adapters import load_adapter
from models.patcher import ModelHandle
from tests.models.adapters.helpers import (HEAD_DIM, HEADS, HIDDEN, INNER, assert_unchanged, param, rand, snapshot, tiny_h3,
                                           tiny_inputs, write_adapter)

# (our module, our path as the adapter names it, the diffusers name, row block or None, swap halves)
TARGETS = [
    ("blocks.0.attn.qkv_proj", "blocks.0.attn.qkv_proj", "transformer_blocks.0.attn.to_q", (0, INNER), False),
    ("blocks.0.attn.out_proj", "blocks.0.attn.out_proj", "transformer_blocks.0.attn.to_out.0", None, False),
    ("blocks.1.mlp.fc1", "blocks.1.mlp.fc1", "transformer_blocks.1.ff.net.0.proj", None, True),
    ("blocks.1.mlp.fc2", "blocks.1.mlp.fc2", "transformer_blocks.1.ff.net.2", None, False),
    ("token_refiner.blocks.0.attn.qkv_proj", "token_refiner.blocks.0.attn.qkv_proj",
     "token_refiner.refiner_blocks.0.attn.to_v", (2 * INNER, 3 * INNER), False),
    ("video_patch_proj", "video_patch_proj", "proj_in", None, False),
    ("final_layer.audio_out", "final_layer.audio_out", "audio_proj_out", None, False),
    ("time_embedder.proj_in", "time_embedder.proj_in", "time_embedder.linear_1", None, False),
    ("blocks.1.adaln_proj.linear", "blocks.1.adaln_proj.linear", "transformer_blocks.1.adaln_proj.linear", None, False),
]


def _dotted(prefix, up, down):
    return lambda path: (f"{prefix}{path}{up}", f"{prefix}{path}{down}", f"{prefix}{path}.alpha")


def _underscored(prefix, up=".lora_up.weight", down=".lora_down.weight"):
    def names(path):
        base = prefix + path.replace(".", "_")
        return f"{base}{up}", f"{base}{down}", f"{base}.alpha"
    return names


# name -> (key names for a module path, uses diffusers module names, stores alpha, detected format)
FORMATS = {
    "kohya": (_underscored("lora_unet_"), False, True, "kohya"),
    "kohya_diffusers_names": (_underscored("lora_unet_"), True, True, "kohya"),
    "peft": (_dotted("base_model.model.", ".lora_B.weight", ".lora_A.weight"), False, False, "peft"),
    "peft_default": (_dotted("", ".lora_B.default.weight", ".lora_A.default.weight"), False, False, "peft"),
    "diffusers_lora_up": (_dotted("transformer.", ".lora.up.weight", ".lora.down.weight"), True, False, "diffusers"),
    "diffusers_linear_layer": (_dotted("transformer.", ".lora_linear_layer.up.weight",
                                       ".lora_linear_layer.down.weight"), True, True, "diffusers"),
    "diffusers_peft": (_dotted("transformer.", ".lora_B.weight", ".lora_A.weight"), True, False, "diffusers"),
    "comfyui": (_dotted("diffusion_model.", ".lora_B.weight", ".lora_A.weight"), False, True, "comfyui"),
    "bare": (_dotted("", ".lora_up.weight", ".lora_down.weight"), False, True, "comfyui"),
    "lycoris": (_underscored("lycoris_"), False, True, "lycoris"),
}


def expected_delta(up: torch.Tensor, down: torch.Tensor, swap: bool) -> torch.Tensor:
    """up @ down, element by element with einsum, rows exchanged for diffusers' [value; gate] order."""
    delta = torch.einsum("or,ri->oi", up.double(), down.double()).float()
    if swap:
        half = delta.shape[0] // 2
        delta = torch.cat([delta[half:], delta[:half]])
    return delta


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_format_maps_onto_the_right_weights(tmp_path, fmt):
    names, diffusers_names, with_alpha, detected = FORMATS[fmt]
    model = tiny_h3()
    before = snapshot(model)
    tensors, expected = {}, {}
    strength, rank, alpha = 0.75, 4, 2.0
    for seed, (module, path, diffusers_path, rows, swap) in enumerate(TARGETS):
        use_rows = rows if diffusers_names else None
        use_swap = swap and diffusers_names
        weight = param(model, module + ".weight")
        out_dim = (use_rows[1] - use_rows[0]) if use_rows else weight.shape[0]
        up, down = rand(out_dim, rank, seed=2 * seed), rand(rank, weight.shape[1], seed=2 * seed + 1)
        up_key, down_key, alpha_key = names(diffusers_path if diffusers_names else path)
        tensors[up_key], tensors[down_key] = up, down
        if with_alpha:
            tensors[alpha_key] = torch.tensor(alpha)
        scale = alpha / rank if with_alpha else 1.0
        delta = torch.zeros_like(weight)
        block = expected_delta(up, down, use_swap)
        if fmt == "peft_default" and module.endswith("qkv_proj"):
            # PEFT's `.default.` over the original names is DiffSynth-Studio's: its qkv rows go head by head.
            block = block.view(HEADS, 3, HEAD_DIM, -1).transpose(0, 1).reshape(block.shape)
        if use_rows:
            delta[use_rows[0]:use_rows[1]] = block
        else:
            delta = block
        expected[module] = weight.detach() + strength * scale * delta
    file = write_adapter(tmp_path / f"{fmt}.safetensors", tensors)

    adapter = load_adapter(file)
    assert adapter.format == detected
    handle = ModelHandle(model, name="tiny").with_adapter(adapter, strength)
    merged = handle.merged()
    merged_params = dict(merged.model.named_parameters())
    for module, want in expected.items():
        torch.testing.assert_close(merged_params[module + ".weight"], want, rtol=1e-5, atol=1e-5)
    # Modules the adapter does not name are shared with the base, not copied.
    assert merged.model.blocks[0].mlp is model.blocks[0].mlp
    assert merged.model.final_layer.video_out is model.final_layer.video_out

    inputs = tiny_inputs()
    on_the_fly = handle(*inputs)
    merged_out = merged(*inputs)
    base_out = model(*inputs)
    for a, b, c in zip(on_the_fly, merged_out, base_out):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        assert (a - c).abs().max() > 1e-3  # the adapter changes the output
    assert_unchanged(model, before)


def test_split_qkv_lora_equals_the_fused_lora_it_is_equivalent_to(tmp_path):
    """to_q/to_k/to_v LoRAs apply to their row blocks: the same as one fused LoRA with block-diagonal up."""
    model = tiny_h3()
    rank = 3
    ups = [rand(INNER, rank, seed=10 + i) for i in range(3)]
    downs = [rand(rank, HIDDEN, seed=20 + i) for i in range(3)]
    split = {}
    for name, up, down in zip(("to_q", "to_k", "to_v"), ups, downs):
        split[f"transformer.transformer_blocks.0.attn.{name}.lora_B.weight"] = up
        split[f"transformer.transformer_blocks.0.attn.{name}.lora_A.weight"] = down
        split[f"transformer.transformer_blocks.0.attn.{name}.alpha"] = torch.tensor(1.5)
    fused_up = torch.block_diag(*ups)  # (3 * INNER, 3 * rank)
    fused_down = torch.cat(downs)  # (3 * rank, HIDDEN)
    fused = {"diffusion_model.blocks.0.attn.qkv_proj.lora_B.weight": fused_up,
             "diffusion_model.blocks.0.attn.qkv_proj.lora_A.weight": fused_down,
             # alpha times 3 keeps alpha / rank: the converter's rule for the real turbo adapter
             "diffusion_model.blocks.0.attn.qkv_proj.alpha": torch.tensor(4.5)}
    split_handle = ModelHandle(model).with_adapter(load_adapter(write_adapter(tmp_path / "s.safetensors", split)), 1.0)
    fused_handle = ModelHandle(model).with_adapter(load_adapter(write_adapter(tmp_path / "f.safetensors", fused)), 1.0)
    a = dict(split_handle.merged().model.named_parameters())["blocks.0.attn.qkv_proj.weight"]
    b = dict(fused_handle.merged().model.named_parameters())["blocks.0.attn.qkv_proj.weight"]
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_alpha_absent_means_scale_one(tmp_path):
    model = tiny_h3()
    up, down = rand(HIDDEN, 2, seed=1), rand(2, INNER, seed=2)
    file = write_adapter(tmp_path / "noalpha.safetensors", {
        "lora_unet_blocks_0_attn_out_proj.lora_up.weight": up,
        "lora_unet_blocks_0_attn_out_proj.lora_down.weight": down})
    merged = ModelHandle(model).with_adapter(load_adapter(file), 0.5).merged()
    torch.testing.assert_close(merged.model.blocks[0].attn.out_proj.weight,
                               model.blocks[0].attn.out_proj.weight + 0.5 * expected_delta(up, down, False))


def test_text_encoder_keys_go_to_the_text_encoder_handle_only(tmp_path):
    """lora_te_ keys map onto any module tree's names; the model handle ignores them and the reverse."""
    from models import ops

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.self_attn = torch.nn.Module()
            self.self_attn.q_proj = ops.Linear(8, 8)

    class TextEncoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = torch.nn.Module()
            self.encoder.layers = torch.nn.ModuleList([Layer(), Layer()])

    torch.manual_seed(0)
    te, model = TextEncoder(), tiny_h3()
    te_before, model_before = snapshot(te), snapshot(model)
    up, down = rand(8, 2, seed=3), rand(2, 8, seed=4)
    mup, mdown = rand(HIDDEN, 2, seed=5), rand(2, INNER, seed=6)
    up0, down0 = rand(8, 3, seed=7), rand(3, 8, seed=8)
    file = write_adapter(tmp_path / "both.safetensors", {
        # HF CLIP-style path under a `text_model` wrapper the module tree does not have
        "lora_te_text_model_encoder_layers_1_self_attn_q_proj.lora_up.weight": up,
        "lora_te_text_model_encoder_layers_1_self_attn_q_proj.lora_down.weight": down,
        # ComfyUI's dotted text-encoder naming, `text_encoders.<name>.` then a `transformer.` wrapper
        "text_encoders.minimax.transformer.encoder.layers.0.self_attn.q_proj.lora_B.weight": up0,
        "text_encoders.minimax.transformer.encoder.layers.0.self_attn.q_proj.lora_A.weight": down0,
        "lora_unet_blocks_1_attn_out_proj.lora_up.weight": mup,
        "lora_unet_blocks_1_attn_out_proj.lora_down.weight": mdown})
    adapter = load_adapter(file)
    assert adapter.components == {"model", "text_encoder"}

    te_handle = ModelHandle(te, component="text_encoder").with_adapter(adapter, 2.0)
    model_handle = ModelHandle(model).with_adapter(adapter, 1.0)
    te_merged = te_handle.merged().model
    torch.testing.assert_close(te_merged.encoder.layers[1].self_attn.q_proj.weight,
                               te.encoder.layers[1].self_attn.q_proj.weight + 2.0 * expected_delta(up, down, False))
    torch.testing.assert_close(te_merged.encoder.layers[0].self_attn.q_proj.weight,
                               te.encoder.layers[0].self_attn.q_proj.weight + 2.0 * expected_delta(up0, down0, False))
    assert te_merged.encoder.layers[0].self_attn.q_proj.bias is te.encoder.layers[0].self_attn.q_proj.bias
    model_merged = model_handle.merged().model
    torch.testing.assert_close(model_merged.blocks[1].attn.out_proj.weight,
                               model.blocks[1].attn.out_proj.weight + expected_delta(mup, mdown, False))
    assert [m for m, _ in model_handle.adapters] == [str(file)]

    te_only = write_adapter(tmp_path / "te_only.safetensors", {
        "lora_te_text_model_encoder_layers_1_self_attn_q_proj.lora_up.weight": up,
        "lora_te_text_model_encoder_layers_1_self_attn_q_proj.lora_down.weight": down})
    plain = ModelHandle(model)
    assert plain.with_adapter(load_adapter(te_only), 1.0) is plain  # nothing for the model: same handle
    assert_unchanged(te, te_before)
    assert_unchanged(model, model_before)
