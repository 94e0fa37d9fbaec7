"""The `compiled` backend's machinery: torch.compile once per shape class, lazily, with capability checks.

A shape class is everything about a call that changes the generated code (dtype, device, feature
sizes, which optional inputs are present) except the token (or frame) count: the caller either marks
that size dynamic up front (`dynamic=`) or leaves dynamo to compile the first count static and
recompile once with it symbolic when a second count arrives (automatic dynamic shapes). Each
class gets its own compiled function object with its own code object: dynamo keeps its compiled
variants per code object and stops compiling after a small limit, so sharing one code object
across many layer shapes would silently drop the later ones back to Python.
"""
from __future__ import annotations

import functools
import importlib.util
import logging
import shutil
import threading
import types
from typing import Any, Callable, Hashable

import torch

from kernels.registry import BackendUnavailable

logger = logging.getLogger(__name__)

# Below this many multiply-adds an op is too small to repay its compile time (seconds per shape
# class on a CPU); such calls go to eager. Tiny test models stay fast this way.
MIN_COMPILE_MACS = 1 << 25


@functools.lru_cache(maxsize=None)
def _device_reason(device_type: str) -> str | None:
    if device_type == "cpu":
        if not any(shutil.which(cxx) for cxx in ("g++", "c++", "clang++")):
            return "torch.compile on the CPU needs a C++ compiler (g++/clang++), none found on PATH"
        return None
    if device_type == "cuda":
        if importlib.util.find_spec("triton") is None:
            return "torch.compile on CUDA needs the triton package, which is not installed"
        return None
    return f"torch.compile is not used on {device_type} devices"


def available() -> str | None:
    """Why torch.compile cannot be used in this process (None when it can)."""
    if not hasattr(torch, "compile"):
        return "this torch has no torch.compile"
    return None


def decline_reason(tensors: list[torch.Tensor | None]) -> str | None:
    """The per-call checks every compiled op shares: device, dtype, autograd, nesting."""
    present = [t for t in tensors if t is not None]
    device_type = present[0].device.type
    reason = _device_reason(device_type)
    if reason is not None:
        return reason
    if torch.compiler.is_compiling():
        return "already inside a torch.compile region (the outer compile fuses the eager op)"
    if torch.is_grad_enabled() and any(t.requires_grad for t in present):
        return "inputs require grad; the compiled backend serves inference only"
    if any(t.is_floating_point() and t.dtype not in (torch.float32, torch.bfloat16, torch.float16) for t in present):
        return f"dtype {present[0].dtype} is not float32/bfloat16/float16"
    return None


def worthwhile(macs: int, minimum: int = MIN_COMPILE_MACS) -> str | None:
    """Why a call of `macs` multiply-adds should not be compiled automatically (None when it should); an op
    whose compiled form saves less per call than the Linear's may ask for a larger `minimum`."""
    if macs < minimum:
        return f"too small to repay compiling ({macs} multiply-adds < {minimum})"
    return None


def _fresh_copy(fn: Callable[..., Any], tag: str) -> Callable[..., Any]:
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{tag}", co_qualname=f"{fn.__qualname__}_{tag}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


class ShapeClassCompiler:
    """Compiles `fn` once per shape-class key and runs the compiled version; remembers failures."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self._compiled: dict[Hashable, Callable[..., Any]] = {}
        self._failed: dict[Hashable, str] = {}
        self._lock = threading.Lock()

    def failure(self, key: Hashable) -> str | None:
        """Why compiling this class failed before (None when it did not)."""
        return self._failed.get(key)

    def compiled_classes(self) -> int:
        """How many shape classes have a compiled function."""
        return len(self._compiled)

    def variants(self, key: Hashable) -> int:
        """How many graphs dynamo holds for class `key` (1 static; 2 once a second size made it dynamic)."""
        compiled = self._compiled.get(key)
        if compiled is None:
            return 0
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list

        return len(_debug_get_cache_entry_list(compiled._torchdynamo_orig_callable.__code__))

    def run(self, key: Hashable, *args, dynamic: list[tuple[torch.Tensor, int]] = (), **kwargs):
        """Run the compiled function of class `key`; `dynamic` lists (tensor, dim) sizes left symbolic."""
        failed = self._failed.get(key)
        if failed is not None:
            raise BackendUnavailable(failed)
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is None:
                compiled = torch.compile(_fresh_copy(self.fn, str(len(self._compiled))), fullgraph=True)
                self._compiled[key] = compiled
        for tensor, dim in dynamic:
            torch._dynamo.maybe_mark_dynamic(tensor, dim)
        try:
            return compiled(*args, **kwargs)
        except Exception as error:  # the compiler's failure, not the caller's: eager will say if it is the caller's
            reason = f"torch.compile failed for this shape class: {type(error).__name__}: {str(error)[:300]}"
            logger.warning("%s", reason)
            self._failed[key] = reason
            raise BackendUnavailable(reason) from error
