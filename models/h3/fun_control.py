"""The MiniMax H3 Fun ControlNet-Union patch: a few extra H3 blocks that steer the video rows.

A patch file holds `control_proj_in` (a float32 Linear from 49 * 2 * 2 hint values per video patch to the
stream width) and `control_blocks.N` (H3 blocks under the base checkpoint's key names, each with an
`after_proj` Linear; block 0 also a `before_proj`). Block N runs at base layer `injection_layers[N]`.
The layers come from the file's `control_blocks_places` metadata (a JSON list) or, without it, are
spread evenly over the released model's 50 layers. `minimax_h3_fun_controlnet: adaln_basis` in the
metadata marks curve-form modulation (8-wide input, no SiLU), which a pruned base needs; a file without
that entry is read as curve-form when its modulation input is 8 wide.

How a run uses it (`FunControlHook`, installed by MiniMaxH3FunControlNetApply):
- The hint is the control video fitted (bilinear, centre crop) to the target's pixel size and frame count
  and encoded by the H3 video VAE (24 channels); with a mask it becomes
  [control latent or zeros | visibility (1 = keep) | VAE(source * visibility)] = 49 channels. Its 2x2
  patches are zero-padded to the 196 input values.
- At the first injection layer the control stream starts from the stream entering that layer: target
  video rows are replaced by `control_proj_in(hint rows)` (keyframe and reference video rows by
  `control_proj_in(0)`), then `c = before_proj(c) + stream`.
- At each injection layer, after the base block: `c = control block(c)` (dense attention, the base's
  modulation rows and rotary tables), and the base block's output gains `strength * after_proj(c)`,
  except on audio rows, which the patch leaves as they are.
- Only while the video sigma lies within [sigma at end_percent, sigma at start_percent].
"""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from models import ops
from models.h3 import packing
from models.h3.latents import SPATIAL_RATIO
from models.h3.packing import SegmentRole as Role
from models.h3.transformer import BlockContext, H3TransformerConfig, JointLayer

CONTROL_IN_CHANNELS = 49            # control latent 24 + visibility 1 + masked source latent 24
RELEASED_BASE_LAYERS = 50           # the released DiT's depth, over which blocks spread without metadata
PLACES_METADATA = "control_blocks_places"
FORM_METADATA = "minimax_h3_fun_controlnet"
CURVE_FORM = "adaln_basis"
CURVE_WIDTH = 8                     # the released curve basis: what a file without the form marker is read by
INPAINT_METADATA = "inpaint_masked_pixel_mode"
# Keys that make a file a Fun ControlNet patch.
DETECTION_KEYS = ("control_proj_in.weight", "control_blocks.0.adaln_proj.linear.weight",
                  "control_blocks.0.after_proj.weight", "control_blocks.0.before_proj.weight",
                  "control_blocks.0.attn.qkv_proj.weight", "control_blocks.0.attn.q_norm.weight",
                  "control_blocks.0.mlp.fc1.weight")
AUDIO_ROLES = (Role.AUDIO, Role.COND_AUDIO, Role.REF_AUDIO)
VISUAL_CONDITION_ROLES = (Role.COND_VIDEO, Role.REF_VIDEO)


@dataclass
class FunControlConfig:
    """Shape and placement of a Fun ControlNet patch."""
    hidden_size: int = 5376
    num_heads: int = 56
    head_dim: int = 128
    ffn_size: int = 14336
    time_embed_dim: int = 2688
    injection_layers: tuple[int, ...] = (0, 10, 20, 30, 40)
    curve_form: bool = False           # modulation fed by the curve table's rows (no SiLU, float32)
    inpaint_post_norm: bool = False    # the file's masked-pixel mode is "post_norm"
    control_in_channels: int = CONTROL_IN_CHANNELS

    @property
    def input_width(self) -> int:
        """Values per hint row: the channels of one 1x2x2 patch."""
        return self.control_in_channels * 4

    def block_config(self) -> H3TransformerConfig:
        """The H3 block shape of the control blocks (the curve flag only picks the modulation form)."""
        return H3TransformerConfig(hidden_size=self.hidden_size, num_heads=self.num_heads, head_dim=self.head_dim,
                                   ffn_size=self.ffn_size, time_embed_dim=self.time_embed_dim,
                                   adaln_curve_points=2 if self.curve_form else None)


def _count_blocks(shapes: dict[str, tuple]) -> int:
    count = 0
    while f"control_blocks.{count}.after_proj.weight" in shapes:
        count += 1
    return count


def injection_layers(count: int, metadata: dict[str, str]) -> tuple[int, ...]:
    """Where the `count` control blocks run: the metadata's list, else every (50 // count)-th layer from 0."""
    if PLACES_METADATA not in metadata:
        return tuple(range(0, RELEASED_BASE_LAYERS, RELEASED_BASE_LAYERS // count))[:count]
    try:
        places = json.loads(metadata[PLACES_METADATA])
    except json.JSONDecodeError:
        raise ValueError(f"its {PLACES_METADATA} metadata is not a JSON list: {metadata[PLACES_METADATA]!r}") from None
    if (not isinstance(places, list) or not all(type(p) is int and p >= 0 for p in places)
            or len(places) != count):
        raise ValueError(f"its {PLACES_METADATA} metadata {metadata[PLACES_METADATA]!r} is not a list of {count} "
                         f"layer numbers, one per control block")
    if places[0] != 0 or places != sorted(set(places)):
        raise ValueError(f"its {PLACES_METADATA} metadata {places} must start at layer 0 and increase")
    return tuple(places)


def fun_control_config(shapes: dict[str, tuple], metadata: dict[str, str]) -> FunControlConfig:
    """The patch's config from its (unprefixed) tensor shapes and safetensors metadata."""
    count = _count_blocks(shapes)
    if count == 0:
        raise ValueError("Fun ControlNet patch has no control_blocks.N.after_proj")
    hidden, width = shapes["control_proj_in.weight"]
    head_dim = shapes["control_blocks.0.attn.q_norm.weight"][0]
    inner = shapes["control_blocks.0.attn.qkv_proj.weight"][0] // 3
    if width % 4 or inner % head_dim:
        raise ValueError(f"Fun ControlNet patch: control_proj_in takes {width} values (not whole 1x2x2 patches) "
                         f"or its attention width {inner} is not a multiple of head_dim {head_dim}")
    return FunControlConfig(
        hidden_size=hidden, num_heads=inner // head_dim, head_dim=head_dim,
        ffn_size=shapes["control_blocks.0.mlp.fc2.weight"][1],
        time_embed_dim=shapes["control_blocks.0.adaln_proj.linear.weight"][1],
        injection_layers=injection_layers(count, metadata),
        curve_form=(metadata[FORM_METADATA] == CURVE_FORM if FORM_METADATA in metadata
                    else shapes["control_blocks.0.adaln_proj.linear.weight"][1] == CURVE_WIDTH),
        inpaint_post_norm=metadata.get(INPAINT_METADATA) == "post_norm",
        control_in_channels=width // 4)


class ControlLayer(JointLayer):
    """An H3 block of the control tower with its output projection (and, for the first, its input one)."""

    def __init__(self, cfg: H3TransformerConfig, first: bool):
        super().__init__(cfg)
        if first:
            self.before_proj = ops.Linear(cfg.hidden_size, cfg.hidden_size, bias=True)
        self.after_proj = ops.Linear(cfg.hidden_size, cfg.hidden_size, bias=True)


class FunControlNet(nn.Module):
    """The patch's weights and the two steps of its control stream (see the module docstring)."""

    def __init__(self, config: FunControlConfig | None = None):
        super().__init__()
        cfg = self.config = config or FunControlConfig()
        block_cfg = cfg.block_config()
        self.control_proj_in = ops.Linear(cfg.input_width, cfg.hidden_size, bias=True)
        self.control_blocks = nn.ModuleList([ControlLayer(block_cfg, first=i == 0)
                                             for i in range(len(cfg.injection_layers))])

    def check_modulation(self, time_embedding_width: int) -> None:
        """Refuse a model whose time embeddings are not the width this patch's modulation reads."""
        expected = self.control_blocks[0].adaln_proj.linear.in_features
        if time_embedding_width != expected:
            raise ValueError(f"the patch's modulation takes {expected}-wide time embeddings but the model gives "
                             f"{time_embedding_width}: one is curve-form (pruned) and the other is not; use a "
                             "patch made for this model's form")

    def project_hint(self, rows: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """control_proj_in over hint rows, returned on `like`'s device and dtype.

        The layer is float32 in the released files; a quantized one computes in float32.
        """
        weight = self.control_proj_in.weight
        compute_dtype = weight.dtype if weight.is_floating_point() else torch.float32
        return self.control_proj_in(rows.to(like.device, compute_dtype)).to(like.dtype)

    def open_stream(self, stream: torch.Tensor, hint_rows: torch.Tensor, context: BlockContext) -> torch.Tensor:
        """The control stream at the first injection layer, from the stream entering it and the hint rows.

        Target video rows take the projected hint; keyframe and reference video rows take the projection
        of an all-zero hint; every other row (text, audio) keeps the stream's value.
        """
        self.check_modulation(context.t_emb.shape[-1])
        control = stream.clone()
        for seg in context.layout.segments:
            if seg.role is Role.VIDEO:
                hint = hint_rows
            elif seg.role in VISUAL_CONDITION_ROLES:
                hint = torch.zeros(seg.stop - seg.start, hint_rows.shape[1], dtype=hint_rows.dtype,
                                   device=hint_rows.device)
            else:
                continue
            if (where := context.rows_here(seg.start, seg.stop)) is None:
                continue  # sequence parallel: another rank holds these rows
            here, within = where
            control[here] = self.project_hint(hint[within], stream)
        return stream + self.control_blocks[0].before_proj(control)

    def advance(self, order: int, control: torch.Tensor, context: BlockContext) -> tuple[torch.Tensor, torch.Tensor]:
        """Run control block `order`: (the control stream after it, the skip it adds to the base stream)."""
        layer = self.control_blocks[order]
        after = layer(control, context.t_emb, context.rows, context.rope)
        return after, layer.after_proj(after)


def hint_rows(hint: torch.Tensor, width: int) -> torch.Tensor:
    """(C, T, H, W) hint latent -> float32 rows of its 2x2 patches, zero-padded to `width` values."""
    patches = packing.patchify_video(packing.pad_to_patches(hint.float()))     # (rows, C * 4)
    if patches.shape[1] > width:
        raise ValueError(f"the control hint has {patches.shape[1]} values per patch but the patch takes {width}")
    rows = patches.new_zeros(patches.shape[0], width)
    rows[:, :patches.shape[1]] = patches
    return rows


def hint_frame_count(latent_t: int) -> int:
    """Pixel frames the hint is encoded from for `latent_t` latent frames: ((t - 2) // 5) * 17 + 5."""
    return max((latent_t - 2) // 5, 0) * 17 + 5


Encode = Callable[[torch.Tensor], torch.Tensor]
Fit = Callable[[torch.Tensor, int, int], torch.Tensor]


def control_hint(size: tuple[int, int, int], *, encode: Encode, fit: Fit, control_video: torch.Tensor | None,
                 mask: torch.Tensor | None, source_video: torch.Tensor | None,
                 masked_pixels_post_norm: bool = False) -> torch.Tensor:
    """The (C, T', H, W) hint latent for a target of latent size `size` = (T', H, W).

    `encode(frames (T, H, W, 3) in 0..1) -> (1, 24, T', H, W)` is the video VAE and `fit(frames, width, height)`
    resizes with a centre crop. Without a mask the hint is the encoded control video (24 channels); with one
    it is [encoded control video, or zeros | where the source shows (1) | the encoded source, blanked where
    the mask repaints] (49 channels), the middle channel brought to latent size by trilinear resampling.
    """
    latent_t, latent_h, latent_w = size
    frame_count = hint_frame_count(latent_t)
    width, height = latent_w * SPATIAL_RATIO, latent_h * SPATIAL_RATIO

    def fitted(frames: torch.Tensor) -> torch.Tensor:
        # A video shorter than the target holds its last frame.
        missing = frame_count - frames.shape[0]
        if missing > 0:
            frames = torch.cat([frames, frames[-1:].expand(missing, *frames.shape[1:])])
        return fit(frames[:frame_count, ..., :3], width, height)

    def encoded(frames: torch.Tensor) -> torch.Tensor:
        latent = encode(frames).float()[0]
        if tuple(latent.shape[1:]) != size:
            raise ValueError(f"the control video encodes to latent size {tuple(latent.shape[1:])}, but the target "
                             f"is {size}")
        return latent

    control = None if control_video is None else encoded(fitted(control_video))
    if mask is None:
        return control
    if masked_pixels_post_norm:
        raise ValueError("this patch fills masked pixels in its 'post_norm' mode, which Weft does not build; "
                         "use it with a control video and no mask")
    repaint = (mask.reshape(-1, *mask.shape[-2:]) > 0.5).float()                  # (frames, H0, W0)
    repaint = fitted(repaint.unsqueeze(-1).expand(*repaint.shape, 3))[..., 0] > 0.5
    shown = (~repaint).float().unsqueeze(-1)                                       # (T, H, W, 1)
    source = (torch.zeros(frame_count, height, width, 3) if source_video is None else fitted(source_video))
    masked_source = encoded(source * shown)
    shown_latent = F.interpolate(shown[None, None, ..., 0], size=size, mode="trilinear", align_corners=False)[0]
    if control is None:
        control = torch.zeros_like(masked_source)
    return torch.cat([control, shown_latent, masked_source], dim=0)


class _ControlRun:
    """One forward's control stream: started at the first injection layer, advanced at each of them."""

    def __init__(self, hook: "FunControlHook", context: BlockContext, rows: torch.Tensor) -> None:
        self.net, self.strength, self.context, self.rows = hook.net, hook.strength, context, rows
        self.order_of = {layer: order for order, layer in enumerate(hook.net.config.injection_layers)}
        # The patch steers the picture only: its skip is zeroed on every audio row (those this rank holds).
        self.audio_rows = [where[0] for seg in context.layout.segments
                           if seg.role in AUDIO_ROLES and (where := context.rows_here(seg.start, seg.stop)) is not None]
        self.control: torch.Tensor | None = None

    def __call__(self, index: int, block_input: torch.Tensor, block_output: torch.Tensor) -> torch.Tensor:
        order = self.order_of.get(index)
        if order is None:
            return block_output
        if order == 0:
            self.control = self.net.open_stream(block_input, self.rows, self.context)
        self.control, skip = self.net.advance(order, self.control, self.context)
        for rows in self.audio_rows:
            skip[rows] = 0
        return torch.add(block_output, skip.to(block_output.dtype), alpha=self.strength)


class FunControlHook:
    """A block hook (models/h3/transformer.py) that runs a Fun ControlNet patch inside the H3 transformer.

    `encode` and `fit` are as `control_hint` takes them; the hint is built on first use for each latent size.
    """

    def __init__(self, net: FunControlNet, encode: Encode, fit: Fit, *, strength: float,
                 sigma_start: float, sigma_end: float, control_video: torch.Tensor | None = None,
                 mask: torch.Tensor | None = None, source_video: torch.Tensor | None = None) -> None:
        if control_video is None and mask is None:
            raise ValueError("a Fun ControlNet needs a control video or a mask")
        self.net = net
        self.strength = float(strength)
        self.sigma_start, self.sigma_end = float(sigma_start), float(sigma_end)
        self._hint_inputs = dict(encode=encode, fit=fit, control_video=control_video, mask=mask,
                                 source_video=source_video, masked_pixels_post_norm=net.config.inpaint_post_norm)
        self._hints: dict[tuple[int, int, int], torch.Tensor] = {}
        self._lock = threading.Lock()

    def hint(self, size: tuple[int, int, int]) -> torch.Tensor:
        """The hint latent for a target of latent size (T', H, W), built once per size."""
        with self._lock:
            if size not in self._hints:
                self._hints[size] = control_hint(size, **self._hint_inputs)
            return self._hints[size]

    def begin(self, context: BlockContext) -> Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor] | None:
        """The per-forward runner, or None when this step's sigma is outside the patch's range."""
        if self.strength == 0 or not self.sigma_end <= context.sigma_video <= self.sigma_start:
            return None
        layers = self.net.config.injection_layers
        if layers[-1] >= context.num_layers:
            raise ValueError(f"the patch injects at layers {list(layers)}, but the model has {context.num_layers}")
        hint = self.hint(context.latent_size)  # the whole clip's hint; a context window takes its own frames
        if context.window is not None:
            hint = hint[:, list(context.window.video)]
        return _ControlRun(self, context, hint_rows(hint, self.net.config.input_width))
