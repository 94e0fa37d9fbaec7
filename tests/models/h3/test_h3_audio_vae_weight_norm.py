"""The H3 audio VAE loads the original weight-normalised format (`weight_g` / `weight_v`).

The original checkpoint keeps its convolutions weight-normalised (encoder and vocoder convs, the
transposed upsamplers), while the converted release stores plain weights. The expected plain weights
here come from torch's own weight norm (torch.nn.utils), not from Weft's folding.
"""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from models.h3.make_tiny import build_tiny
from models.loading import load_model


def weight_normalised_layers(model: nn.Module) -> list[str]:
    """Names of the convolutions the original audio VAE keeps weight-normalised."""
    return [name for name, m in model.named_modules()
            if isinstance(m, (nn.Conv1d, nn.ConvTranspose1d)) and name.startswith(("encoder.", "decoder."))]


def original_format(model: nn.Module, spelling: str, seed: int = 0) -> tuple[dict, dict]:
    """(file tensors with gain/direction pairs, the plain weights torch's weight norm makes of them)."""
    gen = torch.Generator().manual_seed(seed)
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    plain = {}
    for name in weight_normalised_layers(model):
        layer = model.get_submodule(name)
        base = nn.ConvTranspose1d if isinstance(layer, nn.ConvTranspose1d) else nn.Conv1d
        conv = base(layer.in_channels, layer.out_channels, layer.kernel_size, bias=layer.bias is not None)
        with torch.no_grad():
            conv.weight.copy_(state[name + ".weight"])
        if spelling == "weight_g":
            conv = torch.nn.utils.weight_norm(conv)        # dim 0, as the original training code used
            gain, direction = conv.weight_g, conv.weight_v
            keys = (name + ".weight_g", name + ".weight_v")
        else:
            conv = torch.nn.utils.parametrizations.weight_norm(conv)
            gain = conv.parametrizations.weight.original0
            direction = conv.parametrizations.weight.original1
            keys = (name + ".parametrizations.weight.original0", name + ".parametrizations.weight.original1")
        with torch.no_grad():
            # Gains and directions unlike the plain weight's own decomposition, so nothing folds back by accident.
            gain.copy_(0.5 + torch.rand(gain.shape, generator=gen))
            direction.copy_(torch.randn(direction.shape, generator=gen))
        if spelling == "weight_g":
            conv(torch.zeros(1, conv.in_channels, 16))     # the pre-hook computes .weight from g and v
        plain[name + ".weight"] = conv.weight.detach().clone()
        del state[name + ".weight"]
        state[keys[0]] = gain.detach().clone().contiguous()
        state[keys[1]] = direction.detach().clone().contiguous()
    return state, plain


@pytest.mark.parametrize("spelling", ["weight_g", "parametrizations"])
def test_original_weight_norm_format_loads_folded(tmp_path, spelling):
    model = build_tiny("audio_vae")
    state, plain = original_format(model, spelling)
    layers = weight_normalised_layers(model)
    assert any(".ups." in n for n in layers) and any(n.startswith("encoder.") for n in layers)
    path = tmp_path / "minimax_h3_audio_vae_fp32.safetensors"
    save_file(state, str(path))
    loaded = load_model(path, expect="h3_audio_vae").model
    got = loaded.state_dict()
    for key, want in plain.items():
        torch.testing.assert_close(got[key], want, rtol=1e-6, atol=1e-7, msg=key)

    # The same model with torch's plain weights decodes and encodes identically.
    reference = build_tiny("audio_vae")
    reference.load_state_dict({**reference.state_dict(), **plain})
    z = torch.randn(1, 32, 2, 6, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(loaded.decode(z), reference.decode(z), rtol=1e-4, atol=1e-4)
    wave = 0.3 * torch.randn(1, 2, 4000, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(loaded.encode(wave), reference.encode(wave), rtol=1e-4, atol=1e-4)


def test_a_gain_without_its_direction_is_refused(tmp_path):
    model = build_tiny("audio_vae")
    state, _ = original_format(model, "weight_g")
    name = weight_normalised_layers(model)[0]
    del state[name + ".weight_v"]
    path = tmp_path / "broken.safetensors"
    save_file(state, str(path))
    with pytest.raises(ValueError, match=rf"{name}.*without its direction"):
        load_model(path)
