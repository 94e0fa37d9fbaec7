"""H3 workflows published by users (tests/data/community/, where the README says where each comes from) convert,
validate and run in Weft as they were published, on the tiny released-format files.

They are UI-format workflows built on the official H3 templates. Three put ComfyUI's `EasyCache` between the
diffusion-model loader and the scheduler and guider (two inside the template's subgraph, one in a flat r2v
graph), one is the t2v template set up for 8 GB cards. Their loaders name the released model files
(`minimax_h3_fl2va_pruned_int8_convrot.safetensors`, ...), and the tiny released-format set is written under
exactly those names, so no model file name has to be changed: the tests check that instead of substituting.
All four run end to end; the three with EasyCache count computed and skipped steps in the job's profile.

What a test changes, and nothing else: the input files the workflows name are written small (a flat picture,
a short video); the r2v workflow's LoadVideo, published empty for the user to pick a clip, is given one; and
for a run, what tests/test_templates.py changes in the official templates (megapixels 0.1, duration 0.2 s:
5 frames) plus the BasicScheduler's step count.

The two turbo workflows need the ComfyUI-MiniMax-H3-Turbo pack's nodes, a third-party pack that is not
ComfyUI core; Weft refuses them at conversion, naming those nodes.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from execution.convert import ui_to_api
from execution.errors import PromptError
from models.h3.sampling import sigmas
from tests.nodes.test_step_cache import transformer_sigmas  # noqa: F401 (fixture)
from tests.test_templates import (  # noqa: F401 (fixtures)
    TEXT_ENCODER, add_inputs, check_outputs, configured_paths, env, fit_to_tiny, listed_model_files, nodes_of,
    released_models,
)

COMMUNITY = Path(__file__).resolve().parent / "data" / "community"
I2V_EASYCACHE = "huyikai/video_minimax_h3_i2v_easycache.json"
T2V_8GB = "huyikai/video_minimax_h3_t2v_8gb.json"
I2V_EASYCACHE_FAST = "grawthings/minimax_h3_i2v_easycache.json"
R2V_EASYCACHE_FAST = "grawthings/minimax_h3_r2v_easycache.json"
VALID = [I2V_EASYCACHE, T2V_8GB, I2V_EASYCACHE_FAST, R2V_EASYCACHE_FAST]
# File -> the EasyCache widgets it was published with (reuse_threshold, start_percent, end_percent, verbose).
EASYCACHE = {I2V_EASYCACHE: (0.2, 0.15, 0.95, False), I2V_EASYCACHE_FAST: (0.2, 0.15, 0.95, True),
             R2V_EASYCACHE_FAST: (0.2, 0.15, 0.95, True)}
# The node types of the third-party ComfyUI-MiniMax-H3-Turbo pack, and the workflows that need them.
TURBO_NODES = {"MiniMaxH3TurboLoRA", "MiniMaxH3TurboSampler"}
REFUSED = ["huyikai/video_minimax_h3_i2v_turbo.json", "huyikai/video_minimax_h3_t2v_turbo.json"]
REFERENCE_CLIP = "community_reference.mp4"    # given to the r2v workflow's LoadVideo, published empty
RUN_STEPS = 8


def load(name: str) -> dict:
    return json.loads((COMMUNITY / name).read_text(encoding="utf-8"))


def community_prompt(env, name: str) -> dict:
    """The workflow as an API prompt, with the input files it names written small."""
    prompt = ui_to_api(load(name), env.registry)
    for node_id in nodes_of(prompt, "LoadVideo"):
        if prompt[node_id]["inputs"]["file"] == "":
            prompt[node_id]["inputs"]["file"] = REFERENCE_CLIP
    add_inputs(env, prompt)
    return prompt


def _link_rows(graph: dict) -> dict[int, tuple]:
    rows = {}
    for link in graph["links"]:
        if isinstance(link, dict):
            link = [link[key] for key in ("id", "origin_id", "origin_slot", "target_id", "target_slot", "type")]
        rows[link[0]] = tuple(link[1:5])
    return rows


# ---------------------------------------------------------------------- the stored files
def test_every_stored_workflow_is_listed_and_its_links_agree_with_its_slots():
    stored = sorted(str(path.relative_to(COMMUNITY)) for path in COMMUNITY.glob("*/*.json"))
    assert stored == sorted(VALID + REFUSED)
    readme = (COMMUNITY / "README.md").read_text(encoding="utf-8")
    for name in stored:
        assert f"`{name}`" in readme
        workflow = load(name)
        for graph in [workflow] + workflow.get("definitions", {}).get("subgraphs", []):
            rows = _link_rows(graph)
            for node in graph["nodes"]:
                for slot, entry in enumerate(node.get("inputs", [])):
                    if entry.get("link") is not None:
                        assert rows[entry["link"]][2:] == (node["id"], slot), (name, node["id"], slot)
                for slot, entry in enumerate(node.get("outputs", [])):
                    for link in entry.get("links") or []:
                        assert rows[link][:2] == (node["id"], slot), (name, node["id"], slot)


# ---------------------------------------------------------------------- what validates
@pytest.mark.parametrize("name", VALID)
def test_community_workflow_converts_and_validates_naming_the_released_files(env, name):
    prompt = community_prompt(env, name)
    validated = env.validate(prompt)
    (save,) = nodes_of(prompt, "SaveVideo")
    assert save in validated.outputs
    named = listed_model_files(prompt)
    assert {file for folder, file in named if folder == "text_encoders"} == {TEXT_ENCODER}
    assert all((env.paths.models / folder / file).is_file() for folder, file in named), named
    easycache = nodes_of(prompt, "EasyCache")
    if name not in EASYCACHE:
        assert not easycache
        return
    (cache,) = easycache
    inputs = prompt[cache]["inputs"]
    assert (inputs["reuse_threshold"], inputs["start_percent"], inputs["end_percent"], inputs["verbose"]) == \
        EASYCACHE[name]
    (loader,) = nodes_of(prompt, "UNETLoader")
    assert inputs["model"] == [loader, 0]
    # Everything that takes the model takes the patched one.
    takers = nodes_of(prompt, "BasicScheduler") + nodes_of(prompt, "BasicGuider")
    assert [prompt[n]["inputs"]["model"] for n in takers] == [[cache, 0]] * 2


def test_the_validate_command_accepts_the_easycache_workflow(env):
    from tests.test_main import run_cli

    add_inputs(env, ui_to_api(load(I2V_EASYCACHE), env.registry))
    done = run_cli("validate", COMMUNITY / I2V_EASYCACHE, "--base-directory", env.paths.base)
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads(done.stdout)["valid"] is True


@pytest.mark.parametrize("name", REFUSED)
def test_turbo_workflows_are_refused_naming_the_third_party_nodes(env, name):
    with pytest.raises(PromptError) as refused:
        ui_to_api(load(name), env.registry)
    message = str(refused.value)
    assert "not registered" in message
    assert set(re.findall(r"'([^']+)' \(node #", message)) == TURBO_NODES, message


# ---------------------------------------------------------------------- what runs
@pytest.mark.parametrize("name", VALID)
def test_community_workflow_runs_and_reports_computed_and_skipped_steps(env, name, transformer_sigmas):
    prompt = community_prompt(env, name)
    changed = fit_to_tiny(prompt, turbo=False)
    assert all(key.endswith((".megapixels", ".value", ".steps")) for key in changed), changed
    (scheduler,) = nodes_of(prompt, "BasicScheduler")
    prompt[scheduler]["inputs"]["steps"] = RUN_STEPS
    result = env.run(prompt)
    check_outputs(env, prompt, result)
    (sampler,) = [row for row in result.profile.values() if row["class_type"] == "SamplerCustomAdvanced"]
    if name not in EASYCACHE:
        assert "counts" not in sampler and len(transformer_sigmas) == RUN_STEPS
        return
    counts = sampler["counts"]
    assert counts["steps_computed"] + counts["steps_skipped"] == RUN_STEPS
    assert counts["model_calls"] == counts["steps_computed"] == len(transformer_sigmas)
    assert counts["steps_skipped"] >= 1
    # The first step is before start_percent and the last after end_percent: both are computed.
    schedule = sigmas(RUN_STEPS, shift=12.0, scheduler=prompt[scheduler]["inputs"]["scheduler"])
    assert transformer_sigmas[0] == pytest.approx(float(schedule[0]))
    assert transformer_sigmas[-1] == pytest.approx(float(schedule[-2]))
