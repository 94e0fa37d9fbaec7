"""Device placement: which device a MODEL, a CLIP or a VAE runs on (SelectModelDevice, SelectCLIPDevice,
SelectVAEDevice).

"default" runs it where its loader put it; "cpu" on the CPU; "gpu:N" on CUDA device N. Any other value,
or a GPU this machine lacks, passes the value through unchanged (logged), so a workflow made on a
machine with more GPUs still runs. The weights are shared; models/memory.py holds them on the chosen
device under a manager of that device.
"""
from __future__ import annotations

import logging
from typing import Any

from nodes.loaders import check_model, keep_shifts
from nodes.spec import Input, NodeSpec, Output

logger = logging.getLogger(__name__)

DEFAULT, CPU = "default", "cpu"


def _gpus() -> list[str]:
    import torch

    return [f"gpu:{index}" for index in range(torch.cuda.device_count())]


def _placement(node: str, device: str) -> tuple[bool, Any]:
    """(whether the value changes, the torch.device to run on or None for the loader's) for a combo value."""
    import torch

    if device == DEFAULT:
        return True, None
    if device == CPU and node != "SelectVAEDevice":
        return True, torch.device("cpu")
    if device.startswith("gpu:") and device[4:].isdigit():
        index = int(device[4:])
        if index < torch.cuda.device_count():
            return True, torch.device("cuda", index)
    logger.info("%s: device %r is not available here; the value passes through unchanged", node, device)
    return False, None


def _any_device(device: Any = None) -> bool:
    # Any value validates (a workflow from a machine with more GPUs must open); execute passes it through.
    return True


def _select_model_device(model: Any, device: str) -> tuple[Any]:
    from models.patcher import PLACED_DEVICE

    model = check_model("SelectModelDevice", model)
    changes, placed = _placement("SelectModelDevice", device)
    return (keep_shifts(model, model.with_options(**{PLACED_DEVICE: placed})) if changes else model,)


def _select_clip_device(clip: Any, device: str) -> tuple[Any]:
    if not callable(getattr(clip, "placed", None)) or not hasattr(clip, "encode"):
        raise TypeError(f"SelectCLIPDevice: input 'clip' takes a CLIP from CLIPLoader; got {type(clip).__name__}")
    changes, placed = _placement("SelectCLIPDevice", device)
    return (clip.placed(placed) if changes else clip,)


def _select_vae_device(vae: Any, device: str) -> tuple[Any]:
    from models.components import VAE

    if not isinstance(vae, VAE):
        raise TypeError(f"SelectVAEDevice: input 'vae' takes a VAE from VAELoader; got {type(vae).__name__}")
    changes, placed = _placement("SelectVAEDevice", device)
    return (vae.placed(placed) if changes else vae,)


def _device_input(with_cpu: bool, what: str) -> Any:
    choices = (lambda: [DEFAULT, CPU, *_gpus()]) if with_cpu else (lambda: [DEFAULT, *_gpus()])
    return Input.combo("device", choices, DEFAULT,
                       tooltip=f"Where the {what} runs: default is where its loader put it"
                               + (", cpu the processor" if with_cpu else "")
                               + ", gpu:N the N-th GPU. A device this machine lacks leaves it where it is.")


NODES = [
    NodeSpec(
        node_id="SelectModelDevice", display_name="Select Model Device", category="advanced/device",
        description="Runs the diffusion model on a chosen device, for example a second GPU.",
        execute=_select_model_device, validate_inputs=_any_device, validate_takes=frozenset({"device"}),
        inputs=[Input.link("model", "MODEL", tooltip="The diffusion model to place."),
                _device_input(True, "diffusion model")],
        outputs=[Output("MODEL", tooltip="The same model, running on the chosen device.")],
    ),
    NodeSpec(
        node_id="SelectCLIPDevice", display_name="Select CLIP Device", category="advanced/device",
        description="Runs the text encoder on a chosen device, for example the large H3 encoder on a second GPU.",
        execute=_select_clip_device, validate_inputs=_any_device, validate_takes=frozenset({"device"}),
        inputs=[Input.link("clip", "CLIP", tooltip="The text encoder to place."),
                _device_input(True, "text encoder")],
        outputs=[Output("CLIP", tooltip="The same text encoder, running on the chosen device.")],
    ),
    NodeSpec(
        node_id="SelectVAEDevice", display_name="Select VAE Device", category="advanced/device",
        description="Runs the VAE on a chosen GPU.",
        execute=_select_vae_device, validate_inputs=_any_device, validate_takes=frozenset({"device"}),
        inputs=[Input.link("vae", "VAE", tooltip="The VAE to place."), _device_input(False, "VAE")],
        outputs=[Output("VAE", tooltip="The same VAE, running on the chosen device.")],
    ),
]
