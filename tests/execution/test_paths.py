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


def test_an_absolute_name_is_accepted_only_when_asked_and_only_inside(tmp_path):
    root = tmp_path / "in"
    (root / "a").mkdir(parents=True)
    inside = str(root / "a" / "x.png")
    with pytest.raises(UnsafePathError, match="is absolute"):
        confine(root, inside)
    assert confine(root, inside, absolute_inside=True) == root / "a" / "x.png"
    for name in (str(tmp_path / "x.png"), str(root / ".." / "x.png"), "/etc/passwd"):
        with pytest.raises(UnsafePathError):
            confine(root, name, absolute_inside=True)
    with pytest.raises(UnsafePathError, match="is absolute"):
        confine(root, inside, subfolder="a", absolute_inside=True)  # no subfolder with an absolute name


def test_output_numbering_continues(tmp_path):
    first, name, sub = next_output_name(tmp_path, "run/shot", "png")
    first.write_bytes(b"x")
    second, name2, _ = next_output_name(tmp_path, "run/shot", "png")
    assert (name, name2, sub) == ("shot_00001_.png", "shot_00002_.png", "run")
    with pytest.raises(UnsafePathError):
        next_output_name(tmp_path, "../escape/shot", "png")


@pytest.mark.parametrize("name", ["a\x01b.png", "line\nbreak.png", "tab\there.png", "del\x7f.png", "c1\x85.png",
                                  "sep\u2028.png", "sub\x1b[31m/x.png"])
def test_names_with_control_characters_are_refused(tmp_path, name):
    with pytest.raises(UnsafePathError, match="cannot hold"):
        confine(tmp_path, name)
    with pytest.raises(UnsafePathError, match="cannot hold"):
        confine(tmp_path, "ok.png", subfolder=name)
    with pytest.raises(UnsafePathError, match="cannot hold"):
        next_output_name(tmp_path, name, "png")
    assert confine(tmp_path, "caf\u00e9 \u65e5\u672c.png").name == "caf\u00e9 \u65e5\u672c.png"


def test_staged_outputs_are_numbered_with_the_others_and_appear_only_when_committed(tmp_path):
    from execution.paths import (STAGING_PREFIX, begin_staging, commit_staged, end_staging, find_staged,
                                 settle_staged, staging_token)

    (tmp_path / "shot_00001_.png").write_bytes(b"old")
    token = staging_token("job-1")
    begin_staging(token)
    path, name, _ = next_output_name(tmp_path, "shot", "png")
    assert name == "shot_00002_.png" and path.name == f"{STAGING_PREFIX}{token}-{name}"
    path.write_bytes(b"new")
    second, name2, _ = next_output_name(tmp_path, "shot", "png")  # counts the staged file
    assert name2 == "shot_00003_.png"
    second.write_bytes(b"new")
    assert not (tmp_path / name).exists() and find_staged(tmp_path / name) == path
    commit_staged(end_staging())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shot_00001_.png", "shot_00002_.png", "shot_00003_.png"]
    # Killed before its record: the attempt's files go. Killed after its record: the rename is finished.
    begin_staging(staging_token("cut-short"))
    next_output_name(tmp_path, "shot", "png")[0].write_bytes(b"half")
    end_staging()
    begin_staging(staging_token("recorded"))
    next_output_name(tmp_path, "shot", "png")[0].write_bytes(b"done")
    end_staging()
    assert settle_staged([tmp_path], {staging_token("recorded")}) == {"committed": 1, "removed": 1}
    assert (tmp_path / "shot_00005_.png").read_bytes() == b"done" and not (tmp_path / "shot_00004_.png").exists()
    assert next_output_name(tmp_path, "shot", "png")[1] == "shot_00006_.png"


def test_a_write_cut_short_inside_a_staged_attempt_leaves_no_file(tmp_path):
    """A kill during atomic_write_bytes leaves `.<staged name>.part`; settling removes it whatever the job's fate."""
    from execution.paths import begin_staging, end_staging, settle_staged, staging_token

    for prompt_id in ("cut-short", "recorded"):
        begin_staging(staging_token(prompt_id))
        path = next_output_name(tmp_path, "runs/run", "txt")[0]
        path.parent.mkdir(exist_ok=True)
        path.with_name(f".{path.name}.part").write_bytes(b"half")  # the temporary name atomic_write_bytes uses
        end_staging()
    report = settle_staged([tmp_path], {staging_token("recorded")})
    assert report == {"committed": 0, "removed": 2}
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []


def test_a_staged_file_renamed_while_names_are_listed_still_holds_its_counter(tmp_path, monkeypatch):
    """Another attempt commits its staged out_00001_ (rename to the final name) right after the first
    listing: the counter must not be handed out again, or that file would be overwritten."""
    import pathlib

    from execution.paths import STAGING_PREFIX, staging_token

    staged = tmp_path / f"{STAGING_PREFIX}{staging_token('other job')}-out_00001_.txt"
    staged.write_text("the other job's output")
    listings, original_glob = [], pathlib.Path.glob

    def glob_then_commit(self, pattern, *args, **kwargs):
        found = list(original_glob(self, pattern, *args, **kwargs))
        listings.append(pattern)
        if len(listings) == 1:
            staged.rename(tmp_path / "out_00001_.txt")  # the other attempt commits between the two listings
        return found

    monkeypatch.setattr(pathlib.Path, "glob", glob_then_commit)
    _, name, _ = next_output_name(tmp_path, "out", "txt")
    assert len(listings) == 2 and name == "out_00002_.txt"
