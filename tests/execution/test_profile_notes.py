"""A node's profile notes: appended per call through its run context, kept on its profile row (and on the
added-up row of expansion copies), absent from rows that noted nothing."""
from __future__ import annotations

from execution.context import RunContext
from execution.paths import Paths
from execution.profile import ProfileRows


def test_notes_append_per_call_and_land_on_the_row(tmp_path):
    context = RunContext(prompt_id="p", node_id="3", display_node_id="3", paths=Paths(tmp_path))
    assert context.profile_notes is None
    context.note_profile("adapters", {"applied": 2})
    context.note_profile("adapters", {"applied": 5})
    assert context.profile_notes == {"adapters": [{"applied": 2}, {"applied": 5}]}
    rows = ProfileRows()
    rows.add("1", "TestConst", "1", False, 1.0, 1.0, 0, 1, 1)
    rows.add("3", "LoraLoader", "3", False, 1.0, 1.0, 0, 1, 1)
    rows.note(1, context.profile_notes)
    index = rows.add_up("9:TestAdd", "TestAdd", "9", 1.0, 1.0, 0, 1, 1)
    rows.note(index, {"seen": [1]})
    assert rows.add_up("9:TestAdd", "TestAdd", "9", 1.0, 1.0, 0, 1, 1) == index
    rows.note(index, {"seen": [2]})
    table = rows.as_dicts()
    assert "notes" not in table["1"]
    assert table["3"]["notes"] == {"adapters": [{"applied": 2}, {"applied": 5}]}
    assert table["9:TestAdd"]["notes"] == {"seen": [1, 2]} and table["9:TestAdd"]["runs"] == 2


def test_a_node_served_from_the_cache_keeps_the_notes_of_the_run_that_made_its_value(paths):
    from execution.cache import make_cache
    from execution.context import current
    from execution.scheduler import Executor
    from execution.validation import validate_prompt
    from nodes.registry import NodeRegistry
    from nodes.spec import Input, NodeSpec, Output

    def noting(value: int) -> tuple[int]:
        current().note_profile("bound", {"value": value})
        return (value,)

    def shown(value: int) -> dict:
        return {"ui": {"value": [value]}}

    registry = NodeRegistry()
    registry.register(NodeSpec("Noting", noting, inputs=[Input.int("value", 0)], outputs=[Output("INT")]))
    # A fingerprint of NaN: the output node runs every time, so it asks for Noting's value again.
    registry.register(NodeSpec("Shown", shown, inputs=[Input.link("value", "INT")], output_node=True,
                               fingerprint=lambda **_inputs: float("nan")))
    executor = Executor(registry, cache=make_cache("classic"), paths=paths)
    prompt = {"n": {"class_type": "Noting", "inputs": {"value": 4}},
              "s": {"class_type": "Shown", "inputs": {"value": ["n", 0]}}}
    first, second = (executor.run(validate_prompt(prompt, registry), prompt_id=job) for job in ("p1", "p2"))
    assert first.profile["n"]["cached"] is False and second.profile["n"]["cached"] is True
    assert first.profile["n"]["notes"] == second.profile["n"]["notes"] == {"bound": [{"value": 4}]}
