"""Broken: imports a name the compatibility module lacks."""
from folder_paths import set_output_directory  # noqa: F401
