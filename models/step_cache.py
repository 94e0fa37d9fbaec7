"""Step skipping for H3 sampling: EasyCache and LazyCache reuse the model's last change instead of calling it.

Both patches watch how much the model's output moved per unit of movement of its input on the steps it
really computed (the transformation rate), and on a later step estimate the output's change as that rate
times the input's change, relative to the size of the last output. While the estimates, summed since the
last computed step, stay under `reuse_threshold`, the step is skipped: its output is the input plus the
difference (output - input) of the last computed call. Once the sum reaches the threshold the model is
called and the sum starts again from zero.

H3 carries a picture stream and a sound stream in one latent, which move at different rates, so every
quantity above is kept per stream; a step is skipped only when both streams' sums stay under the
threshold (one transformer call computes both, so both must agree). A stream with no elements (no sound
frames) takes no part.

Where the two differ:
- EasyCache (`StepCacheKind.EASY`) sits at each transformer call: with classifier-free guidance a step
  makes two calls; the first one of the step decides and the others follow its decision, each reusing its
  own last difference.
- LazyCache (`StepCacheKind.LAZY`) sits around the step's whole (guided) model output: one estimate and
  one difference per step however many calls guidance makes.

Window: a step is a candidate only while its video sigma is at most the sigma at `start_percent` and
above the sigma at `end_percent` of the shifted schedule (the sampler node passes the percent-to-sigma
map of models/h3/sparse_attention.py), and never the last step of the schedule, whose output is the result.
The estimates are measured inside the window only, so its first step is always computed.

The settings travel on a MODEL handle as its `STEP_CACHE` option (models/patcher.py); one handle carries
at most one of them (a second would share the per-run state and corrupt it, so the nodes refuse it). The
state of one sampling run is a `StepCacheRun`, made by the sampler node for that run and dropped after it.
"""
from __future__ import annotations

import enum
import logging
import math
from dataclasses import dataclass, field
from typing import Callable

import contextvars

import torch

logger = logging.getLogger(__name__)

SUBSAMPLE = 8  # the estimates read every 8th element of a stream's last two axes, as ComfyUI's nodes do


class StepCacheKind(enum.Enum):
    """Which patch; the value is its node id, used in messages."""

    EASY = "EasyCache"
    LAZY = "LazyCache"


@dataclass(frozen=True)
class StepCacheSettings:
    """What an EasyCache or LazyCache node chose."""

    kind: StepCacheKind
    reuse_threshold: float  # skip while the summed estimated output change stays under this
    start_percent: float  # no skipping before this share of the schedule
    end_percent: float  # no skipping after this share of the schedule
    verbose: bool = False  # log each decision


@dataclass
class _StreamState:
    """What one stream of one call remembers of its last computed call."""

    input_sample: torch.Tensor | None = None  # subsampled model input of the last computed call
    output_sample: torch.Tensor | None = None  # subsampled model output of the last computed call
    output_size: float | None = None  # mean absolute value of that output
    rate: float | None = None  # output change per input change between the last two computed calls
    difference: torch.Tensor | None = None  # output - input of the last computed call (full size)
    pending_change: float | None = None  # this step's input change, measured when the decision was made


def _sample(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach()[..., ::SUBSAMPLE, ::SUBSAMPLE].float()


def _mean_abs(tensor: torch.Tensor) -> float:
    return float(tensor.abs().mean()) if tensor.numel() else math.nan


@dataclass
class StepCacheRun:
    """One sampling run's step-skipping state and its counts (computed and skipped steps, model calls)."""

    settings: StepCacheSettings
    window: tuple[float, float]  # (sigma at start_percent, sigma at end_percent)
    total_steps: int
    computed_steps: int = 0
    skipped_steps: int = 0
    model_calls: int = 0  # transformer calls made (EasyCache) or guided model evaluations (LazyCache)
    _calls: dict[int, list[_StreamState]] = field(default_factory=dict)  # per call index of a step
    _summed: list[float] = field(default_factory=list)  # per stream: estimated change since the last compute
    _step: int = -1
    _step_sigma: float = 1.0
    _call_index: int = 0
    _decision: bool | None = None  # the step's skip decision, made by its first call

    @classmethod
    def start(cls, settings: StepCacheSettings, sigmas: torch.Tensor,
              percent_to_sigma: Callable[[float], float]) -> "StepCacheRun":
        """The state for sampling along `sigmas` (the video schedule, steps + 1 values), whose shifted
        schedule maps a share of the way through to a sigma with `percent_to_sigma`."""
        window = (percent_to_sigma(settings.start_percent), percent_to_sigma(settings.end_percent))
        return cls(settings, window, int(torch.as_tensor(sigmas).numel()) - 1)

    @property
    def kind(self) -> StepCacheKind:
        """EasyCache or LazyCache."""
        return self.settings.kind

    def summary(self) -> str:
        """One line for the sampler's progress text and the log."""
        calls = "transformer calls" if self.kind is StepCacheKind.EASY else "model evaluations"
        return (f"{self.kind.value}: computed {self.computed_steps} of {self.total_steps} steps, skipped "
                f"{self.skipped_steps} ({self.model_calls} {calls})")

    def candidate(self, step: int, sigma: float) -> bool:
        """Whether `step` (0-based) at video sigma `sigma` may be skipped at all."""
        start_sigma, end_sigma = self.window
        return step < self.total_steps - 1 and end_sigma < sigma <= start_sigma

    def step(self, step: int, sigma: float, compute: Callable[[], tuple[torch.Tensor, ...]],
             inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """One sampler step (0-based `step` at video sigma `sigma`): the model output on `inputs`, computed
        by `compute()` or reused. LazyCache decides here; EasyCache at each transformer call inside it."""
        self._step, self._step_sigma, self._call_index, self._decision = step, float(sigma), 0, None
        if self.kind is StepCacheKind.LAZY:
            outputs = self.call(compute, inputs)
        else:
            token = _running.set(self)
            try:
                outputs = compute()
            finally:
                _running.reset(token)
        if self._decision:
            self.skipped_steps += 1
        else:
            self.computed_steps += 1
        return outputs

    def call(self, compute: Callable[[], tuple[torch.Tensor, ...]],
             inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """One model call of the current step: `compute()` or, when skipped, each input plus its last difference."""
        index = self._call_index
        self._call_index += 1
        streams = self._calls.setdefault(index, [_StreamState() for _ in inputs])
        if index == 0:
            self._decision = self._decide(streams, inputs)
        elif self._decision and any(state.difference is None for state in streams):
            self._decision = False  # a later call with nothing to reuse: the whole step is computed
        if self._decision:
            return tuple(x + state.difference.to(device=x.device, dtype=x.dtype)
                         for x, state in zip(inputs, streams))
        outputs = compute()
        self.model_calls += 1
        self._remember(streams, inputs, outputs, measure=index == 0)
        return outputs

    def _decide(self, streams: list[_StreamState], inputs: tuple[torch.Tensor, ...]) -> bool:
        if not self._summed:
            self._summed = [0.0] * len(inputs)
        if not self.candidate(self._step, self._step_sigma):
            return False  # outside the window: computed; the estimates are measured inside it only
        estimates = []
        for number, (state, x) in enumerate(zip(streams, inputs)):
            change = state.pending_change = self._input_change(state, x)
            if x.numel() == 0:
                continue
            if change is None or state.rate is None or not state.output_size:
                estimates.append(math.inf)
                continue
            self._summed[number] += state.rate * change / state.output_size
            estimates.append(self._summed[number])
        skip = bool(estimates) and all(math.isfinite(value) and value < self.settings.reuse_threshold
                                       for value in estimates)
        skip = skip and all(state.difference is not None for state in streams)
        if self.settings.verbose:
            logger.info("%s: step %d of %d %s (estimated change per stream %s, threshold %g)", self.kind.value,
                        self._step + 1, self.total_steps, "skipped" if skip else "computed",
                        ", ".join(f"{value:.4g}" for value in estimates), self.settings.reuse_threshold)
        if not skip:
            self._summed = [0.0] * len(inputs)
        return skip

    @staticmethod
    def _input_change(state: _StreamState, x: torch.Tensor) -> float | None:
        if state.input_sample is None or x.numel() == 0:
            return None
        return _mean_abs(_sample(x) - state.input_sample.to(x.device))

    def _remember(self, streams: list[_StreamState], inputs: tuple[torch.Tensor, ...],
                  outputs: tuple[torch.Tensor, ...], *, measure: bool) -> None:
        if len(outputs) != len(inputs):
            raise ValueError(f"{self.kind.value}: the model returned {len(outputs)} streams for {len(inputs)} inputs")
        for state, x, out in zip(streams, inputs, outputs):
            if x.numel() == 0:
                state.difference = out.detach() - x.detach()
                continue
            out_sample = _sample(out)
            if measure and state.output_sample is not None and state.pending_change:
                state.rate = _mean_abs(out_sample - state.output_sample) / state.pending_change
            state.pending_change = None
            state.difference = (out.detach() - x.detach()).to(out.dtype)
            state.input_sample = _sample(x)
            state.output_sample = out_sample
            state.output_size = _mean_abs(out.detach().float())


# The EasyCache run of the sampler step in progress, consulted by each transformer call (ModelHandle.__call__).
_running: contextvars.ContextVar[StepCacheRun | None] = contextvars.ContextVar("weft_step_cache", default=None)


def running() -> StepCacheRun | None:
    """The EasyCache run whose step is in progress (None outside one, and for LazyCache)."""
    return _running.get()


def guarded_call(compute: Callable[[], tuple[torch.Tensor, ...]], video: torch.Tensor,
                 audio: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A transformer call on (video, audio): through the running EasyCache step when there is one."""
    run = _running.get()
    if run is None:
        return compute()
    token = _running.set(None)  # the model's own inner calls, if any, are not steps
    try:
        return run.call(compute, (video, audio))
    finally:
        _running.reset(token)
