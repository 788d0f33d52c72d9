"""The simulator's OpenAI HTTP surface as vLLM 0.33 serves it: response shapes, completions,
``kv_transfer_params.prompt_token_ids``, tokenizer endpoints, metrics, and bad input.

Every request goes through the real ASGI app (httpx's ASGI transport) with the real Qwen3
tokenizer and template, and no simulated delays.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

from agentkv.chat import load_template, load_tokenizer
from agentkv.protocol.promtext import parse_metrics
from agentkv.sim import SimConfig, SimState, create_app
from agentkv.sim.costmodel import PRESETS
from agentkv.sim.transfer import TransferClient
from tests._support.cluster import openai_error
from tests._support.templates import TEMPLATES_DIR
from tests._support.tools import chat_tool

pytestmark = pytest.mark.anyio

IM_END = 151645  # <|im_end|>, Qwen3's end of turn
MODEL = "agentkv-sim"
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is the capital of France?"},
]
TOOLS = [
    chat_tool(
        "get_weather",
        "Weather for a city.",
        {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    )
]
WITH_TOOL_CALL = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, cloudy"},
    {"role": "user", "content": "And Berlin?"},
]

Connect = Callable[..., tuple[httpx.AsyncClient, SimState]]
TOKENIZER = load_tokenizer()
TEMPLATE = load_template(None, TOKENIZER)  # compiled once: most instances here share it
TRANSFER = TransferClient()  # no test here moves KV between instances


@pytest.fixture
async def connect() -> AsyncIterator[Connect]:
    """``connect(**config)``: a fresh instance and a client that reaches it."""
    clients: list[httpx.AsyncClient] = []

    def make(**config: Any) -> tuple[httpx.AsyncClient, SimState]:
        cfg = SimConfig.model_validate({"time_scale": 0.0, "num_blocks": 1024, **config})
        template = None if cfg.template else TEMPLATE
        app = create_app(
            cfg, tokenizer=TOKENIZER, template=template, cost=PRESETS["zero"], transfer=TRANSFER
        )
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://sim")
        clients.append(client)
        return client, app.state.sim

    yield make
    for client in clients:
        await client.aclose()


@pytest.fixture
async def client(connect: Connect) -> httpx.AsyncClient:
    return connect()[0]


async def chat(client: httpx.AsyncClient, **body: Any) -> dict[str, Any]:
    r = await client.post("/v1/chat/completions", json={"messages": MESSAGES, **body})
    assert r.status_code == 200, r.text
    return r.json()


async def complete(client: httpx.AsyncClient, **body: Any) -> dict[str, Any]:
    r = await client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


async def tokenize(client: httpx.AsyncClient, **body: Any) -> list[int]:
    r = await client.post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    tokens: list[int] = r.json()["tokens"]
    return tokens


def sse(text: str) -> list[dict[str, Any]]:
    """The JSON events of a complete SSE body (which must end with ``data: [DONE]``)."""
    frames = text.split("\n\n")
    assert frames[-2:] == ["data: [DONE]", ""], text[-200:]
    assert all(f.startswith("data: ") for f in frames[:-1])
    return [json.loads(f.removeprefix("data: ")) for f in frames[:-2]]


async def metrics(client: httpx.AsyncClient) -> dict[str, float]:
    return parse_metrics((await client.get("/metrics")).text)


# -- chat: response shape ----------------------------------------------------------------------
async def test_chat_response_has_vllm_fields(client):
    body = await chat(client)
    assert set(body) == {
        "id", "object", "created", "model", "choices", "service_tier", "system_fingerprint",
        "usage", "prompt_logprobs", "prompt_token_ids", "prompt_text", "kv_transfer_params",
        "ec_transfer_params", "metrics",
    }  # fmt: skip
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["model"] == MODEL
    assert body["prompt_token_ids"] is None and body["kv_transfer_params"] is None
    (choice,) = body["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "stop"
    assert choice["stop_reason"] is None and choice["token_ids"] is None


async def test_chat_message_without_tool_calls_has_no_tool_calls_key(client):
    message = (await chat(client))["choices"][0]["message"]
    assert set(message) == {
        "role", "content", "refusal", "annotations", "audio", "function_call", "reasoning",
    }  # fmt: skip
    assert message["role"] == "assistant"
    assert message["content"] and message["reasoning"]  # generated: thinks, then answers


async def test_return_token_ids_gives_prompt_and_output_ids(client):
    body = await chat(client, return_token_ids=True)
    ids = body["choices"][0]["token_ids"]
    assert body["prompt_token_ids"] == await tokenize(client, messages=MESSAGES)
    assert ids[-1] == IM_END and IM_END not in ids[:-1]
    assert body["usage"]["completion_tokens"] == len(ids)


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"tools": TOOLS},
        {"chat_template_kwargs": {"enable_thinking": False}},
        {"messages": WITH_TOOL_CALL, "tools": TOOLS},
    ],
    ids=["plain", "tools", "no-thinking", "tool-call-history"],
)
async def test_prompt_tokens_equal_tokenize_count(client, extra):
    request = {"messages": MESSAGES, **extra}
    count = (await client.post("/tokenize", json=request)).json()["count"]
    usage = (await chat(client, **request))["usage"]
    assert usage["prompt_tokens"] == count
    assert usage["total_tokens"] == count + usage["completion_tokens"]


async def test_cached_tokens_count_full_prefix_blocks(client):
    first = await chat(client, return_token_ids=True)
    again = await chat(client)
    n = len(first["prompt_token_ids"])
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    # vLLM always computes the last prompt token, so at most (n - 1) // 16 blocks hit.
    assert again["usage"]["prompt_tokens_details"] == {"cached_tokens": (n - 1) // 16 * 16}


async def test_prompt_tokens_details_off_is_null(connect):
    client, _ = connect(prompt_tokens_details=False)
    usage = (await chat(client))["usage"]
    assert usage["prompt_tokens_details"] is None and usage["prompt_tokens"] > 0


# -- completions --------------------------------------------------------------------------------
async def test_completion_response_shape(client):
    body = await complete(client, prompt="The capital of France is")
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert "prompt_token_ids" not in body and body["kv_transfer_params"] is None
    (choice,) = body["choices"]
    assert set(choice) == {
        "index", "text", "logprobs", "finish_reason", "stop_reason", "token_ids",
        "prompt_logprobs", "prompt_token_ids", "routed_experts", "weight_versions",
    }  # fmt: skip
    assert choice["text"] and choice["token_ids"] is None and choice["prompt_token_ids"] is None


@pytest.mark.parametrize("as_ids", [False, True], ids=["string", "token-ids"])
async def test_completion_prompt_forms_agree(client, as_ids):
    text = "The capital of France is"
    ids = await tokenize(client, prompt=text)
    body = await complete(client, prompt=ids if as_ids else text, return_token_ids=True, seed=7)
    (choice,) = body["choices"]
    assert choice["prompt_token_ids"] == ids
    assert body["usage"]["prompt_tokens"] == len(ids)
    detok = await client.post("/detokenize", json={"tokens": choice["token_ids"]})
    assert detok.json()["prompt"].startswith(choice["text"])


async def test_completion_max_tokens_defaults_to_16(client):
    body = await complete(client, prompt="Count:", ignore_eos=True, return_token_ids=True)
    (choice,) = body["choices"]
    assert len(choice["token_ids"]) == 16 and choice["finish_reason"] == "length"


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
async def test_ignore_eos_runs_to_max_tokens(client, endpoint):
    kw = {"max_tokens": 70, "ignore_eos": True, "return_token_ids": True}
    body = (
        await chat(client, **kw)
        if endpoint == "chat"
        else await complete(client, prompt="Hi", **kw)
    )
    (choice,) = body["choices"]
    assert len(choice["token_ids"]) == 70 == body["usage"]["completion_tokens"]
    assert choice["finish_reason"] == "length" and IM_END not in choice["token_ids"]


async def test_min_tokens_extends_a_short_answer(client):
    script = {"content": "Paris."}
    short = await chat(client, agentkv_sim=script, return_token_ids=True)
    longer = await chat(client, agentkv_sim=script, min_tokens=30, return_token_ids=True)
    assert len(short["choices"][0]["token_ids"]) < 30
    ids = longer["choices"][0]["token_ids"]
    assert len(ids) >= 30 and ids[-1] == IM_END
    assert longer["choices"][0]["message"]["content"].startswith("Paris.")


@pytest.mark.parametrize(
    ("stop", "min_tokens", "text", "reason"),
    [
        (["two"], 0, "one ", "two"),
        ("two", 0, "one ", "two"),
        (["three", " two"], 0, "one", " two"),  # the one that completes first wins
        (["two"], 3, "one two one ", "two"),  # not checked within the first min_tokens tokens
    ],
    ids=["list", "string", "earliest", "after-min-tokens"],
)
async def test_stop_string_cuts_text_and_sets_stop_reason(client, stop, min_tokens, text, reason):
    body = await complete(
        client,
        prompt="Say it:",
        agentkv_sim={"content": "one two one two three"},
        stop=stop,
        min_tokens=min_tokens,
        return_token_ids=True,
    )
    (choice,) = body["choices"]
    assert choice["text"] == text
    assert choice["stop_reason"] == reason and choice["finish_reason"] == "stop"
    # vLLM keeps the token that completes the stop string, and nothing after it.
    full = await client.post("/detokenize", json={"tokens": choice["token_ids"]})
    cut = await client.post("/detokenize", json={"tokens": choice["token_ids"][:-1]})
    assert (
        full.json()["prompt"].endswith(reason) and reason not in cut.json()["prompt"][len(text) :]
    )


async def test_stop_string_not_reached_before_max_tokens(client):
    body = await complete(
        client,
        prompt="Say:",
        agentkv_sim={"content": "one two three"},
        stop=["three"],
        max_tokens=2,
    )
    (choice,) = body["choices"]
    assert choice["text"] == "one two"
    assert choice["finish_reason"] == "length" and choice["stop_reason"] is None


async def test_chat_stop_string(client):
    body = await chat(client, agentkv_sim={"content": "Paris is the capital."}, stop=["capital"])
    (choice,) = body["choices"]
    assert choice["message"]["content"] == "Paris is the "
    assert choice["stop_reason"] == "capital" and choice["finish_reason"] == "stop"


@pytest.mark.parametrize("include_usage", [False, True], ids=["no-usage", "usage"])
async def test_completion_stream_matches_full_response(client, include_usage):
    kw = {
        "prompt": "Once upon a time",
        "max_tokens": 12,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    full = (await complete(client, **kw))["choices"][0]
    r = await client.post(
        "/v1/completions",
        json={**kw, "stream": True, "stream_options": {"include_usage": include_usage}},
    )
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse(r.text)
    usage = [e for e in events if not e["choices"]]
    chunks = [e["choices"][0] for e in events if e["choices"]]
    assert "".join(c["text"] for c in chunks) == full["text"]
    assert [t for c in chunks for t in c["token_ids"]] == full["token_ids"]
    assert chunks[0]["prompt_token_ids"] == full["prompt_token_ids"]
    assert all(c["prompt_token_ids"] is None for c in chunks[1:])
    assert [c["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    assert len(usage) == int(include_usage)
    if include_usage:
        assert usage[0]["usage"]["completion_tokens"] == len(full["token_ids"])


# -- kv_transfer_params.prompt_token_ids on chat -----------------------------------------------
OTHER = [
    {"role": "system", "content": "Completely different prompt B."},
    {"role": "user", "content": "Tell me about llamas, please."},
]


async def test_reused_prompt_ids_replace_the_messages(client):
    ids = await tokenize(client, messages=OTHER)
    body = await chat(client, return_token_ids=True, kv_transfer_params={"prompt_token_ids": ids})
    assert body["prompt_token_ids"] == ids
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert body["kv_transfer_params"] is None  # the key is popped; nothing else was sent


async def test_reused_prompt_ids_on_a_stream(client):
    ids = await tokenize(client, messages=OTHER)
    r = await client.post(
        "/v1/chat/completions",
        json={
            "messages": MESSAGES,
            "stream": True,
            "return_token_ids": True,
            "kv_transfer_params": {"prompt_token_ids": ids},
        },
    )
    events = sse(r.text)
    assert events[0]["prompt_token_ids"] == ids
    assert events[-1]["kv_transfer_params"] is None


async def test_reused_prompt_ids_are_not_echoed_in_the_handle(client):
    ids = await tokenize(client, messages=OTHER)
    body = await chat(
        client,
        max_tokens=1,
        kv_transfer_params={"do_remote_decode": True, "prompt_token_ids": ids},
    )
    handle = body["kv_transfer_params"]
    assert handle["remote_num_tokens"] == len(ids)
    assert "prompt_token_ids" not in handle


PARAM = "kv_transfer_params.prompt_token_ids"
NOT_A_LIST = (
    "`kv_transfer_params['prompt_token_ids']` must be a non-empty list of non-negative "
    f"integers. (parameter={PARAM})"
)


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        ([], NOT_A_LIST),
        ([1, -5], NOT_A_LIST),
        (["a"], NOT_A_LIST),
        ([True], NOT_A_LIST),
        ("1 2 3", NOT_A_LIST),
        ([10000000], f"Token id 10000000 is out of vocabulary (parameter={PARAM})"),
    ],
    ids=["empty", "negative", "string", "bool", "not-a-list", "out-of-vocab"],
)
async def test_invalid_reused_prompt_ids(client, ids, message):
    before = await metrics(client)
    r = await client.post(
        "/v1/chat/completions",
        json={"messages": MESSAGES, "kv_transfer_params": {"prompt_token_ids": ids}},
    )
    assert r.status_code == 400
    assert r.json()["error"] == {
        "message": message,
        "type": "BadRequestError",
        "param": PARAM,
        "code": 400,
    }
    assert await metrics(client) == before


# -- tokenizer endpoints, models, health, metrics ----------------------------------------------
async def test_tokenize_prompt(client):
    r = await client.post("/tokenize", json={"prompt": "Hello world"})
    assert r.json() == {
        "count": 2,
        "max_model_len": 131072,
        "tokens": [9707, 1879],
        "token_strs": None,
    }


async def test_tokenize_return_token_strs(client):
    out = (
        await client.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True})
    ).json()
    assert out["token_strs"] == ["Hello", "Ġworld"]


async def test_tokenize_generation_prompt_is_a_suffix(client):
    with_prompt = await tokenize(client, messages=MESSAGES)
    without = await tokenize(client, messages=MESSAGES, add_generation_prompt=False)
    assert with_prompt[: len(without)] == without
    tail = await client.post("/detokenize", json={"tokens": with_prompt[len(without) :]})
    assert tail.json()["prompt"] == "<|im_start|>assistant\n"


async def test_tokenize_continue_final_message(client):
    partial = [*MESSAGES, {"role": "assistant", "content": "The capital is"}]
    ids = await tokenize(
        client, messages=partial, add_generation_prompt=False, continue_final_message=True
    )
    text = (await client.post("/detokenize", json={"tokens": ids})).json()["prompt"]
    # Qwen3's template writes an empty think block into the last assistant turn.
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nThe capital is")


async def test_tokenize_both_generation_flags_is_400(client):
    r = await client.post(
        "/tokenize",
        json={"messages": MESSAGES, "add_generation_prompt": True, "continue_final_message": True},
    )
    assert r.status_code == 400
    assert "continue_final_message" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    "text",
    ["Hello, world!", "héllo 世界 🙂 — ok", "<|im_start|>user\nhi<|im_end|>\n", "  spaced\tout\n"],
    ids=["ascii", "unicode", "special-tokens", "whitespace"],
)
async def test_detokenize_round_trip(client, text):
    ids = await tokenize(client, prompt=text)
    r = await client.post("/detokenize", json={"tokens": ids})
    assert r.json() == {"prompt": text}


@pytest.mark.parametrize(
    "tokens",
    [[-1], [10000000], ["a"], [1.5], "12", None],
    ids=["negative", "out-of-vocab", "string", "float", "not-a-list", "missing"],
)
async def test_detokenize_bad_ids_is_400(client, tokens):
    r = await client.post("/detokenize", json={"tokens": tokens})
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "BadRequestError"


async def test_models_lists_the_served_model(connect):
    client, _ = connect(served_model_name="tiny", max_model_len=4096)
    body = (await client.get("/v1/models")).json()
    assert body["object"] == "list"
    (card,) = body["data"]
    assert card["id"] == card["root"] == "tiny" and card["object"] == "model"
    assert card["max_model_len"] == 4096 and card["owned_by"] == "vllm"
    assert card["permission"][0]["object"] == "model_permission"


async def test_health(client):
    r = await client.get("/health")
    assert r.status_code == 200


async def test_metrics_exposes_vllm_names(client):
    await chat(client)
    r = await client.get("/metrics")
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    text = r.text
    for name in (
        "vllm:prefix_cache_queries_total",
        "vllm:kv_cache_usage_perc",
        "vllm:nixl_num_kv_expired_reqs_total",
        "agentkv_sim_wrong_kv_tokens_total",
        "agentkv_sim_retained_block_seconds_total",
    ):
        assert f"\n{name}{{" in text, name
    for source in ("local_compute", "local_cache_hit", "external_kv_transfer"):
        assert f'source="{source}"' in text


async def test_metrics_count_a_request(client):
    body = await chat(client)
    m = await metrics(client)
    n = body["usage"]["prompt_tokens"]
    assert m["vllm:prefix_cache_queries_total"] == n
    assert m["vllm:prompt_tokens_by_source_total[local_compute]"] == n
    assert m["vllm:generation_tokens_total"] == body["usage"]["completion_tokens"]


# -- bad input ----------------------------------------------------------------------------------
CHAT = "/v1/chat/completions"
HANDLE = {
    "do_remote_decode": True,
    "remote_block_ids": [[1, 2]],
    "remote_engine_id": "e",
    "remote_request_id": "r",
    "remote_host": "localhost",
    "remote_port": 8100,
    "remote_num_tokens": 32,
}
LONG = [{"role": "user", "content": "word " * 300}]
DS31 = str(TEMPLATES_DIR / "deepseek-v3.1.jinja")


def bad(case: str, body: Any, message: str, status: int = 400, path: str = CHAT) -> Any:
    return pytest.param(path, body, status, message, id=case)


BAD = [
    bad("invalid-json", b"{not json", "Invalid JSON body"),
    bad("json-array", [MESSAGES], "must be a JSON object"),
    bad("no-messages", {}, "`messages`"),
    bad("empty-messages", {"messages": []}, "`messages`"),
    bad("no-role", {"messages": [{"content": "hi"}]}, "`role`"),
    bad("message-not-object", {"messages": ["hi"]}, "`role`"),
    bad("content-int", {"messages": [{"role": "user", "content": 5}]}, "`content`"),
    bad("content-object", {"messages": [{"role": "user", "content": {"a": 1}}]}, "`content`"),
    bad("kv-not-object", {"messages": MESSAGES, "kv_transfer_params": "x"}, "must be an object"),
    bad(
        "kv-port-type",
        {"messages": MESSAGES, "kv_transfer_params": {**HANDLE, "remote_port": "p"}},
        "remote_port",
    ),
    bad(
        "kv-tokens-type",
        {"messages": MESSAGES, "kv_transfer_params": {**HANDLE, "remote_num_tokens": "x"}},
        "remote_num_tokens",
    ),
    bad(
        "kv-blocks-type",
        {"messages": MESSAGES, "kv_transfer_params": {**HANDLE, "remote_block_ids": "x"}},
        "remote_block_ids",
    ),
    bad("n-2", {"messages": MESSAGES, "n": 2}, "n=1"),
    bad("max-tokens-0", {"messages": MESSAGES, "max_tokens": 0}, "`max_tokens`"),
    bad("max-tokens-string", {"messages": MESSAGES, "max_tokens": "5"}, "`max_tokens`"),
    bad(
        "max-tokens-over-context",
        {"messages": MESSAGES, "max_tokens": 10**6},
        "maximum context length is 256 tokens",
    ),
    bad("prompt-over-context", {"messages": LONG}, "maximum context length is 256 tokens"),
    bad(
        "min-tokens-negative",
        {"messages": MESSAGES, "min_tokens": -1},
        "min_tokens must be greater than or equal to 0, got -1.",
    ),
    bad(
        "min-tokens-over-max",
        {"messages": MESSAGES, "min_tokens": 9, "max_tokens": 8},
        "min_tokens must be less than or equal to max_tokens=8, got 9.",
    ),
    bad(
        "min-tokens-huge",
        {"messages": MESSAGES, "min_tokens": 10**9},
        "min_tokens must be less than or equal to max_tokens=",
    ),
    bad("min-tokens-string", {"messages": MESSAGES, "min_tokens": "x"}, "`min_tokens`"),
    bad("stop-int", {"messages": MESSAGES, "stop": 5}, "`stop`"),
    bad("stop-mixed", {"messages": MESSAGES, "stop": ["a", 5]}, "`stop`"),
    bad("seed-string", {"messages": MESSAGES, "seed": "x"}, "`seed`"),
    bad(
        "unknown-model",
        {"messages": MESSAGES, "model": "gpt-9"},
        "The model `gpt-9` does not exist. Valid aliases: agentkv-sim.",
        404,
    ),
    bad("model-not-string", {"messages": MESSAGES, "model": 5}, "`model`"),
    bad(
        "sim-script-unknown-field",
        {"messages": MESSAGES, "agentkv_sim": {"bogus": 1}},
        "Invalid `agentkv_sim`",
    ),
    bad(
        "sim-script-text-and-content",
        {"messages": MESSAGES, "agentkv_sim": {"text": "a", "content": "b"}},
        "Invalid `agentkv_sim`",
    ),
    bad("tools-not-list", {"messages": MESSAGES, "tools": {"type": "function"}}, "`tools`"),
    bad(
        "tools-not-objects",
        {"messages": MESSAGES, "tools": ["get_weather"]},
        "Tools should be JSON schemas",
    ),
    bad(
        "template-kwargs-not-object",
        {"messages": MESSAGES, "chat_template_kwargs": [1]},
        "`chat_template_kwargs`",
    ),
    bad(
        "request-template-syntax",
        {"messages": MESSAGES, "chat_template": "{% if %}"},
        "Expected an expression",
    ),
    bad(
        "request-template-raises",
        {"messages": MESSAGES, "chat_template": "{{ raise_exception('no') }}"},
        "no",
    ),
    bad("completion-no-prompt", {}, "`prompt`", path="/v1/completions"),
    bad("completion-empty-prompt", {"prompt": ""}, "at least one token", path="/v1/completions"),
    bad(
        "completion-id-out-of-vocab",
        {"prompt": [10000000]},
        "out of vocabulary",
        path="/v1/completions",
    ),
    bad("tokenize-nothing", {}, "`prompt`", path="/tokenize"),
    bad(
        "tokenize-unknown-model",
        {"prompt": "hi", "model": "x"},
        "does not exist",
        status=404,
        path="/tokenize",
    ),
]


@pytest.mark.parametrize(("path", "body", "status", "message"), BAD)
async def test_bad_input_is_an_openai_error_and_changes_nothing(
    connect, path, body, status, message
):
    client, state = connect(max_model_len=256)
    before = await metrics(client)
    if isinstance(body, bytes):
        r = await client.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = await client.post(path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status
    assert error["type"] == ("NotFoundError" if status == 404 else "BadRequestError")
    assert message in error["message"]
    assert await metrics(client) == before
    assert state.engine.pool.num_used == 0 and state.engine.retained == {}


async def test_template_error_is_400_with_the_templates_own_message(connect):
    client, _ = connect(template=DS31)
    before = await metrics(client)
    r = await client.post(CHAT, json={"messages": WITH_TOOL_CALL, "tools": TOOLS})
    assert r.status_code == 400
    assert r.json()["error"] == openai_error(
        'can only concatenate str (not "dict") to str', "BadRequestError", 400
    )
    assert await metrics(client) == before


@pytest.mark.parametrize(
    ("exc", "status"),
    [(ValueError("bad value"), 400), (TypeError("bad type"), 400), (RuntimeError("boom"), 500)],
    ids=["value-error", "type-error", "unexpected"],
)
async def test_unexpected_exceptions_keep_the_error_shape(connect, monkeypatch, exc, status):
    client, state = connect()

    def broken(body: dict[str, Any]) -> str:
        raise exc

    monkeypatch.setattr(state.renderer, "render_chat", broken)
    r = await client.post(CHAT, json={"messages": MESSAGES})
    assert r.status_code == status
    error = r.json()["error"]
    assert error["code"] == status and set(error) == {"message", "type", "param", "code"}
    assert "Traceback" not in r.text
