"""Broken: the entry function returns something that is not a NodeSpec."""


def weft_nodes():
    return ["FixtureJunk"]
