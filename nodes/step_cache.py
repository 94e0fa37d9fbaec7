"""EasyCache and LazyCache: MODEL patches that let a sampler skip steps whose output barely changes.

Each node returns a new MODEL handle carrying its settings (`models.patcher.STEP_CACHE`); the sampler
nodes make the run's state from them (models/step_cache.py holds the mechanism and its estimates) and
report the computed and skipped steps in their progress text and profile row. A handle carries at most one
of the two: both keep per-run state under one option, so the second is refused rather than let it corrupt
the first.
"""
from __future__ import annotations

from typing import Any

from models.patcher import STEP_CACHE
from models.step_cache import StepCacheKind, StepCacheSettings
from nodes.loaders import check_model, keep_shifts
from nodes.spec import Input, NodeSpec, Output

_MODULE = "comfy_extras.nodes_easycache"  # provenance: interface (where ComfyUI declares both nodes)


def _patched(kind: StepCacheKind, model: Any, reuse_threshold: float, start_percent: float, end_percent: float,
             verbose: bool) -> tuple[Any]:
    node = kind.value
    model = check_model(node, model)
    present = model.options.get(STEP_CACHE)
    if present is not None:
        raise ValueError(f"{node}: input 'model' already carries a {present.kind.value} patch; two step-skipping "
                         "patches on one model would overwrite each other's per-step state. Keep one of them "
                         "between the model loader and the sampler")
    settings = StepCacheSettings(kind, float(reuse_threshold), float(start_percent), float(end_percent), bool(verbose))
    return (keep_shifts(model, model.with_options(**{STEP_CACHE: settings})),)


def _easy_cache(model: Any, reuse_threshold: float, start_percent: float, end_percent: float,
                verbose: bool) -> tuple[Any]:
    return _patched(StepCacheKind.EASY, model, reuse_threshold, start_percent, end_percent, verbose)


def _lazy_cache(model: Any, reuse_threshold: float, start_percent: float, end_percent: float,
                verbose: bool) -> tuple[Any]:
    return _patched(StepCacheKind.LAZY, model, reuse_threshold, start_percent, end_percent, verbose)


def _inputs(name: str) -> list:
    return [
        Input.link("model", "MODEL", tooltip=f"The model {name} lets the sampler skip steps of."),
        Input.float("reuse_threshold", 0.2, min=0.0, max=3.0, step=0.01,
                    tooltip="How much estimated change of the output, summed since the last computed step, a "
                            "skipped step may stand for. Higher skips more steps and drifts further from the "
                            "full run; 0 skips none."),
        Input.float("start_percent", 0.15, min=0.0, max=1.0, step=0.01,
                    tooltip="How far into sampling skipping may begin; every earlier step is computed."),
        Input.float("end_percent", 0.95, min=0.0, max=1.0, step=0.01,
                    tooltip="How far into sampling skipping stops; every later step, and always the last one, "
                            "is computed."),
        Input.boolean("verbose", False, tooltip="Log each step's estimate and whether it was skipped."),
    ]


NODES = [
    NodeSpec(
        node_id="EasyCache", display_name="EasyCache", category="advanced/debug/model", python_module=_MODULE,
        experimental=True,
        description="Skips transformer calls on steps where the output is estimated to change little, reusing "
                    "the change the last computed call made. The estimate is kept apart for the picture and "
                    "the sound; a step is skipped only when both stay under the threshold.",
        execute=_easy_cache, inputs=_inputs("EasyCache"),
        outputs=[Output("MODEL", tooltip="The same model, with EasyCache step skipping.")],
    ),
    NodeSpec(
        node_id="LazyCache", display_name="LazyCache", category="advanced/debug/model", python_module=_MODULE,
        experimental=True,
        description="A simpler relative of EasyCache: it judges the step's whole model output (after guidance) "
                    "at once, so with cfg above 1 a skipped step saves both calls. Usually skips less wisely "
                    "than EasyCache.",
        execute=_lazy_cache, inputs=_inputs("LazyCache"),
        outputs=[Output("MODEL", tooltip="The same model, with LazyCache step skipping.")],
    ),
]
