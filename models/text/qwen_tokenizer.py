"""Qwen2's byte-level BPE tokenizer as H3's Qwen3-VL text encoder reads it, built with the `tokenizers` library.

Files. The vocabulary does not ship inside the released safetensors, and Weft ships none. A user puts
`vocab.json` and `merges.txt` in a folder named `qwen25_tokenizer` beside the text-encoder checkpoint
(`models/text_encoders/qwen25_tokenizer/` in the usual layout). The same two files come with every
Qwen2.5, Qwen3 and Qwen3-VL release on Hugging Face, and ComfyUI carries them in its
`comfy/text_encoders/qwen25_tokenizer/` folder, so that folder can be copied as it is. A
`tokenizer_config.json` there is optional; when present, the added tokens it lists must agree with
the table below (a tokenizer of another model family is refused instead of silently shifting ids).

Ids. `vocab.json` holds the byte-level pieces (151,643 of them, ids 0..151642, in the real file).
Qwen adds 26 tokens at 151643..151668 and H3's release seven more at 151669..151675. All 33 keep
these ids whatever vocabulary is loaded: the tiny vocabulary the project trains for its tests
(`write_tiny_tokenizer`) has a few hundred pieces but the same added ids, so a tiny Qwen3-VL keeps the
real embedding table's row count (151,936, more than the last added id).

Text. There is no weight syntax: parentheses are text, and the escapes `\\(` and `\\)` become `(` and
`)`. No BOS or EOS is added. An added token written in the text (`<d>`, `<|cutoff|>`) becomes its id.
The encoding is the one of transformers' `Qwen2Tokenizer` (NFC, Qwen's split pattern, byte-level BPE);
`tests/models/text/test_qwen_tokenizer.py` checks that they agree.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

TOKENIZER_FOLDER = "qwen25_tokenizer"
VOCAB_FILE = "vocab.json"
MERGES_FILE = "merges.txt"
CONFIG_FILE = "tokenizer_config.json"
REQUIRED_FILES = (VOCAB_FILE, MERGES_FILE)
WHERE_TO_GET = (f"Copy {VOCAB_FILE} and {MERGES_FILE} from a Qwen2.5 or Qwen3-VL release on Hugging Face "
                f"(for example Qwen/Qwen3-VL-32B-Instruct) or from ComfyUI's comfy/text_encoders/{TOKENIZER_FOLDER}/ "
                f"folder into that folder.")

# How Qwen2 splits text into words before byte-level BPE: contractions, letter runs with one leading
# non-letter, single digits, punctuation runs, newlines, then the remaining whitespace.
SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclass(frozen=True)
class AddedTokenSpec:
    """A token matched whole in the text before BPE, with the id the model's embedding expects."""
    id: int
    content: str
    special: bool  # dropped by decode(skip_special=True)


_QWEN_ADDED = (
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True),
    ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False), ("<|fim_pad|>", False),
    ("<|repo_name|>", False), ("<|file_sep|>", False), ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False),
)
_MINIMAX_ADDED = ("<d>", "</d>", "<|cutoff|>", "<|lyrics_start|>", "<|lyrics_end|>", "<|caption_start|>",
                  "<|caption_end|>")

FIRST_ADDED_ID = 151643
QWEN_ADDED_TOKENS = tuple(AddedTokenSpec(FIRST_ADDED_ID + i, content, special)
                          for i, (content, special) in enumerate(_QWEN_ADDED))
MINIMAX_ADDED_TOKENS = tuple(AddedTokenSpec(QWEN_ADDED_TOKENS[-1].id + 1 + i, content, True)
                             for i, content in enumerate(_MINIMAX_ADDED))
ADDED_TOKENS = QWEN_ADDED_TOKENS + MINIMAX_ADDED_TOKENS

_ID_OF = {spec.content: spec.id for spec in ADDED_TOKENS}
PAD_ID = _ID_OF["<|endoftext|>"]            # also what an empty prompt encodes to
VISION_START_ID = _ID_OF["<|vision_start|>"]
VISION_END_ID = _ID_OF["<|vision_end|>"]
IMAGE_PAD_ID = _ID_OF["<|image_pad|>"]      # one per merged image patch; the encoder puts vision features there
VIDEO_PAD_ID = _ID_OF["<|video_pad|>"]      # the same for video frames


def unescape_prompt(text: str) -> str:
    """ComfyUI's prompt escapes without its weight syntax: `\\(` and `\\)` become `(` and `)`."""
    return text.replace("\\(", "(").replace("\\)", ")")


class QwenTokenizer:
    """Qwen2 byte-level BPE over a given vocabulary, with Qwen's and H3's added tokens at their fixed ids."""

    def __init__(self, vocab: dict[str, int], merges: list[tuple[str, str]], *, source: str = "the vocabulary"):
        for spec in ADDED_TOKENS:
            if vocab.get(spec.content, spec.id) != spec.id:
                raise ValueError(f"{source} gives {spec.content} the id {vocab[spec.content]}; Qwen3-VL "
                                 f"expects {spec.id}. This is not a Qwen2/Qwen3 tokenizer.")
        added_ids = {spec.id for spec in ADDED_TOKENS}
        clashing = sorted(piece for piece, i in vocab.items() if i in added_ids and _ID_OF.get(piece) != i)
        if clashing:
            raise ValueError(f"{source} uses ids reserved for Qwen's added tokens ({FIRST_ADDED_ID} and up) "
                             f"for {clashing[:3]}. This is not a Qwen2/Qwen3 tokenizer.")
        # The added tokens go into the BPE vocabulary at their ids; `tokenizers` would otherwise number
        # them after the largest vocabulary id, which is wrong for any vocabulary but the full one.
        full_vocab = dict(vocab)
        full_vocab.update(_ID_OF)
        try:
            bpe = models.BPE(vocab=full_vocab, merges=merges, dropout=None, unk_token=None, fuse_unk=False,
                             byte_fallback=False)
        except Exception as exc:  # the library reports a merge of unknown pieces as a bare Exception
            raise ValueError(f"{source} and its merges do not belong together ({exc}); take both files from "
                             f"the same release") from None
        self._tokenizer = _with_qwen_pipeline(Tokenizer(bpe))
        for spec in ADDED_TOKENS:
            token = AddedToken(spec.content, special=spec.special, normalized=False, lstrip=False, rstrip=False,
                               single_word=False)
            (self._tokenizer.add_special_tokens if spec.special else self._tokenizer.add_tokens)([token])
        for spec in ADDED_TOKENS:  # the construction above must not have renumbered anything
            if self._tokenizer.token_to_id(spec.content) != spec.id:
                raise RuntimeError(f"the tokenizers library numbered {spec.content} "
                                   f"{self._tokenizer.token_to_id(spec.content)} instead of {spec.id}")
        self.piece_count = len(vocab)

    @classmethod
    def from_folder(cls, folder: str | Path) -> QwenTokenizer:
        """Load vocab.json and merges.txt (and check tokenizer_config.json when present) from `folder`."""
        folder = Path(folder)
        missing = [name for name in REQUIRED_FILES if not (folder / name).is_file()]
        if missing:
            raise FileNotFoundError(
                f"The Qwen3-VL tokenizer file {missing[0]} is missing: looked in {folder.resolve()}"
                f"{' (the folder does not exist)' if not folder.is_dir() else ''}. {WHERE_TO_GET}")
        vocab = _read_vocab(folder / VOCAB_FILE)
        merges = _read_merges(folder / MERGES_FILE)
        if (folder / CONFIG_FILE).is_file():
            _check_config(folder / CONFIG_FILE)
        return cls(vocab, merges, source=str(folder / VOCAB_FILE))

    def encode(self, text: str) -> list[int]:
        """Token ids of one piece of prompt text (escapes resolved, nothing added; "" gives [])."""
        text = unescape_prompt(text)
        if not text:
            return []
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], *, skip_special: bool = False) -> str:
        """Text of token ids; added tokens marked special are left out when `skip_special`."""
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special)

    def token_to_id(self, token: str) -> int | None:
        """The id of one vocabulary piece or added token, None when it has none."""
        return self._tokenizer.token_to_id(token)


def tokenizer_folder_beside(checkpoint: str | Path) -> Path:
    """Where the tokenizer of a Qwen3-VL checkpoint is looked for: `qwen25_tokenizer/` in its folder."""
    return Path(checkpoint).parent / TOKENIZER_FOLDER


def load_tokenizer_beside(checkpoint: str | Path) -> QwenTokenizer:
    """The tokenizer in the `qwen25_tokenizer/` folder beside a Qwen3-VL checkpoint."""
    return QwenTokenizer.from_folder(tokenizer_folder_beside(checkpoint))


def _with_qwen_pipeline(tokenizer: Tokenizer) -> Tokenizer:
    # Shared by loading and by training, so the trained merges fit the way text is split when encoding.
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _read_vocab(path: Path) -> dict[str, int]:
    try:
        vocab = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not a JSON vocabulary ({exc}). {WHERE_TO_GET}") from None
    if not isinstance(vocab, dict) or not all(isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool)
                                              for k, v in vocab.items()):
        raise ValueError(f"{path} must map each vocabulary piece to an integer id. {WHERE_TO_GET}")
    return vocab


def _read_merges(path: Path) -> list[tuple[str, str]]:
    merges = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line or (number == 1 and line.startswith("#version")):
            continue
        parts = line.split(" ")
        if len(parts) != 2:
            raise ValueError(f"{path} line {number} is not a merge of two pieces separated by one space: {line!r}")
        merges.append((parts[0], parts[1]))
    return merges


def _check_config(path: Path) -> None:
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not JSON ({exc}); remove it or replace it with the release's file") from None
    declared = config.get("added_tokens_decoder", {}) if isinstance(config, dict) else {}
    for key, entry in declared.items():
        content = entry.get("content") if isinstance(entry, dict) else None
        expected = _ID_OF.get(content)
        if not key.isdigit() or expected != int(key):
            raise ValueError(f"{path} declares the added token {content!r} with id {key}; Qwen3-VL's tokenizer "
                             f"has {'no such token' if expected is None else f'it at {expected}'}. "
                             f"This is not a Qwen2/Qwen3 tokenizer.")


# ---- the tiny tokenizer the tests and `make_tiny` use ----

TINY_PIECE_COUNT = 512  # the trainer's ceiling: the byte alphabet (256) plus merges seen twice in TINY_CORPUS

# Our own sentences, in the register of video prompts. The trainer sees each line once, in this order.
TINY_CORPUS = (
    "A red fox runs across a snowy field at dawn while the camera follows from a low angle.",
    "The woman turns toward the window and smiles; soft light falls on her face.",
    "Rain drips from the roof of an old wooden house as thunder rolls in the distance.",
    "A close-up of hands shaping wet clay on a spinning wheel, slow and steady.",
    "Two children chase each other through tall grass, laughing, in the late afternoon sun.",
    "The city at night: neon signs reflect in puddles and cars pass with a low hum.",
    "An astronaut floats inside the station, reaching for a pen that drifts away.",
    "Waves crash against black rocks; seabirds call above the spray.",
    "A chef slices onions quickly on a wooden board, then sweeps them into a hot pan.",
    "The drummer counts in, and the band starts playing a fast song on a small stage.",
    "Snow falls silently on a mountain village; smoke rises from every chimney.",
    "A cat watches a moth circle the lamp, its tail twitching.",
    "The train leaves the station slowly, and a man on the platform waves goodbye.",
    "Sunlight flickers through the leaves of a forest path after the rain.",
    "A singer holds a long note while the crowd raises their phones.",
    "The old man reads a letter aloud in a quiet voice, then folds it carefully.",
    "Fireworks burst over the harbour, red, green and gold, reflected in the water.",
    "A girl in a yellow coat opens a red umbrella and steps into the street.",
    "Camera: slow dolly in. Lighting: warm, golden hour. Mood: calm and hopeful.",
    "He says: \"We leave at seven.\" She answers: \"Then we should pack tonight.\"",
    "Dialogue in English and Chinese: 你好，今天天气很好。我们去公园吧。",
    "Numbers and timing: 3 seconds, 12 frames, 24 fps, 1344 by 768 pixels, version 2.5.",
    "The dog barks twice, the door opens, and footsteps echo down the hallway.",
    "Steam rises from a cup of coffee on a table by the window on a cold morning.",
    "A skateboarder rolls down the ramp, jumps, and lands cleanly as friends cheer.",
    "Close shot of an eye; the pupil narrows as a bright light turns on.",
    "The violinist plays softly; the melody rises and then fades to silence.",
    "Traffic lights change from red to green and the crowd crosses the wide street.",
    "In the desert, wind lifts sand over the dunes under a pale sky.",
    "A robot arm picks up a glass cube and places it gently on a shelf.",
)


def train_tiny_vocabulary() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A small byte-level BPE vocabulary and its merges, trained deterministically on TINY_CORPUS."""
    tokenizer = _with_qwen_pipeline(Tokenizer(models.BPE()))
    trainer = trainers.BpeTrainer(vocab_size=TINY_PIECE_COUNT, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tokenizer.train_from_iterator(TINY_CORPUS, trainer=trainer)
    model = json.loads(tokenizer.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    return dict(model["vocab"]), merges


def write_tiny_tokenizer(folder: str | Path) -> Path:
    """Write the tiny tokenizer (vocab.json, merges.txt, tokenizer_config.json) into `folder`; returns it."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    vocab, merges = train_tiny_vocabulary()
    (folder / VOCAB_FILE).write_text(json.dumps(vocab, ensure_ascii=False, indent=None), encoding="utf-8")
    (folder / MERGES_FILE).write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges),
                                      encoding="utf-8")
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "add_prefix_space": False,
        "bos_token": None,
        "pad_token": "<|endoftext|>",
        "eos_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 131072,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "added_tokens_decoder": {
            str(spec.id): {"content": spec.content, "special": spec.special, "normalized": False,
                           "lstrip": False, "rstrip": False, "single_word": False}
            for spec in ADDED_TOKENS},
    }
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return folder
