"""ComfyUI's V3 `ui` helpers: what a node shows in the editor, returned as `NodeOutput(ui=...)`.

Previews are written to the running job's temp folder (saves to its output folder) with Weft's own
PNG and FLAC writers and file naming, so they read back like the built-in Preview Image and Preview
Audio nodes' files. A helper given the node class (`cls=cls`) stores the run's prompt and workflow in
the file when the node asked for those hidden values. Every sound written gets the sound check of the
built-in nodes (`nodes.audio_health`); its entries travel with the written files and join the UI output.
"""
from __future__ import annotations

from typing import Any

import torch

from execution.paths import atomic_write_bytes
from execution.types import AUDIO_HEALTH_KEY
from media.audio import check_audio, write_flac
from media.image import check_image, encode_png
from nodes.audio_health import checked_sound
from nodes.files import file_metadata, output_target, temp_prefix

from ._io import FolderType, _UIOutput

PREVIEW_COMPRESS_LEVEL = 1  # a preview is thrown away: favour speed over size


class SavedResult(dict):
    """One written file as the editor finds it: {"filename", "subfolder", "type"}. A sound file also
    carries its sound check (`health`, outside the dict, so the editor's entry keeps its three keys)."""

    def __init__(self, filename: str, subfolder: str, type: FolderType | str, *, health: dict | None = None) -> None:
        super().__init__(filename=filename, subfolder=subfolder, type=FolderType(type).value)
        self.health = health

    @property
    def filename(self) -> str:
        """The file's name inside its folder."""
        return self["filename"]

    @property
    def subfolder(self) -> str:
        """The subfolder of the job folder ("" for none)."""
        return self["subfolder"]

    @property
    def type(self) -> FolderType:
        """The job folder holding the file."""
        return FolderType(self["type"])


def _metadata(cls: Any) -> dict[str, Any]:
    hidden = getattr(cls, "hidden", None) if cls is not None else None
    if hidden is None:
        return {}
    return file_metadata(hidden.prompt, hidden.extra_pnginfo)


def _label(cls: Any, helper: str) -> str:
    return getattr(cls, "__name__", None) or helper


def _with_health(shown: dict, results: list) -> dict:
    checks = [result.health for result in results if getattr(result, "health", None) is not None]
    if checks:
        shown[AUDIO_HEALTH_KEY] = checks
    return shown


class ImageSaveHelper:
    """Writing IMAGE batches as numbered PNG files."""

    @staticmethod
    def save_images(images: torch.Tensor, filename_prefix: str, folder_type: FolderType, cls: Any = None,
                    compress_level: int = 4) -> list[SavedResult]:
        """One PNG per frame in the folder `folder_type`; %batch_num% in the prefix becomes the frame index."""
        images = check_image(_label(cls, "ImageSaveHelper"), images, "images")
        kind = FolderType(folder_type).value
        metadata = _metadata(cls)
        written = []
        for index, frame in enumerate(images):
            path, filename, subfolder = output_target(
                kind, filename_prefix.replace("%batch_num%", str(index)), "png",
                width=int(frame.shape[1]), height=int(frame.shape[0]))
            atomic_write_bytes(path, encode_png(frame, compress_level=compress_level, metadata=metadata))
            written.append(SavedResult(filename, subfolder, kind))
        return written

    @staticmethod
    def get_save_images_ui(images: torch.Tensor, filename_prefix: str, cls: Any = None,
                           compress_level: int = 4) -> "SavedImages":
        """Save to the output folder and describe the files for the editor."""
        return SavedImages(ImageSaveHelper.save_images(images, filename_prefix, FolderType.output, cls,
                                                       compress_level))


class AudioSaveHelper:
    """Writing AUDIO batches as numbered FLAC files (the one audio format Weft writes)."""

    @staticmethod
    def save_audio(audio: dict, filename_prefix: str, folder_type: FolderType, cls: Any = None,
                   format: str = "flac", quality: str = "128k") -> list[SavedResult]:
        """One FLAC per clip of the batch in the folder `folder_type`."""
        if format != "flac":
            raise ValueError(f"{_label(cls, 'AudioSaveHelper')}: Weft writes audio as flac only, not {format!r}")
        audio = check_audio(_label(cls, "AudioSaveHelper"), audio)
        kind = FolderType(folder_type).value
        metadata = _metadata(cls)
        written = []
        for clip in audio["waveform"]:
            path, filename, subfolder = output_target(kind, filename_prefix, "flac")
            write_flac(path, clip, int(audio["sample_rate"]), metadata=metadata)
            health = checked_sound(_label(cls, "AudioSaveHelper"), clip, int(audio["sample_rate"]),
                                   what=f"{subfolder}/{filename}" if subfolder else filename)
            written.append(SavedResult(filename, subfolder, kind, health=health))
        return written

    @staticmethod
    def get_save_audio_ui(audio: dict, filename_prefix: str, cls: Any = None, format: str = "flac",
                          quality: str = "128k") -> "SavedAudios":
        """Save to the output folder and describe the files for the editor."""
        return SavedAudios(AudioSaveHelper.save_audio(audio, filename_prefix, FolderType.output, cls, format,
                                                      quality))


class SavedImages(_UIOutput):
    """Images already written, shown on the node."""

    def __init__(self, results: list[SavedResult], is_animated: bool = False) -> None:
        self.results = list(results)
        self.is_animated = is_animated

    def as_dict(self) -> dict:
        shown: dict[str, Any] = {"images": self.results}
        if self.is_animated:
            shown["animated"] = (True,)
        return shown


class SavedAudios(_UIOutput):
    """Sound files already written, played on the node."""

    def __init__(self, results: list[SavedResult]) -> None:
        self.results = list(results)

    def as_dict(self) -> dict:
        return _with_health({"audio": self.results}, self.results)


class PreviewImage(_UIOutput):
    """Write an IMAGE batch to the temp folder and show it on the node."""

    def __init__(self, image: torch.Tensor, animated: bool = False, cls: Any = None, **_unused: Any) -> None:
        self.values = ImageSaveHelper.save_images(image, temp_prefix(), FolderType.temp, cls,
                                                  PREVIEW_COMPRESS_LEVEL)
        self.animated = animated

    def as_dict(self) -> dict:
        return {"images": self.values, "animated": (self.animated,)}


class PreviewMask(PreviewImage):
    """Show a MASK batch as grey pictures."""

    def __init__(self, mask: torch.Tensor, animated: bool = False, cls: Any = None, **unused: Any) -> None:
        grey = mask.reshape(-1, mask.shape[-2], mask.shape[-1]).unsqueeze(-1).expand(-1, -1, -1, 3)
        super().__init__(grey, animated, cls, **unused)


class PreviewAudio(_UIOutput):
    """Write an AUDIO batch to the temp folder and play it on the node."""

    def __init__(self, audio: dict, cls: Any = None, **_unused: Any) -> None:
        self.values = AudioSaveHelper.save_audio(audio, temp_prefix(), FolderType.temp, cls)

    def as_dict(self) -> dict:
        return _with_health({"audio": self.values}, self.values)


class PreviewVideo(_UIOutput):
    """Show video files already written (SavedResult entries) on the node."""

    def __init__(self, values: list, **_unused: Any) -> None:
        self.values = list(values)

    def as_dict(self) -> dict:
        return {"images": self.values, "animated": (True,)}


class PreviewText(_UIOutput):
    """Show a text on the node."""

    def __init__(self, value: str, **_unused: Any) -> None:
        self.value = value

    def as_dict(self) -> dict:
        return {"text": (self.value,)}


__all__ = [
    "SavedResult", "SavedImages", "SavedAudios", "ImageSaveHelper", "AudioSaveHelper", "PreviewImage",
    "PreviewMask", "PreviewAudio", "PreviewVideo", "PreviewText",
]
