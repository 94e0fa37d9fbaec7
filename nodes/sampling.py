"""Sampling nodes: the seed, the stepper, the noise levels, the guiders, and the three sampler nodes.

What the wires carry:
- NOISE: a `Noise`, which is a seed; `generate_noise(latent)` draws the picture and sound noise from it.
  `NoNoise` (DisableNoise) adds none: the latent is sampled from where it is, as a second pass continues
  a first pass's leftover noise.
- SAMPLER: a `Sampler`, the name of the ODE stepper (euler or res_multistep).
- SIGMAS: float32 noise levels of the picture stream, falling to 0; the sound stream's follow from them.
- GUIDER: a `Guider`, a MODEL with the conditioning it follows (and, for CFG, a negative one and a scale).

The H3 models were distilled to need no classifier-free guidance, so one model call per step
(BasicGuider, or KSampler at cfg 1) is the intended use; any other cfg adds a call on the negative
conditioning at every step.
"""
from __future__ import annotations

import logging
import re
from typing import Any

import torch

from execution.context import current
from models.h3.sampling import SCHEDULERS
from nodes.latent import check_latent
from nodes.loaders import check_model
from nodes.previews import SamplerPreviews
from nodes.spec import Input, NodeSpec, Output

logger = logging.getLogger(__name__)

SAMPLER_NAMES = ("euler", "res_multistep")
SCHEDULER_NAMES = SCHEDULERS
SEED_MAX = 0xFFFF_FFFF_FFFF_FFFF
_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


def model_shifts(model: Any) -> tuple[float, float]:
    """(picture shift, sound shift) of a MODEL: those set by MiniMaxH3SigmaShift, else its config's."""
    shifts = getattr(model, "h3_shifts", None)
    if shifts is not None:
        return float(shifts[0]), float(shifts[1])
    config = getattr(getattr(model, "model", model), "config", None)
    return float(getattr(config, "shift_video", 12.0)), float(getattr(config, "shift_audio", 3.0))


class Noise:
    """NOISE: the seed of the starting noise, drawn on the CPU, picture stream before sound stream."""

    adds_noise = True  # whether sampling mixes this noise into the latent at the first sigma

    def __init__(self, seed: int) -> None:
        self.seed = int(seed)

    def generate_noise(self, latent: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(picture noise, sound noise), each of its stream's shape in `latent`."""
        from models.h3.sampling import make_noise

        return make_noise(latent, self.seed)

    def __repr__(self) -> str:
        return f"Noise(seed={self.seed})"


class NoNoise(Noise):
    """NOISE that adds nothing: the latent already holds the noise of its first sigma."""

    adds_noise = False

    def __init__(self) -> None:
        super().__init__(0)

    def generate_noise(self, latent: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Zeros of each stream's shape."""
        return torch.zeros_like(latent["samples"]), torch.zeros_like(latent["audio_samples"])

    def __repr__(self) -> str:
        return "NoNoise()"


class Sampler:
    """SAMPLER: which ODE stepper integrates the flow."""

    def __init__(self, name: str) -> None:
        if name not in SAMPLER_NAMES:
            raise ValueError(f"sampler {name!r} is not available; the choices are {', '.join(SAMPLER_NAMES)}")
        self.name = name

    def __repr__(self) -> str:
        return f"Sampler({self.name!r})"


class _GuidedModel:
    """Two model calls per step combined by CFG: v = v_neg + cfg * (v_pos - v_neg), per stream."""

    def __init__(self, handle: Any, negative: list, cfg: float, frames: int) -> None:
        self.handle = handle
        self.model = handle.model
        self.negative = negative
        self.cfg = float(cfg)
        self.frames = frames

    def __call__(self, video, audio, context, sigma_video, sigma_audio, *, context_mask=None, conditions=None,
                 video_mask=None, audio_mask=None, condition_seed=0, context_tags=None, target_window=None,
                 clip_size=None):
        from models.h3 import packing
        from models.h3.context_windows import settings_of as context_windows_settings, window_conditions
        from models.h3.sampling import split_conditioning

        common = dict(video_mask=video_mask, audio_mask=audio_mask, condition_seed=condition_seed,
                      target_window=target_window, clip_size=clip_size)
        v_pos, a_pos = self.handle(video, audio, context, sigma_video, sigma_audio, context_mask=context_mask,
                                   conditions=conditions, context_tags=context_tags, **common)
        hidden, extras = split_conditioning(self.negative)
        b, _, _, lh, lw = video.shape
        items = [packing.condition_items(extras, i, target_frames=self.frames, latent_h=lh + lh % 2,
                                         latent_w=lw + lw % 2, audio_t=audio.shape[-1]) for i in range(b)]
        if target_window is not None:  # a context window keeps the guides it covers, as for the positive prompt
            retain = getattr(context_windows_settings(self.handle), "cond_retain", ())
            items = [window_conditions(batch_items, target_window.video, retain) for batch_items in items]
        mask = extras.get("attention_mask")
        v_neg, a_neg = self.handle(video, audio, hidden.to(video.device), sigma_video, sigma_audio,
                                   context_mask=mask.to(video.device) if mask is not None else None,
                                   conditions=items, context_tags=extras.get(packing.TOKEN_TAGS_KEY), **common)
        return v_neg + self.cfg * (v_pos - v_neg), a_neg + self.cfg * (a_pos - a_neg)


class Guider:
    """GUIDER: a MODEL and the conditioning it follows; `sample` runs the sampler with them."""

    def __init__(self, model: Any, positive: list, negative: list | None = None, cfg: float = 1.0) -> None:
        self.model = model
        self.positive = positive
        self.negative = negative
        self.cfg = float(cfg)

    def sample(self, noise: Noise, latent: dict, sampler: Sampler, sigmas: torch.Tensor, *,
               node: str = "SamplerCustomAdvanced") -> tuple[dict, dict]:
        """(the sampled LATENT, the model's last clean estimate as a LATENT); progress is reported per step."""
        from models.h3.sampling import sample

        latent = check_latent(node, latent, need=("samples", "audio_samples"), name="latent_image")
        last: dict[str, torch.Tensor] = {}
        previews = SamplerPreviews.start(latent)

        def on_step(step: int, total: int, denoised: dict) -> None:
            last.update(denoised)
            previews.report(step, total, denoised)

        runner = self.model
        if self.negative is not None and self.cfg != 1.0:
            frames = int(latent.get("length") or 0) or _pixel_frames(latent["samples"].shape[2])
            runner = _GuidedModel(self.model, self.negative, self.cfg, frames)
        video_shift, audio_shift = model_shifts(self.model)
        sigmas = torch.as_tensor(sigmas, dtype=torch.float32).flatten()
        skipping = step_cache_run(self.model, sigmas, video_shift)
        try:
            with previews:
                out = sample(runner, latent, self.positive, sigmas, noise.seed, sampler.name, callback=on_step,
                             video_shift=video_shift, audio_shift=audio_shift, add_noise=noise.adds_noise,
                             step_cache=skipping)
        except ValueError as exc:
            raise ValueError(f"{node}: {exc}") from None
        if skipping is not None:
            report_step_cache(skipping)
        denoised = dict(out)
        if last:
            denoised["samples"] = last["samples"].to(out["samples"].dtype)
            denoised["audio_samples"] = last["audio_samples"].to(out["audio_samples"].dtype)
        return out, denoised


def step_cache_run(model: Any, sigmas: torch.Tensor, video_shift: float):
    """The EasyCache / LazyCache state for one sampling run of `model` (None when it carries neither)."""
    from models.h3.sparse_attention import percent_to_sigma
    from models.patcher import STEP_CACHE
    from models.step_cache import StepCacheRun

    settings = getattr(model, "options", {}).get(STEP_CACHE)
    if settings is None:
        return None
    return StepCacheRun.start(settings, sigmas, lambda percent: percent_to_sigma(percent, video_shift))


def report_step_cache(run: Any) -> None:
    """The sampler node's progress text, its profile row's counts and a log line say what the run skipped."""
    ctx = current()
    ctx.show(text=run.summary())
    ctx.count("steps_computed", run.computed_steps)
    ctx.count("steps_skipped", run.skipped_steps)
    ctx.count("model_calls", run.model_calls)
    logger.info("node %s: %s", ctx.display_node_id, run.summary())


def _pixel_frames(latent_t: int) -> int:
    from models.h3 import pixel_frames

    return pixel_frames(latent_t)


def _check_conditioning(node: str, value: Any, name: str) -> list:
    if not isinstance(value, list) or not value or not isinstance(value[0], (list, tuple)):
        raise TypeError(f"{node}: input '{name}' must be a CONDITIONING, got {type(value).__name__}")
    return value


# ---------------------------------------------------------------------- node functions
def _random_noise(noise_seed: int) -> tuple[Noise]:
    return (Noise(noise_seed),)


def _ksampler_select(sampler_name: str) -> tuple[Sampler]:
    return (Sampler(sampler_name),)


def _schedule(node: str, model: Any, scheduler: str, steps: int, denoise: float, *,
              whole: bool = False) -> torch.Tensor:
    from models.h3 import sigmas

    video_shift, _ = model_shifts(model)
    try:
        return sigmas(int(steps), float(denoise), shift=video_shift, scheduler=scheduler, whole=whole)
    except ValueError as exc:
        raise ValueError(f"{node}: {exc}") from None


def _basic_scheduler(model: Any, scheduler: str, steps: int, denoise: float) -> tuple[torch.Tensor]:
    return (_schedule("BasicScheduler", check_model("BasicScheduler", model), scheduler, steps, denoise),)


def _disable_noise() -> tuple[Noise]:
    return (NoNoise(),)


def _manual_sigmas(sigmas: str) -> tuple[torch.Tensor]:
    # Every number in the text, whatever separates them ("1, 0.5", "1 0.5 0", one per line).
    values = [float(text) for text in _NUMBER.findall(sigmas)]
    if not values:
        raise ValueError(f"ManualSigmas: input 'sigmas' holds no number ({sigmas!r}); write the noise levels "
                         "separated by commas, such as '1.0, 0.5, 0.0'")
    return (torch.tensor(values, dtype=torch.float32),)


def _check_sigmas(node: str, sigmas: Any) -> torch.Tensor:
    if not isinstance(sigmas, torch.Tensor) or sigmas.dim() != 1:
        raise TypeError(f"{node}: input 'sigmas' takes SIGMAS (a list of noise levels), got "
                        f"{type(sigmas).__name__}")
    return sigmas


def _split_sigmas(sigmas: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    # Both parts keep the sigma at `step`: the first ends there, the second starts there.
    sigmas = _check_sigmas("SplitSigmas", sigmas)
    return sigmas[:int(step) + 1], sigmas[int(step):]


def _set_first_sigma(sigmas: torch.Tensor, sigma: float) -> tuple[torch.Tensor]:
    sigmas = _check_sigmas("SetFirstSigma", sigmas).clone()
    if sigmas.numel() == 0:
        raise ValueError("SetFirstSigma: input 'sigmas' is empty; there is no first noise level to set")
    sigmas[0] = float(sigma)
    return (sigmas,)


def _cfg_guider(model: Any, positive: list, negative: list, cfg: float) -> tuple[Guider]:
    node = "CFGGuider"
    model = check_model(node, model)
    return (Guider(model, _check_conditioning(node, positive, "positive"),
                   _check_conditioning(node, negative, "negative"), cfg),)


def _basic_guider(model: Any, conditioning: list) -> tuple[Guider]:
    model = check_model("BasicGuider", model)
    return (Guider(model, _check_conditioning("BasicGuider", conditioning, "conditioning")),)


def _sampler_custom_advanced(noise: Noise, guider: Guider, sampler: Sampler, sigmas: torch.Tensor,
                             latent_image: dict) -> tuple[dict, dict]:
    node = "SamplerCustomAdvanced"
    for value, cls, name in ((noise, Noise, "noise"), (guider, Guider, "guider"), (sampler, Sampler, "sampler")):
        if not isinstance(value, cls):
            raise TypeError(f"{node}: input '{name}' takes a {name.upper()}; got {type(value).__name__}")
    return guider.sample(noise, latent_image, sampler, sigmas, node=node)


def _ksampler(model: Any, seed: int, steps: int, cfg: float, sampler_name: str, scheduler: str, positive: list,
              negative: list, latent_image: dict, denoise: float) -> tuple[dict]:
    node = "KSampler"
    model = check_model(node, model)
    schedule = _schedule(node, model, scheduler, steps, denoise, whole=True)
    guider = Guider(model, _check_conditioning(node, positive, "positive"),
                    _check_conditioning(node, negative, "negative"), cfg)
    out, _ = guider.sample(Noise(seed), latent_image, Sampler(sampler_name), schedule, node=node)
    return (out,)


def advanced_schedule(schedule: torch.Tensor, start_at_step: int, end_at_step: int,
                      leftover_noise: bool) -> torch.Tensor:
    """The part of a `steps`-step schedule that steps start_at_step..end_at_step run (KSamplerAdvanced).

    Ending early keeps that step's sigma as the last one (the latent keeps its noise) when `leftover_noise`,
    else the last sigma becomes 0 so the part ends on a clean estimate. Fewer than two sigmas: no step runs.
    """
    sigmas = schedule.clone()
    if end_at_step < sigmas.numel() - 1:
        sigmas = sigmas[:end_at_step + 1]
        if not leftover_noise:
            sigmas[-1] = 0.0
    if start_at_step >= sigmas.numel() - 1:
        return sigmas[:0]
    return sigmas[start_at_step:]


def _ksampler_advanced(model: Any, add_noise: str, noise_seed: int, steps: int, cfg: float, sampler_name: str,
                       scheduler: str, positive: list, negative: list, latent_image: dict, start_at_step: int,
                       end_at_step: int, return_with_leftover_noise: str) -> tuple[dict]:
    node = "KSamplerAdvanced"
    model = check_model(node, model)
    schedule = _schedule(node, model, scheduler, steps, 1.0, whole=True)
    sigmas = advanced_schedule(schedule, int(start_at_step), int(end_at_step), return_with_leftover_noise == "enable")
    if sigmas.numel() < 2:  # the range holds no step: the latent passes through as it came
        return (check_latent(node, latent_image, need=("samples", "audio_samples"), name="latent_image"),)
    guider = Guider(model, _check_conditioning(node, positive, "positive"),
                    _check_conditioning(node, negative, "negative"), cfg)
    noise = Noise(noise_seed) if add_noise == "enable" else NoNoise()
    out, _ = guider.sample(noise, latent_image, Sampler(sampler_name), sigmas, node=node)
    return (out,)


_SEED_TIP = "Seed of the starting noise; the same seed and settings give the same result."
_CFG_TIP = ("Classifier-free guidance scale. At 1.0 the negative prompt is unused and each step is one model "
            "call, which suits the distilled H3 models.")
_ENABLE = ("enable", "disable")

NODES = [
    NodeSpec(
        node_id="RandomNoise", display_name="RandomNoise", category="sampling/custom_sampling/noise",
        python_module="comfy_extras.nodes_custom_sampler", execute=_random_noise,
        inputs=[Input.int("noise_seed", 0, min=0, max=SEED_MAX, control_after_generate=True, tooltip=_SEED_TIP)],
        outputs=[Output("NOISE")],
    ),
    NodeSpec(
        node_id="KSamplerSelect", display_name="KSamplerSelect", category="sampling/custom_sampling/samplers",
        python_module="comfy_extras.nodes_custom_sampler", execute=_ksampler_select,
        description="Chooses how the H3 flow ODE is stepped: euler (first order) or res_multistep (second order, "
                    "reusing the previous step).",
        inputs=[Input.combo("sampler_name", list(SAMPLER_NAMES), "euler")],
        outputs=[Output("SAMPLER")],
    ),
    NodeSpec(
        node_id="BasicScheduler", display_name="BasicScheduler", category="sampling/custom_sampling/schedulers",
        python_module="comfy_extras.nodes_custom_sampler", execute=_basic_scheduler,
        description="Noise levels for `steps` steps: steps + 1 values falling to 0 along the model's shifted "
                    "noise table. 'simple' and 'ddim_uniform' take evenly spaced entries of the table; 'normal' and "
                    "'sgm_uniform' space times evenly; 'karras', 'exponential' and 'kl_optimal' space the levels "
                    "themselves (by a power, a logarithm, an arctangent) between the table's largest and smallest; "
                    "'beta' crowds the steps at both ends; 'linear_quadratic' falls slowly at first, then fast.",
        inputs=[
            Input.link("model", "MODEL"),
            Input.combo("scheduler", list(SCHEDULER_NAMES), "simple"),
            Input.int("steps", 20, min=1, max=10000),
            Input.float("denoise", 1.0, min=0.0, max=1.0, step=0.01),
        ],
        outputs=[Output("SIGMAS")],
    ),
    NodeSpec(
        node_id="BasicGuider", display_name="BasicGuider", category="sampling/custom_sampling/guiders",
        python_module="comfy_extras.nodes_custom_sampler", execute=_basic_guider,
        inputs=[Input.link("model", "MODEL"), Input.link("conditioning", "CONDITIONING")],
        outputs=[Output("GUIDER")],
    ),
    NodeSpec(
        node_id="SamplerCustomAdvanced", display_name="SamplerCustomAdvanced", category="sampling/custom_sampling",
        python_module="comfy_extras.nodes_custom_sampler", execute=_sampler_custom_advanced,
        description="Samples both streams of the H3 latent, stepping through the sigmas with the guider's model.",
        inputs=[
            Input.link("noise", "NOISE"), Input.link("guider", "GUIDER"), Input.link("sampler", "SAMPLER"),
            Input.link("sigmas", "SIGMAS"), Input.link("latent_image", "LATENT"),
        ],
        outputs=[Output("LATENT", "output"), Output("LATENT", "denoised_output")],
    ),
    NodeSpec(
        node_id="KSampler", display_name="KSampler", category="sampling", python_module="nodes",
        description="Samples a latent in one node: seed, steps, stepper and schedule as widgets, the prompt on "
                    "positive and, when cfg is not 1, the prompt to avoid on negative.",
        execute=_ksampler,
        inputs=[
            Input.link("model", "MODEL", tooltip="Diffusion model that predicts each step."),
            Input.int("seed", 0, min=0, max=SEED_MAX, control_after_generate=True, tooltip=_SEED_TIP),
            Input.int("steps", 20, min=1, max=10000, tooltip="How many model steps to take from noise to result."),
            Input.float("cfg", 8.0, min=0.0, max=100.0, step=0.1, round=0.01, tooltip=_CFG_TIP),
            Input.combo("sampler_name", list(SAMPLER_NAMES), "euler",
                        tooltip="ODE stepper; see KSamplerSelect."),
            Input.combo("scheduler", list(SCHEDULER_NAMES), "simple",
                        tooltip="How the noise levels are spaced over the steps."),
            Input.link("positive", "CONDITIONING", tooltip="Encoded prompt the result should follow."),
            Input.link("negative", "CONDITIONING", tooltip="Encoded prompt the result should move away from (used "
                                                           "only when cfg is not 1)."),
            Input.link("latent_image", "LATENT", tooltip="Starting latent; its size and length set the output's."),
            Input.float("denoise", 1.0, min=0.0, max=1.0, step=0.01,
                        tooltip="Share of the noise schedule to run: 1.0 starts from pure noise, lower values keep "
                                "more of the starting latent."),
        ],
        outputs=[Output("LATENT", tooltip="The sampled latent.")],
    ),
    NodeSpec(
        node_id="KSamplerAdvanced", display_name="KSampler (Advanced)", category="sampling", python_module="nodes",
        description="KSampler that runs only steps start_at_step to end_at_step of its schedule, so several "
                    "samplers can share one schedule: the first adds the noise and stops with noise left, the next "
                    "continues from there without adding any.",
        execute=_ksampler_advanced,
        inputs=[
            Input.link("model", "MODEL", tooltip="Diffusion model that predicts each step."),
            Input.combo("add_noise", list(_ENABLE), "enable",
                        tooltip="'enable' mixes the seed's noise into the latent first; 'disable' samples the "
                                "latent as it comes, as a second pass does."),
            Input.int("noise_seed", 0, min=0, max=SEED_MAX, control_after_generate=True, tooltip=_SEED_TIP),
            Input.int("steps", 20, min=1, max=10000, tooltip="Steps of the whole schedule the range is cut from."),
            Input.float("cfg", 8.0, min=0.0, max=100.0, step=0.1, round=0.01, tooltip=_CFG_TIP),
            Input.combo("sampler_name", list(SAMPLER_NAMES), "euler", tooltip="ODE stepper; see KSamplerSelect."),
            Input.combo("scheduler", list(SCHEDULER_NAMES), "simple",
                        tooltip="How the noise levels are spaced over the steps."),
            Input.link("positive", "CONDITIONING", tooltip="Encoded prompt the result should follow."),
            Input.link("negative", "CONDITIONING", tooltip="Encoded prompt the result should move away from (used "
                                                           "only when cfg is not 1)."),
            Input.link("latent_image", "LATENT", tooltip="Latent to sample; its size and length set the output's."),
            Input.int("start_at_step", 0, min=0, max=10000, tooltip="First step of the schedule to run."),
            Input.int("end_at_step", 10000, min=0, max=10000,
                      tooltip="Step to stop at; at or past `steps` the schedule runs to its end."),
            Input.combo("return_with_leftover_noise", list(reversed(_ENABLE)), "disable",
                        tooltip="When stopping early: 'enable' returns the latent with the noise of the step it "
                                "stopped at, for a later sampler; 'disable' finishes on a clean estimate."),
        ],
        outputs=[Output("LATENT", tooltip="The sampled latent.")],
    ),
    NodeSpec(
        node_id="DisableNoise", display_name="DisableNoise", category="sampling/custom_sampling/noise",
        python_module="comfy_extras.nodes_custom_sampler", execute=_disable_noise,
        description="NOISE that adds nothing, for sampling a latent that already holds its noise (a second pass).",
        inputs=[], outputs=[Output("NOISE")],
    ),
    NodeSpec(
        node_id="CFGGuider", display_name="CFGGuider", category="sampling/custom_sampling/guiders",
        python_module="comfy_extras.nodes_custom_sampler", execute=_cfg_guider,
        description="A guider with a prompt to follow and one to avoid, mixed by cfg at every step.",
        inputs=[Input.link("model", "MODEL"), Input.link("positive", "CONDITIONING"),
                Input.link("negative", "CONDITIONING"),
                Input.float("cfg", 8.0, min=0.0, max=100.0, step=0.1, round=0.01, tooltip=_CFG_TIP)],
        outputs=[Output("GUIDER")],
    ),
    NodeSpec(
        node_id="ManualSigmas", display_name="ManualSigmas", category="_for_testing/custom_sampling",
        python_module="comfy_extras.nodes_custom_sampler", execute=_manual_sigmas,
        description="Noise levels written by hand: every number in the text, in order.",
        inputs=[Input.string("sigmas", "1, 0.5", tooltip="Noise levels from first to last, such as "
                                                          "'1.0, 0.7, 0.4, 0.0'; a schedule usually ends at 0.")],
        outputs=[Output("SIGMAS")],
        search_aliases=("custom noise schedule", "define sigmas"),
    ),
    NodeSpec(
        node_id="SplitSigmas", display_name="SplitSigmas", category="sampling/custom_sampling/sigmas",
        python_module="comfy_extras.nodes_custom_sampler", execute=_split_sigmas,
        description="Cuts a schedule at `step` into the noisier first part and the rest, for two samplers in turn; "
                    "the sigma at `step` ends the first and starts the second.",
        inputs=[Input.link("sigmas", "SIGMAS"), Input.int("step", 0, min=0, max=10000)],
        outputs=[Output("SIGMAS", "high_sigmas"), Output("SIGMAS", "low_sigmas")],
    ),
    NodeSpec(
        node_id="SetFirstSigma", display_name="SetFirstSigma", category="sampling/custom_sampling/sigmas",
        python_module="comfy_extras.nodes_custom_sampler", execute=_set_first_sigma,
        description="The schedule with its first noise level replaced.",
        inputs=[Input.link("sigmas", "SIGMAS"),
                Input.float("sigma", 136.0, min=0.0, max=20000.0, step=0.001, round=False)],
        outputs=[Output("SIGMAS")],
    ),
]
