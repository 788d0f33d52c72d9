"""A renderer asks once for what depends only on the template and the tokenizer
(``agentkv._probe.FixedProbes``). Real HTTP against the shared simulator."""

from __future__ import annotations

from typing import Any

import httpx
import openai

import agentkv
from agentkv.sim.launch import SimProcess
from tests._support.tools import function_tool

TOOLS = [function_tool("get_weather", "Weather", city="string")]


def test_what_depends_only_on_the_template_is_asked_once_per_renderer(sim: SimProcess) -> None:
    sent: list[str] = []
    http: Any = httpx.Client(
        event_hooks={"request": [lambda r: sent.append(r.url.path)]}, trust_env=False
    )
    oa = openai.OpenAI(base_url=f"{sim.url}/v1", api_key="k", http_client=http)
    client = agentkv.Client(openai_client=oa, retries=0)

    def turn(conv: Any, text: str) -> tuple[int, int]:
        before = len(sent)
        conv.add_user(text)
        conv.create(max_tokens=8)  # cut by max_tokens: no end of turn in the answer
        paths = sent[before:]
        return sum(p == "/tokenize" for p in paths), sum(p == "/detokenize" for p in paths)

    with client:
        conv = client.conversation(model="sim", system="be brief", tools=TOOLS)
        counts = [turn(conv, f"question {i}") for i in range(4)]
        other = client.conversation(model="sim", system="be brief")  # no tools: asked again
        counts += [turn(other, "hi"), turn(other, "and?")]
    # the first turn renders the whole history; the second asks for the marker, the end of
    # turn, the new message, the end of turn's text and the answer's last text; later turns
    # only for the new message and the answer's last text
    assert counts == [(1, 0), (3, 2), (1, 1), (1, 1), (1, 0), (3, 1)], counts
