"""Flow-matching schedule, derived audio sigma, Euler and res_multistep, and the sample loop's determinism."""

import pytest
import torch

from models.h3.sampling import (ResMultistep, convert_sigma, euler_step, flow_table, sample, shifted_sigma, sigmas,
                                unshifted_sigma)
from models.h3 import empty_latent


def test_four_step_schedule_at_shift_12():
    got = sigmas(4, shift=12.0)
    assert got.tolist() == pytest.approx([1.0, 0.97297, 0.92308, 0.8, 0.0], abs=1e-4)
    # Against the formula sigma = s*b / (1 + (s-1)*b) on b = linspace(1, 0, 5).
    for b, s in zip(torch.linspace(1, 0, 5).tolist(), got.tolist()):
        assert s == pytest.approx(12 * b / (1 + 11 * b), abs=1e-6)


def test_denoise_takes_the_tail_of_a_longer_schedule():
    full = sigmas(8, shift=3.0)
    part = sigmas(4, denoise=0.5, shift=3.0)
    assert part.tolist() == pytest.approx(full[-5:].tolist())


def test_normal_schedule_spaces_times_from_one_to_the_flow_tables_smallest_sigma():
    # The table's smallest sigma, shifted(1/1000), serves as the last time, so it is shifted a second time.
    smallest = 12 * 0.001 / (1 + 11 * 0.001)
    got = sigmas(4, shift=12.0, scheduler="normal")
    assert got.dtype == torch.float32 and got.numel() == 5 and got[-1] == 0.0
    times = unshifted_sigma(got[:-1].double(), 12.0)
    assert times.tolist() == pytest.approx(torch.linspace(1.0, smallest, 4, dtype=torch.float64).tolist(), abs=1e-6)
    assert got[3].item() == pytest.approx(12 * smallest / (1 + 11 * smallest), abs=1e-6)   # about 0.126, not ~0
    assert sigmas(1, shift=12.0, scheduler="normal").tolist() == [1.0, 0.0]


def test_sgm_uniform_is_normal_over_one_more_time_without_the_last():
    smallest = 3 * 0.001 / (1 + 2 * 0.001)
    got = sigmas(4, shift=3.0, scheduler="sgm_uniform")
    assert got.numel() == 5 and got[-1] == 0.0
    times = unshifted_sigma(got[:-1].double(), 3.0)
    assert times.tolist() == pytest.approx(torch.linspace(1.0, smallest, 5, dtype=torch.float64)[:-1].tolist(),
                                           abs=1e-6)


@pytest.mark.parametrize("scheduler", ["normal", "sgm_uniform"])
def test_denoise_takes_the_tail_of_every_schedule(scheduler):
    full = sigmas(10, shift=12.0, scheduler=scheduler)
    assert sigmas(4, denoise=0.4, shift=12.0, scheduler=scheduler).tolist() == full[-5:].tolist()


def test_an_unknown_schedule_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="'turbo' is not available; the choices are simple, sgm_uniform, karras, "
                                         "exponential, ddim_uniform, beta, normal, linear_quadratic, kl_optimal"):
        sigmas(4, scheduler="turbo")


def test_audio_sigma_derived_from_video_sigma():
    b = torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0], dtype=torch.float64)
    video = shifted_sigma(b, 12.0)
    audio = convert_sigma(video, 12.0, 3.0)
    assert audio.tolist() == pytest.approx(shifted_sigma(b, 3.0).tolist())


def test_one_euler_step_by_hand():
    x = torch.tensor([0.5, -1.0])
    v = torch.tensor([2.0, 0.25])
    # x0 = x + sigma v; Euler from 0.8 to 0.6 moves by (0.8 - 0.6) * v.
    out = euler_step(x, v, 0.8, 0.6)
    assert out.tolist() == pytest.approx([0.5 + 0.2 * 2.0, -1.0 + 0.2 * 0.25])


def _gaussian_velocity(mu, s):
    # Data N(mu, s^2), x = (1 - sigma) x0 + sigma eps: the exact velocity toward data, (E[x0 | x] - x) / sigma.
    def velocity(x, sigma):
        a = 1.0 - sigma
        denoised = mu + a * s * s / (a * a * s * s + sigma * sigma) * (x - a * mu)
        return (denoised - x) / sigma
    return velocity


def _integrate(stepper, sched, x, velocity):
    for i in range(len(sched) - 1):
        x = stepper(x, velocity(x, sched[i]), sched[i], sched[i + 1])
    return x


def test_res_multistep_is_a_more_accurate_flow_solver_than_euler():
    mu, s = 2.0, 0.5
    velocity = _gaussian_velocity(mu, s)
    noise = torch.linspace(-2, 2, 9, dtype=torch.float64)
    exact = mu + s * noise  # the flow ODE maps a Gaussian onto a Gaussian linearly
    sched = sigmas(20, shift=3.0).double()
    x_start = noise  # sigma = 1: pure noise
    euler_err = (_integrate(lambda x, v, a, b: euler_step(x, v, a, b), sched, x_start, velocity) - exact).abs().max()
    res = ResMultistep()
    res_err = (_integrate(lambda x, v, a, b: res.step(x, v, a, b), sched, x_start, velocity) - exact).abs().max()
    # The last step to sigma = 0 is first order for every solver; the multistep update removes the rest.
    assert res_err < 0.25 * euler_err
    assert res_err < 3e-2


def test_res_multistep_first_and_last_steps_are_euler():
    x, v = torch.randn(3), torch.randn(3)
    res = ResMultistep()
    torch.testing.assert_close(res.step(x, v, torch.tensor(1.0), torch.tensor(0.9)), euler_step(x, v, 1.0, 0.9))
    x2, v2 = torch.randn(3), torch.randn(3)
    torch.testing.assert_close(res.step(x2, v2, torch.tensor(0.9), torch.tensor(0.0)), x2 + 0.9 * v2)


class _LinearModel(torch.nn.Module):
    """A stand-in transformer: v = -x (so x0 = (1 - sigma) x), recording the sigmas it was called with."""

    def __init__(self):
        super().__init__()
        self.calls = []
        self.weight = torch.nn.Parameter(torch.zeros(1))

    def forward(self, video, audio, context, sigma_video, sigma_audio, **kwargs):
        self.calls.append((sigma_video, sigma_audio, kwargs))
        return -video, -audio


def test_sample_is_deterministic_and_drives_audio_on_its_own_schedule():
    model = _LinearModel()
    lat = empty_latent(32, 32, 5)
    cond = [[torch.zeros(1, 3, 8), {}]]
    steps = []
    a = sample(model, lat, cond, sigmas(3), 7, callback=lambda i, n, d: steps.append((i, n)))
    b = sample(model, lat, cond, sigmas(3), 7)
    c = sample(model, lat, cond, sigmas(3), 8)
    assert a["samples"].numpy().tobytes() == b["samples"].numpy().tobytes()
    assert a["audio_samples"].numpy().tobytes() == b["audio_samples"].numpy().tobytes()
    assert not torch.equal(a["samples"], c["samples"])
    assert steps == [(1, 3), (2, 3), (3, 3)]
    sv, sa, _ = model.calls[1]
    assert sa == pytest.approx(convert_sigma(sv, 12.0, 3.0))
    assert a["frame_rate"] == 24.0 and a["length"] == 5


def test_sample_refuses_unknown_sampler_and_several_conditionings():
    lat = empty_latent(32, 32, 5)
    cond = [[torch.zeros(1, 3, 8), {}]]
    with pytest.raises(ValueError, match="unknown sampler"):
        sample(_LinearModel(), lat, cond, sigmas(2), 0, sampler="dpmpp_9m")
    with pytest.raises(ValueError, match="one conditioning entry"):
        sample(_LinearModel(), lat, cond * 2, sigmas(2), 0)


@pytest.mark.parametrize("steps", [4, 7, 30])
def test_simple_takes_entries_of_the_flow_table_stepping_back_len_over_steps(steps):
    # 1000 / 30 is not a whole number: step 3 takes the entry 99 back (int(3 * 33.33...)), not 100 back, so the
    # sigmas are the table's, not those of an exactly even grid.
    table = flow_table(12.0)
    got = sigmas(steps, shift=12.0)
    expected = [table[-(1 + int(x * (1000 / steps)))].item() for x in range(steps)] + [0.0]
    assert got.dtype == torch.float32 and got.tolist() == expected
    # The table: float32 shifted_sigma of k / 1000, sigma 1 at its end.
    assert table[-1].item() == 1.0 and table[0].item() == pytest.approx(12 * 0.001 / (1 + 11 * 0.001), rel=1e-6)


@pytest.mark.parametrize("steps", [1, 4, 30])
@pytest.mark.parametrize("scheduler", ["karras", "exponential"])
def test_karras_and_exponential_span_the_flow_tables_range_as_diffusers_spaces_them(scheduler, steps):
    """diffusers' own spacing (rho 7 for karras) between the table's largest and smallest sigma is the oracle."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    table = flow_table(12.0)
    oracle = FlowMatchEulerDiscreteScheduler()
    convert = oracle._convert_to_karras if scheduler == "karras" else oracle._convert_to_exponential
    expected = torch.tensor(convert(table.flip(0), steps), dtype=torch.float64)
    got = sigmas(steps, shift=12.0, scheduler=scheduler)
    assert got.dtype == torch.float32 and got.numel() == steps + 1 and got[-1] == 0.0
    torch.testing.assert_close(got[:-1].double(), expected, rtol=2e-6, atol=0)


@pytest.mark.parametrize("steps", list(range(1, 41)) + [50, 77, 100])
def test_beta_takes_table_entries_at_beta_quantiles_once_each(steps):
    """scipy's beta quantile is the oracle: steps at 1 - k/steps of the Beta(0.6, 0.6) distribution, rounded to
    the nearest of the table's 999 intervals (halves to even), a repeated entry taken once, then 0."""
    import numpy as np
    from scipy.stats import beta

    table = flow_table(3.0)
    levels = 1.0 - np.linspace(0.0, 1.0, steps, endpoint=False)
    entries = [int(e) for e in np.rint(beta.ppf(levels, 0.6, 0.6) * 999)]
    kept = [e for i, e in enumerate(entries) if i == 0 or e != entries[i - 1]]
    assert sigmas(steps, shift=3.0, scheduler="beta").tolist() == [table[e].item() for e in kept] + [0.0]


def test_ddim_uniform_takes_every_stride_th_entry_from_the_second_and_ksampler_keeps_them_all():
    table = flow_table(12.0)
    four = [table[k].item() for k in (751, 501, 251, 1)] + [0.0]
    assert sigmas(4, shift=12.0, scheduler="ddim_uniform").tolist() == four
    # 1000 // 7 = 142 leaves a remainder: entries 1, 143, ..., 995 are eight steps. BasicScheduler gives the
    # last 7 + 1 sigmas; KSampler (whole) runs all of them.
    whole = sigmas(7, shift=12.0, scheduler="ddim_uniform", whole=True)
    assert whole.tolist() == [table[1 + 142 * k].item() for k in range(7, -1, -1)] + [0.0]
    assert sigmas(7, shift=12.0, scheduler="ddim_uniform").tolist() == whole[-8:].tolist()
    assert sigmas(7, denoise=0.5, shift=12.0, scheduler="ddim_uniform", whole=True).numel() == 8  # denoise < 1: sliced


def test_linear_quadratic_falls_linearly_to_the_threshold_then_along_a_parabola():
    # Four steps: a linear half 0 -> 0.0125 (threshold 0.025 over 2 steps), then 0.025 and 0.275 on the parabola.
    expected = [1.0, 0.9875, 0.975, 0.725, 0.0]
    assert sigmas(4, shift=12.0, scheduler="linear_quadratic").tolist() == pytest.approx(expected, abs=1e-7)
    assert sigmas(1, shift=12.0, scheduler="linear_quadratic").tolist() == [1.0, 0.0]


def test_kl_optimal_spaces_the_arctangent_of_sigma_evenly():
    import math

    table = flow_table(12.0)
    low, high = table[0].item(), table[-1].item()
    middle = math.tan(0.5 * math.atan(low) + 0.5 * math.atan(high))
    assert sigmas(3, shift=12.0, scheduler="kl_optimal").tolist() == pytest.approx([high, middle, low, 0.0], rel=1e-6)
    assert sigmas(1, shift=12.0, scheduler="kl_optimal").tolist() == [1.0, 0.0]  # no spacing to divide by 0


@pytest.mark.parametrize("scheduler", ["simple", "sgm_uniform", "karras", "exponential", "ddim_uniform", "beta",
                                       "normal", "linear_quadratic", "kl_optimal"])
@pytest.mark.parametrize("steps", [1, 2, 9, 30])
def test_every_schedule_is_finite_and_falls_strictly_to_zero(scheduler, steps):
    got = sigmas(steps, shift=12.0, scheduler=scheduler, whole=True)
    assert got.dtype == torch.float32 and got[-1] == 0.0 and bool(torch.isfinite(got).all())
    assert bool((got[:-1] > got[1:]).all()), got
