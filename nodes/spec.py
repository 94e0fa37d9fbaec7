"""Builders that declare nodes as data: `Input.int(...)`, `Input.file(...)`, `Output(...)`.

The contract they build (`NodeSpec`, `InputSpec`, `OutputSpec`, the type constants) is owned by
`execution/spec.py`, where the executor consumes it; it is re-exported here so a node pack needs one
import. The `NodeSpec` exported here is the contract's, with what its file inputs imply derived (see
`FileInput`). Classic ComfyUI classes are adapted into a `NodeSpec` by `nodes/classic.py`.
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from execution.spec import NodeSpec as ContractNodeSpec
from execution.spec import (  # noqa: F401 (the contract, re-exported for node packs)
    AUTOGROW, DYNAMIC_COMBO, HIDDEN_VALUES, INPUT_KINDS, UI_OPTION_KEYS, WIDGET_TYPES, InputSpec,
    NodeDefinitionError, OutputSpec, widget_inputs,
)
from nodes import files
from execution.types import (  # noqa: F401 (re-exported for node authors)
    MATCH_TYPE, ExecutionBlocker, NodeOutput, normalize_result, types_compatible,
)


# ---------------------------------------------------------------------- declaration helpers
def _opts(tooltip: str | None, **kw: Any) -> dict[str, Any]:
    out = {k: v for k, v in kw.items() if v is not None}
    if tooltip:
        out["tooltip"] = tooltip
    return out


class Input:
    """Constructors for InputSpec, so node declarations read as data."""

    @staticmethod
    def int(name: str, default: int = 0, *, min: int = -(2**63), max: int = 2**63 - 1, step: int = 1,
            tooltip: str | None = None, optional: bool = False, lazy: bool | None = None,
            force_input: bool | None = None, control_after_generate: bool | None = None,
            display: str | None = None) -> InputSpec:
        return InputSpec(name, "INT", "optional" if optional else "required", _opts(
            tooltip, default=default, min=min, max=max, step=step, lazy=lazy, forceInput=force_input,
            control_after_generate=control_after_generate, display=display))

    @staticmethod
    def float(name: str, default: float = 0.0, *, min: float = -1e18, max: float = 1e18, step: float = 0.01,
              round: float | bool | None = None, tooltip: str | None = None, optional: bool = False,
              lazy: bool | None = None, force_input: bool | None = None) -> InputSpec:
        return InputSpec(name, "FLOAT", "optional" if optional else "required", _opts(
            tooltip, default=default, min=min, max=max, step=step, round=round, lazy=lazy, forceInput=force_input))

    @staticmethod
    def string(name: str, default: str = "", *, multiline: bool = False, tooltip: str | None = None,
               optional: bool = False, lazy: bool | None = None, force_input: bool | None = None,
               dynamic_prompts: bool | None = None, placeholder: str | None = None) -> InputSpec:
        return InputSpec(name, "STRING", "optional" if optional else "required", _opts(
            tooltip, default=default, multiline=multiline or None, lazy=lazy, forceInput=force_input,
            dynamicPrompts=dynamic_prompts, placeholder=placeholder))

    @staticmethod
    def boolean(name: str, default: bool = False, *, tooltip: str | None = None, optional: bool = False,
                lazy: bool | None = None, force_input: bool | None = None, label_on: str | None = None,
                label_off: str | None = None) -> InputSpec:
        return InputSpec(name, "BOOLEAN", "optional" if optional else "required", _opts(
            tooltip, default=default, lazy=lazy, forceInput=force_input, label_on=label_on, label_off=label_off))

    @staticmethod
    def combo(name: str, choices: Sequence[Any] | Callable[[], Sequence[Any]], default: Any = None, *,
              tooltip: str | None = None, optional: bool = False, lazy: bool | None = None,
              image_upload: bool | None = None, control_after_generate: bool | None = None,
              folder: str | Callable[[], str] | None = None,
              missing_hint: Callable[[], str] | None = None) -> InputSpec:
        opts = _opts(tooltip, default=default, lazy=lazy, image_upload=image_upload,
                     control_after_generate=control_after_generate)
        return InputSpec(name, "COMBO", "optional" if optional else "required", opts, choices, folder=folder,
                         missing_hint=missing_hint)

    @staticmethod
    def file(name: str, *, folder: str = "input", extensions: Sequence[str], identity: str = "content",
             upload: str | None = None, label: str | None = None, tooltip: str | None = None) -> "FileInput":
        """A choice of one file in a job folder ("input", "output" or "temp") ending in one of `extensions`.

        `identity` says how a changed file is noticed: "content" hashes its bytes, "stat" compares size and
        modification time. `upload` ("image", "video", "audio") adds the editor's upload button; `label`
        (default: the upload kind, else the input name) is what messages call the file."""
        if folder not in FILE_FOLDERS:
            raise NodeDefinitionError(f"file input '{name}': folder {folder!r} is not one of "
                                      f"{', '.join(FILE_FOLDERS)}")
        if identity not in FILE_IDENTITIES:
            raise NodeDefinitionError(f"file input '{name}': identity {identity!r} is not one of "
                                      f"{', '.join(FILE_IDENTITIES)}")
        if upload is not None and upload not in FILE_UPLOAD_OPTIONS:
            raise NodeDefinitionError(f"file input '{name}': upload {upload!r} is not one of "
                                      f"{', '.join(FILE_UPLOAD_OPTIONS)}")
        suffixes = tuple(extensions)
        options = _opts(tooltip)
        if upload is not None:
            options[FILE_UPLOAD_OPTIONS[upload]] = True
        return FileInput(name, "COMBO", "required", options, choices=lambda: files.list_folder_files(folder, suffixes),
                         folder=lambda: str(files.folder_of(folder)), extensions=suffixes, identity=identity,
                         file_folder=folder, label=label or upload or name)

    @staticmethod
    def link(name: str, type: str, *, tooltip: str | None = None, optional: bool = False,
             lazy: bool | None = None, raw_link: bool | None = None) -> InputSpec:
        return InputSpec(name, type, "optional" if optional else "required",
                         _opts(tooltip, lazy=lazy, rawLink=raw_link))

    @staticmethod
    def hidden(name: str, value: str, *, as_string: bool = False) -> InputSpec:
        """A value the executor supplies; `as_string` when /object_info shows it bare, as for ComfyUI's classic nodes."""
        return InputSpec(name, value, "hidden", hidden_as_string=as_string)

    @staticmethod
    def dynamic_combo(name: str, options: Mapping[str, Sequence[InputSpec]], *, tooltip: str | None = None) -> InputSpec:
        return InputSpec(name, DYNAMIC_COMBO, "required", _opts(tooltip),
                         dynamic_options={k: tuple(v) for k, v in options.items()})

    @staticmethod
    def autogrow(name: str, template: InputSpec, *, prefix: str = "", names: Sequence[str] = (), min: int = 0,
                 max: int = 50, tooltip: str | None = None) -> InputSpec:
        if names:
            max = len(names)
        return InputSpec(name, AUTOGROW, "optional" if min == 0 else "required", _opts(tooltip),
                         template=template, prefix=prefix, grow_min=min, grow_max=max, names=tuple(names))

    @staticmethod
    def match_type(name: str, template_id: str = "T", *, allowed: str = "*", tooltip: str | None = None,
                   optional: bool = False, lazy: bool | None = None) -> InputSpec:
        opts = _opts(tooltip, lazy=lazy)
        opts["template"] = {"template_id": template_id, "allowed_types": allowed}
        return InputSpec(name, MATCH_TYPE, "optional" if optional else "required", opts)


def Output(type: str, name: str = "", *, is_list: bool = False, tooltip: str | None = None,
           match_type: str | None = None) -> OutputSpec:
    """Declare an output."""
    return OutputSpec(type, name, is_list, tooltip, match_type)


# ---------------------------------------------------------------------- file inputs
FILE_FOLDERS = ("input", "output", "temp")
FILE_IDENTITIES = ("content", "stat")
FILE_UPLOAD_OPTIONS = {"image": "image_upload", "video": "video_upload", "audio": "audio_upload"}


@dataclass(frozen=True)
class FileInput(InputSpec):
    """A widget choosing one file of a job folder, with what a loader needs to know about that file.

    A `NodeSpec` with file inputs derives three things from them: its fingerprint (each file's version:
    a hash of its bytes for identity "content", its size and modification time for "stat", meant for
    files too large to hash on every run), validation that each named file exists inside its folder,
    and the not-found error when a file is gone by the time the node runs. `execute` receives the
    file's resolved `Path` in place of its name.
    """

    extensions: tuple[str, ...] = ()
    identity: str = "content"
    file_folder: str = "input"
    label: str = ""  # what the file holds, as messages name it: "image file 'x.png' not found"

    def path(self, name: Any) -> Path:
        """The confined path `name` stands for; the editor's ' [output]'-style suffixes are honoured."""
        return files.annotated_path(name, default_kind=self.file_folder)

    def problem(self, node_id: str, name: Any) -> str | None:
        """Why the file `name` cannot be loaded (a name leaving its folder, a missing file), or None."""
        verdict = files.check_input_file(node_id, self.label, name, default_kind=self.file_folder)
        return None if verdict is True else verdict

    def existing(self, node_id: str, name: Any) -> Path:
        """The path of `name`; a FileNotFoundError naming the node, the file and the folder looked in if absent."""
        path = self.path(name)
        if not path.is_file():
            folder = files.annotated_folder(name, default_kind=self.file_folder)
            raise FileNotFoundError(f"{node_id}: {self.label} file {name!r} not found (searched folder: {folder})")
        return path

    def version(self, name: Any) -> str:
        """What changes when the file does: its content hash, or its size and modification time."""
        path = self.path(name)
        if self.identity == "stat":
            stat = path.stat()
            return f"{stat.st_size}:{stat.st_mtime_ns}"
        return files.file_sha256(path)


class NodeSpec(ContractNodeSpec):
    """The contract's `NodeSpec`, with the fingerprint, validation and paths its `FileInput`s imply.

    A node with file inputs declares no fingerprint (the files' versions are its fingerprint); a
    validator it declares runs once the files are found.
    """

    def __post_init__(self):
        file_inputs = tuple(spec for spec in self.inputs if isinstance(spec, FileInput))
        if file_inputs:
            self._derive_from_files(file_inputs)
        super().__post_init__()

    def _derive_from_files(self, file_inputs: tuple[FileInput, ...]) -> None:
        node_id = self.node_id
        if self.fingerprint is not None and not getattr(self.fingerprint, "from_file_inputs", False):
            raise NodeDefinitionError(f"node '{node_id}': fingerprint: its file inputs "
                                      f"({', '.join(i.name for i in file_inputs)}) state it; declare none")

        def fingerprint(**values: Any) -> Any:
            versions = tuple(spec.version(values.get(spec.name)) for spec in file_inputs)
            return versions[0] if len(versions) == 1 else versions

        declared_check = getattr(self.validate_inputs, "declared_check", self.validate_inputs)

        def validate_inputs(**values: Any) -> Any:
            for spec in file_inputs:
                if values.get(spec.name) is None:  # linked: the value is known only when the node runs
                    continue
                problem = spec.problem(node_id, values[spec.name])
                if problem:
                    return problem
            return declared_check(**values) if declared_check is not None else True

        declared_execute = getattr(self.execute, "declared_execute", self.execute)

        def with_paths(values: dict[str, Any]) -> dict[str, Any]:
            for spec in file_inputs:
                if values.get(spec.name) is not None:
                    values[spec.name] = spec.existing(node_id, values[spec.name])
            return values

        if inspect.iscoroutinefunction(declared_execute):
            @functools.wraps(declared_execute)
            async def execute(*args: Any, **values: Any) -> Any:
                return await declared_execute(*args, **with_paths(values))
        else:
            @functools.wraps(declared_execute)
            def execute(*args: Any, **values: Any) -> Any:
                return declared_execute(*args, **with_paths(values))

        fingerprint.from_file_inputs = True
        validate_inputs.declared_check = declared_check
        execute.declared_execute = declared_execute
        self.fingerprint = fingerprint
        self.validate_inputs = validate_inputs
        self.validate_takes = frozenset(self.validate_takes) | {spec.name for spec in file_inputs}
        self.execute = execute
