"""The DYNPROMPT value: the run's graph read the way packs written for ComfyUI read it."""
from __future__ import annotations

import pytest

from execution.graph import Link, Prompt, PromptNode, PromptReader


def test_get_node_gives_api_data_with_links_as_lists_and_fresh_copies():
    prompt = Prompt.from_api({
        "1": {"class_type": "A", "inputs": {"x": 3}, "_meta": {"title": "first"}},
        "2": {"class_type": "B", "inputs": {"src": ["1", 0], "n": {"__value__": [1, 2]}}},
    })
    prompt.add(PromptNode("2.k", "C", {"src": Link("2", 0)}, parent="2", display_id="2", real_id="9"))
    reader = PromptReader(prompt)
    assert reader.get_node("1") == {"class_type": "A", "inputs": {"x": 3}, "_meta": {"title": "first"}}
    got = reader.get_node(2)  # ids are read as strings, as the packs' int ids from GraphBuilder are
    assert got == {"class_type": "B", "inputs": {"src": ["1", 0], "n": [1, 2]}}
    got["inputs"]["src"][0] = "changed"
    assert prompt.nodes["2"].inputs["src"] == Link("1", 0)  # what a pack edits is its own copy
    assert reader.has_node("2.k") and not reader.has_node("3")
    assert reader.all_node_ids() == {"1", "2", "2.k"}
    assert (reader.get_parent_node_id("2.k"), reader.get_display_node_id("2.k"), reader.get_real_node_id("2.k")) \
        == ("2", "2", "9")
    assert reader.get_real_node_id("1") == "1"
    with pytest.raises(KeyError, match="'3' is not in this run's graph"):
        reader.get_node("3")
