"""Weft's Qwen3-VL against transformers' own implementation (tiny config, random weights, float32).

transformers' Qwen3VLModel is built at a tiny size with every weight drawn at random, its state dict
renamed to the released encoder's keys and written to a safetensors file; Weft loads that file through
the ordinary loader. The stream after each layer L must equal transformers' `hidden_states[L]` within
1e-5: for a text-only prompt, and for a prompt holding a picture block and a two-slice video block (so
the vision tower, the deepstack mergers and the multi-axis positions all take part).
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from models.loading import load_model
from models.text.qwen3vl import (DEEPSTACK_METADATA, IMAGE_PAD_ID, TAG_TEXT, TAG_VISION, VIDEO_PAD_ID,
                                 VISION_END_ID, VISION_START_ID, Qwen3VL, VisualInput, default_mrope_section,
                                 rope_positions)

transformers = pytest.importorskip("transformers")  # pinned in requirements-test.txt; never skipped there

LAYERS = 4
HEAD_DIM = 16
DEEPSTACK = [0, 2]
IMAGE_GRID = (1, 4, 4)
VIDEO_GRID = (2, 4, 6)
TOLERANCE = 1e-5


def hf_config():
    from transformers import Qwen3VLConfig
    text = dict(vocab_size=151936, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD_DIM, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 5_000_000.0,
                                 "mrope_section": list(default_mrope_section(HEAD_DIM)), "mrope_interleaved": True})
    vision = dict(depth=3, hidden_size=64, num_heads=16, intermediate_size=96, patch_size=16, temporal_patch_size=2,
                  spatial_merge_size=2, out_hidden_size=32, num_position_embeddings=64,
                  deepstack_visual_indexes=DEEPSTACK)
    return Qwen3VLConfig(text_config=text, vision_config=vision)


@pytest.fixture(scope="module")
def reference():
    return build_reference()


def build_reference():
    """transformers' Qwen3VLModel with random weights (norms near 1, matrices scaled by fan-in)."""
    from transformers import Qwen3VLModel
    torch.manual_seed(0)
    model = Qwen3VLModel(hf_config()).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * torch.randn(p.shape, generator=gen))
            elif p.dim() >= 2:
                fan_in = p[0].numel()
                p.copy_(torch.randn(p.shape, generator=gen) / fan_in ** 0.5)
            else:
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
    return model


def released_state(reference, layers: int = LAYERS) -> dict[str, torch.Tensor]:
    """The reference's weights under the released file's names, truncated to `layers`, without the final norm."""
    state = {}
    for key, value in reference.state_dict().items():
        if key.startswith("language_model."):
            key = "model." + key[len("language_model."):]
            if key == "model.norm.weight":
                continue
            if key.startswith("model.layers.") and int(key.split(".")[2]) >= layers:
                continue
        state[key] = value.detach().clone().contiguous()
    return state


def write(path, state, metadata=None):
    save_file(state, str(path), metadata={DEEPSTACK_METADATA: json.dumps(DEEPSTACK), **(metadata or {})})
    return path


def prompt():
    """Token ids of text, a picture block, text, a video block of two slices (timestamps between), text."""
    gen = torch.Generator().manual_seed(2)
    text = lambda n: torch.randint(0, 5000, (n,), generator=gen).tolist()  # noqa: E731
    image_tokens = IMAGE_GRID[1] * IMAGE_GRID[2] // 4
    slice_tokens = VIDEO_GRID[1] * VIDEO_GRID[2] // 4
    ids = text(3) + [VISION_START_ID] + [IMAGE_PAD_ID] * image_tokens + [VISION_END_ID] + text(4)
    for _ in range(VIDEO_GRID[0]):
        ids += text(2) + [VISION_START_ID] + [VIDEO_PAD_ID] * slice_tokens + [VISION_END_ID]
    ids += text(5)
    patches = lambda grid: torch.randn(grid[0] * grid[1] * grid[2], 3 * 2 * 16 * 16, generator=gen)  # noqa: E731
    return torch.tensor(ids), patches(IMAGE_GRID), patches(VIDEO_GRID)


def hf_hidden_states(reference, ids, image=None, video=None):
    kwargs = {}
    if image is not None:
        types = torch.zeros_like(ids)
        types[ids == IMAGE_PAD_ID] = 1
        types[ids == VIDEO_PAD_ID] = 2
        kwargs = dict(pixel_values=image, image_grid_thw=torch.tensor([IMAGE_GRID]), pixel_values_videos=video,
                      video_grid_thw=torch.tensor([VIDEO_GRID]), mm_token_type_ids=types[None])
    with torch.no_grad():
        out = reference(input_ids=ids[None], output_hidden_states=True, **kwargs)
    return [h[0] for h in out.hidden_states]


def test_text_only_prompt_matches_transformers_after_every_layer(reference, tmp_path):
    model = load_model(str(write(tmp_path / "qwen.safetensors", released_state(reference)))).model
    assert isinstance(model, Qwen3VL) and model.config.num_layers == LAYERS
    ids = torch.randint(0, 151936, (11,), generator=torch.Generator().manual_seed(3))
    expected = hf_hidden_states(reference, ids)
    encoded = model.encode(ids, keep_layers=True)
    for layer in range(LAYERS):  # transformers' last entry is after its final norm, which H3 does not use
        torch.testing.assert_close(encoded.layers[layer], expected[layer], atol=TOLERANCE, rtol=0)
    assert encoded.hidden.dtype == torch.float32 and bool((encoded.tags == TAG_TEXT).all())


def test_picture_and_video_prompt_matches_transformers_after_every_layer(reference, tmp_path):
    model = load_model(str(write(tmp_path / "qwen.safetensors", released_state(reference)))).model
    ids, image, video = prompt()
    expected = hf_hidden_states(reference, ids, image, video)
    encoded = model.encode(ids, [VisualInput(image, IMAGE_GRID), VisualInput(video, VIDEO_GRID)], keep_layers=True)
    for layer in range(LAYERS):
        torch.testing.assert_close(encoded.layers[layer], expected[layer], atol=TOLERANCE, rtol=0)
    # Vision blocks (start and end tokens included) carry tag 0, the rest 1.
    vision = (ids == VISION_START_ID).cumsum(0) - (ids == VISION_END_ID).cumsum(0) + (ids == VISION_END_ID).long()
    assert torch.equal(encoded.tags, torch.where(vision > 0, TAG_VISION, TAG_TEXT))


def test_truncated_file_gives_the_stream_after_its_last_layer(reference, tmp_path):
    # The released file keeps 50 of 64 layers and no final norm: its output is transformers' hidden_states[50].
    kept = LAYERS - 1
    model = load_model(str(write(tmp_path / "qwen.safetensors", released_state(reference, kept)))).model
    assert model.config.num_layers == kept
    ids, image, video = prompt()
    expected = hf_hidden_states(reference, ids, image, video)
    encoded = model.encode(ids, [VisualInput(image, IMAGE_GRID), VisualInput(video, VIDEO_GRID)])
    torch.testing.assert_close(encoded.hidden, expected[kept], atol=TOLERANCE, rtol=0)


def test_positions_match_transformers_rope_index(reference):
    ids, _, _ = prompt()
    types = torch.zeros_like(ids)
    types[ids == IMAGE_PAD_ID] = 1
    types[ids == VIDEO_PAD_ID] = 2
    expected, _ = reference.get_rope_index(ids[None], types[None], torch.tensor([IMAGE_GRID]),
                                           torch.tensor([VIDEO_GRID]))
    grids = [(IMAGE_GRID[1] // 2, IMAGE_GRID[2] // 2)] + [(VIDEO_GRID[1] // 2, VIDEO_GRID[2] // 2)] * VIDEO_GRID[0]
    assert torch.equal(rope_positions(ids, grids), expected[:, 0])


def test_hugging_face_key_names_load_the_same_model(reference, tmp_path):
    # A transformers checkpoint: model.language_model.* / model.visual.*, with its final norm and output head.
    state = {"model." + k: v.detach().clone().contiguous() for k, v in reference.state_dict().items()}
    state["lm_head.weight"] = torch.randn(151936, 32)
    hf_model = load_model(str(write(tmp_path / "hf.safetensors", state))).model
    released = load_model(str(write(tmp_path / "released.safetensors", released_state(reference)))).model
    ids, image, video = prompt()
    visuals = [VisualInput(image, IMAGE_GRID), VisualInput(video, VIDEO_GRID)]
    assert torch.equal(hf_model.encode(ids, visuals).hidden, released.encode(ids, visuals).hidden)


def test_layers_after_the_fiftieth_are_not_loaded(reference, tmp_path):
    # A whole Qwen3-VL file (64 layers in the 32B release) is read up to layer 50, the one H3 conditions on.
    state = released_state(reference, 1)
    layer0 = {k: v for k, v in state.items() if k.startswith("model.layers.0.")}
    for n in range(1, 52):
        state.update({k.replace("model.layers.0.", f"model.layers.{n}."): v.clone() for k, v in layer0.items()})
    model = load_model(str(write(tmp_path / "long.safetensors", state))).model
    assert model.config.num_layers == 50 and len(model.model.layers) == 50
