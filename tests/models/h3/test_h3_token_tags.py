"""Per-token modality tags of the text rows: the Qwen3-VL encoder tags its picture and video tokens as
video, and the transformer modulates those rows as video rows."""
from __future__ import annotations

import pytest
import torch

from models.h3 import packing, transformer
from models.h3.make_tiny import _init_weights


def test_text_rows_take_the_given_tags():
    tags = torch.tensor([1, 0, 0, 0, 1])
    layout = packing.build_layout(5, 2, 2, 2, 3, text_tags=tags)
    _, row_tags = packing.row_timesteps(layout, 0.7, 0.5)
    text = layout.segment(packing.SegmentRole.TEXT)
    assert torch.equal(row_tags[text.start:text.stop], tags)
    untagged = packing.row_timesteps(packing.build_layout(5, 2, 2, 2, 3), 0.7, 0.5)[1]
    assert bool((untagged[text.start:text.stop] == packing.TAG_TEXT).all())
    assert torch.equal(row_tags[text.stop:], untagged[text.stop:])


@pytest.mark.parametrize("tags, problem", [(torch.tensor([1, 0]), "2 token tags for 5 text rows"),
                                           (torch.tensor([1, 2, 1, 1, 1]), "token tags must be")])
def test_bad_tags_are_refused(tags, problem):
    with pytest.raises(ValueError, match=problem):
        packing.build_layout(5, 2, 2, 2, 3, text_tags=tags)


def test_transformer_modulates_vision_tokens_as_video():
    model = transformer.H3Transformer(transformer.TINY_CONFIG)
    _init_weights(model, 7)
    gen = torch.Generator().manual_seed(8)
    cfg = transformer.TINY_CONFIG
    video = torch.randn(1, cfg.video_channels, 2, 4, 4, generator=gen)
    audio = torch.randn(1, cfg.audio_channels, 2, 3, generator=gen)
    context = torch.randn(1, 6, cfg.text_dim, generator=gen)
    mask = torch.tensor([[True, True, True, True, True, False]])
    run = lambda tags: model(video, audio, context, 0.6, 0.4, context_mask=mask, context_tags=tags)  # noqa: E731
    plain = run(None)
    all_text = run(torch.ones(1, 6, dtype=torch.long))
    with_vision = run(torch.tensor([[1, 0, 0, 0, 1, 1]]))
    for a, b in zip(plain, all_text):
        assert torch.equal(a, b)
    assert not torch.allclose(plain[0], with_vision[0])
