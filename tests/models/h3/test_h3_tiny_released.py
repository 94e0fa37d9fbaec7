"""`python -m models.h3.make_tiny --released-formats` writes the released file names in the released formats."""
from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from safetensors import safe_open

from models.h3.make_tiny import main
from models.loading import load_model, read_header


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    root = tmp_path_factory.mktemp("released_models")
    main(["--released-formats", "--models-dir", str(root)])
    return root


def marker(path, layer: str) -> dict:
    with safe_open(str(path), framework="pt") as f:
        return json.loads(bytes(f.get_tensor(f"{layer}.comfy_quant").tolist()).decode("utf-8"))


def test_every_released_name_is_written(released):
    names = {p.relative_to(released).as_posix() for p in released.rglob("*.safetensors")}
    assert names == {
        "diffusion_models/minimax_h3_fl2va_pruned_int8_convrot.safetensors",
        "diffusion_models/minimax_h3_ref2va_pruned_int8_convrot.safetensors",
        "diffusion_models/fastvideo_fasth3_8step_v2_pruned_int8_convrot.safetensors",
        "diffusion_models/fasth3_omniref_8step_pruned_int8_convrot.safetensors",
        "vae/minimax_h3_video_vae_int8_convrot.safetensors",
        "vae/minimax_h3_video_vae_fp16.safetensors",
        "vae/minimax_h3_audio_vae_fp32.safetensors",
        "text_encoders/qwen3vl_32b_minimax_h3_nvfp4_awq.safetensors",
        "loras/minimax_h3_fl2v_turbo_8step_v1.0_comfyui_bf16.safetensors",
        "loras/minimax_h3_ref2v_turbo_4step_v0.1_comfyui_bf16.safetensors",
        "loras/MiniMax-H3-FL2VA-Acc-8Step.safetensors",
        "loras/MiniMax-H3-Ref2VA-Acc-8Step.safetensors",
        "loras/FastH3-4-step-Preview-v1-LoRA/dense-datafree/adapter_model.safetensors",
        "model_patches/minimax_h3_fun_controlnet_union_pruned_int8_convrot.safetensors",
        "vae_approx/taeh3.safetensors",
    }
    assert {p.relative_to(released).as_posix() for p in released.rglob("*.gguf")} == {
        "diffusion_models/minimax_h3_fl2va_pruned-Q8_0.gguf", "text_encoders/qwen3vl_32b_minimax_h3-Q8_0.gguf"}
    for path in [*released.rglob("*.safetensors"), *released.rglob("*.gguf")]:
        assert read_header(path).metadata.get("weft_random_weights") == "true", path.name


def test_fasth3_dits_carry_a_float_to_gate_compress_in_every_block(released):
    from models.loading import load_model
    for name in ("fastvideo_fasth3_8step_v2_pruned_int8_convrot", "fasth3_omniref_8step_pruned_int8_convrot"):
        path = released / "diffusion_models" / f"{name}.safetensors"
        header = read_header(path)
        gates = [k for k in header.tensors if k.endswith(".attn.to_gate_compress.weight")]
        assert len(gates) == 2 and all(header.tensors[k].dtype == "BF16" for k in gates)
        loaded = load_model(str(path), expect="h3_transformer")
        assert loaded.config.gate_compress and loaded.config.adaln_curve_points is not None


def test_pruned_dit_is_int8_convrot_with_curve_adaln(released):
    path = released / "diffusion_models" / "minimax_h3_fl2va_pruned_int8_convrot.safetensors"
    header = read_header(path)
    assert "__metadata__" not in header.tensors and "_quantization_metadata" not in header.metadata
    quantized = sorted(k[:-len(".comfy_quant")] for k in header.tensors if k.endswith(".comfy_quant"))
    assert quantized == sorted(f"blocks.{i}.{layer}" for i in range(2)
                               for layer in ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2"))
    for layer in quantized:
        conf = marker(path, layer)
        n, k = header.tensors[f"{layer}.weight"].shape
        # Per layer, the largest power of 4 up to the released 256 that divides the input width.
        group = max(g for g in (4, 16, 64, 256) if k % g == 0)
        assert conf == {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": group}
        assert header.tensors[f"{layer}.weight"].dtype == "I8"
        assert (header.tensors[f"{layer}.weight_scale"].dtype, header.tensors[f"{layer}.weight_scale"].shape) == ("F32", (n, 1))
    assert (header.tensors["adaln_t_table"].dtype, header.tensors["adaln_t_table"].shape) == ("F32", (1025, 8))
    assert not any(k.startswith("time_embedder.") for k in header.tensors)
    assert {header.tensors[k].dtype for k in header.tensors if ".adaln_proj." in k} == {"F16"}
    assert header.tensors["token_refiner.blocks.0.attn.qkv_proj.weight"].dtype == "BF16"
    assert header.tensors["video_patch_proj.weight"].dtype == "F32"
    other = released / "diffusion_models" / "minimax_h3_ref2va_pruned_int8_convrot.safetensors"
    assert other.read_bytes() != path.read_bytes()


def test_vaes_and_lora_formats(released):
    int8 = read_header(released / "vae" / "minimax_h3_video_vae_int8_convrot.safetensors")
    quantized = {k for k in int8.tensors if k.endswith(".comfy_quant")}
    assert quantized and all(k.startswith("decoder.transformer_blocks.") for k in quantized)
    assert not any(".comfy_quant" in k for k in read_header(released / "vae" / "minimax_h3_video_vae_fp16.safetensors").tensors)
    fp16 = Counter(t.dtype for t in read_header(released / "vae" / "minimax_h3_video_vae_fp16.safetensors").tensors.values())
    assert set(fp16) == {"F16", "F32"} and fp16["F32"] == 2                        # the latent statistics
    audio = read_header(released / "vae" / "minimax_h3_audio_vae_fp32.safetensors")
    assert {t.dtype for t in audio.tensors.values()} == {"F32"}
    assert "decoder.conv_pre.weight_g" in audio.tensors and "decoder.conv_pre.weight" not in audio.tensors
    assert "decoder.ups.0.0.weight_v" in audio.tensors and "dec_in_proj.weight" in audio.tensors
    lora = read_header(released / "loras" / "minimax_h3_fl2v_turbo_8step_v1.0_comfyui_bf16.safetensors")
    assert {t.dtype for t in lora.tensors.values()} == {"BF16"}
    assert "diffusion_model.blocks.1.mlp.fc2.lora_B.weight" in lora.tensors


def test_released_files_load_and_run(released):
    vae = load_model(released / "vae" / "minimax_h3_video_vae_int8_convrot.safetensors", expect="h3_video_vae").model
    frames = vae.decode(torch.randn(1, 24, 2, 2, 2, generator=torch.Generator().manual_seed(0)))
    assert frames.shape == (1, 5, 32, 32, 3) and torch.isfinite(frames).all()
    audio = load_model(released / "vae" / "minimax_h3_audio_vae_fp32.safetensors", expect="h3_audio_vae").model
    wave = audio.decode(torch.randn(1, 32, 2, 4, generator=torch.Generator().manual_seed(1)))
    assert wave.shape == (1, 2, 3200) and torch.isfinite(wave).all()


@pytest.mark.parametrize("lora, dit", [
    ("MiniMax-H3-FL2VA-Acc-8Step.safetensors", "minimax_h3_fl2va_pruned_int8_convrot.safetensors"),
    ("FastH3-4-step-Preview-v1-LoRA/dense-datafree/adapter_model.safetensors",
     "minimax_h3_fl2va_pruned_int8_convrot.safetensors"),
    ("FastH3-4-step-Preview-v1-LoRA/dense-datafree/adapter_model.safetensors",
     "fastvideo_fasth3_8step_v2_pruned_int8_convrot.safetensors")])
def test_pdd_bank_and_fasth3_adapter_apply_whole_to_the_pruned_dits(released, lora, dit):
    from models.adapters import load_adapter
    from models.h3 import pdd, sampling
    from models.patcher import ModelHandle
    adapter = load_adapter(released / "loras" / lora)
    model = load_model(released / "diffusion_models" / dit).model
    handle = ModelHandle(model).with_adapter(adapter, 1.0)
    applied = handle.applied[0]
    kinds = Counter(patch.source.kind for patch in applied.patches)
    if "Acc" in lora:
        assert kinds["head bank"] == 4 and applied.adapter.metadata["pdd_num_steps"] == "32"
    else:
        assert kinds["diff"] == 3 * model.config.num_layers and kinds["lora"] > 0  # norm1, norm2, AdaLN bias
        assert applied.adapter.format == "comfyui"
    gen = torch.Generator().manual_seed(2)
    video, audio = torch.randn(1, 24, 2, 4, 4, generator=gen), torch.randn(1, 32, 2, 5, generator=gen)
    text = torch.randn(1, 3, model.config.text_dim, generator=gen)
    sigmas = sampling.sigmas(8, shift=12.0)
    with torch.no_grad(), pdd.sampler_step(pdd.SamplerStep(float(sigmas[1]), float(sigmas[2]), 12.0, 3.0)):
        v, a = handle(video, audio, text, float(sigmas[1]), 0.5)
        base_v, _ = model(video, audio, text, float(sigmas[1]), 0.5)
    assert torch.isfinite(v).all() and torch.isfinite(a).all() and (v - base_v).abs().max() > 1e-3
