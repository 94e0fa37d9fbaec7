"""Adapters (LoRA, LoKr, LoHa, full deltas) in the community file formats; applied by models/patcher.py."""
from models.adapters.adapter import Adapter, AdapterEntry, adapter_from_tensors, load_adapter

__all__ = ["Adapter", "AdapterEntry", "adapter_from_tensors", "load_adapter"]
