"""Safetensors loading: detection by keys, config recovery from shapes, prefixes, shape checks, refusals."""
import dataclasses
import functools

import pytest
import torch
from safetensors.torch import save_file

from models.h3 import audio_vae, text_encoder, transformer, video_vae
from models.h3.make_tiny import build_tiny, write_tiny
from models.loading import detect, load_model, read_header

TINY = {"h3_transformer": transformer.TINY_CONFIG, "h3_video_vae": video_vae.TINY_CONFIG,
        "h3_audio_vae": audio_vae.TINY_CONFIG, "h3_text_encoder": text_encoder.TINY_CONFIG}


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("models"))


@functools.lru_cache(maxsize=None)
def _built(kind):
    return {k: v.contiguous() for k, v in build_tiny(kind).state_dict().items()}


def _state(kind):
    return {k: v.clone() for k, v in _built(kind).items()}


@pytest.mark.parametrize("kind,name", [("transformer", "h3_transformer"), ("video_vae", "h3_video_vae"),
                                       ("audio_vae", "h3_audio_vae"), ("text_encoder", "h3_text_encoder")])
def test_config_recovered_from_a_saved_tiny_checkpoint(tiny_files, kind, name):
    loaded = load_model(tiny_files[kind])
    assert loaded.kind == name
    assert dataclasses.asdict(loaded.config) == dataclasses.asdict(TINY[name])
    assert loaded.metadata["weft_random_weights"] == "true"
    ref = _built(kind)
    for key, value in loaded.model.state_dict().items():
        assert torch.equal(value, ref[key]), key


@pytest.mark.parametrize("prefix", ["model.diffusion_model.", "diffusion_model."])
def test_prefixed_transformer_keys(tmp_path, prefix):
    state = _state("transformer")
    path = tmp_path / "prefixed.safetensors"
    save_file({prefix + k: v for k, v in state.items()}, path)
    assert detect(read_header(path)) == ("h3_transformer", prefix)
    loaded = load_model(path, expect="h3_transformer")
    assert dataclasses.asdict(loaded.config) == dataclasses.asdict(transformer.TINY_CONFIG)
    torch.testing.assert_close(loaded.model.blocks[1].mlp.fc2.weight, state["blocks.1.mlp.fc2.weight"])


def test_half_precision_keeps_float32_islands(tmp_path):
    state = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in _state("transformer").items()}
    path = tmp_path / "bf16.safetensors"
    save_file(state, path)
    model = load_model(path).model
    assert model.blocks[0].attn.qkv_proj.weight.dtype == torch.bfloat16
    assert model.video_patch_proj.weight.dtype == torch.float32
    assert model.final_layer.audio_out.weight.dtype == torch.float32
    v, a = model(torch.randn(1, 24, 2, 2, 2), torch.randn(1, 32, 2, 4), torch.randn(1, 3, 48), 0.5, 0.4)
    assert v.dtype == torch.float32 and torch.isfinite(v).all() and torch.isfinite(a).all()


def test_wrong_shape_names_the_key(tmp_path):
    state = _state("transformer")
    state["blocks.1.attn.out_proj.weight"] = torch.zeros(64, 95)
    path = tmp_path / "bad.safetensors"
    save_file({"model.diffusion_model." + k: v for k, v in state.items()}, path)
    with pytest.raises(ValueError, match=r"'model\.diffusion_model\.blocks\.1\.attn\.out_proj\.weight' has shape \[64, 95\], expected \[64, 96\]"):
        load_model(path)


def test_missing_and_unexpected_keys_are_named(tmp_path):
    state = _state("video_vae")
    del state["decoder.transformer_blocks.0.scale2"]
    path = tmp_path / "missing.safetensors"
    save_file(state, path)
    with pytest.raises(ValueError, match="missing 1 tensor.*decoder.transformer_blocks.0.scale2"):
        load_model(path)
    state = _state("audio_vae")
    state["decoder.extra_head.weight"] = torch.zeros(2)
    save_file(state, path)
    with pytest.raises(ValueError, match="unexpected tensor.*decoder.extra_head.weight"):
        load_model(path)


def test_pickle_checkpoints_are_refused(tmp_path):
    zipped = tmp_path / "model.ckpt"
    zipped.write_bytes(b"PK\x03\x04" + b"\x00" * 64)
    with pytest.raises(ValueError, match="pickle / PyTorch checkpoint .*only .safetensors"):
        load_model(zipped)
    raw = tmp_path / "model.pt"
    raw.write_bytes(b"\x80\x04\x95" + b"\x00" * 64)
    with pytest.raises(ValueError, match="pickle stream"):
        load_model(raw)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"hello world, not a model")
    with pytest.raises(ValueError, match="not a safetensors file"):
        load_model(junk)


def test_safetensors_whose_header_length_starts_like_a_pickle_loads(tmp_path):
    # The header length is the file's first 8 bytes: 0x80 (a pickle's first byte) or b"PK" can be its low bytes.
    from models.loading import read_header
    for header_length in (0x180, 0x4B50):
        path = tmp_path / f"padded_{header_length}.safetensors"
        for padding in range(header_length - 200, header_length):  # the metadata adds about its own length
            save_file({"w": torch.zeros(3)}, path, metadata={"pad": "x" * padding})
            if int.from_bytes(path.read_bytes()[:8], "little") == header_length:
                break
        else:
            pytest.fail(f"no padding gave a header of {header_length:#x} bytes")
        assert read_header(path).tensors["w"].shape == (3,)


def test_unknown_architecture_is_refused(tmp_path):
    path = tmp_path / "other.safetensors"
    save_file({"model.embed_tokens.weight": torch.zeros(4, 4), "lm_head.weight": torch.zeros(4, 4)}, path)
    with pytest.raises(ValueError, match="unknown architecture .*lm_head.weight.*supported: H3 transformer"):
        load_model(path)


def test_quantised_weights_are_refused(tmp_path):
    state = _state("transformer")
    state["blocks.0.attn.qkv_proj.weight_scale"] = torch.ones(1)
    path = tmp_path / "int8.safetensors"
    save_file(state, path)
    with pytest.raises(ValueError, match="quantised \\(found key 'blocks.0.attn.qkv_proj.weight_scale'\\)"):
        load_model(path)
    state = _state("transformer")
    state["blocks.0.mlp.fc1.weight"] = state["blocks.0.mlp.fc1.weight"].to(torch.int8)
    save_file(state, path)
    with pytest.raises(ValueError, match="'blocks.0.mlp.fc1.weight' has dtype I8, which is not supported"):
        load_model(path)


def test_float8_weights_are_upcast(tmp_path):
    state = {k: (v.to(torch.float8_e4m3fn) if k.startswith("blocks.") else v) for k, v in _state("transformer").items()}
    path = tmp_path / "fp8.safetensors"
    save_file(state, path)
    model = load_model(path, dtype=torch.float32).model
    assert model.blocks[0].mlp.fc1.weight.dtype == torch.float32


def test_expected_kind_is_enforced(tiny_files):
    with pytest.raises(ValueError, match="is a h3 audio vae checkpoint, but a h3 video vae is needed"):
        load_model(tiny_files["audio_vae"], expect="h3_video_vae")
    assert load_model(tiny_files["audio_vae"], expect=("h3_video_vae", "h3_audio_vae")).kind == "h3_audio_vae"


def test_missing_file(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        load_model(tmp_path / "nope.safetensors")
