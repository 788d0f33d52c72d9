"""What the tests over the real chat templates of ``../shared/chat-templates`` share: where they
are, their names (the calling test module is skipped when they are not checked out), the
standard conversation with a tool call, and what each template does with it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

TEMPLATES_DIR = Path(__file__).resolve().parents[2].parent / "shared" / "chat-templates"


def real_templates() -> list[str]:
    """The template file names, sorted; skips the importing module when there are none."""
    if not TEMPLATES_DIR.is_dir():
        pytest.skip(
            f"the real chat templates are not checked out next to the repo ({TEMPLATES_DIR})",
            allow_module_level=True,
        )
    return sorted(p.name for p in TEMPLATES_DIR.glob("*.jinja"))


UNSAFE_APPEND = "access to attribute 'append' of 'list' object is unsafe."
# Content format per vLLM 0.33's own `_detect_content_format` (checked against its source),
# and the error each template raises on CONVERSATION as vLLM hands it over (None: renders).
EXPECTED: dict[str, tuple[str, str | None]] = {
    "deepseek-r1-distill-qwen.jinja": ("string", None),
    # the official template concatenates the arguments: it needs a string, vLLM sends a dict
    "deepseek-v3.1.jinja": ("string", 'can only concatenate str (not "dict") to str'),
    "deepseek-v3.2-llamacpp.jinja": ("string", None),
    # "openai" format turns the tool-call message's `content: None` into [], and the template
    # reads content[0]['text']
    "devstral-small-2507-unsloth.jinja": ("openai", "list object has no element 0"),
    "glm-4.6.jinja": ("openai", None),
    "glm-4.7-flash.jinja": ("openai", None),
    "gpt-oss.jinja": ("string", None),
    "hermes-3-tool-use.jinja": ("string", None),
    # llama.cpp copies call list.append, which the immutable sandbox forbids
    "kimi-k2-instruct-0905.jinja": ("string", UNSAFE_APPEND),
    "kimi-k2-instruct.jinja": ("openai", None),
    "kimi-k2-thinking.jinja": ("string", UNSAFE_APPEND),
    "llama-3.1.jinja": ("string", None),
    "minimax-m2.jinja": ("openai", None),
    "mistral-nemo.jinja": ("string", None),
    "mistral-small-3.2.jinja": ("openai", None),
    "qwen3-coder.jinja": ("string", None),
    "qwen3.5.jinja": ("openai", None),
    "qwen3.jinja": ("string", None),
    "qwq-32b.jinja": ("string", None),
    "vllm-deepseek-r1-0528.jinja": ("string", None),
    "vllm-deepseek-v3.1.jinja": ("string", None),
    "vllm-deepseek-v3.jinja": ("string", None),
    "vllm-hermes.jinja": ("string", None),
    "vllm-llama-3.1-json.jinja": ("openai", None),
    "vllm-mistral.jinja": ("string", None),
}
# The templates that cannot render CONVERSATION, and their own error.
KNOWN_ERRORS = {name: error for name, (_, error) in EXPECTED.items() if error is not None}

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather for a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "City name"}},
                "required": ["city"],
            },
        },
    }
]
# As an OpenAI client sends it back: arguments as a JSON string, content None on the call.
CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What's the weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "reasoning": "The user wants the weather in Paris; call the tool.",
        "tool_calls": [
            {
                "id": "call12345",  # Mistral templates want 9 alphanumerics
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call12345", "content": '{"temp_c": 18, "sky": "cloudy"}'},
    {
        "role": "assistant",
        "content": "It is 18 °C and cloudy in Paris.",
        "reasoning": "The tool says 18 °C and cloudy.",
    },
    {"role": "user", "content": "And in Berlin?"},
]
