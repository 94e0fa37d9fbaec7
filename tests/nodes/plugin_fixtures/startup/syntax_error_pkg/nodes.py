NODE_CLASS_MAPPINGS = {
    "a": 1
    "b": 2
}
