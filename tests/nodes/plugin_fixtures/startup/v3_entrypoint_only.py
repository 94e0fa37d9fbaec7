"""Broken: a V3 entry point that returns no ComfyExtension."""


async def comfy_entrypoint():
    return None
