"""The LoRA loader nodes: the bypass pair's ComfyUI interface, the same samples through the bypass (side
path) and the ordinary loader, and the report of what bound (node text, UI output, profile notes)."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from tests.nodes.test_h3_nodes import (  # noqa: F401 (configured_paths and h3 are fixtures)
    TINY_NAMES, configured_paths, h3, probe, t2va_prompt, write_tiny_lora,
)
from web.object_info import object_info

BYPASS_INPUTS = {
    "LoraLoaderBypass": ["model", "clip", "lora_name", "strength_model", "strength_clip"],
    "LoraLoaderBypassModelOnly": ["model", "lora_name", "strength_model"],
}


def test_bypass_loaders_have_comfyui_ids_inputs_outputs_and_defaults(registry):
    info = object_info(registry)
    for node_id, inputs in BYPASS_INPUTS.items():
        entry = info[node_id]
        assert entry["input_order"]["required"] == inputs
        assert entry["category"] == "loaders" and entry["experimental"] is True
        assert entry["python_module"] == "comfy_extras.nodes_lora_debug"
        for name in ("strength_model", "strength_clip"):
            if name in inputs:
                kind, options = entry["input"]["required"][name]
                assert kind == "FLOAT"
                assert (options["default"], options["min"], options["max"], options["step"]) == (1.0, -100.0, 100.0, 0.01)
        assert entry["input"]["required"]["model"][0] == "MODEL"
    assert info["LoraLoaderBypass"]["output"] == ["MODEL", "CLIP"]
    assert info["LoraLoaderBypassModelOnly"]["output"] == ["MODEL"]


def _with_lora(prompt: dict, node_type: str, strength: float = 0.8) -> dict:
    prompt["lora"] = {"class_type": node_type, "inputs": {
        "model": ["unet", 0], "lora_name": "tiny_lora.safetensors", "strength_model": strength}}
    for node in prompt.values():  # everything that took the model now takes it through the LoRA
        for name, value in node["inputs"].items():
            if value == ["unet", 0] and node is not prompt["lora"]:
                node["inputs"][name] = ["lora", 0]
    return prompt


def test_bypass_model_only_samples_what_the_ordinary_loader_samples_on_a_float_base(h3):
    models = h3.paths.models
    write_tiny_lora(models / "loras" / "tiny_lora.safetensors", models / "diffusion_models" / TINY_NAMES["transformer"][1])
    results = {}
    shown = []
    unsubscribe = h3.events.subscribe(lambda event, data: shown.append(data) if event == "progress_text" else None)
    for node_type in ("LoraLoaderModelOnly", "LoraLoaderBypassModelOnly"):
        results[node_type] = h3.run(_with_lora(t2va_prompt(steps=2, save_video=False), node_type))
    unsubscribe()
    ordinary, bypass = (probe(results[t], "probe_latent")["samples"] for t in results)
    plain = probe(h3.run(t2va_prompt(steps=2, save_video=False)), "probe_latent")["samples"]
    assert (ordinary - plain).abs().max() > 1e-3  # the adapter changes the samples
    torch.testing.assert_close(bypass, ordinary, rtol=0, atol=1e-5 * ordinary.abs().max().item())
    # What bound: three entries on the DiT, all on the side path in bypass mode, none in the ordinary one.
    for node_type, beside in (("LoraLoaderModelOnly", 0), ("LoraLoaderBypassModelOnly", 3)):
        result = results[node_type]
        (text,) = result.outputs["lora"]["text"]
        assert text == (f"tiny_lora.safetensors: DiT: 3 of 3 entries applied at 0.8 (0 projected), "
                        f"{beside} on the side path")
        (note,) = result.profile["lora"]["notes"]["adapters"]
        assert note == {"adapter": "tiny_lora.safetensors", "component": "DiT", "entries": 3, "applied": 3,
                        "projected": 0, "side_path": beside, "strength": 0.8, "not_loaded": None}
    # The editor shows the same line on the node (a progress text).
    assert [data["text"] for data in shown if data["node"] == "lora"] == [
        results[t].outputs["lora"]["text"][0] for t in results]


def test_lora_loader_reports_each_component_and_a_model_only_load_names_what_it_left(h3):
    models = h3.paths.models
    write_tiny_lora(models / "loras" / "both.safetensors", models / "diffusion_models" / TINY_NAMES["transformer"][1],
                    text_encoder_file=models / "text_encoders" / TINY_NAMES["text_encoder"][1])
    prompt = t2va_prompt(save_video=False)
    prompt["both"] = {"class_type": "LoraLoaderBypass", "inputs": {
        "model": ["unet", 0], "clip": ["clip", 0], "lora_name": "both.safetensors", "strength_model": 1.0,
        "strength_clip": 0.0}}
    prompt["model_only"] = {"class_type": "LoraLoaderModelOnly", "inputs": {
        "model": ["unet", 0], "lora_name": "both.safetensors", "strength_model": 1.0}}
    prompt["p_both"] = {"class_type": "TestOutput", "inputs": {"value": ["both", 0]}}
    prompt["p_only"] = {"class_type": "TestOutput", "inputs": {"value": ["model_only", 0]}}
    result = h3.run(prompt)
    assert result.outputs["both"]["text"] == [
        "both.safetensors: DiT: 3 of 3 entries applied at 1 (0 projected), 3 on the side path; "
        "text encoder: 1 entries not applied (strength_clip is 0)"]
    assert result.outputs["model_only"]["text"] == [
        "both.safetensors: DiT: 3 of 3 entries applied at 1 (0 projected), 0 on the side path; "
        "text encoder: 1 entries not applied (this node loads the model only)"]
    notes = result.profile["both"]["notes"]["adapters"]
    assert [n["component"] for n in notes] == ["DiT", "text encoder"] and notes[1]["applied"] == 0
    # The same prompt again: the loaders are served from the output cache, and their rows keep what bound.
    for probe_id in ("p_both", "p_only"):  # a new label, so the probes run and ask for the loaders' values
        prompt[probe_id]["inputs"]["label"] = "again"
    again = h3.run(prompt)
    for node_id in ("both", "model_only"):
        assert again.profile[node_id]["cached"] is True
        assert again.profile[node_id]["notes"] == result.profile[node_id]["notes"]


def test_a_file_of_which_nothing_applies_is_an_error_naming_the_input(h3):
    tensors = {"text_encoder.layers.0.attn.qkv_proj.lora_A.weight": torch.zeros(2, 8),
               "text_encoder.layers.0.attn.qkv_proj.lora_B.weight": torch.zeros(8, 2)}
    (h3.paths.models / "loras").mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(h3.paths.models / "loras" / "te_only.safetensors"))
    for node_type in ("LoraLoaderModelOnly", "LoraLoaderBypassModelOnly"):
        prompt = t2va_prompt(save_video=False)
        prompt["lora"] = {"class_type": node_type, "inputs": {
            "model": ["unet", 0], "lora_name": "te_only.safetensors", "strength_model": 1.0}}
        prompt["p"] = {"class_type": "TestOutput", "inputs": {"value": ["lora", 0]}}
        node, message = h3.run_error(prompt)
        assert node == node_type
        assert "input 'lora_name'" in message and "te_only.safetensors" in message and "1 for the text encoder" in message


def test_strength_zero_returns_the_model_unchanged_without_reading_the_file(h3):
    prompt = t2va_prompt(save_video=False)
    prompt["lora"] = {"class_type": "LoraLoaderBypassModelOnly", "inputs": {
        "model": ["unet", 0], "lora_name": "broken.safetensors", "strength_model": 0.0}}
    prompt["p"] = {"class_type": "TestOutput", "inputs": {"value": ["lora", 0]}}
    (h3.paths.models / "loras").mkdir(parents=True, exist_ok=True)
    # A down factor without its up factor: loading this file is refused, so a success means it was not read.
    save_file({"x.lora_A.weight": torch.zeros(1, 1)}, str(h3.paths.models / "loras" / "broken.safetensors"))
    result = h3.run(prompt)
    assert "lora" not in result.outputs and "notes" not in result.profile["lora"]


def _int8_transformer(models) -> str:
    """The tiny transformer with its block linears stored int8-convrot, as the released DiTs; returns its name."""
    from safetensors import safe_open

    from models.quant.writer import RELEASED_INT8_LAYERS, quantize_state_dict, save_quantized

    source = models / "diffusion_models" / TINY_NAMES["transformer"][1]
    with safe_open(str(source), framework="pt") as handle:
        state = {key: handle.get_tensor(key) for key in handle.keys()}
        metadata = dict(handle.metadata())
    state, quant_metadata = quantize_state_dict(state, RELEASED_INT8_LAYERS["h3_transformer"], "int8_tensorwise",
                                                rotation_group=256)
    save_quantized(str(models / "diffusion_models" / "tiny_int8.safetensors"), state, {**metadata, **quant_metadata})
    return "tiny_int8.safetensors"


def test_merge_adapters_on_int8_samples_what_the_side_path_does_and_reports_the_rounding_it_adds(h3):
    from safetensors.torch import load_file

    from models.ops import QuantizedLinear

    models = h3.paths.models
    write_tiny_lora(models / "loras" / "tiny_lora.safetensors", models / "diffusion_models" / TINY_NAMES["transformer"][1])
    prompt = _with_lora(t2va_prompt(save_video=False), "LoraLoaderModelOnly")
    prompt["unet"]["inputs"]["unet_name"] = _int8_transformer(models)
    # A second sampler on the merged model, beside the one on the model with the LoRA on the side path.
    prompt["merge"] = {"class_type": "MergeAdapters", "inputs": {"model": ["lora", 0]}}
    prompt["guider_merged"] = {"class_type": "BasicGuider", "inputs": {"model": ["merge", 0],
                                                                        "conditioning": ["text", 0]}}
    prompt["sample_merged"] = dict(prompt["sample"], inputs={**prompt["sample"]["inputs"],
                                                             "guider": ["guider_merged", 0]})
    prompt["probe_merged"] = {"class_type": "TestOutput", "inputs": {"value": ["sample_merged", 0]}}
    prompt["probe_model"] = {"class_type": "TestOutput", "inputs": {"value": ["merge", 0]}}
    prompt["merge_none"] = {"class_type": "MergeAdapters", "inputs": {"model": ["unet", 0]}}
    prompt["probe_none"] = {"class_type": "TestOutput", "inputs": {"value": ["merge_none", 0]}}
    result = h3.run(prompt)
    side, merged = probe(result, "probe_latent")["samples"], probe(result, "probe_merged")["samples"]
    assert not torch.equal(side, merged)  # the merged weights were requantized
    torch.testing.assert_close(merged, side, rtol=0, atol=2e-2 * side.abs().max().item())
    # The reported rounding, recomputed from the file's factors and the merged copies' stored codes.
    handle = probe(result, "probe_model")
    (note,) = result.profile["merge"]["notes"]["merge"]
    tensors = load_file(str(models / "loras" / "tiny_lora.safetensors"))
    layers = ("blocks.0.attn.qkv_proj", "blocks.1.mlp.fc2", "blocks.1.attn.out_proj")
    assert set(note["errors"]) == set(layers) and note["requantized"] == note["weights"] == 3
    for layer in layers:
        base, copy = handle.base.get_submodule(layer), handle.model.get_submodule(layer)
        assert isinstance(copy, QuantizedLinear) and copy is not base
        delta = tensors[f"diffusion_model.{layer}.lora_B.weight"] @ tensors[f"diffusion_model.{layer}.lora_A.weight"]
        exact = base.dequantized_weight() + 0.8 * delta
        error = ((copy.dequantized_weight() - exact).abs().max() / exact.abs().max()).item()
        assert note["errors"][layer] == pytest.approx(error, rel=1e-5)
        assert 0 < error < 0.02  # half an int8 step at most, against the layer's largest value
    assert note["largest_error"] == max(note["errors"].values())
    assert note["adapters"] == [{"adapter": "tiny_lora.safetensors", "strength": 0.8}]
    (text,) = result.outputs["merge"]["text"]
    assert text.startswith("merged 1 adapter (tiny_lora.safetensors at 0.8) into 3 weights, 3 of them requantized; "
                           f"largest error {note['largest_error']:.3%}")
    # A model without adapters passes through, saying so.
    assert probe(result, "probe_none").model is handle.base
    assert result.outputs["merge_none"]["text"] == ["nothing to merge: no adapter is loaded on this model"]
