"""Context windows over the joint H3 latent: the window plans, the sound aligned to the picture, guides and masks
per window, equality with plain sampling when one window holds the clip, and memory bounded by the window."""
from __future__ import annotations

import pytest
import torch

from models.h3 import context_windows as cw
from models.h3 import empty_latent, packing
from models.h3.context_windows import ContextSchedule, ContextWindowSettings, FuseMethod
from models.h3.sampling import sample, sigmas
from models.h3.transformer import TINY_CONFIG, H3Transformer, JointLayer
from models.patcher import ModelHandle

FRAMES = 17 * 3 + 5   # 56 video frames: 17 latent frames, 93 audio latent frames
STEPS = 2


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return H3Transformer(TINY_CONFIG).eval()


def _conditioning(guide_frame: int | None = None, latent: dict | None = None) -> list:
    hidden = torch.randn(1, 4, TINY_CONFIG.text_dim, generator=torch.Generator().manual_seed(3))
    extras: dict = {}
    if guide_frame is not None:
        video = latent["samples"]
        guide = torch.randn(1, 24, 1, video.shape[3], video.shape[4], generator=torch.Generator().manual_seed(4))
        extras["keyframes"] = [{"frame_index": guide_frame, "latent": guide, "audio_latent": None}]
    return [[hidden, extras]]


def _windowed(handle: ModelHandle, **settings) -> ModelHandle:
    return handle.with_options(**{cw.CONTEXT_WINDOWS: ContextWindowSettings(**settings)})


# Plans ---------------------------------------------------------------------------------------------

def test_static_windows_overlap_and_the_last_one_ends_on_the_last_frame():
    settings = ContextWindowSettings(context_length=5, context_overlap=2)
    assert cw.plan_windows(settings, 12) == [[0, 1, 2, 3, 4], [3, 4, 5, 6, 7], [6, 7, 8, 9, 10], [7, 8, 9, 10, 11]]
    assert cw.plan_windows(settings, 5) == [[0, 1, 2, 3, 4]]
    batched = ContextWindowSettings(context_length=5, context_overlap=2, schedule=ContextSchedule.BATCHED)
    assert cw.plan_windows(batched, 12) == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11]]


def test_bit_reversed_fraction_spreads_successive_steps():
    assert [cw.bit_reversed_fraction(step) for step in range(5)] == [0.0, 0.5, 0.25, 0.75, 0.125]


@pytest.mark.parametrize("schedule", list(ContextSchedule))
@pytest.mark.parametrize("stride", [1, 2])
def test_every_schedule_covers_every_frame_at_every_step(schedule, stride):
    settings = ContextWindowSettings(context_length=6, context_overlap=2, schedule=schedule, stride=stride)
    for frames in (7, 17, 22):
        for step in range(6):
            windows = cw.plan_windows(settings, frames, step)
            assert set().union(*map(set, windows)) == set(range(frames))
            assert all(0 <= k < frames for window in windows for k in window)
            if schedule is ContextSchedule.UNIFORM_STANDARD and stride == 1:  # never wraps past the end
                assert all(w == list(range(w[0], w[0] + len(w))) for w in windows), windows


def test_uniform_windows_move_between_steps_but_static_ones_do_not():
    uniform = ContextWindowSettings(context_length=6, context_overlap=2, schedule=ContextSchedule.UNIFORM_STANDARD)
    static = ContextWindowSettings(context_length=6, context_overlap=2)
    assert cw.plan_windows(uniform, 22, 0) != cw.plan_windows(uniform, 22, 1)
    assert cw.plan_windows(static, 22, 0) == cw.plan_windows(static, 22, 1)


def test_settings_refuse_an_overlap_that_would_not_move_the_windows():
    with pytest.raises(ValueError, match="context_overlap"):
        ContextWindowSettings(context_length=4, context_overlap=4)


def test_fuse_weights():
    assert cw.fuse_weights(FuseMethod.PYRAMID, [0, 1, 2, 3, 4], 10, 2).tolist() == [1, 2, 3, 2, 1]
    assert cw.fuse_weights(FuseMethod.PYRAMID, [0, 1, 2, 3], 10, 2).tolist() == [1, 2, 2, 1]
    assert cw.fuse_weights(FuseMethod.FLAT, [3, 4, 5], 10, 2).tolist() == [1, 1, 1]
    linear = cw.fuse_weights(FuseMethod.OVERLAP_LINEAR, [0, 1, 2, 3, 4, 5], 10, 3)
    assert linear[:5].tolist() == [1, 1, 1, 1, 0.5] and 0 < linear[-1] < 1e-30  # the first window ramps down only
    middle = cw.fuse_weights(FuseMethod.OVERLAP_LINEAR, [2, 3, 4, 5, 6], 10, 2)
    assert middle[0] < 1e-30 and middle[-1] < 1e-30 and middle[2] == 1
    relative = cw.fuse_weights(FuseMethod.RELATIVE, [2, 3, 4, 5, 6], 10, 2)
    assert relative.argmax() == 2 and relative.min() > 0


# Sound aligned to picture ----------------------------------------------------------------------------

def test_audio_of_a_window_spans_the_time_of_its_video_frames_and_windows_cover_all_audio():
    latent = empty_latent(32, 32, FRAMES)
    latent_t, audio_t = latent["samples"].shape[2], latent["audio_samples"].shape[-1]
    settings = ContextWindowSettings(context_length=6, context_overlap=2, causal_window_fix=False)
    heard = set()
    for window in cw.plan(settings, latent_t, audio_t):
        start = packing.frame_clock_span(window.video[0])[0]
        stop = packing.frame_clock_span(window.video[-1])[1]
        inner = [j for j in window.audio if 0 < j < audio_t - 1]
        assert all(start - 1 < j < stop for j in inner)           # audio frame j covers clock [j, j + 1)
        assert window.audio == list(range(window.audio[0], window.audio[-1] + 1))
        heard.update(window.audio)
    assert heard == set(range(audio_t))


def test_a_window_keeps_the_clip_times_of_its_rows(model):
    latent = empty_latent(32, 32, FRAMES)
    latent_t, audio_t = latent["samples"].shape[2], latent["audio_samples"].shape[-1]
    whole = packing.build_layout(4, latent_t, 2, 2, audio_t)
    window = cw.plan(ContextWindowSettings(context_length=6, context_overlap=2), latent_t, audio_t)[2]
    part = packing.build_layout(4, len(window.model_video), 2, 2, len(window.audio), window=window.target)
    for role, frames, per_frame in ((packing.SegmentRole.VIDEO, window.model_video, 1),
                                    (packing.SegmentRole.AUDIO, window.audio, 1)):
        full_seg, seg = whole.segment(role), part.segment(role)
        full_times = whole.positions[full_seg.start:full_seg.stop, 0]
        times = part.positions[seg.start:seg.stop, 0]
        if role is packing.SegmentRole.VIDEO:
            rows = full_times.numel() // latent_t                   # patches per frame
            expected = full_times.view(latent_t, rows)[frames].flatten()
        else:
            expected = full_times.view(2, audio_t)[:, frames].flatten()
        assert torch.equal(times, expected)


# Sampling --------------------------------------------------------------------------------------------

def test_one_window_holding_the_whole_clip_samples_exactly_as_without_windows(model):
    latent = empty_latent(32, 32, FRAMES)
    latent_t = latent["samples"].shape[2]
    mask = torch.ones(1, 1, latent_t, 2, 2)
    mask[:, :, :3] = 0.0                                          # keep the opening frames (a continuation)
    latent = {**latent, "samples": torch.randn(latent["samples"].shape), "noise_mask": mask}
    conditioning = _conditioning(guide_frame=40, latent=latent)
    handle = ModelHandle(model)
    plain = sample(handle, latent, conditioning, sigmas(STEPS), 7)
    for schedule in ContextSchedule:
        windowed = sample(_windowed(handle, context_length=latent_t, context_overlap=3, schedule=schedule),
                          latent, conditioning, sigmas(STEPS), 7)
        assert torch.equal(windowed["samples"], plain["samples"])
        assert torch.equal(windowed["audio_samples"], plain["audio_samples"])


class _Spy:
    """Wraps a model; records what each call sees."""

    def __init__(self, model):
        self.model, self.calls = model, []

    def __call__(self, video, audio, *args, **kwargs):
        self.calls.append({"video": video.shape[2], "audio": audio.shape[-1], "window": kwargs.get("target_window"),
                           "text": args[0].shape[1],
                           "guides": [item.frame_index for item in kwargs["conditions"][0]],
                           "video_mask": kwargs.get("video_mask")})
        return self.model(video, audio, *args, **kwargs)


def test_windows_run_the_model_on_short_clips_and_keep_only_the_guides_they_cover(model):
    latent = empty_latent(32, 32, FRAMES)
    latent_t = latent["samples"].shape[2]
    conditioning = _conditioning(guide_frame=50, latent=latent)
    settings = ContextWindowSettings(context_length=6, context_overlap=2)
    spy = _Spy(ModelHandle(model))
    windowed = cw.WindowedModel(spy, settings, [_entry(conditioning, latent)])
    vm = torch.ones(1, latent_t, 1, 1)
    vm[:, 0] = 0.25
    velocity, _ = windowed(0, latent["samples"], latent["audio_samples"], 1.0, 1.0, video_mask=vm, audio_mask=None,
                           condition_seed=0, device=torch.device("cpu"))
    assert velocity.shape == latent["samples"].shape and torch.isfinite(velocity).all()
    windows = cw.plan(settings, latent_t, latent["audio_samples"].shape[-1])
    assert len(spy.calls) == len(windows) > 1
    guide_latent = 14                      # latent 14 = the 5th of the 3rd clip: pixel frames 47-50
    for call, window in zip(spy.calls, windows):
        assert call["video"] == len(window.model_video) <= settings.context_length + 1  # + the causal anchor
        assert call["window"].video == tuple(window.model_video)
        assert call["guides"] == ([50] if _shares_time(window.model_video, 50) else [])
        assert torch.equal(call["video_mask"], vm[:, window.model_video])
    assert any(call["guides"] for call in spy.calls) and not all(call["guides"] for call in spy.calls)
    retained = cw.WindowedModel(_Spy(ModelHandle(model)), ContextWindowSettings(
        context_length=6, context_overlap=2, cond_retain=(guide_latent,)), [_entry(conditioning, latent)])
    retained(0, latent["samples"], latent["audio_samples"], 1.0, 1.0, video_mask=None, audio_mask=None,
             condition_seed=0, device=torch.device("cpu"))
    assert all(call["guides"] == [50] for call in retained.model.calls)


def _shares_time(frames, pixel_frame):
    start = packing.FRAME_UNITS * pixel_frame
    return any(a < start + packing.FRAME_UNITS and start < b for a, b in map(packing.frame_clock_span, frames))


def _entry(conditioning, latent):
    hidden, extras = conditioning[0]
    video = latent["samples"]
    items = [packing.condition_items(extras, 0, target_frames=FRAMES, latent_h=video.shape[3],
                                     latent_w=video.shape[4], audio_t=latent["audio_samples"].shape[-1])]
    return cw.Conditioning(hidden, None, None, items)


def _largest_activation(model, run) -> int:
    """Bytes of the largest tensor a transformer block puts out while `run()` samples."""
    largest = [0]

    def record(_module, _inputs, output):
        largest[0] = max(largest[0], output.numel() * output.element_size())

    hooks = [block.register_forward_hook(record) for block in model.modules() if isinstance(block, JointLayer)]
    try:
        run()
    finally:
        for hook in hooks:
            hook.remove()
    return largest[0]


def test_peak_activation_is_bounded_by_the_window_and_grows_with_it_not_with_the_clip(model):
    handle = ModelHandle(model)
    conditioning = _conditioning()

    def peak(frames: int, **settings) -> int:
        latent = empty_latent(32, 32, frames)
        target = _windowed(handle, **settings) if settings else handle
        return _largest_activation(model, lambda: sample(target, latent, conditioning, sigmas(1), 1))

    short_clip = peak(22)                                  # 7 latent frames: what one window of 6 + its anchor holds
    long_clip = peak(FRAMES)                               # 17 latent frames in one pass
    longer_clip = peak(FRAMES + 34)                        # 27 latent frames in one pass
    assert short_clip < long_clip < longer_clip
    window_6 = peak(FRAMES, context_length=6, context_overlap=2)
    window_6_longer = peak(FRAMES + 34, context_length=6, context_overlap=2)
    window_10 = peak(FRAMES, context_length=10, context_overlap=2)
    assert window_6 == window_6_longer                     # the clip grew, the peak did not
    assert window_6 <= short_clip < window_10 < long_clip  # bounded by the window, growing with it


def test_freenoise_repeats_shuffled_noise_of_the_previous_window():
    video = torch.randn(1, 2, 10, 1, 1)
    audio = torch.randn(1, 2, 2, 20)
    settings = ContextWindowSettings(context_length=4, context_overlap=2, freenoise=True)
    shuffled_v, shuffled_a = cw.freenoise(video, audio, settings, seed=5)
    assert torch.equal(shuffled_v[:, :, :4], video[:, :, :4])          # the first window keeps its noise
    for target in (4, 6, 8):  # frames only the next window holds: the previous window's first frames, shuffled
        later = {tuple(shuffled_v[0, :, k, 0, 0].tolist()) for k in range(target, target + 2)}
        earlier = {tuple(shuffled_v[0, :, k, 0, 0].tolist()) for k in range(target - 4, target - 2)}
        assert later == earlier
    assert not torch.equal(shuffled_a, audio) and torch.equal(shuffled_a[..., :8], audio[..., :8])


def test_split_conds_to_windows_gives_each_window_the_entry_for_its_part_of_the_clip(model):
    latent = empty_latent(32, 32, FRAMES)                              # 17 latent frames
    first, last = (_entry([[torch.randn(1, n, TINY_CONFIG.text_dim), {}]], latent) for n in (3, 5))
    for split, expected in ((True, [3, 3, 5, 5]), (False, [3, 3, 3, 3])):
        spy = _Spy(ModelHandle(model))
        settings = ContextWindowSettings(context_length=6, context_overlap=2, split_conds_to_windows=split)
        cw.WindowedModel(spy, settings, [first, last])(0, latent["samples"], latent["audio_samples"], 1.0, 1.0,
                                                        video_mask=None, audio_mask=None, condition_seed=0,
                                                        device=torch.device("cpu"))
        assert [call["text"] for call in spy.calls] == expected       # windows 0-5, 4-9, 8-13, 11-16
    two = [[torch.randn(1, n, TINY_CONFIG.text_dim), {}] for n in (3, 5)]
    out = sample(_windowed(ModelHandle(model), context_length=6, context_overlap=2, split_conds_to_windows=True),
                 latent, two, sigmas(1), 0)
    assert torch.isfinite(out["samples"]).all()
    with pytest.raises(ValueError, match="one conditioning entry"):            # without the split: one entry only
        sample(_windowed(ModelHandle(model), context_length=6, context_overlap=2), latent, two, sigmas(1), 0)
