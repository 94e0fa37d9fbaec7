"""Broken: the folder has no __init__.py."""
NODE_CLASS_MAPPINGS = {}
