"""Loads: no nodes, only editor extensions."""
WEB_DIRECTORY = "js"
