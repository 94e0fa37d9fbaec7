"""The taeh3 preview decoder: H3's frame counts, its file layout (shapes recovered from the keys), refusals."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from models.h3.latents import pixel_frames
from models.h3.taeh3 import TINY_CONFIG, TAEH3Decoder, config_from_state, load_state, load_taeh3
from models.h3.tiny_released import TAEH3, taeh3_bytes


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("taeh3") / TAEH3
    path.write_bytes(taeh3_bytes())
    return path


@pytest.mark.parametrize("latent_t", [1, 2, 5, 7, 12])
def test_latents_decode_to_the_h3_vaes_frame_count_at_16x(tiny_file, latent_t):
    decoder = load_taeh3(tiny_file)
    assert decoder.config == TINY_CONFIG
    frames = decoder.decode(torch.randn(2, 24, latent_t, 3, 2, generator=torch.Generator().manual_seed(latent_t)))
    assert tuple(frames.shape) == (2, pixel_frames(latent_t), 48, 32, 3)
    assert frames.min() >= 0.0 and frames.max() <= 1.0 and frames.std() > 0.01


def test_clips_decode_on_their_own_and_the_preview_frame_is_its_latents_last(tiny_file):
    decoder = load_taeh3(tiny_file)
    latents = torch.randn(1, 24, 7, 2, 2, generator=torch.Generator().manual_seed(3))
    frames = decoder.decode(latents)
    second_clip = decoder.decode(latents[:, :, 5:])
    assert torch.equal(frames[:, 17:], second_clip)  # latents 5, 6 start a new 17-frame clip
    assert torch.allclose(decoder.frame_at(latents, 3), frames[0, 1 + 4 * 3 - 1], atol=1e-6)
    assert torch.allclose(decoder.frame_at(latents, 6), frames[0, -1], atol=1e-6)


def test_the_preview_frame_runs_as_one_graph_per_window_shape_equal_to_the_layers_run_one_by_one(
        tiny_file, monkeypatch, caplog):
    decoder = load_taeh3(tiny_file)
    latents = torch.randn(1, 24, 7, 3, 2, generator=torch.Generator().manual_seed(4))
    traced_frames = []
    trace = torch.jit.trace

    def counting(module, example, **options):
        traced_frames.append(example[0].shape[2])
        return trace(module, example, **options)

    monkeypatch.setattr(torch.jit, "trace", counting)
    with caplog.at_level("INFO", logger="models.h3.taeh3"):
        for index in range(7):
            window = latents[:, :, index - index % 5:index + 1]
            assert torch.equal(decoder.frame_at(latents, index), decoder.last_frame(window))
        decoder.frame_at(latents, 3)
    # Windows of 1 to 5 latents (latents 5 and 6 start the second clip again at 1 and 2): five shapes,
    # each traced once and then reused, and none fell back to the op-by-op path.
    assert sorted(traced_frames) == [1, 2, 3, 4, 5]
    assert not [r for r in caplog.records if "op by op" in r.getMessage()]


def test_a_decoder_torch_cannot_trace_draws_op_by_op_and_says_so(tiny_file, monkeypatch, caplog):
    decoder = load_taeh3(tiny_file)
    latents = torch.randn(1, 24, 4, 3, 2, generator=torch.Generator().manual_seed(5))

    def no_tracing(*args, **kwargs):
        raise RuntimeError("tracing is not available here")

    monkeypatch.setattr(torch.jit, "trace", no_tracing)
    with caplog.at_level("INFO", logger="models.h3.taeh3"):
        first, again = decoder.frame_at(latents, 3), decoder.frame_at(latents, 3)
    assert torch.equal(first, decoder.last_frame(latents)) and torch.equal(again, first)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "op by op" in said[0] and "tracing is not available here" in said[0]


def test_the_released_widths_are_recovered_from_the_keys_and_a_stride_2_first_grow_is_trimmed():
    released = TAEH3Decoder()
    state = released.state_dict()
    assert config_from_state(state).widths == (256, 128, 64, 64)
    grow = "decoder.7.conv.weight"
    state[grow] = torch.cat([torch.zeros_like(state[grow]), state[grow]])  # stored growing time 2x
    copy = TAEH3Decoder()
    load_state(copy, state)
    assert torch.equal(copy.state_dict()[grow], released.state_dict()[grow])


def test_a_file_that_is_not_taeh3_is_refused_naming_the_key(tmp_path):
    state = TAEH3Decoder(TINY_CONFIG).state_dict()
    del state["decoder.14.weight"]
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "broken.safetensors"))
    with pytest.raises(ValueError, match="decoder.14.weight"):
        load_taeh3(tmp_path / "broken.safetensors")
    wrong = TAEH3Decoder(TINY_CONFIG).state_dict()
    wrong["decoder.22.weight"] = torch.zeros(3, 8, 3, 3)
    save_file({k: v.contiguous() for k, v in wrong.items()}, str(tmp_path / "wrong.safetensors"))
    with pytest.raises(ValueError, match="decoder.22.weight"):
        load_taeh3(tmp_path / "wrong.safetensors")


@pytest.mark.parametrize("latent_t", [1, 2, 4, 5])
def test_the_previewed_frame_runs_each_layer_on_the_frames_it_depends_on_only(tiny_file, latent_t):
    decoder = load_taeh3(tiny_file)
    latents = torch.randn(1, 24, latent_t, 3, 2, generator=torch.Generator().manual_seed(10 + latent_t))
    seen: dict[int, list[int]] = {}
    hooks = [layer.register_forward_pre_hook(lambda _, args, i=i: seen.setdefault(i, []).append(args[0].shape[0]))
             for i, layer in enumerate(decoder.decoder)]
    with torch.no_grad():
        full = decoder.decode_clip(latents)[0, -1]
        full_counts = {i: counts.pop() for i, counts in seen.items()}
        last = decoder.last_frame(latents)
    for hook in hooks:
        hook.remove()
    torch.testing.assert_close(last, full, atol=1e-6, rtol=0)
    window = {i: counts.pop() for i, counts in seen.items()}
    # The last stage's memory blocks (time at 2x the latents', 4 frames per latent in all after the last grow)
    # see the 4, 3, 2 frames the last one reads back to, not the whole clip's; the layers after it see one.
    stage = [min(n, 2 * latent_t) for n in (4, 3, 2)]
    assert [window[i] for i in (15, 16, 17)] == stage and [full_counts[i] for i in (15, 16, 17)] == [2 * latent_t] * 3
    assert window[20] == window[22] == 1 and full_counts[22] == 4 * latent_t
    assert all(window[i] <= full_counts[i] for i in window)


def test_the_decoder_runs_where_the_latents_are_from_one_copy_per_device(tiny_file):
    decoder = load_taeh3(tiny_file)
    assert decoder.on("cpu") is decoder
    elsewhere = decoder.on("meta")  # any other device: the sampler's GPU in use; meta stands in here
    assert elsewhere is not decoder and decoder.on(torch.device("meta")) is elsewhere
    assert all(p.device.type == "meta" for p in elsewhere.parameters())
    assert all(p.device.type == "cpu" for p in decoder.parameters())
    frame = elsewhere.frame_at(torch.randn(1, 24, 4, 3, 2, device="meta"), 3)
    assert frame.device.type == "meta" and tuple(frame.shape) == (48, 32, 3)
