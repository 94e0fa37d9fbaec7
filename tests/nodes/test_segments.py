"""The chained-segments workflow (workflows/h3_chained_segments.json): a 4-segment clip whose loop caches
its passes, so editing one segment's prompt re-runs that segment and the ones after it, never the ones
before. Run through the executor and through `main.py run`, on the tiny models at 32 x 32 with one step."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from execution.convert import ui_to_api
from tests.nodes.test_h3_control import WORKFLOWS, env, node_of  # noqa: F401 (env is a fixture)
from tests.nodes.test_h3_nodes import configured_paths, install, mp4_streams, tiny_weights  # noqa: F401

WORKFLOW = "h3_chained_segments.json"
PROMPTS_TITLE = "Segments 2-4: prompts (one line each)"


def small_workflow(edits: dict[int, str] | None = None) -> dict:
    """The bundled UI workflow at 32 x 32 pixels and one sampling step, with the prompt lines of the
    segments in `edits` (2, 3 or 4 -> text) replaced."""
    workflow = json.loads((WORKFLOWS / WORKFLOW).read_text(encoding="utf-8"))
    for node in workflow["nodes"]:
        if node["type"] == "EmptyMiniMaxH3LatentAV":
            node["widgets_values"][:2] = [32, 32]
        elif node["type"] == "BasicScheduler":
            node["widgets_values"][1] = 1
        elif node.get("title") == PROMPTS_TITLE:
            lines = node["widgets_values"][0].split("\n")
            for segment, text in (edits or {}).items():
                lines[segment - 2] = text
            node["widgets_values"][0] = "\n".join(lines)
    return workflow


def ids(prompt: dict) -> dict[str, str]:
    """The node ids the tests ask about, found by class and title."""
    return {"end": node_of(prompt, "EndLoop"), "first": node_of(prompt, "CreateVideo", "Segment 1 (video)"),
            "first_sampler": node_of(prompt, "SamplerCustomAdvanced", "Segment 1"),
            "sampler": node_of(prompt, "SamplerCustomAdvanced", "This segment"),
            "encode": node_of(prompt, "CLIPTextEncode", "This segment's prompt"),
            "joined": node_of(prompt, "ConcatenateVideo"), "save": node_of(prompt, "SaveVideo")}


def passes_run(result, end: str, body: str) -> list[int]:
    """The loop passes in which the copy of body node `body` ran."""
    return sorted(int(node_id.split(".")[1]) for node_id in result.executed
                  if node_id.startswith(end + ".") and node_id.endswith("." + body))


def run(env, edits: dict[int, str] | None = None):
    prompt = ui_to_api(small_workflow(edits), env.registry)
    at = ids(prompt)
    for name in ("first", "joined"):
        prompt[f"probe_{name}"] = {"class_type": "TestOutput", "inputs": {"value": [at[name], 0]}}
    return env.run(prompt)


def test_editing_one_segment_re_runs_it_and_the_segments_after_it_only(env):
    at = ids(ui_to_api(small_workflow(), env.registry))
    sampler_row = f"{at['sampler']}:SamplerCustomAdvanced"
    first = run(env)
    assert passes_run(first, at["end"], at["sampler"]) == [0, 1, 2]  # segments 2, 3 and 4
    assert first.profile[sampler_row]["runs"] == 3
    # The joined clip: segment 1 untouched, then 17 new frames per segment, with sound all along.
    segment_1 = first.outputs["probe_first"]["values"][0].get_components()
    joined = first.outputs["probe_joined"]["values"][0].get_components()
    assert joined.images.shape[0] == 22 + 3 * 17 and (joined.images[:22] == segment_1.images).all()
    assert abs(joined.audio["waveform"].shape[-1] / joined.audio["sample_rate"] - 73 / 24) < 0.05
    info = mp4_streams(env.output_file(first, at["save"]))
    assert info["frames"] == 73 and info["audio_streams"] == 1

    edits = {3: "a heron lands on the puddle"}
    edited = run(env, edits)
    assert passes_run(edited, at["end"], at["sampler"]) == [1, 2]  # segments 3 and 4
    assert passes_run(edited, at["end"], at["encode"]) == [1]  # only segment 3's prompt is new
    assert at["first"] in edited.cached and at["first_sampler"] not in edited.executed
    # The profile says the same: segment 1 served, the loop's sampler run twice (once per re-made segment).
    assert edited.profile[at["first"]]["cached"] is True and edited.profile[sampler_row]["runs"] == 2
    joined_again = edited.outputs["probe_joined"]["values"][0].get_components()
    assert (joined_again.images[:22 + 17] == joined.images[:22 + 17]).all()  # segments 1 and 2 as before
    assert not (joined_again.images[22 + 17:] == joined.images[22 + 17:]).all()

    edits[4] = "the boat sinks slowly"
    assert passes_run(run(env, edits), at["end"], at["sampler"]) == [2]  # the last segment alone
    assert passes_run(run(env, edits), at["end"], at["sampler"]) == []  # nothing changed: nothing re-made


def test_the_cli_runs_two_workflows_in_one_process_and_the_second_re_runs_only_the_edited_segments(
        registry, tmp_path, tmp_path_factory, capsys, configured_paths):  # noqa: F811
    import main

    install(tiny_weights(tmp_path_factory), tmp_path)
    original, edited = tmp_path / "chain.json", tmp_path / "chain_edited.json"
    original.write_text(json.dumps(small_workflow()))
    edited.write_text(json.dumps(small_workflow({3: "a heron lands on the puddle"})))
    # An LRU cache: the default RAM cache empties itself when the machine has little memory free.
    code = main.main(["run", str(original), str(edited), "--json", "--base-directory", str(tmp_path),
                      "--cache-lru", "1000"])
    assert code == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [line["status"] for line in lines] == ["success", "success"]
    at = ids(ui_to_api(small_workflow(), registry))
    sampler = f"{at['sampler']}:SamplerCustomAdvanced"
    assert lines[0]["profile"][sampler]["runs"] == 3 and lines[0]["profile"][at["first"]]["cached"] is False
    assert lines[1]["profile"][sampler]["runs"] == 2 and lines[1]["profile"][at["first"]]["cached"] is True
    assert all(Path(path).is_file() for line in lines for path in line["files"])
