"""The Qwen3-VL tokenizer: added-token ids, escapes, the empty prompt, missing files, and agreement with
transformers' Qwen2Tokenizer on the tiny vocabulary the project trains."""
from __future__ import annotations

import json
import unicodedata

import pytest
from tokenizers import AddedToken
from transformers import Qwen2Tokenizer

from models.text import qwen_tokenizer as qt
from models.text.qwen_prompt import text_to_video_prompt

SAMPLES = (
    "A red fox runs across a snowy field at dawn.",
    "It's 2024, don't they'll WE'RE  two   spaces\n\nand\ttabs \r\n end ",
    "Unicode: 你好，世界 — café naïve ünïcödé 🎬🦊 e\u0301 (combining accent, NFC folds it)",
    "<|vision_start|><|image_pad|><|vision_end|>text<|video_pad|> <d>x</d><|cutoff|>",
    "<|lyrics_start|>la la<|lyrics_end|><|caption_start|>a song<|caption_end|><think></think>",
    "unknown-ish <|not_a_token|> <Picture 1>: and <Video 2>: <1.2 seconds>",
    "(a photo:1.3) of [things] {braces} \\\\ backslashes",
)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return qt.write_tiny_tokenizer(tmp_path_factory.mktemp("tok") / qt.TOKENIZER_FOLDER)


@pytest.fixture(scope="module")
def tokenizer(tiny_folder):
    return qt.QwenTokenizer.from_folder(tiny_folder)


def test_added_tokens_have_qwen_and_minimax_ids(tokenizer):
    assert [spec.id for spec in qt.ADDED_TOKENS] == list(range(151643, 151676))
    assert len(qt.QWEN_ADDED_TOKENS) == 26 and len(qt.MINIMAX_ADDED_TOKENS) == 7
    expected = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645,
                "<|vision_start|>": 151652, "<|vision_end|>": 151653, "<|image_pad|>": 151655,
                "<|video_pad|>": 151656, "</think>": 151668, "<d>": 151669, "</d>": 151670,
                "<|cutoff|>": 151671, "<|lyrics_start|>": 151672, "<|lyrics_end|>": 151673,
                "<|caption_start|>": 151674, "<|caption_end|>": 151675}
    for content, token_id in expected.items():
        assert tokenizer.encode(content) == [token_id], content
        assert tokenizer.token_to_id(content) == token_id
    assert (qt.PAD_ID, qt.VISION_START_ID, qt.VISION_END_ID, qt.IMAGE_PAD_ID, qt.VIDEO_PAD_ID) == (
        151643, 151652, 151653, 151655, 151656)
    # the encoder's token table (real and tiny) has a row for every added id
    from models.text.qwen3vl import TINY_CONFIG, Qwen3VLConfig
    assert min(Qwen3VLConfig().vocab_size, TINY_CONFIG.vocab_size) > qt.ADDED_TOKENS[-1].id
    # an added token inside text is matched whole, with the text around it tokenized as usual
    ids = tokenizer.encode("fox<d>fox")
    assert ids == tokenizer.encode("fox") + [151669] + tokenizer.encode("fox")


def test_tiny_vocabulary_stays_below_the_added_ids(tokenizer):
    vocab, merges = qt.train_tiny_vocabulary()
    assert 256 < len(vocab) <= qt.TINY_PIECE_COUNT and max(vocab.values()) == len(vocab) - 1
    assert merges and tokenizer.piece_count == len(vocab)


def test_matches_transformers_qwen2_tokenizer(tokenizer):
    vocab, merges = qt.train_tiny_vocabulary()
    full = dict(vocab)
    full.update({spec.content: spec.id for spec in qt.ADDED_TOKENS})
    reference = Qwen2Tokenizer(vocab=full, merges=merges)
    reference.add_tokens([AddedToken(spec.content, special=spec.special, normalized=False)
                          for spec in qt.ADDED_TOKENS], special_tokens=True)
    for text in SAMPLES:
        assert tokenizer.encode(text) == reference(text)["input_ids"], text


def test_decode_round_trips_and_skips_special_tokens(tokenizer):
    for text in SAMPLES[:3]:
        assert tokenizer.decode(tokenizer.encode(text)) == unicodedata.normalize("NFC", text)
    ids = tokenizer.encode("<|vision_start|>hi<|vision_end|><think>")
    assert tokenizer.decode(ids) == "<|vision_start|>hi<|vision_end|><think>"
    assert tokenizer.decode(ids, skip_special=True) == "hi<think>"  # <think> is not marked special


def test_escaped_parentheses_become_parentheses_and_weights_are_text(tokenizer):
    assert qt.unescape_prompt(r"\(a\) \\(b\)") == r"(a) \(b)"
    assert tokenizer.encode(r"a \(red\) fox") == tokenizer.encode("a (red) fox")
    weighted = "(red fox:1.3)"
    assert tokenizer.decode(tokenizer.encode(weighted)) == weighted


def test_empty_prompt_is_the_pad_token_alone(tokenizer):
    assert tokenizer.encode("") == []
    prompt = text_to_video_prompt(tokenizer, "")
    assert prompt.input_ids.tolist() == [151643] and prompt.token_tags.tolist() == [1]
    assert prompt.visual_items == ()
    assert text_to_video_prompt(tokenizer, " ").input_ids.tolist() == tokenizer.encode(" ") != [151643]


def test_missing_files_name_the_file_the_folder_and_where_to_get_them(tmp_path, tiny_folder):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError) as info:
        qt.QwenTokenizer.from_folder(empty)
    message = str(info.value)
    assert "vocab.json" in message and str(empty.resolve()) in message
    assert "Hugging Face" in message and "comfy/text_encoders/qwen25_tokenizer" in message

    only_vocab = tmp_path / "only_vocab"
    only_vocab.mkdir()
    (only_vocab / "vocab.json").write_bytes((tiny_folder / "vocab.json").read_bytes())
    with pytest.raises(FileNotFoundError, match="merges.txt"):
        qt.QwenTokenizer.from_folder(only_vocab)

    checkpoint = tmp_path / "text_encoders" / "qwen3vl_32b_minimax_h3_nvfp4_awq.safetensors"
    assert qt.tokenizer_folder_beside(checkpoint) == tmp_path / "text_encoders" / "qwen25_tokenizer"
    with pytest.raises(FileNotFoundError, match="does not exist") as info:
        qt.load_tokenizer_beside(checkpoint)
    assert str((tmp_path / "text_encoders" / "qwen25_tokenizer").resolve()) in str(info.value)


def test_loads_from_the_folder_beside_a_checkpoint(tmp_path, tokenizer):
    qt.write_tiny_tokenizer(tmp_path / "qwen25_tokenizer")
    loaded = qt.load_tokenizer_beside(tmp_path / "encoder.safetensors")
    assert loaded.encode(SAMPLES[0]) == tokenizer.encode(SAMPLES[0])


def test_a_tokenizer_of_another_family_is_refused(tmp_path, tiny_folder):
    folder = tmp_path / "other"
    folder.mkdir()
    for name in ("vocab.json", "merges.txt"):
        (folder / name).write_bytes((tiny_folder / name).read_bytes())
    config = json.loads((tiny_folder / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"]["151643"]["content"] = "<|begin_of_text|>"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="not a Qwen2/Qwen3 tokenizer"):
        qt.QwenTokenizer.from_folder(folder)

    vocab, merges = qt.train_tiny_vocabulary()
    with pytest.raises(ValueError, match="reserved"):
        qt.QwenTokenizer({**vocab, "zz": 151650}, merges)
    with pytest.raises(ValueError, match="expects 151655"):
        qt.QwenTokenizer({**vocab, "<|image_pad|>": 7}, merges)
    with pytest.raises(ValueError, match="do not belong together"):
        qt.QwenTokenizer({"a": 0, "b": 1}, [("a", "b")])
    (folder / "tokenizer_config.json").unlink()
    (folder / "merges.txt").write_text("#version: 0.2\na b c\n")
    with pytest.raises(ValueError, match="line 2"):
        qt.QwenTokenizer.from_folder(folder)


def test_a_comfyui_style_config_with_only_qwens_tokens_is_accepted(tmp_path, tiny_folder, tokenizer):
    folder = tmp_path / "qwen25_tokenizer"
    folder.mkdir()
    for name in ("vocab.json", "merges.txt"):
        (folder / name).write_bytes((tiny_folder / name).read_bytes())
    config = json.loads((tiny_folder / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"] = {k: v for k, v in config["added_tokens_decoder"].items() if int(k) < 151669}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert qt.QwenTokenizer.from_folder(folder).encode("<|caption_end|>") == [151675]


def test_tiny_tokenizer_is_deterministic(tmp_path):
    first = qt.write_tiny_tokenizer(tmp_path / "a")
    second = qt.write_tiny_tokenizer(tmp_path / "b")
    for name in ("vocab.json", "merges.txt", "tokenizer_config.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
