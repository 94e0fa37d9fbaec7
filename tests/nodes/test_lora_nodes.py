"""The LoRA loader nodes: the bypass pair's ComfyUI interface, the same samples through the bypass (side
path) and the ordinary loader, and the report of what bound (node text, UI output, profile notes)."""
from __future__ import annotations

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
