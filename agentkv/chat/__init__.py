"""Chat rendering primitives shared by the simulator and the SDK's local renderer.

A real ``tokenizers`` tokenizer (:func:`load_tokenizer`; the default is the real Qwen3
vocabulary) and chat templates rendered exactly as Hugging Face ``transformers`` renders them,
after vLLM's message preprocessing (:class:`ChatTemplate`). Needs ``jinja2`` and ``tokenizers``
(extras ``agentkv[tokenizers]`` or ``agentkv[serve]``).
"""

from __future__ import annotations

from agentkv.chat.template import (
    ChatTemplate,
    ContentFormat,
    TemplateError,
    detect_content_format,
    load_template,
    preprocess_messages,
)
from agentkv.chat.tokenizer import (
    ChatTokenizer,
    cache_dir,
    deepseek_tokenizer_path,
    default_tokenizer_dir,
    load_tokenizer,
)

__all__ = [
    "ChatTemplate",
    "ChatTokenizer",
    "ContentFormat",
    "TemplateError",
    "cache_dir",
    "deepseek_tokenizer_path",
    "default_tokenizer_dir",
    "detect_content_format",
    "load_template",
    "load_tokenizer",
    "preprocess_messages",
]
