"""Broken: declares no nodes and no web folder."""
VALUE = 1
