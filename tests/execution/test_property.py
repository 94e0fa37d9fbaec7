"""Property test: random DAGs with lazy and expanding nodes give the same outputs as a naive executor."""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from execution.cache import make_cache
from execution.scheduler import Executor
from execution.validation import validate_prompt


@st.composite
def random_dags(draw):
    count = draw(st.integers(min_value=1, max_value=18))
    prompt = {}
    for i in range(count):
        kinds = ["const"] if i == 0 else ["const", "add", "mul", "lazy", "expand", "async"]
        kind = draw(st.sampled_from(kinds))
        earlier = lambda: [str(draw(st.integers(0, i - 1))), 0]  # noqa: E731
        if kind == "const":
            prompt[str(i)] = {"class_type": "TestConst", "inputs": {"value": draw(st.integers(-50, 50))}}
        elif kind == "add":
            b = earlier() if draw(st.booleans()) else draw(st.integers(-5, 5))
            prompt[str(i)] = {"class_type": "TestAdd", "inputs": {"a": earlier(), "b": b}}
        elif kind == "mul":
            prompt[str(i)] = {"class_type": "TestMul", "inputs": {"a": earlier(), "b": earlier()}}
        elif kind == "lazy":
            prompt[str(i)] = {"class_type": "TestLazySelect",
                              "inputs": {"cond": draw(st.booleans()), "a": earlier(), "b": earlier()}}
        elif kind == "expand":
            prompt[str(i)] = {"class_type": "TestExpandAddChain",
                              "inputs": {"value": earlier(), "steps": draw(st.integers(1, 4)),
                                         "increment": draw(st.integers(-3, 3))}}
        else:
            prompt[str(i)] = {"class_type": "TestAsyncAdd", "inputs": {"a": earlier(), "b": draw(st.integers(-3, 3))}}
    outputs = draw(st.lists(st.integers(0, count - 1), min_size=1, max_size=3, unique=True))
    for k, target in enumerate(outputs):
        prompt[f"out{k}"] = {"class_type": "TestOutput", "inputs": {"value": [str(target), 0]}}
    return prompt


def reference(prompt: dict) -> dict:
    """Evaluate the prompt by plain recursion over the nodes' meanings."""
    memo = {}

    def value(ref):
        return evaluate(ref[0]) if isinstance(ref, list) else ref

    def evaluate(node_id):
        if node_id in memo:
            return memo[node_id]
        node = prompt[node_id]
        cls, inputs = node["class_type"], node["inputs"]
        if cls == "TestConst":
            result = inputs["value"]
        elif cls in ("TestAdd", "TestAsyncAdd"):
            result = value(inputs["a"]) + value(inputs["b"])
        elif cls == "TestMul":
            result = (value(inputs["a"]) * value(inputs["b"])) % 1000003
        elif cls == "TestLazySelect":
            result = value(inputs["a"]) if inputs["cond"] else value(inputs["b"])
        elif cls == "TestExpandAddChain":
            result = value(inputs["value"]) + inputs["steps"] * inputs["increment"]
        else:
            raise AssertionError(cls)
        memo[node_id] = result
        return result

    return {nid: [evaluate(body["inputs"]["value"][0])] for nid, body in prompt.items()
            if body["class_type"] == "TestOutput"}


@settings(max_examples=220, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(prompt=random_dags(), cache_kind=st.sampled_from(["classic", "none", "lru", "ram"]))
def test_random_dags_match_reference(registry, tmp_path_factory, prompt, cache_kind):
    from execution.paths import Paths

    executor = Executor(registry, cache=make_cache(cache_kind, lru_size=8),
                        paths=Paths(tmp_path_factory.getbasetemp()))
    expected = reference(prompt)
    first = executor.run(validate_prompt(prompt, registry), prompt_id="first")
    assert first.status == "success", first.error
    assert {k: v["values"] for k, v in first.outputs.items()} == expected
    second = executor.run(validate_prompt(prompt, registry), prompt_id="second")
    assert {k: v["values"] for k, v in second.outputs.items()} == expected
    if cache_kind == "classic":
        assert second.executed == []
