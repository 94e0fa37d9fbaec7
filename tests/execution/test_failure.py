"""RunFailure renders the execution_error / execution_interrupted payloads the editor reads."""
from __future__ import annotations

import torch

from execution.failure import RunFailure
from execution.graph import PromptNode

ERROR_KEYS = {"prompt_id", "node_id", "node_type", "executed", "exception_message", "exception_type", "traceback",
              "current_inputs", "current_outputs", "timestamp"}


def test_a_node_error_names_the_editor_node_and_summarises_its_inputs():
    node = PromptNode("e.3.f", "TestAdd", {}, display_id="f")
    try:
        raise ValueError("bad value")
    except ValueError as exc:
        failure = RunFailure.node_raised(node, exc, {"a": [torch.zeros(2, 3)], "b": [1, 2], "s": ["x" * 300]})
    payload = failure.payload("p1", ["a", "b"])
    assert failure.event == "execution_error"
    assert payload.keys() == ERROR_KEYS | {"real_node_id"}
    assert payload["node_id"] == "f" and payload["real_node_id"] == "e.3.f" and payload["node_type"] == "TestAdd"
    assert payload["exception_message"] == "bad value" and payload["exception_type"] == "ValueError"
    assert payload["executed"] == ["a", "b"] and "bad value" in payload["traceback"][-1]
    inputs = payload["current_inputs"]
    assert inputs["a"] == "Tensor(2, 3) torch.float32" and inputs["b"] == [1, 2] and inputs["s"].endswith("...")


def test_interruption_and_faults_have_their_own_shapes():
    node = PromptNode("7", "TestSlow", {})
    interrupted = RunFailure.interrupted(node).payload("p", ["1"])
    assert RunFailure.interrupted(None).event == "execution_interrupted"
    assert interrupted.keys() == {"prompt_id", "node_id", "node_type", "executed", "timestamp"}
    assert interrupted["node_id"] == "7" and interrupted["node_type"] == "TestSlow"
    fault = RunFailure.fault(KeyError("slot")).payload("p", [])
    assert fault.keys() == ERROR_KEYS and fault["node_id"] is None and fault["exception_type"] == "KeyError"
    stuck = RunFailure.stuck(node, ["7", "8"]).payload("p", [])
    assert stuck["node_id"] == "7" and "['7', '8'] could never run" in stuck["exception_message"]
