"""Video and sound nodes: make, take apart, load, save and join VIDEO values; load, save and preview AUDIO.

The values and their codecs live in `media.video` and `media.audio`; these nodes check their inputs,
pick the folders and call them. Every sound they write is checked (`nodes.audio_health`): its figures
join the node's UI output under `audio_health`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from execution.context import current
from media.audio import LOSSY_FORMATS, check_audio, decode_audio, write_flac, write_lossy
from media.image import check_image
from media.video import (
    AUDIO_EXTENSIONS, VIDEO_CODECS, VIDEO_EXTENSIONS, VIDEO_FORMATS, EncodedPieces, Video, VideoComponents, VideoConcat,
    VideoFile, VideoTrim, as_frame_rate, check_video,
)
from execution.types import AUDIO_HEALTH_KEY
from nodes.audio_health import checked_clips, checked_video_sound
from nodes.files import file_metadata, output_target, temp_prefix
from nodes.spec import Input, NodeOutput, NodeSpec, Output

ENCODED_PIECES_KEY = "mp4_encoded_pieces"  # the runtime's store of encoded clip pictures (media.video.EncodedPieces)


def _as_list(value: Any) -> list:
    return value if isinstance(value, list) else [value]


def _create_video(images: torch.Tensor, fps: float, audio: dict | None = None,
                  bit_depth: int | str = "auto") -> tuple[Video]:
    images = check_image("CreateVideo", images, "images")
    if audio is not None:
        audio = check_audio("CreateVideo", audio)
    depth = 8 if bit_depth == "auto" else int(bit_depth)
    return (VideoComponents(images=images, audio=audio, frame_rate=as_frame_rate(fps), bit_depth=depth),)


def _get_video_components(video: Video) -> tuple[torch.Tensor, dict | None, float]:
    parts = check_video("GetVideoComponents", video).get_components()
    return parts.images, parts.audio, float(parts.frame_rate)


def _load_video(file: Path) -> tuple[Video]:
    try:
        return (VideoFile(file),)
    except ValueError as exc:
        raise ValueError(f"LoadVideo: {exc}") from None


def _save_video(video: Video, filename_prefix: str, format: str, codec: str,
                prompt: Any = None, extra_pnginfo: Any = None) -> NodeOutput:
    video = check_video("SaveVideo", video)
    ctx = current()
    width, height = video.get_dimensions()
    path, filename, subfolder = output_target("output", filename_prefix, "mp4", width=width, height=height)
    try:
        # A joined clip's parts encoded by an earlier save are reused (the runtime's store; see EncodedPieces).
        video.save_to(path, format=format, codec=codec, metadata=file_metadata(prompt, extra_pnginfo),
                      progress=lambda done, total: ctx.progress(done, total),
                      pieces=ctx.runtime.shared(ENCODED_PIECES_KEY, EncodedPieces))
    except ValueError as exc:
        raise ValueError(f"SaveVideo: {exc}") from None
    written = {"filename": filename, "subfolder": subfolder, "type": "output"}
    ui = {"images": [written], "animated": (True,)}
    health = checked_video_sound("SaveVideo", video, written)
    if health:
        ui[AUDIO_HEALTH_KEY] = health
    return NodeOutput.of(video, ui=ui)


def _concatenate_video(videos: dict, codec: Any, complete_audio: Any = None) -> tuple[Video]:
    # Declared input_is_list, so every input, widgets included, arrives as a list.
    node = "ConcatenateVideo"
    clips = [check_video(node, clip, name) for name, slot in videos.items() for clip in _as_list(slot)]
    chosen_codec = _as_list(codec)[0] if codec is not None else "auto"
    if chosen_codec not in VIDEO_CODECS:
        raise ValueError(f"{node}: codec {chosen_codec!r} cannot be written; the choices are {VIDEO_CODECS}")
    soundtrack = _as_list(complete_audio)[0] if complete_audio is not None else None
    if soundtrack is not None:
        soundtrack = check_audio(node, soundtrack, "complete_audio")
    try:
        return (VideoConcat(clips, audio=soundtrack, codec=chosen_codec),)
    except ValueError as exc:
        raise ValueError(f"{node}: {exc}") from None


def _video_slice(video: Video, start_time: float, duration: float,
                 strict_duration: bool) -> tuple[Video]:
    node = "Video Slice"
    video = check_video(node, video)
    if start_time == 0 and duration == 0:
        return (video,)
    try:
        trimmed = VideoTrim(video, start_time, duration)
    except ValueError as exc:
        raise ValueError(f"{node}: {exc}") from None
    if strict_duration and duration > 0 and trimmed.get_duration() < duration - 1e-6:
        raise ValueError(f"{node}: {duration:g} s from {start_time:g} s were asked for with strict_duration on, "
                         f"but the video has only {trimmed.get_duration():.3f} s there")
    return (trimmed,)


def _load_audio(audio: Path) -> tuple[dict]:
    try:
        loaded = decode_audio(audio)
    except ValueError as exc:
        raise ValueError(f"LoadAudio: {exc}") from None
    if loaded is None:
        raise ValueError(f"LoadAudio: file {audio.name!r} has no audio stream")
    return (loaded,)


def _write_flacs(node: str, audio: dict, prefix: str, kind: str, metadata: dict) -> dict[str, list[dict]]:
    """Each clip written as a FLAC file: the UI output listing the files and the sound check of each."""
    audio = check_audio(node, audio)
    written = []
    for clip in audio["waveform"]:
        path, filename, subfolder = output_target(kind, prefix, "flac")
        write_flac(path, clip, int(audio["sample_rate"]), metadata=metadata)
        written.append({"filename": filename, "subfolder": subfolder, "type": kind})
    return {"audio": written, AUDIO_HEALTH_KEY: checked_clips(node, audio, written)}


def _save_audio_advanced(audio: dict, filename_prefix: str, format: dict, prompt: Any = None,
                         extra_pnginfo: Any = None) -> NodeOutput:
    node = "SaveAudioAdvanced"
    chosen = format.get("format")
    metadata = file_metadata(prompt, extra_pnginfo)
    if chosen == "flac":
        return NodeOutput.of(audio, ui=_write_flacs(node, audio, filename_prefix, "output", metadata))
    if chosen not in LOSSY_FORMATS:
        raise ValueError(f"{node}: input 'format' is {chosen!r}; the choices are flac, {', '.join(LOSSY_FORMATS)}")
    quality = format.get("quality")
    if quality not in LOSSY_FORMATS[chosen]["qualities"]:
        raise ValueError(f"{node}: input 'format.quality' is {quality!r}; {chosen} takes "
                         f"{', '.join(LOSSY_FORMATS[chosen]['qualities'])}")
    audio = check_audio(node, audio)
    written = []
    for clip in audio["waveform"]:
        path, filename, subfolder = output_target("output", filename_prefix, chosen)
        try:
            write_lossy(path, clip, int(audio["sample_rate"]), format=chosen, quality=quality, metadata=metadata)
        except ValueError as exc:
            raise ValueError(f"{node}: {exc}") from None
        written.append({"filename": filename, "subfolder": subfolder, "type": "output"})
    return NodeOutput.of(audio, ui={"audio": written, AUDIO_HEALTH_KEY: checked_clips(node, audio, written)})


def _save_audio(audio: dict, filename_prefix: str, prompt: Any = None,
                extra_pnginfo: Any = None) -> NodeOutput:
    ui = _write_flacs("SaveAudio", audio, filename_prefix, "output", file_metadata(prompt, extra_pnginfo))
    return NodeOutput.of(audio, ui=ui)


def _preview_audio(audio: dict, prompt: Any = None, extra_pnginfo: Any = None) -> NodeOutput:
    ui = _write_flacs("PreviewAudio", audio, temp_prefix(), "temp", file_metadata(prompt, extra_pnginfo))
    return NodeOutput.of(audio, ui=ui)


_HIDDEN_METADATA = [Input.hidden("prompt", "PROMPT"), Input.hidden("extra_pnginfo", "EXTRA_PNGINFO")]

NODES = [
    NodeSpec(
        node_id="CreateVideo", display_name="Create Video", category="video",
        python_module="comfy_extras.nodes_video",
        description="Makes a VIDEO from a batch of frames played at `fps`, with an optional sound track.",
        execute=_create_video,
        inputs=[
            Input.link("images", "IMAGE", tooltip="Frames of the video, in playing order."),
            Input.float("fps", 30.0, min=1.0, max=120.0, step=1.0),
            Input.link("audio", "AUDIO", optional=True, tooltip="Sound track to play with the frames."),
            Input.combo("bit_depth", ["auto", 8, 10], "auto", optional=True,
                        tooltip="Bits per sample of the H.264 picture when the video is written; auto is 8."),
        ],
        outputs=[Output("VIDEO")],
        search_aliases=("images to video",),
    ),
    NodeSpec(
        node_id="GetVideoComponents", display_name="Get Video Components", category="video",
        python_module="comfy_extras.nodes_video",
        description="Splits a VIDEO into its frames, its sound track and its frame rate.",
        execute=_get_video_components,
        inputs=[Input.link("video", "VIDEO", tooltip="The VIDEO to split.")],
        outputs=[Output("IMAGE", "images"), Output("AUDIO", "audio"), Output("FLOAT", "fps")],
        search_aliases=("extract frames", "split video", "video to images", "demux"),
    ),
    NodeSpec(
        node_id="LoadVideo", display_name="Load Video", category="video", python_module="comfy_extras.nodes_video",
        description="Opens a video file from the input folder, sound included. Only its header is read here; "
                    "frames are decoded by whichever node needs them.",
        # Hashing a whole video on every run would cost more than it saves: size and change time identify it.
        execute=_load_video, inputs=[Input.file("file", extensions=VIDEO_EXTENSIONS, identity="stat", upload="video")],
        outputs=[Output("VIDEO")],
        search_aliases=("import video", "open video", "video file"),
    ),
    NodeSpec(
        node_id="SaveVideo", display_name="Save Video", category="video", python_module="comfy_extras.nodes_video",
        description="Writes the VIDEO as a numbered MP4 file in the output folder: H.264 picture, AAC stereo "
                    "sound at 32 kHz.",
        execute=_save_video, output_node=True,
        inputs=[
            Input.link("video", "VIDEO", tooltip="The VIDEO to write."),
            Input.string("filename_prefix", "video/ComfyUI",
                         tooltip="Start of the file name; a '/' makes a subfolder, %width% and %height% are "
                                 "replaced by the video's size."),
            Input.combo("format", list(VIDEO_FORMATS), "auto", tooltip="Container of the file; auto is MP4."),
            Input.combo("codec", list(VIDEO_CODECS), "auto", tooltip="Picture codec; auto is H.264."),
            *_HIDDEN_METADATA,
        ],
        outputs=[Output("VIDEO", "video", tooltip="The same VIDEO that came in.")],
        search_aliases=("export video",),
    ),
    NodeSpec(
        node_id="ConcatenateVideo", display_name="Concatenate Video", category="video",
        python_module="comfy_extras.nodes_video",
        description="Plays videos back to back, sound included; every clip must have the first one's size and "
                    "frame rate.",
        execute=_concatenate_video, input_is_list=True,
        inputs=[
            Input.autogrow("videos", Input.link("video", "VIDEO", tooltip="One clip of the sequence."),
                           prefix="video", min=1, max=100, tooltip="Clips, played from the first slot to the last."),
            Input.combo("codec", list(VIDEO_CODECS), "auto",
                        tooltip="Picture codec used when the joined video is written; auto is H.264."),
            Input.link("complete_audio", "AUDIO", optional=True,
                       tooltip="A sound track for the joined video; when connected, the clips' own sound is "
                               "dropped."),
        ],
        outputs=[Output("VIDEO", tooltip="The clips as one VIDEO.")],
    ),
    NodeSpec(
        node_id="Video Slice", display_name="Video Slice", category="video",
        python_module="comfy_extras.nodes_video",
        description="Keeps a stretch of a video, sound included: from start_time for duration seconds. With both "
                    "at 0 the video passes unchanged.",
        execute=_video_slice,
        inputs=[
            Input.link("video", "VIDEO", tooltip="The VIDEO to cut."),
            Input.float("start_time", 0.0, min=0.0, max=1e5, step=0.001,
                        tooltip="Seconds into the video where the stretch begins."),
            Input.float("duration", 0.0, min=0.0, max=1e5, step=0.001,
                        tooltip="Seconds to keep; 0 keeps everything from start_time on."),
            Input.boolean("strict_duration", False,
                          tooltip="On: a video too short to give the whole duration is an error instead of a "
                                  "shorter stretch."),
        ],
        outputs=[Output("VIDEO")],
        search_aliases=("trim video", "cut video", "video trim"),
    ),
    NodeSpec(
        node_id="LoadAudio", display_name="Load Audio", category="audio", python_module="comfy_extras.nodes_audio",
        description="Reads the first sound track of a sound or video file in the input folder.",
        execute=_load_audio, inputs=[Input.file("audio", extensions=AUDIO_EXTENSIONS + VIDEO_EXTENSIONS, upload="audio")],
        outputs=[Output("AUDIO")],
        search_aliases=("import audio", "open audio", "audio file"),
    ),
    NodeSpec(
        node_id="SaveAudio", display_name="Save Audio (FLAC)", category="audio",
        python_module="comfy_extras.nodes_audio",
        description="Writes every clip of the AUDIO as a numbered 16-bit FLAC file in the output folder.",
        execute=_save_audio, output_node=True,
        inputs=[Input.link("audio", "AUDIO"), Input.string("filename_prefix", "audio/ComfyUI"), *_HIDDEN_METADATA],
        outputs=[Output("AUDIO", "audio")],
        search_aliases=("export flac",),
    ),
    NodeSpec(
        node_id="PreviewAudio", display_name="Preview Audio", category="audio",
        python_module="comfy_extras.nodes_audio",
        description="Plays the sound in the editor; the file goes to the temporary folder rather than the output "
                    "folder.",
        execute=_preview_audio, output_node=True,
        inputs=[Input.link("audio", "AUDIO"), *_HIDDEN_METADATA],
        outputs=[Output("AUDIO", "audio")],
        search_aliases=("preview", "preview audio", "play audio"),
    ),
    NodeSpec(
        node_id="SaveAudioAdvanced", display_name="Save Audio", category="audio",
        python_module="comfy_extras.nodes_audio",
        description="Writes every clip of the AUDIO as a numbered file in the output folder: FLAC (lossless), "
                    "MP3 or Opus at the quality chosen.",
        execute=_save_audio_advanced, output_node=True,
        inputs=[
            Input.link("audio", "AUDIO"), Input.string("filename_prefix", "audio/ComfyUI"),
            Input.dynamic_combo("format", {
                "flac": [],
                "mp3": [Input.combo("quality", list(LOSSY_FORMATS["mp3"]["qualities"]), "V0",
                                    tooltip="V0: variable bit rate at LAME's best level; or a constant bit rate.")],
                "opus": [Input.combo("quality", list(LOSSY_FORMATS["opus"]["qualities"]), "128k",
                                     tooltip="Constant bit rate; the sound is resampled to 48 kHz when Opus cannot "
                                             "take its rate.")],
            }, tooltip="File format: FLAC keeps every sample, MP3 and Opus are smaller."),
            *_HIDDEN_METADATA,
        ],
        outputs=[Output("AUDIO", "audio")],
        search_aliases=("save audio", "export audio", "mp3", "opus", "flac"),
    ),
]
