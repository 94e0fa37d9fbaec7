"""Disabled by its name; never imported."""
raise RuntimeError("a disabled plugin was imported")
