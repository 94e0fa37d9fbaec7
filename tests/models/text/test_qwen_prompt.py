"""H3's Qwen3-VL prompt layouts and the image/video preprocessing, checked against transformers' Qwen3-VL
processor pieces (smart resize, image processor, video patchify, frame timestamps)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

from models.text import qwen_prompt as qp
from models.text import qwen_tokenizer as qt

START, END, IMAGE_PAD, VIDEO_PAD = 151652, 151653, 151655, 151656


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return qt.QwenTokenizer.from_folder(qt.write_tiny_tokenizer(tmp_path_factory.mktemp("tok") / "qwen25_tokenizer"))


def _image(height, width, seed=0):
    return torch.rand(height, width, 3, generator=torch.Generator().manual_seed(seed))


def _block(pad, count):
    return [START] + [pad] * count + [END]


def test_first_last_frame_layout_puts_the_picture_block_where_the_layout_says(tokenizer):
    prompt = "<Picture 1> walks toward <Picture 2> in the rain"
    first, last = _image(64, 96, 1), _image(96, 64, 2)
    laid_out = qp.first_last_frame_prompt(tokenizer, prompt, [first, last])
    per_image = 64 * 96 // (32 * 32)  # merged 2x2 groups of 16-pixel patches
    expected = (tokenizer.encode("<Picture 1>: ") + _block(IMAGE_PAD, per_image)
                + tokenizer.encode("<Picture 2>: ") + _block(IMAGE_PAD, per_image) + tokenizer.encode(prompt))
    assert laid_out.input_ids.tolist() == expected
    ids, tags = laid_out.input_ids.tolist(), laid_out.token_tags.tolist()
    first_start = ids.index(START)
    assert first_start == len(tokenizer.encode("<Picture 1>: "))
    for position, (token, tag) in enumerate(zip(ids, tags)):
        in_block = token in (START, END, IMAGE_PAD)
        assert tag == (0 if in_block else 1), (position, token)
    assert tags[first_start:first_start + per_image + 2] == [0] * (per_image + 2)
    assert [item.grid_thw for item in laid_out.visual_items] == [(1, 4, 6), (1, 6, 4)]
    assert all(item.kind is qp.VisualKind.IMAGE for item in laid_out.visual_items)
    # the prompt's own "<Picture 1>" is text, not a vision block
    assert tags[-len(tokenizer.encode(prompt)):] == [1] * len(tokenizer.encode(prompt))


def test_one_keyframe_and_an_empty_prompt_have_no_pad_token(tokenizer):
    laid_out = qp.first_last_frame_prompt(tokenizer, "", [_image(64, 64)])
    assert laid_out.input_ids.tolist() == tokenizer.encode("<Picture 1>: ") + _block(IMAGE_PAD, 4)
    with pytest.raises(ValueError, match="at most two images"):
        qp.first_last_frame_prompt(tokenizer, "x", [_image(64, 64)] * 3)


def test_text_to_video_is_the_prompt_alone(tokenizer):
    laid_out = qp.text_to_video_prompt(tokenizer, r"a fox \(red\)")
    assert laid_out.input_ids.tolist() == tokenizer.encode("a fox (red)")
    assert set(laid_out.token_tags.tolist()) == {1} and laid_out.visual_items == ()


def test_reference_layout_numbers_each_kind_and_keeps_audio_out_of_the_encoder(tokenizer):
    video = qp.VideoReference(torch.rand(3, 64, 64, 3), (0.0, 0.5, 1.0))
    references = [qp.ImageReference(_image(64, 64)), qp.AudioReference(), video,
                  qp.ImageReference(_image(64, 128)[None]), qp.AudioReference()]
    laid_out = qp.build_encoder_prompt(tokenizer, "go", references)
    expected = (tokenizer.encode("<Picture 1>: ") + _block(IMAGE_PAD, 4)
                + tokenizer.encode("<Audio 1>: ")
                + tokenizer.encode("<Video 1>: ")
                + tokenizer.encode("<0.2 seconds>") + _block(VIDEO_PAD, 4)
                + tokenizer.encode("<1.0 seconds>") + _block(VIDEO_PAD, 4)
                + tokenizer.encode("<Picture 2>: ") + _block(IMAGE_PAD, 8)
                + tokenizer.encode("<Audio 2>: ") + tokenizer.encode("go"))
    assert laid_out.input_ids.tolist() == expected
    assert [(item.kind, item.grid_thw) for item in laid_out.visual_items] == [
        (qp.VisualKind.IMAGE, (1, 4, 4)), (qp.VisualKind.VIDEO, (2, 4, 4)), (qp.VisualKind.IMAGE, (1, 4, 8))]
    assert sum(item.token_count for item in laid_out.visual_items) == sum(
        token in (IMAGE_PAD, VIDEO_PAD) for token in expected)
    vision = {START, END, IMAGE_PAD, VIDEO_PAD}
    assert laid_out.token_tags.tolist() == [0 if token in vision else 1 for token in expected]
    with pytest.raises(TypeError, match="reference 1"):
        qp.build_encoder_prompt(tokenizer, "go", [_image(64, 64)])


def test_video_is_sampled_at_2_fps_with_transformers_timestamps(tokenizer):
    fps, count = 24, 124  # a 17n + 5 clip at H3's frame rate
    frames = torch.arange(count, dtype=torch.float32).div(count)[:, None, None, None].expand(count, 64, 64, 3)
    reference = qp.VideoReference.sampled(frames, fps)
    indices = list(range(0, count, 12))  # every half second
    assert torch.equal(reference.frames, frames[indices])
    assert reference.timestamps_s == tuple(i / 2 for i in range(len(indices)))
    expected_times = Qwen3VLProcessor._calculate_timestamps(None, list(indices), fps, 2)
    assert qp.frame_pair_timestamps(reference.timestamps_s) == pytest.approx(expected_times, abs=1e-12)
    labels = [f"<{t:.1f} seconds>" for t in expected_times]
    assert labels[:3] == ["<0.2 seconds>", "<1.2 seconds>", "<2.2 seconds>"] and labels[-1] == "<5.0 seconds>"

    laid_out = qp.build_encoder_prompt(tokenizer, "", [reference])
    item = laid_out.visual_items[0]
    assert item.grid_thw == (6, 4, 4)  # 11 sampled frames, the last one repeated
    expected = tokenizer.encode("<Video 1>: ")
    for label in labels:
        expected += tokenizer.encode(label) + _block(VIDEO_PAD, 4)
    assert laid_out.input_ids.tolist() == expected

    # a 30 fps clip takes the nearest frame to each half second
    assert qp.VideoReference.sampled(torch.rand(31, 32, 32, 3), 30).timestamps_s == (0.0, 0.5, 1.0)
    with pytest.raises(ValueError, match="frame rate"):
        qp.VideoReference.sampled(frames, 0)
    with pytest.raises(ValueError, match="2 timestamps"):
        qp.build_encoder_prompt(tokenizer, "", [qp.VideoReference(frames[:3], (0.0, 0.5))])


@pytest.mark.parametrize("height, width", [(64, 96), (224, 160), (96, 352)])
def test_image_patches_equal_transformers_image_processor(height, width):
    rgb = np.random.default_rng(height + width).integers(0, 256, (height, width, 3), dtype=np.uint8)
    reference = Qwen2VLImageProcessorPil(patch_size=16, temporal_patch_size=2, merge_size=2,
                                         image_mean=[0.5] * 3, image_std=[0.5] * 3,
                                         min_pixels=qp.MIN_PIXELS, max_pixels=qp.MAX_PIXELS)(
        images=[rgb], return_tensors="pt")
    ours = qp.preprocess_image(torch.from_numpy(rgb).float() / 255.0)
    assert ours.grid_thw == tuple(reference["image_grid_thw"][0].tolist())
    assert ours.patches.dtype == torch.float32
    torch.testing.assert_close(ours.patches, reference["pixel_values"].float(), atol=1e-6, rtol=0)
    assert torch.equal(qp.preprocess_image(torch.from_numpy(rgb)).patches, ours.patches)


@pytest.mark.parametrize("frame_count", [4, 5])
def test_video_patches_equal_transformers_video_patchify(frame_count):
    frames = torch.rand(frame_count, 64, 96, 3, generator=torch.Generator().manual_seed(frame_count))
    ours = qp.preprocess_video(frames)
    normalised = ((frames - 0.5) / 0.5).permute(0, 3, 1, 2)[None]  # (1, T, C, H, W)
    patches, grid_t, grid_h, grid_w = Qwen3VLVideoProcessor().patchify(
        normalised, patch_size=16, merge_size=2, temporal_patch_size=2)
    assert ours.grid_thw == (grid_t, grid_h, grid_w) == ((frame_count + 1) // 2, 4, 6)
    torch.testing.assert_close(ours.patches, patches[0], atol=0, rtol=0)


def test_image_patches_equal_video_patches_of_the_image_twice():
    image = _image(96, 64)
    torch.testing.assert_close(qp.preprocess_image(image).patches,
                               qp.preprocess_video(torch.stack([image, image])).patches, atol=0, rtol=0)


def test_fit_to_patch_grid_equals_transformers_smart_resize():
    rng = np.random.default_rng(0)
    sizes = [(1, 1), (10, 10), (31, 33), (56, 56), (57, 200), (500, 3), (768, 1344), (1080, 1920),
             (2048, 3584), (4000, 4000), (10000, 6000), (33, 6000)]
    sizes += [tuple(int(v) for v in rng.integers(8, 5000, 2)) for _ in range(200)]
    for height, width in sizes:
        expected = hf_smart_resize(height, width, factor=32, min_pixels=qp.MIN_PIXELS, max_pixels=qp.MAX_PIXELS)
        assert qp.fit_to_patch_grid(height, width) == expected, (height, width)
    with pytest.raises(ValueError, match="elongated"):
        qp.fit_to_patch_grid(10, 2100)


def test_off_grid_images_are_resized_bilinearly_onto_the_grid():
    image = torch.full((50, 70, 4), 0.75)  # RGBA, the alpha dropped
    item = qp.preprocess_image(image)
    assert item.grid_thw == (1, 4, 4)  # 50x70 -> 64x64: the nearest multiples of 32 are 64x64
    torch.testing.assert_close(item.patches, torch.full_like(item.patches, 0.5))
    ramp = torch.linspace(0, 1, 40)[None, :, None].expand(40, 40, 3)
    resized = torch.nn.functional.interpolate(ramp.permute(2, 0, 1)[None], size=(64, 64), mode="bilinear",
                                              align_corners=False)
    patches = qp.preprocess_image(ramp).patches
    assert patches.shape == (16, 3 * 2 * 16 * 16)
    # first patch, channel 0, frame 0: the resized ramp's top-left 16x16 corner
    torch.testing.assert_close(patches[0, :256].view(16, 16), (resized[0, 0, :16, :16] - 0.5) / 0.5)


def test_bad_frames_are_refused_with_what_was_expected():
    with pytest.raises(ValueError, match=r"one \(height, width, channels\) frame"):
        qp.preprocess_image(torch.rand(2, 64, 64, 3))
    with pytest.raises(ValueError, match="3 \\(RGB\\) or 4"):
        qp.preprocess_image(torch.rand(64, 64, 1))
    with pytest.raises(ValueError, match="float in"):
        qp.preprocess_image(torch.zeros(64, 64, 3, dtype=torch.int32))
    with pytest.raises(ValueError, match="at least one frame"):
        qp.preprocess_video(torch.rand(0, 64, 64, 3))


def test_transformers_inputs_split_images_and_videos(tokenizer):
    video = qp.VideoReference(torch.rand(2, 64, 64, 3), (0.0, 0.5))
    laid_out = qp.build_encoder_prompt(tokenizer, "x", [qp.ImageReference(_image(64, 96)), video])
    inputs = laid_out.transformers_inputs()
    assert inputs["input_ids"].shape == inputs["mm_token_type_ids"].shape == (1, laid_out.input_ids.numel())
    types = inputs["mm_token_type_ids"][0]
    assert int((types == 1).sum()) == 6 and int((types == 2).sum()) == 4
    assert inputs["image_grid_thw"].tolist() == [[1, 4, 6]] and inputs["video_grid_thw"].tolist() == [[1, 4, 4]]
    assert inputs["pixel_values"].shape == (24, 1536) and inputs["pixel_values_videos"].shape == (16, 1536)


def test_the_encoder_reads_the_laid_out_prompt_and_its_pictures_at_their_blocks(tokenizer):
    from models.text.qwen3vl import TINY_CONFIG, Qwen3VL
    torch.manual_seed(0)
    encoder = Qwen3VL(TINY_CONFIG)
    with torch.no_grad():
        for parameter in encoder.parameters():
            parameter.normal_(0, 0.05)
    video = qp.VideoReference(torch.rand(3, 64, 64, 3, generator=torch.Generator().manual_seed(5)), (0.0, 0.5, 1.0))
    outputs = []
    for seed in (1, 2):  # the same layout with a different picture
        laid_out = qp.build_encoder_prompt(tokenizer, "a fox", [qp.ImageReference(_image(64, 96, seed)), video])
        encoded = encoder.encode(laid_out.input_ids, laid_out.visual_items)
        assert torch.equal(encoded.tags, laid_out.token_tags)
        outputs.append(encoded.hidden)
    first_pad = laid_out.input_ids.tolist().index(IMAGE_PAD)
    # causal: rows before the picture's pads are untouched by the picture, its pad rows are not
    torch.testing.assert_close(outputs[0][:first_pad], outputs[1][:first_pad], atol=0, rtol=0)
    assert not torch.allclose(outputs[0][first_pad], outputs[1][first_pad])


def test_reference_to_video_orders_images_videos_with_their_sound_then_sounds(tokenizer):
    images = [_image(64, 64, 1), _image(64, 64, 2)]
    videos = [torch.rand(29, 64, 64, 3), torch.rand(13, 64, 64, 3)]  # 3 and 2 frames at 2 fps
    laid_out = qp.reference_to_video_prompt(tokenizer, "p", images=images, videos=videos,
                                            video_has_sound=[False, True], standalone_audio_count=1)
    expected = qp.build_encoder_prompt(tokenizer, "p", [
        qp.ImageReference(images[0]), qp.ImageReference(images[1]),
        qp.VideoReference.sampled(videos[0], 24), qp.AudioReference(), qp.VideoReference.sampled(videos[1], 24),
        qp.AudioReference()])
    assert laid_out.input_ids.tolist() == expected.input_ids.tolist()
    text = tokenizer.decode(laid_out.input_ids.tolist())
    labels = ["<Picture 1>: ", "<Picture 2>: ", "<Video 1>: ", "<Audio 1>: ", "<Video 2>: ", "<Audio 2>: "]
    positions = [text.index(label) for label in labels]
    assert positions == sorted(positions)
    assert [item.grid_thw[0] for item in laid_out.visual_items] == [1, 1, 2, 1]
    with pytest.raises(ValueError, match="1 entries for 2 videos"):
        qp.reference_to_video_prompt(tokenizer, "p", videos=videos, video_has_sound=[True])


def test_sampling_at_2_fps_takes_the_nearest_frame_ties_going_later():
    frames = torch.arange(51, dtype=torch.float32)[:, None, None, None].expand(51, 32, 32, 3)
    reference = qp.VideoReference.sampled(frames, 25)  # half seconds fall on frames 0, 12.5, 25, 37.5, 50
    assert reference.frames[:, 0, 0, 0].tolist() == [0, 13, 25, 38, 50]
    assert reference.timestamps_s == (0.0, 0.5, 1.0, 1.5, 2.0)
