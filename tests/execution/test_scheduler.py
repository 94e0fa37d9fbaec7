"""The scheduler through the public interface: validate + run prompts built from the testing pack."""
from __future__ import annotations

import threading
import time

import pytest

from execution.events import EventBus
from execution.scheduler import Executor, JobControl
from execution.cache import make_cache
from execution.validation import validate_prompt


def chain_prompt(length: int, start: int = 1) -> dict:
    prompt = {"0": {"class_type": "TestConst", "inputs": {"value": start}}}
    for i in range(1, length):
        prompt[str(i)] = {"class_type": "TestAdd", "inputs": {"a": [str(i - 1), 0], "b": 1}}
    prompt["out"] = {"class_type": "TestOutput", "inputs": {"value": [str(length - 1), 0]}}
    return prompt


def test_chain_runs_and_outputs(runner):
    result = runner.run(chain_prompt(5, start=10))
    assert result.status == "success"
    assert result.outputs["out"]["values"] == [14]
    assert len(result.executed) == 6


def test_unchanged_rerun_executes_nothing(runner):
    prompt = chain_prompt(20)
    runner.run(prompt)
    again = runner.run(prompt)
    assert again.executed == []
    assert again.outputs["out"]["values"] == [20]


def test_changing_one_constant_reruns_exactly_its_descendants(runner):
    prompt = {
        "a": {"class_type": "TestConst", "inputs": {"value": 1}},
        "b": {"class_type": "TestConst", "inputs": {"value": 2}},
        "ab": {"class_type": "TestAdd", "inputs": {"a": ["a", 0], "b": 0}},
        "bb": {"class_type": "TestAdd", "inputs": {"a": ["b", 0], "b": 5}},
        "sum": {"class_type": "TestMul", "inputs": {"a": ["ab", 0], "b": ["bb", 0]}},
        "o1": {"class_type": "TestOutput", "inputs": {"value": ["sum", 0]}},
        "o2": {"class_type": "TestOutput", "inputs": {"value": ["bb", 0]}},
    }
    runner.run(prompt)
    prompt["a"]["inputs"]["value"] = 3
    result = runner.run(prompt)
    assert sorted(result.executed) == sorted(["a", "ab", "sum", "o1"])
    assert result.outputs["o1"]["values"] == [21]


def test_cache_is_structural_not_by_id(runner):
    runner.run(chain_prompt(4))
    renamed = {f"x{k}": {**v, "inputs": {n: ([f"x{val[0]}", val[1]] if isinstance(val, list) else val)
                                          for n, val in v["inputs"].items()}}
               for k, v in chain_prompt(4).items()}
    result = runner.run(renamed)
    assert result.executed == []


def test_lazy_input_only_computes_chosen_branch(runner):
    prompt = {
        "good": {"class_type": "TestConst", "inputs": {"value": 7}},
        "bad": {"class_type": "TestFail", "inputs": {"value": ["good", 0], "message": "must not run"}},
        "sel": {"class_type": "TestLazySelect", "inputs": {"cond": True, "a": ["good", 0], "b": ["bad", 0]}},
        "out": {"class_type": "TestOutput", "inputs": {"value": ["sel", 0]}},
    }
    result = runner.run(prompt)
    assert result.status == "success", result.error
    assert result.outputs["out"]["values"] == [7]
    assert "bad" not in result.executed


def test_expansion_runs_its_subgraph(runner):
    prompt = {
        "c": {"class_type": "TestConst", "inputs": {"value": 10}},
        "e": {"class_type": "TestExpandAddChain", "inputs": {"value": ["c", 0], "steps": 3, "increment": 2}},
        "out": {"class_type": "TestOutput", "inputs": {"value": ["e", 0]}},
    }
    result = runner.run(prompt)
    assert result.status == "success", result.error
    assert result.outputs["out"]["values"] == [16]
    # e.start is TestConst(10), the same as node c: structurally equal, so served from the cache.
    assert sorted(n for n in result.executed if n.startswith("e.")) == ["e.add0", "e.add1", "e.add2"]
    assert "e.start" in result.cached


def test_list_mapping_and_input_is_list(runner):
    prompt = {
        "src": {"class_type": "TestListSource", "inputs": {"count": 4, "start": 1}},
        "one": {"class_type": "TestConst", "inputs": {"value": 10}},
        "add": {"class_type": "TestAdd", "inputs": {"a": ["src", 0], "b": ["one", 0]}},
        "sum": {"class_type": "TestListSum", "inputs": {"values": ["add", 0]}},
        "out": {"class_type": "TestOutput", "inputs": {"value": ["sum", 0]}},
        "each": {"class_type": "TestOutput", "inputs": {"value": ["add", 0]}},
    }
    result = runner.run(prompt)
    assert result.outputs["out"]["values"] == [11 + 12 + 13 + 14]
    assert result.outputs["each"]["values"] == [11, 12, 13, 14]
    assert result.profile["add"]["calls"] == 4


def test_shorter_list_repeats_its_last_element(runner):
    prompt = {
        "x": {"class_type": "TestListSource", "inputs": {"count": 3, "start": 0}},
        "y": {"class_type": "TestListSource", "inputs": {"count": 1, "start": 100}},
        "add": {"class_type": "TestAdd", "inputs": {"a": ["x", 0], "b": ["y", 0]}},
        "out": {"class_type": "TestOutput", "inputs": {"value": ["add", 0]}},
    }
    assert runner.run(prompt).outputs["out"]["values"] == [100, 101, 102]


def test_execution_blocker_skips_consumers(runner):
    prompt = {
        "c": {"class_type": "TestConst", "inputs": {"value": 1}},
        "blk": {"class_type": "TestBlock", "inputs": {"value": ["c", 0], "block": True, "message": ""}},
        "after": {"class_type": "TestAdd", "inputs": {"a": ["blk", 0], "b": 1}},
        "out": {"class_type": "TestOutput", "inputs": {"value": ["after", 0]}},
        "other": {"class_type": "TestOutput", "inputs": {"value": ["c", 0]}},
    }
    result = runner.run(prompt)
    assert result.status == "success"
    assert "out" not in result.outputs
    assert result.outputs["other"]["values"] == [1]
    prompt["blk"]["inputs"]["message"] = "blocked on purpose"
    failed = runner.run(prompt)
    assert failed.status == "error" and "blocked on purpose" in failed.error["exception_message"]


def test_a_blocked_item_of_a_list_skips_only_its_own_calls(runner):
    prompt = {
        "src": {"class_type": "TestListSource", "inputs": {"count": 4, "start": 1}},
        "odd": {"class_type": "TestBlockOdd", "inputs": {"value": ["src", 0]}},
        "after": {"class_type": "TestAdd", "inputs": {"a": ["odd", 0], "b": 100}},
        "each": {"class_type": "TestOutput", "inputs": {"value": ["after", 0]}},
        "sum": {"class_type": "TestListSum", "inputs": {"values": ["after", 0]}},
        "total": {"class_type": "TestOutput", "inputs": {"value": ["sum", 0]}},
    }
    result = runner.run(prompt)
    assert result.status == "success", result.error
    assert result.outputs["each"]["values"] == [102, 104]  # items 1 and 3 were blocked, 2 and 4 went on
    assert result.profile["after"]["calls"] == 2
    assert "total" not in result.outputs  # a list node's one call sees a blocked item: it is skipped whole


def test_check_lazy_status_is_asked_once_per_mapped_call(runner):
    prompt = {
        "cond": {"class_type": "TestBoolList", "inputs": {"bits": "1,0"}},
        "a": {"class_type": "TestConst", "inputs": {"value": 1}},
        "b": {"class_type": "TestConst", "inputs": {"value": 2}},
        "sel": {"class_type": "TestLazySelect", "inputs": {"cond": ["cond", 0], "a": ["a", 0], "b": ["b", 0]}},
        "out": {"class_type": "TestOutput", "inputs": {"value": ["sel", 0]}},
    }
    result = runner.run(prompt)
    assert result.status == "success", result.error
    assert result.outputs["out"]["values"] == [1, 2]  # the second item needed b, which the first did not


def test_a_raw_link_input_gets_the_link_and_waits_for_its_source(runner):
    prompt = {
        "c": {"class_type": "TestConst", "inputs": {"value": 5}},
        "raw": {"class_type": "TestRawLink", "inputs": {"source": ["c", 0]}},
        "out": {"class_type": "TestOutput", "inputs": {"value": ["raw", 0]}},
    }
    result = runner.run(prompt)
    assert result.status == "success", result.error
    assert result.outputs["out"]["values"] == ["c:0:TestConst"]
    assert "c" in result.executed


def test_async_node(runner):
    prompt = {
        "c": {"class_type": "TestConst", "inputs": {"value": 1}},
        "a1": {"class_type": "TestAsyncAdd", "inputs": {"a": ["c", 0], "b": 2}},
        "a2": {"class_type": "TestAsyncAdd", "inputs": {"a": ["c", 0], "b": 3}},
        "m": {"class_type": "TestMul", "inputs": {"a": ["a1", 0], "b": ["a2", 0]}},
        "out": {"class_type": "TestOutput", "inputs": {"value": ["m", 0]}},
    }
    assert runner.run(prompt).outputs["out"]["values"] == [12]


def test_node_exception_ends_job_with_structured_error(runner):
    prompt = {
        "c": {"class_type": "TestConst", "inputs": {"value": 1}},
        "f": {"class_type": "TestFail", "inputs": {"value": ["c", 0], "message": "kaput"}},
        "out": {"class_type": "TestOutput", "inputs": {"value": ["f", 0]}},
    }
    result = runner.run(prompt)
    assert result.status == "error"
    error = result.error
    assert error["node_id"] == "f" and error["node_type"] == "TestFail"
    assert error["exception_type"] == "RuntimeError" and error["exception_message"] == "kaput"
    assert error["traceback"] and error["current_inputs"]["value"] == 1
    # The executor is still usable afterwards.
    assert runner.run(chain_prompt(3)).status == "success"


def test_not_idempotent_and_nan_fingerprint_always_run(runner):
    prompt = {
        "n": {"class_type": "TestNotIdempotent", "inputs": {"value": 1}},
        "o1": {"class_type": "TestOutput", "inputs": {"value": ["n", 0]}},
        "z": {"class_type": "TestAlwaysChanged", "inputs": {"value": 2}},
        "o2": {"class_type": "TestOutput", "inputs": {"value": ["z", 0]}},
    }
    runner.run(prompt)
    again = runner.run(prompt)
    assert "z" in again.executed and "o2" in again.executed
    assert "n" not in again.executed  # same id, same inputs: cached (the id is part of its key)


def test_interrupt_between_and_inside_nodes(registry, paths):
    executor = Executor(registry, cache=make_cache("none"), paths=paths)
    prompt = {
        "c": {"class_type": "TestConst", "inputs": {"value": 1}},
        "s1": {"class_type": "TestSlow", "inputs": {"value": ["c", 0], "seconds": 2.0}},
        "s2": {"class_type": "TestSlow", "inputs": {"value": ["s1", 0], "seconds": 2.0}},
        "out": {"class_type": "TestOutput", "inputs": {"value": ["s2", 0]}},
    }
    control = JobControl()
    timer = threading.Timer(0.3, control.interrupt)
    timer.start()
    started = time.monotonic()
    result = executor.run(validate_prompt(prompt, registry), prompt_id="job", control=control)
    assert result.status == "interrupted"
    assert result.error["node_id"] == "s1"
    assert time.monotonic() - started < 1.9  # stopped inside s1's progress callback, not after it


def test_events_name_their_job(registry, paths):
    bus = EventBus()
    seen = []
    bus.subscribe(lambda event, data: seen.append((event, data)))
    executor = Executor(registry, cache=make_cache("classic"), events=bus, paths=paths)
    executor.run(validate_prompt(chain_prompt(3), registry), prompt_id="p1")
    kinds = [e for e, _ in seen]
    assert kinds[0] == "execution_start" and "execution_success" in kinds and "executed" in kinds
    assert all(d.get("prompt_id") == "p1" for _, d in seen)
    executor.run(validate_prompt(chain_prompt(3), registry), prompt_id="p2")
    cached = [d for e, d in seen if e == "execution_cached" and d["prompt_id"] == "p2"]
    assert cached and "out" in cached[0]["nodes"]


def test_intermediates_are_released(registry, paths):
    executor = Executor(registry, cache=make_cache("none"), paths=paths)
    from execution.readiness import Readiness

    states = []
    original = Readiness.complete

    def spy(self, slot, outputs, ui, notes=None):
        original(self, slot, outputs, ui, notes)
        states.append(self.held_values())

    Readiness.complete = spy
    try:
        executor.run(validate_prompt(chain_prompt(50), registry), prompt_id="p")
    finally:
        Readiness.complete = original
    assert max(states) <= 2  # a chain holds at most the value being consumed


def test_profile_records_each_node(runner):
    result = runner.run(chain_prompt(3))
    for node_id in ("0", "1", "2", "out"):
        row = result.profile[node_id]
        assert {"wall_ms", "cpu_ms", "peak_rss_growth_bytes", "cached"} <= row.keys()


def wide_prompt(leaves: int) -> dict:
    """A binary tree of sums over `leaves` constants, one output at the root."""
    prompt = {f"l{i}": {"class_type": "TestConst", "inputs": {"value": i}} for i in range(leaves)}
    level, counter = list(prompt), 0
    while len(level) > 1:
        nxt = []
        for j in range(0, len(level) - 1, 2):
            prompt[f"s{counter}"] = {"class_type": "TestAdd", "inputs": {"a": [level[j], 0], "b": [level[j + 1], 0]}}
            nxt.append(f"s{counter}")
            counter += 1
        level = nxt + ([level[-1]] if len(level) % 2 else [])
    prompt["out"] = {"class_type": "TestOutput", "inputs": {"value": [level[0], 0]}}
    return prompt


@pytest.mark.parametrize("cache_kind", ["classic", "lru", "ram"])
def test_an_unchanged_rerun_keeps_every_node_cached_for_the_next_change(registry, paths, cache_kind):
    """The unchanged re-run stops at the cached output; the nodes behind it must stay cached, so
    changing one leaf afterwards runs only that leaf's path to the output."""
    from tests.conftest import Runner

    runner = Runner(registry, paths, cache_kind)
    if cache_kind == "lru":
        runner.executor.cache.max_entries = 1000
    prompt = wide_prompt(16)
    assert len(runner.run(prompt).executed) == len(prompt)
    assert runner.run(prompt).executed == []
    prompt["l5"]["inputs"]["value"] = 100
    result = runner.run(prompt)
    assert sorted(result.executed) == sorted(["l5", "s2", "s9", "s12", "s14", "out"])
    assert result.outputs["out"]["values"] == [sum(range(16)) - 5 + 100]


def test_a_validated_prompt_runs_again_unchanged_by_its_runs(registry, paths):
    """A run adds expansion nodes to its own copy of the graph: the validated prompt can run again
    (the validation memo hands out the same one for an unchanged prompt)."""
    from execution.paths import Paths

    prompt = {
        "v": {"class_type": "TestConst", "inputs": {"value": 5}},
        "e": {"class_type": "TestExpandAddChain", "inputs": {"value": ["v", 0], "steps": 3, "increment": 2}},
        "o": {"class_type": "TestOutput", "inputs": {"value": ["e", 0]}},
    }
    validated = validate_prompt(prompt, registry)
    nodes_before = dict(validated.prompt.nodes)
    for attempt in range(2):  # a fresh executor each time: nothing cached, the expansion runs again
        executor = Executor(registry, cache=make_cache("none"), paths=paths)
        result = executor.run(validated, prompt_id=f"p{attempt}")
        assert result.status == "success", result.error
        assert result.outputs["o"]["values"] == [11]
        assert any(node_id.startswith("e.") for node_id in result.executed)
        assert validated.prompt.nodes == nodes_before


def test_signatures_reused_across_runs_still_follow_fingerprints(runner):
    """Re-running the same validated prompt reuses structural signatures, but a node with a NaN
    fingerprint, and everything downstream of it, still runs every time."""
    prompt = {
        "c": {"class_type": "TestConst", "inputs": {"value": 3}},
        "z": {"class_type": "TestAlwaysChanged", "inputs": {"value": 2}},
        "sum": {"class_type": "TestAdd", "inputs": {"a": ["c", 0], "b": ["z", 0]}},
        "o": {"class_type": "TestOutput", "inputs": {"value": ["sum", 0]}},
        "oc": {"class_type": "TestOutput", "inputs": {"value": ["c", 0], "label": "const"}},
    }
    runner.run(prompt)
    for _ in range(2):
        again = runner.run(prompt)
        assert sorted(again.executed) == ["o", "sum", "z"]
        assert again.outputs["o"]["values"] == [5]
    assert runner.memo.hits == 2


def test_each_node_ends_its_run_released_and_the_state_prints(registry, paths, monkeypatch):
    from execution.readiness import Phase, Readiness

    made: list[Readiness] = []
    original_init = Readiness.__init__

    def remember(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(Readiness, "__init__", remember)
    executor = Executor(registry, cache=make_cache("classic"), paths=paths)
    executor.run(validate_prompt(chain_prompt(5), registry), prompt_id="p1")
    first = made[-1]
    assert {slot.phase for slot in first.slots.values()} == {Phase.RELEASED}
    assert first.pending == 0 and not first.ready
    assert "released 6" in str(first)  # five in the chain and its output
    executor.run(validate_prompt(chain_prompt(5), registry), prompt_id="p2")
    second = made[-1]
    # The unchanged re-run is served at its output: the sources are never needed, so they stay idle.
    assert second.slots["out"].phase is Phase.RELEASED
    assert {second.slots[n].phase for n in ("0", "1", "2", "3")} == {Phase.IDLE}


def test_a_plain_execute_returning_an_awaitable_fails_its_node(paths):
    from nodes.registry import NodeRegistry
    from nodes.spec import NodeSpec, Output

    async def later():
        return (1,)

    pending = []

    def sneaky():
        pending.append(later())
        return pending[-1]

    reg = NodeRegistry()
    reg.register(NodeSpec("Sneaky", sneaky, outputs=[Output("INT")], output_node=True))
    result = Executor(reg, cache=make_cache("none"), paths=paths).run(
        validate_prompt({"s": {"class_type": "Sneaky", "inputs": {}}}, reg), prompt_id="p")
    for coroutine in pending:
        coroutine.close()
    assert result.status == "error"
    assert result.error["node_id"] == "s" and result.error["exception_type"] == "TypeError"
    assert "non-async execute" in result.error["exception_message"]
