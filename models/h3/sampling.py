"""Flow-matching sampling for H3: schedules, the audio sigma derived from the video sigma, Euler and res_multistep.

Noise model: x_sigma = (1 - sigma) * x0 + sigma * noise. The transformer predicts the velocity toward
data, so the denoised estimate is x0 = x + sigma * v. The schedule `sigma = s*b / (1 + (s-1)*b)` over
`b = linspace(1, 0, N)` is drawn for video (shift 12); the audio sigma of each step is obtained by
undoing the video shift and applying the audio shift (3), so one schedule drives both streams.

Per-token noise masks (1 = generate, 0 = keep): a row with mask m is at sigma m * sigma (its timestep
label and its noise level), its velocity is multiplied by m, and kept rows (m = 0) are re-injected from
the clean latent after every step.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable

import torch

from models.h3 import context_windows, packing, pdd
from models.h3.layers import compute_device

if TYPE_CHECKING:
    from models.step_cache import StepCacheRun

SAMPLERS = ("euler", "res_multistep")


def shifted_sigma(b: torch.Tensor | float, shift: float) -> torch.Tensor | float:
    """sigma = s*b / (1 + (s-1)*b) for a base grid value b in [0, 1]."""
    return shift * b / (1.0 + (shift - 1.0) * b)


def unshifted_sigma(sigma: torch.Tensor | float, shift: float) -> torch.Tensor | float:
    """The base grid value b that `shifted_sigma(b, shift)` maps to `sigma`.

    Solving sigma * (1 + (s-1)*b) = s*b for b gives b = sigma / (s - (s-1)*sigma).
    """
    return sigma / (shift - (shift - 1.0) * sigma)


def convert_sigma(sigma: torch.Tensor | float, from_shift: float, to_shift: float) -> torch.Tensor | float:
    """Re-express a sigma of one shifted schedule in another: both schedules share the base grid, so the
    video step's sigma becomes the audio step's by mapping it back to the grid and forward again."""
    return shifted_sigma(unshifted_sigma(sigma, from_shift), to_shift)


# The schedules BasicScheduler / KSampler offer, in ComfyUI's order. ComfyUI reads every schedule off the
# model's sampling object; for H3 that is a discrete flow table of 1000 times t = 1/1000 .. 1 with
# sigma(t) = shifted_sigma(t, shift), and a "timestep" of sigma * 1000.
SCHEDULERS = ("simple", "sgm_uniform", "karras", "exponential", "ddim_uniform", "beta", "normal", "linear_quadratic",
              "kl_optimal")
KARRAS_RHO = 7.0
BETA_SHAPE = (0.6, 0.6)  # the beta schedule's (alpha, beta)
LINEAR_QUADRATIC_THRESHOLD = 0.025  # the noise level the linear part of `linear_quadratic` falls to
_FLOW_TIMESTEPS = 1000


def _normal_times(steps: int, shift: float, *, sgm: bool) -> tuple[torch.Tensor, bool]:
    """(the times the `normal` / `sgm_uniform` schedules take sigmas at, whether a final 0 follows).

    Both space times evenly from the table's largest sigma to its smallest. The smallest sigma, shifted(1/1000),
    is used as a time, not inverted to one, so the last sigma is shifted twice: ComfyUI's numbers, kept.
    """
    first = 1.0                                                            # sigma_max of the table, as a time
    last = float(shifted_sigma(torch.tensor(1.0 / _FLOW_TIMESTEPS, dtype=torch.float32), shift))
    if sgm:
        return torch.linspace(first, last, steps + 1, dtype=torch.float32)[:-1], True
    if math.isclose(float(shifted_sigma(last, shift)), 0.0, abs_tol=1e-5):   # the table reaches 0: it ends the list
        return torch.linspace(first, last, steps + 1, dtype=torch.float32), False
    return torch.linspace(first, last, steps, dtype=torch.float32), True


def flow_table(shift: float) -> torch.Tensor:
    """The model's float32 sigma table, ascending: shifted_sigma(k / 1000, shift) for k = 1 .. 1000."""
    # Timesteps k / 1000 * 1000, divided back by 1000, in float32: the table's values to the bit.
    timesteps = torch.arange(1, _FLOW_TIMESTEPS + 1, dtype=torch.float32) / _FLOW_TIMESTEPS * _FLOW_TIMESTEPS
    times = timesteps / _FLOW_TIMESTEPS
    return shifted_sigma(times, shift)


def _full_schedule(scheduler: str, steps: int, shift: float) -> torch.Tensor:
    """The float32 sigmas of `scheduler` for a whole run (denoise 1), ending at 0: `steps` + 1 of them, but for
    `ddim_uniform` (every (1000 // steps)-th entry of the table: more than asked where 1000 is not a multiple
    of the steps) and `beta` (steps landing on one table entry are taken once: fewer)."""
    table = flow_table(shift)
    low, high = float(table[0]), float(table[-1])
    if scheduler in _FROM_RANGE:
        return _FROM_RANGE[scheduler](steps, low, high)
    if scheduler == "ddim_uniform":
        # From the second entry up, every stride-th, the largest first, then 0; a table whose second entry is
        # already 0 (a shift near 0) ends on it and takes one step more instead.
        ends_at_zero = math.isclose(float(table[1]), 0.0, abs_tol=1e-5)
        picked = table[1::max(_FLOW_TIMESTEPS // (steps + ends_at_zero), 1)].flip(0)
        return picked if ends_at_zero else torch.cat([picked, torch.zeros(1)])
    if scheduler == "beta":
        entries = []
        for level in (1.0 - k * (1.0 / steps) for k in range(steps)):  # k times the spacing, as numpy's linspace
            entry = round(_beta_quantile(level, *BETA_SHAPE) * (_FLOW_TIMESTEPS - 1))  # halves to even
            if not entries or entries[-1] != entry:
                entries.append(entry)
        return torch.cat([table[entries], torch.zeros(1)])
    if scheduler == "linear_quadratic":
        return _linear_quadratic(steps) * table[-1]
    if scheduler == "simple":
        # Every step takes an entry of the table, stepping back len/steps entries at a time (rounded down) from
        # sigma 1, then 0: where 1000 is not a multiple of steps, the times are not exactly evenly spaced, and
        # the sigmas are ComfyUI's to the bit.
        stride = _FLOW_TIMESTEPS / steps
        picks = torch.tensor([_FLOW_TIMESTEPS - 1 - int(step * stride) for step in range(steps)])
        return torch.cat([table[picks], torch.zeros(1)])
    times, then_zero = _normal_times(steps, shift, sgm=scheduler == "sgm_uniform")
    values = shifted_sigma(times.double(), shift).float()
    return torch.cat([values, torch.zeros(1)]) if then_zero else values


def _karras(steps: int, low: float, high: float) -> torch.Tensor:
    """Evenly spaced in sigma ** (1 / rho) from the largest sigma to the smallest, then 0."""
    ramp = torch.linspace(0, 1, steps)
    top, bottom = high ** (1.0 / KARRAS_RHO), low ** (1.0 / KARRAS_RHO)
    return torch.cat([(top + ramp * (bottom - top)) ** KARRAS_RHO, torch.zeros(1)])


def _exponential(steps: int, low: float, high: float) -> torch.Tensor:
    """Evenly spaced in log sigma from the largest sigma to the smallest, then 0."""
    return torch.cat([torch.linspace(math.log(high), math.log(low), steps).exp(), torch.zeros(1)])


def _kl_optimal(steps: int, low: float, high: float) -> torch.Tensor:
    """Evenly spaced in arctan(sigma) from the largest sigma to the smallest, then 0. One step is the
    largest sigma then 0 (the spacing divides by steps - 1)."""
    if steps == 1:
        return torch.tensor([high, 0.0])
    along = torch.arange(steps, dtype=torch.float32) / (steps - 1)
    return torch.cat([(along * math.atan(low) + (1 - along) * math.atan(high)).tan(), torch.zeros(1)])


_FROM_RANGE = {"karras": _karras, "exponential": _exponential, "kl_optimal": _kl_optimal}


def _linear_quadratic(steps: int) -> torch.Tensor:
    """Noise levels (before scaling by the largest sigma) that fall linearly to LINEAR_QUADRATIC_THRESHOLD
    over the first half of the steps, then along a parabola to 0, in double precision as Python floats."""
    if steps == 1:
        return torch.tensor([1.0, 0.0])
    threshold = LINEAR_QUADRATIC_THRESHOLD
    linear = steps // 2
    rest = steps - linear
    gap = linear - threshold * steps  # how far the parabola must climb over the rest of the steps
    square = gap / (linear * rest ** 2)
    slope = threshold / linear - 2 * gap / rest ** 2
    offset = square * linear ** 2
    rising = [k * threshold / linear for k in range(linear)]
    rising += [square * k ** 2 + slope * k + offset for k in range(linear, steps)]
    return torch.tensor([1.0 - level for level in rising + [1.0]], dtype=torch.float32)


def _beta_quantile(level: float, a: float, b: float) -> float:
    """The x in [0, 1] where the regularized incomplete beta function I_x(a, b) reaches `level`, by bisection
    (60 halvings: double precision). At level 1/2 of a symmetric shape the answer is 1/2 exactly."""
    if level <= 0.0:
        return 0.0
    if level >= 1.0:
        return 1.0
    if a == b and level == 0.5:
        return 0.5
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if _incomplete_beta(mid, a, b) < level:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def _incomplete_beta(x: float, a: float, b: float) -> float:
    """The regularized incomplete beta function I_x(a, b), from its continued fraction (modified Lentz);
    beyond the fraction's fast region the symmetry I_x(a, b) = 1 - I_(1-x)(b, a) is used."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    if x > (a + 1.0) / (a + b + 2.0):
        return 1.0 - _incomplete_beta(1.0 - x, b, a)
    log_front = a * math.log(x) + b * math.log1p(-x) + math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    fraction = d
    for m in range(1, 300):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            fraction *= c * d
        if abs(c * d - 1.0) < 1e-16:
            break
    return math.exp(log_front) * fraction / a


def sigmas(steps: int, denoise: float = 1.0, shift: float = 12.0, scheduler: str = "simple", *,
           whole: bool = False) -> torch.Tensor:
    """steps + 1 sigmas ending at 0 (float32) of `scheduler` (one of SCHEDULERS); with denoise < 1, the last
    steps + 1 values of the schedule for int(steps / denoise) steps. With `whole` at denoise 1, every sigma of
    the schedule (KSampler's and KSamplerAdvanced's, where `ddim_uniform` and `beta` may differ in length;
    BasicScheduler always gives steps + 1 at most).

    `simple` takes evenly spaced entries of the model's 1000-entry sigma table (`flow_table`); `normal` spaces
    times evenly from 1 down to the table's smallest sigma and shifts them; `sgm_uniform` is `normal` over
    steps + 1 times less the last.
    """
    if scheduler not in SCHEDULERS:
        raise ValueError(f"scheduler {scheduler!r} is not available; the choices are {', '.join(SCHEDULERS)}")
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    if not 0.0 < denoise <= 1.0:
        if denoise == 0.0:
            return torch.zeros(0)
        raise ValueError(f"denoise must be in (0, 1], got {denoise}")
    total = steps if denoise >= 1.0 else int(steps / denoise)
    full = _full_schedule(scheduler, total, shift)
    return full if whole and denoise >= 1.0 else full[-(steps + 1):]


# Steppers -----------------------------------------------------------------------------------------
# Each works on one stream with an elementwise sigma tensor (masked rows carry m * sigma).

def euler_step(x: torch.Tensor, v: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor) -> torch.Tensor:
    """One Euler step of the flow ODE: x + (sigma - sigma_next) * v."""
    return x + (sigma - sigma_next) * v


def _half_log_snr(sigma: torch.Tensor) -> torch.Tensor:
    # lambda = log(alpha / sigma) with alpha = 1 - sigma; -inf at pure noise, +inf at clean.
    return torch.log1p(-sigma) - torch.log(sigma)


class ResMultistep:
    """Second-order multistep exponential integrator (data prediction) in the flow model's half-log-SNR.

    x_next = (sigma_next / sigma) * x + alpha_next * h * ((phi1 + phi2 / c) * D - (phi2 / c) * D_prev),
    with h = lambda_next - lambda, c = (lambda - lambda_prev) / h, phi1(z) = (e^z - 1)/z, phi2(z) = (phi1(z) - 1)/z at
    z = -h. The first step (no previous estimate), a step from pure noise history and the final step to 0 are
    first order (Euler), which is exact for the flow model's linear interpolation at those points.
    """

    def __init__(self):
        self.prev_denoised: torch.Tensor | None = None
        self.prev_lambda: torch.Tensor | None = None

    def step(self, x: torch.Tensor, v: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor) -> torch.Tensor:
        """Advance x from sigma to sigma_next (elementwise, broadcastable) given the velocity v at x."""
        xd, vd = x.double(), v.double()
        sigma = torch.as_tensor(sigma, dtype=torch.float64).expand_as(xd)
        sigma_next = torch.as_tensor(sigma_next, dtype=torch.float64).expand_as(xd)
        denoised = xd + sigma * vd
        out = xd + (sigma - sigma_next) * vd  # Euler
        # The second-order update applies where both ends are strictly inside (0, 1) and a finite history exists.
        inside = (sigma > 0) & (sigma < 1) & (sigma_next > 0) & (sigma_next < sigma)
        lam = _half_log_snr(torch.where(inside, sigma, torch.full_like(sigma, 0.5)))
        if self.prev_denoised is not None and bool(inside.any()):
            lam_next = _half_log_snr(torch.where(inside, sigma_next, torch.full_like(sigma, 0.25)))
            h = lam_next - lam
            lam_prev = self.prev_lambda
            ok = inside & torch.isfinite(lam_prev) & (lam > lam_prev)
            c = torch.where(ok, (lam - lam_prev) / h, torch.ones_like(h))
            phi1 = torch.expm1(-h) / (-h)
            phi2 = (phi1 - 1.0) / (-h)
            b2 = -phi2 / c
            b1 = phi1 - b2
            sn = torch.where(inside, sigma_next, torch.full_like(sigma, 0.25))
            s = torch.where(inside, sigma, torch.full_like(sigma, 0.5))
            second = (sn / s) * xd + (1.0 - sn) * h * (b1 * denoised + b2 * self.prev_denoised)
            out = torch.where(ok, second, out)
        self.prev_denoised = denoised
        # Pure noise (sigma = 1) has lambda = -inf: a history point there carries no slope information.
        self.prev_lambda = torch.where(inside, lam, torch.full_like(lam, -math.inf))
        return out.to(x.dtype)


# The sampling loop --------------------------------------------------------------------------------

def make_noise(latent: dict, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic noise for a LATENT value: video first, then audio, from one CPU generator seeded with `seed`."""
    gen = torch.Generator("cpu").manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)
    video = latent["samples"]
    audio = latent["audio_samples"]
    nv = torch.randn(video.shape, generator=gen, dtype=torch.float32)
    na = torch.randn(audio.shape, generator=gen, dtype=torch.float32)
    return nv, na


def split_conditioning(conditioning) -> tuple[torch.Tensor, dict]:
    """(hidden (B, L, D), extras) of a one-entry CONDITIONING list; ValueError for anything else."""
    if not isinstance(conditioning, (list, tuple)) or not conditioning:
        raise ValueError("conditioning must be a non-empty list of [hidden, extras] entries")
    if len(conditioning) > 1:
        raise ValueError(f"H3 sampling takes one conditioning entry; got {len(conditioning)} "
                         "(combine prompts before encoding instead)")
    entry = conditioning[0]
    hidden, extras = entry[0], (entry[1] if len(entry) > 1 else {}) or {}
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3:
        raise ValueError(f"conditioning hidden states must be (B, L, D), got {getattr(hidden, 'shape', type(hidden).__name__)}")
    return hidden, extras




def sample(model, latent: dict, conditioning, sigmas: torch.Tensor, noise_seed: int, sampler: str = "euler",
           callback: Callable[[int, int, dict], None] | None = None, *, video_shift: float | None = None,
           audio_shift: float | None = None, add_noise: bool = True, step_cache: "StepCacheRun | None" = None) -> dict:
    """Denoise an H3 LATENT value along `sigmas` (the video schedule) and return the new LATENT value.

    model: an H3Transformer (or anything with its forward signature and `config`). conditioning: a
    CONDITIONING list with one [hidden (B, L, D), extras] entry; extras may hold "attention_mask" (B, L),
    "token_tags" (B, L), "keyframes" and "references" (models/h3/packing.py). `callback(step, total, denoised)` is called
    after each step with the current x0 estimate {"samples", "audio_samples"}; raise from it to interrupt.
    Deterministic for a given seed. video_shift / audio_shift default to the model config's (12 / 3).
    step_cache: the EasyCache / LazyCache state of this run (models/step_cache.py), which may reuse a step's
    model output instead of computing it; it counts what it computed and skipped.
    """
    from models import memory
    from models.patcher import PLACED_DEVICE

    # A MODEL placed on its own device (SelectModelDevice) samples there: the inputs are made on it too.
    handle = getattr(model, "handle", model)  # a guided model wraps the MODEL handle
    with memory.placed_on(getattr(handle, "options", {}).get(PLACED_DEVICE)):
        return _sample(model, latent, conditioning, sigmas, noise_seed, sampler, callback, video_shift=video_shift,
                       audio_shift=audio_shift, add_noise=add_noise, step_cache=step_cache)


def _sample(model, latent: dict, conditioning, sigmas: torch.Tensor, noise_seed: int, sampler: str,
            callback: Callable[[int, int, dict], None] | None, *, video_shift: float | None,
            audio_shift: float | None, add_noise: bool, step_cache: "StepCacheRun | None") -> dict:
    if sampler not in SAMPLERS:
        raise ValueError(f"unknown sampler {sampler!r}; H3 supports {', '.join(SAMPLERS)}")
    if "samples" not in latent or "audio_samples" not in latent:
        raise ValueError("H3 sampling needs a LATENT with both 'samples' (video) and 'audio_samples' (audio)")
    module = getattr(model, "model", model)  # a patcher ModelHandle runs its .model with its adapters
    cfg = getattr(model, "config", None) or getattr(module, "config", None)
    video_shift = float(video_shift if video_shift is not None else getattr(cfg, "shift_video", 12.0))
    audio_shift = float(audio_shift if audio_shift is not None else getattr(cfg, "shift_audio", 3.0))
    sig_v = torch.as_tensor(sigmas, dtype=torch.float64).flatten()
    clean_v = latent["samples"].float()
    clean_a = latent["audio_samples"].float()
    out = dict(latent)
    if sig_v.numel() < 2:
        return out
    sig_a = convert_sigma(sig_v, video_shift, audio_shift)

    windows = context_windows.settings_of(model)
    # Several conditioning entries are taken only by context windows that split them over the clip.
    several = (windows is not None and windows.split_conds_to_windows and isinstance(conditioning, (list, tuple))
               and len(conditioning) > 1)
    entries = [[entry] for entry in conditioning] if several else [conditioning]
    b, _, lt, lh, lw = clean_v.shape
    at = clean_a.shape[-1]
    frames = int(latent.get("length") or 0) or packing.pixel_frames(lt)
    prepared = []
    for entry in entries:
        hidden, extras = split_conditioning(entry)
        items = [packing.condition_items(extras, i, target_frames=frames, latent_h=lh + lh % 2, latent_w=lw + lw % 2,
                                         audio_t=at) for i in range(b)]
        prepared.append(context_windows.Conditioning(hidden, extras.get("attention_mask"),
                                                     extras.get(packing.TOKEN_TAGS_KEY), items))
    hidden, context_mask, context_tags, items = (prepared[0].hidden, prepared[0].context_mask,
                                                 prepared[0].context_tags, prepared[0].items)
    windowed = None if windows is None else context_windows.WindowedModel(model, windows, prepared)
    if windowed is not None and step_cache is not None:
        # A step cache estimates one model output per step; windows make several partial ones per step.
        raise ValueError("EasyCache / LazyCache and context windows (ContextWindowsManual) on one model are not "
                         "supported together; remove one of the two patches")

    # Noise masks at row resolution (patch grid / audio frame), then back at latent resolution.
    vm_rows = am_rows = None
    vm = am = None
    if latent.get("noise_mask") is not None:
        vm_rows = packing.reduce_video_mask(latent["noise_mask"], b, lt, lh, lw)
        vm = packing.expand_video_mask(vm_rows, lh, lw).double()
    if latent.get("audio_noise_mask") is not None:
        am_rows = packing.reduce_audio_mask(latent["audio_noise_mask"], b, at)
        am = packing.expand_audio_mask(am_rows).double()

    def stream_sigma(s: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return s if mask is None else s * mask

    device = compute_device(module) if isinstance(module, torch.nn.Module) else torch.device("cpu")
    x_v, x_a = clean_v.clone(), clean_a.clone()
    if add_noise:
        noise_v, noise_a = make_noise(latent, noise_seed)
        if windows is not None and windows.freenoise:
            noise_v, noise_a = context_windows.freenoise(noise_v, noise_a, windows, noise_seed)
        s0v, s0a = stream_sigma(sig_v[0], vm), stream_sigma(sig_a[0], am)
        x_v = ((1.0 - s0v) * clean_v + s0v * noise_v).float()
        x_a = ((1.0 - s0a) * clean_a + s0a * noise_a).float()

    steppers = (ResMultistep(), ResMultistep()) if sampler == "res_multistep" else None
    total = sig_v.numel() - 1
    for i in range(total):
        sv, sa = float(sig_v[i]), float(sig_a[i])
        x_v_in, x_a_in = x_v.to(device), x_a.to(device)

        def velocities(x_v_in=x_v_in, x_a_in=x_a_in) -> tuple[torch.Tensor, torch.Tensor]:
            if windowed is not None:
                return windowed(i, x_v, x_a, sv, sa, video_mask=vm_rows, audio_mask=am_rows,
                                condition_seed=noise_seed, device=device)
            return model(x_v_in, x_a_in, hidden.to(device), sv, sa,
                         context_mask=context_mask.to(device) if context_mask is not None else None,
                         conditions=items, video_mask=vm_rows, audio_mask=am_rows, condition_seed=noise_seed,
                         **({} if context_tags is None else {"context_tags": context_tags}))

        step = pdd.SamplerStep(sv, float(sig_v[i + 1]), video_shift, audio_shift)
        with torch.no_grad(), pdd.sampler_step(step):
            if step_cache is None:
                v_v, v_a = velocities()
            else:
                v_v, v_a = step_cache.step(i, sv, velocities, (x_v_in, x_a_in))
        v_v, v_a = v_v.float().cpu(), v_a.float().cpu()
        # Row sigmas: m * sigma where a noise mask is set. Stepping a row from m*sigma to m*sigma_next with its
        # own velocity is the same as stepping the global sigma with the velocity multiplied by m.
        rv, rv_next = stream_sigma(sig_v[i], vm), stream_sigma(sig_v[i + 1], vm)
        ra, ra_next = stream_sigma(sig_a[i], am), stream_sigma(sig_a[i + 1], am)
        denoised_v = (x_v + rv * v_v).float()
        denoised_a = (x_a + ra * v_a).float()
        if steppers is None:
            x_v = euler_step(x_v, v_v, rv, rv_next).float()
            x_a = euler_step(x_a, v_a, ra, ra_next).float()
        else:
            x_v = steppers[0].step(x_v, v_v, torch.as_tensor(rv), torch.as_tensor(rv_next))
            x_a = steppers[1].step(x_a, v_a, torch.as_tensor(ra), torch.as_tensor(ra_next))
        # Kept rows come back exactly from the clean latent.
        if vm is not None:
            x_v = torch.where(vm > 0, x_v, clean_v)
            denoised_v = torch.where(vm > 0, denoised_v, clean_v)
        if am is not None:
            x_a = torch.where(am > 0, x_a, clean_a)
            denoised_a = torch.where(am > 0, denoised_a, clean_a)
        if callback is not None:
            callback(i + 1, total, {"samples": denoised_v, "audio_samples": denoised_a})

    out["samples"] = x_v.to(latent["samples"].dtype)
    out["audio_samples"] = x_a.to(latent["audio_samples"].dtype)
    return out
