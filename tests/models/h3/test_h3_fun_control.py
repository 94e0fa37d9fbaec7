"""The Fun ControlNet-Union patch: detection and config from the file, and its effect inside the tiny pruned DiT."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load as load_bytes
from safetensors.torch import save as save_bytes

from models.h3.fun_control import (
    FunControlConfig, FunControlHook, FunControlNet, hint_frame_count, injection_layers,
)
from models.h3.packing import SegmentRole as Role
from models.h3.tiny_released import build_pruned_transformer, fun_control_bytes
from models.loading import load_model
from models.patcher import BLOCK_HOOKS, ModelHandle


@pytest.fixture(scope="module")
def patch_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("fun_control") / "patch.safetensors"
    path.write_bytes(fun_control_bytes())
    return path


@pytest.fixture(scope="module")
def net(patch_file):
    return load_model(str(patch_file), expect="h3_fun_control").model


@pytest.fixture(scope="module")
def dit():
    return build_pruned_transformer(2001).to(torch.bfloat16)


def test_patch_is_detected_with_places_and_curve_form_from_its_metadata(net):
    cfg = net.config
    assert cfg.injection_layers == (0, 1) and cfg.curve_form and cfg.time_embed_dim == 8
    assert net.control_proj_in.weight.dtype == torch.float32 and net.control_proj_in.in_features == 196
    assert net.control_blocks[0].adaln_proj.linear.weight.dtype == torch.float32   # curve form runs in float32
    assert getattr(net.control_blocks[0].attn.qkv_proj, "holds_quantized_weights", False)
    assert hasattr(net.control_blocks[0], "before_proj") and not hasattr(net.control_blocks[1], "before_proj")


def test_injection_layers_spread_evenly_without_metadata_and_bad_metadata_is_refused():
    assert injection_layers(5, {}) == (0, 10, 20, 30, 40)
    assert injection_layers(10, {}) == tuple(range(0, 50, 5))
    for bad in ("[0, 5]", "[1, 2, 3]", "[0, 3, 2]", "nope"):
        with pytest.raises(ValueError, match="control_blocks_places"):
            injection_layers(3, {"control_blocks_places": bad})


def test_the_form_marker_decides_and_an_unmarked_8_wide_file_is_curve_form(patch_file, tmp_path):
    tensors = load_bytes(patch_file.read_bytes())
    for metadata, curve in (({"control_blocks_places": "[0, 1]"}, True),
                            ({"control_blocks_places": "[0, 1]", "minimax_h3_fun_controlnet": "full"}, False)):
        path = tmp_path / "patch.safetensors"
        path.write_bytes(save_bytes(tensors, metadata=metadata))
        assert load_model(str(path)).model.config.curve_form is curve


def test_a_full_form_patch_is_refused_on_a_curve_form_model(dit):
    full = FunControlNet(FunControlConfig(hidden_size=64, num_heads=2, head_dim=48, ffn_size=128, time_embed_dim=32,
                                          injection_layers=(0, 1)))
    with pytest.raises(ValueError, match="curve-form"):
        _run(dit, [_hook(full)])


def _hook(net, *, strength=1.0, sigma_start=1.0, sigma_end=0.0):
    def encode(frames):            # a stand-in VAE: a fixed latent per frame count and size
        t = 1 if frames.shape[0] == 1 else 2 + (frames.shape[0] - 5) // 17 * 5
        gen = torch.Generator().manual_seed(frames.shape[0] * 1000 + frames.shape[1])
        return torch.randn(1, 24, t, frames.shape[1] // 16, frames.shape[2] // 16, generator=gen)

    def fit(frames, width, height):
        return torch.nn.functional.interpolate(frames.movedim(-1, 1), size=(height, width)).movedim(1, -1)

    video = torch.rand(3, 40, 40, 3, generator=torch.Generator().manual_seed(3))
    return FunControlHook(net, encode, fit, strength=strength, sigma_start=sigma_start, sigma_end=sigma_end,
                          control_video=video)


class Recorder:
    """A block hook that keeps each block's input and output, and the forward's context."""

    def __init__(self):
        self.blocks, self.context = [], None

    def begin(self, context):
        self.context = context
        self.blocks = []

        def record(index, block_input, block_output):
            self.blocks.append((block_input.clone(), block_output.clone()))
            return block_output
        return record


def _run(dit, hooks, sigma=0.7):
    gen = torch.Generator().manual_seed(0)
    video, audio = torch.randn(1, 24, 2, 4, 6, generator=gen), torch.randn(1, 32, 2, 8, generator=gen)
    text = torch.randn(1, 5, 48, generator=gen)
    handle = ModelHandle(dit, options={BLOCK_HOOKS: tuple(hooks)})
    with torch.no_grad():
        return handle(video, audio, text, sigma, sigma)


def test_strength_one_changes_every_injected_layer_and_never_the_audio_rows(net, dit):
    plain, controlled = Recorder(), Recorder()
    base = _run(dit, [plain])
    steered = _run(dit, [_hook(net), controlled])
    ctx = controlled.context
    audio = [(s.start, s.stop) for s in ctx.layout.segments if s.role is Role.AUDIO]
    video = ctx.layout.segment(Role.VIDEO)
    # Layer 0 sees the same input either way: only the patch's skip separates the outputs.
    (in0, out0), (_, plain_out0) = controlled.blocks[0], plain.blocks[0]
    assert torch.equal(in0, plain.blocks[0][0])
    for start, stop in audio:
        assert torch.equal(out0[start:stop], plain_out0[start:stop])
    assert not torch.equal(out0[video.start:video.stop], plain_out0[video.start:video.stop])
    # At every injected layer: output - block(input) is the patch's skip: nonzero on video, zero on audio.
    for index in net.config.injection_layers:
        block_in, block_out = controlled.blocks[index]
        with torch.no_grad():
            own = dit.blocks[index](block_in, ctx.t_emb, ctx.rows, ctx.rope)
        skip = block_out.float() - own.float()
        assert skip[video.start:video.stop].abs().amax() > 0
        for start, stop in audio:
            assert torch.equal(block_out[start:stop], own[start:stop])
    assert not torch.equal(base[0], steered[0])


@pytest.mark.parametrize("case", ["strength 0", "sigma above the range", "sigma below the range"])
def test_outside_its_range_the_patch_changes_nothing(net, dit, case):
    hook = {"strength 0": _hook(net, strength=0.0), "sigma above the range": _hook(net, sigma_start=0.5),
            "sigma below the range": _hook(net, sigma_end=0.8)}[case]
    base, with_hook = _run(dit, []), _run(dit, [hook])
    assert torch.equal(base[0], with_hook[0]) and torch.equal(base[1], with_hook[1])


def test_hint_frames_follow_the_latent_length():
    assert [hint_frame_count(t) for t in (2, 7, 12)] == [5, 22, 39]


def test_a_context_window_takes_its_own_frames_of_the_whole_clips_hint(net, dit, monkeypatch):
    import models.h3.fun_control as fun_control
    from models.h3.packing import TargetWindow

    cut = []
    whole_rows = fun_control.hint_rows
    monkeypatch.setattr(fun_control, "hint_rows", lambda hint, width: cut.append(hint) or whole_rows(hint, width))
    hook = _hook(net)
    clip = (12, 4, 6)                                          # the whole clip's latent size (T', H, W)
    window = TargetWindow(video=(5, 6, 7), audio=tuple(range(30, 38)))
    gen = torch.Generator().manual_seed(0)
    video, audio = torch.randn(1, 24, 3, 4, 6, generator=gen), torch.randn(1, 32, 2, 8, generator=gen)
    handle = ModelHandle(dit, options={BLOCK_HOOKS: (hook,)})
    with torch.no_grad():
        handle(video, audio, torch.randn(1, 5, 48, generator=gen), 0.7, 0.7, target_window=window, clip_size=clip)
    assert torch.equal(cut[0], hook.hint(clip)[:, [5, 6, 7]])
