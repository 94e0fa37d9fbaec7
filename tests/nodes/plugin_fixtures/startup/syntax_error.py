"""Broken: a syntax error."""

def broken(:
    pass
