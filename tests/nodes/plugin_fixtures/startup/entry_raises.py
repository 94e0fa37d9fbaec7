"""Broken: the entry function raises."""


def weft_nodes():
    raise OSError("model folder unreadable")
