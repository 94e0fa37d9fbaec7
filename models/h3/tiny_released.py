"""Tiny H3 models in the formats and under the file names of the released H3 files.

    python -m models.h3.make_tiny --released-formats [--models-dir DIR]

writes, under DIR's diffusion_models/, vae/, text_encoders/, loras/ and model_patches/ folders, the files the official
H3 templates load, each a tiny random model stored the way the released file stores the real one:

- `minimax_h3_{fl2va,ref2va}_pruned_int8_convrot`: the pruned DiT (curve-form AdaLN: an `adaln_t_table`
  of 1025 rows x 8 in float32 and no time embedder; `adaln_proj` in float16), its block linears in
  int8 with a Hadamard rotation and per-layer `.comfy_quant` markers, the rest bfloat16 except the
  float32 patch projections, output heads and RoPE frequencies.
- `fastvideo_fasth3_8step_v2_pruned_int8_convrot`, `fasth3_omniref_8step_pruned_int8_convrot`: the same
  pruned DiT with FastH3's `attn.to_gate_compress` in every block (bfloat16, not quantized).
- `minimax_h3_video_vae_int8_convrot`: the video VAE with its decoder's transformer linears in int8
  (rotated), the rest float16; `minimax_h3_video_vae_fp16`: the same model in float16.
- `minimax_h3_audio_vae_fp32`: the audio VAE in float32, its convolutions weight-normalised
  (`weight_g` / `weight_v`) as the original training checkpoint stores them.
- `minimax_h3_{fl2v_turbo_8step_v1.0,ref2v_turbo_4step_v0.1}_comfyui_bf16`: bfloat16 LoRAs on the DiT.
- `MiniMax-H3-{FL2VA,Ref2VA}-Acc-8Step` (loras/): PDD adapters, a bfloat16 backbone LoRA plus a float32 bank
  of 32 output heads (`final_layer.{video,audio}_out.set_weight` / `set_bias`, `pdd_num_steps` 32), in the
  layout ComfyUI's LoRA loaders read (models/h3/pdd.py; the original release's own layout is not read).
- `FastH3-4-step-Preview-v1-LoRA/dense-datafree/adapter_model` (loras/): a FastH3 adapter as FastVideo's
  v2 adapters are built (rank-16 LoRA pairs with no alpha, full-rank `.diff` on the block norms, `.diff_b`
  on the AdaLN biases), under ComfyUI's `diffusion_model.` key names (FastVideo's own names unverified).
- `minimax_h3_fun_controlnet_union_pruned_int8_convrot` (model_patches/): a Fun ControlNet-Union patch for
  the pruned DiT, one control block per tiny DiT layer (`control_blocks_places` [0, 1]), curve-form
  modulation (`minimax_h3_fun_controlnet: adaln_basis`), block linears in int8 convrot, the float32 hint
  projection, float16 modulation and the rest bfloat16 (the released file's exact layout is not
  published; this follows the pruned DiT's).
- `minimax_h3_fl2va_pruned-Q8_0.gguf` (diffusion_models/) and `qwen3vl_32b_minimax_h3-Q8_0.gguf`
  (text_encoders/): the same pruned DiT and tiny Qwen3-VL as GGUF files in the layout of the released
  GGUF conversions (models/gguf.py): original key names, every 2-D weight whose rows are whole
  blocks in Q8_0, the DiT's float32 islands and every 1-D tensor in F32, the rest F16, the vision
  tower's Conv3d weight with its shape in `comfy.gguf.orig_shape`. The released files also come in
  K types (Q4_K, Q2_K_M, ...), whose blocks hold 256 values: no row of these tiny models is that wide,
  so the tiny files stay Q8_0 (Weft writes Q6_K and Q4_K; tests/models/test_gguf_loading.py writes a
  DiT widened to 256 in them).
- `qwen3vl_32b_minimax_h3_nvfp4_awq`: a tiny Qwen3-VL (language model and vision tower) stored as the
  released encoder is: the language model's linears in nvfp4 (AWQ `pre_quant_scale` on o_proj and
  down_proj), the token table in int8, the vision tower in bfloat16, a few layers and no final norm;
  beside it, in text_encoders/qwen25_tokenizer/, the tiny tokenizer the project trains itself.
- `taeh3` (vae_approx/): a tiny taeh3 live-preview decoder (models/h3/taeh3.py's TINY_CONFIG widths), float16,
  decoder keys only (Weft's previews use no encoder).

Rotation groups are per layer, as in the released files: the largest power of 4 up to 256 that divides
the layer's input width (the tiny widths give 64 where the released files use 256). The weights are
random, so the output is noise; every file says so in its metadata.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import torch
from safetensors.torch import save as save_safetensors
from torch import nn

from models.h3 import transformer
from models.h3.make_tiny import NOTE, _init_weights, _write_atomic, build_tiny
from models.quant.writer import RELEASED_INT8_LAYERS, quantize_state_dict

ROTATION_GROUP = 256          # the released int8 files' convrot group; tiny layers use the largest that fits
CURVE_POINTS = 1025           # rows of the released pruned DiT's adaln_t_table
CURVE_WIDTH = 8               # its columns (the adaln projections' input width)
PRUNED_TINY_CONFIG = dataclasses.replace(transformer.TINY_CONFIG, adaln_curve_points=CURVE_POINTS,
                                         time_embed_dim=CURVE_WIDTH)

TRANSFORMERS = {"minimax_h3_fl2va_pruned_int8_convrot.safetensors": 2001,
                "minimax_h3_ref2va_pruned_int8_convrot.safetensors": 2002}
# FastH3 (VSA-distilled) DiTs: the pruned form plus each block's to_gate_compress.
FASTH3_TRANSFORMERS = {"fastvideo_fasth3_8step_v2_pruned_int8_convrot.safetensors": 2003,
                       "fasth3_omniref_8step_pruned_int8_convrot.safetensors": 2004}
LORAS = {"minimax_h3_fl2v_turbo_8step_v1.0_comfyui_bf16.safetensors": "minimax_h3_fl2va_pruned_int8_convrot.safetensors",
         "minimax_h3_ref2v_turbo_4step_v0.1_comfyui_bf16.safetensors": "minimax_h3_ref2va_pruned_int8_convrot.safetensors"}
VIDEO_VAE_INT8 = "minimax_h3_video_vae_int8_convrot.safetensors"
VIDEO_VAE_FP16 = "minimax_h3_video_vae_fp16.safetensors"
AUDIO_VAE = "minimax_h3_audio_vae_fp32.safetensors"
TEXT_ENCODER = "qwen3vl_32b_minimax_h3_nvfp4_awq.safetensors"
FUN_CONTROL = "minimax_h3_fun_controlnet_union_pruned_int8_convrot.safetensors"
# PDD adapters (alibaba-pai/MiniMax-H3-Acc-LoRAs) and the DiT each is made for; the bank's head count.
PDD_LORAS = {"MiniMax-H3-FL2VA-Acc-8Step.safetensors": "minimax_h3_fl2va_pruned_int8_convrot.safetensors",
             "MiniMax-H3-Ref2VA-Acc-8Step.safetensors": "minimax_h3_ref2va_pruned_int8_convrot.safetensors"}
PDD_HEADS = 32
# FastVideo's FastH3 Preview adapter (dense, data-free variant), under its folder in the release.
FASTH3_ADAPTER = "FastH3-4-step-Preview-v1-LoRA/dense-datafree/adapter_model.safetensors"

TAEH3 = "taeh3.safetensors"  # in vae_approx/, where the live previews look for it
TAEH3_SEED = 2301
FUN_CONTROL_LAYERS = r"control_blocks\.\d+\.(attn\.(qkv_proj|out_proj)|mlp\.(fc1|fc2))"
QWEN3VL_SEED = 2004
# The released encoder's nvfp4 layers, and those of them that carry an AWQ pre_quant_scale.
QWEN3VL_NVFP4_LAYERS = r"model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)"
QWEN3VL_AWQ_LAYERS = (".self_attn.o_proj.weight", ".mlp.down_proj.weight")
LORA_TARGETS = r"blocks\.\d+\.(attn\.(qkv_proj|out_proj)|mlp\.(fc1|fc2))"


def build_pruned_transformer(seed: int, *, gate_compress: bool = False) -> transformer.H3Transformer:
    """A tiny curve-form (pruned) H3 transformer with deterministic weights and a smooth adaln_t_table."""
    model = transformer.H3Transformer(dataclasses.replace(PRUNED_TINY_CONFIG, gate_compress=gate_compress))
    _init_weights(model, seed)
    # The released table samples a smooth curve of t in [0, 1]; a few random sinusoids stand in for it.
    gen = torch.Generator("cpu").manual_seed(seed + 1)
    t = torch.linspace(0.0, 1.0, CURVE_POINTS)[:, None]
    freqs = 0.5 + 3.0 * torch.rand(1, 4 * CURVE_WIDTH, generator=gen)
    phases = 2 * math.pi * torch.rand(1, 4 * CURVE_WIDTH, generator=gen)
    mixing = torch.randn(4 * CURVE_WIDTH, CURVE_WIDTH, generator=gen) / math.sqrt(4 * CURVE_WIDTH)
    with torch.no_grad():
        model.adaln_t_table.copy_(torch.sin(t * freqs + phases) @ mixing)
    return model.eval().requires_grad_(False)


def _stored_dtype(key: str) -> torch.dtype:
    if key.startswith(transformer.FLOAT32_PREFIXES):
        return torch.float32
    return torch.float16 if ".adaln_proj." in key else torch.bfloat16


def pruned_transformer_bytes(seed: int, *, gate_compress: bool = False) -> bytes:
    """The safetensors bytes of a tiny pruned int8-convrot DiT (see the module docstring)."""
    model = build_pruned_transformer(seed, gate_compress=gate_compress)
    state = {k: v.detach().float().contiguous() for k, v in model.state_dict().items()}
    tensors, _ = quantize_state_dict(state, RELEASED_INT8_LAYERS["h3_transformer"], "int8_tensorwise",
                                     rotation_group=ROTATION_GROUP)
    # Quantized codes, their scales and markers keep the dtypes the writer gave them; float weights take the file's.
    out = {k: v.to(_stored_dtype(k)) if k in state and v.is_floating_point() else v for k, v in tensors.items()}
    return save_safetensors(out, metadata=_metadata("transformer", model.config, "pruned int8 convrot"))


def _metadata(kind: str, config: object, form: str) -> dict[str, str]:
    return {"weft_random_weights": "true", "weft_tiny": "true", "weft_note": NOTE, "weft_kind": kind,
            "weft_released_form": form, "weft_config": json.dumps(dataclasses.asdict(config))}


def video_vae_bytes(quantized: bool) -> bytes:
    """The tiny video VAE in float16, its decoder transformer linears in int8 convrot when `quantized`."""
    model = build_tiny("video_vae")
    state = {k: v.detach().float().contiguous() for k, v in model.state_dict().items()}
    if quantized:
        state, _ = quantize_state_dict(state, RELEASED_INT8_LAYERS["h3_video_vae"], "int8_tensorwise",
                                       rotation_group=ROTATION_GROUP)
    floats = set(model.state_dict()) - {"latents_mean", "latents_std"}
    out = {k: v.to(torch.float16) if k in floats and v.is_floating_point() else v for k, v in state.items()}
    form = "int8 convrot" if quantized else "fp16"
    return save_safetensors(out, metadata=_metadata("video_vae", model.config, form))


def weight_normalised_convs(model: nn.Module) -> list[str]:
    """The audio VAE convolutions the original checkpoint stores weight-normalised (encoder and vocoder)."""
    return [name for name, m in model.named_modules()
            if isinstance(m, (nn.Conv1d, nn.ConvTranspose1d)) and name.startswith(("encoder.", "decoder."))]


def audio_vae_bytes(seed: int = 2003) -> bytes:
    """The tiny audio VAE in float32 with gain/direction pairs (`weight_g`, `weight_v`, norm over dim 0)."""
    model = build_tiny("audio_vae")
    state = {k: v.detach().float().contiguous() for k, v in model.state_dict().items()}
    gen = torch.Generator("cpu").manual_seed(seed)
    for name in weight_normalised_convs(model):
        weight = state.pop(name + ".weight")
        gain = weight.flatten(1).norm(dim=1).view(-1, *([1] * (weight.dim() - 1)))
        # The direction keeps the weight's orientation at an arbitrary per-slice length, as training leaves it.
        length = 0.5 + torch.rand(gain.shape, generator=gen)
        state[name + ".weight_g"] = gain.contiguous()
        state[name + ".weight_v"] = (weight / gain.clamp_min(1e-12) * length).contiguous()
    return save_safetensors(state, metadata=_metadata("audio_vae", model.config, "fp32 weight-normalised"))


def lora_bytes(transformer_bytes: bytes, seed: int, rank: int = 2, scale: float = 0.3) -> bytes:
    """A bfloat16 LoRA (ComfyUI `diffusion_model.` keys) on every block linear of the tiny DiT."""
    from safetensors.torch import load as load_safetensors
    pattern = re.compile(LORA_TARGETS)
    shapes = {}
    for key, value in load_safetensors(transformer_bytes).items():
        layer, _, leaf = key.rpartition(".")
        if leaf == "weight" and pattern.fullmatch(layer):
            shapes[layer] = tuple(value.shape)     # int8 codes keep the dense (out, in) shape
    gen = torch.Generator("cpu").manual_seed(seed)
    tensors = {}
    for layer, (out_features, in_features) in sorted(shapes.items()):
        tensors[f"diffusion_model.{layer}.lora_A.weight"] = (torch.randn(rank, in_features, generator=gen) * scale).to(torch.bfloat16)
        tensors[f"diffusion_model.{layer}.lora_B.weight"] = (torch.randn(out_features, rank, generator=gen) * scale).to(torch.bfloat16)
    return save_safetensors(tensors, metadata={"weft_random_weights": "true", "weft_tiny": "true", "weft_note": NOTE})


def _dit_tensors(transformer_bytes: bytes) -> dict[str, torch.Tensor]:
    from safetensors.torch import load as load_safetensors
    return load_safetensors(transformer_bytes)


def pdd_bytes(transformer_bytes: bytes, seed: int, heads: int = PDD_HEADS) -> bytes:
    """A PDD adapter for the tiny DiT: the backbone LoRA of `lora_bytes` plus a bank of `heads` output heads.

    Row block 0 of each bank is the DiT's own head, nudged; blocks 1.. are small offsets from it.
    """
    from safetensors.torch import load as load_safetensors
    tensors = load_safetensors(lora_bytes(transformer_bytes, seed))
    dit = _dit_tensors(transformer_bytes)
    gen = torch.Generator("cpu").manual_seed(seed + 1)
    for head in ("video_out", "audio_out"):
        for part in ("weight", "bias"):
            base = dit[f"final_layer.{head}.{part}"].float()
            blocks = [base + 0.02 * torch.randn(base.shape, generator=gen)]
            blocks += [0.05 * torch.randn(base.shape, generator=gen) for _ in range(heads - 1)]
            tensors[f"diffusion_model.final_layer.{head}.set_{part}"] = torch.cat(blocks).contiguous()
    return save_safetensors(tensors, metadata={"weft_random_weights": "true", "weft_tiny": "true", "weft_note": NOTE,
                                               "pdd_num_steps": str(heads)})


def fasth3_adapter_bytes(transformer_bytes: bytes, seed: int = 2301, rank: int = 16) -> bytes:
    """A FastH3-style adapter for the tiny DiT: alpha-less LoRA pairs, `.diff` on norms, `.diff_b` on AdaLN biases."""
    from safetensors.torch import load as load_safetensors
    gen = torch.Generator("cpu").manual_seed(seed)
    tensors = {k: v for k, v in load_safetensors(lora_bytes(transformer_bytes, seed, rank=rank, scale=0.05)).items()}
    for key, value in sorted(_dit_tensors(transformer_bytes).items()):
        layer, _, leaf = key.rpartition(".")
        if re.fullmatch(r"blocks\.\d+\.norm[12]", layer) and leaf == "weight":
            tensors[f"diffusion_model.{layer}.diff"] = (0.01 * torch.randn(value.shape, generator=gen)).to(torch.bfloat16)
        elif re.fullmatch(r"blocks\.\d+\.adaln_proj\.linear", layer) and leaf == "bias":
            tensors[f"diffusion_model.{layer}.diff_b"] = (0.01 * torch.randn(value.shape, generator=gen)).to(torch.bfloat16)
    return save_safetensors(tensors, metadata={"weft_random_weights": "true", "weft_tiny": "true", "weft_note": NOTE})


def fun_control_bytes(seed: int = 2201) -> bytes:
    """A tiny Fun ControlNet-Union patch for the tiny pruned DiT (see the module docstring)."""
    from models.h3.fun_control import CURVE_FORM, FORM_METADATA, PLACES_METADATA, FunControlConfig, FunControlNet
    base = PRUNED_TINY_CONFIG
    places = tuple(range(base.num_layers))
    config = FunControlConfig(hidden_size=base.hidden_size, num_heads=base.num_heads, head_dim=base.head_dim,
                              ffn_size=base.ffn_size, time_embed_dim=base.time_embed_dim, injection_layers=places,
                              curve_form=True)
    model = FunControlNet(config)
    _init_weights(model, seed)
    state = {k: v.detach().float().contiguous() for k, v in model.state_dict().items()}
    tensors, _ = quantize_state_dict(state, FUN_CONTROL_LAYERS, "int8_tensorwise", rotation_group=ROTATION_GROUP)
    out = {}
    for key, value in tensors.items():
        if key not in state or not value.is_floating_point():
            out[key] = value                                   # codes, scales and markers as written
        elif key.startswith("control_proj_in."):
            out[key] = value
        else:
            out[key] = value.to(torch.float16 if ".adaln_proj." in key else torch.bfloat16)
    metadata = _metadata("fun_control", config, "pruned int8 convrot")
    metadata.update({PLACES_METADATA: json.dumps(list(places)), FORM_METADATA: CURVE_FORM})
    return save_safetensors(out, metadata=metadata)


def build_tiny_qwen3vl(seed: int = QWEN3VL_SEED):
    """The tiny Qwen3-VL (models/text/qwen3vl.py TINY_CONFIG) with deterministic random float32 weights."""
    from models.text.qwen3vl import TINY_CONFIG, Qwen3VL
    model = Qwen3VL(TINY_CONFIG)
    _init_weights(model, seed)
    return model.eval().requires_grad_(False)


def released_qwen3vl_tensors(state: dict[str, torch.Tensor], seed: int = QWEN3VL_SEED) -> dict[str, torch.Tensor]:
    """A float Qwen3-VL state dict (released key names) stored as the released encoder file stores its model.

    The language model's linears become nvfp4 (full-precision products); o_proj and down_proj carry an
    AWQ `pre_quant_scale` (bfloat16, one per input column), the stored weight being W / scale so that the
    layer still computes x @ W^T. The token table becomes int8_tensorwise (per-row scales, no rotation);
    the final norm is dropped; norms and the whole vision tower are bfloat16.
    """
    gen = torch.Generator("cpu").manual_seed(seed)
    floats = {k: v.detach().float().contiguous() for k, v in state.items() if k != "model.norm.weight"}
    awq_scales = {}
    for key in sorted(floats):
        if key.endswith(QWEN3VL_AWQ_LAYERS):
            scale = torch.exp(0.25 * torch.randn(floats[key].shape[1], generator=gen)).to(torch.bfloat16)
            floats[key] = floats[key] / scale.float()
            awq_scales[key.removesuffix("weight") + "pre_quant_scale"] = scale
    tensors, _ = quantize_state_dict(floats, QWEN3VL_NVFP4_LAYERS, "nvfp4", full_precision=True)
    tensors, _ = quantize_state_dict(tensors, ["model.embed_tokens"], "int8_tensorwise")
    out = {k: v.to(torch.bfloat16) if k in floats and v.dtype == torch.float32 else v for k, v in tensors.items()}
    return {**out, **awq_scales}


def qwen3vl_bytes(seed: int = QWEN3VL_SEED) -> bytes:
    """The tiny Qwen3-VL in the released encoder's format (see released_qwen3vl_tensors)."""
    from models.text.qwen3vl import DEEPSTACK_METADATA
    model = build_tiny_qwen3vl(seed)
    metadata = {**_metadata("qwen3vl", model.config, "nvfp4 awq"),
                DEEPSTACK_METADATA: json.dumps(list(model.config.vision.deepstack_layers))}
    return save_safetensors(released_qwen3vl_tensors(model.state_dict(), seed), metadata=metadata)


GGUF_TRANSFORMER = "minimax_h3_fl2va_pruned-Q8_0.gguf"
GGUF_TEXT_ENCODER = "qwen3vl_32b_minimax_h3-Q8_0.gguf"


def gguf_layout(state: dict[str, torch.Tensor], block_type: str = "Q8_0",
                float32: tuple[str, ...] = ()) -> dict[str, tuple[str, torch.Tensor]]:
    """A state dict as a released GGUF conversion stores it: {key: (ggml type, values)}.

    2-D `.weight` tensors whose rows are whole 32-value blocks take `block_type`; keys starting
    with one of `float32` and 1-D tensors take F32; the rest F16.
    """
    out = {}
    for key, value in state.items():
        value = value.detach().float().contiguous()
        if key.endswith(".weight") and value.dim() == 2 and value.shape[1] % 32 == 0:
            out[key] = (block_type, value)
        elif value.dim() <= 1 or key.startswith(float32):
            out[key] = ("F32", value)
        else:
            out[key] = ("F16", value)
    return out


def pruned_transformer_gguf_bytes(seed: int) -> bytes:
    """The GGUF bytes of the tiny pruned DiT (see the module docstring)."""
    from models.gguf import gguf_bytes
    model = build_pruned_transformer(seed)
    state = {k: v for k, v in model.state_dict().items()}
    return gguf_bytes(gguf_layout(state, float32=transformer.FLOAT32_PREFIXES),
                      _metadata("transformer", model.config, "pruned GGUF Q8_0"))


def qwen3vl_gguf_bytes(seed: int = QWEN3VL_SEED) -> bytes:
    """The GGUF bytes of the tiny Qwen3-VL (no final norm, as the released encoder files)."""
    from models.gguf import gguf_bytes
    from models.text.qwen3vl import DEEPSTACK_METADATA
    model = build_tiny_qwen3vl(seed)
    state = {k: v for k, v in model.state_dict().items() if k != "model.norm.weight"}
    metadata = {**_metadata("qwen3vl", model.config, "GGUF Q8_0"),
                DEEPSTACK_METADATA: json.dumps(list(model.config.vision.deepstack_layers))}
    return gguf_bytes(gguf_layout(state), metadata)

def taeh3_bytes(seed: int = TAEH3_SEED) -> bytes:
    """A tiny random taeh3 decoder in float16 (scaled so its features stay near unit size through depth)."""
    from models.h3.taeh3 import TINY_CONFIG, TAEH3Decoder

    model = TAEH3Decoder(TINY_CONFIG)
    generator = torch.Generator("cpu").manual_seed(seed)
    state = {}
    for name, tensor in sorted(model.state_dict().items()):
        if name.endswith("bias"):
            state[name] = 0.05 * torch.randn(tensor.shape, generator=generator)
        else:
            fan_in = tensor[0].numel()
            state[name] = torch.randn(tensor.shape, generator=generator) * (1.0 / math.sqrt(fan_in))
    state["decoder.22.bias"] += 0.5  # centre the colours, so the pictures are neither black nor white
    out = {name: tensor.to(torch.float16).contiguous() for name, tensor in state.items()}
    return save_safetensors(out, metadata=_metadata("taeh3", TINY_CONFIG, "fp16 decoder"))


def write_released(models_dir: str | Path) -> dict[str, Path]:
    """Write every tiny released-format file under models_dir; returns {file name: path}."""
    root = Path(models_dir)
    written: dict[str, Path] = {}

    def put(folder: str, name: str, data: bytes) -> None:
        path = root / folder / name
        _write_atomic(path, data)
        written[name] = path

    dit_bytes = {}
    for name, seed in TRANSFORMERS.items():
        dit_bytes[name] = pruned_transformer_bytes(seed)
        put("diffusion_models", name, dit_bytes[name])
    for name, seed in FASTH3_TRANSFORMERS.items():
        put("diffusion_models", name, pruned_transformer_bytes(seed, gate_compress=True))
    for n, (name, base) in enumerate(LORAS.items()):
        put("loras", name, lora_bytes(dit_bytes[base], seed=2100 + n))
    for n, (name, base) in enumerate(PDD_LORAS.items()):
        put("loras", name, pdd_bytes(dit_bytes[base], seed=2150 + n))
    put("loras", FASTH3_ADAPTER, fasth3_adapter_bytes(dit_bytes[next(iter(TRANSFORMERS))]))
    put("vae", VIDEO_VAE_INT8, video_vae_bytes(quantized=True))
    put("vae", VIDEO_VAE_FP16, video_vae_bytes(quantized=False))
    put("vae", AUDIO_VAE, audio_vae_bytes())
    put("text_encoders", TEXT_ENCODER, qwen3vl_bytes())
    put("diffusion_models", GGUF_TRANSFORMER, pruned_transformer_gguf_bytes(TRANSFORMERS["minimax_h3_fl2va_pruned_int8_convrot.safetensors"]))
    put("text_encoders", GGUF_TEXT_ENCODER, qwen3vl_gguf_bytes())
    from models.text.qwen_tokenizer import TOKENIZER_FOLDER, write_tiny_tokenizer
    written[TOKENIZER_FOLDER] = write_tiny_tokenizer(root / "text_encoders" / TOKENIZER_FOLDER)
    put("model_patches", FUN_CONTROL, fun_control_bytes())
    put("vae_approx", TAEH3, taeh3_bytes())
    return written
