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
