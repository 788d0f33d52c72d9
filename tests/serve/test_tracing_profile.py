"""``otlp_traces_endpoint``: vLLM engines get ``--otlp-traces-endpoint`` (a real vLLM 0.33 flag),
the router its OpenTelemetry variables, each process its own service name."""

from __future__ import annotations

import os
import sys

import pytest

from agentkv.serve import expand, load_profile
from agentkv.serve.profiles import ProfileError
from tests._support.vllm_names import OTHER_ENV, VLLM_ENV, VLLM_FLAGS

ENDPOINT = "http://collector.example:4317"


def _profile(tmp_path, base: str, extra: str = ""):
    path = tmp_path / "traced.toml"
    path.write_text(
        f'extends = "{base}"\nname = "traced"\notlp_traces_endpoint = "{ENDPOINT}"\n{extra}'
    )
    return load_profile(path)


def test_vllm_engines_and_router_trace_to_the_endpoint(tmp_path):
    deployment = expand(_profile(tmp_path, "llama-3.1-8b-2p4d"))
    engines = [p for p in deployment.processes if p.role != "router"]
    assert len(engines) == 6
    for spec in engines:
        at = spec.argv.index("--otlp-traces-endpoint")
        assert spec.argv[at + 1] == ENDPOINT
        for flag in (a for a in spec.argv if a.startswith("--")):
            assert flag in VLLM_FLAGS, flag
        assert spec.env["OTEL_SERVICE_NAME"] == f"vllm-{spec.name}"
        assert set(spec.env) <= set(VLLM_ENV) | set(OTHER_ENV)
    (router,) = [p for p in deployment.processes if p.role == "router"]
    assert router.env == {
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": ENDPOINT,
        "OTEL_SERVICE_NAME": "agentkv-router",
    }


def test_the_profile_env_names_its_own_services(tmp_path):
    extra = (
        '[router.env]\nOTEL_SERVICE_NAME = "my-router"\n[prefill.env]\nOTEL_SERVICE_NAME = "p"\n'
    )
    deployment = expand(_profile(tmp_path, "llama-3.1-8b-2p4d", extra))
    names = {p.name: p.env.get("OTEL_SERVICE_NAME") for p in deployment.processes}
    assert names["router"] == "my-router"
    assert names["prefill-0"] == "p" and names["decode-0"] == "vllm-decode-0"


def test_unset_endpoint_changes_nothing():
    deployment = expand(load_profile("llama-3.1-8b-2p4d"))
    for spec in deployment.processes:
        assert "--otlp-traces-endpoint" not in spec.argv
        assert not any(k.startswith("OTEL_") for k in spec.env)


def test_simulator_engines_export_no_traces_but_the_router_does(tmp_path):
    deployment = expand(_profile(tmp_path, "local"))
    for spec in deployment.processes:
        assert "--otlp-traces-endpoint" not in spec.argv
    router = next(p for p in deployment.processes if p.role == "router")
    assert router.env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] == ENDPOINT


def test_the_flag_is_owned_by_the_profile(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text(
        'extends = "llama-3.1-8b-2p4d"\nname = "bad"\n'
        'extra_args = ["--otlp-traces-endpoint", "http://x:4317"]\n'
    )
    with pytest.raises(ProfileError, match="otlp_traces_endpoint"):
        load_profile(path)


def test_kubernetes_rendering_traces_too(tmp_path):
    from agentkv.serve.k8s import render_k8s

    text = render_k8s(_profile(tmp_path, "llama-3.1-8b-2p4d"))
    assert text.count("--otlp-traces-endpoint") == 6
    assert "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT" in text and "agentkv-router" in text


def test_serve_says_where_traces_go(tmp_path, monkeypatch):
    from agentkv.serve.tracing import tracing_line as _tracing_line

    for key in [k for k in os.environ if k.startswith("OTEL_")]:
        monkeypatch.delenv(key)
    assert _tracing_line(load_profile("local")) is None  # nothing asked: nothing said
    line = _tracing_line(_profile(tmp_path, "llama-3.1-8b-2p4d"))
    assert line == f"tracing: router to {ENDPOINT}; vLLM engines to {ENDPOINT}"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://otel:4317")
    line = _tracing_line(load_profile("local"))
    assert line == "tracing: router to http://otel:4317; simulator engines export no traces"
    monkeypatch.setitem(sys.modules, "opentelemetry.distro", None)
    line = _tracing_line(load_profile("local"))
    assert line is not None and 'pip install "vllm-agentkv[otel]"' in line
