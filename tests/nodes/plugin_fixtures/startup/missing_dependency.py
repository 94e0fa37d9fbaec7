"""Broken: imports a module that is not installed."""
import weft_fixture_not_installed  # noqa: F401
