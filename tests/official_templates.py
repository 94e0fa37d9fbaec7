"""The official MiniMax H3 templates, read from the `comfyui-workflow-templates-json` package (a runtime dependency).

The package is pinned in requirements.txt, so a fresh clone's `make test` has it and no template
test skips; a missing package is an error here, not a skip.
"""
from __future__ import annotations

import json
from importlib import resources

T2V = "video_minimax_h3_t2v.json"
R2V = "video_minimax_h3_r2v.json"


def official_template(name: str) -> dict:
    """The parsed UI workflow `name` from the installed template package."""
    folder = resources.files("comfyui_workflow_templates_json") / "templates"
    return json.loads((folder / name).read_text(encoding="utf-8"))


def template_names() -> list[str]:
    """Every template file name the installed package holds."""
    folder = resources.files("comfyui_workflow_templates_json") / "templates"
    return sorted(entry.name for entry in folder.iterdir() if entry.name.endswith(".json"))


def local_h3_templates() -> list[str]:
    """The H3 templates that run on local models: names with `minimax_h3` or `fasth3`, not the `api_` ones."""
    return [name for name in template_names()
            if ("minimax_h3" in name or "fasth3" in name) and not name.startswith("api_")]
