"""Every workflow Weft ships opens with all of its nodes in view, right of the editor's side bar."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from web import workflow_view

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = sorted((ROOT / "workflows").glob("*.json"))


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_shipped_workflow_opens_with_every_node_in_view(path):
    workflow = json.loads(path.read_text(encoding="utf-8"))
    ds = workflow["extra"]["ds"]
    scale, (dx, dy) = ds["scale"], ds["offset"]
    left, top, right, bottom = workflow_view.visible_area()
    assert left >= 48 and right <= 1280 and bottom <= 720  # the side bar is 48 px wide; a 1280x720 window
    for node in workflow["nodes"]:
        (x, y), (w, h) = node["pos"], node["size"]
        screen = ((x + dx) * scale, (y - workflow_view.TITLE_HEIGHT + dy) * scale,
                  (x + w + dx) * scale, (y + h + dy) * scale)
        assert screen[0] >= left and screen[1] >= top, (node["id"], node["type"], screen)
        assert screen[2] <= right and screen[3] <= bottom, (node["id"], node["type"], screen)


def test_fitting_is_stable_and_moves_a_graph_out_from_under_the_side_bar(tmp_path):
    path = tmp_path / "w.json"
    path.write_text(json.dumps({"nodes": [{"id": 1, "pos": [0, 0], "size": [3000, 200]},
                                          {"id": 2, "pos": [-500, 900], "size": [200, 100]}],
                                "extra": {"ds": {"scale": 1, "offset": [0, 0]}}}))
    assert workflow_view.fit_file(path) and not workflow_view.fit_file(path)
    ds = json.loads(path.read_text())["extra"]["ds"]
    assert ds["scale"] < 0.4 and (-500 + ds["offset"][0]) * ds["scale"] >= workflow_view.SIDEBAR_WIDTH - 0.5
    assert all(not workflow_view.fit_file(p) for p in SHIPPED), "run python -m web.workflow_view workflows/*.json"
