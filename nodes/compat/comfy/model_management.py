"""ComfyUI's `comfy.model_management` basics for plugins, answered by Weft's device-memory manager.

Provided: get_torch_device, intermediate_device, unet_offload_device, get_free_memory,
soft_empty_cache, processing_interrupted, throw_exception_if_processing_interrupted,
InterruptProcessingException, is_device_cpu, is_device_cuda, is_device_mps.
Not provided: model loading and unloading (load_models_gpu, LoadedModel, ...), dtype policies,
VRAMState, interrupt_current_processing. Weft's `models.memory` owns those decisions.
"""
from __future__ import annotations

from typing import Any

import torch

from execution.context import ExecutionInterrupted, current
from models import memory

InterruptProcessingException = ExecutionInterrupted


def get_torch_device() -> torch.device:
    """The compute device (decided by models.memory, the one place that picks it)."""
    return memory.compute_device()


def intermediate_device() -> torch.device:
    """Where node outputs between nodes live: host memory."""
    return torch.device("cpu")


def unet_offload_device() -> torch.device:
    """Where offloaded weights wait: host memory."""
    return torch.device("cpu")


def get_free_memory(dev: Any = None, torch_free_too: bool = False) -> int | tuple[int, int]:
    """Free bytes on `dev` (default: the compute device); with `torch_free_too`, also torch's cached free bytes."""
    device = torch.device(dev) if dev is not None else memory.compute_device()
    free_total = memory.device_free_bytes(device)
    if not torch_free_too:
        return free_total
    if device.type == "cuda":
        free_torch = int(torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    else:
        free_torch = free_total
    return free_total, free_torch


def soft_empty_cache(force: bool = False) -> None:
    """Give torch's cached, unused device blocks back to the driver."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def processing_interrupted() -> bool:
    """Whether the running job was interrupted or cancelled."""
    return current().is_interrupted()


def throw_exception_if_processing_interrupted() -> None:
    """Raise InterruptProcessingException when the running job was interrupted or cancelled."""
    current().check_interrupted()


def is_device_cpu(device: Any) -> bool:
    """Whether `device` is a cpu device."""
    return torch.device(device).type == "cpu"


def is_device_cuda(device: Any) -> bool:
    """Whether `device` is a cuda device."""
    return torch.device(device).type == "cuda"


def is_device_mps(device: Any) -> bool:
    """Whether `device` is a mps device."""
    return torch.device(device).type == "mps"
