"""ComfyUI's `comfy.k_diffusion` for node packs: only `utils.FolderOfImages`. Its samplers are not provided."""
