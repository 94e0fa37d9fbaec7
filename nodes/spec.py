"""Builders that declare nodes as data: `Input.int(...)`, `Input.combo(...)`, `Output(...)`.

The contract they build (`NodeSpec`, `InputSpec`, `OutputSpec`, the type constants) is owned by
`execution/spec.py`, where the executor consumes it; it is re-exported here so a node pack needs one
import. Classic ComfyUI classes are adapted into the same `NodeSpec` by `nodes/classic.py`.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from execution.spec import (  # noqa: F401 (the contract, re-exported for node packs)
    AUTOGROW, DYNAMIC_COMBO, HIDDEN_VALUES, INPUT_KINDS, UI_OPTION_KEYS, WIDGET_TYPES, InputSpec,
    NodeDefinitionError, NodeSpec, OutputSpec, widget_inputs,
)
from execution.types import (  # noqa: F401 (re-exported for node authors)
    MATCH_TYPE, ExecutionBlocker, NodeOutput, normalize_result, types_compatible,
)


# ---------------------------------------------------------------------- declaration helpers
def _opts(tooltip: str | None, **kw: Any) -> dict[str, Any]:
    out = {k: v for k, v in kw.items() if v is not None}
    if tooltip:
        out["tooltip"] = tooltip
    return out


class Input:
    """Constructors for InputSpec, so node declarations read as data."""

    @staticmethod
    def int(name: str, default: int = 0, *, min: int = -(2**63), max: int = 2**63 - 1, step: int = 1,
            tooltip: str | None = None, optional: bool = False, lazy: bool | None = None,
            force_input: bool | None = None, control_after_generate: bool | None = None,
            display: str | None = None) -> InputSpec:
        return InputSpec(name, "INT", "optional" if optional else "required", _opts(
            tooltip, default=default, min=min, max=max, step=step, lazy=lazy, forceInput=force_input,
            control_after_generate=control_after_generate, display=display))

    @staticmethod
    def float(name: str, default: float = 0.0, *, min: float = -1e18, max: float = 1e18, step: float = 0.01,
              round: float | bool | None = None, tooltip: str | None = None, optional: bool = False,
              lazy: bool | None = None, force_input: bool | None = None) -> InputSpec:
        return InputSpec(name, "FLOAT", "optional" if optional else "required", _opts(
            tooltip, default=default, min=min, max=max, step=step, round=round, lazy=lazy, forceInput=force_input))

    @staticmethod
    def string(name: str, default: str = "", *, multiline: bool = False, tooltip: str | None = None,
               optional: bool = False, lazy: bool | None = None, force_input: bool | None = None,
               dynamic_prompts: bool | None = None, placeholder: str | None = None) -> InputSpec:
        return InputSpec(name, "STRING", "optional" if optional else "required", _opts(
            tooltip, default=default, multiline=multiline or None, lazy=lazy, forceInput=force_input,
            dynamicPrompts=dynamic_prompts, placeholder=placeholder))

    @staticmethod
    def boolean(name: str, default: bool = False, *, tooltip: str | None = None, optional: bool = False,
                lazy: bool | None = None, force_input: bool | None = None, label_on: str | None = None,
                label_off: str | None = None) -> InputSpec:
        return InputSpec(name, "BOOLEAN", "optional" if optional else "required", _opts(
            tooltip, default=default, lazy=lazy, forceInput=force_input, label_on=label_on, label_off=label_off))

    @staticmethod
    def combo(name: str, choices: Sequence[Any] | Callable[[], Sequence[Any]], default: Any = None, *,
              tooltip: str | None = None, optional: bool = False, lazy: bool | None = None,
              image_upload: bool | None = None, control_after_generate: bool | None = None,
              folder: str | Callable[[], str] | None = None,
              missing_hint: Callable[[], str] | None = None) -> InputSpec:
        opts = _opts(tooltip, default=default, lazy=lazy, image_upload=image_upload,
                     control_after_generate=control_after_generate)
        return InputSpec(name, "COMBO", "optional" if optional else "required", opts, choices, folder=folder,
                         missing_hint=missing_hint)

    @staticmethod
    def link(name: str, type: str, *, tooltip: str | None = None, optional: bool = False,
             lazy: bool | None = None, raw_link: bool | None = None) -> InputSpec:
        return InputSpec(name, type, "optional" if optional else "required",
                         _opts(tooltip, lazy=lazy, rawLink=raw_link))

    @staticmethod
    def hidden(name: str, value: str) -> InputSpec:
        return InputSpec(name, value, "hidden")

    @staticmethod
    def dynamic_combo(name: str, options: Mapping[str, Sequence[InputSpec]], *, tooltip: str | None = None) -> InputSpec:
        return InputSpec(name, DYNAMIC_COMBO, "required", _opts(tooltip),
                         dynamic_options={k: tuple(v) for k, v in options.items()})

    @staticmethod
    def autogrow(name: str, template: InputSpec, *, prefix: str = "", names: Sequence[str] = (), min: int = 0,
                 max: int = 50, tooltip: str | None = None) -> InputSpec:
        if names:
            max = len(names)
        return InputSpec(name, AUTOGROW, "optional" if min == 0 else "required", _opts(tooltip),
                         template=template, prefix=prefix, grow_min=min, grow_max=max, names=tuple(names))

    @staticmethod
    def match_type(name: str, template_id: str = "T", *, allowed: str = "*", tooltip: str | None = None,
                   optional: bool = False, lazy: bool | None = None) -> InputSpec:
        opts = _opts(tooltip, lazy=lazy)
        opts["template"] = {"template_id": template_id, "allowed_types": allowed}
        return InputSpec(name, MATCH_TYPE, "optional" if optional else "required", opts)


def Output(type: str, name: str = "", *, is_list: bool = False, tooltip: str | None = None,
           match_type: str | None = None) -> OutputSpec:
    """Declare an output."""
    return OutputSpec(type, name, is_list, tooltip, match_type)
