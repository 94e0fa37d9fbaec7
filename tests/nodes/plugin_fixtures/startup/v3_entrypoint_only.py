"""Broken: only ComfyUI's newer extension interface, which Weft does not load."""


async def comfy_entrypoint():
    return None
