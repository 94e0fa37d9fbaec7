"""Weft's compatibility stand-in for ComfyUI's `comfy` package: `comfy.utils`, `comfy.model_management`,
`comfy.model_detection`, `comfy.supported_models`, `comfy.comfy_types` and `comfy.k_diffusion.utils`
(FolderOfImages only).

Any other `comfy.*` module is absent on purpose, so a plugin importing it fails to load with that
module named (see nodes/plugins.py)."""
