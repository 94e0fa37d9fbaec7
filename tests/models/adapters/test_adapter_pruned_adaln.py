"""Adapters trained on the full H3 DiT, applied to the pruned (curve-form AdaLN) DiT by projection.

The oracle: a full tiny DiT whose SiLU'd time embedding lies in an 8-dimensional affine subspace (its
time_embedder's last layer repeats 8 output rows), and the pruned DiT made from it by the pruning's rule
(table = the curve's coordinates, projections times basis.T, biases plus weight times mean), are the same
model wherever t falls on a table row. So a full-model adapter on the full DiT and the same file projected
onto the pruned DiT must give the same velocities, to float32 rounding.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from models.adapters import load_adapter
from models.h3 import transformer
from models.h3.make_tiny import build_tiny
from models.loading import load_model
from models.patcher import ModelHandle
from tests.models.adapters.helpers import rand, write_adapter

ROWS, CURVE = 1025, 8
SIGMAS = [(0.75, 0.5), (0.25, 0.125)]  # t = 1 - sigma on table rows (multiples of 1 / 1024)


def _full_model() -> transformer.H3Transformer:
    """The tiny DiT with time_embedder.proj_out's rows repeating every CURVE rows (so its curve is 8-dimensional)."""
    model = build_tiny("transformer").float()
    out = model.time_embedder.proj_out
    with torch.no_grad():
        out.weight.copy_(out.weight[:CURVE].repeat(out.weight.shape[0] // CURVE, 1))
        out.bias.copy_(out.bias[:CURVE].repeat(out.bias.shape[0] // CURVE))
    return model


def _pruning(full: transformer.H3Transformer):
    """(pruned state dict, basis (CURVE, wide), mean (wide,)) of `full`, by the pruning's rule."""
    wide = full.config.time_embed_dim
    gen = torch.Generator().manual_seed(7)
    place = torch.zeros(CURVE, wide, dtype=torch.float64)  # P: a curve coordinate feeds every repeat of its row
    place[torch.arange(wide) % CURVE, torch.arange(wide)] = 1.0
    mix = torch.linalg.qr(torch.randn(CURVE, CURVE, generator=gen, dtype=torch.float64))[0]  # Q, invertible
    mean8 = torch.randn(CURVE, generator=gen, dtype=torch.float64)
    basis, mean = mix @ place, mean8 @ place  # wide(t) = mean + curve(t) @ basis
    grid = torch.linspace(0.0, 1.0, ROWS, dtype=torch.float64).float()
    with torch.no_grad():
        dense = F.silu(full.time_embedder(grid).double())
    table = (dense[:, :CURVE] - mean8) @ mix.T  # Q orthogonal: inverse = transpose
    state = {k: v.detach().clone() for k, v in full.state_dict().items() if not k.startswith("time_embedder.")}
    for name in full.adaln_modules():
        weight, bias = state[f"{name}.weight"].double(), state[f"{name}.bias"].double()
        state[f"{name}.weight"] = (weight @ basis.T).float()
        state[f"{name}.bias"] = (bias + weight @ mean).float()
    state["adaln_t_table"] = table.float()
    return {k: v.contiguous() for k, v in state.items()}, basis.float(), mean.float()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(full model, pruned model loaded from a file whose affine sits in a side file, pruned file path)."""
    folder = tmp_path_factory.mktemp("pruned")
    full = _full_model()
    state, basis, mean = _pruning(full)
    path = folder / "tiny_pruned.safetensors"
    save_file(state, str(path))
    save_file({"adaln_basis": basis, "adaln_mean": mean, "adaln_t_table": state["adaln_t_table"]},
              str(folder / "tiny_pruned.adaln_affine.safetensors"))
    pruned = load_model(path).model.float()
    return full, pruned, path


def _inputs(seed: int = 3):
    gen = torch.Generator().manual_seed(seed)
    cfg = transformer.TINY_CONFIG
    return (torch.randn(1, cfg.video_channels, 2, 4, 6, generator=gen), torch.randn(1, cfg.audio_channels, 2, 5, generator=gen),
            torch.randn(1, 7, cfg.text_dim, generator=gen))


def _full_model_adapter(tmp_path, full: transformer.H3Transformer):
    """A kohya-named file with LoRA entries on every AdaLN projection, a LoKr on one, and LoRAs on block linears."""
    tensors = {}
    for seed, name in enumerate(full.adaln_modules()):
        linear = full.get_submodule(name)
        key = "lora_unet_" + name.replace(".", "_")
        if name == "blocks.1.adaln_proj.linear":
            tensors[f"{key}.lokr_w1"] = rand(2, 4, seed=40) * 0.3
            tensors[f"{key}.lokr_w2_a"] = rand(linear.out_features // 2, 3, seed=41) * 0.3
            tensors[f"{key}.lokr_w2_b"] = rand(3, linear.in_features // 4, seed=42) * 0.3
            tensors[f"{key}.alpha"] = torch.tensor(1.5)
            continue
        tensors[f"{key}.lora_up.weight"] = rand(linear.out_features, 4, seed=2 * seed) * 0.2
        tensors[f"{key}.lora_down.weight"] = rand(4, linear.in_features, seed=2 * seed + 1) * 0.2
        tensors[f"{key}.alpha"] = torch.tensor(2.0)
    qkv = full.blocks[0].attn.qkv_proj
    tensors["lora_unet_blocks_0_attn_qkv_proj.lora_up.weight"] = rand(qkv.out_features, 4, seed=50) * 0.1
    tensors["lora_unet_blocks_0_attn_qkv_proj.lora_down.weight"] = rand(4, qkv.in_features, seed=51) * 0.1
    return write_adapter(tmp_path / "full_model_lora.safetensors", tensors)


def test_the_pruned_model_equals_the_full_one_on_the_grid(models):
    full, pruned, _ = models
    assert pruned.config.time_embed_dim == CURVE and full.config.time_embed_dim != CURVE
    inputs = _inputs()
    with torch.no_grad():
        for sigmas in SIGMAS:
            for a, b in zip(full(*inputs, *sigmas), pruned(*inputs, *sigmas)):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("merge", [False, True])
def test_a_full_model_adapter_projected_onto_the_pruned_model_gives_the_same_velocities(models, tmp_path, merge):
    full, pruned, _ = models
    adapter = load_adapter(_full_model_adapter(tmp_path, full))
    on_full = ModelHandle(full).with_adapter(adapter, 0.8)
    on_pruned = ModelHandle(pruned).with_adapter(adapter, 0.8)
    projected = sorted({key for applied in on_pruned.applied for key in applied.projected})
    assert projected == sorted("lora_unet_" + n.replace(".", "_") for n in full.adaln_modules())
    assert not on_full.applied[0].projected
    if merge:
        on_full, on_pruned = on_full.merged(), on_pruned.merged()
    inputs = _inputs()
    with torch.no_grad():
        for sigmas in SIGMAS:
            plain = full(*inputs, *sigmas)
            for a, b, c in zip(on_full(*inputs, *sigmas), on_pruned(*inputs, *sigmas), plain):
                torch.testing.assert_close(a, b, rtol=0, atol=2e-5)
                assert (a - c).abs().max() > 1e-3  # the adapter changes the output


def test_an_adapter_made_for_the_pruned_model_applies_unchanged(models, tmp_path):
    _, pruned, _ = models
    linear = pruned.blocks[0].adaln_proj.linear
    up, down = rand(linear.out_features, 2, seed=1), rand(2, CURVE, seed=2)
    file = write_adapter(tmp_path / "pruned_lora.safetensors", {
        "diffusion_model.blocks.0.adaln_proj.linear.lora_B.weight": up,
        "diffusion_model.blocks.0.adaln_proj.linear.lora_A.weight": down})
    handle = ModelHandle(pruned).with_adapter(load_adapter(file), 1.0)
    assert not handle.applied[0].projected
    merged = handle.merged().model
    torch.testing.assert_close(merged.blocks[0].adaln_proj.linear.weight, linear.weight + up @ down)
    torch.testing.assert_close(merged.blocks[0].adaln_proj.linear.bias, linear.bias)


def test_without_the_affine_the_wide_entries_are_refused_by_name(models, tmp_path):
    full, _, path = models
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / path.name).write_bytes(path.read_bytes())
    pruned = load_model(bare / path.name).model
    file = _full_model_adapter(tmp_path, full)
    with pytest.raises(ValueError) as raised:
        ModelHandle(pruned).with_adapter(load_adapter(file), 1.0)
    message = str(raised.value)
    assert "lora_unet_blocks_0_adaln_proj_linear" in message and "lora_unet_final_layer_adaln_proj_linear" in message
    assert "adaln_basis" in message and "tiny_pruned.adaln_affine.safetensors" in message
    assert "nothing was applied" in message


def test_a_side_file_made_for_another_pruning_is_not_used(models, tmp_path):
    full, _, path = models
    folder = tmp_path / "other"
    folder.mkdir()
    (folder / path.name).write_bytes(path.read_bytes())
    state, basis, mean = _pruning(full)
    save_file({"adaln_basis": basis, "adaln_mean": mean, "adaln_t_table": state["adaln_t_table"] + 1.0},
              str(folder / "adaln_affine.safetensors"))
    pruned = load_model(folder / path.name).model
    with pytest.raises(ValueError, match="another pruning"):
        ModelHandle(pruned).with_adapter(load_adapter(_full_model_adapter(tmp_path, full)), 1.0)


def test_the_affine_inside_the_checkpoint_is_read(models, tmp_path):
    full, _, _ = models
    state, basis, mean = _pruning(full)
    path = tmp_path / "with_affine.safetensors"
    save_file({**state, "adaln_basis": basis, "adaln_mean": mean}, str(path))
    pruned = load_model(path).model
    assert pruned.adaln_affine.source == path.name
    torch.testing.assert_close(pruned.adaln_affine.basis, basis)
    handle = ModelHandle(pruned).with_adapter(load_adapter(_full_model_adapter(tmp_path, full)), 1.0)
    assert len(handle.applied[0].projected) == len(full.adaln_modules())


def test_the_full_model_itself_has_no_affines():
    assert dataclasses.replace(transformer.TINY_CONFIG).adaln_curve_points is None
    assert transformer.H3Transformer(transformer.TINY_CONFIG).adapter_input_affines() == {}
