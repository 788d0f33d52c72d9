"""``configure_opentelemetry``: what ``agentkv router`` does with the ``OTEL_*`` environment
(the configured case runs in tests/router/test_tracing_e2e.py, in a real router process)."""

from __future__ import annotations

import logging
import sys

import pytest
from opentelemetry import trace

from agentkv.router import tracing


@pytest.fixture
def clean_env(monkeypatch):
    import os

    for key in list(os.environ):
        if key.startswith("OTEL_"):
            monkeypatch.delenv(key)
    # as in a fresh process: no tracer provider set yet
    monkeypatch.setattr(trace, "get_tracer_provider", trace.ProxyTracerProvider)
    return monkeypatch


def test_off_without_otel_variables(clean_env):
    assert not tracing.otel_requested()
    assert tracing.configure_opentelemetry("agentkv-router") == "off"


def test_disabled_by_otel_sdk_disabled(clean_env):
    clean_env.setenv("OTEL_SDK_DISABLED", "true")
    clean_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4317")
    assert not tracing.otel_requested()
    assert tracing.configure_opentelemetry("agentkv-router") == "disabled"


def test_missing_extra_is_one_clear_line(clean_env, caplog):
    clean_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4317")
    clean_env.setitem(sys.modules, "opentelemetry.distro", None)  # not installed
    with caplog.at_level(logging.WARNING, logger="agentkv.router"):
        assert tracing.configure_opentelemetry("agentkv-router") == "missing"
    (record,) = caplog.records
    assert 'pip install "vllm-agentkv[otel]"' in record.getMessage()
    assert "no tracing" in record.getMessage()


def test_keeps_a_provider_set_before(clean_env):
    clean_env.setenv("OTEL_TRACES_EXPORTER", "console")
    from opentelemetry.sdk.trace import TracerProvider

    clean_env.setattr(trace, "get_tracer_provider", TracerProvider)
    assert tracing.configure_opentelemetry("agentkv-router") == "already"


def test_trace_headers_carry_the_current_span(otel):
    assert tracing.trace_headers() == {}
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    with tracing.extracted({"traceparent": parent}):
        with trace.get_tracer("t").start_as_current_span("child") as span:
            headers = tracing.trace_headers()
        ctx = span.get_span_context()
    assert headers["traceparent"].split("-")[1] == "0af7651916cd43dd8448eb211c80319c"
    assert headers["traceparent"].split("-")[2] == trace.format_span_id(ctx.span_id)
    assert tracing.trace_headers() == {}
