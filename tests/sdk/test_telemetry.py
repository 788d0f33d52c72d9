"""One OpenTelemetry span per turn, with gen_ai.* and agentkv.* attributes."""

from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import agentkv

_exporter = InMemorySpanExporter()


@pytest.fixture(scope="module")
def spans():
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(_exporter))
    trace.set_tracer_provider(provider)
    yield _exporter
    provider.shutdown()


def test_turn_span_attributes(sim, spans):
    with agentkv.Client(base_url=f"{sim.url}/v1", api_key="k") as c:
        conv = c.conversation("conv-otel", model="sim")
        conv.add_user("hi")
        conv.create(max_tokens=5)
        conv.add_user("streamed")
        list(conv.create(max_tokens=3, stream=True))
    finished = [s for s in spans.get_finished_spans() if s.name == "chat sim"]
    assert len(finished) == 2
    attrs = finished[0].attributes
    assert attrs["gen_ai.operation.name"] == "chat"
    assert attrs["gen_ai.conversation.id"] == "conv-otel"
    assert attrs["gen_ai.request.model"] == "sim"
    assert attrs["gen_ai.usage.output_tokens"] == 5
    assert attrs["agentkv.turn"] == 1 and attrs["agentkv.mode"] == "exact"
    assert finished[1].attributes["gen_ai.usage.output_tokens"] == 3
    assert finished[1].attributes["agentkv.turn"] == 2
