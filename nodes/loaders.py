"""Loader nodes: the diffusion model, the text encoder, the VAEs, and LoRA-style adapters.

The wire values and their loading live in `models.components`, the cache of loaded files in
`models.cache`. There is one cache per runtime, shared by every job it runs: a file is read once, and
the text encoder with its remembered prompt encodings stays loaded from one job to the next.
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Callable

from execution.context import current
from execution.paths import UnsafePathError
from models.cache import ModelCache, file_identity
from models.components import (
    ModelPatch, TextEncoder, VAE, load_diffusion_model, load_model_patch, load_text_encoder, load_vae,
)
from nodes.spec import Input, NodeOutput, NodeSpec, Output

UNET_WEIGHT_DTYPES = ("default", "fp8_e4m3fn", "fp8_e4m3fn_fast", "fp8_e5m2")
# Every type ComfyUI's CLIPLoader lists, in its order, so saved workflows keep their value; only the
# H3 text encoder ("minimax") can be loaded.
CLIP_TYPES = (
    "stable_diffusion", "stable_cascade", "sd3", "stable_audio", "mochi", "ltxv", "pixart", "cosmos", "lumina2",
    "wan", "hidream", "chroma", "ace", "omnigen2", "qwen_image", "hunyuan_image", "flux2", "ovis", "longcat_image",
    "cogvideox", "lens", "pixeldit", "ideogram4", "boogu", "krea2", "joyimage", "mage", "minimax", "yue2",
)
SUPPORTED_CLIP_TYPES = ("minimax",)
CLIP_DEVICES = ("default", "cpu")
EMBEDDING_SUFFIXES = (".safetensors", ".sft")


def model_cache() -> ModelCache:
    """The running runtime's cache of loaded model files."""
    return current().runtime.shared("model_cache", ModelCache)


# The model folders `python -m models.h3.make_tiny` fills (kept here: importing make_tiny imports torch models).
TINY_MODEL_FOLDERS = ("diffusion_models", "vae", "text_encoders")


def missing_model_hint(folder: str) -> str:
    """How to fill `models/<folder>` when it holds no model file at all ("" when it holds some)."""
    paths = current().paths
    if paths.list_models(folder):
        return ""
    hint = f"models/{folder} holds no model file: put real checkpoint files (.safetensors) in {paths.models / folder}"
    if folder in TINY_MODEL_FOLDERS:
        hint += (f", or write Weft's tiny random test models with "
                 f"`python -m models.h3.make_tiny --models-dir {paths.models}`")
    return hint


def _model_file(node: str, folder: str, name: str) -> Path:
    try:
        return current().paths.model_path(folder, name)
    except FileNotFoundError as exc:
        hint = missing_model_hint(folder)
        raise ValueError(f"{node}: {exc}" + (f"; {hint}" if hint else "")) from None


def _loaded(node: str, kind: str, path: Path, build: Callable[[], Any]) -> Any:
    """The cached object of `kind` for `path`; a refusal while building is reported as the node's."""
    def build_for_node():
        try:
            return build()
        except ValueError as exc:
            raise ValueError(f"{node}: {exc}") from None
    return model_cache().get(kind, path, build_for_node)


def _file_fingerprint(folder: str, input_name: str) -> Callable[..., Any]:
    # The file's version, not only its name, so a file replaced in place is loaded again.
    def fingerprint(**kwargs: Any) -> Any:
        try:
            return file_identity(current().paths.model_path(folder, kwargs.get(input_name)))
        except (FileNotFoundError, ValueError, TypeError):
            return None
    return fingerprint


def _models_folder(folder: str) -> Callable[[], str]:
    return lambda: ", ".join(str(p) for p in current().paths.model_dirs(folder))


def _model_choice(name: str, folder: str, tooltip: str) -> Any:
    return Input.combo(name, lambda: current().paths.list_models(folder), tooltip=tooltip,
                       folder=_models_folder(folder), missing_hint=lambda: missing_model_hint(folder))


def find_embedding(name: str) -> Path:
    """The file of `embedding:name` in models/embeddings: name.safetensors, name.sft, or name as given."""
    paths = current().paths  # the running job's folders, whichever job uses the cached encoder
    for candidate in (*(name + suffix for suffix in EMBEDDING_SUFFIXES), name):
        try:
            return paths.model_path("embeddings", candidate)
        except FileNotFoundError:
            continue
        except UnsafePathError as exc:
            raise ValueError(f"embedding name {name!r} does not stay inside the embeddings folder: {exc}") from None
    folders = ", ".join(str(p) for p in paths.model_dirs("embeddings"))
    raise ValueError(f"the prompt names embedding {name!r}, but no {name}.safetensors is in {folders}")


def check_vae(node: str, vae: Any, kind: str, input_name: str = "vae") -> VAE:
    """`vae` when it is an H3 VAE of `kind`; an error naming the node and the input otherwise."""
    if not isinstance(vae, VAE):
        raise TypeError(f"{node}: input '{input_name}' takes a VAE from VAELoader; got {type(vae).__name__}")
    return vae.require(kind, node, input_name)


def check_clip(node: str, clip: Any) -> TextEncoder:
    """`clip` when it is a CLIP value from CLIPLoader; an error naming the node otherwise."""
    if not isinstance(clip, TextEncoder):
        raise TypeError(f"{node}: input 'clip' takes a CLIP from CLIPLoader; got {type(clip).__name__}")
    return clip


def check_model(node: str, model: Any) -> Any:
    """`model` when it is a MODEL (a ModelHandle) from UNETLoader; an error naming the node otherwise."""
    from models.patcher import ModelHandle

    if not isinstance(model, ModelHandle):
        raise TypeError(f"{node}: input 'model' takes a MODEL from UNETLoader; got {type(model).__name__}")
    return model


def check_model_patch(node: str, patch: Any) -> ModelPatch:
    """`patch` when it is a MODEL_PATCH from ModelPatchLoader; an error naming the node otherwise."""
    if not isinstance(patch, ModelPatch):
        raise TypeError(f"{node}: input 'model_patch' takes a MODEL_PATCH from ModelPatchLoader; got "
                        f"{type(patch).__name__}")
    return patch


def with_options(handle: Any, **options: Any) -> Any:
    """A shallow copy of a ModelHandle with `options` set as attributes; base weights and patches are shared."""
    clone = copy.copy(handle)
    for key, value in options.items():
        setattr(clone, key, value)
    return clone


def keep_shifts(before: Any, after: Any) -> Any:
    """`after` carrying `before`'s sampling shifts: a node that makes a new handle keeps the shifts chosen."""
    shifts = getattr(before, "h3_shifts", None)
    if after is not before and shifts is not None and getattr(after, "h3_shifts", None) != shifts:
        after = with_options(after, h3_shifts=shifts)
    return after


def _unet_loader(unet_name: str, weight_dtype: str) -> tuple[Any]:
    if weight_dtype != "default":
        raise ValueError(f"UNETLoader: weight_dtype {weight_dtype!r} is not available; Weft keeps the H3 transformer "
                         "in the dtype its file stores (float8 files are widened to bfloat16), so choose 'default'")
    path = _model_file("UNETLoader", "diffusion_models", unet_name)
    return (_loaded("UNETLoader", "unet", path, lambda: load_diffusion_model(path, unet_name)),)


def _clip_loader(clip_name: str, type: str, device: str = "default") -> tuple[TextEncoder]:
    problem = _clip_type_problem(type)
    if problem:
        raise ValueError(problem)
    if device not in CLIP_DEVICES:
        raise ValueError(f"CLIPLoader: device {device!r} is not one of {', '.join(CLIP_DEVICES)}")
    if device == "cpu":
        _require_cpu_compute()
    path = _model_file("CLIPLoader", "text_encoders", clip_name)
    return (_loaded("CLIPLoader", "clip", path, lambda: load_text_encoder(path, clip_name, embedding_path=find_embedding)),)


def _require_cpu_compute() -> None:
    # The memory manager decides where models run. Keeping the text encoder alone on the CPU while the rest
    # runs on an accelerator is not built, and running it on the accelerator anyway would ignore the choice.
    from models import memory

    if memory.manager() is not None and memory.compute_device().type != "cpu":
        raise ValueError(f"CLIPLoader: device 'cpu' cannot be honoured while models run on "
                         f"{memory.compute_device()}; choose 'default' and the memory manager places the encoder")


def _clip_type_problem(clip_type: Any) -> str | None:
    if clip_type in SUPPORTED_CLIP_TYPES:
        return None
    return (f"CLIPLoader: type {clip_type!r} cannot be loaded: Weft has the MiniMax H3 text encoder only; "
            f"choose type 'minimax' and an H3 text encoder file")


def _clip_loader_validate(type: Any = None, **_other: Any) -> bool | str:
    if type is None:  # a linked value is only known when the node runs
        return True
    return _clip_type_problem(type) or True


def _vae_loader(vae_name: str) -> tuple[VAE]:
    path = _model_file("VAELoader", "vae", vae_name)
    vae = _loaded("VAELoader", "vae", path, lambda: load_vae(path, vae_name))
    from nodes.previews import register_vae

    register_vae(vae)  # the preview source of the samplers that follow
    return (vae,)


def _model_patch_loader(name: str) -> tuple[ModelPatch]:
    path = _model_file("ModelPatchLoader", "model_patches", name)
    return (_loaded("ModelPatchLoader", "model_patch", path, lambda: load_model_patch(path, name)),)


def _adapter(node: str, lora_name: str):
    from models.adapters import load_adapter

    path = _model_file(node, "loras", lora_name)
    return _loaded(node, "adapter", path, lambda: load_adapter(path))


def _stack(node: str, target: Any, adapter: Any, strength: float, what: str, mode: Any) -> Any:
    try:
        return target.with_adapter(adapter, float(strength), mode=mode)
    except ValueError as exc:
        raise ValueError(f"{node}: {adapter.name} does not fit the {what}: {exc}") from None


def _apply_lora(node: str, model: Any, clip: Any, lora_name: str, strength_model: float, strength_clip: float,
                bypass: bool) -> NodeOutput:
    """The LoRA loaders' one body: stack the file on the MODEL (and the CLIP, when given) and report what bound.

    The report (models.patcher.Binding, one per component) is the node's text in the editor, its UI
    output `text`, and the `adapters` note of its row in the job's profile. A file of which nothing
    applies to what this node loads is an error naming the input.
    """
    from models.patcher import AdapterMode

    mode = AdapterMode.BYPASS if bypass else AdapterMode.AUTO
    model = check_model(node, model)
    clip = check_clip(node, clip) if clip is not None else None
    if strength_model == 0 and (clip is None or strength_clip == 0):
        return NodeOutput.of(model, *(() if clip is None else (clip,)))
    adapter = _adapter(node, lora_name)
    new_model, new_clip = model, clip
    if strength_model != 0:
        new_model = keep_shifts(model, _stack(node, model, adapter, strength_model, "model", mode))
    if clip is not None and strength_clip != 0:
        new_clip = _stack(node, clip, adapter, strength_clip, "text encoder", mode)
    bindings = [new_model.binding(adapter, not_loaded="strength_model is 0" if strength_model == 0 else "")]
    te_handle = new_clip.handle if clip is not None else None
    if te_handle is not None:
        bindings.append(te_handle.binding(adapter, not_loaded="strength_clip is 0" if strength_clip == 0 else ""))
    else:
        from models.adapters.keys import TEXT_ENCODER
        from models.patcher import Binding

        entries = sum(1 for entry in adapter.entries if entry.component == TEXT_ENCODER)
        if entries:
            bindings.append(Binding(adapter.name, TEXT_ENCODER, entries, not_loaded="this node loads the model only"))
    if not any(binding.applied for binding in bindings):
        asked = [binding for binding in bindings if not binding.not_loaded]
        found = ", ".join(f"{b.entries} for the {'DiT' if b.component == 'model' else 'text encoder'}"
                          for b in bindings if b.entries) or "none"
        raise ValueError(f"{node}: input 'lora_name': nothing in {adapter.name} applies to what this node loads "
                         f"({'; '.join(b.text() for b in asked)}); its entries: {found}. Load it with a node "
                         "that takes the part its entries are for, or check that it is an H3 adapter")
    text = f"{adapter.name}: " + "; ".join(binding.text() for binding in bindings)
    context = current()
    context.show(text=text)
    for binding in bindings:
        context.note_profile("adapters", binding.as_dict())
    values = (new_model,) if clip is None else (new_model, new_clip)
    return NodeOutput.of(*values, ui={"text": [text]})


def _lora_loader_model_only(model: Any, lora_name: str, strength_model: float) -> NodeOutput:
    return _apply_lora("LoraLoaderModelOnly", model, None, lora_name, strength_model, 0.0, bypass=False)


def _lora_loader(model: Any, clip: Any, lora_name: str, strength_model: float, strength_clip: float) -> NodeOutput:
    return _apply_lora("LoraLoader", model, clip, lora_name, strength_model, strength_clip, bypass=False)


def _lora_loader_bypass_model_only(model: Any, lora_name: str, strength_model: float) -> NodeOutput:
    return _apply_lora("LoraLoaderBypassModelOnly", model, None, lora_name, strength_model, 0.0, bypass=True)


def _lora_loader_bypass(model: Any, clip: Any, lora_name: str, strength_model: float,
                        strength_clip: float) -> NodeOutput:
    return _apply_lora("LoraLoaderBypass", model, clip, lora_name, strength_model, strength_clip, bypass=True)


def _merge_adapters(model: Any) -> NodeOutput:
    """Fold the adapters stacked on `model` into private copies of the weights they change, once.

    What that did (models.patcher.MergeReport: the weights changed, the rounding a requantization
    added to each) is the node's text, its UI output `text` and the `merge` note of its profile row.
    """
    handle = check_model("MergeAdapters", model)
    context = current()
    if handle.merged_count == len(handle.applied):
        text = ("nothing to merge: no adapter is loaded on this model" if not handle.applied else
                "nothing to merge: every adapter on this model is merged already")
        context.show(text=text)
        return NodeOutput.of(handle, ui={"text": [text]})
    merged = keep_shifts(handle, handle.merged())
    report = handle.merge_report()
    text = report.text()
    context.show(text=text)
    context.note_profile("merge", report.as_dict())
    return NodeOutput.of(merged, ui={"text": [text]})


_LORA_NAME_TIP = "Adapter file (LoRA, LoKr or LoHa) from models/loras."
_STRENGTH = dict(min=-100.0, max=100.0, step=0.01)


def _lora_inputs() -> list:
    """The inputs of the LoRA loaders that take the model and the text encoder (ordinary and bypass)."""
    return [
        Input.link("model", "MODEL", tooltip="Diffusion model that receives the adapter."),
        Input.link("clip", "CLIP", tooltip="Text encoder that receives the adapter."),
        _model_choice("lora_name", "loras", _LORA_NAME_TIP),
        Input.float("strength_model", 1.0, **_STRENGTH,
                    tooltip="Scale of the adapter's change to the diffusion model; 0 skips it, a negative "
                            "value reverses it."),
        Input.float("strength_clip", 1.0, **_STRENGTH,
                    tooltip="Scale of the adapter's change to the text encoder; 0 skips it, a negative value "
                            "reverses it."),
    ]


def _lora_model_only_inputs() -> list:
    """The inputs of the model-only LoRA loaders (ordinary and bypass)."""
    return [Input.link("model", "MODEL"), _model_choice("lora_name", "loras", _LORA_NAME_TIP),
            Input.float("strength_model", 1.0, **_STRENGTH)]

NODES = [
    NodeSpec(
        node_id="UNETLoader", display_name="Load Diffusion Model", category="advanced/loaders",
        description="Reads the H3 transformer (the denoising model) from models/diffusion_models.",
        execute=_unet_loader,
        inputs=[
            _model_choice("unet_name", "diffusion_models", "Transformer file to load."),
            Input.combo("weight_dtype", list(UNET_WEIGHT_DTYPES), "default",
                        tooltip="How weights are stored in memory; only 'default', the file's own dtype, is "
                                "available."),
        ],
        outputs=[Output("MODEL")],
        fingerprint=_file_fingerprint("diffusion_models", "unet_name"),
        search_aliases=("load unet", "diffusion model", "load transformer"),
    ),
    NodeSpec(
        node_id="CLIPLoader", display_name="Load CLIP", category="advanced/loaders",
        description="Reads a text encoder from models/text_encoders. Only the MiniMax H3 encoder (type 'minimax') "
                    "can be loaded; any other type is refused with a message.",
        execute=_clip_loader,
        inputs=[
            _model_choice("clip_name", "text_encoders", "Text encoder file to load."),
            Input.combo("type", list(CLIP_TYPES), "stable_diffusion",
                        tooltip="Which model family the file belongs to; choose 'minimax' for H3."),
            Input.combo("device", list(CLIP_DEVICES), "default", optional=True,
                        tooltip="'default' leaves the placement to the memory manager; 'cpu' works only when every "
                                "model runs on the CPU."),
        ],
        outputs=[Output("CLIP")],
        fingerprint=_file_fingerprint("text_encoders", "clip_name"),
        validate_inputs=_clip_loader_validate,
        search_aliases=("text encoder", "load text encoder"),
    ),
    NodeSpec(
        node_id="VAELoader", display_name="Load VAE", category="loaders",
        description="Reads an H3 VAE from models/vae; whether it is the video or the audio VAE is read from the "
                    "file's tensor names.",
        execute=_vae_loader,
        inputs=[_model_choice("vae_name", "vae", "VAE file to load, video or audio.")],
        outputs=[Output("VAE")],
        fingerprint=_file_fingerprint("vae", "vae_name"),
    ),
    NodeSpec(
        node_id="LoraLoader", display_name="Load LoRA", category="loaders",
        description="Adds an adapter (LoRA, LoKr or LoHa) to both the diffusion model and the text encoder. The "
                    "loaded base weights are shared and never changed; the adapter is applied on the fly.",
        execute=_lora_loader,
        inputs=_lora_inputs(),
        outputs=[Output("MODEL", tooltip="Diffusion model with the adapter."),
                 Output("CLIP", tooltip="Text encoder with the adapter.")],
        fingerprint=_file_fingerprint("loras", "lora_name"),
    ),
    NodeSpec(
        node_id="LoraLoaderModelOnly", display_name="LoraLoaderModelOnly", category="loaders",
        description="Adds an adapter (LoRA, LoKr or LoHa) to the diffusion model alone.",
        execute=_lora_loader_model_only,
        inputs=_lora_model_only_inputs(),
        outputs=[Output("MODEL")],
        fingerprint=_file_fingerprint("loras", "lora_name"),
    ),
    NodeSpec(
        node_id="LoraLoaderBypass",
        display_name="Load LoRA (Bypass) (For debugging)",  # provenance: interface
        category="loaders", python_module="comfy_extras.nodes_lora_debug", experimental=True,
        description="Adds an adapter (LoRA, LoKr or LoHa) to the diffusion model and the text encoder, computed "
                    "beside every linear layer's own product through the adapter's small factors instead of being "
                    "added to the weights. The result equals Load LoRA's; on a quantized model both run this way.",
        execute=_lora_loader_bypass,
        inputs=_lora_inputs(),
        outputs=[Output("MODEL", tooltip="Diffusion model with the adapter beside its layers."),
                 Output("CLIP", tooltip="Text encoder with the adapter beside its layers.")],
        fingerprint=_file_fingerprint("loras", "lora_name"),
    ),
    NodeSpec(
        node_id="LoraLoaderBypassModelOnly",
        display_name="Load LoRA (Bypass, Model Only) (for debugging)",  # provenance: interface
        category="loaders", python_module="comfy_extras.nodes_lora_debug", experimental=True,
        description="Adds an adapter (LoRA, LoKr or LoHa) to the diffusion model alone, computed beside every linear "
                    "layer's own product through the adapter's small factors instead of being added to the weights.",
        execute=_lora_loader_bypass_model_only,
        inputs=_lora_model_only_inputs(),
        outputs=[Output("MODEL")],
        fingerprint=_file_fingerprint("loras", "lora_name"),
    ),
    NodeSpec(
        node_id="MergeAdapters", display_name="Merge Adapters Into Weights", category="advanced/model",
        description="Adds the adapters loaded so far into the weights they change, once, so sampling runs at the "
                    "speed of the model without adapters. On a quantized model each changed weight is "
                    "requantized in its own format, which adds a small rounding error; the node's text reports "
                    "the largest. The loaded model is shared and stays unchanged: the changed weights are private "
                    "copies. Adapters loaded after this node are computed on the fly on top of it.",
        execute=_merge_adapters,
        inputs=[Input.link("model", "MODEL", tooltip="Diffusion model whose adapters to merge.")],
        outputs=[Output("MODEL", tooltip="The same model with its adapters merged into its weights.")],
        search_aliases=("merge lora", "bake lora", "fuse lora"),
    ),
    NodeSpec(
        node_id="ModelPatchLoader", display_name="Load Model Patch", category="advanced/loaders",
        python_module="comfy_extras.nodes_model_patch",
        description="Reads a model patch from models/model_patches: the MiniMax H3 Fun ControlNet-Union, which "
                    "MiniMaxH3FunControlNetApply adds to an H3 model. Its layers and modulation form come "
                    "from the file.",
        execute=_model_patch_loader,
        inputs=[_model_choice("name", "model_patches", "Model patch file to load.")],
        outputs=[Output("MODEL_PATCH")],
        fingerprint=_file_fingerprint("model_patches", "name"),
    ),
]
