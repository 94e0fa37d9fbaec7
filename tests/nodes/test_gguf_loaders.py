"""The ComfyUI-GGUF loader nodes: their ids, inputs and folders, and the bundled GGUF workflow run unchanged.

The models folder holds what `python -m models.h3.make_tiny --released-formats` writes, which includes
the tiny pruned DiT and Qwen3-VL encoder as GGUF files (models/h3/tiny_released.py).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from execution.convert import ui_to_api
from execution.errors import PromptError
from models.h3.tiny_released import GGUF_TEXT_ENCODER, GGUF_TRANSFORMER
from tests.nodes.test_h3_nodes import configured_paths, mp4_streams  # noqa: F401 (configured_paths is a fixture)
from tests.test_templates import env, nodes_of, released_models  # noqa: F401 (fixtures)

WORKFLOW = Path(__file__).resolve().parents[2] / "workflows" / "h3_t2va_gguf.json"


def _inputs(registry, node_id):
    return {spec.name: spec for spec in registry.get(node_id).inputs}


def test_the_packs_node_ids_inputs_and_choices(registry):
    for node_id in ("UnetLoaderGGUF", "UnetLoaderGGUFAdvanced", "CLIPLoaderGGUF", "DualCLIPLoaderGGUF"):
        spec = registry.get(node_id)
        assert spec.category == "bootleg" and spec.python_module == "custom_nodes.ComfyUI-GGUF"
        assert [o.type for o in spec.outputs] == (["MODEL"] if node_id.startswith("Unet") else ["CLIP"])
    assert list(_inputs(registry, "UnetLoaderGGUF")) == ["unet_name"]
    advanced = _inputs(registry, "UnetLoaderGGUFAdvanced")
    assert list(advanced) == ["unet_name", "dequant_dtype", "patch_dtype", "patch_on_device"]
    for name in ("dequant_dtype", "patch_dtype"):
        assert advanced[name].choice_list() == ["default", "target", "float32", "float16", "bfloat16"]
        assert advanced[name].options["default"] == "default"
    assert advanced["patch_on_device"].type == "BOOLEAN" and advanced["patch_on_device"].options["default"] is False
    clip = _inputs(registry, "CLIPLoaderGGUF")
    assert list(clip) == ["clip_name", "type"] and "minimax" in clip["type"].choice_list()
    assert list(_inputs(registry, "DualCLIPLoaderGGUF")) == ["clip_name1", "clip_name2", "type"]


def test_unet_choices_are_gguf_files_of_both_folders_and_clip_choices_mix_both_kinds(env):
    models = env.paths.models
    (models / "unet").mkdir(exist_ok=True)
    (models / "unet" / "older-Q4_K.gguf").write_bytes((models / "diffusion_models" / GGUF_TRANSFORMER).read_bytes())
    (models / "clip").mkdir(exist_ok=True)
    (models / "clip" / "other.safetensors").write_bytes(b"")
    unets = _inputs(env.registry, "UnetLoaderGGUF")["unet_name"].choice_list()
    assert unets == sorted([GGUF_TRANSFORMER, "older-Q4_K.gguf"])
    clips = _inputs(env.registry, "CLIPLoaderGGUF")["clip_name"].choice_list()
    assert GGUF_TEXT_ENCODER in clips and "other.safetensors" in clips and clips == sorted(clips)
    assert "qwen3vl_32b_minimax_h3_nvfp4_awq.safetensors" in clips


def test_bundled_gguf_workflow_runs_unchanged_on_the_tiny_gguf_files(env):
    workflow = json.loads(WORKFLOW.read_text(encoding="utf-8"))
    prompt = ui_to_api(workflow, env.registry)
    assert {node["class_type"] for node in prompt.values()} >= {"UnetLoaderGGUF", "CLIPLoaderGGUF"}
    result = env.run(prompt)
    (save,) = nodes_of(prompt, "SaveVideo")
    streams = mp4_streams(env.output_file(result, save))
    assert streams["frames"] == 22 and streams["audio_codec"] == "aac" and streams["channels"] == 2


def _workflow_prompt(env):
    return ui_to_api(json.loads(WORKFLOW.read_text(encoding="utf-8")), env.registry)


def _refusal(env, prompt) -> str:
    with pytest.raises(PromptError) as error:
        env.validate(prompt)
    return json.dumps([str(error.value), error.value.node_errors if hasattr(error.value, "node_errors") else None])


def test_advanced_loader_accepts_what_weft_gives_and_refuses_other_dtypes(env):
    prompt = _workflow_prompt(env)
    (unet,) = nodes_of(prompt, "UnetLoaderGGUF")
    prompt[unet] = {"class_type": "UnetLoaderGGUFAdvanced",
                    "inputs": {"unet_name": GGUF_TRANSFORMER, "dequant_dtype": "target", "patch_dtype": "float32",
                               "patch_on_device": True}}
    env.validate(prompt)
    prompt[unet]["inputs"]["dequant_dtype"] = "float16"
    assert "UnetLoaderGGUFAdvanced: dequant_dtype 'float16' is not available" in _refusal(env, prompt)


def test_dual_loader_says_h3_takes_one_encoder(env):
    prompt = _workflow_prompt(env)
    (clip,) = nodes_of(prompt, "CLIPLoaderGGUF")
    prompt[clip] = {"class_type": "DualCLIPLoaderGGUF",
                    "inputs": {"clip_name1": GGUF_TEXT_ENCODER, "clip_name2": GGUF_TEXT_ENCODER, "type": "flux"}}
    assert "load it with CLIPLoaderGGUF (type 'minimax')" in _refusal(env, prompt)
