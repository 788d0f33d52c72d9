"""What ``agentkv serve`` says about tracing before it starts a deployment."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agentkv.serve.profile_model import Profile

__all__ = ["tracing_line"]


def tracing_line(prof: Profile) -> str | None:
    """What ``agentkv serve`` traces: the router from its ``OTEL_*`` environment (the profile's
    ``otlp_traces_endpoint`` sets it), vLLM engines with ``--otlp-traces-endpoint``."""
    import importlib.util
    import os

    from agentkv.router.tracing import otel_requested

    endpoint = prof.otlp_traces_endpoint
    if endpoint is None and not otel_requested():
        return None
    if importlib.util.find_spec("opentelemetry.distro") is None:
        return (
            "tracing: OTEL_* or otlp_traces_endpoint is set but the otel extra is not "
            'installed (pip install "vllm-agentkv[otel]"): the router does not trace'
        )
    target = endpoint or os.environ.get(
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "the OTel defaults"),
    )
    engines = (
        f"vLLM engines to {endpoint}"
        if endpoint and prof.engine == "vllm"
        else "engines do not trace (set otlp_traces_endpoint for vLLM)"
        if prof.engine == "vllm"
        else "simulator engines export no traces"
    )
    return f"tracing: router to {target}; {engines}"
