"""Fit a UI workflow's saved view (`extra.ds`) so the editor opens it with every node in sight.

The editor restores `extra.ds` (`screen = (graph position + offset) * scale`) when it opens a workflow. Weft's
shipped workflows are fitted to the smallest editor window we design for, right of the editor's side bar
and below its top bar, with a margin for nodes the editor draws larger than their saved size:

    python -m web.workflow_view workflows/*.json      # rewrite each file's extra.ds in place
"""
from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path
from typing import Any

# The editor window every shipped workflow must fit in, and the parts of it the editor's own chrome covers.
VIEWPORT = (1280, 720)
SIDEBAR_WIDTH = 80    # the icon side bar (and a little air)
TOP_BAR_HEIGHT = 90   # workflow tabs and the menu bar
BOTTOM_MARGIN = 70    # the canvas tool buttons
RIGHT_MARGIN = 40
TITLE_HEIGHT = 30     # a node's title bar is drawn above its saved position
GROWTH = 1.12         # nodes drawn up to this much larger than saved (previews, wrapped widgets) still fit
MAX_SCALE = 1.0


def _xy(value: Any, default: tuple[float, float]) -> tuple[float, float]:
    if isinstance(value, dict):
        return float(value.get("0", default[0])), float(value.get("1", default[1]))
    if isinstance(value, (list, tuple)) and len(value) >= 2:
        return float(value[0]), float(value[1])
    return default


def graph_bounds(workflow: dict) -> tuple[float, float, float, float] | None:
    """(left, top, right, bottom) of every node (title bar included) and group, in graph units."""
    boxes = []
    for node in workflow.get("nodes") or []:
        if not isinstance(node, dict) or "pos" not in node:
            continue
        x, y = _xy(node["pos"], (0.0, 0.0))
        w, h = _xy(node.get("size"), (200.0, 100.0))
        collapsed = isinstance(node.get("flags"), dict) and node["flags"].get("collapsed")
        boxes.append((x, y - TITLE_HEIGHT, x + (120.0 if collapsed else w), y + (0.0 if collapsed else h)))
    for group in workflow.get("groups") or []:
        bounding = group.get("bounding") if isinstance(group, dict) else None
        if isinstance(bounding, list) and len(bounding) == 4:
            x, y, w, h = map(float, bounding)
            boxes.append((x, y, x + w, y + h))
    if not boxes:
        return None
    return (min(b[0] for b in boxes), min(b[1] for b in boxes), max(b[2] for b in boxes), max(b[3] for b in boxes))


def visible_area(viewport: tuple[int, int] = VIEWPORT) -> tuple[float, float, float, float]:
    """(left, top, right, bottom) of the canvas area the editor's chrome leaves free, in screen pixels."""
    return SIDEBAR_WIDTH, TOP_BAR_HEIGHT, viewport[0] - RIGHT_MARGIN, viewport[1] - BOTTOM_MARGIN


def fitted_view(workflow: dict, viewport: tuple[int, int] = VIEWPORT) -> dict[str, Any] | None:
    """The `extra.ds` that shows the whole workflow in the free area of `viewport` (None: no nodes)."""
    bounds = graph_bounds(workflow)
    if bounds is None:
        return None
    left, top, right, bottom = bounds
    area = visible_area(viewport)
    width, height = (right - left) * GROWTH, (bottom - top) * GROWTH
    scale = min(MAX_SCALE, (area[2] - area[0]) / max(width, 1.0), (area[3] - area[1]) / max(height, 1.0))
    scale = float(f"{scale:.4f}")  # short numbers in the file; rounding down keeps it inside
    # Offsets rounded up to a tenth: the graph never starts left of or above the free area.
    return {"scale": scale, "offset": [math.ceil((area[0] / scale - left) * 10) / 10,
                                       math.ceil((area[1] / scale - top) * 10) / 10]}


def fit_file(path: Path) -> bool:
    """Rewrite `path`'s extra.ds to the fitted view; True when it changed."""
    text = path.read_text(encoding="utf-8")
    workflow = json.loads(text)
    view = fitted_view(workflow)
    if view is None or (workflow.get("extra") or {}).get("ds") == view:
        return False
    workflow.setdefault("extra", {})["ds"] = view
    # Replace the ds object's text alone, so the file keeps its own layout; rewrite it whole otherwise.
    edited, count = re.subn(r'"ds"\s*:\s*\{[^{}]*\}', lambda _: '"ds": ' + json.dumps(view), text, count=1)
    if count != 1 or json.loads(edited) != workflow:
        edited = json.dumps(workflow, indent=2, ensure_ascii=False) + "\n"
    path.write_text(edited, encoding="utf-8")
    return True


def main(argv: list[str]) -> int:
    """Fit every file named on the command line; print the ones changed."""
    if not argv:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    for name in argv:
        if fit_file(Path(name)):
            print(f"fitted {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
