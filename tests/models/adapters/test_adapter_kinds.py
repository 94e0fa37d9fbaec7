"""The math of each adapter kind against references computed here with loops: LoKr (whole, low-rank,
Tucker; alpha only with a low-rank factor), LoHa (plain and Tucker), DoRA on both axes, full deltas,
convolution LoRA with and without a Tucker mid, and LoKr on split q/k/v row blocks."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from models import ops
from models.adapters import load_adapter
from models.patcher import ModelHandle
from tests.models.adapters.helpers import (HIDDEN, INNER, assert_unchanged, param, rand, snapshot, tiny_h3,
                                           tiny_inputs, write_adapter)


def kron_reference(w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """kron(w1, w2) block by block: block (p, q) is w1[p, q] * w2."""
    a, c = w1.shape
    b, d = w2.shape[:2]
    out = torch.zeros(a * b, c * d, *w2.shape[2:])
    for p in range(a):
        for q in range(c):
            out[p * b:(p + 1) * b, q * d:(q + 1) * d] = w1[p, q] * w2
    return out


def tucker_reference(t: torch.Tensor, wa: torch.Tensor, wb: torch.Tensor) -> torch.Tensor:
    """w[p, q, ...] = sum_ij t[i, j, ...] * wa[i, p] * wb[j, q], by loops over i and j."""
    out = torch.zeros(wa.shape[1], wb.shape[1], *t.shape[2:])
    for i in range(t.shape[0]):
        for j in range(t.shape[1]):
            out += t[i, j][None, None] * (wa[i][:, None] * wb[j][None, :]).reshape(
                wa.shape[1], wb.shape[1], *[1] * (t.dim() - 2))
    return out


def merged_param(model, file, strength, name, component="model"):
    handle = ModelHandle(model, component=component).with_adapter(load_adapter(file), strength)
    return dict(handle.merged().model.named_parameters())[name], handle


def check_forward_equal(model, handle):
    inputs = tiny_inputs()
    for a, b in zip(handle(*inputs), handle.merged()(*inputs)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_lokr_whole_factors_ignore_a_placeholder_alpha(tmp_path):
    model = tiny_h3()
    before = snapshot(model)
    w1, w2 = rand(4, 4, seed=1), rand(3 * INNER // 4, HIDDEN // 4, seed=2)  # kron -> (144, 32) = fused qkv
    file = write_adapter(tmp_path / "lokr.safetensors", {
        "lycoris_blocks_0_attn_qkv_proj.lokr_w1": w1, "lycoris_blocks_0_attn_qkv_proj.lokr_w2": w2,
        "lycoris_blocks_0_attn_qkv_proj.alpha": torch.tensor(1e10)})
    got, handle = merged_param(model, file, 0.5, "blocks.0.attn.qkv_proj.weight")
    torch.testing.assert_close(got, model.blocks[0].attn.qkv_proj.weight + 0.5 * kron_reference(w1, w2))
    check_forward_equal(model, handle)
    assert_unchanged(model, before)


def test_lokr_low_rank_factors_use_alpha_over_rank(tmp_path):
    model = tiny_h3()
    w1_a, w1_b = rand(4, 2, seed=1), rand(2, 4, seed=2)
    w2 = rand(HIDDEN // 4, INNER // 4, seed=3)  # kron -> (32, 48) = out_proj
    file = write_adapter(tmp_path / "lokr1.safetensors", {
        "lora_unet_blocks_1_attn_out_proj.lokr_w1_a": w1_a, "lora_unet_blocks_1_attn_out_proj.lokr_w1_b": w1_b,
        "lora_unet_blocks_1_attn_out_proj.lokr_w2": w2, "lora_unet_blocks_1_attn_out_proj.alpha": torch.tensor(3.0)})
    got, _ = merged_param(model, file, 1.0, "blocks.1.attn.out_proj.weight")
    torch.testing.assert_close(got, model.blocks[1].attn.out_proj.weight + 1.5 * kron_reference(w1_a @ w1_b, w2))

    w1 = rand(2, 4, seed=4)
    w2_a, w2_b = rand(HIDDEN // 2, 3, seed=5), rand(3, INNER // 4, seed=6)
    file = write_adapter(tmp_path / "lokr2.safetensors", {
        "lora_unet_blocks_1_attn_out_proj.lokr_w1": w1, "lora_unet_blocks_1_attn_out_proj.lokr_w2_a": w2_a,
        "lora_unet_blocks_1_attn_out_proj.lokr_w2_b": w2_b, "lora_unet_blocks_1_attn_out_proj.alpha": torch.tensor(1.0)})
    got, _ = merged_param(model, file, 1.0, "blocks.1.attn.out_proj.weight")
    torch.testing.assert_close(got, model.blocks[1].attn.out_proj.weight + kron_reference(w1, w2_a @ w2_b) / 3)


def test_lokr_for_split_qkv_applies_to_each_row_block_when_it_fits(tmp_path):
    model = tiny_h3()
    factors = {name: (rand(4, 4, seed=10 + i), rand(INNER // 4, HIDDEN // 4, seed=20 + i))
               for i, name in enumerate(("to_q", "to_k", "to_v"))}
    tensors = {}
    for name, (w1, w2) in factors.items():
        tensors[f"lycoris_transformer_blocks_1_attn_{name}.lokr_w1"] = w1
        tensors[f"lycoris_transformer_blocks_1_attn_{name}.lokr_w2"] = w2
    got, _ = merged_param(model, write_adapter(tmp_path / "split.safetensors", tensors), 1.0,
                          "blocks.1.attn.qkv_proj.weight")
    want = model.blocks[1].attn.qkv_proj.weight.detach().clone()
    for i, (w1, w2) in enumerate(factors.values()):
        want[i * INNER:(i + 1) * INNER] += kron_reference(w1, w2)
    torch.testing.assert_close(got, want)


def test_loha_plain(tmp_path):
    model = tiny_h3()
    w1a, w1b, w2a, w2b = rand(HIDDEN, 2, seed=1), rand(2, INNER, seed=2), rand(HIDDEN, 2, seed=3), rand(2, INNER, seed=4)
    file = write_adapter(tmp_path / "loha.safetensors", {
        "lycoris_blocks_0_attn_out_proj.hada_w1_a": w1a, "lycoris_blocks_0_attn_out_proj.hada_w1_b": w1b,
        "lycoris_blocks_0_attn_out_proj.hada_w2_a": w2a, "lycoris_blocks_0_attn_out_proj.hada_w2_b": w2b,
        "lycoris_blocks_0_attn_out_proj.alpha": torch.tensor(4.0)})
    got, handle = merged_param(model, file, 0.25, "blocks.0.attn.out_proj.weight")
    hadamard = torch.einsum("or,ri->oi", w1a, w1b) * torch.einsum("or,ri->oi", w2a, w2b)
    torch.testing.assert_close(got, model.blocks[0].attn.out_proj.weight + 0.25 * 2.0 * hadamard)
    check_forward_equal(model, handle)


def test_full_diff_and_diff_b(tmp_path):
    model = tiny_h3()
    diff, diff_b = rand(96, HIDDEN, seed=1), rand(96, seed=2)
    file = write_adapter(tmp_path / "full.safetensors", {
        "diffusion_model.final_layer.video_out.diff": diff, "diffusion_model.final_layer.video_out.diff_b": diff_b,
        "diffusion_model.final_layer.video_out.alpha": torch.tensor(99.0)})  # ignored for full deltas
    handle = ModelHandle(model).with_adapter(load_adapter(file), 0.3)
    merged = handle.merged().model.final_layer.video_out
    torch.testing.assert_close(merged.weight, model.final_layer.video_out.weight + 0.3 * diff)
    torch.testing.assert_close(merged.bias, model.final_layer.video_out.bias + 0.3 * diff_b)
    check_forward_equal(model, handle)


def dora_reference(weight, delta, magnitude, axis, strength):
    patched = weight + delta
    dim = 1 if axis == "out" else 0
    norm = torch.linalg.vector_norm(patched, dim=dim, keepdim=True)
    return weight + strength * (magnitude.reshape(norm.shape) * patched / norm - weight)


def test_dora_kohya_column_magnitude_and_peft_row_magnitude(tmp_path):
    model = tiny_h3()
    before = snapshot(model)
    up, down = rand(HIDDEN, 2, seed=1), rand(2, 40, seed=2)
    magnitude_in = rand(1, 40, seed=3).abs() + 0.5
    kohya = write_adapter(tmp_path / "dora_kohya.safetensors", {
        "lora_unet_blocks_0_mlp_fc2.lora_up.weight": up, "lora_unet_blocks_0_mlp_fc2.lora_down.weight": down,
        "lora_unet_blocks_0_mlp_fc2.alpha": torch.tensor(1.0), "lora_unet_blocks_0_mlp_fc2.dora_scale": magnitude_in})
    got, handle = merged_param(model, kohya, 0.6, "blocks.0.mlp.fc2.weight")
    want = dora_reference(model.blocks[0].mlp.fc2.weight.detach(), 0.5 * up @ down, magnitude_in, "in", 0.6)
    torch.testing.assert_close(got, want)
    check_forward_equal(model, handle)

    magnitude_out = rand(HIDDEN, seed=4).abs() + 0.5
    peft = write_adapter(tmp_path / "dora_peft.safetensors", {
        "base_model.model.blocks.0.mlp.fc2.lora_B.weight": up, "base_model.model.blocks.0.mlp.fc2.lora_A.weight": down,
        "base_model.model.blocks.0.mlp.fc2.lora_magnitude_vector": magnitude_out})
    got, _ = merged_param(model, peft, 1.0, "blocks.0.mlp.fc2.weight")
    want = dora_reference(model.blocks[0].mlp.fc2.weight.detach(), up @ down, magnitude_out, "out", 1.0)
    torch.testing.assert_close(got, want)
    assert_unchanged(model, before)


def test_dora_on_diffusers_swiglu_rows_follows_the_row_exchange(tmp_path):
    """A row magnitude given in diffusers' [value; gate] order lands on our [gate; value] rows."""
    model = tiny_h3()
    up, down = rand(80, 2, seed=1), rand(2, HIDDEN, seed=2)
    magnitude = rand(80, seed=3).abs() + 0.5
    file = write_adapter(tmp_path / "dora_ff.safetensors", {
        "transformer.transformer_blocks.0.ff.net.0.proj.lora_B.weight": up,
        "transformer.transformer_blocks.0.ff.net.0.proj.lora_A.weight": down,
        "transformer.transformer_blocks.0.ff.net.0.proj.lora_magnitude_vector": magnitude})
    got, _ = merged_param(model, file, 1.0, "blocks.0.mlp.fc1.weight")

    def swap(t):
        return torch.cat([t[40:], t[:40]])

    theirs = swap(model.blocks[0].mlp.fc1.weight.detach())  # the base in diffusers' row order
    torch.testing.assert_close(got, swap(dora_reference(theirs, up @ down, magnitude, "out", 1.0)))


class ConvNet(nn.Module):
    """A 3x3x3 convolution, a pointwise one and a 1-D one, all taking weights through the memory manager."""

    def __init__(self):
        super().__init__()
        self.conv = ops.Conv3d(4, 6, 3, padding=1)
        self.pointwise = ops.Conv3d(6, 8, 1)
        self.conv1d = ops.Conv1d(4, 6, 3, padding=1)

    def forward(self, x, y):
        return self.pointwise(self.conv(x)), self.conv1d(y)


def conv_net():
    torch.manual_seed(3)
    return ConvNet()


def conv_inputs():
    gen = torch.Generator().manual_seed(5)
    return torch.randn(1, 4, 3, 5, 5, generator=gen), torch.randn(1, 4, 9, generator=gen)


def test_conv_lora_plain_and_with_tucker_mid_and_linear_lora_on_pointwise_conv(tmp_path):
    net = conv_net()
    before = snapshot(net)
    up, down = rand(6, 2, 1, 1, 1, seed=1), rand(2, 4, 3, 3, 3, seed=2)
    up_m, mid, down_m = rand(6, 2, 1, 1, 1, seed=3), rand(2, 2, 3, 3, 3, seed=4), rand(2, 4, 1, 1, 1, seed=5)
    up1, down1 = rand(6, 3, 1, seed=6), rand(3, 4, 3, seed=7)
    up_p, down_p = rand(8, 2, seed=8), rand(2, 6, seed=9)
    plain = write_adapter(tmp_path / "conv.safetensors", {
        "lora_unet_conv.lora_up.weight": up, "lora_unet_conv.lora_down.weight": down,
        "lora_unet_conv.alpha": torch.tensor(1.0),
        "lora_unet_conv1d.lora_up.weight": up1, "lora_unet_conv1d.lora_down.weight": down1,
        "lora_unet_pointwise.lora_up.weight": up_p, "lora_unet_pointwise.lora_down.weight": down_p})
    tucker = write_adapter(tmp_path / "locon_tucker.safetensors", {
        "lora_unet_conv.lora_up.weight": up_m, "lora_unet_conv.lora_mid.weight": mid,
        "lora_unet_conv.lora_down.weight": down_m, "lora_unet_conv.alpha": torch.tensor(4.0)})

    handle = ModelHandle(net).with_adapter(load_adapter(plain), 1.0)
    merged = handle.merged().model
    want = torch.zeros(6, 4, 3, 3, 3)
    for r in range(2):
        want += up[:, r].reshape(6, 1, 1, 1, 1) * down[r][None]
    torch.testing.assert_close(merged.conv.weight, net.conv.weight + 0.5 * want)
    want1 = torch.zeros(6, 4, 3)
    for r in range(3):
        want1 += up1[:, r].reshape(6, 1, 1) * down1[r][None]
    torch.testing.assert_close(merged.conv1d.weight, net.conv1d.weight + want1)
    torch.testing.assert_close(merged.pointwise.weight, net.pointwise.weight + (up_p @ down_p).reshape(8, 6, 1, 1, 1))
    for a, b in zip(handle(*conv_inputs()), handle.merged()(*conv_inputs())):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)

    handle = ModelHandle(net).with_adapter(load_adapter(tucker), 1.0)
    want = torch.zeros(6, 4, 3, 3, 3)
    for a in range(2):
        for b in range(2):
            want += up_m[:, a].reshape(6, 1, 1, 1, 1) * mid[a, b][None, None] * down_m[b, :, 0, 0, 0].reshape(1, 4, 1, 1, 1)
    torch.testing.assert_close(handle.merged().model.conv.weight, net.conv.weight + 2.0 * want)
    assert_unchanged(net, before)


def test_lokr_and_loha_tucker_on_a_convolution(tmp_path):
    net = conv_net()
    w1 = rand(2, 2, seed=1)
    t2, w2_a, w2_b = rand(2, 2, 3, 3, 3, seed=2), rand(2, 3, seed=3), rand(2, 2, seed=4)
    lokr = write_adapter(tmp_path / "lokr_tucker.safetensors", {
        "lycoris_conv.lokr_w1": w1, "lycoris_conv.lokr_t2": t2, "lycoris_conv.lokr_w2_a": w2_a,
        "lycoris_conv.lokr_w2_b": w2_b, "lycoris_conv.alpha": torch.tensor(1.0)})
    handle = ModelHandle(net).with_adapter(load_adapter(lokr), 1.0)
    w2 = tucker_reference(t2, w2_a, w2_b)  # (3, 2, 3, 3, 3)
    want = torch.zeros(6, 4, 3, 3, 3)
    for p in range(2):
        for q in range(2):
            want[p * 3:(p + 1) * 3, q * 2:(q + 1) * 2] = w1[p, q] * w2
    torch.testing.assert_close(handle.merged().model.conv.weight, net.conv.weight + 0.5 * want)
    for a, b in zip(handle(*conv_inputs()), handle.merged()(*conv_inputs())):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)

    t1, w1a, w1b = rand(2, 2, 3, 3, 3, seed=5), rand(2, 6, seed=6), rand(2, 4, seed=7)
    t2, w2a, w2b = rand(2, 2, 3, 3, 3, seed=8), rand(2, 6, seed=9), rand(2, 4, seed=10)
    loha = write_adapter(tmp_path / "loha_tucker.safetensors", {
        "lycoris_conv.hada_t1": t1, "lycoris_conv.hada_w1_a": w1a, "lycoris_conv.hada_w1_b": w1b,
        "lycoris_conv.hada_t2": t2, "lycoris_conv.hada_w2_a": w2a, "lycoris_conv.hada_w2_b": w2b})
    handle = ModelHandle(net).with_adapter(load_adapter(loha), 1.0)
    want = tucker_reference(t1, w1a, w1b) * tucker_reference(t2, w2a, w2b)
    torch.testing.assert_close(handle.merged().model.conv.weight, net.conv.weight + want, rtol=1e-5, atol=1e-5)


def test_bf16_base_is_patched_in_float32_and_rounded_once(tmp_path):
    model = tiny_h3().to(torch.bfloat16)
    up, down = rand(HIDDEN, 2, seed=1) * 1e-2, rand(2, INNER, seed=2)
    file = write_adapter(tmp_path / "small.safetensors", {
        "blocks.0.attn.out_proj.lora_up.weight": up.to(torch.bfloat16),
        "blocks.0.attn.out_proj.lora_down.weight": down.to(torch.bfloat16)})
    got, _ = merged_param(model, file, 1.0, "blocks.0.attn.out_proj.weight")
    assert got.dtype == torch.bfloat16
    want = (model.blocks[0].attn.out_proj.weight.float()
            + up.to(torch.bfloat16).float() @ down.to(torch.bfloat16).float()).to(torch.bfloat16)
    assert torch.equal(got, want)
    assert param(model, "blocks.0.attn.out_proj.weight").dtype == torch.bfloat16


@pytest.mark.parametrize("w1_rows", [2, 1, 5])
def test_lokr_on_diffusers_swiglu_rows_is_exchanged_like_the_weight(tmp_path, w1_rows):
    """kron(w1, w2) given in diffusers' [value; gate] row order lands on our [gate; value] rows, whether the
    exchange falls on w1's rows (even), on w2's (w1 has one row) or on neither factor alone (odd)."""
    model = tiny_h3()
    w1, w2 = rand(w1_rows, 4, seed=1), rand(80 // w1_rows, 8, seed=2)
    file = write_adapter(tmp_path / "lokr_ff.safetensors", {
        "lycoris_transformer_blocks_1_ff_net_0_proj.lokr_w1": w1,
        "lycoris_transformer_blocks_1_ff_net_0_proj.lokr_w2": w2})
    got, handle = merged_param(model, file, 0.7, "blocks.1.mlp.fc1.weight")
    delta = kron_reference(w1, w2)
    torch.testing.assert_close(got, model.blocks[1].mlp.fc1.weight + 0.7 * torch.cat([delta[40:], delta[:40]]))
    check_forward_equal(model, handle)


def test_lokr_tucker_on_a_linear(tmp_path):
    model = tiny_h3()
    w1 = rand(4, 4, seed=1)
    t2, w2_a, w2_b = rand(2, 2, seed=2), rand(2, HIDDEN // 4, seed=3), rand(2, INNER // 4, seed=4)
    file = write_adapter(tmp_path / "lokr_tucker_linear.safetensors", {
        "lycoris_blocks_0_attn_out_proj.lokr_w1": w1, "lycoris_blocks_0_attn_out_proj.lokr_t2": t2,
        "lycoris_blocks_0_attn_out_proj.lokr_w2_a": w2_a, "lycoris_blocks_0_attn_out_proj.lokr_w2_b": w2_b,
        "lycoris_blocks_0_attn_out_proj.alpha": torch.tensor(1.0)})
    got, handle = merged_param(model, file, 1.0, "blocks.0.attn.out_proj.weight")
    want = kron_reference(w1, tucker_reference(t2, w2_a, w2_b)) * 0.5
    torch.testing.assert_close(got, model.blocks[0].attn.out_proj.weight + want)
    check_forward_equal(model, handle)
