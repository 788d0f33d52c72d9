from __future__ import annotations

import json
import random
import re
from itertools import pairwise
from typing import Any

import pytest
from pydantic import ValidationError

from agentkv.protocol.deltas import ToolCall
from agentkv.sim.outputs import (
    ParsedOutput,
    join_deltas,
    parse_output,
    stream_deltas,
)
from agentkv.sim.script import (
    HERMES,
    QWEN3_CODER,
    ScriptToolCall,
    SimScript,
    generate_text,
    native_syntax_for,
    render_script,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "scale": {"type": "number"},
                "hourly": {"type": "boolean"},
                "where": {"type": "object"},
                "tags": {"type": "array", "items": {"type": "integer"}},
                "note": {"type": ["string", "null"]},
                "code": {"type": "string"},
            },
        },
    },
}
TOOLS = [WEATHER]
ID = re.compile(r"chatcmpl-tool-[0-9a-f]{16}")


def hermes_call(name: str, arguments: Any) -> str:
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def calls(parsed: ParsedOutput) -> list[tuple[str, Any]]:
    return [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]


# -- reasoning -------------------------------------------------------------------------------
@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
def test_reasoning_keeps_the_models_newlines(parser: Any) -> None:
    out = parse_output("<think>\nLet me see.\n</think>\n\nHello!", reasoning_parser=parser)
    assert out == ParsedOutput(reasoning="\nLet me see.\n", content="\n\nHello!", tool_calls=[])


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
def test_prompt_ending_in_think_leaves_only_the_end_tag(parser: Any) -> None:
    out = parse_output("I should greet.\n</think>\n\nHi.", reasoning_parser=parser)
    assert (out.reasoning, out.content) == ("I should greet.\n", "\n\nHi.")


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
def test_truncated_reasoning_is_all_reasoning(parser: Any) -> None:
    out = parse_output("<think>\nStill thinking about", reasoning_parser=parser)
    assert (out.reasoning, out.content) == ("\nStill thinking about", None)


def test_qwen3_reads_untagged_output_as_reasoning_unless_thinking_is_off() -> None:
    assert parse_output("Plain answer.") == ParsedOutput("Plain answer.", None)
    assert parse_output("Plain answer.", thinking=False) == ParsedOutput(None, "Plain answer.")
    # deepseek_r1 ignores enable_thinking
    r1 = parse_output("Plain answer.", reasoning_parser="deepseek_r1", thinking=False)
    assert r1 == ParsedOutput("Plain answer.", None)


def test_qwen3_drops_stray_think_tags_and_deepseek_r1_keeps_them() -> None:
    text = "<think>a<think>b</think>c</think>d"
    assert parse_output(text) == ParsedOutput("ab", "cd")
    assert parse_output(text, reasoning_parser="deepseek_r1") == ParsedOutput(
        "a<think>b", "c</think>d"
    )
    r1 = parse_output("pre<think>r</think>c", reasoning_parser="deepseek_r1")
    assert r1 == ParsedOutput("r", "c")  # deepseek_r1 drops text before <think>


def test_empty_content_and_reasoning() -> None:
    assert parse_output("<think>R</think>") == ParsedOutput("R", None)
    assert parse_output("<think></think>Hi") == ParsedOutput(None, "Hi")
    assert parse_output("", reasoning_parser="deepseek_r1") == ParsedOutput("", None)
    assert parse_output("<think></think>", reasoning_parser="deepseek_r1") == ParsedOutput("", None)
    assert parse_output("", reasoning=False, tool_format="none") == ParsedOutput(None, "")
    assert parse_output("", thinking=False, tool_format="hermes") == ParsedOutput(None, "")


def test_no_reasoning_parser_leaves_think_tags_in_content() -> None:
    text = "<think>R</think>Answer"
    assert parse_output(text, reasoning=False, tool_format="none") == ParsedOutput(None, text)


# -- hermes ----------------------------------------------------------------------------------
def test_hermes_single_call_after_reasoning() -> None:
    text = "<think>\nNeed weather.\n</think>\n\nChecking.\n" + hermes_call(
        "get_weather", {"city": "Zürich", "days": 2}
    )
    out = parse_output(text, tool_format="hermes")
    assert out.reasoning == "\nNeed weather.\n"
    assert out.content == "\n\nChecking.\n"  # hermes keeps whitespace around real content
    assert out.tool_calls[0].arguments == '{"city": "Zürich", "days": 2}'
    assert calls(out) == [("get_weather", {"city": "Zürich", "days": 2})]
    assert ID.fullmatch(out.tool_calls[0].id)


def test_hermes_multiple_calls_whitespace_content_and_trailing_text() -> None:
    text = (
        "<think>r</think>\n\n"
        + hermes_call("a", {"x": 1})
        + "\n"
        + hermes_call("b", {})
        + "\nlost text"
    )
    out = parse_output(text)  # auto: no <function= → hermes
    assert out.content is None
    assert calls(out) == [("a", {"x": 1}), ("b", {})]
    assert len({c.id for c in out.tool_calls}) == 2


def test_hermes_unclosed_call_at_the_end_still_counts() -> None:
    text = '<think>r</think><tool_call>\n{"name": "a", "arguments": {"x": [1, 2]}}'
    assert calls(parse_output(text, tool_format="hermes")) == [("a", {"x": [1, 2]})]


@pytest.mark.parametrize(
    "body",
    [
        '{"name": "a", "arguments": {"x": oops}}',  # invalid JSON
        '{"name": "a"}',  # no arguments
        '{"name": 5, "arguments": {}}',  # name not a string
        '["a", {}]',  # not an object
        '{"name": "a", "arguments": {"x": 1',  # truncated
    ],
)
def test_hermes_broken_call_returns_no_calls_and_the_raw_content(body: str) -> None:
    good = hermes_call("ok", {})
    text = f"<think>r</think>Before {good}<tool_call>\n{body}\n</tool_call>"
    out = parse_output(text, tool_format="hermes")
    assert out.tool_calls == []
    assert out.content == text.removeprefix("<think>r</think>")


def test_hermes_string_arguments_are_reencoded_like_vllm() -> None:
    text = '<tool_call>\n{"name": "a", "arguments": "{\\"x\\": 1}"}\n</tool_call>'
    out = parse_output(text, thinking=False)
    assert out.tool_calls[0].arguments == json.dumps('{"x": 1}')


def test_hermes_does_not_type_arguments() -> None:
    out = parse_output(hermes_call("get_weather", {"days": "3"}), thinking=False, tools=TOOLS)
    assert calls(out) == [("get_weather", {"days": "3"})]


def test_tool_call_without_end_of_thinking() -> None:
    text = "<think>I will call it." + hermes_call("a", {})
    assert parse_output(text) == ParsedOutput(
        "I will call it.", None, parse_output(text).tool_calls
    )
    assert calls(parse_output(text)) == [("a", {})]  # qwen3: <tool_call> ends reasoning
    r1 = parse_output(text, reasoning_parser="deepseek_r1")
    assert (r1.reasoning, r1.content, r1.tool_calls) == (text[len("<think>") :], None, [])


# -- qwen3_coder -----------------------------------------------------------------------------
def coder_call(name: str, params: dict[str, str]) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


PARAMS = {
    "city": "New York",
    "days": "3",
    "scale": "1.5",
    "hourly": "true",
    "where": '{"lat": 40.7}',
    "tags": "[1, 2]",
    "note": "null",
    "code": "007",
    "extra": "42",
}


def test_qwen3_coder_types_parameters_from_the_tool_schema() -> None:
    text = "<think>\nplan\n</think>\n\n  Let me look.  \n\n" + coder_call("get_weather", PARAMS)
    out = parse_output(text, tools=TOOLS)  # auto: <function= → qwen3_coder
    assert out.reasoning == "\nplan\n"
    assert out.content == "Let me look."  # stripped when there are tool calls
    assert calls(out) == [
        (
            "get_weather",
            {
                "city": "New York",
                "days": 3,
                "scale": 1.5,
                "hourly": True,
                "where": {"lat": 40.7},
                "tags": [1, 2],
                "note": None,
                "code": "007",
                "extra": "42",
            },
        )
    ]


def test_qwen3_coder_without_schema_keeps_strings() -> None:
    out = parse_output(coder_call("get_weather", PARAMS), tool_format="qwen3_coder", thinking=False)
    assert calls(out) == [("get_weather", PARAMS)]
    assert out.tool_calls[0].arguments == json.dumps(PARAMS, ensure_ascii=False)


def test_qwen3_coder_number_and_integer_edge_cases() -> None:
    params = {"days": "three", "scale": "2.0", "hourly": "maybe"}
    out = parse_output(coder_call("get_weather", params), thinking=False, tools=TOOLS)
    assert calls(out) == [("get_weather", {"days": "three", "scale": 2, "hourly": "maybe"})]


def test_qwen3_coder_multiple_calls_drop_text_between_and_after() -> None:
    text = (
        "<think>r</think>"
        + coder_call("a", {"x": "1"})
        + "\nbetween\n"
        + coder_call("b", {})
        + "\nafter"
    )
    out = parse_output(text, tool_format="qwen3_coder")
    assert out.content is None
    assert calls(out) == [("a", {"x": "1"}), ("b", {})]


def test_qwen3_coder_truncated_call_drops_the_open_parameter() -> None:
    text = "<tool_call>\n<function=a>\n<parameter=x>\n1\n</parameter>\n<parameter=y>\n2"
    out = parse_output(text, tool_format="qwen3_coder", thinking=False)
    assert calls(out) == [("a", {"x": "1"})]


def test_qwen3_coder_drops_markup_it_cannot_use() -> None:
    # A hermes body under the qwen3_coder parser: no name, so no call, and the markup goes.
    text = "Hi " + hermes_call("a", {})
    out = parse_output(text, tool_format="qwen3_coder", thinking=False)
    assert out == ParsedOutput(None, "Hi ", [])
    # With deepseek_r1 the composed parser is not engine-based and keeps its content.
    r1 = parse_output(
        "<think>r</think>" + text, tool_format="qwen3_coder", reasoning_parser="deepseek_r1"
    )
    assert r1 == ParsedOutput("r", text, [])


def test_tool_choice_none() -> None:
    hermes = "Hi " + hermes_call("a", {})
    assert parse_output(hermes, thinking=False, tool_choice="none", tools=TOOLS) == ParsedOutput(
        None, hermes
    )
    coder = "Hi " + coder_call("a", {}) + " there"
    # tools given: vLLM suppresses the calls and keeps all the text around them
    assert parse_output(coder, thinking=False, tool_choice="none", tools=TOOLS) == ParsedOutput(
        None, "Hi  there"
    )
    # no tools: the calls are parsed (content before them, stripped) and then dropped
    assert parse_output(coder, thinking=False, tool_choice="none") == ParsedOutput(None, "Hi")


# -- ids -------------------------------------------------------------------------------------
def test_tool_call_ids_are_vllm_shaped_and_reproducible() -> None:
    text = hermes_call("a", {}) + hermes_call("b", {})
    first = parse_output(text, thinking=False, seed=7).tool_calls
    again = parse_output(text, thinking=False, seed=7).tool_calls
    other = parse_output(text, thinking=False, seed=8).tool_calls
    assert all(ID.fullmatch(c.id) for c in first)
    assert first == again
    assert [c.id for c in first] != [c.id for c in other]
    assert first[0].id != first[1].id


# -- streaming -------------------------------------------------------------------------------
CORPUS = [
    "<think>\nLet me see.\n</think>\n\nHello there!",
    "Still reasoning\n</think>\n\nDone.",
    "<think>\nnever ends",
    "",
    "<think>R</think>",
    "<think></think>   ",
    "<think>a<think>b</think>c</think>d",
    "<think>r</think>Checking. " + hermes_call("get_weather", {"city": "Paris"}) + "\n",
    "<think>r</think>" + hermes_call("a", {"x": 1}) + "\n" + hermes_call("b", {"y": "é"}),
    "<think>r</think>Before <tool_call>\n{bad json}\n</tool_call> after",
    "<think>plan</think>\n\n" + coder_call("get_weather", PARAMS) + coder_call("b", {}),
    "<think>plan</think> x " + coder_call("get_weather", {"days": "2"}) + " after",
    "<tool_call>\n<function=a>\n<parameter=x>\n1\n</parameter>\n<parameter=y>\n2",
    "I will call. <tool_call>\n<function=a>\n</function>\n</tool_call>",
]
OPTIONS: list[dict[str, Any]] = [
    {},
    {"tools": TOOLS},
    {"reasoning_parser": "deepseek_r1"},
    {"thinking": False},
    {"reasoning": False},
    {"tool_format": "none"},
    {"reasoning": False, "tool_format": "none"},
    {"tool_choice": "none"},
    {"tool_choice": "none", "tools": TOOLS},
    {"tool_format": "qwen3_coder", "reasoning_parser": "deepseek_r1"},
]


def chunkings(text: str, rng: random.Random) -> list[list[str]]:
    per_char = list(text) or [""]
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, 5))) if len(text) > 1 else []
    bounds = [0, *cuts, len(text)]
    random_cuts = [text[a:b] for a, b in pairwise(bounds)]
    with_empties = [p for piece in random_cuts for p in (piece, "")]
    return [per_char, random_cuts, with_empties, [text]]


@pytest.mark.parametrize("options", OPTIONS, ids=str)
def test_joined_deltas_equal_the_parsed_output(options: dict[str, Any]) -> None:
    rng = random.Random(0)
    for text in CORPUS:
        want = parse_output(text, seed=3, **options)
        for pieces in chunkings(text, rng):
            deltas = stream_deltas(pieces, seed=3, **options)
            assert len(deltas) == len(pieces)
            assert join_deltas(deltas) == want, (text, pieces)


FRAGMENTS = [
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<function=get_weather>",
    "<function=",
    "</function>",
    "<parameter=days>",
    "</parameter>",
    ">",
    "\n",
    " ",
    "Sure.",
    "é 🚀",
    '{"name": "f", "arguments": {"a": 1}}',
    "{bad",
    "3",
]


@pytest.mark.parametrize("options", OPTIONS, ids=str)
def test_joined_deltas_equal_the_parsed_output_for_random_outputs(options: dict[str, Any]) -> None:
    rng = random.Random(1)
    for _ in range(150):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 12)))
        want = parse_output(text, **options)
        for pieces in chunkings(text, rng):
            assert join_deltas(stream_deltas(pieces, **options)) == want, text


def test_deltas_per_token_use_vllm_field_names() -> None:
    pieces = ["<think>", "\n", "Hmm", "\n", "</think>", "\n\n", "OK"]
    deltas = stream_deltas(pieces)
    assert deltas == [
        None,
        {"reasoning": "\n"},
        {"reasoning": "Hmm"},
        {"reasoning": "\n"},
        None,
        {"content": "\n\n"},
        {"content": "OK"},
    ]


def test_tool_call_deltas_announce_the_name_then_the_arguments() -> None:
    call = hermes_call("get_weather", {"city": "Paris"})
    split = call.index("get_weather") + len("get_weather") + 1  # just past the closing quote
    pieces = ["Sure. ", call[:split], call[split:-5], call[-5:]]
    deltas = stream_deltas(pieces, thinking=False, seed=1)
    [tool_id] = [c.id for c in parse_output("".join(pieces), thinking=False, seed=1).tool_calls]
    assert deltas == [
        {"content": "Sure. "},
        {
            "tool_calls": [
                {"index": 0, "id": tool_id, "type": "function", "function": {"name": "get_weather"}}
            ]
        },
        None,
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Paris"}'}}]},
    ]


def test_qwen3_coder_call_completes_at_its_end_of_function() -> None:
    pieces = [
        "<tool_call>\n<function=a>\n",
        "<parameter=x>\n1\n</parameter>\n",
        "</function>",
        "\n",
        "x",
    ]
    deltas = stream_deltas(pieces, thinking=False, tool_format="qwen3_coder")
    [call] = parse_output("".join(pieces), thinking=False, tool_format="qwen3_coder").tool_calls
    head = {"index": 0, "id": call.id, "type": "function", "function": {"name": "a"}}
    args = {"index": 0, "function": {"arguments": '{"x": "1"}'}}
    assert deltas == [{"tool_calls": [head]}, None, {"tool_calls": [args]}, None, None]


def test_no_pieces_no_deltas() -> None:
    assert stream_deltas([]) == []


def test_join_deltas_accumulates_like_a_client() -> None:
    deltas: list[dict[str, Any] | None] = [
        {"content": "a"},
        None,
        {"tool_calls": [{"index": 1, "id": "y", "function": {"name": "g", "arguments": "{"}}]},
        {"tool_calls": [{"index": 0, "id": "x", "type": "function", "function": {"name": "f"}}]},
        {"tool_calls": [{"index": 1, "function": {"arguments": "}"}}]},
        {"content": "b", "reasoning": "r"},
    ]
    assert join_deltas(deltas) == ParsedOutput(
        "r", "ab", [ToolCall("x", "f", ""), ToolCall("y", "g", "{}")]
    )


def test_stream_of_real_qwen_tokens_joins_to_the_parse() -> None:
    from agentkv.chat.tokenizer import load_tokenizer

    tok = load_tokenizer()
    for text in filter(None, CORPUS):  # no tokens, no deltas (test_no_pieces_no_deltas)
        ids = tok.encode(text)
        pieces: list[str] = []
        sent = ""
        for n in range(1, len(ids) + 1):
            decoded = tok.decode(ids[:n])
            if decoded.endswith("\ufffd"):
                pieces.append("")
                continue
            pieces.append(decoded[len(sent) :])
            sent = decoded
        assert "".join(pieces) == text
        for options in OPTIONS:
            assert join_deltas(stream_deltas(pieces, **options)) == parse_output(text, **options)


# -- generated text --------------------------------------------------------------------------
def test_generate_text_is_deterministic_bounded_and_extends() -> None:
    a = generate_text(42, 300)
    assert a == generate_text(42, 300)
    assert a != generate_text(43, 300)
    assert 250 < len(a) <= 300
    assert generate_text(42, 1000).startswith(a)
    assert a[0].isupper()
    assert re.fullmatch(r"[A-Za-z .!?]+", a)
    assert generate_text(1, 0) == ""
    assert len(generate_text(1, 5)) <= 5


# -- scripts ---------------------------------------------------------------------------------
def test_script_round_trip_hermes() -> None:
    script = SimScript(
        reasoning="\nThe user wants weather.\n",
        content="Let me check.",
        tool_calls=[
            ScriptToolCall(name="get_weather", arguments={"city": "Zürich", "days": 3}),
            ScriptToolCall(name="noop"),
        ],
    )
    text = render_script(script, native=HERMES)
    assert text.startswith("<think>\nThe user wants weather.\n</think>Let me check.<tool_call>\n")
    assert '{"name": "get_weather", "arguments": {"city": "Zürich", "days": 3}}' in text
    out = parse_output(text, tool_format="hermes")
    assert (out.reasoning, out.content) == (script.reasoning, script.content)
    assert calls(out) == [("get_weather", {"city": "Zürich", "days": 3}), ("noop", {})]


def test_script_round_trip_qwen3_coder_with_typed_arguments() -> None:
    arguments = {"city": "New York", "days": 3, "hourly": False, "tags": [1, 2], "note": None}
    script = SimScript(
        reasoning="plan",
        content="On it.",
        tool_calls=[ScriptToolCall(name="get_weather", arguments=arguments)],
    )
    text = render_script(script, native=QWEN3_CODER)
    assert "<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n" in text
    out = parse_output(text, tools=TOOLS)
    assert (out.reasoning, out.content) == ("plan", "On it.")
    assert calls(out) == [("get_weather", arguments)]
    # without the schema every value comes back as the text the model wrote
    untyped = parse_output(text)
    assert calls(untyped)[0][1]["days"] == "3"


def test_script_without_reasoning_still_closes_thinking() -> None:
    script = SimScript(content="Just the answer.")
    assert render_script(script, native=HERMES) == "<think></think>Just the answer."
    assert parse_output(render_script(script, native=HERMES)) == ParsedOutput(
        None, "Just the answer."
    )
    off = render_script(script, native=HERMES, thinking=False)
    assert off == "Just the answer."
    assert parse_output(off, thinking=False) == ParsedOutput(None, "Just the answer.")


def test_script_when_the_prompt_already_opened_thinking() -> None:
    script = SimScript(reasoning="r", content="c")
    text = render_script(script, native=HERMES, prompt_ends_in_think=True)
    assert text == "r</think>c"
    assert parse_output(text) == ParsedOutput("r", "c")


def test_script_text_is_verbatim_and_raw_arguments_can_break_a_call() -> None:
    assert render_script(SimScript(text="<think>x"), native=QWEN3_CODER) == "<think>x"
    broken = SimScript(content="Hi", tool_calls=[ScriptToolCall(name="a", arguments="{oops")])
    text = render_script(broken, native=HERMES)
    assert text == '<think></think>Hi<tool_call>\n{"name": "a", "arguments": {oops}\n</tool_call>'
    assert parse_output(text) == ParsedOutput(None, text.removeprefix("<think></think>"))
    raw = SimScript(
        tool_calls=[ScriptToolCall(name="a", arguments="<parameter=x>\n1\n</parameter>\n")]
    )
    assert calls(parse_output(render_script(raw, native=QWEN3_CODER))) == [("a", {"x": "1"})]


def test_sim_script_validation() -> None:
    with pytest.raises(ValidationError):
        SimScript.model_validate({"content": "x", "temperature": 1})
    with pytest.raises(ValidationError):
        SimScript.model_validate({"tool_calls": [{"name": "a", "args": {}}]})
    with pytest.raises(ValidationError):
        SimScript.model_validate({"text": "x", "content": "y"})
    with pytest.raises(ValidationError):
        SimScript.model_validate({"finish_reason": "tool_calls"})
    ok = SimScript.model_validate({"text": "raw", "finish_reason": "length"})
    assert (ok.text, ok.finish_reason) == ("raw", "length")


def test_native_syntax_for_templates() -> None:
    coder = "{{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}"
    qwen3 = '{{- \'<tool_call>\\n{"name": "\' }}{{ tool_call.name }}'
    assert native_syntax_for(coder) == QWEN3_CODER
    assert native_syntax_for(qwen3) == HERMES
    assert native_syntax_for("") == HERMES
