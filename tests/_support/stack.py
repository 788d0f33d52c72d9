"""Real processes on loopback: simulator P and D instances and agentkv routers in front."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from agentkv.procs import Process
from agentkv.protocol.promtext import parse_metrics
from agentkv.serve.supervisor import start_router as serve_router
from agentkv.sim.launch import SimProcess, start_sims
from tests._support.router_config import router_data

NO_P_CACHE = (("--no-prefix-caching",),)
"""``p_args`` of a P without its prefix cache: P recomputes what it does not read from D (what
the pull covers is all P skips)."""

MODEL = "agentkv-sim"

RouterProcess = Process
"""An ``agentkv router`` process: ``url``, ``port``, ``log_path`` (``tmp/router-PORT.log``)."""


def start_router(
    config: dict[str, Any],
    tmp: Path,
    *,
    args: Sequence[str] = (),
    log_level: str = "warning",
    timeout_s: float = 30,
) -> RouterProcess:
    """``agentkv router`` with ``config`` (and a 0.5 s health interval) on a free port, its
    config and log (``router-PORT.log``) in ``tmp``; ready when this returns."""
    config = router_data(config, {"upstream": {"health_interval_s": 0.5}})
    return serve_router(config, workdir=tmp, args=args, log_level=log_level, timeout_s=timeout_s)


@dataclass
class Stack:
    prefill: list[SimProcess]
    decode: list[SimProcess]
    routers: list[RouterProcess] = field(default_factory=list)

    @property
    def router(self) -> RouterProcess:
        return self.routers[0]

    def router_config(
        self, backend: dict[str, Any] | None = None, *, kv_events: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """A router configuration over these engines (``backend``: more of each one's settings;
        ``kv_events``: the P's KV events configuration, the router subscribes), 16-token blocks."""
        events = {} if kv_events is None else {"kv_events": kv_events}
        return {
            "upstream": {
                "prefill": [{"url": p.url, **(backend or {}), **events} for p in self.prefill],
                "decode": [{"url": d.url, **(backend or {})} for d in self.decode],
                "block_size": 16,
            }
        }

    def metrics(self, sim: SimProcess) -> dict[str, float]:
        return parse_metrics(httpx.get(f"{sim.url}/metrics", timeout=10).text)

    def wrong_kv(self) -> float:
        return sum(
            self.metrics(s).get("agentkv_sim_wrong_kv_tokens_total", 0.0)
            for s in [*self.prefill, *self.decode]
        )

    def retained(self, sim: SimProcess) -> int:
        return len(httpx.get(f"{sim.url}/_sim/state", timeout=10).json()["retained"])

    def stop(self) -> None:
        for r in self.routers:
            r.stop()
        for s in [*self.prefill, *self.decode]:
            s.stop()


def exact(
    s: Stack,
    conv: str | None,
    ids: list[int],
    *,
    salt: str | None = None,
    headers: Mapping[str, str] | None = None,
    **extra: Any,
) -> httpx.Response:
    """One chat turn of conversation ``conv`` (None: no ``X-Conversation-Id``) through the router
    whose prompt is exactly ``ids`` (``kv_transfer_params.prompt_token_ids``): 20 tokens, ``salt``
    as its ``cache_salt``, ``headers`` besides ``X-Conversation-Id``, ``extra`` in the body."""
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 20,
        "kv_transfer_params": {"prompt_token_ids": ids},
        "return_token_ids": True,
        **extra,
    }
    if salt is not None:
        body["cache_salt"] = salt
    return httpx.post(
        f"{s.router.url}/v1/chat/completions",
        json=body,
        headers={**({"X-Conversation-Id": conv} if conv is not None else {}), **(headers or {})},
        timeout=60,
    )


def chat_as(s: Stack, key: str, body: dict[str, Any]) -> tuple[httpx.Response, int]:
    """``body`` sent to the router's chat completions with ``key`` as the bearer token, answered
    200: the response and its usage's ``cached_tokens`` (0 when absent)."""
    r = httpx.post(
        f"{s.router.url}/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {key}"},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    cached = (r.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return r, int(cached)


@contextlib.contextmanager
def stack(
    tmp: Path,
    *,
    p_args: Sequence[Sequence[str]] = ((),),
    d_args: Sequence[Sequence[str]] = ((),),
    router: dict[str, Any] | None = None,
    backend: dict[str, Any] | None = None,
    routers: int = 1,
    common: Sequence[str] = ("--time-scale", "0", "--block-size", "16"),
    kv_events: dict[str, Any] | None = None,
) -> Iterator[Stack]:
    """P and D simulators and ``routers`` routers over them (``kv_events``: the P publish KV
    events with that configuration, the routers subscribe)."""
    if kv_events is not None:
        p_args = [[*a, "--kv-events-config", json.dumps(kv_events)] for a in p_args]
    argvs = [["--role", "prefill", *common, *a] for a in p_args] + [
        ["--role", "decode", *common, *a] for a in d_args
    ]
    sims = start_sims(argvs)
    s = Stack(sims[: len(p_args)], sims[len(p_args) :])
    try:
        cfg = router_data(s.router_config(backend, kv_events=kv_events), router)
        for _ in range(routers):
            s.routers.append(start_router(cfg, tmp))
        yield s
    finally:
        s.stop()


def vllm_032_stack(tmp: Path) -> contextlib.AbstractContextManager[Stack]:
    """One P without its prefix cache, one D that speaks vLLM 0.32 (no KV handle on its streams:
    the router reads a streamed decode whole and re-streams it)."""
    return stack(
        tmp, p_args=NO_P_CACHE, d_args=(("--compat", "0.32"),), backend={"handle_on_stream": False}
    )


def ids_of(s: Stack, messages: list[dict[str, Any]]) -> list[int]:
    """The ids P's ``/tokenize`` renders for ``messages`` (with the generation prompt)."""
    r = httpx.post(
        f"{s.prefill[0].url}/tokenize",
        json={"model": MODEL, "messages": messages, "add_generation_prompt": True},
    )
    return list(r.json()["tokens"])


def held_after(r: httpx.Response, ids: list[int]) -> list[int]:
    """What D holds after answering ``r`` to a prompt of ``ids``."""
    body = r.json()
    return [*ids, *body["choices"][0]["token_ids"]]


def rss_mib(pid: int) -> float:
    """A process's resident memory (``/proc``), in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")
