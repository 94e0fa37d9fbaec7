"""Backend registries: each op tries its backends in priority order and runs the first capable one.

A backend is a function with the op's signature plus two checks: `available()` once per process
(is the package importable, is there a CUDA device) and `check(*args, **kwargs)` per call (device,
dtype, shape, contiguity). Both return None when the backend can run, else the reason it cannot.
`eager` is the reference of every op and always runs.

The choice can be forced, most specific first:
  1. `backend=` passed to the op (where the op takes it, e.g. attention);
  2. the environment variable WEFT_KERNEL_BACKEND: either a backend name for every op that has one
     of that name (`compiled`), or per op (`linear:compiled,conv3d:eager`); read at each call but
     parsed only when its value changes (`backend_override()`);
  3. `disable_fused_kernels()` (`--disable-fused-kernels`): every op runs `eager`.
A forced backend that cannot run the call raises ValueError saying why; it never falls back silently.

An op may pass `memo_key=`: a hashable summary of the call holding everything its backends' `check`
and `worthwhile` read (devices, dtypes, shapes, grad and compile state). The automatic choice made for
one key is remembered and reused for later calls with the same key, without running the checks again
(a model calls the same shapes every step). A forced backend never uses or fills the memo; registering
or unregistering a backend clears it, and a backend that gives up (BackendUnavailable) is forgotten.
"""
from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from kernels.options import FAST_OPTIONS  # defined torch-free for the command line

ENV_VAR = "WEFT_KERNEL_BACKEND"
MEMO_LIMIT = 4096  # remembered choices per op

logger = logging.getLogger(__name__)

_fused_disabled = False
_fast_options: frozenset[str] = frozenset()
_registries: dict[str, "KernelRegistry"] = {}


def disable_fused_kernels(disabled: bool = True) -> None:
    """Make every op run its eager reference (`--disable-fused-kernels`); pass False to undo."""
    global _fused_disabled
    _fused_disabled = bool(disabled)


def fused_kernels_enabled() -> bool:
    """False after disable_fused_kernels()."""
    return not _fused_disabled


def set_fast_options(options: Iterable[str]) -> None:
    """Opt into less exact math (`--fast OPTION...`); replaces the earlier set."""
    global _fast_options
    options = frozenset(options)
    unknown = options - set(FAST_OPTIONS)
    if unknown:
        raise ValueError(f"unknown --fast option(s) {sorted(unknown)}; expected some of {FAST_OPTIONS}")
    _fast_options = options
    # fp16 accumulation exists for CUDA matrix products (cuBLAS) only; PyTorch has no such switch for
    # cuDNN convolutions, so conv3d keeps float32 accumulation whatever the flag says.
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "allow_fp16_accumulation"):
        matmul.allow_fp16_accumulation = "fp16_accumulation" in options


def fast_option(name: str) -> bool:
    """Whether `--fast name` is on."""
    return name in _fast_options


class BackendUnavailable(RuntimeError):
    """Raised by a backend that found at run time that it cannot serve the call (e.g. its compile failed)."""


@dataclass
class Backend:
    """One implementation of an op, with its process-wide and per-call capability checks."""

    name: str
    fn: Callable[..., Any]
    check: Callable[..., str | None] | None = None  # per call: None = can run, else the reason
    available: Callable[[], str | None] | None = None  # once per process: None = present, else the reason
    # per call, automatic choice only: None = worth using, else why not (a forced backend ignores it)
    worthwhile: Callable[..., str | None] | None = None
    _availability: tuple[str | None] | None = None

    def unavailable_reason(self) -> str | None:
        """Why this backend cannot run at all in this process (None when it can), cached."""
        if self._availability is None:
            try:
                reason = self.available() if self.available is not None else None
            except Exception as error:  # an import that fails in an odd way is just "not available"
                reason = f"{type(error).__name__}: {error}"
            self._availability = (reason,)
        return self._availability[0]

    def decline_reason(self, *args, **kwargs) -> str | None:
        """Why this backend cannot run this call (None when it can)."""
        reason = self.unavailable_reason()
        if reason is None and self.check is not None:
            reason = self.check(*args, **kwargs)
        return reason


@dataclass(frozen=True)
class BackendOverride:
    """WEFT_KERNEL_BACKEND, parsed: backends named per op, and one bare name for every op that has it."""

    text: str                      # the variable as set
    per_op: dict[str, str]         # op -> backend, from `op:backend` parts (the first part for an op wins)
    everywhere: str | None = None  # a bare `backend` part (the last one wins)

    @classmethod
    def parse(cls, text: str) -> BackendOverride:
        """Split the variable's value into its per-op and bare parts."""
        per_op: dict[str, str] = {}
        everywhere = None
        for part in (p.strip() for p in text.split(",")):
            if ":" in part:
                op_name, _, backend = part.partition(":")
                per_op.setdefault(op_name.strip(), backend.strip())
            elif part:
                everywhere = part
        return cls(text, per_op, everywhere)

    def backend_for(self, op: str) -> str | None:
        """The backend this setting forces on `op`, or None; ValueError when a bare name matches no backend."""
        if op in self.per_op:
            return self.per_op[op]
        if self.everywhere is None:
            return None
        known = _backend_names()
        if self.everywhere not in known:
            import kernels.attention, kernels.conv2d, kernels.conv3d, kernels.linear, kernels.quantized_linear  # noqa: F401,E501 (every op registers its backends)
            known = _backend_names()
        if self.everywhere not in known:
            raise ValueError(f"{ENV_VAR}={self.text!r}: no op has a backend named {self.everywhere!r}; "
                             f"known backends: {sorted(known)}")
        # A bare name forces only the ops that have a backend of that name.
        return self.everywhere if self.everywhere in _registries[op].names() else None


_parsed_override: BackendOverride | None = None


def backend_override() -> BackendOverride | None:
    """The parsed WEFT_KERNEL_BACKEND (None when unset or blank), parsed again only when its value changes."""
    global _parsed_override
    text = os.environ.get(ENV_VAR, "")
    if not text.strip():
        return None
    parsed = _parsed_override
    if parsed is None or parsed.text != text:
        parsed = _parsed_override = BackendOverride.parse(text)
    return parsed


def _backend_names() -> set[str]:
    return {name for registry in _registries.values() for name in registry.names()}


class KernelRegistry:
    """The backends of one op in priority order; calling it runs the first capable one."""

    def __init__(self, op: str) -> None:
        self.op = op
        self._backends: list[Backend] = []
        self._local = threading.local()
        self._memo: dict[Any, Backend] = {}  # memo_key -> the automatic choice (see the module docstring)
        _registries[op] = self

    def register(self, name: str, fn: Callable[..., Any], *, check: Callable[..., str | None] | None = None,
                 available: Callable[[], str | None] | None = None,
                 worthwhile: Callable[..., str | None] | None = None, before: str | None = None) -> Backend:
        """Add a backend (last in priority unless `before` names one it should precede)."""
        if any(b.name == name for b in self._backends):
            raise ValueError(f"kernel op {self.op!r} already has a backend named {name!r}")
        backend = Backend(name, fn, check, available, worthwhile)
        index = len(self._backends)
        if before is not None:
            index = next((i for i, b in enumerate(self._backends) if b.name == before), None)
            if index is None:
                raise ValueError(f"kernel op {self.op!r} has no backend {before!r} to insert {name!r} before")
        self._backends.insert(index, backend)
        self._memo = {}
        return backend

    def unregister(self, name: str) -> None:
        """Remove a backend (tests register temporary ones)."""
        self._backends = [b for b in self._backends if b.name != name]
        self._memo = {}

    def names(self) -> list[str]:
        """Backend names in priority order."""
        return [b.name for b in self._backends]

    def available_names(self) -> list[str]:
        """Names of the backends present in this process (they may still decline a given call)."""
        return [b.name for b in self._backends if b.unavailable_reason() is None]

    def backend(self, name: str) -> Backend:
        """The backend called `name`."""
        for backend in self._backends:
            if backend.name == name:
                return backend
        raise ValueError(f"kernel op {self.op!r} has no backend {name!r}; it has {self.names()}")

    @property
    def last_backend(self) -> str | None:
        """The backend that ran this thread's most recent call (for tests and profiles)."""
        return getattr(self._local, "last", None)

    def forced_backend(self, backend: str | None = None) -> tuple[str | None, str]:
        """The backend name forcing this call (None for automatic choice) and what forced it."""
        if backend is not None:
            return backend, "the backend= argument"
        override = backend_override()
        forced = override.backend_for(self.op) if override is not None else None
        if forced is not None:
            return forced, f"{ENV_VAR}={override.text!r}"
        if _fused_disabled:
            return "eager", "--disable-fused-kernels"
        return None, ""

    def remembered(self, memo_key: Any) -> Backend | None:
        """The automatic choice remembered for `memo_key`, when no backend is forced now (else None)."""
        chosen = self._memo.get(memo_key)
        if chosen is None or self.forced_backend()[0] is not None:
            return None
        return chosen

    def run_remembered(self, chosen: Backend, memo_key: Any, *args, **kwargs):
        """Run `chosen` (from `remembered`); if it gives up, forget it and choose again."""
        try:
            result = chosen.fn(*args, **kwargs)
        except BackendUnavailable as error:
            logger.warning("kernel %s: backend %s gave up (%s); choosing again", self.op, chosen.name, error)
            self._memo.pop(memo_key, None)
            return self(*args, memo_key=memo_key, **kwargs)
        self._local.last = chosen.name
        return result

    def __call__(self, *args, backend: str | None = None, memo_key: Any = None, **kwargs):
        forced, source = self.forced_backend(backend)
        if forced is not None:
            chosen = self.backend(forced)
            reason = chosen.decline_reason(*args, **kwargs)
            if reason is not None:
                raise ValueError(f"kernel {self.op!r}: backend {forced!r} (forced by {source}) cannot run this call: {reason}")
            try:
                result = chosen.fn(*args, **kwargs)
            except BackendUnavailable as error:
                raise ValueError(f"kernel {self.op!r}: backend {forced!r} (forced by {source}) failed: {error}") from error
            self._local.last = forced
            return result
        for candidate in self._backends:
            if candidate.decline_reason(*args, **kwargs) is not None:
                continue
            if candidate.worthwhile is not None and candidate.worthwhile(*args, **kwargs) is not None:
                continue
            try:
                result = candidate.fn(*args, **kwargs)
            except BackendUnavailable as error:
                logger.warning("kernel %s: backend %s gave up (%s); trying the next", self.op, candidate.name, error)
                continue
            self._local.last = candidate.name
            if memo_key is not None:
                if len(self._memo) >= MEMO_LIMIT:  # shapes that keep changing: start over rather than grow
                    self._memo = {}
                self._memo[memo_key] = candidate
            return result
        raise ValueError(f"kernel {self.op!r}: no backend can run this call (tried {self.names()})")


def registry(op: str) -> KernelRegistry:
    """The registry of `op` ('linear', 'conv2d', 'conv3d', 'attention', ...)."""
    try:
        return _registries[op]
    except KeyError:
        raise ValueError(f"no kernel op {op!r}; known ops: {sorted(_registries)}") from None
