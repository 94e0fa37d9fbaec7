"""The 2-D convolution's backends against F.conv2d, and which one a call gets."""
import pytest
import torch
import torch.nn.functional as F

from kernels.conv2d import CONV2D, NATIVE_MAX_MACS, conv2d


@pytest.mark.parametrize("batch,c_in,c_out,kernel,padding,size,with_bias", [
    (4, 16, 8, 3, 1, (4, 6), True), (1, 8, 12, 3, 1, (32, 48), True), (3, 8, 16, 1, 0, (5, 7), False),
    (2, 5, 3, 3, 0, (6, 9), False)])
def test_native_matches_the_reference(batch, c_in, c_out, kernel, padding, size, with_bias):
    generator = torch.Generator().manual_seed(batch * c_in + kernel)
    x = torch.randn(batch, c_in, *size, generator=generator)
    weight = torch.randn(c_out, c_in, kernel, kernel, generator=generator)
    bias = torch.randn(c_out, generator=generator) if with_bias else None
    native = conv2d(x, weight, bias, padding=padding, backend="native")
    torch.testing.assert_close(native, F.conv2d(x, weight, bias, padding=padding), atol=1e-5, rtol=1e-5)


def test_small_cpu_calls_go_native_large_ones_and_other_dtypes_to_the_reference():
    small = torch.randn(4, 16, 4, 6), torch.randn(8, 16, 3, 3)
    conv2d(*small, padding=1)
    assert CONV2D.last_backend == "native"
    side = 64  # 64 x 64 pixels x 64 x 64 channels x 9 taps: above the native kernel's limit
    assert side ** 4 * 9 > NATIVE_MAX_MACS
    conv2d(torch.randn(1, side, side, side), torch.randn(side, side, 3, 3), padding=1)
    assert CONV2D.last_backend == "eager"
    conv2d(small[0].double(), small[1].double(), padding=1)
    assert CONV2D.last_backend == "eager"
    with pytest.raises(ValueError, match="backend 'native'.*float32"):
        conv2d(small[0].double(), small[1].double(), padding=1, backend="native")


def test_an_input_that_does_not_fit_the_weight_is_refused():
    with pytest.raises(ValueError, match=r"input \(4, 15, 4, 6\) does not fit weight \(8, 16, 3, 3\)"):
        conv2d(torch.randn(4, 15, 4, 6), torch.randn(8, 16, 3, 3), padding=1)
