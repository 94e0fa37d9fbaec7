"""Pictures, video and sound as plain values: decoding, encoding and resampling (PyAV, Pillow).

The value shapes are the ones ComfyUI node packs exchange, so plugins interoperate:
- IMAGE: float tensor (B, H, W, C), values 0..1, C = 3 (or 4 with alpha, 1 for grey).
- MASK: float tensor (B, H, W), values 0..1.
- AUDIO: ``{"waveform": float tensor (B, C, S) in -1..1, "sample_rate": int}``.
- VIDEO: a `media.video.Video`.

Nothing here knows about nodes, graphs, folders or HTTP: callers pass paths and get values back.
"""
