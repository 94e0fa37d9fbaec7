"""The loader nodes of the ComfyUI-GGUF pack (city96), for H3's GGUF files.

Workflows shared for 8-16 GB cards load the H3 DiT and the Qwen3-VL text encoder from GGUF files
through this pack's nodes, so Weft declares them with the pack's ids, inputs and folders and loads
the files itself (models/gguf.py reads the container; the layers stay in their block type,
models/quant/formats/gguf.py). What the pack lists, and Weft lists the same way:
  UnetLoaderGGUF, UnetLoaderGGUFAdvanced  `.gguf` files of models/diffusion_models and models/unet
  CLIPLoaderGGUF, DualCLIPLoaderGGUF      `.safetensors` and `.gguf` files of models/text_encoders and
                                          models/clip, sorted together
The pack's own loading options (UnetLoaderGGUFAdvanced's dequant_dtype, patch_dtype,
patch_on_device) are honoured where Weft's single path gives that result and refused otherwise:
Weft decodes blocks in float32 and rounds once to the compute dtype ("default", "target" and
"float32" all give exactly that), applies adapter patches in float32 ("default", "float32"), and
applies them where the weight is taken, on the compute device (patch_on_device either way).
"""
from __future__ import annotations

from typing import Any

from execution.context import current
from execution.paths import GGUF_EXTENSIONS, MODEL_EXTENSIONS
from models.components import load_diffusion_model, load_text_encoder
from nodes.loaders import (CLIP_TYPES, _clip_type_problem, _file_fingerprint, _loaded, _model_file, _models_folder,
                           find_embedding, missing_model_hint)
from nodes.spec import Input, NodeSpec, Output

PACK_MODULE = "custom_nodes.ComfyUI-GGUF"  # provenance: interface (the pack's module, as /object_info names it)
CATEGORY = "bootleg"  # provenance: interface (the pack's category)
DTYPE_CHOICES = ("default", "target", "float32", "float16", "bfloat16")
SAME_AS_WEFT_DEQUANT = ("default", "target", "float32")
SAME_AS_WEFT_PATCH = ("default", "float32")
# ComfyUI's DualCLIPLoader types, which the pack's dual loader offers; none of them is H3's.
DUAL_CLIP_TYPES = ("sdxl", "sd3", "flux", "hunyuan_video", "hidream", "hunyuan_image", "hunyuan_video_15",
                   "kandinsky5", "kandinsky5_image", "ltxv", "newbie", "ace")


def _gguf_unets() -> list[str]:
    return current().paths.list_models("diffusion_models", GGUF_EXTENSIONS)


def _clip_files() -> list[str]:
    return current().paths.list_models("text_encoders", MODEL_EXTENSIONS + GGUF_EXTENSIONS)


def _unet_choice() -> Any:
    return Input.combo("unet_name", _gguf_unets, tooltip="GGUF file of the H3 transformer (full or pruned), from "
                       "models/diffusion_models or models/unet.", folder=_models_folder("diffusion_models"),
                       missing_hint=lambda: missing_model_hint("diffusion_models"))


def _clip_choice(name: str) -> Any:
    return Input.combo(name, _clip_files, tooltip="Text encoder file (.gguf or .safetensors) from "
                       "models/text_encoders or models/clip.", folder=_models_folder("text_encoders"),
                       missing_hint=lambda: missing_model_hint("text_encoders"))


def _load_unet(node: str, unet_name: str) -> Any:
    path = _model_file(node, "diffusion_models", unet_name)
    return _loaded(node, "unet", path, lambda: load_diffusion_model(path, unet_name))


def _unet_loader_gguf(unet_name: str) -> tuple[Any]:
    return (_load_unet("UnetLoaderGGUF", unet_name),)


def _advanced_problem(dequant_dtype: Any, patch_dtype: Any) -> str | None:
    if dequant_dtype is not None and dequant_dtype not in SAME_AS_WEFT_DEQUANT:
        return (f"UnetLoaderGGUFAdvanced: dequant_dtype {dequant_dtype!r} is not available; Weft decodes GGUF blocks "
                "in float32 and rounds once to the model's compute dtype, which is what 'default', 'target' and "
                "'float32' give: choose one of those")
    if patch_dtype is not None and patch_dtype not in SAME_AS_WEFT_PATCH:
        return (f"UnetLoaderGGUFAdvanced: patch_dtype {patch_dtype!r} is not available; Weft adds LoRA patches to "
                "the decoded weight in float32, which is what 'default' and 'float32' give: choose one of those")
    return None


def _unet_loader_gguf_advanced(unet_name: str, dequant_dtype: str, patch_dtype: str,
                               patch_on_device: bool) -> tuple[Any]:
    problem = _advanced_problem(dequant_dtype, patch_dtype)
    if problem:
        raise ValueError(problem)
    return (_load_unet("UnetLoaderGGUFAdvanced", unet_name),)


def _advanced_validate(dequant_dtype: Any = None, patch_dtype: Any = None, **_other: Any) -> bool | str:
    return _advanced_problem(dequant_dtype, patch_dtype) or True


def _load_clip(node: str, clip_name: str, type: str) -> Any:
    problem = _clip_type_problem(type)
    if problem:
        raise ValueError(problem.replace("CLIPLoader:", f"{node}:", 1))
    path = _model_file(node, "text_encoders", clip_name)
    return _loaded(node, "clip", path, lambda: load_text_encoder(path, clip_name, embedding_path=find_embedding))


def _clip_loader_gguf(clip_name: str, type: str) -> tuple[Any]:
    return (_load_clip("CLIPLoaderGGUF", clip_name, type),)


def _clip_validate(type: Any = None, **_other: Any) -> bool | str:
    if type is None:
        return True
    problem = _clip_type_problem(type)
    return problem.replace("CLIPLoader:", "CLIPLoaderGGUF:", 1) if problem else True


def _dual_problem(type: Any) -> str:
    return (f"DualCLIPLoaderGGUF: type {type!r} pairs two text encoders of another model family; H3 is conditioned "
            "on one encoder (Qwen3-VL), so load it with CLIPLoaderGGUF (type 'minimax') instead")


def _dual_clip_loader_gguf(clip_name1: str, clip_name2: str, type: str) -> tuple[Any]:
    raise ValueError(_dual_problem(type))


def _dual_validate(type: Any = None, **_other: Any) -> bool | str:
    return _dual_problem(type) if type is not None else True


_DTYPE_TIP = "{what}; Weft's one path is what 'default' gives (see the node's description)."

NODES = [
    NodeSpec(
        node_id="UnetLoaderGGUF", display_name="Unet Loader (GGUF)",  # provenance: interface
        category=CATEGORY, python_module=PACK_MODULE,
        description="Reads the H3 transformer from a GGUF file. Its quantized layers stay in their GGUF block type "
                    "in memory and are decoded per operation on the device that runs them.",
        execute=_unet_loader_gguf,
        inputs=[_unet_choice()],
        outputs=[Output("MODEL")],
        fingerprint=_file_fingerprint("diffusion_models", "unet_name"),
        search_aliases=("gguf", "load gguf model"),
    ),
    NodeSpec(
        node_id="UnetLoaderGGUFAdvanced", display_name="Unet Loader (GGUF/Advanced)",  # provenance: interface
        category=CATEGORY, python_module=PACK_MODULE,
        description="Reads the H3 transformer from a GGUF file, as Unet Loader (GGUF) does. Weft decodes blocks in "
                    "float32, rounds once to the compute dtype and adds LoRA patches in float32 on the device that "
                    "runs the layer: dequant_dtype 'default', 'target' or 'float32' and patch_dtype 'default' or "
                    "'float32' give exactly that; the other choices are refused.",
        execute=_unet_loader_gguf_advanced,
        inputs=[
            _unet_choice(),
            Input.combo("dequant_dtype", list(DTYPE_CHOICES), "default",
                        tooltip=_DTYPE_TIP.format(what="The dtype blocks are decoded into")),
            Input.combo("patch_dtype", list(DTYPE_CHOICES), "default",
                        tooltip=_DTYPE_TIP.format(what="The dtype LoRA patches are computed in")),
            Input.boolean("patch_on_device", False,
                       tooltip="Where LoRA patches are kept; Weft applies them where the weight is taken, on the "
                               "compute device, either way."),
        ],
        outputs=[Output("MODEL")],
        fingerprint=_file_fingerprint("diffusion_models", "unet_name"),
        validate_inputs=_advanced_validate,
    ),
    NodeSpec(
        node_id="CLIPLoaderGGUF", display_name="CLIPLoader (GGUF)",  # provenance: interface
        category=CATEGORY, python_module=PACK_MODULE,
        description="Reads a text encoder from a GGUF or safetensors file. Only the MiniMax H3 encoder (type "
                    "'minimax', Qwen3-VL) can be loaded; any other type is refused with a message.",
        execute=_clip_loader_gguf,
        inputs=[
            _clip_choice("clip_name"),
            Input.combo("type", list(CLIP_TYPES), "stable_diffusion",
                        tooltip="Which model family the file belongs to; choose 'minimax' for H3."),
        ],
        outputs=[Output("CLIP")],
        fingerprint=_file_fingerprint("text_encoders", "clip_name"),
        validate_inputs=_clip_validate,
    ),
    NodeSpec(
        node_id="DualCLIPLoaderGGUF", display_name="DualCLIPLoader (GGUF)",  # provenance: interface
        category=CATEGORY, python_module=PACK_MODULE,
        description="Pairs two text encoders for the families ComfyUI's DualCLIPLoader serves. H3 uses one encoder, "
                    "so every type is refused with a message pointing to CLIPLoaderGGUF.",
        execute=_dual_clip_loader_gguf,
        inputs=[
            _clip_choice("clip_name1"),
            _clip_choice("clip_name2"),
            Input.combo("type", list(DUAL_CLIP_TYPES), "sdxl",
                        tooltip="The two-encoder recipe; none of them is H3's."),
        ],
        outputs=[Output("CLIP")],
        validate_inputs=_dual_validate,
    ),
]
