"""Broken: imports a name the compatibility module lacks."""
from folder_paths import folder_names_and_paths  # noqa: F401
