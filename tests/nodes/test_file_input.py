"""Input.file: one declaration from which a node's fingerprint, validation and not-found error follow."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from nodes.spec import FileInput, Input, NodeDefinitionError, NodeSpec, Output


def _reader(page: Path, copies: int = 1) -> tuple[str]:
    return (page.read_text() * copies,)


def _spec(identity: str = "content", **extra) -> NodeSpec:
    return NodeSpec("ReadPage", _reader, inputs=[Input.file("page", extensions=(".txt",), identity=identity),
                                                 Input.int("copies", 1)],
                    outputs=[Output("STRING")], **extra)


def test_choices_list_the_folder_files_with_the_extensions(ctx):
    (ctx.paths.input / "a.txt").write_text("a")
    (ctx.paths.input / "b.md").write_text("b")
    (ctx.paths.input / "sub").mkdir()
    (ctx.paths.input / "sub" / "c.txt").write_text("c")
    spec = _spec()
    assert isinstance(spec.input("page"), FileInput)
    assert spec.input("page").choice_list() == ["a.txt", "sub/c.txt"]
    assert spec.input("page").searched_folder() == str(ctx.paths.input)


def test_execute_gets_the_path_and_a_missing_file_names_node_and_folder(ctx):
    (ctx.paths.input / "a.txt").write_text("hi ")
    spec = _spec()
    assert spec.execute(page="a.txt", copies=2) == ("hi hi ",)
    with pytest.raises(FileNotFoundError, match=r"ReadPage: page file 'gone.txt' not found \(searched folder: "):
        spec.execute(page="gone.txt", copies=1)


def test_validation_is_derived_and_a_linked_value_waits_for_the_run(ctx):
    (ctx.paths.input / "a.txt").write_text("x")
    spec = _spec()
    assert spec.validate_takes == frozenset({"page"})
    assert spec.validate_inputs(page="a.txt", copies=1) is True
    assert spec.validate_inputs(page=None, copies=1) is True
    message = spec.validate_inputs(page="nope.txt", copies=1)
    assert "ReadPage" in message and "nope.txt" in message and str(ctx.paths.input) in message
    assert "invalid page file" in spec.validate_inputs(page="../a.txt", copies=1)


def test_a_declared_validator_runs_after_the_files_are_found(ctx):
    (ctx.paths.input / "a.txt").write_text("x")
    spec = _spec(validate_inputs=lambda copies=1, **_: True if copies < 5 else "too many copies")
    assert spec.validate_inputs(page="a.txt", copies=9) == "too many copies"
    assert "not found" in spec.validate_inputs(page="b.txt", copies=9)


@pytest.mark.parametrize("identity", ["content", "stat"])
def test_fingerprint_follows_the_file(ctx, identity):
    path = ctx.paths.input / "a.txt"
    path.write_text("one")
    spec = _spec(identity)
    first = spec.fingerprint(page="a.txt", copies=1)
    assert spec.fingerprint(page="a.txt", copies=3) == first  # only the file counts
    path.write_text("two, longer")
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 1_000_000))
    assert spec.fingerprint(page="a.txt", copies=1) != first


def test_declarations_are_checked():
    with pytest.raises(NodeDefinitionError, match="fingerprint"):
        _spec(fingerprint=lambda **_: 1)
    with pytest.raises(NodeDefinitionError, match="identity 'mtime'"):
        Input.file("page", extensions=(".txt",), identity="mtime")
    with pytest.raises(NodeDefinitionError, match="folder 'models'"):
        Input.file("page", extensions=(".txt",), folder="models")
    with pytest.raises(NodeDefinitionError, match="upload 'text'"):
        Input.file("page", extensions=(".txt",), upload="text")
    assert Input.file("clip", extensions=(".mp4",), upload="video").options == {"video_upload": True}


def test_other_folders_and_the_editor_suffix(ctx):
    (ctx.paths.output / "made.txt").write_text("out")
    spec = NodeSpec("ReadOutput", _reader, inputs=[Input.file("page", folder="output", extensions=(".txt",))],
                    outputs=[Output("STRING")])
    assert spec.input("page").choice_list() == ["made.txt"]
    assert spec.execute(page="made.txt") == ("out",)
    (ctx.paths.input / "in.txt").write_text("in")
    assert spec.execute(page="in.txt [input]") == ("in",)
