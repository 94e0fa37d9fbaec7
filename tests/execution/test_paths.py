"""The one file-name confinement function, named after what it guards against."""
from __future__ import annotations

import os

import pytest

from execution.paths import UnsafePathError, confine, next_output_name


@pytest.mark.parametrize("name", [
    "../secret", "a/../../secret", "/etc/passwd", "\\\\server\\share", "C:evil", "a\\..\\b", "ok\x00.png", "..",
    "sub/../../x",
])
def test_path_traversal_is_refused(tmp_path, name):
    with pytest.raises(UnsafePathError):
        confine(tmp_path, name)


def test_symlink_out_of_the_folder_is_refused(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    outside = tmp_path / "outside.txt"
    outside.write_text("canary")
    os.symlink(outside, root / "link.txt")
    with pytest.raises(UnsafePathError):
        confine(root, "link.txt")


def test_names_inside_resolve(tmp_path):
    assert confine(tmp_path, "a/b.png") == (tmp_path / "a" / "b.png").resolve()
    assert confine(tmp_path, "b.png", subfolder="x") == (tmp_path / "x" / "b.png").resolve()


def test_output_numbering_continues(tmp_path):
    first, name, sub = next_output_name(tmp_path, "run/shot", "png")
    first.write_bytes(b"x")
    second, name2, _ = next_output_name(tmp_path, "run/shot", "png")
    assert (name, name2, sub) == ("shot_00001_.png", "shot_00002_.png", "run")
    with pytest.raises(UnsafePathError):
        next_output_name(tmp_path, "../escape/shot", "png")
