"""ComfyUI's V3 node schema (`comfy_api.latest.io`): node classes declared as data.

A V3 node is a class deriving from `ComfyNode` whose `define_schema()` returns a `Schema` (id, inputs,
outputs, flags) and whose classmethod `execute(**inputs)` does the work, returning a `NodeOutput`.
`nodes/v3.py` reads the schema once, when the pack is registered, and builds Weft's `NodeSpec` from it;
each input object writes its widget options with `as_dict()`, in the same option names a classic
node's INPUT_TYPES uses, so both kinds of declaration give the same node.

What this module has: the widget types (Boolean, Int, Float, String, Combo, MultiCombo), the link
types (Image, Mask, Latent, Conditioning, Model, Vae, Clip, Audio, Video and the other common ones,
plus `Custom(io_type)` and `comfytype` for a pack's own), AnyType, MultiType, MatchType,
DynamicCombo, Autogrow, Hidden, Schema, ComfyNode, NodeOutput. What it lacks (DynamicSlot, the
editor-only widgets such as Color or Curve, API-node pricing) is absent, so a pack that uses it
fails with the name it asked for; see `UNSUPPORTED`.
"""
from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, ClassVar, Iterable

import torch

from execution.types import ExecutionBlocker

# Names ComfyUI's io module has that Weft leaves out, with the reason a pack asking for one is told.
UNSUPPORTED = {
    "DynamicSlot": "slots that grow inputs when linked are not part of Weft's node contract",
    "PriceBadge": "Weft runs no API nodes, so it shows no prices",
    "PriceBadgeDepends": "Weft runs no API nodes, so it shows no prices",
    "NodeReplace": "Weft has no node-replacement registry",
    "Webcam": "the webcam widget is not supported",
    "Color": "the colour widget is not supported",
    "Colors": "the colour list widget is not supported",
    "Curve": "the curve widget is not supported",
    "BoundingBox": "the bounding-box widget is not supported",
    "BoundingBoxes": "the bounding-box widget is not supported",
    "ImageCompare": "the image-compare widget is not supported",
    "VideoEdit": "the video-edit widget is not supported",
    "Range": "the range widget is not supported",
    "ResolutionPreview": "the resolution-preview widget is not supported",
}


def __getattr__(name: str) -> Any:
    reason = UNSUPPORTED.get(name)
    if reason is not None:
        raise AttributeError(f"comfy_api io.{name} is not provided by Weft: {reason}")
    raise AttributeError(f"module 'comfy_api.latest.io' has no attribute {name!r}")


def _present(**values: Any) -> dict[str, Any]:
    """The given options without those left unset (None)."""
    return {key: value for key, value in values.items() if value is not None}


# ---------------------------------------------------------------------- option enums
class FolderType(str, Enum):
    """The job folders a file may live in."""

    input = "input"
    output = "output"
    temp = "temp"


class UploadType(str, Enum):
    """Which upload button a combo shows; the value is the widget option it sets."""

    image = "image_upload"
    audio = "audio_upload"
    video = "video_upload"
    model = "file_upload"


class NumberDisplay(str, Enum):
    """How a number widget is drawn."""

    number = "number"
    slider = "slider"
    gradient_slider = "gradientslider"


class ControlAfterGenerate(str, Enum):
    """What a seed-like widget does after each queued run."""

    fixed = "fixed"
    increment = "increment"
    decrement = "decrement"
    randomize = "randomize"


class RemoteOptions:
    """A combo whose choices the editor fetches from a route of this server."""

    def __init__(self, route: str, refresh_button: bool, control_after_refresh: str = "first",
                 timeout: int | None = None, max_retries: int | None = None, refresh: int | None = None) -> None:
        self.route = route
        self.refresh_button = refresh_button
        self.control_after_refresh = control_after_refresh
        self.timeout = timeout
        self.max_retries = max_retries
        self.refresh = refresh

    def as_dict(self) -> dict[str, Any]:
        """The `remote` widget option."""
        return _present(route=self.route, refresh_button=self.refresh_button,
                        control_after_refresh=self.control_after_refresh, timeout=self.timeout,
                        max_retries=self.max_retries, refresh=self.refresh)


def _plain(value: Any) -> Any:
    """An enum option as its wire value."""
    return value.value if isinstance(value, Enum) else value


# ---------------------------------------------------------------------- inputs and outputs
class _Socket:
    """What inputs and outputs share: the value type they belong to and the type name written for them."""

    Parent: ClassVar[Any] = None  # the type (Image, Int, ...) this class belongs to

    @property
    def io_type(self) -> str:
        """The type name links are checked against."""
        return self.Parent.io_type

    def get_io_type(self) -> str:
        """The type written for this socket (a widget may override its parent's)."""
        return self.io_type


class Input(_Socket):
    """One input of a V3 node: a link socket unless a widget type says otherwise."""

    def __init__(self, id: str, display_name: str | None = None, optional: bool = False,
                 tooltip: str | None = None, lazy: bool | None = None, extra_dict: dict | None = None,
                 raw_link: bool | None = None, advanced: bool | None = None) -> None:
        self.id = id
        self.display_name = display_name
        self.optional = optional
        self.tooltip = tooltip
        self.lazy = lazy
        self.extra_dict = dict(extra_dict) if extra_dict else {}
        self.rawLink = raw_link
        self.advanced = advanced

    def as_dict(self) -> dict[str, Any]:
        """The input's options, named as in a classic node's INPUT_TYPES."""
        return _present(display_name=self.display_name, tooltip=self.tooltip, lazy=self.lazy,
                        rawLink=self.rawLink, advanced=self.advanced) | _present(**self.extra_dict)

    def validate(self) -> None:
        """Raise ValueError when the declaration cannot work."""
        if not isinstance(self.id, str) or not self.id:
            raise ValueError(f"an input id must be a non-empty string, got {self.id!r}")


class WidgetInput(Input):
    """An input the editor can show as a widget holding a value."""

    def __init__(self, id: str, display_name: str | None = None, optional: bool = False,
                 tooltip: str | None = None, lazy: bool | None = None, default: Any = None,
                 socketless: bool | None = None, widget_type: str | None = None, force_input: bool | None = None,
                 extra_dict: dict | None = None, raw_link: bool | None = None, advanced: bool | None = None) -> None:
        super().__init__(id, display_name, optional, tooltip, lazy, extra_dict, raw_link, advanced)
        self.default = default
        self.socketless = socketless
        self.widget_type = widget_type
        self.force_input = force_input

    def get_io_type(self) -> str:
        return self.widget_type if self.widget_type is not None else self.io_type

    def as_dict(self) -> dict[str, Any]:
        return super().as_dict() | _present(default=self.default, socketless=self.socketless,
                                            widgetType=self.widget_type, forceInput=self.force_input)


class Output(_Socket):
    """One output of a V3 node."""

    def __init__(self, id: str | None = None, display_name: str | None = None, tooltip: str | None = None,
                 is_output_list: bool = False) -> None:
        self.id = id
        self.display_name = display_name if display_name else id
        self.tooltip = tooltip
        self.is_output_list = is_output_list

    def as_dict(self) -> dict[str, Any]:
        """The output's options."""
        return _present(display_name=self.display_name, tooltip=self.tooltip, is_output_list=self.is_output_list)

    def validate(self) -> None:
        """Raise ValueError when the declaration cannot work."""


class _ComfyType:
    """A value type: its name on the wire (`io_type`), a type hint (`Type`) and its Input/Output classes."""

    io_type: ClassVar[str] = ""
    Type: ClassVar[Any] = Any


class ComfyTypeI(_ComfyType):
    """A type that only appears as an input."""

    Input = Input


class ComfyTypeIO(ComfyTypeI):
    """A type that appears as an input and as an output."""

    Output = Output


def comfytype(io_type: str, **_unused: Any) -> Callable[[type], type]:
    """Class decorator naming a value type: binds `io_type` and gives the class its own Input/Output
    classes pointing back at it (a plain class gets the default ones)."""

    def bind(cls: type) -> type:
        if not issubclass(cls, _ComfyType):
            cls = type(cls.__name__, (cls, ComfyTypeIO), {"__module__": cls.__module__, "__doc__": cls.__doc__})
        cls.io_type = io_type
        for role in ("Input", "Output"):
            base = getattr(cls, role, None)
            if base is not None:
                setattr(cls, role, type(base.__name__, (base,), {
                    "Parent": cls, "__module__": cls.__module__, "__qualname__": f"{cls.__qualname__}.{role}"}))
        return cls

    return bind


def Custom(io_type: str) -> type[ComfyTypeIO]:
    """A link type of a pack's own, named `io_type`."""
    return comfytype(io_type)(type(f"Custom_{io_type}", (ComfyTypeIO,), {}))


# ---------------------------------------------------------------------- widget types
@comfytype("BOOLEAN")
class Boolean(ComfyTypeIO):
    """A true/false toggle."""

    Type = bool

    class Input(WidgetInput):
        """A toggle widget, with optional labels for its two states."""

        def __init__(self, id: str, display_name: str | None = None, optional: bool = False,
                     tooltip: str | None = None, lazy: bool | None = None, default: bool | None = None,
                     label_on: str | None = None, label_off: str | None = None, socketless: bool | None = None,
                     force_input: bool | None = None, extra_dict: dict | None = None, raw_link: bool | None = None,
                     advanced: bool | None = None) -> None:
            super().__init__(id, display_name, optional, tooltip, lazy, default, socketless, None, force_input,
                             extra_dict, raw_link, advanced)
            self.label_on = label_on
            self.label_off = label_off

        def as_dict(self) -> dict[str, Any]:
            return super().as_dict() | _present(label_on=self.label_on, label_off=self.label_off)


@comfytype("INT")
class Int(ComfyTypeIO):
    """A whole number."""

    Type = int

    class Input(WidgetInput):
        """A whole-number widget with optional bounds, step and after-run control."""

        def __init__(self, id: str, display_name: str | None = None, optional: bool = False,
                     tooltip: str | None = None, lazy: bool | None = None, default: int | None = None,
                     min: int | None = None, max: int | None = None, step: int | None = None,
                     control_after_generate: bool | ControlAfterGenerate | None = None,
                     display_mode: NumberDisplay | None = None, socketless: bool | None = None,
                     force_input: bool | None = None, extra_dict: dict | None = None, raw_link: bool | None = None,
                     advanced: bool | None = None) -> None:
            super().__init__(id, display_name, optional, tooltip, lazy, default, socketless, None, force_input,
                             extra_dict, raw_link, advanced)
            self.min, self.max, self.step = min, max, step
            self.control_after_generate = control_after_generate
            self.display_mode = display_mode

        def as_dict(self) -> dict[str, Any]:
            return super().as_dict() | _present(
                min=self.min, max=self.max, step=self.step,
                control_after_generate=_plain(self.control_after_generate), display=_plain(self.display_mode))


@comfytype("FLOAT")
class Float(ComfyTypeIO):
    """A real number."""

    Type = float

    class Input(WidgetInput):
        """A number widget with optional bounds, step and rounding."""

        def __init__(self, id: str, display_name: str | None = None, optional: bool = False,
                     tooltip: str | None = None, lazy: bool | None = None, default: float | None = None,
                     min: float | None = None, max: float | None = None, step: float | None = None,
                     round: float | None = None, display_mode: NumberDisplay | None = None,
                     socketless: bool | None = None, force_input: bool | None = None, extra_dict: dict | None = None,
                     raw_link: bool | None = None, advanced: bool | None = None) -> None:
            super().__init__(id, display_name, optional, tooltip, lazy, default, socketless, None, force_input,
                             extra_dict, raw_link, advanced)
            self.min, self.max, self.step, self.round = min, max, step, round
            self.display_mode = display_mode

        def as_dict(self) -> dict[str, Any]:
            return super().as_dict() | _present(min=self.min, max=self.max, step=self.step, round=self.round,
                                                display=_plain(self.display_mode))


@comfytype("STRING")
class String(ComfyTypeIO):
    """Text."""

    Type = str

    class Input(WidgetInput):
        """A text widget, one line or several."""

        def __init__(self, id: str, display_name: str | None = None, optional: bool = False,
                     tooltip: str | None = None, lazy: bool | None = None, multiline: bool = False,
                     placeholder: str | None = None, default: str | None = None, dynamic_prompts: bool | None = None,
                     socketless: bool | None = None, force_input: bool | None = None, extra_dict: dict | None = None,
                     raw_link: bool | None = None, advanced: bool | None = None) -> None:
            super().__init__(id, display_name, optional, tooltip, lazy, default, socketless, None, force_input,
                             extra_dict, raw_link, advanced)
            self.multiline = multiline
            self.placeholder = placeholder
            self.dynamic_prompts = dynamic_prompts

        def as_dict(self) -> dict[str, Any]:
            return super().as_dict() | _present(multiline=self.multiline or None, placeholder=self.placeholder,
                                                dynamicPrompts=self.dynamic_prompts)


@comfytype("COMBO")
class Combo(ComfyTypeIO):
    """One value out of a list of choices."""

    Type = str

    class Input(WidgetInput):
        """A drop-down list; `options` may be an Enum class (its values are the choices)."""

        def __init__(self, id: str, options: Iterable[Any] | type[Enum] | None = None,
                     display_name: str | None = None, optional: bool = False, tooltip: str | None = None,
                     lazy: bool | None = None, default: Any = None, control_after_generate: bool | None = None,
                     upload: UploadType | None = None, image_folder: FolderType | None = None,
                     remote: RemoteOptions | None = None, socketless: bool | None = None,
                     extra_dict: dict | None = None, raw_link: bool | None = None, advanced: bool | None = None) -> None:
            if inspect.isclass(options) and issubclass(options, Enum):
                options = [member.value for member in options]
            super().__init__(id, display_name, optional, tooltip, lazy, _plain(default), socketless, None, None,
                             extra_dict, raw_link, advanced)
            self.options = list(options) if options is not None else []
            self.multiselect = False
            self.control_after_generate = control_after_generate
            self.upload = upload
            self.image_folder = image_folder
            self.remote = remote

        def as_dict(self) -> dict[str, Any]:
            options = super().as_dict() | _present(
                multiselect=self.multiselect or None, options=self.options,
                control_after_generate=_plain(self.control_after_generate),
                image_folder=_plain(self.image_folder), remote=self.remote.as_dict() if self.remote else None)
            if self.upload is not None:
                options[UploadType(self.upload).value] = True
            return options

    class Output(Output):
        """A combo value given on (its choices are the editor's business)."""

        def __init__(self, id: str | None = None, display_name: str | None = None, options: list | None = None,
                     tooltip: str | None = None, is_output_list: bool = False) -> None:
            super().__init__(id, display_name, tooltip, is_output_list)
            self.options = list(options) if options is not None else []


@comfytype("COMBO")
class MultiCombo(ComfyTypeI):
    """Several values out of a list of choices."""

    Type = list

    class Input(Combo.Input):
        """A drop-down list allowing more than one choice."""

        def __init__(self, id: str, options: Iterable[Any], display_name: str | None = None, optional: bool = False,
                     tooltip: str | None = None, lazy: bool | None = None, default: list | None = None,
                     placeholder: str | None = None, chip: bool | None = None,
                     control_after_generate: bool | None = None, socketless: bool | None = None,
                     extra_dict: dict | None = None, raw_link: bool | None = None, advanced: bool | None = None) -> None:
            super().__init__(id, options, display_name, optional, tooltip, lazy, default, control_after_generate,
                             socketless=socketless, extra_dict=extra_dict, raw_link=raw_link, advanced=advanced)
            self.multiselect = True
            self.placeholder = placeholder
            self.chip = chip

        def as_dict(self) -> dict[str, Any]:
            return super().as_dict() | _present(placeholder=self.placeholder, chip=self.chip)


# ---------------------------------------------------------------------- link types
def _link_type(name: str, io_type: str, hint: Any = Any) -> type[ComfyTypeIO]:
    return comfytype(io_type)(type(name, (ComfyTypeIO,), {"Type": hint, "__module__": __name__}))


Image = _link_type("Image", "IMAGE", torch.Tensor)  # (B, H, W, C) in 0..1
Mask = _link_type("Mask", "MASK", torch.Tensor)  # (B, H, W) in 0..1
Latent = _link_type("Latent", "LATENT", dict)  # {"samples": tensor, ...}
Conditioning = _link_type("Conditioning", "CONDITIONING", list)
Model = _link_type("Model", "MODEL")
Vae = _link_type("Vae", "VAE")
Clip = _link_type("Clip", "CLIP")
ClipVision = _link_type("ClipVision", "CLIP_VISION")
ClipVisionOutput = _link_type("ClipVisionOutput", "CLIP_VISION_OUTPUT")
ControlNet = _link_type("ControlNet", "CONTROL_NET")
StyleModel = _link_type("StyleModel", "STYLE_MODEL")
Gligen = _link_type("Gligen", "GLIGEN")
UpscaleModel = _link_type("UpscaleModel", "UPSCALE_MODEL")
LatentUpscaleModel = _link_type("LatentUpscaleModel", "LATENT_UPSCALE_MODEL")
LoraModel = _link_type("LoraModel", "LORA_MODEL", dict)
Audio = _link_type("Audio", "AUDIO", dict)  # {"waveform": (B, C, S), "sample_rate": int}
Video = _link_type("Video", "VIDEO")
Sampler = _link_type("Sampler", "SAMPLER")
Sigmas = _link_type("Sigmas", "SIGMAS", torch.Tensor)
Noise = _link_type("Noise", "NOISE")
Guider = _link_type("Guider", "GUIDER")
Hooks = _link_type("Hooks", "HOOKS")
HookKeyframes = _link_type("HookKeyframes", "HOOK_KEYFRAMES")
TimestepsRange = _link_type("TimestepsRange", "TIMESTEPS_RANGE", tuple)
LatentOperation = _link_type("LatentOperation", "LATENT_OPERATION")
AudioEncoder = _link_type("AudioEncoder", "AUDIO_ENCODER")
AudioEncoderOutput = _link_type("AudioEncoderOutput", "AUDIO_ENCODER_OUTPUT")
ModelPatch = MODEL_PATCH = _link_type("MODEL_PATCH", "MODEL_PATCH")
Photomaker = _link_type("Photomaker", "PHOTOMAKER")
SVG = _link_type("SVG", "SVG")
Mesh = _link_type("Mesh", "MESH")
Voxel = _link_type("Voxel", "VOXEL")
Point = _link_type("Point", "POINT")
FaceAnalysis = _link_type("FaceAnalysis", "FACE_ANALYSIS")
BBOX = _link_type("BBOX", "BBOX")
SEGS = _link_type("SEGS", "SEGS")
Tracks = _link_type("Tracks", "TRACKS", dict)
LossMap = _link_type("LossMap", "LOSS_MAP", dict)
FlowControl = _link_type("FlowControl", "FLOW_CONTROL", tuple)
Accumulation = _link_type("Accumulation", "ACCUMULATION", dict)
WanCameraEmbedding = _link_type("WanCameraEmbedding", "WAN_CAMERA_EMBEDDING", torch.Tensor)
Histogram = _link_type("Histogram", "HISTOGRAM", list)
# 3D values pass through Weft as plain links (it has no 3D nodes of its own, a pack may).
Load3DCamera = _link_type("Load3DCamera", "LOAD3D_CAMERA", dict)
Load3D = _link_type("Load3D", "LOAD_3D", dict)
Load3DAnimation = _link_type("Load3DAnimation", "LOAD_3D_ANIMATION", dict)
File3DAny = _link_type("File3DAny", "FILE_3D")
File3DGLB = _link_type("File3DGLB", "FILE_3D_GLB")
File3DGLTF = _link_type("File3DGLTF", "FILE_3D_GLTF")
File3DFBX = _link_type("File3DFBX", "FILE_3D_FBX")
File3DOBJ = _link_type("File3DOBJ", "FILE_3D_OBJ")
File3DSTL = _link_type("File3DSTL", "FILE_3D_STL")
File3DUSDZ = _link_type("File3DUSDZ", "FILE_3D_USDZ")
AnyType = _link_type("AnyType", "*")


@comfytype("COMFY_MULTITYPED_V3")
class MultiType:
    """An input accepting any of several types (written as a comma list)."""

    Type = Any

    class Input(Input):
        """`id` may be another input, whose widget and options this one takes over."""

        def __init__(self, id: str | Input, types: list, display_name: str | None = None, optional: bool = False,
                     tooltip: str | None = None, lazy: bool | None = None, extra_dict: dict | None = None,
                     raw_link: bool | None = None, advanced: bool | None = None) -> None:
            wrapped = copy.copy(id) if isinstance(id, Input) else None
            if wrapped is not None:
                # What the wrapped input states wins over the arguments; it is optional if either one is.
                inherited = {name: getattr(wrapped, name) for name in ("display_name", "tooltip", "lazy")}
                display_name = inherited["display_name"] if inherited["display_name"] is not None else display_name
                tooltip = inherited["tooltip"] if inherited["tooltip"] is not None else tooltip
                lazy = inherited["lazy"] if inherited["lazy"] is not None else lazy
                optional = optional or wrapped.optional
            self.input_override = wrapped
            super().__init__(wrapped.id if wrapped is not None else id, display_name, optional, tooltip, lazy,
                             extra_dict, raw_link, advanced)
            self.types = list(types)

        def get_io_type(self) -> str:
            own = [] if self.input_override is None else [self.input_override.get_io_type()]
            # Repeats dropped, first mention first.
            return ",".join(dict.fromkeys(own + [t.io_type for t in self.types]))

        def as_dict(self) -> dict[str, Any]:
            merged = {} if self.input_override is None else dict(self.input_override.as_dict())
            merged.update(super().as_dict())
            return merged


@comfytype("COMFY_MATCHTYPE_V3")
class MatchType(ComfyTypeIO):
    """Inputs and outputs sharing one template take whatever type is linked to the first of them."""

    class Template:
        """A named type variable and the types it may stand for."""

        def __init__(self, template_id: str, allowed_types: Any = None) -> None:
            allowed = AnyType if allowed_types is None else allowed_types
            self.template_id = template_id
            self.allowed_types = list(allowed) if isinstance(allowed, (list, tuple)) else [allowed]
            for item in self.allowed_types:
                if not getattr(item, "io_type", None):
                    raise ValueError(f"MatchType template {template_id!r}: allowed types must be io types, "
                                     f"got {item!r}")

        def as_dict(self) -> dict[str, str]:
            """The `template` option."""
            return {"template_id": self.template_id,
                    "allowed_types": ",".join(t.io_type for t in self.allowed_types)}

    class Input(Input):
        """An input whose type is the template's."""

        def __init__(self, id: str, template: "MatchType.Template", display_name: str | None = None,
                     optional: bool = False, tooltip: str | None = None, lazy: bool | None = None,
                     extra_dict: dict | None = None, raw_link: bool | None = None, advanced: bool | None = None) -> None:
            super().__init__(id, display_name, optional, tooltip, lazy, extra_dict, raw_link, advanced)
            self.template = template

        def as_dict(self) -> dict[str, Any]:
            return super().as_dict() | {"template": self.template.as_dict()}

    class Output(Output):
        """An output whose type is the template's."""

        def __init__(self, template: "MatchType.Template", id: str | None = None, display_name: str | None = None,
                     tooltip: str | None = None, is_output_list: bool = False) -> None:
            super().__init__(id, display_name, tooltip, is_output_list)
            self.template = template


# ---------------------------------------------------------------------- dynamic inputs
class DynamicInput(Input):
    """An input standing for a set of inputs that depends on the node's values."""


@comfytype("COMFY_AUTOGROW_V3")
class Autogrow(ComfyTypeI):
    """A group of like inputs that grows by one slot each time the last one is linked."""

    Type = dict
    MAX_SLOTS = 100

    class _Template:
        def __init__(self, input: Input, min: int) -> None:
            if isinstance(input, DynamicInput):
                raise ValueError(f"an Autogrow template cannot be a dynamic input ({input.id!r})")
            if not isinstance(min, int) or min < 0:
                raise ValueError(f"Autogrow min must be a whole number of at least 0, got {min!r}")
            self.input = copy.copy(input)
            if isinstance(self.input, WidgetInput):
                self.input.force_input = True  # a grown slot is a socket, never a widget
            self.min = min
            self.names: list[str] = []

    class TemplatePrefix(_Template):
        """Slots named prefix0, prefix1, ... up to `max` of them."""

        def __init__(self, input: Input, prefix: str, min: int = 1, max: int = 10) -> None:
            super().__init__(input, min)
            if not isinstance(max, int) or not 1 <= max <= Autogrow.MAX_SLOTS:
                raise ValueError(f"Autogrow max must be between 1 and {Autogrow.MAX_SLOTS}, got {max!r}")
            self.prefix = prefix
            self.max = max
            self.names = [f"{prefix}{i}" for i in range(max)]

    class TemplateNames(_Template):
        """Slots with the given names, in order."""

        def __init__(self, input: Input, names: list[str], min: int = 1) -> None:
            super().__init__(input, min)
            self.names = list(names)[:Autogrow.MAX_SLOTS]
            if not self.names:
                raise ValueError("Autogrow TemplateNames needs at least one name")

    class Input(DynamicInput):
        """The growing group; `execute` gets it as {slot name: value} for the linked slots."""

        def __init__(self, id: str, template: "Autogrow.TemplatePrefix | Autogrow.TemplateNames",
                     display_name: str | None = None, optional: bool = False, tooltip: str | None = None,
                     lazy: bool | None = None, extra_dict: dict | None = None) -> None:
            super().__init__(id, display_name, optional, tooltip, lazy, extra_dict)
            self.template = template


@comfytype("COMFY_DYNAMICCOMBO_V3")
class DynamicCombo(ComfyTypeI):
    """A combo whose chosen option brings its own further inputs."""

    Type = dict

    class Option:
        """One choice of a dynamic combo and the inputs it adds."""

        def __init__(self, key: str, inputs: list[Input]) -> None:
            self.key = key
            self.inputs = list(inputs)

    class Input(DynamicInput):
        """The combo; `execute` gets it as {combo id: chosen key, sub input: value, ...}."""

        def __init__(self, id: str, options: "list[DynamicCombo.Option]", display_name: str | None = None,
                     optional: bool = False, tooltip: str | None = None, lazy: bool | None = None,
                     extra_dict: dict | None = None) -> None:
            super().__init__(id, display_name, optional, tooltip, lazy, extra_dict)
            self.options = list(options)


# ---------------------------------------------------------------------- hidden values
class Hidden(str, Enum):
    """Values the executor hands a node without a socket; the node reads them on `cls.hidden`."""

    unique_id = "UNIQUE_ID"
    prompt = "PROMPT"
    extra_pnginfo = "EXTRA_PNGINFO"
    dynprompt = "DYNPROMPT"
    auth_token_comfy_org = "AUTH_TOKEN_COMFY_ORG"
    api_key_comfy_org = "API_KEY_COMFY_ORG"


class HiddenHolder:
    """`cls.hidden` while a node runs: one attribute per Hidden name, None when not requested."""

    def __init__(self, unique_id: Any = None, prompt: Any = None, extra_pnginfo: Any = None, dynprompt: Any = None,
                 auth_token_comfy_org: Any = None, api_key_comfy_org: Any = None, **_others: Any) -> None:
        self.unique_id = unique_id
        self.prompt = prompt
        self.extra_pnginfo = extra_pnginfo
        self.dynprompt = dynprompt
        self.auth_token_comfy_org = auth_token_comfy_org
        self.api_key_comfy_org = api_key_comfy_org

    def __getattr__(self, name: str) -> Any:
        return None  # a hidden value this build does not know reads as absent

    @classmethod
    def from_dict(cls, values: dict | None) -> "HiddenHolder":
        """A holder from {Hidden member or its value: value}."""
        values = values or {}
        return cls(**{member.name: values.get(member, values.get(member.value)) for member in Hidden})


# ---------------------------------------------------------------------- the node
@dataclass
class Schema:
    """A V3 node's declaration: identity, inputs, outputs and flags."""

    node_id: str
    display_name: str | None = None
    category: str = "sd"
    inputs: list = field(default_factory=list)
    outputs: list = field(default_factory=list)
    hidden: list = field(default_factory=list)
    description: str = ""
    search_aliases: list = field(default_factory=list)
    is_input_list: bool = False
    is_output_node: bool = False
    is_deprecated: bool = False
    is_experimental: bool = False
    is_dev_only: bool = False
    is_api_node: bool = False
    price_badge: Any = None
    not_idempotent: bool = False
    enable_expand: bool = False
    accept_all_inputs: bool = False
    essentials_category: str | None = None
    has_intermediate_output: bool = False
    loop_boundary: str | None = None

    def finalize(self) -> None:
        """Fill what the declaration implies: lists for None, an output node's prompt and workflow
        hidden values (it writes them into the files it saves), and ids for unnamed outputs."""
        self.inputs = list(self.inputs or [])
        self.outputs = list(self.outputs or [])
        self.hidden = list(self.hidden or [])
        if self.is_output_node:
            for needed in (Hidden.prompt, Hidden.extra_pnginfo):
                if needed not in self.hidden:
                    self.hidden.append(needed)
        for index, output in enumerate(self.outputs):
            if getattr(output, "id", None) is None:
                output.id = f"_{index}_{output.io_type}_"

    def validate(self) -> None:
        """Raise ValueError when two inputs or two outputs share an id, or an input cannot work."""
        input_ids = [item.id for item in self.inputs]
        output_ids = [item.id for item in self.outputs]
        for kind, ids in (("input", input_ids), ("output", output_ids)):
            repeated = sorted({i for i in ids if ids.count(i) > 1})
            if repeated:
                raise ValueError(f"{kind} ids must be unique, repeated: {repeated}")
        for item in [*self.inputs, *self.outputs]:
            item.validate()


def _flat_unevaluated(values: dict[str, Any], prefix: str = "") -> list[str]:
    """Names of the None values, a grouped (dynamic) input's members as 'group.member'."""
    names = []
    for key, value in values.items():
        if isinstance(value, dict) and not prefix:
            names.extend(f"{key}.{sub}" if sub != key else key for sub in _flat_unevaluated(value, key))
        elif value is None:
            names.append(key)
    return names


class ComfyNode:
    """Base class of V3 nodes: override `define_schema` and `execute` (classmethods), and optionally
    `validate_inputs`, `fingerprint_inputs` and `check_lazy_status`."""

    hidden: ClassVar[HiddenHolder | None] = None  # the hidden values, set on the class the node runs as
    RELATIVE_PYTHON_MODULE: ClassVar[str | None] = None

    @classmethod
    def define_schema(cls) -> Schema:
        """The node's declaration."""
        raise NotImplementedError(f"{cls.__name__} does not define define_schema()")

    @classmethod
    def execute(cls, **kwargs: Any) -> "NodeOutput":
        """The node's work."""
        raise NotImplementedError(f"{cls.__name__} does not define execute()")

    @classmethod
    def validate_inputs(cls, **kwargs: Any) -> bool | str:
        """True when the inputs are acceptable, else a message; declared only when a node checks them."""
        raise NotImplementedError

    @classmethod
    def fingerprint_inputs(cls, **kwargs: Any) -> Any:
        """A value that changes when the node must run again; declared only when a node needs one."""
        raise NotImplementedError

    @classmethod
    def check_lazy_status(cls, **kwargs: Any) -> list[str]:
        """The lazy inputs still to evaluate (all that are not, unless a node says otherwise)."""
        return _flat_unevaluated(kwargs)

    @classmethod
    def GET_SCHEMA(cls) -> Schema:
        """The declaration, finalized and checked."""
        schema = cls.define_schema()
        schema.finalize()
        schema.validate()
        return schema


def overrides(cls: type, name: str) -> bool:
    """Whether `cls` (a ComfyNode) declares its own `name` hook rather than the base class's."""
    own = inspect.getattr_static(cls, name, None)
    base = inspect.getattr_static(ComfyNode, name)
    return own is not None and getattr(own, "__func__", own) is not getattr(base, "__func__", base)


class _UIOutput:
    """What a node shows in the editor; `as_dict()` is the `ui` part of its result."""

    def as_dict(self) -> dict:
        """The ui dict sent with the node's `executed` event."""
        raise NotImplementedError


class NodeOutput:
    """A V3 node's result: output values in order, and optionally `ui`, `expand` or a blocked branch."""

    def __init__(self, *args: Any, ui: _UIOutput | dict | None = None, expand: dict | None = None,
                 block_execution: str | None = None) -> None:
        self.args = args
        self.ui = ui
        self.expand = expand
        self.block_execution = block_execution

    @property
    def result(self) -> tuple | None:
        """The output values, or None when there are none."""
        return self.args if self.args else None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "NodeOutput":
        """From a classic result dict ({"result": ..., "ui": ..., "expand": ...})."""
        result = data.get("result", ())
        if isinstance(result, ExecutionBlocker):
            return cls(block_execution=result.message)
        return cls(*(result or ()), ui=data.get("ui"), expand=data.get("expand"))

    def __getitem__(self, index: int) -> Any:
        return self.args[index]


__all__ = [
    "FolderType", "UploadType", "NumberDisplay", "ControlAfterGenerate", "RemoteOptions", "comfytype", "Custom",
    "Input", "WidgetInput", "Output", "ComfyTypeI", "ComfyTypeIO", "Boolean", "Int", "Float", "String", "Combo",
    "MultiCombo", "Image", "Mask", "Latent", "Conditioning", "Model", "Vae", "Clip", "ClipVision",
    "ClipVisionOutput", "ControlNet", "StyleModel", "Gligen", "UpscaleModel", "LatentUpscaleModel", "LoraModel",
    "Audio", "Video", "Sampler", "Sigmas", "Noise", "Guider", "Hooks", "HookKeyframes", "TimestepsRange",
    "LatentOperation", "AudioEncoder", "AudioEncoderOutput", "MODEL_PATCH", "Photomaker", "SVG", "Mesh", "Voxel",
    "Point", "FaceAnalysis", "BBOX", "SEGS", "Tracks", "LossMap", "FlowControl", "Accumulation",
    "WanCameraEmbedding", "Histogram", "Load3DCamera", "Load3D", "Load3DAnimation", "File3DAny", "File3DGLB",
    "File3DGLTF", "File3DFBX", "File3DOBJ", "File3DSTL", "File3DUSDZ", "AnyType", "MultiType", "MatchType", "DynamicInput",
    "Autogrow", "DynamicCombo", "Hidden", "HiddenHolder", "Schema", "ComfyNode", "NodeOutput",
]
