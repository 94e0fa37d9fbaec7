"""Weft's stand-in for ComfyUI's `comfy_api` package: the V3 node API.

`comfy_api.latest` holds the API (`io`, `ui`, `ComfyExtension`, ...); `v0_0_1`, `v0_0_2` and `v0_0_3` are
the pinned version names ComfyUI also answers to, each the same API here. Nodes declared with it are
turned into Weft's `NodeSpec` by `nodes/v3.py`, so the executor never sees a V3 class.
"""
