"""The shipped Grafana dashboard against a real Prometheus server.

A real ``prometheus`` (Debian's package) on 127.0.0.1 scrapes a running router and its simulator
engines with the shipped ``deploy/prometheus/prometheus.yml`` (targets and interval rewritten);
the test drives turns, a rewrite, a retried P failure, an engine's 404 and a closed conversation,
then evaluates every PromQL expression of ``deploy/grafana/agentkv-router.json`` through
Prometheus's HTTP API and requires a non-empty result for each.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import agentkv
from agentkv import procs
from tests._support.stack import Stack, stack

# paths.mode = "pull" (tests/_support/router_config.py): these tests check P's reads of
# D's KV (decision `pull`, X-AgentKV-Reused-Tokens, P's counters), which the default
# `choose` skips for a short turn by decoding it on D in place (test_paths_e2e.py)
pytestmark = [pytest.mark.e2e, pytest.mark.paths_pull]

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "agentkv-router.json"
SCRAPE_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
_INSTALL = "apt-get install -y prometheus (or see .ci/run)"
SYSTEM = "You are a coding agent. " + " ".join(f"Rule {i}: keep changes small." for i in range(40))


def _unavailable(reason: str) -> None:
    """In CI a missing Prometheus is a failure, never a silent skip; on a laptop it is a skip."""
    if os.environ.get("CI"):
        pytest.fail(f"{reason}; CI must run the Prometheus dashboard test", pytrace=False)
    pytest.skip(reason)


def _host(url: str) -> str:
    return url.removeprefix("http://")


def dashboard_exprs() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of the dashboard."""
    board = json.loads(DASHBOARD.read_text())
    out = []
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            out.append((panel["title"], target["expr"]))
    return out


def scrape_config(s: Stack) -> str:
    """The shipped scrape configuration, pointed at this stack, scraping every second."""
    text = SCRAPE_CONFIG.read_text()
    for old, new in {
        "scrape_interval: 15s": "scrape_interval: 1s",
        "127.0.0.1:8000": _host(s.router.url),
        "127.0.0.1:8100": _host(s.prefill[0].url),
        "127.0.0.1:8200": _host(s.decode[0].url),
    }.items():
        assert old in text, old
        text = text.replace(old, new)
    return text


@contextlib.contextmanager
def prometheus(config: str, workdir: Path) -> Iterator[str]:
    """A Prometheus server on 127.0.0.1 (a free port, its storage in ``workdir``)."""
    binary = shutil.which("prometheus")
    if binary is None:
        _unavailable(f"prometheus is not installed: {_INSTALL}")
    assert binary is not None
    path = workdir / "prometheus.yml"
    path.write_text(config)
    argv = lambda port: [  # noqa: E731
        binary,
        f"--config.file={path}",
        f"--storage.tsdb.path={workdir / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--log.level=warn",
    ]
    try:
        server = procs.start_on_free_port(
            argv,
            name="prometheus",
            health_path="/-/ready",
            timeout_s=30,
            log=lambda _: workdir / "prometheus.log",
        )
    except procs.ProcessError as exc:
        pytest.fail(f"prometheus would not start: {exc}", pytrace=False)
    with server:
        yield server.url


def drive(s: Stack) -> None:
    """Traffic that gives every dashboard panel data: pulls, a rewrite, a retried P failure, an
    engine's 404, a closed conversation."""
    with agentkv.Client(base_url=f"{s.router.url}/v1", api_key="k") as c:
        conv = c.conversation(model="agentkv-sim", system=SYSTEM)
        for i in range(4):
            conv.add_user(f"Question {i}: explain module {i} in detail.")
            conv.create(max_tokens=24)
        assert conv.last_receipt is not None and conv.last_receipt.decision == "pull"
        # a rewrite that keeps the system prompt and the first exchange: a trimmed pull
        conv.rewrite([*conv.messages[:3], {"role": "user", "content": "Summarise it all."}])
        conv.create(max_tokens=8)
        # P fails once: the router retries (another P pass), the turn is answered
        httpx.post(
            f"{s.prefill[0].url}/_sim/faults", json={"fail_next": 1, "fail_status": 500}
        ).raise_for_status()
        conv.add_user("And once more.")
        conv.create(max_tokens=8)
        assert conv.close()  # its handle: released now ("closed")
    r = httpx.post(
        f"{s.router.url}/v1/completions",
        json={"model": "no-such-model", "prompt": [1, 2, 3], "max_tokens": 1},
        timeout=30,
    )
    assert r.status_code == 404, r.text


def query(url: str, expr: str) -> list[dict[str, Any]]:
    r = httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=10)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", (expr, body)
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


def wait_for(check: Any, what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_shipped_scrape_config_is_valid():
    promtool = shutil.which("promtool")
    if promtool is None:
        _unavailable(f"promtool is not installed: {_INSTALL}")
    assert promtool is not None
    done = subprocess.run(
        [promtool, "check", "config", str(SCRAPE_CONFIG)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_dashboard_expression_has_data(tmp_path):
    exprs = dashboard_exprs()
    assert len(exprs) >= 15
    with stack(tmp_path) as s, prometheus(scrape_config(s), tmp_path) as prom:
        wait_for(lambda: len(query(prom, "up == 1")) == 3, "all three targets scraped")
        drive(s)
        time.sleep(2)  # a few scrapes apart: rates need two samples
        with agentkv.Client(base_url=f"{s.router.url}/v1", api_key="k") as c:
            conv = c.conversation(model="agentkv-sim", system=SYSTEM)
            for i in range(3):
                conv.add_user(f"Later question {i}.")
                conv.create(max_tokens=16)
        pending = {expr: title for title, expr in exprs}
        results: dict[str, list[dict[str, Any]]] = {}
        deadline = time.monotonic() + 60
        while pending and time.monotonic() < deadline:
            for expr in list(pending):
                result = query(prom, expr.replace("$__rate_interval", "1m"))
                # non-empty, and a number: not the NaN of a ratio or quantile without data
                if any(math.isfinite(float(x["value"][1])) for x in result):
                    results[expr] = result
                    del pending[expr]
            if pending:
                time.sleep(1)
        targets = query(prom, "up")
        assert not pending, {
            "empty": pending,
            "targets": [(t["metric"], t["value"]) for t in targets],
        }
        # the scrape configuration's three jobs are all up
        assert sorted((t["metric"]["job"], t["value"][1]) for t in targets) == [
            ("agentkv-engines", "1"),
            ("agentkv-engines", "1"),
            ("agentkv-router", "1"),
        ]
    ratio = next(r for e, r in results.items() if e.startswith("sum(rate(agentkv_router_reused"))
    assert float(ratio[0]["value"][1]) > 0.3  # most prompt tokens were read from D's KV
    trimmed = next(r for e, r in results.items() if "agentkv_router_trimmed_turns_total" in e)
    assert {x["metric"]["cause"] for x in trimmed} == {"rewrite"}
    released = next(r for e, r in results.items() if "agentkv_router_handles_released" in e)
    assert "closed" in {x["metric"]["reason"] for x in released}
    by_decision = next(r for e, r in results.items() if "agentkv_router_requests_total" in e)
    assert {"miss", "pull"} <= {x["metric"]["decision"] for x in by_decision}
