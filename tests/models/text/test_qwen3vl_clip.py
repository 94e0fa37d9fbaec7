"""The Qwen3-VL encoder on the CLIP wire: loaded with its tokenizer from the folder beside the file, prompts
laid out with their pictures, tagged per token, remembered per (text, pictures); and the refusals of a
file without its tokenizer or with halves of different widths."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from models.components import load_text_encoder
from models.h3.packing import TOKEN_TAGS_KEY
from models.h3.tiny_released import TEXT_ENCODER, qwen3vl_bytes
from models.loading import load_model
from models.text.qwen3vl import DEEPSTACK_METADATA
from models.text.qwen_prompt import AudioReference, ImageReference, VideoReference
from models.text.qwen_tokenizer import PAD_ID, TOKENIZER_FOLDER, write_tiny_tokenizer


@pytest.fixture(scope="module")
def encoder_file(tmp_path_factory):
    folder = tmp_path_factory.mktemp("text_encoders")
    path = folder / TEXT_ENCODER
    path.write_bytes(qwen3vl_bytes())
    write_tiny_tokenizer(folder / TOKENIZER_FOLDER)
    return path


def picture(height: int, width: int, seed: int) -> torch.Tensor:
    return torch.rand(height, width, 3, generator=torch.Generator().manual_seed(seed))


def test_first_frame_picture_tokens_sit_where_the_layout_says_with_tag_0(encoder_file):
    clip = load_text_encoder(encoder_file, encoder_file.name)
    assert clip.reads_pictures
    (hidden, extras), = clip.encode("A red kite over the sea.", references=[ImageReference(picture(64, 96, 1))])
    tags = extras[TOKEN_TAGS_KEY][0]
    label = len(clip.tokenizer.encode("<Picture 1>: "))
    block = 2 + (64 // 32) * (96 // 32)          # start, one token per 32 x 32 pixels, end
    words = len(clip.tokenizer.encode("A red kite over the sea."))
    assert hidden.shape == (1, label + block + words, 48) and hidden.dtype == torch.float32
    assert tags.tolist() == [1] * label + [0] * block + [1] * words
    assert bool(extras["attention_mask"].all())


def test_references_are_laid_out_and_the_prompt_is_cached_by_text_and_pictures(encoder_file):
    clip = load_text_encoder(encoder_file, encoder_file.name)
    video = VideoReference.sampled(torch.rand(25, 64, 64, 3, generator=torch.Generator().manual_seed(3)), 24.0)
    references = [ImageReference(picture(64, 64, 2)), AudioReference(), video]
    first = clip.encode("They dance.", references=references)
    again = clip.encode("They dance.", references=[ImageReference(picture(64, 64, 2)), AudioReference(), video])
    assert again[0][0] is first[0][0]                       # remembered: same text, same pictures
    other = clip.encode("They dance.", references=[ImageReference(picture(64, 64, 9)), AudioReference(), video])
    assert other[0][0] is not first[0][0] and not torch.equal(other[0][0], first[0][0])
    tags = first[0][1][TOKEN_TAGS_KEY][0]
    # One picture block and one block per two sampled frames (25 frames at 24 fps: 3 samples -> 2 blocks).
    starts = (tags[1:] == 0) & (tags[:-1] == 1)
    assert int(starts.sum()) == 3


def test_empty_prompt_is_the_pad_token(encoder_file):
    clip = load_text_encoder(encoder_file, encoder_file.name)
    (hidden, extras), = clip.encode("")
    assert hidden.shape[:2] == (1, 1) and extras[TOKEN_TAGS_KEY].tolist() == [[1]]
    expected = clip.model.encode([PAD_ID]).hidden
    assert torch.equal(hidden[0], expected)


def test_missing_tokenizer_names_the_file_and_the_folder(tmp_path):
    path = tmp_path / TEXT_ENCODER
    path.write_bytes(qwen3vl_bytes())
    with pytest.raises(ValueError, match=r"vocab\.json.*" + TOKENIZER_FOLDER):
        load_text_encoder(path, path.name)


def test_halves_of_different_widths_are_refused(tmp_path, encoder_file):
    # The vision tower of one model and the language model of another: the merger writes 32-wide tokens.
    state = load_file(str(encoder_file))
    for key in ("visual.merger.linear_fc2.weight", "visual.merger.linear_fc2.bias"):
        state[key] = state[key][:32].contiguous()
    path = tmp_path / "mixed.safetensors"
    save_file(state, str(path), metadata={DEEPSTACK_METADATA: json.dumps([0, 1])})
    with pytest.raises(ValueError, match=r"merger writes 32-wide tokens.*48 wide"):
        load_model(str(path))


def test_a_narrower_encoder_loads_and_the_transformer_refuses_its_width(tmp_path):
    import dataclasses

    from models.h3 import transformer
    from models.h3.make_tiny import _init_weights
    from models.text.qwen3vl import TINY_CONFIG, Qwen3VL
    # A consistent Qwen3-VL of another width (as a smaller Qwen3-VL release would be) loads and encodes;
    # the H3 transformer refuses conditioning of a width it was not built for, saying both widths.
    config = dataclasses.replace(TINY_CONFIG, hidden_size=32,
                                 vision=dataclasses.replace(TINY_CONFIG.vision, out_hidden_size=32))
    model = Qwen3VL(config)
    _init_weights(model, 11)
    path = tmp_path / "narrow.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path),
              metadata={DEEPSTACK_METADATA: json.dumps(list(config.vision.deepstack_layers))})
    write_tiny_tokenizer(tmp_path / TOKENIZER_FOLDER)
    (hidden, _), = load_text_encoder(path, path.name).encode("A boat.")
    assert hidden.shape[-1] == 32
    dit = transformer.H3Transformer(transformer.TINY_CONFIG)
    with pytest.raises(ValueError, match="conditioning width 32 does not match the model's text width 48"):
        dit(torch.zeros(1, 24, 1, 2, 2), torch.zeros(1, 32, 2, 1), hidden, 0.5, 0.5)
