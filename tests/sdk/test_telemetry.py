"""One OpenTelemetry span per turn, with gen_ai.* and agentkv.* attributes, its trace context on
the request, and the GenAI client metrics (OpenTelemetry SDK in-memory exporter and reader)."""

from __future__ import annotations

from urllib.parse import urlsplit

import httpx
import pytest
from opentelemetry.trace import SpanKind, format_span_id, format_trace_id

import agentkv


def _turn_spans(otel, name="chat sim"):
    return [s for s in otel.spans.get_finished_spans() if s.name == name]


def test_turn_span_attributes(sim, otel):
    otel.spans.clear()
    with agentkv.Client(base_url=f"{sim.url}/v1", api_key="k") as c:
        conv = c.conversation("conv-otel", model="sim")
        conv.add_user("a first message long enough to fill some KV blocks " * 8)
        conv.create(max_tokens=5, temperature=0.5, top_p=0.9)
        conv.add_user("streamed")
        list(conv.create(max_tokens=3, stream=True))
    finished = _turn_spans(otel)
    assert len(finished) == 2
    first, second = finished
    assert first.kind == SpanKind.CLIENT
    attrs = first.attributes
    assert attrs["gen_ai.operation.name"] == "chat"
    assert attrs["gen_ai.provider.name"] == "vllm"
    assert attrs["gen_ai.conversation.id"] == "conv-otel"
    assert attrs["gen_ai.request.model"] == "sim"
    assert attrs["gen_ai.response.model"] == "sim"
    assert attrs["gen_ai.request.max_tokens"] == 5
    assert attrs["gen_ai.request.temperature"] == 0.5
    assert attrs["gen_ai.request.top_p"] == 0.9
    assert attrs["gen_ai.request.stream"] is False
    url = urlsplit(sim.url)
    assert attrs["server.address"] == url.hostname
    assert attrs["server.port"] == url.port
    assert attrs["gen_ai.usage.output_tokens"] == 5
    assert attrs["gen_ai.usage.input_tokens"] > 0
    assert attrs["gen_ai.response.finish_reasons"] == ("length",)
    assert attrs["agentkv.turn"] == 1 and attrs["agentkv.mode"] == "exact"
    s = second.attributes
    assert s["gen_ai.usage.output_tokens"] == 3
    assert s["gen_ai.request.stream"] is True
    assert s["gen_ai.response.model"] == "sim"
    assert s["agentkv.turn"] == 2
    # the second turn reads the first turn's prompt from the engine's prefix cache
    assert s["gen_ai.usage.cache_read.input_tokens"] == s["agentkv.cached_tokens"] > 0


def test_turn_carries_its_span_as_traceparent(sim, otel):
    """The request's ``traceparent`` is the turn span's own context (W3C trace context)."""
    otel.spans.clear()
    with agentkv.Client(base_url=f"{sim.url}/v1", api_key="k") as c:
        conv = c.conversation("conv-traceparent", model="sim")
        conv.add_user("hi")
        conv.create(max_tokens=2)
    (span,) = _turn_spans(otel)
    seen = httpx.get(f"{sim.url}/_sim/state", timeout=10).json()["last_trace_context"]
    ctx = span.get_span_context()
    version, trace_id, parent_id, flags = seen["traceparent"].split("-")
    assert version == "00" and int(flags, 16) & 1  # sampled
    assert (trace_id, parent_id) == (format_trace_id(ctx.trace_id), format_span_id(ctx.span_id))


def test_genai_client_metrics(sim, otel):
    with agentkv.Client(base_url=f"{sim.url}/v1", api_key="k", retries=0) as c:
        conv = c.conversation("conv-metrics", model="sim")
        conv.add_user("count my tokens")
        completion = conv.create(max_tokens=4)
        bad = c.conversation("conv-metrics-404", model="sim-metrics")
        bad.add_user("an unknown model")
        with pytest.raises(Exception):  # noqa: B017 - the error class is the openai client's
            bad.create(max_tokens=4)
    usage = [
        p
        for p in otel.points("gen_ai.client.token.usage")
        if p.attributes.get("gen_ai.response.model") == "sim"
        and p.attributes.get("server.port") == urlsplit(sim.url).port
    ]
    by_type = {}
    for p in usage:
        by_type.setdefault(p.attributes["gen_ai.token.type"], []).append(p)
    assert set(by_type) == {"input", "output"}
    for p in usage:
        assert p.attributes["gen_ai.operation.name"] == "chat"
        assert p.attributes["gen_ai.provider.name"] == "vllm"
        assert p.attributes["gen_ai.request.model"] == "sim"
        assert p.attributes["server.address"] == urlsplit(sim.url).hostname
        # the semantic conventions' boundaries: 1, 4, 16, ...
        assert list(p.explicit_bounds[:3]) == [1, 4, 16] and p.explicit_bounds[-1] == 4**13
    assert sum(p.sum for p in by_type["output"]) >= completion.usage.completion_tokens
    assert sum(p.sum for p in by_type["input"]) >= completion.usage.prompt_tokens

    durations = otel.points("gen_ai.client.operation.duration")
    ok = [p for p in durations if p.attributes.get("gen_ai.response.model") == "sim"]
    failed = [p for p in durations if p.attributes.get("gen_ai.request.model") == "sim-metrics"]
    assert ok and all(p.sum > 0 for p in ok)
    assert list(ok[0].explicit_bounds[:3]) == [0.01, 0.02, 0.04]
    assert ok[0].explicit_bounds[-1] == pytest.approx(81.92)
    assert len(failed) == 1 and failed[0].attributes["error.type"] == "NotFoundError"
    assert failed[0].count == 1
    # no token usage is reported for the failed call (no usage in its response)
    assert not [
        p
        for p in otel.points("gen_ai.client.token.usage")
        if p.attributes.get("gen_ai.request.model") == "sim-metrics"
    ]
