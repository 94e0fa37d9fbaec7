"""Validation: every error type in ComfyUI's shape, messages naming node, title, class and input."""
from __future__ import annotations

import json
import random

import pytest

from execution.errors import PromptError
from execution.validation import validate_prompt


def errors_of(prompt, registry):
    with pytest.raises(PromptError) as caught:
        validate_prompt(prompt, registry)
    body = caught.value.to_json()
    json.dumps(body)  # always serialisable
    return body


def only_error(body, node_id):
    return body["node_errors"][node_id]["errors"][0]


def out(src):
    return {"class_type": "TestOutput", "inputs": {"value": src}}


def test_missing_node_type_names_it(registry):
    body = errors_of({"1": {"class_type": "NoSuchNode", "inputs": {}}}, registry)
    assert body["error"]["type"] == "missing_node_type"
    assert "NoSuchNode" in body["error"]["message"] and "1" in body["error"]["message"]


def test_no_outputs(registry):
    body = errors_of({"1": {"class_type": "TestConst", "inputs": {"value": 1}}}, registry)
    assert body["error"]["type"] == "prompt_no_outputs"


def test_required_input_missing(registry):
    body = errors_of({"1": {"class_type": "TestConst", "inputs": {}, "_meta": {"title": "My const"}},
                      "2": out(["1", 0])}, registry)
    assert body["error"]["type"] == "prompt_outputs_failed_validation"
    err = only_error(body, "1")
    assert err["type"] == "required_input_missing"
    for part in ("1", "My const", "TestConst", "value"):
        assert part in err["message"]
    assert body["node_errors"]["1"]["dependent_outputs"] == ["2"]
    assert body["node_errors"]["1"]["class_type"] == "TestConst"


@pytest.mark.parametrize("link, kind", [
    (["9", 0], "bad_linked_input"),  # no such node
    (["1", 3], "bad_linked_input"),  # output index out of range
])
def test_bad_links(registry, link, kind):
    body = errors_of({"1": {"class_type": "TestConst", "inputs": {"value": 1}},
                      "2": {"class_type": "TestAdd", "inputs": {"a": link, "b": 1}}, "3": out(["2", 0])}, registry)
    err = only_error(body, "2")
    assert err["type"] == kind and "'a'" in err["message"]
    assert err["extra_info"]["input_name"] == "a"


def test_type_mismatch(registry):
    body = errors_of({"1": {"class_type": "PrimitiveString", "inputs": {"value": "x"}},
                      "2": {"class_type": "TestAdd", "inputs": {"a": ["1", 0], "b": 1}}, "3": out(["2", 0])}, registry)
    err = only_error(body, "2")
    assert err["type"] == "return_type_mismatch" and "INT" in err["message"] and "STRING" in err["message"]


def test_star_and_unions_accept(registry):
    prompt = {"1": {"class_type": "PrimitiveFloat", "inputs": {"value": 1.5}},
              "2": {"class_type": "ComfyMathExpression", "inputs": {"expression": "a*2", "values.a": ["1", 0]}},
              "3": {"class_type": "PreviewAny", "inputs": {"source": ["2", 0]}}}
    assert validate_prompt(prompt, registry).outputs == ["3"]


@pytest.mark.parametrize("value, kind", [
    ("abc", "invalid_input_type"), (1.5, "invalid_input_type"), (True, "invalid_input_type"),
])
def test_int_coercion_errors(registry, value, kind):
    body = errors_of({"1": {"class_type": "TestConst", "inputs": {"value": value}}, "2": out(["1", 0])}, registry)
    assert only_error(body, "1")["type"] == kind


def test_coercion_accepts_numeric_strings(registry):
    validated = validate_prompt({"1": {"class_type": "TestConst", "inputs": {"value": "42"}}, "2": out(["1", 0])}, registry)
    assert validated.prompt.nodes["1"].inputs["value"] == 42


def test_min_max(registry):
    small = errors_of({"1": {"class_type": "TestListSource", "inputs": {"count": -1, "start": 0}}, "2": out(["1", 0])}, registry)
    err = only_error(small, "1")
    assert err["type"] == "value_smaller_than_min" and "-1" in err["message"] and "0" in err["message"]
    big = errors_of({"1": {"class_type": "TestListSource", "inputs": {"count": 5000, "start": 0}}, "2": out(["1", 0])}, registry)
    assert only_error(big, "1")["type"] == "value_bigger_than_max"


def test_choice_list(registry):
    from nodes.registry import NodeRegistry
    from nodes.spec import Input, NodeSpec, Output

    reg = NodeRegistry()
    reg.register(NodeSpec("Pick", lambda name: (name,), inputs=[Input.combo("name", ["a", "b"], "a", folder="models/loras")],
                          outputs=[Output("STRING")]))
    reg.register(NodeSpec("Show", lambda v: None, inputs=[Input.link("v", "*")], output_node=True))
    body = errors_of({"1": {"class_type": "Pick", "inputs": {"name": "zzz"}},
                      "2": {"class_type": "Show", "inputs": {"v": ["1", 0]}}}, reg)
    err = only_error(body, "1")
    assert err["type"] == "value_not_in_list" and "models/loras" in err["message"] and "zzz" in err["message"]


def test_custom_validator(registry):
    body = errors_of({"1": {"class_type": "TestValidated", "inputs": {"value": 3}}, "2": out(["1", 0])}, registry)
    [err] = body["node_errors"]["1"]["errors"]
    # ComfyUI's shape: a fixed message, details "<input> - <the node's message>", the input named.
    assert err["type"] == "custom_validation_failed" and err["message"] == "The node's own input check refused this prompt"
    assert err["details"] == "value - value must be even, got 3"
    assert err["extra_info"]["input_name"] == "value" and err["extra_info"]["received_value"] == 3


def test_custom_validation_failure_names_each_input_the_validator_takes():
    from nodes.classic import specs_from_mappings
    from nodes.registry import NodeRegistry
    from nodes.spec import Input, NodeSpec, Output

    class Pair:
        @classmethod
        def INPUT_TYPES(cls):
            return {"required": {"a": ("INT", {}), "b": ("INT", {}), "c": ("INT", {})}}

        RETURN_TYPES = ("INT",)
        FUNCTION = "run"

        @classmethod
        def VALIDATE_INPUTS(cls, b, a):
            return False if a == b else (a < b or "a must be below b")

        def run(self, a, b, c):
            return (a + b + c,)

    def native_check(c=None, **_others):
        return True if c != 0 else "c cannot be zero"

    reg = NodeRegistry()
    reg.register_all(specs_from_mappings({"Pair": Pair}, python_module="tests.pair"))
    reg.register(NodeSpec("Native", lambda a, c: (a,), inputs=[Input.int("a", 0), Input.int("c", 1)],
                          outputs=[Output("INT")], validate_inputs=native_check))
    reg.register(NodeSpec("Show", lambda v: None, inputs=[Input.link("v", "*")], output_node=True))

    def details(class_type, inputs):
        body = errors_of({"1": {"class_type": class_type, "inputs": inputs},
                          "2": {"class_type": "Show", "inputs": {"v": ["1", 0]}}}, reg)
        errors = body["node_errors"]["1"]["errors"]
        assert {e["message"] for e in errors} == {"The node's own input check refused this prompt"}
        assert [e["details"].partition(" - ")[0] for e in errors] == [e["extra_info"]["input_name"] for e in errors]
        return [e["details"] for e in errors]

    # One error per input the validator takes, in the prompt's order; a bare False gives the name alone.
    assert details("Pair", {"a": 5, "b": 2, "c": 0}) == ["a - a must be below b", "b - a must be below b"]
    assert details("Pair", {"a": 2, "b": 2, "c": 0}) == ["a", "b"]
    # A Weft validator taking the rest through **kwargs names only the inputs it declares.
    assert details("Native", {"a": 1, "c": 0}) == ["c - c cannot be zero"]


def test_cycle_names_the_path(registry):
    body = errors_of({
        "3": {"class_type": "TestAdd", "inputs": {"a": ["5", 0], "b": 1}, "_meta": {"title": "A"}},
        "5": {"class_type": "TestAdd", "inputs": {"a": ["3", 0], "b": 1}, "_meta": {"title": "B"}},
        "9": out(["5", 0])}, registry)
    assert body["error"]["type"] == "dependency_cycle"
    message = body["error"]["message"]
    assert "3 'A' (TestAdd)" in message and "5 'B' (TestAdd)" in message and message.count("->") == 2


def test_some_outputs_valid_runs_the_rest(registry):
    validated = validate_prompt({
        "1": {"class_type": "TestConst", "inputs": {"value": 1}}, "2": out(["1", 0]),
        "3": {"class_type": "TestConst", "inputs": {}}, "4": out(["3", 0])}, registry)
    assert validated.outputs == ["2"] and "3" in validated.node_errors


def test_list_widget_values_unwrap(registry):
    validated = validate_prompt({"1": {"class_type": "PreviewAny", "inputs": {"source": {"__value__": [1, 2]}}}}, registry)
    assert validated.prompt.nodes["1"].inputs["source"] == [1, 2]


def _malformed_prompts(rng: random.Random):
    scalars = [None, 0, -1, 2**70, 1.5, float("inf"), "", "x", True, [], {}, [1], ["1"], ["1", "0"], [None, 0],
               ["1", 0, 0], {"__value__": 1}, "\x00", "../../etc/passwd", [["1", 0]], {"a": 1}]
    classes = ["TestConst", "TestAdd", "TestOutput", "TestLazySelect", "NoSuch", "", 5, None, "PreviewAny",
               "TestListSource", "TestExpandAddChain", "ComfyMathExpression", "ComfySwitchNode"]
    for _ in range(1200):
        shape = rng.randrange(6)
        if shape == 0:
            yield rng.choice(scalars)
        elif shape == 1:
            yield {str(rng.randrange(5)): rng.choice(scalars)}
        else:
            prompt = {}
            for i in range(rng.randrange(1, 6)):
                body = {"class_type": rng.choice(classes)}
                if rng.random() < 0.9:
                    body["inputs"] = {rng.choice(["value", "a", "b", "cond", "count", "source", "x", "values.a",
                                                  "switch", "on_true"]):
                                      rng.choice(scalars + [[str(rng.randrange(6)), rng.randrange(-1, 3)]])
                                      for _ in range(rng.randrange(4))}
                if rng.random() < 0.1:
                    body["_meta"] = rng.choice(scalars)
                prompt[str(i) if rng.random() < 0.9 else rng.choice(scalars and ["", " ", "1"])] = body
            yield prompt


def test_a_thousand_malformed_prompts_get_structured_errors(registry, runner):
    rng = random.Random(1234)
    refused = 0
    for prompt in _malformed_prompts(rng):
        try:
            validated = validate_prompt(prompt, registry)
        except PromptError as error:
            body = error.to_json()
            assert set(body) == {"error", "node_errors"}
            assert {"type", "message", "details", "extra_info"} <= set(body["error"])
            json.dumps(body)
            refused += 1
            continue
        result = runner.executor.run(validated, prompt_id="m")
        assert result.status in ("success", "error")
    assert refused >= 1000


# ---------------------------------------------------------------------- the validation memo
def memo_prompt(value=1) -> dict:
    return {"c": {"class_type": "TestConst", "inputs": {"value": value}},
            "a": {"class_type": "TestAdd", "inputs": {"a": ["c", 0], "b": "7"}},
            "o": out(["a", 0])}


def test_memo_gives_an_unchanged_prompt_back_without_checking_it_again(registry, monkeypatch):
    from execution import validation
    from execution.validation import ValidationMemo

    memo = ValidationMemo()
    first = validate_prompt(memo_prompt(), registry, memo=memo)
    checked = []
    monkeypatch.setattr(validation._NodeChecker, "check_node", lambda self, node: checked.append(node.id))
    data = memo_prompt()
    again = validate_prompt(data, registry, memo=memo)
    assert checked == [] and memo.hits == 1
    assert again.outputs == first.outputs and again.order == first.order
    assert again.prompt.nodes["a"].inputs["b"] == 7  # the coerced value, as validation left it
    assert again.prompt.raw is data  # hidden PROMPT inputs see the prompt as submitted now
    from execution.graph import PromptNode

    again.prompt.add(PromptNode("a.child", "TestConst", {"value": 1}, parent="a"))  # as an expansion does
    assert "a.child" in again.prompt.nodes and "a.child" not in first.prompt.nodes  # each has its own graph
    assert again.signatures is first.signatures  # signatures computed by one run serve the next


@pytest.mark.parametrize("changed", [2, 1.0, "1", True])
def test_memo_misses_when_anything_changes_even_to_an_equal_number(registry, changed):
    """1.0, "1" and True compare or coerce equal to 1, yet they are other prompts: validated afresh
    (True is no INT, so validating it again must fail)."""
    from execution.validation import ValidationMemo

    memo = ValidationMemo()
    validate_prompt(memo_prompt(1), registry, memo=memo)
    if changed is True:
        assert errors_of(memo_prompt(True), registry)["node_errors"]["c"]["errors"][0]["type"] == "invalid_input_type"
        with pytest.raises(PromptError):
            validate_prompt(memo_prompt(True), registry, memo=memo)
    else:
        result = validate_prompt(memo_prompt(changed), registry, memo=memo)
        assert result.prompt.nodes["c"].inputs["value"] == int(changed)
    assert memo.hits == 0


def test_memo_keeps_only_prompts_validated_from_the_prompt_alone(registry, monkeypatch):
    """A custom validator (or a choice list read from a folder) may answer differently next time:
    such prompts are validated every time."""
    from execution.validation import ValidationMemo
    from tests import nodes_pack

    calls = []
    original = nodes_pack.TestValidated.VALIDATE_INPUTS.__func__
    monkeypatch.setattr(nodes_pack.TestValidated, "VALIDATE_INPUTS",
                        classmethod(lambda cls, value: calls.append(value) or original(cls, value)))
    memo = ValidationMemo()
    prompt = {"1": {"class_type": "TestValidated", "inputs": {"value": 4}}, "2": out(["1", 0])}
    for _ in range(2):
        validate_prompt(prompt, registry, memo=memo)
    assert len(memo) == 0 and memo.hits == 0
    assert not registry.get("TestValidated").validation_is_pure
    assert not registry.get("LoadImage").validation_is_pure  # its choices are the input folder's files
    assert registry.get("TestAdd").validation_is_pure


def test_memo_forgets_when_the_registry_changes(registry):
    from execution.validation import ValidationMemo
    from nodes.registry import NodeRegistry
    from nodes.spec import Input, NodeSpec, Output

    reg = NodeRegistry()
    reg.register(NodeSpec("Num", lambda v: (v,), inputs=[Input.int("v", 1, max=10)], outputs=[Output("INT")]))
    reg.register(NodeSpec("Show", lambda v: None, inputs=[Input.link("v", "*")], output_node=True))
    prompt = {"1": {"class_type": "Num", "inputs": {"v": 8}}, "2": {"class_type": "Show", "inputs": {"v": ["1", 0]}}}
    memo = ValidationMemo()
    validate_prompt(prompt, reg, memo=memo)
    reg.register(NodeSpec("Num", lambda v: (v,), inputs=[Input.int("v", 1, max=5)], outputs=[Output("INT")]),
                 override=True)
    with pytest.raises(PromptError) as caught:
        validate_prompt(prompt, reg, memo=memo)
    assert "bigger than its maximum 5" in json.dumps(caught.value.to_json())
    assert memo.hits == 0


def test_a_validated_graph_is_kept_as_old_objects(registry):
    """Validation's graph is long-lived: it goes to the oldest generation instead of being scanned
    by the next young collection; an application's own frozen objects stay frozen."""
    import gc

    validated = validate_prompt(memo_prompt(), registry)
    node = validated.prompt.nodes["a"]
    assert not any(obj is node for obj in gc.get_objects(generation=0))
    assert any(obj is node for obj in gc.get_objects(generation=2))

    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        validate_prompt(memo_prompt(5), registry)
        assert gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()


def test_every_node_is_checked_once_after_its_sources(registry, monkeypatch):
    """Checks run inside the depth-first pass that orders the graph: each node once, sources first."""
    from execution import validation

    prompt = {"c": {"class_type": "TestConst", "inputs": {"value": 1}},
              "a": {"class_type": "TestAdd", "inputs": {"a": ["c", 0], "b": ["c", 0]}},
              "m": {"class_type": "TestMul", "inputs": {"a": ["a", 0], "b": ["c", 0]}},
              "unused": {"class_type": "TestConst", "inputs": {"value": 2}},
              "o": out(["m", 0])}
    checked = []
    original = validation._NodeChecker.check_node

    def spy(self, node):
        checked.append(node.id)
        return original(self, node)

    monkeypatch.setattr(validation._NodeChecker, "check_node", spy)
    validated = validate_prompt(prompt, registry)
    assert checked == validated.order == ["c", "a", "m", "o"]


def test_structural_signatures_are_kept_by_position_in_the_order(registry, paths):
    """A run keeps each node's signature at its place in the validated order, except where a
    fingerprint (here NaN: always run) decides it, on the node or upstream."""
    from execution.cache import make_cache
    from execution.scheduler import Executor

    prompt = {"c": {"class_type": "TestConst", "inputs": {"value": 3}},
              "z": {"class_type": "TestAlwaysChanged", "inputs": {"value": 2}},
              "sum": {"class_type": "TestAdd", "inputs": {"a": ["c", 0], "b": ["z", 0]}},
              "o": out(["sum", 0])}
    validated = validate_prompt(prompt, registry)
    assert validated.signatures == []
    Executor(registry, cache=make_cache("classic"), paths=paths).run(validated, prompt_id="p")
    kept = dict(zip(validated.order, validated.signatures))
    assert set(kept) == {"c", "z", "sum", "o"} and len(validated.signatures) == len(validated.order)
    assert kept["c"] is not None and kept["z"] is None and kept["sum"] is None and kept["o"] is None
