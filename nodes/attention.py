"""How a MODEL attends: the dense attention backend and block-sparse attention (FastH3's VSA, SLA, Sol-Attn).

Both nodes return a new MODEL handle carrying the choice in its options (models/h3/sparse_attention.py
reads them while the transformer runs); the shared weights are untouched.
"""
from __future__ import annotations

import logging
from typing import Any

from models.h3.sparse_attention import SINK_CONDITIONING, SparseAttentionSettings, parse_block_list, percent_to_sigma
from nodes.loaders import check_model, with_options
from nodes.spec import Input, NodeSpec, Output

logger = logging.getLogger(__name__)

# The editor's choice -> models/h3/sparse_attention.py's dense backend. The second name is the one the
# official templates use; Weft's int8 attention (q and k quantised per 64-token block) stands in for it.
DENSE_BACKENDS = {"pytorch attention": "sdpa", "comfy kitchen attention": "int8"}


def _derived(before: Any, after: Any) -> Any:
    # A new handle keeps the sampling shifts MiniMaxH3SigmaShift set on the one it came from.
    shifts = getattr(before, "h3_shifts", None)
    return with_options(after, h3_shifts=shifts) if shifts is not None else after


def _attention_backend(model: Any, attention: str) -> tuple[Any]:
    model = check_model("ModelAttentionBackend", model)
    backend = DENSE_BACKENDS.get(attention)
    if backend is None:
        logger.warning("ModelAttentionBackend: attention backend %r is not available here; using %r",
                       attention, "pytorch attention")
        backend = "sdpa"
    return (_derived(model, model.with_options(attention_backend=backend)),)


def _attention_backend_valid(attention: Any = None) -> bool:
    # Any name validates, as it does in ComfyUI: a backend this machine lacks falls back when the node runs.
    return True


def _block_sparse_attention(model: Any, selection: dict, start_percent: float, end_percent: float,
                            dense_blocks: str, min_tokens: int, extra_tokens: int, sink_conditioning: str,
                            verbose: bool) -> tuple[Any]:
    node = "BlockSparseAttention"
    model = check_model(node, model)
    method = selection.get("selection")
    try:
        blocks = parse_block_list(dense_blocks)
    except ValueError as exc:
        raise ValueError(f"{node}: input 'dense_blocks': {exc}") from None
    from nodes.sampling import model_shifts
    shift = model_shifts(model)[0]
    if method == "vsa" and extra_tokens:
        # VSA checkpoints were trained on their own sparse pattern; extra tokens would move it toward dense.
        logger.info("%s: extra_tokens is ignored by vsa", node)
    settings = SparseAttentionSettings(
        method=method, keep_ratio=float(selection.get("keep_percent", 10.0)) / 100.0,
        tau=float(selection.get("tau", 1.3)), sigma_start=percent_to_sigma(start_percent, shift),
        sigma_end=percent_to_sigma(end_percent, shift), min_tokens=int(min_tokens), dense_blocks=blocks,
        sink_conditioning=sink_conditioning, verbose=bool(verbose))
    return (_derived(model, model.with_options(sparse_attention=settings)),)


def _block_sparse_valid(dense_blocks: Any = None, **_other: Any) -> bool | str:
    if isinstance(dense_blocks, str):
        try:
            parse_block_list(dense_blocks)
        except ValueError as exc:
            return str(exc)
    return True


def _advanced(spec):
    """The input, shown among the node's advanced widgets."""
    import dataclasses
    return dataclasses.replace(spec, options={**spec.options, "advanced": True})


def _keep_percent(tooltip: str):
    return Input.float("keep_percent", 10.0, min=0.5, max=95.0, step=0.5, tooltip=tooltip)


NODES = [
    NodeSpec(
        node_id="ModelAttentionBackend", display_name="Model Attention Backend", category="model/patch",
        python_module="comfy_extras.nodes_model_advanced", experimental=True,
        description="Chooses how the model attends whenever its attention is dense, including the steps and "
                    "blocks a Model Sparse Attention node leaves dense.",
        execute=_attention_backend, validate_inputs=_attention_backend_valid,
        validate_takes=frozenset({"attention"}),
        inputs=[
            Input.link("model", "MODEL", tooltip="The model whose attention to set."),
            Input.combo("attention", list(DENSE_BACKENDS), "pytorch attention",
                        tooltip="pytorch attention: PyTorch's scaled dot-product attention. comfy kitchen "
                                "attention: Weft's int8 attention (queries and keys quantised per block of 64 "
                                "tokens); a call too large for it, or a name this machine lacks, uses PyTorch "
                                "attention and logs a warning."),
        ],
        outputs=[Output("MODEL", tooltip="The same model, attending with the chosen backend.")],
        search_aliases=("attention backend", "int8 attention"),
    ),
    NodeSpec(
        node_id="BlockSparseAttention", display_name="Model Sparse Attention", category="model/patch",
        python_module="comfy_extras.nodes_sparse_attention", experimental=True,
        description="Makes the MiniMax H3 transformer attend block-sparsely on long sequences: each query tile of 64 "
                    "rows attends exactly to a few chosen key tiles. It pays off more the longer the sequence. "
                    "Before start_percent, after end_percent, in dense_blocks and under min_tokens the model "
                    "attends densely, with the backend Model Attention Backend chose.",
        execute=_block_sparse_attention, validate_inputs=_block_sparse_valid,
        inputs=[
            Input.link("model", "MODEL", tooltip="The model to make sparse."),
            Input.dynamic_combo("selection", {
                "sol-attn": [Input.float("tau", 1.3, min=0.0, max=4.0, step=0.05,
                                         tooltip="How many standard deviations above the mean a key tile's score "
                                                 "must be to be kept; higher keeps fewer tiles.")],
                "sla": [_keep_percent("Share of key tiles each query tile keeps, best first; the sink tiles and "
                                      "the diagonal come on top. Meant for weights trained on this pattern.")],
                "vsa": [_keep_percent("Percent of the 4x4x4 video cubes a cube attends to in full. Use 10 with "
                                      "FastH3 weights, the value they learned with; their to_gate_compress layers "
                                      "weigh in the pooled view of all cubes.")],
            }, tooltip="How key tiles are chosen. sol-attn: a per-row threshold, no training needed. sla: a fixed "
                       "share of the best tiles. vsa: FastVideo's video sparse attention over 4x4x4 video cubes "
                       "with a learned coarse branch, for FastH3 weights."),
            Input.float("start_percent", 0.2, min=0.0, max=1.0, step=0.01,
                        tooltip="How far into sampling sparse attention starts; earlier steps are dense."),
            Input.float("end_percent", 1.0, min=0.0, max=1.0, step=0.01,
                        tooltip="How far into sampling sparse attention stops; later steps are dense."),
            _advanced(Input.string("dense_blocks", "",
                                   tooltip="Comma list of DiT block numbers (a-b for a run of them) kept on full "
                                           "attention, e.g. 0, 1, 47-49.")),
            _advanced(Input.int("min_tokens", 12288, min=0, max=1 << 20, step=512,
                                tooltip="Sequences with fewer rows than this attend densely.")),
            _advanced(Input.int("extra_tokens", 256, min=0, max=256, step=64,
                                tooltip="Extra best-scoring tokens per query tile in ComfyUI's fused kernel. Weft "
                                        "computes the chosen tiles exactly without them, as the reference does; "
                                        "vsa ignores them anyway.")),
            _advanced(Input.combo("sink_conditioning", list(SINK_CONDITIONING), "exact_kv_and_rows",
                                  tooltip="sla and sol-attn: exact_kv makes the text, condition and audio rows "
                                          "exact keys for every query; exact_kv_and_rows also runs the target "
                                          "audio's queries densely; off treats them like any other rows. vsa "
                                          "always keeps every row before the video exact, as keys and as "
                                          "queries.")),
            _advanced(Input.boolean("verbose", False,
                                    tooltip="Log which calls ran sparse and why the others stayed dense.")),
        ],
        outputs=[Output("MODEL", tooltip="The same model, attending block-sparsely.")],
        search_aliases=("block sparse attention", "vsa", "sparse attention"),
    ),
]
