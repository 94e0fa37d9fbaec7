"""Start Loop / End Loop through the public interface: validate + run prompts, count what ran."""
from __future__ import annotations

import json
import re
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from execution.cache import make_cache
from execution.context import Services
from execution.convert import ui_to_api
from execution.errors import PromptError
from execution.events import EventBus
from execution.graph import Prompt
from execution.scheduler import Executor
from execution.validation import validate_prompt
from nodes.loops import check_loops, content_key
from tests.conftest import Runner
from web.object_info import object_info


# ---------------------------------------------------------------------- helpers
def start(mode: str = "simple", *, cache: bool = False, **sub) -> dict:
    inputs = {"mode": mode, "cache_iterations": cache}
    for key, value in sub.items():
        if key in ("initial_iteration_value", "parent_iteration"):
            inputs[key] = value
        else:
            inputs[f"mode.{key}"] = value
    return {"class_type": "StartLoop", "inputs": inputs}


def end(output=None, *, next_value=None, accumulate=False, **extra) -> dict:
    inputs = {"accumulate": accumulate, **extra}
    if output is not None:
        inputs["output_value"] = output
    if next_value is not None:
        inputs["next_iteration_value"] = next_value
    return {"class_type": "EndLoop", "inputs": inputs}


def math(expression: str, **values) -> dict:
    return {"class_type": "ComfyMathExpression",
            "inputs": {"expression": expression, **{f"values.{k}": v for k, v in values.items()}}}


def out(value) -> dict:
    return {"class_type": "TestOutput", "inputs": {"value": value}}


def ok(runner, prompt, **kwargs):
    result = runner.run(prompt, **kwargs)
    assert result.status == "success", result.error
    return result


def copies(result, end_id: str, body_id: str) -> list[int]:
    """Iterations in which the copy of `body_id` ran (ids are `<end>.<k>.<body>`)."""
    pattern = re.compile(re.escape(end_id) + r"\.(\d+)\." + re.escape(body_id) + "$")
    return [int(m.group(1)) for m in map(pattern.match, result.executed) if m]


def refused(registry, prompt, **options) -> PromptError:
    with pytest.raises(PromptError) as info:
        validate_prompt(prompt, registry, options=options or None)
    return info.value


def loop_errors(error: PromptError) -> dict[str, set[str]]:
    """node id -> the loop error types reported on it."""
    return {nid: {e["type"] for e in entry["errors"]} for nid, entry in error.node_errors.items()}


# ---------------------------------------------------------------------- schema
def test_schema_matches_comfyui_loop_nodes(registry):
    info = object_info(registry)
    s, e = info["StartLoop"], info["EndLoop"]
    mode = s["input"]["required"]["mode"]
    assert mode[0] == "COMFY_DYNAMICCOMBO_V3"
    options = {o["key"]: o["inputs"]["required"] for o in mode[1]["options"]}
    assert list(options) == ["simple", "For", "List"]
    assert list(options["simple"]) == ["num_iterations"] and options["simple"]["num_iterations"][1]["default"] == 4
    assert options["simple"]["num_iterations"][1]["min"] == 0
    assert list(options["For"]) == ["start_iteration_index", "max_iteration", "step"]
    assert options["For"]["step"][1]["min"] == 1 and options["For"]["max_iteration"][1]["max"] == 2**64 - 1
    assert list(options["List"]) == ["list"] and options["List"]["list"][0] == "COMFY_MATCHTYPE_V3"
    assert s["input"]["required"]["cache_iterations"][1]["default"] is False
    assert set(s["input"]["optional"]) == {"parent_iteration", "initial_iteration_value"}
    assert s["output_name"] == ["iteration_index", "is_first", "is_last", "list_item", "current_iteration_value"]
    assert s["output"][:3] == ["INT", "BOOLEAN", "BOOLEAN"] and s["is_input_list"] is True
    assert s["output_matchtypes"] == [None, None, None, "list_item", "carried_value"]
    assert list(e["input"]["required"]) == ["accumulate"]
    assert list(e["input"]["optional"]) == ["output_value", "next_iteration_value", "terminations", "break_when"]
    grow = e["input"]["optional"]["terminations"]
    assert grow[0] == "COMFY_AUTOGROW_V3"
    assert grow[1]["template"]["prefix"] == "termination" and grow[1]["template"]["min"] == 0
    assert grow[1]["template"]["max"] == 50 and list(grow[1]["template"]["input"]["required"]) == ["termination"]
    assert e["output_name"] == ["outputs"] and e["output_is_list"] == [True]
    assert e["display_name"] == "End Loop" and s["display_name"] == "Start Loop"
    assert s["category"] == e["category"] == "utilities/looping"


# ---------------------------------------------------------------------- modes
@pytest.mark.parametrize("count", [0, 1, 4])
def test_simple_mode_runs_count_iterations(runner, count):
    prompt = {
        "s": start("simple", num_iterations=count),
        "b": {"class_type": "TestAdd", "inputs": {"a": ["s", 0], "b": 10}},
        "e": end(["b", 0], accumulate=True),
        "o": out(["e", 0]),
    }
    result = ok(runner, prompt)
    assert result.outputs.get("o", {}).get("values", []) == [10 + i for i in range(count)]
    assert copies(result, "e", "b") == list(range(count))


def test_for_mode_with_step_three_and_empty_range(runner):
    prompt = {
        "s": start("For", start_iteration_index=2, max_iteration=11, step=3),
        "e": end(["s", 0], accumulate=True),
        "o": out(["e", 0]),
    }
    assert ok(runner, prompt).outputs["o"]["values"] == [2, 5, 8]
    prompt["s"]["inputs"]["mode.max_iteration"] = 2
    assert "o" not in ok(runner, prompt).outputs


def test_list_mode_one_iteration_per_item_and_empty_list(runner):
    prompt = {
        "text": {"class_type": "SplitTextToList", "inputs": {"text": "red\n\nblue \ngreen", "delimiter": "\\n",
                                                              "skip_empty": True}},
        "s": start("List", list=["text", 0]),
        "tag": {"class_type": "TestTag", "inputs": {"value": ["s", 3], "tag": "style"}},
        "e": end(["tag", 0], accumulate=True),
        "o": out(["e", 0]),
    }
    assert ok(runner, prompt).outputs["o"]["values"] == ["style:red", "style:blue", "style:green"]
    prompt["text"]["inputs"]["text"] = "  \n"
    result = ok(runner, prompt)
    assert "o" not in result.outputs and copies(result, "e", "tag") == []


def test_accumulate_off_returns_last_iteration_and_flags(runner):
    prompt = {
        "s": start("simple", num_iterations=3),
        "first": {"class_type": "TestRecord", "inputs": {"value": ["s", 1], "label": "first"}},
        "last": {"class_type": "TestRecord", "inputs": {"value": ["s", 2], "label": "last"}},
        "e": end(["s", 0], accumulate=False, **{"terminations.termination0": ["first", 0],
                                                "terminations.termination1": ["last", 0]}),
        "o": out(["e", 0]),
    }
    result = ok(runner, prompt)
    assert result.outputs["o"]["values"] == [2]
    assert result.outputs["first"]["values"] == [True, False, False]
    assert result.outputs["last"]["values"] == [False, False, True]


def test_carried_value_feeds_the_next_iteration(runner):
    prompt = {
        "init": {"class_type": "TestConst", "inputs": {"value": 100}},
        "s": start("simple", num_iterations=4, initial_iteration_value=["init", 0]),
        "add": {"class_type": "TestAdd", "inputs": {"a": ["s", 4], "b": 5}},
        "e": end(["s", 4], next_value=["add", 0], accumulate=True),
        "o": out(["e", 0]),
    }
    assert ok(runner, prompt).outputs["o"]["values"] == [100, 105, 110, 115]


def test_nested_loops_two_deep(runner):
    prompt = {
        "outer": start("For", start_iteration_index=0, max_iteration=3, step=1),
        "inner": start("simple", num_iterations=2, parent_iteration=["outer", 0]),
        "cell": math("a * 10 + b", a=["outer", 0], b=["inner", 0]),
        "inner_end": end(["cell", 1], accumulate=True),
        "outer_end": end(["inner_end", 0], accumulate=True),
        "o": out(["outer_end", 0]),
    }
    result = ok(runner, prompt)
    assert result.outputs["o"]["values"] == [0, 1, 10, 11, 20, 21]
    assert copies(result, "outer_end", "inner_end") == [0, 1, 2]
    assert sorted(copies(result, "outer_end.1.inner_end", "cell")) == [0, 1]


def test_break_when_ends_after_the_current_iteration(registry, paths):
    bus = EventBus()
    texts = []
    bus.subscribe(lambda event, data: texts.append(data["text"]) if event == "progress_text" else None)
    executor = Executor(registry, cache=make_cache("classic"), events=bus, paths=paths)
    prompt = {
        "s": start("simple", num_iterations=10),
        "stop": math("a >= 2", a=["s", 0]),
        "e": end(["s", 0], accumulate=True, break_when=["stop", 2]),
        "o": out(["e", 0]),
    }
    result = executor.run(validate_prompt(prompt, registry), prompt_id="b")
    assert result.status == "success", result.error
    assert result.outputs["o"]["values"] == [0, 1, 2]
    assert texts[-1] == "Iteration 3/10 (stopped by break_when)"


def test_carried_mixed_list_of_images_and_strings_passes_intact(runner):
    prompt = {
        "mixed": {"class_type": "TestMixedList", "inputs": {"size": 3}},
        "s": start("simple", num_iterations=3, initial_iteration_value=["mixed", 0]),
        # Not list-aware: called once per element, so the list comes back element by element.
        "rec": {"class_type": "TestRecord", "inputs": {"value": ["s", 4], "label": "seen"}},
        "e": end(["rec", 0], next_value=["rec", 0], accumulate=False),
        "o": out(["e", 0]),
    }
    result = ok(runner, prompt)
    first, caption, batch = result.outputs["o"]["values"]
    assert caption == "a caption"
    assert first.shape == (1, 3, 3, 3) and batch.shape == (2, 4, 3, 3)
    assert torch.equal(first, torch.arange(27, dtype=torch.float32).reshape(1, 3, 3, 3) / 27)
    assert torch.equal(batch, torch.ones(2, 4, 3, 3) * 0.25)
    assert len(result.outputs["rec"]["values"]) == 9  # 3 elements x 3 iterations
    assert result.profile["rec:TestRecord"]["calls"] == 9


def test_mixed_list_as_list_mode_items(runner):
    prompt = {
        "mixed": {"class_type": "TestMixedList", "inputs": {"size": 2}},
        "s": start("List", list=["mixed", 0]),
        "e": end(["s", 3], accumulate=True),
        "o": out(["e", 0]),
    }
    values = ok(runner, prompt).outputs["o"]["values"]
    assert [type(v).__name__ for v in values] == ["Tensor", "str", "Tensor"] and values[1] == "a caption"


# ---------------------------------------------------------------------- side effects, progress, display ids
def test_output_nodes_run_every_iteration_in_order(runner, paths):
    prompt = {
        "s": start("simple", num_iterations=4),
        "color": math("a * 65536 + 7", a=["s", 0]),
        "img": {"class_type": "EmptyImage", "inputs": {"width": 4, "height": 3, "batch_size": 1, "color": ["color", 1]}},
        "save": {"class_type": "SaveImage", "inputs": {"images": ["img", 0], "filename_prefix": "loop"}},
        # The bare slot name is accepted too; nothing uses the End's value.
        "e": {"class_type": "EndLoop", "inputs": {"accumulate": False, "termination0": ["save", 0]}},
    }
    result = ok(runner, prompt)
    files = sorted(paths.output.glob("loop_*.png"))
    assert len(files) == 4
    reds = [np.asarray(Image.open(f))[0, 0, 0] for f in files]
    blues = {int(np.asarray(Image.open(f))[0, 0, 2]) for f in files}
    assert reds == [0, 1, 2, 3] and blues == {7}
    saves = [i for i, n in enumerate(result.executed) if n.endswith(".save")]
    colors = [i for i, n in enumerate(result.executed) if n.endswith(".color")]
    assert all(saves[k] < colors[k + 1] for k in range(3))  # iteration k's save before iteration k+1 starts
    assert len(result.outputs["save"]["images"]) == 4  # the editor's node shows every iteration's image


def test_progress_iteration_k_of_n_on_start_node_and_display_ids(registry, paths):
    bus = EventBus()
    events = []
    bus.subscribe(lambda event, data: events.append((event, data)))
    executor = Executor(registry, cache=make_cache("classic"), events=bus, paths=paths)
    prompt = {
        "s": start("simple", num_iterations=3),
        "b": {"class_type": "TestAdd", "inputs": {"a": ["s", 0], "b": 1}},
        "e": end(["b", 0], accumulate=True),
        "o": out(["e", 0]),
    }
    result = executor.run(validate_prompt(prompt, registry), prompt_id="p")
    assert result.status == "success"
    texts = [d["text"] for ev, d in events if ev == "progress_text" and d["node"] == "s"]
    assert texts == ["Iteration 1/3", "Iteration 2/3", "Iteration 3/3", "Iteration 3/3 (done)"]
    progress = [(d["value"], d["max"]) for ev, d in events if ev == "progress" and d["node"] == "s"]
    assert progress == [(0, 3), (1, 3), (2, 3), (3, 3)]
    shown = {d["display_node"] for ev, d in events if ev == "executing" and d["node"] is not None}
    assert shown == {"s", "b", "e", "o"}  # every iteration node maps to an editor node


def test_error_inside_the_body_names_the_body_node(runner):
    prompt = {
        "s": start("simple", num_iterations=3),
        "f": {"class_type": "TestFail", "inputs": {"value": ["s", 0], "message": "bad frame"}},
        "e": end(["f", 0]),
        "o": out(["e", 0]),
    }
    result = runner.run(prompt)
    assert result.status == "error"
    assert result.error["node_id"] == "f" and result.error["real_node_id"] == "e.0.f"
    assert result.error["exception_message"] == "bad frame"


# ---------------------------------------------------------------------- cache_iterations
def _listed(values: list[str], *, cache: bool) -> dict:
    prompt = {
        "text": {"class_type": "SplitTextToList", "inputs": {"text": "\n".join(values), "delimiter": "\\n",
                                                              "skip_empty": True}},
        "s": start("List", cache=cache, list=["text", 0], initial_iteration_value="start"),
        "tag": {"class_type": "TestTag", "inputs": {"value": ["s", 3], "tag": "x"}},
        "e": end(["tag", 0], accumulate=True),
        "o": out(["e", 0]),
    }
    return prompt


def test_cache_iterations_reruns_only_the_changed_iteration(runner):
    items = [f"item{i}" for i in range(10)]
    first = ok(runner, _listed(items, cache=True))
    assert copies(first, "e", "tag") == list(range(10))
    again = ok(runner, _listed(items, cache=True))
    assert copies(again, "e", "tag") == [] and again.outputs == first.outputs
    items[7] = "changed"
    changed = ok(runner, _listed(items, cache=True))
    assert copies(changed, "e", "tag") == [7]
    assert changed.outputs["o"]["values"][7] == "x:changed"
    longer = ok(runner, _listed(items + ["item10", "item11"], cache=True))
    assert copies(longer, "e", "tag") == [10, 11]


def test_cache_iterations_reruns_what_depends_on_the_changed_iteration(runner):
    def chain(values):
        return {
            "text": {"class_type": "SplitTextToList", "inputs": {"text": "\n".join(values), "delimiter": "\\n",
                                                                  "skip_empty": True}},
            "s": start("List", cache=True, list=["text", 0], initial_iteration_value="seed"),
            "step": {"class_type": "TestTag", "inputs": {"value": ["s", 3], "tag": "i"}},
            "carry": {"class_type": "TestTag", "inputs": {"value": ["s", 4], "tag": ["step", 0]}},
            "e": end(["carry", 0], next_value=["carry", 0], accumulate=False),
            "o": out(["e", 0]),
        }

    items = [str(i) for i in range(10)]
    ok(runner, chain(items))
    items[7] = "seven"
    result = ok(runner, chain(items))
    assert copies(result, "e", "step") == [7]
    assert copies(result, "e", "carry") == [7, 8, 9]


def test_without_cache_iterations_every_iteration_runs_each_time(runner):
    items = [f"item{i}" for i in range(5)]
    ok(runner, _listed(items, cache=False))
    assert copies(ok(runner, _listed(items, cache=False)), "e", "tag") == [0, 1, 2, 3, 4]


def test_longer_simple_loop_keeps_cached_iterations(runner):
    def prompt(count):
        return {
            "s": start("simple", cache=True, num_iterations=count),
            "b": {"class_type": "TestAdd", "inputs": {"a": ["s", 0], "b": 3}},
            "e": end(["b", 0], accumulate=True),
            "o": out(["e", 0]),
        }

    ok(runner, prompt(5))
    assert copies(ok(runner, prompt(8)), "e", "b") == [5, 6, 7]
    assert copies(ok(runner, prompt(3)), "e", "b") == []


def test_outside_node_read_by_the_body_runs_once_without_a_cache(registry, paths):
    runner = Runner(registry, paths, cache_kind="none")
    prompt = {
        "base": {"class_type": "TestConst", "inputs": {"value": 40}},
        "s": start("simple", num_iterations=5),
        "b": {"class_type": "TestAdd", "inputs": {"a": ["base", 0], "b": 2}},
        "m": {"class_type": "TestMul", "inputs": {"a": ["b", 0], "b": ["s", 0]}},
        "e": end(["m", 0], accumulate=True),
        "o": out(["e", 0]),
    }
    result = ok(runner, prompt)
    assert result.outputs["o"]["values"] == [0, 42, 84, 126, 168]
    assert result.executed.count("base") == 1


# ---------------------------------------------------------------------- validation
def test_end_without_start(registry):
    err = refused(registry, {
        "c": {"class_type": "TestConst", "inputs": {"value": 1}},
        "e": end(["c", 0]),
        "o": out(["e", 0]),
    })
    assert err.type == "prompt_outputs_failed_validation"
    assert loop_errors(err) == {"e": {"loop_end_without_start"}}
    assert "End Loop e 'EndLoop' (EndLoop)" in err.node_errors["e"]["errors"][0]["details"]


def test_start_without_end(registry):
    err = refused(registry, {
        "s": start("simple", num_iterations=2),
        "b": {"class_type": "TestAdd", "inputs": {"a": ["s", 0], "b": 1}},
        "o": out(["b", 0]),
    })
    assert loop_errors(err) == {"s": {"loop_start_without_end"}}
    assert err.node_errors["s"]["dependent_outputs"] == ["o"]


def test_ambiguous_nesting(registry):
    err = refused(registry, {
        "s1": start("simple", num_iterations=2),
        "s2": start("simple", num_iterations=3),
        "b": {"class_type": "TestMul", "inputs": {"a": ["s1", 0], "b": ["s2", 0]}},
        "e": end(["b", 0]),
        "o": out(["e", 0]),
    })
    assert loop_errors(err) == {k: {"ambiguous_loop_nesting"} for k in ("s1", "s2", "e")}
    assert err.node_errors["e"]["errors"][0]["extra_info"]["node_ids"] == ["e", "s1", "s2"]


def test_cycle_through_end_is_refused_naming_the_end(registry):
    err = refused(registry, {
        "s": start("simple", num_iterations=2),
        "b": {"class_type": "TestAdd", "inputs": {"a": ["s", 0], "b": ["e", 0]}},
        "e": end(["b", 0]),
        "o": out(["e", 0]),
    })
    assert err.type == "dependency_cycle" and "e" in err.node_errors and "b" in err.node_errors


def test_ends_depending_on_each_other_report_loop_end_cycle(registry):
    # Called directly: validate_prompt's own cycle check would report this first (dependency_cycle).
    prompt = Prompt.from_api({
        "s1": start("simple", num_iterations=2),
        "s2": start("simple", num_iterations=2),
        "a": {"class_type": "TestAdd", "inputs": {"a": ["s1", 0], "b": ["e2", 0]}},
        "b": {"class_type": "TestAdd", "inputs": {"a": ["s2", 0], "b": ["e1", 0]}},
        "e1": end(["a", 0]),
        "e2": end(["b", 0]),
        "rec": {"class_type": "TestRecord", "inputs": {"value": ["e1", 0]}},
    })
    errors = check_loops(prompt, registry, {})
    assert {e["type"] for e in errors["e1"]} == {"loop_end_cycle"} and "e2" in errors
    assert "cycle through End Loop" in errors["e1"][0]["details"]


def test_accumulate_from_inside_the_body(registry):
    err = refused(registry, {
        "s": start("simple", num_iterations=2),
        "flag": math("a > 0", a=["s", 0]),
        "e": end(["s", 0], accumulate=["flag", 2]),
        "o": out(["e", 0]),
    })
    assert loop_errors(err)["e"] == {"loop_accumulate_from_body"}
    assert err.node_errors["e"]["errors"][0]["extra_info"]["input_name"] == "accumulate"


def test_output_node_escaping_the_loop(registry):
    err = refused(registry, {
        "s": start("simple", num_iterations=2),
        "b": {"class_type": "TestAdd", "inputs": {"a": ["s", 0], "b": 1}},
        "peek": out(["b", 0]),  # an output in the body that does not feed a termination
        "e": end(["b", 0]),
        "o": out(["e", 0]),
    })
    assert loop_errors(err) == {k: {"loop_escape"} for k in ("s", "e", "peek")}
    assert "termination" in err.node_errors["peek"]["errors"][0]["details"]


def test_iteration_cap_at_validation_and_at_run_time(registry, paths):
    prompt = {
        "s": start("simple", num_iterations=11),
        "e": end(["s", 0]),
        "o": out(["e", 0]),
    }
    err = refused(registry, prompt, max_loop_iterations=10)
    assert loop_errors(err) == {"s": {"loop_too_many_iterations"}}
    assert "11 iterations" in err.node_errors["s"]["errors"][0]["details"]
    ranged = {**prompt, "s": start("For", start_iteration_index=0, max_iteration=2**64 - 1, step=1)}
    assert loop_errors(refused(registry, ranged)) == {"s": {"loop_too_many_iterations"}}
    assert validate_prompt(prompt, registry, options={"max_loop_iterations": 11}).outputs == ["o"]
    # A list's length is known only when the loop runs: the same cap applies then.
    listed = {
        "text": {"class_type": "SplitTextToList", "inputs": {"text": "a\nb\nc\nd", "delimiter": "\\n",
                                                              "skip_empty": True}},
        "s": start("List", list=["text", 0]),
        "e": end(["s", 3]),
        "o": out(["e", 0]),
    }
    executor = Executor(registry, cache=make_cache("none"), paths=paths, runtime=Services(max_loop_iterations=3))
    result = executor.run(validate_prompt(listed, registry), prompt_id="cap")
    assert result.status == "error" and result.error["node_id"] == "s"
    assert "4 iterations" in result.error["exception_message"]


def test_unrelated_outputs_still_run_beside_a_broken_loop(registry):
    validated = validate_prompt({
        "c": {"class_type": "TestConst", "inputs": {"value": 1}},
        "e": end(["c", 0]),
        "o": out(["e", 0]),
        "fine": out(["c", 0]),
    }, registry)
    assert validated.outputs == ["fine"] and "e" in validated.node_errors


# ---------------------------------------------------------------------- scale
def test_thousand_iterations_hold_one_iteration_at_a_time(runner):
    prompt = {
        "init": {"class_type": "TestConst", "inputs": {"value": 0}},
        "s": start("simple", num_iterations=1000, initial_iteration_value=["init", 0]),
        "add": {"class_type": "TestAdd", "inputs": {"a": ["s", 4], "b": 3}},
        "size": {"class_type": "TestGraphSize", "inputs": {"value": ["add", 0]}},
        "e": end(["size", 0], next_value=["add", 0], accumulate=True),
        "o": out(["e", 0]),
    }
    validated = validate_prompt(prompt, runner.registry)
    result = runner.executor.run(validated, prompt_id=str(uuid.uuid4()))
    assert result.status == "success", result.error
    sizes = result.outputs["o"]["values"]
    assert len(sizes) == 1000
    assert max(sizes) <= min(sizes) + 2 and max(sizes) < 20  # the live graph does not grow with iterations
    assert len(validated.prompt.nodes) == len(prompt)  # and every iteration node is gone afterwards


# ---------------------------------------------------------------------- property: loop == unrolled
@st.composite
def loop_bodies(draw):
    """A random body over iteration_index (s,0) and the carried value (s,4), plus an unrolled twin."""
    size = draw(st.integers(1, 5))
    body = {}
    body_sources = [["s", 0], ["s", 4]]  # every body node reads the loop through its first input
    for i in range(size):
        kind = draw(st.sampled_from(["add", "mul", "const_add"]))
        a = draw(st.sampled_from(body_sources))
        if kind == "add":
            body[f"n{i}"] = {"class_type": "TestAdd", "inputs": {"a": a, "b": draw(st.integers(-3, 3))}}
        elif kind == "mul":
            b = draw(st.sampled_from(body_sources + [["k", 0]]))
            body[f"n{i}"] = {"class_type": "TestMul", "inputs": {"a": a, "b": b}}
        else:
            body[f"n{i}"] = {"class_type": "TestAdd", "inputs": {"a": a, "b": ["k", 0]}}
        body_sources.append([f"n{i}", 0])
    output = draw(st.sampled_from(body_sources))
    carried = draw(st.sampled_from(body_sources + [None]))
    count = draw(st.integers(0, 4))
    accumulate = draw(st.booleans())
    return body, output, carried, count, accumulate, draw(st.integers(-5, 5))


def _loop_prompt(body, output, carried, count, accumulate, initial) -> dict:
    prompt = {
        "k": {"class_type": "TestConst", "inputs": {"value": 7}},
        "init": {"class_type": "TestConst", "inputs": {"value": initial}},
        "s": start("simple", num_iterations=count, initial_iteration_value=["init", 0]),
        **body,
        "e": end(output, next_value=carried, accumulate=accumulate),
        "o": out(["e", 0]),
    }
    return prompt


def _unrolled_prompt(body, output, carried, count, accumulate, initial) -> tuple[dict, list[str]]:
    prompt = {"k": {"class_type": "TestConst", "inputs": {"value": 7}},
              "init": {"class_type": "TestConst", "inputs": {"value": initial}}}
    carry = ["init", 0]
    outputs = []
    for i in range(count):
        prompt[f"i{i}"] = {"class_type": "TestConst", "inputs": {"value": i}}

        def move(value, i=i, carry=carry):
            if not isinstance(value, list):
                return value
            if value == ["s", 0]:
                return [f"i{i}", 0]
            if value == ["s", 4]:
                return carry
            if value[0] == "k":
                return value
            return [f"{value[0]}_{i}", value[1]]

        for node_id, node in body.items():
            prompt[f"{node_id}_{i}"] = {"class_type": node["class_type"],
                                        "inputs": {k: move(v) for k, v in node["inputs"].items()}}
        if accumulate or i == count - 1:
            prompt[f"o{i}"] = out(move(output))
            outputs.append(f"o{i}")
        if carried is not None:
            carry = move(carried)
    if not outputs:  # a prompt needs an output; this one is not compared
        prompt["unused"] = out(["k", 0])
    return prompt, outputs


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(loop_bodies())
def test_random_loop_bodies_match_their_unrolled_graphs(registry, paths, case):
    runner = Runner(registry, paths, cache_kind="none")
    looped = ok(runner, _loop_prompt(*case))
    unrolled_prompt, order = _unrolled_prompt(*case)
    unrolled = ok(runner, unrolled_prompt)
    expected = [unrolled.outputs[o]["values"][0] for o in order]
    assert looped.outputs.get("o", {}).get("values", []) == expected


# ---------------------------------------------------------------------- content keys
def test_content_keys_follow_content_not_identity():
    a = [torch.ones(1, 2, 2, 3), "caption", {"samples": torch.zeros(1, 4, 2, 2)}]
    b = [torch.ones(1, 2, 2, 3), "caption", {"samples": torch.zeros(1, 4, 2, 2)}]
    assert content_key(a) == content_key(b)
    b[2]["samples"][0, 0, 0, 0] = 1.0
    assert content_key(a) != content_key(b)
    assert content_key(1) != content_key(1.0) != content_key(True)
    assert content_key(object()) != content_key(object())  # unreadable content is never reused


# ---------------------------------------------------------------------- workflows
def test_restyle_list_workflow_runs_headless(runner, paths):
    workflow = json.loads((Path(__file__).resolve().parents[2] / "workflows" / "loop_restyle_prompts.json").read_text())
    prompt = ui_to_api(workflow, runner.registry)
    assert prompt["2"]["inputs"] == {"mode": "List", "cache_iterations": True, "mode.list": ["1", 0]}
    assert prompt["7"]["inputs"]["terminations.termination0"] == ["6", 0]
    result = ok(runner, prompt)
    names = sorted(p.name for p in paths.output.glob("*.png"))
    assert names == ["blue city_00001_.png", "green forest_00001_.png", "red sunset_00001_.png",
                     "violet dusk_00001_.png"]
    assert len(result.outputs["8"]["images"]) == 4  # End Loop accumulated every iteration's image
    colors = {tuple(np.asarray(Image.open(paths.output / n))[0, 0]) for n in names}
    assert len(colors) == 4  # one style color per prompt


# ---------------------------------------------------------------------- the declared rewrite
def test_the_loop_check_is_pure_and_the_rewrite_returns_a_new_graph(registry):
    from execution.rewrite import rewrite_prompt
    from nodes.loops import LOOP_KEY, LoopTemplate

    prompt = Prompt.from_api({
        "s": start("simple", num_iterations=3),
        "add": {"class_type": "TestAdd", "inputs": {"a": ["s", 0], "b": 1}},
        "e": end(["add", 0], accumulate="true"),
        "o": out(["e", 0]),
    })
    before = {node_id: dict(node.inputs) for node_id, node in prompt.nodes.items()}
    assert check_loops(prompt, registry, {}) == {}
    assert {node_id: node.inputs for node_id, node in prompt.nodes.items()} == before  # the check changed nothing

    rewritten = rewrite_prompt(prompt, registry, {})
    assert {node_id: node.inputs for node_id, node in prompt.nodes.items()} == before and not prompt.stand_ins
    end_node = rewritten.nodes["e"]
    assert end_node is not prompt.nodes["e"] and type(end_node.inputs[LOOP_KEY]) is LoopTemplate
    assert "output_value" not in end_node.inputs and end_node.inputs["accumulate"] is True
    assert not end_node.links()  # the End no longer waits on its body
    assert rewritten.stand_ins == {"s": "e", "add": "e"}
    assert rewritten.nodes["add"] is prompt.nodes["add"]  # what the rewrite did not replace is shared


def test_a_rewrite_may_add_only_the_inputs_it_declares(registry):
    from execution.graph import PromptNode
    from execution.rewrite import GraphRewrite, RewriteResult

    prompt = Prompt.from_api({"c": {"class_type": "TestConst", "inputs": {"value": 1}}, "o": out(["c", 0])})

    def sneak(prompt, registry, options):
        return RewriteResult({"c": PromptNode("c", "TestConst", {"value": 1, "hidden_extra": 2})})

    with pytest.raises(ValueError, match="undeclared inputs \\['hidden_extra'\\]"):
        GraphRewrite("sneak", lambda *_: {}, sneak).apply(prompt, registry, {})
    declared = GraphRewrite("declared", lambda *_: {}, sneak, adds_inputs={"TestConst": ("hidden_extra",)})
    assert declared.apply(prompt, registry, {}).nodes["c"].inputs["hidden_extra"] == 2
    assert "hidden_extra" not in prompt.nodes["c"].inputs
