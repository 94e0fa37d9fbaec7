"""media.image: the one center crop and resize, shared by the image nodes and the comfy.utils shim."""
from __future__ import annotations

import pytest
import torch

from media.image import center_crop, resize_planes, scale_images


def test_center_crop_trims_the_long_side_equally():
    planes = torch.arange(4 * 10, dtype=torch.float32).reshape(1, 1, 4, 10)
    wide = center_crop(planes, 4, 4)  # 10 wide to 4:4 -> 4 wide, 3 columns off each side
    assert wide.shape == (1, 1, 4, 4) and torch.equal(wide, planes[..., 3:7])
    tall = center_crop(planes.transpose(-1, -2), 4, 4)
    assert tall.shape == (1, 1, 4, 4) and torch.equal(tall, planes.transpose(-1, -2)[..., 3:7, :])
    assert center_crop(planes, 20, 8) is planes  # same aspect: untouched


def test_scale_images_and_common_upscale_share_crop_and_resize():
    from nodes.compat.comfy import utils

    image = torch.rand(2, 12, 30, 3, generator=torch.Generator().manual_seed(0))
    for method in ("nearest-exact", "bilinear", "area", "bicubic", "lanczos"):
        ours = scale_images(image, 16, 16, method, "center")
        shim = utils.common_upscale(image.movedim(-1, 1), 16, 16, method, "center").movedim(1, -1)
        torch.testing.assert_close(ours, shim.clamp(0, 1))
    with pytest.raises(ValueError, match="unknown upscale method 'sinc'"):
        resize_planes(image.movedim(-1, 1), 4, 4, "sinc")
