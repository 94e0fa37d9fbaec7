"""The core utility nodes (nodes/utility.py): what each computes, and that each is declared with the node id,
inputs and outputs the official templates use; the count of official templates each appears in is what the
editor note reports."""
from __future__ import annotations

import json

import pytest
import torch

from execution import templates
from nodes import utility

SPECS = {spec.node_id: spec for spec in utility.NODES}


def run(node_id, **kwargs):
    return SPECS[node_id].execute(**kwargs)


def test_strings():
    assert run("StringConcatenate", string_a="a red", string_b="fox", delimiter=" ") == ("a red fox",)
    assert run("StringReplace", string="a.b.c", find=".", replace="/") == ("a/b/c",)
    assert run("RegexReplace", string="Cat cat CAT", regex_pattern="cat", replace="dog") == ("dog dog dog",)
    assert run("RegexReplace", string="Cat cat", regex_pattern="cat", replace="dog", case_insensitive=False) == \
        ("Cat dog",)
    assert run("RegexReplace", string="x1 x2 x3", regex_pattern=r"x(\d)", replace=r"<\1>", count=2) == \
        ("<1> <2> x3",)
    assert run("RegexReplace", string="a\nb", regex_pattern="^b", replace="B", multiline=True) == ("a\nB",)
    assert run("RegexReplace", string="a\nb", regex_pattern="a.b", replace="-", dotall=True) == ("-",)
    with pytest.raises(ValueError, match="RegexReplace: regex_pattern '\\(' is not a valid"):
        run("RegexReplace", string="x", regex_pattern="(", replace="")


def test_image_scale_by_and_masks():
    image = torch.rand(2, 10, 20, 3)
    (scaled,) = run("ImageScaleBy", image=image, upscale_method="area", scale_by=0.5)
    assert scaled.shape == (2, 5, 10, 3)
    torch.testing.assert_close(scaled, image.view(2, 5, 2, 10, 2, 3).mean(dim=(2, 4)))  # each 2x2 block's mean
    assert run("ImageScaleBy", image=image, upscale_method="bilinear", scale_by=1.55)[0].shape == (2, 16, 31, 3)
    rgba = torch.rand(1, 4, 4, 4)
    (green,) = run("ImageToMask", image=rgba, channel="green")
    assert torch.equal(green, rgba[..., 1])
    with pytest.raises(ValueError, match="no alpha channel"):
        run("ImageToMask", image=image, channel="alpha")
    (inverted,) = run("InvertMask", mask=green)
    torch.testing.assert_close(inverted, 1.0 - green)
    # JoinImageWithAlpha: opacity is 1 - mask; a mask of another size is resized to the picture.
    mask = torch.zeros(1, 2, 4)
    mask[:, :, 2:] = 1.0  # right half transparent
    (joined,) = run("JoinImageWithAlpha", image=torch.rand(1, 4, 8, 3), alpha=mask)
    assert joined.shape == (1, 4, 8, 4)
    assert joined[0, :, 0, 3].eq(1.0).all() and joined[0, :, -1, 3].eq(0.0).all()


def _templates_using(node_id: str) -> list[str]:
    used = []
    for name in templates.official_names():
        text = templates.official_text(name) or ""
        if f'"type": "{node_id}"' in text or f'"type":"{node_id}"' in text:
            workflow = json.loads(text)
            graphs = [workflow, *((workflow.get("definitions") or {}).get("subgraphs") or [])]
            if any(n.get("type") == node_id for g in graphs for n in g.get("nodes") or []):
                used.append(name)
    return used


@pytest.mark.parametrize("node_id", sorted(SPECS))
def test_each_is_used_by_at_least_three_official_templates_with_the_inputs_they_save(node_id):
    """The templates' saved nodes name the same inputs (their `inputs` entries with a widget)."""
    used = _templates_using(node_id)
    assert len(used) >= 3, used
    declared = {inp.name for inp in SPECS[node_id].inputs}
    for name in used:
        workflow = json.loads(templates.official_text(name))
        graphs = [workflow, *((workflow.get("definitions") or {}).get("subgraphs") or [])]
        for node in (n for g in graphs for n in g.get("nodes") or [] if n.get("type") == node_id):
            saved = {i["name"] for i in node.get("inputs") or [] if isinstance(i, dict) and i.get("name")}
            assert saved <= declared, (name, saved - declared)
