"""Which worker of a pool runs a job: the files a job names, and the rule that picks a worker.

A job names files through its file choices (inputs whose spec lists a folder: model files, and the
input, output or temp files a node loads). On one machine every worker sees the server's folders; a
worker elsewhere has its own model folders (the same layout, by relative path) and gets the job's
input files from the server. So the dispatcher asks two things of each idle worker: does it lack a
model file the job names, and which of those files it already holds. The rule, in order:

    1. only workers that have every model file the job names (none has them: the job fails,
       naming the first missing file);
    2. a worker that is up before one still starting;
    3. the most bytes of the job's model files already held (model affinity: no load at all);
    4. the fewest bytes held in all (the cheapest eviction);
    5. not the worker the job's previous attempt died on (the retry goes elsewhere when it can);
    6. the pool's order.

What a worker holds is the dispatcher's own account: the model files of the jobs it ran since it
last unloaded its models or was restarted, with their sizes on the server. Nothing here imports
torch or knows about nodes beyond their specs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from execution.paths import MODEL_FOLDERS, Paths, UnsafePathError, confine

FOLDER_SUFFIXES = {" [input]": "input", " [output]": "output", " [temp]": "temp"}  # the editor's annotations


@dataclass(frozen=True)
class NamedFiles:
    """The files one prompt names through its file choices."""

    models: tuple[tuple[str, str], ...] = ()  # (model folder, file name), e.g. ("checkpoints", "a.safetensors")
    media: tuple[tuple[str, str], ...] = ()  # (input | output | temp, name relative to that folder)


def _split_annotation(name: str) -> tuple[str, str]:
    for suffix, kind in FOLDER_SUFFIXES.items():
        if name.endswith(suffix):
            return name[: -len(suffix)], kind
    return name, "input"


def named_files(prompt: dict, registry: Any, paths: Paths) -> NamedFiles:
    """The model and media files `prompt`'s constant file choices name and `paths` holds.

    A choice's spec says which folder it lists (`InputSpec.searched_folder`); that text is matched
    against the folders of `paths`, so a value is looked up only where its node looks for it."""
    model_folders = sorted(set(MODEL_FOLDERS) | set(paths.extra_model_dirs))
    by_listing = {", ".join(str(p) for p in paths.model_dirs(f)): f for f in model_folders}
    media_listing = {str(paths.folder(k)): k for k in ("input", "output", "temp")}
    models: dict[tuple[str, str], None] = {}
    media: dict[tuple[str, str], None] = {}
    for node in prompt.values():
        spec = registry.get(node.get("class_type")) if isinstance(node, dict) else None
        values = node.get("inputs") if spec is not None else None
        if not isinstance(values, dict):
            continue
        for name, input_spec in spec.instance_inputs(spec.normalize_input_names(dict(values))).items():
            value = values.get(name)
            if not isinstance(value, str) or not value or input_spec.folder is None:
                continue
            try:
                listing = input_spec.searched_folder()
            except Exception:  # a folder function that needs a running job: not a file choice we can place
                continue
            if listing in by_listing:
                folder = by_listing[listing]
                try:
                    paths.model_path(folder, value)
                except (FileNotFoundError, UnsafePathError):
                    continue
                models[(folder, value)] = None
            elif listing in media_listing:
                bare, kind = _split_annotation(value)
                try:
                    if confine(paths.folder(kind), bare).is_file():
                        media[(kind, bare)] = None
                except UnsafePathError:
                    continue
    return NamedFiles(tuple(models), tuple(media))


def model_bytes(paths: Paths, files: Sequence[tuple[str, str]]) -> dict[tuple[str, str], int]:
    """Each model file's size on this machine (0 when it cannot be read)."""
    sizes = {}
    for folder, name in files:
        try:
            sizes[(folder, name)] = Path(paths.model_path(folder, name)).stat().st_size
        except (OSError, UnsafePathError):
            sizes[(folder, name)] = 0
    return sizes


@dataclass
class Candidate:
    """One idle worker as the rule sees it."""

    index: int  # its place in the pool
    ready: bool  # up (not still starting)
    held: dict[tuple[str, str], int] = field(default_factory=dict)  # model files it holds -> bytes
    missing: tuple[tuple[str, str], ...] = ()  # model files of the job it lacks
    died_on_last_attempt: bool = False


def choose(candidates: Sequence[Candidate], models: Sequence[tuple[str, str]]) -> Candidate | None:
    """The candidate the module's rule picks, or None when every one lacks a model file."""
    able = [c for c in candidates if not c.missing]
    if not able:
        return None
    wanted = set(models)

    def rank(candidate: Candidate) -> tuple:
        shared = sum(size for key, size in candidate.held.items() if key in wanted)
        return (not candidate.ready, -shared, sum(candidate.held.values()), candidate.died_on_last_attempt,
                candidate.index)

    return min(able, key=rank)
