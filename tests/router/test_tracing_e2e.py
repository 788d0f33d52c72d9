"""One trace per turn: the SDK's span → the router's ``agentkv.router.turn`` span → P and D.

Real processes: the router runs with the OpenTelemetry SDK configured from ``OTEL_*`` variables
(the console exporter, so its spans land in its log), the simulators record the W3C trace context
of the last request they got (``GET /_sim/state``), the SDK exports to the in-memory exporter.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.trace import format_span_id, format_trace_id

import agentkv
from tests._support.stack import stack

# paths.mode = "pull" (tests/_support/router_config.py): the trace reaches P and D on every
# turn, which the default `choose` sends straight to D when it adds a few tokens
# (test_paths_e2e.py)
pytestmark = [pytest.mark.e2e, pytest.mark.paths_pull]

SYSTEM = "You are a careful agent. " + " ".join(f"Rule {i}: be brief." for i in range(30))


def _spans(log: Path) -> list[dict[str, Any]]:
    """The JSON spans ``ConsoleSpanExporter`` printed into a log."""
    text = log.read_text(errors="replace")
    decoder = json.JSONDecoder()
    out: list[dict[str, Any]] = []
    at = text.find("{\n")
    while at != -1:
        try:
            obj, end = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            end = at + 1
        else:
            if isinstance(obj, dict) and "context" in obj:
                out.append(obj)
        at = text.find("{\n", end)
    return out


def _parts(traceparent: str) -> tuple[str, str]:
    version, trace_id, parent_id, flags = traceparent.split("-")
    assert version == "00" and int(flags, 16) & 1  # sampled
    return trace_id, parent_id


def test_one_trace_from_the_sdk_through_the_router_to_p_and_d(tmp_path, monkeypatch, otel):
    if importlib.util.find_spec("opentelemetry.distro") is None:
        reason = 'the otel extra is not installed: pip install -e ".[dev]"'
        if os.environ.get("CI"):
            pytest.fail(f"{reason}; CI must run the tracing test", pytrace=False)
        pytest.skip(reason)
    for key, value in {
        "OTEL_TRACES_EXPORTER": "console",
        "OTEL_METRICS_EXPORTER": "none",
        "OTEL_LOGS_EXPORTER": "none",
        "OTEL_BSP_SCHEDULE_DELAY": "50",
    }.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    otel.spans.clear()
    with stack(tmp_path) as s:
        log = next(tmp_path.glob(f"router-{s.router.port}.log"))
        seen: dict[str, list[tuple[str, str]]] = {"prefill": [], "decode": []}
        with agentkv.Client(base_url=f"{s.router.url}/v1", api_key="k") as c:
            conv = c.conversation("conv-trace", model="agentkv-sim", system=SYSTEM)
            for i in range(2):
                conv.add_user(f"Question {i}: what is {i} + {i}?")
                if i == 0:
                    conv.create(max_tokens=8)
                else:
                    list(conv.create(max_tokens=8, stream=True))
                for role, sim in (("prefill", s.prefill[0]), ("decode", s.decode[0])):
                    state = httpx.get(f"{sim.url}/_sim/state", timeout=10).json()
                    seen[role].append(_parts(state["last_trace_context"]["traceparent"]))
        client_spans = [x for x in otel.spans.get_finished_spans() if x.name == "chat agentkv-sim"]
        assert len(client_spans) == 2
        assert conv.receipts[1].decision == "pull"
        deadline = time.monotonic() + 20
        turns: list[dict[str, Any]] = []
        while time.monotonic() < deadline and len(turns) < 2:
            turns = [x for x in _spans(log) if x["name"] == "agentkv.router.turn"]
            time.sleep(0.1)
    assert len(turns) == 2, log.read_text()[-3000:]
    for i, (client_span, turn) in enumerate(zip(client_spans, turns, strict=True)):
        ctx = client_span.get_span_context()
        trace_id = format_trace_id(ctx.trace_id)
        # the router's span is a server span in the SDK's trace, its parent the SDK's span
        assert turn["kind"] == "SpanKind.SERVER"
        assert turn["context"]["trace_id"] == f"0x{trace_id}"
        assert turn["parent_id"] == f"0x{format_span_id(ctx.span_id)}"
        assert turn["resource"]["attributes"]["service.name"] == "agentkv-router"
        assert turn["attributes"]["gen_ai.conversation.id"] == "conv-trace"
        # P and D got the router's span as their parent, in the same trace
        router_span = turn["context"]["span_id"].removeprefix("0x")
        assert seen["prefill"][i] == (trace_id, router_span)
        assert seen["decode"][i] == (trace_id, router_span)
    assert turns[1]["attributes"]["agentkv.decision"] == "pull"
