"""Weft's stand-in for ComfyUI's `comfy_execution` package: only `graph_utils`, which node packs use to
build the graphs their nodes expand into and to block a branch. Every other module is absent."""
