"""Context windows: ContextWindowsManual returns a MODEL that samples long clips window by window.

The node returns a new MODEL handle carrying the settings in its options (`models.h3.context_windows.
CONTEXT_WINDOWS`); the H3 sampler reads them and runs the model over overlapping windows of latent frames,
the sound of each window cut to the same stretch of time (models/h3/context_windows.py). The shared weights
are untouched.
"""
from __future__ import annotations

from typing import Any

from models.h3.context_windows import (CONTEXT_WINDOWS, VIDEO_TIME_DIM, ContextSchedule, ContextWindowSettings,
                                       FuseMethod, parse_index_list)
from nodes.loaders import check_model, keep_shifts
from nodes.spec import Input, NodeSpec, Output

NODE = "ContextWindowsManual"
SCHEDULES = [schedule.value for schedule in ContextSchedule]
FUSE_METHODS = [FuseMethod.PYRAMID.value, FuseMethod.RELATIVE.value, FuseMethod.FLAT.value,
                FuseMethod.OVERLAP_LINEAR.value]


def _dim_problem(dim: Any) -> str | None:
    if isinstance(dim, int) and dim != VIDEO_TIME_DIM:
        return (f"{NODE}: input 'dim' is {dim}, but an H3 latent holds its frames on dim {VIDEO_TIME_DIM} "
                f"(batch, channels, frames, height, width); set dim to {VIDEO_TIME_DIM}")
    return None


def _index_list(name: str, text: Any) -> tuple[int, ...]:
    try:
        return parse_index_list(text)
    except ValueError as exc:
        raise ValueError(f"{NODE}: input '{name}': {exc}") from None


def _validate(dim: Any = None, context_length: Any = None, context_overlap: Any = None,
              cond_retain_index_list: Any = None, latent_retain_index_list: Any = None, **_other: Any) -> bool | str:
    if (problem := _dim_problem(dim)) is not None:
        return problem
    if isinstance(context_length, int) and isinstance(context_overlap, int) and context_overlap >= context_length:
        return (f"{NODE}: input 'context_overlap' ({context_overlap}) must be smaller than context_length "
                f"({context_length}), or the windows would not move forward")
    for name, text in (("cond_retain_index_list", cond_retain_index_list),
                       ("latent_retain_index_list", latent_retain_index_list)):
        if isinstance(text, str):
            try:
                parse_index_list(text)
            except ValueError as exc:
                return f"{NODE}: input '{name}': {exc}"
    return True


def _context_windows_manual(model: Any, context_length: int, context_overlap: int, context_schedule: str,
                            context_stride: int, closed_loop: bool, fuse_method: str, dim: int, freenoise: bool,
                            cond_retain_index_list: str, split_conds_to_windows: bool,
                            latent_retain_index_list: str, causal_window_fix: bool) -> tuple[Any]:
    model = check_model(NODE, model)
    if (problem := _dim_problem(int(dim))) is not None:
        raise ValueError(problem)
    try:
        settings = ContextWindowSettings(
            context_length=int(context_length), context_overlap=int(context_overlap),
            schedule=ContextSchedule(context_schedule), stride=int(context_stride), closed_loop=bool(closed_loop),
            fuse=FuseMethod(fuse_method), freenoise=bool(freenoise),
            cond_retain=_index_list("cond_retain_index_list", cond_retain_index_list),
            latent_retain=_index_list("latent_retain_index_list", latent_retain_index_list),
            causal_window_fix=bool(causal_window_fix), split_conds_to_windows=bool(split_conds_to_windows))
    except ValueError as exc:
        message = str(exc)
        raise ValueError(message if message.startswith(NODE) else f"{NODE}: {message}") from None
    return (keep_shifts(model, model.with_options(**{CONTEXT_WINDOWS: settings})),)


NODES = [
    NodeSpec(
        node_id=NODE, display_name="Context Windows (Manual)", category="model_patches",
        python_module="comfy_extras.nodes_context_windows", experimental=True,
        description="Lets a sampler make a clip longer than one model pass: the model runs over overlapping "
                    "windows of latent frames, each with the sound of the same stretch of time, and the windows "
                    "are blended where they overlap. Memory grows with the window, not with the clip.",
        execute=_context_windows_manual, validate_inputs=_validate,
        inputs=[
            Input.link("model", "MODEL", tooltip="The model that should sample in windows."),
            Input.int("context_length", 16, min=1,
                      tooltip="Latent frames in one window. An H3 latent frame is 4 video frames (the first of "
                              "every 17 is 1): 5n + 2 latent frames make 17n + 5 video frames."),
            Input.int("context_overlap", 4, min=0,
                      tooltip="Latent frames two neighbouring windows share, blended between them."),
            Input.combo("context_schedule", SCHEDULES, ContextSchedule.STATIC_STANDARD.value,
                        tooltip="standard_static: the same windows at every step, the last one ending on the "
                                "last frame. standard_uniform: windows moved at every step so the seams fall "
                                "elsewhere. looped_uniform: the same, and windows may wrap from the end to the "
                                "start. batched: windows side by side without overlap."),
            Input.int("context_stride", 1, min=1,
                      tooltip="Uniform schedules only: above 1, also windows whose frames are 2, 4, ... apart, "
                              "which tie distant parts of the clip together."),
            Input.boolean("closed_loop", False,
                          tooltip="looped_uniform only: windows also wrap from the last frame to the first, "
                                  "for clips meant to loop."),
            Input.combo("fuse_method", FUSE_METHODS, FuseMethod.PYRAMID.value,
                        tooltip="How overlapping windows are weighed: pyramid and relative favour each window's "
                                "middle, flat weighs all frames alike, overlap-linear ramps only across the "
                                "overlap."),
            Input.int("dim", 0, min=0, max=5,
                      tooltip="The latent dimension the windows run along. H3 latents hold their frames on "
                              "dim 2, the only value they take."),
            Input.boolean("freenoise", False,
                          tooltip="Start each window from a shuffled copy of the previous window's noise "
                                  "(FreeNoise), which helps windows agree where they meet."),
            Input.string("cond_retain_index_list", "",
                         tooltip="Latent frame indices, comma separated: a guide (first or last frame, added "
                                 "guide) covering one of them goes into every window, not only those that "
                                 "cover it in time; e.g. 0 keeps the first-frame guide everywhere."),
            Input.boolean("split_conds_to_windows", False,
                          tooltip="With several conditioning entries, each window follows the one for its "
                                  "part of the clip (the first entry the start, the last the end)."),
            Input.string("latent_retain_index_list", "",
                         tooltip="Latent frame indices, comma separated, that every window also sees at their "
                                 "own time, as context: e.g. 0 lets every window look at the opening frame."),
            Input.boolean("causal_window_fix", True,
                          tooltip="A window that does not start at the first frame also sees the frame just "
                                  "before it, as context."),
        ],
        outputs=[Output("MODEL", tooltip="The same model, sampling in context windows.")],
        search_aliases=("context windows", "long video", "sliding window"),
    ),
]
