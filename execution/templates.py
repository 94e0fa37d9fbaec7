"""Workflow templates by name: Weft's own (the `workflows/` folder) and the official ones.

The official templates come from the `comfyui-workflow-templates-json` package (a runtime dependency):
its `templates/` folder holds one UI workflow per template and `index.json`, which groups them into
categories as the editor's template browser shows them. A name is looked up in Weft's folder first, then
in the package; `name` and `name.json` are the same template. Thumbnails: this package ships none, so
callers draw a diagram of the workflow instead (web/files.py).

Torch-free: the server, `main.py run` and `main.py validate` all read templates through this module.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

OFFICIAL_PACKAGE = "comfyui_workflow_templates_json"


@dataclass(frozen=True)
class TemplateCategory:
    """One group of the official template index (title and the template entries, as the index has them)."""

    title: str
    kind: str  # the index's media type of the group: image, video, audio, ...
    entries: list[dict[str, Any]]


def _official_folder():
    try:
        return resources.files(OFFICIAL_PACKAGE) / "templates"
    except ModuleNotFoundError:
        return None


def template_stem(name: str) -> str:
    """`name` without a trailing `.json`."""
    return name[:-5] if name.endswith(".json") else name


def _plain_name(stem: str) -> bool:
    return bool(stem) and "/" not in stem and "\\" not in stem and not stem.startswith(".")


def official_names() -> list[str]:
    """Every official template's name (no `.json`), sorted; empty when the package is not installed."""
    folder = _official_folder()
    if folder is None or not folder.is_dir():
        return []
    return sorted(entry.name[:-5] for entry in folder.iterdir()
                  if entry.name.endswith(".json") and not entry.name.startswith("index"))


def local_names(workflows_dir: Path) -> list[str]:
    """Weft's own workflows (names without `.json`)."""
    if not workflows_dir.is_dir():
        return []
    return sorted(p.stem for p in workflows_dir.glob("*.json") if p.is_file())


def official_text(name: str) -> str | None:
    """The official template `name`'s JSON text, or None when there is no such template."""
    stem = template_stem(name)
    folder = _official_folder()
    if folder is None or not _plain_name(stem) or stem.startswith("index"):
        return None
    entry = folder / f"{stem}.json"
    return entry.read_text(encoding="utf-8") if entry.is_file() else None


def find_template(name: str, workflows_dir: Path) -> tuple[str, str] | None:
    """(where, JSON text) of the template `name`: Weft's workflows folder first, then the official package.
    `where` says where it was found, for messages. None when neither has it."""
    stem = template_stem(name)
    if not _plain_name(stem):
        return None
    local = workflows_dir / f"{stem}.json"
    if local.is_file():
        return str(local), local.read_text(encoding="utf-8")
    text = official_text(stem)
    if text is not None:
        return f"official template {stem} ({OFFICIAL_PACKAGE})", text
    return None


def official_categories() -> list[TemplateCategory]:
    """The official index's groups, in its order, keeping only entries whose workflow file is present."""
    folder = _official_folder()
    if folder is None or not (folder / "index.json").is_file():
        return []
    present = set(official_names())
    groups = json.loads((folder / "index.json").read_text(encoding="utf-8"))
    categories = []
    for group in groups if isinstance(groups, list) else []:
        if not isinstance(group, dict) or not isinstance(group.get("templates"), list):
            continue
        entries = [dict(t) for t in group["templates"] if isinstance(t, dict) and t.get("name") in present]
        if entries:
            categories.append(TemplateCategory(str(group.get("title") or group.get("category") or "Templates"),
                                               str(group.get("type") or "image"), entries))
    return categories


def similar_names(name: str, names: list[str], limit: int = 5) -> list[str]:
    """Names that contain every `_`-separated word of `name` (for a "did you mean" line)."""
    words = [w for w in template_stem(name).lower().replace("-", "_").split("_") if w]
    return [n for n in names if all(w in n.lower() for w in words)][:limit]


def loaded_file_names(workflow: dict[str, Any], node_types: tuple[str, ...] = ("LoadImage",)) -> list[str]:
    """The file names the `node_types` nodes of a UI workflow (subgraphs included) load: their first widget
    value, as saved. A plain reading of the JSON: no conversion, no registry."""
    graphs = [workflow, *((workflow.get("definitions") or {}).get("subgraphs") or [])]
    names = []
    for graph in graphs:
        for node in graph.get("nodes") or [] if isinstance(graph, dict) else []:
            values = node.get("widgets_values") if isinstance(node, dict) else None
            if node.get("type") in node_types and isinstance(values, list) and values and isinstance(values[0], str):
                if values[0] not in names:
                    names.append(values[0])
    return names


def example_input_names(words: tuple[str, ...] = ("h3",)) -> list[str]:
    """The pictures the official templates whose names hold all of `words` load (not the `api_` ones)."""
    names: list[str] = []
    for template in official_names():
        if template.startswith("api_") or not all(w in template for w in words):
            continue
        for name in loaded_file_names(json.loads(official_text(template) or "{}")):
            if name not in names:
                names.append(name)
    return names


EXAMPLE_INPUT_SIZE = (96, 64)  # small: the tiny models run the templates at their smallest resolution


def write_example_inputs(input_dir: str | os.PathLike) -> list[Path]:
    """Small example pictures under the names the official H3 templates load, so those templates run on
    the tiny models as they are. A file already there (a user's own picture) is never replaced."""
    from PIL import Image, ImageDraw  # a plain image library, not Weft's media/: this only draws placeholders

    written = []
    for index, name in enumerate(example_input_names()):
        path = Path(input_dir) / name
        if path.exists() or "/" in name or "\\" in name:
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        # A different colour and a diagonal band per picture, so a run that mixes them up shows it.
        hue = (index * 67) % 256
        image = Image.new("RGB", EXAMPLE_INPUT_SIZE, (hue, 255 - hue, (hue * 3) % 256))
        ImageDraw.Draw(image).polygon([(0, 40), (40, 0), (70, 0), (0, 64)], fill=(240, 240, 240))
        tmp = path.with_name(path.name + ".part")
        image.save(tmp, format="PNG")
        os.replace(tmp, path)
        written.append(path)
    return written
