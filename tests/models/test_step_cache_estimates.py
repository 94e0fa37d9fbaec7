"""models/step_cache.py on a stand-in model: separate picture and sound estimates, the window, reused changes."""
from __future__ import annotations

import torch

from models.step_cache import StepCacheKind, StepCacheRun, StepCacheSettings


def _run(kind: StepCacheKind, threshold: float, steps: int = 20) -> StepCacheRun:
    settings = StepCacheSettings(kind, threshold, 0.0, 1.0)
    sigmas = torch.linspace(1.0, 0.0, steps + 1)
    return StepCacheRun.start(settings, sigmas, lambda percent: 1.0 - percent)


def _drive(run: StepCacheRun, audio_gain: float, steps: int = 20) -> list[int]:
    """Steps the stand-in model computed: its picture output barely moves; its sound output moves
    `audio_gain` times as far as its input."""
    computed = []
    video = torch.ones(1, 4, 2, 16, 16)
    audio = torch.ones(1, 8, 2, 16)
    for step in range(steps):
        sigma = 1.0 - step / steps
        video_in, audio_in = video * (1.0 + 0.01 * step), audio * (1.0 + 0.01 * step)

        def model(step=step, video_in=video_in, audio_in=audio_in):
            computed.append(step)
            return video_in * 0.0 + 1.0 + 1e-4 * step, 1.0 + audio_gain * (audio_in - 1.0)
        out_video, out_audio = run.step(step, sigma, model, (video_in, audio_in))
        assert out_video.shape == video.shape and out_audio.shape == audio.shape
    return computed


def test_a_quiet_picture_is_not_skipped_while_the_sound_moves():
    quiet_sound = _drive(_run(StepCacheKind.LAZY, 0.2), audio_gain=0.0)
    loud_sound = _drive(_run(StepCacheKind.LAZY, 0.2), audio_gain=50.0)
    assert len(quiet_sound) < 10  # both streams settled: most steps reuse the last change
    assert len(loud_sound) > len(quiet_sound)
    assert quiet_sound[-1] == loud_sound[-1] == 19  # the last step is always computed


def test_the_first_window_steps_are_computed_and_a_skipped_step_reuses_the_last_change():
    run = _run(StepCacheKind.LAZY, 3.0, steps=6)
    inputs = [torch.full((1, 1, 1, 8, 8), float(step)) for step in range(6)]
    outputs = []
    for step, x in enumerate(inputs):
        outputs.append(run.step(step, 1.0 - step / 6, lambda x=x: (x * 2.0 + 1.0, x[..., :0]), (x, x[..., :0]))[0])
    # Steps 0 and 1 give the rate (output change 2 per input change 1; last output 3). Estimates summed since
    # step 1: step 2 moved 1 -> 2/3, step 3 moved 2 -> 2/3 + 4/3 = 2 (both under 3, reused); step 4 -> 4: computed.
    # Step 5 is the last one: computed.
    assert (run.computed_steps, run.skipped_steps, run.model_calls) == (4, 2, 4)
    for step in (2, 3):
        assert torch.equal(outputs[step], inputs[step] + (inputs[1] * 2.0 + 1.0 - inputs[1]))
    for step in (4, 5):
        assert torch.equal(outputs[step], inputs[step] * 2.0 + 1.0)
    assert "computed 4 of 6 steps, skipped 2" in run.summary()
