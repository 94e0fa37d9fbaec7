"""ComfyUI's `comfy.comfy_types.node_typing` for node packs: the names classic nodes are typed with.

Pure typing, with one behaviour that matters at run time: an `IO` member compares unequal (`!=`) to a
type only when neither names a type the other accepts (`*` accepts everything; "FLOAT,INT" accepts
"INT"), which is how Weft's link check reads a pack's type strings.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from enum import Enum
from typing import Any, Literal, TypedDict

from typing_extensions import NotRequired


class StrEnum(str, Enum):
    """A string enum whose `str()` is its value."""

    def __str__(self) -> str:
        return self.value


class IO(StrEnum):
    """The value types of node inputs and outputs, as their wire names."""

    STRING = "STRING"
    IMAGE = "IMAGE"
    MASK = "MASK"
    LATENT = "LATENT"
    BOOLEAN = "BOOLEAN"
    INT = "INT"
    FLOAT = "FLOAT"
    COMBO = "COMBO"
    CONDITIONING = "CONDITIONING"
    SAMPLER = "SAMPLER"
    SIGMAS = "SIGMAS"
    GUIDER = "GUIDER"
    NOISE = "NOISE"
    CLIP = "CLIP"
    CONTROL_NET = "CONTROL_NET"
    VAE = "VAE"
    MODEL = "MODEL"
    LORA_MODEL = "LORA_MODEL"
    LOSS_MAP = "LOSS_MAP"
    CLIP_VISION = "CLIP_VISION"
    CLIP_VISION_OUTPUT = "CLIP_VISION_OUTPUT"
    STYLE_MODEL = "STYLE_MODEL"
    GLIGEN = "GLIGEN"
    UPSCALE_MODEL = "UPSCALE_MODEL"
    AUDIO = "AUDIO"
    WEBCAM = "WEBCAM"
    POINT = "POINT"
    FACE_ANALYSIS = "FACE_ANALYSIS"
    BBOX = "BBOX"
    SEGS = "SEGS"
    VIDEO = "VIDEO"
    ANY = "*"  # links to anything
    NUMBER = "FLOAT,INT"
    PRIMITIVE = "STRING,FLOAT,INT,BOOLEAN"

    def __ne__(self, other: object) -> bool:
        if not isinstance(other, str):
            return True
        if self.value == "*" or other == "*":
            return False
        mine, theirs = set(self.value.split(",")), set(str(other).split(","))
        return not (mine <= theirs or theirs <= mine)



class RemoteInputOptions(TypedDict):
    """Where a remote combo fetches its choices."""

    route: str
    refresh_button: NotRequired[bool]
    control_after_refresh: NotRequired[Literal["first", "last"]]
    timeout: NotRequired[int]
    max_retries: NotRequired[int]
    refresh: NotRequired[int]


class MultiSelectOptions(TypedDict):
    """A combo that picks several choices."""

    placeholder: NotRequired[str]
    chip: NotRequired[bool]


class InputTypeOptions(TypedDict, total=False):
    """The options dict of one input (every key optional; the editor ignores those it does not know)."""

    default: Any
    defaultInput: bool
    forceInput: bool
    lazy: bool
    rawLink: bool
    tooltip: str
    min: float
    max: float
    step: float
    round: float
    display: str
    control_after_generate: bool
    label_on: str
    label_off: str
    multiline: bool
    placeholder: str
    dynamicPrompts: bool
    image_upload: bool
    image_folder: str
    remote: RemoteInputOptions
    multiselect: MultiSelectOptions


class HiddenInputTypeDict(TypedDict, total=False):
    """The hidden section of INPUT_TYPES."""

    node_id: Literal["UNIQUE_ID"]
    unique_id: Literal["UNIQUE_ID"]
    prompt: Literal["PROMPT"]
    extra_pnginfo: Literal["EXTRA_PNGINFO"]
    dynprompt: Literal["DYNPROMPT"]


class InputTypeDict(TypedDict, total=False):
    """What INPUT_TYPES returns."""

    required: dict[str, tuple[Any, InputTypeOptions]]
    optional: dict[str, tuple[Any, InputTypeOptions]]
    hidden: HiddenInputTypeDict


class ComfyNodeABC(ABC):
    """A base class for classic nodes: it only states the attributes a node class declares."""

    DESCRIPTION: str
    CATEGORY: str
    EXPERIMENTAL: bool
    DEPRECATED: bool
    RETURN_TYPES: tuple
    RETURN_NAMES: tuple
    OUTPUT_TOOLTIPS: tuple
    OUTPUT_IS_LIST: tuple
    FUNCTION: str
    OUTPUT_NODE: bool
    INPUT_IS_LIST: bool

    @classmethod
    @abstractmethod
    def INPUT_TYPES(cls) -> InputTypeDict:
        """The node's inputs."""


class CheckLazyMixin:
    """A lazy node that wants every lazy input it has not been given yet."""

    def check_lazy_status(self, **kwargs: Any) -> list[str]:
        return [name for name, value in kwargs.items() if value is None]


class FileLocator(TypedDict):
    """Where an output file is: what `/view` takes."""

    filename: str
    subfolder: str
    type: Literal["input", "output", "temp"]
