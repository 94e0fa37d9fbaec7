"""ComfyUI's `comfy.comfy_types` for node packs: typing only (see `node_typing`)."""
from __future__ import annotations

from typing import Any, Callable, Optional, Protocol, TypedDict

from .node_typing import IO, CheckLazyMixin, ComfyNodeABC, FileLocator, InputTypeDict


class UnetApplyFunction(Protocol):
    """The signature of a diffusion model's apply function (for wrapper typing)."""

    def __call__(self, x: Any, t: Any, **kwargs: Any) -> Any: ...


class UnetApplyConds(TypedDict):
    """The conditions a wrapped apply function receives."""

    c_concat: Optional[Any]
    c_crossattn: Optional[Any]
    control: Optional[Any]
    transformer_options: Optional[dict]


class UnetParams(TypedDict):
    """The arguments a model wrapper receives."""

    input: Any
    timestep: Any
    c: UnetApplyConds
    cond_or_uncond: list[int]


UnetWrapperFunction = Callable[[UnetApplyFunction, UnetParams], Any]

__all__ = ["IO", "InputTypeDict", "ComfyNodeABC", "CheckLazyMixin", "FileLocator", "UnetApplyFunction",
           "UnetApplyConds", "UnetParams", "UnetWrapperFunction"]
