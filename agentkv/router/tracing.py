"""W3C trace context through the router, and OpenTelemetry set up from ``OTEL_*`` variables.

The router continues the client's trace: :func:`extracted` makes the ``traceparent`` of the
client's request the parent of the turn's span, and :func:`trace_headers` gives the headers
that carry the current span on to P and D (vLLM continues the trace when it runs with
``--otlp-traces-endpoint``). Both use only ``opentelemetry-api``: without an SDK the router
records nothing, but still passes the client's trace context on unchanged.

:func:`configure_opentelemetry` is what ``agentkv router`` runs at start-up: with the ``otel``
extra installed (``pip install "vllm-agentkv[otel]"``) and any ``OTEL_*`` variable set, it
configures the SDK exactly as ``opentelemetry-instrument`` would (opentelemetry-distro: OTLP
exporters by default, ``OTEL_TRACES_EXPORTER``, ``OTEL_EXPORTER_OTLP_ENDPOINT``,
``OTEL_SERVICE_NAME``, … as the OpenTelemetry specification defines them).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping
from typing import Literal

from opentelemetry import context, propagate, trace

__all__ = ["configure_opentelemetry", "extracted", "otel_requested", "trace_headers"]

log = logging.getLogger("agentkv.router")

OtelState = Literal["off", "configured", "already", "missing", "disabled"]

_INSTALL = 'pip install "vllm-agentkv[otel]"'


def trace_headers() -> dict[str, str]:
    """``traceparent`` (and ``tracestate``) of the current span, for an upstream request;
    empty when there is no trace."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier


@contextlib.contextmanager
def extracted(headers: Mapping[str, str]) -> Iterator[None]:
    """Make the trace context of a client's request headers current while handling it."""
    token = context.attach(propagate.extract(headers))
    try:
        yield
    finally:
        context.detach(token)


def otel_requested(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the environment asks for OpenTelemetry: any ``OTEL_*`` variable set, and the SDK
    not disabled (``OTEL_SDK_DISABLED``)."""
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    return any(k.startswith("OTEL_") and v for k, v in env.items())


def configure_opentelemetry(service_name: str) -> OtelState:
    """Configure the OpenTelemetry SDK from the ``OTEL_*`` variables; one log line says what.

    ``service_name`` is ``OTEL_SERVICE_NAME`` unless the environment sets it. Returns ``off``
    (no ``OTEL_*`` variable), ``disabled`` (``OTEL_SDK_DISABLED=true``), ``missing`` (the
    ``otel`` extra is not installed: no tracing), ``already`` (a tracer provider was set, e.g.
    by ``opentelemetry-instrument``) or ``configured``."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return "disabled"
    if not otel_requested():
        return "off"
    if not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        log.info("OpenTelemetry already configured (opentelemetry-instrument?): keeping it")
        return "already"
    try:
        from opentelemetry.distro import OpenTelemetryConfigurator, OpenTelemetryDistro
    except ImportError:
        log.warning(
            "OTEL_* variables are set but the otel extra is not installed (%s): no tracing",
            _INSTALL,
        )
        return "missing"
    os.environ.setdefault("OTEL_SERVICE_NAME", service_name)
    OpenTelemetryDistro().configure()
    OpenTelemetryConfigurator().configure()  # type: ignore[no-untyped-call]
    log.info(
        "OpenTelemetry on: service %s, traces exporter %s, endpoint %s",
        os.environ["OTEL_SERVICE_NAME"],
        os.environ.get("OTEL_TRACES_EXPORTER", "otlp"),
        os.environ.get(
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
            os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "the OTLP default"),
        ),
    )
    return "configured"
