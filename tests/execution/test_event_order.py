"""The events of a job in ComfyUI's order: a fresh run, a fully cached re-run, and a re-run with one changed
seed. `progress_state` comes when a node starts (before `executing`), before each `progress`, and when it
finishes (after `executed`), listing every node that is not pending; `execution_cached` always comes and
lists every cached node of the prompt."""
from __future__ import annotations

from execution.cache import make_cache
from execution.events import EventBus
from execution.scheduler import Executor
from execution.validation import validate_prompt

STEPS = 20  # TestSlow's progress updates


def prompt(seed: int) -> dict:
    """loader -> enc -> mix(seed) -> slow (reports progress) -> out, in the prompt's own order."""
    return {
        "loader": {"class_type": "TestConst", "inputs": {"value": 1}},
        "enc": {"class_type": "TestAdd", "inputs": {"a": ["loader", 0], "b": 2}},
        "seed": {"class_type": "TestConst", "inputs": {"value": seed}},
        "mix": {"class_type": "TestAdd", "inputs": {"a": ["enc", 0], "b": ["seed", 0]}},
        "slow": {"class_type": "TestSlow", "inputs": {"value": ["mix", 0], "seconds": 0.0}},
        "out": {"class_type": "TestOutput", "inputs": {"value": ["slow", 0]}},
    }


class Recorder:
    def __init__(self, registry, paths) -> None:
        self.bus = EventBus()
        self.events: list[tuple[str, dict]] = []
        self.bus.subscribe(lambda event, data: self.events.append((event, data)))
        self.executor = Executor(registry, cache=make_cache("classic"), events=self.bus, paths=paths)
        self.registry = registry

    def run(self, seed: int, prompt_id: str) -> list[tuple[str, dict]]:
        start = len(self.events)
        result = self.executor.run(validate_prompt(prompt(seed), self.registry), prompt_id=prompt_id)
        assert result.status == "success", result.error
        events = self.events[start:]
        assert all(d.get("prompt_id") == prompt_id for _, d in events)
        return events


def compact(events) -> list[tuple]:
    """(event, node) pairs; progress_state as ("progress_state", {node: (state, value, max)})."""
    out = []
    for event, data in events:
        if event == "progress_state":
            out.append((event, {k: (v["state"], v["value"], v["max"]) for k, v in data["nodes"].items()}))
        elif event == "execution_cached":
            out.append((event, tuple(data["nodes"])))
        elif event == "progress":
            out.append((event, data["node"], data["value"], data["max"]))
        else:
            out.append((event, data.get("node")))
    return out


def expected_runs(order: list[str], done: dict) -> list[tuple]:
    """ComfyUI's sequence for running the nodes in `order`, with `done` the non-pending nodes before."""
    seq = []
    for node in order:
        done[node] = ("running", 0.0, 1.0)
        seq += [("progress_state", dict(done)), ("executing", node)]
        if node == "slow":
            for step in range(1, STEPS + 1):
                done[node] = ("running", step, STEPS)
                seq += [("progress_state", dict(done)), ("progress", node, step, STEPS)]
        if node == "out":
            seq.append(("executed", "out"))
        maximum = done[node][2]
        done[node] = ("finished", maximum, maximum)
        seq.append(("progress_state", dict(done)))
    return seq


def test_fresh_run_in_comfyui_order(registry, paths):
    events = Recorder(registry, paths).run(1, "fresh")
    executing = [d["node"] for e, d in events if e == "executing" and d["node"] is not None]
    assert sorted(executing) == sorted(prompt(1))  # every node ran; the order is the scheduler's
    assert executing.index("loader") < executing.index("enc") < executing.index("mix") < executing.index("slow")
    assert compact(events) == [("execution_start", None), ("execution_cached", ()),
                               *expected_runs(executing, {}),
                               ("execution_success", None), ("executing", None)]
    state = next(d for e, d in reversed(events) if e == "progress_state")["nodes"]["slow"]
    assert state == {"value": STEPS, "max": STEPS, "state": "finished", "node_id": "slow", "prompt_id": "fresh",
                     "display_node_id": "slow", "parent_node_id": None, "real_node_id": "slow"}


def test_fully_cached_rerun_lists_every_node_and_finishes_the_output(registry, paths):
    recorder = Recorder(registry, paths)
    recorder.run(1, "first")
    events = recorder.run(1, "again")
    assert compact(events) == [
        ("execution_start", None),
        ("execution_cached", ("loader", "enc", "seed", "mix", "slow", "out")),  # behind cached ones too
        ("executed", "out"),  # the cached output's UI, as ComfyUI re-sends it
        ("progress_state", {"out": ("finished", 1.0, 1.0)}),
        ("execution_success", None), ("executing", None)]


def test_rerun_with_one_changed_seed(registry, paths):
    recorder = Recorder(registry, paths)
    recorder.run(1, "first")
    events = recorder.run(2, "seed")
    executing = [d["node"] for e, d in events if e == "executing" and d["node"] is not None]
    assert sorted(executing) == ["mix", "out", "seed", "slow"]
    assert compact(events) == [("execution_start", None), ("execution_cached", ("loader", "enc")),
                               *expected_runs(executing, {}),
                               ("execution_success", None), ("executing", None)]
