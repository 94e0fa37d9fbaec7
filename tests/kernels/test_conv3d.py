"""The fused causal Conv3d against an unfused torch.nn reference; chunking with context; backends."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kernels.conv3d import CONV3D, causal_conv3d, causal_conv3d_eager


def unfused_reference(x, conv: nn.Conv3d, norm: nn.GroupNorm | None, silu: bool, residual=None):
    """Each step with torch.nn: GroupNorm frame by frame, SiLU, causal zeros in front, reflect in space, conv."""
    batch, channels, frames, height, width = x.shape
    h = x
    if norm is not None:
        per_frame = x.permute(0, 2, 1, 3, 4).reshape(batch * frames, channels, height, width)
        h = norm(per_frame).reshape(batch, frames, channels, height, width).permute(0, 2, 1, 3, 4)
    if silu:
        h = F.silu(h)
    kt, kh, kw = conv.kernel_size
    h = F.pad(h, ((kw - 1) // 2, kw // 2, (kh - 1) // 2, kh // 2, 0, 0), mode="reflect")
    h = torch.cat([torch.zeros_like(h[:, :, :1]).expand(-1, -1, kt - 1, -1, -1), h], dim=2)
    out = conv(h)
    return out if residual is None else out + residual


def make(seed, channels_in, channels_out, kernel, frames, size, stride=1, groups=2, batch=2, dtype=torch.float32):
    torch.manual_seed(seed)
    conv = nn.Conv3d(channels_in, channels_out, kernel, stride=stride)
    norm = nn.GroupNorm(groups, channels_in, eps=1e-6)
    with torch.no_grad():
        norm.weight.normal_(1, 0.2)
        norm.bias.normal_(0, 0.2)
    x = torch.randn(batch, channels_in, frames, *size)
    return x.to(dtype), conv.to(dtype), norm.to(dtype)


@pytest.mark.parametrize("kernel,frames,size,batch", [(3, 5, (6, 7), 2), ((3, 1, 1), 4, (5, 5), 1), ((2, 3, 3), 1, (4, 3), 1)])
@pytest.mark.parametrize("silu,with_norm,with_residual", [(True, True, True), (False, False, False), (True, True, False)])
def test_fused_matches_unfused_reference(kernel, frames, size, batch, silu, with_norm, with_residual):
    x, conv, norm = make(0, 4, 6, kernel, frames, size, batch=batch)
    residual = torch.randn(batch, 6, frames, *size) if with_residual else None
    with torch.no_grad():
        expected = unfused_reference(x, conv, norm if with_norm else None, silu, residual)
        out = causal_conv3d(x, conv.weight, conv.bias, num_groups=2 if with_norm else None,
                            norm_weight=norm.weight if with_norm else None, norm_bias=norm.bias if with_norm else None,
                            silu=silu, residual=residual)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_output_is_causal():
    x, conv, norm = make(1, 4, 4, 3, 6, (5, 5))
    with torch.no_grad():
        base = causal_conv3d(x, conv.weight, conv.bias, num_groups=2, norm_weight=norm.weight, silu=True)
        changed = x.clone()
        changed[:, :, 4:] += 5.0  # future frames change
        out = causal_conv3d(changed, conv.weight, conv.bias, num_groups=2, norm_weight=norm.weight, silu=True)
    torch.testing.assert_close(out[:, :, :4], base[:, :, :4])
    assert not torch.allclose(out[:, :, 4:], base[:, :, 4:])


def test_chunks_with_context_equal_one_pass():
    x, conv, norm = make(2, 4, 6, 3, 9, (6, 6))
    kwargs = dict(num_groups=2, norm_weight=norm.weight, norm_bias=norm.bias, silu=True)
    with torch.no_grad():
        whole = causal_conv3d(x, conv.weight, conv.bias, **kwargs)
        first = causal_conv3d(x[:, :, :1], conv.weight, conv.bias, **kwargs)  # 1 + 4 + 4 frames, as the VAE chunks
        second = causal_conv3d(x[:, :, 1:5], conv.weight, conv.bias, context=x[:, :, :1], **kwargs)
        third = causal_conv3d(x[:, :, 5:], conv.weight, conv.bias, context=x[:, :, :5], **kwargs)
    torch.testing.assert_close(torch.cat([first, second, third], dim=2), whole, atol=1e-5, rtol=1e-5)


def test_temporal_stride_keeps_first_frame_and_shapes():
    x, conv, norm = make(3, 4, 6, 3, 9, (6, 6), stride=(2, 2, 2))
    with torch.no_grad():
        out = causal_conv3d(x, conv.weight, conv.bias, stride=2)
        expected = unfused_reference(x, conv, None, False)
    assert out.shape == (2, 6, 5, 3, 3)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_bfloat16_close_to_float32():
    x, conv, norm = make(4, 4, 6, 3, 3, (5, 6))
    kwargs = dict(num_groups=2, silu=True)
    with torch.no_grad():
        ref = causal_conv3d(x, conv.weight, conv.bias, norm_weight=norm.weight, norm_bias=norm.bias, **kwargs)
        low = causal_conv3d(x.bfloat16(), conv.weight.bfloat16(), conv.bias.bfloat16(), norm_weight=norm.weight.bfloat16(),
                            norm_bias=norm.bias.bfloat16(), **kwargs)
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), ref, atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_on_the_cpu_is_float32_arithmetic_rounded_once(dtype):
    x, conv, norm = make(5, 4, 6, 3, 3, (5, 6), dtype=dtype)
    kwargs = dict(num_groups=2, silu=True, norm_weight=norm.weight, norm_bias=norm.bias)
    with torch.no_grad():
        low = causal_conv3d(x, conv.weight, conv.bias, **kwargs)
        wide = causal_conv3d(x.float(), conv.weight.float(), conv.bias.float(),
                             **{k: (v.float() if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()})
    assert low.dtype == dtype and torch.equal(low, wide.to(dtype))


@pytest.mark.parametrize("stride,dilation", [(1, 1), ((2, 2, 2), 1), (1, (2, 1, 1))])
def test_one_frame_equals_the_three_dimensional_convolution(stride, dilation):
    x, conv, norm = make(6, 4, 6, 3, 1, (7, 6))
    with torch.no_grad():
        out = causal_conv3d(x, conv.weight, conv.bias, stride=stride, dilation=dilation)
        front = (dilation if isinstance(dilation, int) else dilation[0]) * 2
        padded = F.pad(F.pad(x, (1, 1, 1, 1, 0, 0), mode="reflect"), (0, 0, 0, 0, front, 0))
        expected = F.conv3d(padded, conv.weight, conv.bias, stride=stride, dilation=dilation)
    assert out.shape == expected.shape
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", [n for n in CONV3D.names() if n != "eager" and CONV3D.backend(n).unavailable_reason() is None])
def test_backend_parity_with_eager(name):
    # One shape class (the frame count is dynamic, so two frame counts share its compilation).
    for frames, seed in ((5, 0), (3, 1)):
        x, conv, norm = make(seed, 4, 8, 3, frames, (6, 5), batch=1)
        residual = torch.randn(1, 8, frames, 6, 5)
        kwargs = dict(num_groups=2, norm_weight=norm.weight, norm_bias=norm.bias, silu=True, residual=residual)
        with torch.no_grad():
            reason = CONV3D.backend(name).decline_reason(x, conv.weight, conv.bias, **kwargs)
            if reason is not None:
                pytest.skip(f"{name} declines here: {reason}")
            out = CONV3D(x, conv.weight, conv.bias, backend=name, **kwargs)
            expected = causal_conv3d_eager(x, conv.weight, conv.bias, **kwargs)
        torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("change,message", [
    (dict(x=(1, 3, 2, 4, 4)), "channels"),
    (dict(residual=(1, 6, 2, 4, 5)), "residual must have the output's shape"),
    (dict(x=(1, 4, 2, 1, 4)), "reflect padding"),
    (dict(groups=3), "do not split into 3 groups"),
])
def test_bad_arguments_say_what_is_wrong(change, message):
    x = torch.randn(*change.get("x", (1, 4, 2, 4, 4)))
    weight = torch.randn(6, 4, 3, 3, 3)
    residual = torch.randn(*change["residual"]) if "residual" in change else None
    with pytest.raises(ValueError, match=message):
        causal_conv3d(x, weight, num_groups=change.get("groups"), residual=residual)


def test_only_convolutions_large_enough_to_repay_compiling_are_compiled_automatically():
    from kernels import conv3d

    compiled = CONV3D.backend("compiled")
    small = torch.empty(1, 8, 1, 256, 256, device="meta"), torch.empty(8, 8, 3, 3, 3, device="meta")
    assert "too small" in compiled.worthwhile(*small)
    # A decoder layer at a real video's size: 128 channels, 17 frames of 96 x 160.
    large = torch.empty(1, 128, 17, 96, 160, device="meta"), torch.empty(128, 128, 3, 3, 3, device="meta")
    assert compiled.worthwhile(*large) is None
    assert 17 * 96 * 160 * 128 * 128 * 27 >= conv3d.MIN_COMPILE_MACS
