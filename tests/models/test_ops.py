"""models/ops.py modules behave like torch.nn, load torch.nn state dicts by name, and take weights via the manager."""
import pytest
import torch
from torch import nn

from models import memory, ops


@pytest.fixture(autouse=True)
def clean_runtime():
    yield
    memory.unconfigure()


CASES = [
    (lambda: nn.Linear(6, 5), lambda: ops.Linear(6, 5), (3, 6)),
    (lambda: nn.Conv1d(4, 6, 3, padding=1), lambda: ops.Conv1d(4, 6, 3, padding=1), (2, 4, 9)),
    (lambda: nn.ConvTranspose1d(4, 3, 4, stride=2, padding=1), lambda: ops.ConvTranspose1d(4, 3, 4, stride=2, padding=1), (2, 4, 7)),
    (lambda: nn.Conv3d(3, 4, 3, padding=1), lambda: ops.Conv3d(3, 4, 3, padding=1), (1, 3, 3, 5, 4)),
    (lambda: nn.GroupNorm(2, 6), lambda: ops.GroupNorm(2, 6), (2, 6, 5)),
    (lambda: nn.LayerNorm(6), lambda: ops.LayerNorm(6), (2, 3, 6)),
    (lambda: nn.LayerNorm(6, elementwise_affine=False), lambda: ops.LayerNorm(6, elementwise_affine=False), (2, 6)),
    (lambda: nn.RMSNorm(6, eps=1e-6), lambda: ops.RMSNorm(6), (2, 3, 6)),
]


@pytest.mark.parametrize("make_reference,make_op,shape", CASES)
@pytest.mark.parametrize("configured", [False, True])
@torch.no_grad()
def test_module_matches_torch_nn_after_loading_its_state_dict(make_reference, make_op, shape, configured):
    torch.manual_seed(0)
    reference, module = make_reference(), make_op()
    for p in reference.parameters():
        p.add_(0.1 * torch.randn_like(p))
    module.load_state_dict(reference.state_dict())  # same key names
    if configured:
        memory.configure(device="cpu", mode="novram")
    x = torch.randn(*shape)
    torch.testing.assert_close(module(x), reference(x), atol=1e-5, rtol=1e-5)
    if configured:
        assert memory.manager().stats().takes >= 1 and memory.manager().stats().resident_bytes == 0


def test_embedding_and_bfloat16_inputs():
    torch.manual_seed(0)
    reference, module = nn.Embedding(10, 4, padding_idx=0), ops.Embedding(10, 4, padding_idx=0)
    module.load_state_dict(reference.state_dict())
    ids = torch.tensor([[0, 3, 9]])
    torch.testing.assert_close(module(ids), reference(ids))
    assert module(ids, dtype=torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="max_norm"):
        ops.Embedding(10, 4, max_norm=1.0)
    layer = ops.Linear(4, 3)
    assert layer(torch.randn(2, 4, dtype=torch.bfloat16)).dtype == torch.bfloat16
    assert layer.weight.dtype == torch.float32


def test_causal_conv3d_module_fuses_norm_and_residual():
    torch.manual_seed(0)
    conv = ops.CausalConv3d(4, 4, 3)
    norm = ops.GroupNorm(2, 4, eps=1e-6)
    x = torch.randn(1, 4, 3, 5, 5)
    with torch.no_grad():
        out = conv(x, norm=norm, silu=True, residual=x)
        h = torch.nn.functional.silu(torch.cat([norm(x[:, :, t]).unsqueeze(2) for t in range(3)], dim=2))
        h = torch.nn.functional.pad(h, (1, 1, 1, 1, 0, 0), mode="reflect")
        h = torch.nn.functional.pad(h, (0, 0, 0, 0, 2, 0))
        expected = torch.nn.functional.conv3d(h, conv.weight, conv.bias) + x
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert set(conv.state_dict()) == {"weight", "bias"}


def test_linear_takes_the_prologue_norm_through_the_manager():
    torch.manual_seed(0)
    norm, layer = ops.RMSNorm(8), ops.Linear(8, 8)
    with torch.no_grad():
        norm.weight.normal_()
    manager = memory.configure(device="cpu", mode="highvram")
    x = torch.randn(2, 8)
    with torch.no_grad():
        fused = layer(x, prologue="rms_norm", prologue_weight=norm, residual=x)
        torch.testing.assert_close(fused, x + layer(norm(x)), atol=1e-5, rtol=1e-5)
    assert set(manager.resident_modules()) == {norm, layer}
