"""The runtime main.py wires, as the server and the CLI use it: Runtime.prepare (the one path from a sent or
loaded workflow to a validated prompt) and unload_models."""
from __future__ import annotations

import pytest

from execution.errors import PromptError
from tests.web.conftest import post_json
from tests.web.serve import LightRuntime, parse_args

UI_WORKFLOW = {
    "nodes": [
        {"id": 1, "type": "TestConst", "widgets_values": [5], "outputs": [{"name": "INT", "type": "INT", "links": [1]}]},
        {"id": 2, "type": "TestOutput", "inputs": [{"name": "value", "type": "*", "link": 1}], "widgets_values": [""]},
    ],
    "links": [[1, 1, 0, 2, 0, "INT"]],
}


@pytest.fixture
def runtime(tmp_path):
    return LightRuntime(parse_args(["--base-directory", str(tmp_path), "--cache-none"], light=True))


def test_ui_workflow_is_converted_adjusted_then_validated(runtime):
    def adjust(prompt):
        prompt["1"]["inputs"]["value"] = "7"

    prompt, validated = runtime.prepare(UI_WORKFLOW, adjust=adjust)
    assert prompt["2"]["inputs"]["value"] == ["1", 0]
    assert validated.outputs == ["2"] and validated.prompt.nodes["1"].inputs["value"] == 7


def test_api_prompt_passes_through_and_errors_are_prompt_errors(runtime):
    api = {"1": {"class_type": "TestConst", "inputs": {"value": 1}},
           "2": {"class_type": "TestOutput", "inputs": {"value": ["1", 0]}}}
    prompt, validated = runtime.prepare(api, partial_targets=["2"])
    assert prompt is api and validated.outputs == ["2"]
    with pytest.raises(PromptError, match="not registered"):
        runtime.prepare({"nodes": [{"id": 1, "type": "Nope"}], "links": []})


def test_server_takes_a_ui_workflow_through_the_same_path(light_server):
    status, body = post_json(light_server.url + "/prompt", {"prompt": UI_WORKFLOW})
    assert status == 200 and body["node_errors"] == {}


def test_unload_models_forgets_the_shared_model_cache(runtime):
    cache = runtime.services.shared("model_cache", dict)
    runtime.unload_models()
    assert runtime.services.shared("model_cache", dict) is not cache
