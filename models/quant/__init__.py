"""Quantized weights in ComfyUI's file format: markers (markers.py) and the writer (writer.py).

The arithmetic that reads stored weights back and the quantized matrix products live in kernels/
(kernels/quantized.py, kernels/quantized_linear.py); the layers that hold them are in models/ops.py.
"""
