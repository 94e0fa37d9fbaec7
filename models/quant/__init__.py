"""Quantized weights in ComfyUI's file format: one object per format (formats/), markers (markers.py), the writer (writer.py).

The arithmetic that reads stored weights back and the quantized matrix products live in kernels/
(kernels/quantized.py, kernels/quantized_linear.py), which the format objects call; the layers
that hold quantized weights are in models/ops.py, which asks the format objects. Nothing here
imports models/ops or the loader.
"""
