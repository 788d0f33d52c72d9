"""Tenancy fails safe (issue 21, items 2 and 7), on real processes: simulator P (its KV events to
the router) and D, ``agentkv router`` on loopback. Each test is one row of docs/reliability.md;
the in-process pieces are in test_tenancy_units.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from typing import Any

import httpx
import pytest

from agentkv.router.tenancy import derived_salt
from agentkv.sim.launch import free_port, start_sims
from tests._support.router_config import router_data
from tests._support.stack import MODEL, NO_P_CACHE, Stack, chat_as, exact, stack, start_router

# paths.mode = "pull" (tests/_support/router_config.py): these tests check that a tenant's
# handle is still read back by P
pytestmark = [pytest.mark.e2e, pytest.mark.paths_pull]

ADMIN = "sk-admin-1"
OLD_FIXED_KEY = "agentkv-tenant-salt-v1"  # what an unset salt_secret used to mean
TENANTS = [
    {"name": "team-a", "api_keys": ["sk-a"]},
    {"name": "team-c", "api_keys": ["sk-c"], "cache_salt": "c-fixed"},
    {"name": "shared-1", "api_keys": ["sk-s1"], "share_prefix_cache": True},
    {"name": "shared-2", "api_keys": ["sk-s2"], "share_prefix_cache": True},
]


def wait_until(fn: Any, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if fn():
            return True
        time.sleep(0.1)
    return bool(fn())


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    """The four tenants, no ``salt_secret`` (the default): the router keeps a generated one in
    this module's own state directory. P's prefix cache on, its KV events to the router (so
    ``X-AgentKV-Local-Prefix-Tokens`` is P's real L)."""
    tmp = tmp_path_factory.mktemp("tenancy")
    events = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{free_port()}", "topic": "kv"}
    common = ["--time-scale", "0", "--block-size", "16"]
    sims = start_sims(
        [
            ["--role", "prefill", *common, "--kv-events-config", json.dumps(events)],
            ["--role", "decode", *common],
        ]
    )
    s = Stack(sims[:1], sims[1:])
    state = tmp / "state"
    try:
        cfg = router_data(
            s.router_config(kv_events=events),
            {"tenancy": {"tenants": TENANTS, "admin_api_keys": [ADMIN]}},
        )
        with pytest.MonkeyPatch.context() as env:
            env.setenv("XDG_STATE_HOME", str(state))
            s.routers.append(start_router(cfg, tmp, log_level="info"))
        s.secret_file = state / "agentkv" / "salt_secret"  # type: ignore[attr-defined]
        time.sleep(0.5)  # the router subscribes to P's events
        yield s
    finally:
        s.stop()


def ask(s: Stack, key: str, prompt: str, salt: str | None = None) -> tuple[int, int]:
    """One turn of ``prompt`` alone (no shared system prefix) as ``key``'s tenant, ``salt`` as
    its ``cache_salt``: (usage ``cached_tokens``, ``X-AgentKV-Local-Prefix-Tokens`` or -1 when
    the receipt is estimated)."""
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 4,
    }
    if salt is not None:
        body["cache_salt"] = salt
    r, cached = chat_as(s, key, body)
    # L is unknown (the receipt says estimated) until the router's index of P's cache is in
    # sync: from the first batch of P's events, which the first turn makes
    return cached, int(r.headers.get("x-agentkv-local-prefix-tokens", -1))


def long_prompt(tag: str) -> str:
    return f"{tag}: " + " ".join(f"private line {i} of {tag}." for i in range(80))


def cached_on_p(s: Stack, prompt: str, salt: str) -> int:
    """What P's prefix cache holds for ``prompt`` under ``salt``, asked of P directly (what the
    router's engines would answer if that salt reached them as sent)."""
    r = httpx.post(
        f"{s.prefill[0].url}/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 1,
            "cache_salt": salt,
        },
        timeout=30,
    )
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] or 0)


def test_a_sharing_tenant_cannot_probe_another_tenants_prefix_cache(probed):
    s = probed
    secret = s.secret_file.read_text().strip()
    a_salt = derived_salt("team-a", secret)
    a_prompt, c_prompt = long_prompt("team A"), long_prompt("team C")
    # the victims' own repeats hit their own caches (the probe works) ...
    assert ask(s, "sk-a", a_prompt)[0] == 0
    assert wait_until(lambda: ask(s, "sk-a", a_prompt)[1] >= 256)
    cached, local = ask(s, "sk-a", a_prompt)
    assert cached >= 256 and local >= 256
    ask(s, "sk-c", c_prompt)
    assert wait_until(lambda: min(ask(s, "sk-c", c_prompt)) >= 256)
    # ... and the engines do answer a probe under the victims' salts when it reaches them
    assert cached_on_p(s, a_prompt, a_salt) >= 256
    assert cached_on_p(s, c_prompt, "c-fixed") >= 256
    # a sharing tenant sending them through the router gets what a random prompt gets: nothing
    random = ask(s, "sk-s1", long_prompt(uuid.uuid4().hex), salt=a_salt)
    probes = {
        "A's derived salt": ask(s, "sk-s1", a_prompt, salt=a_salt),
        "A's salt under the old fixed key": ask(
            s, "sk-s1", a_prompt, salt=derived_salt("team-a", OLD_FIXED_KEY)
        ),
        "C's configured salt": ask(s, "sk-s2", c_prompt, salt="c-fixed"),
        "A's salt, A's namespace spelled out": ask(s, "sk-s1", a_prompt, salt=f"{a_salt}:x"),
        "no salt at all": ask(s, "sk-s1", a_prompt),
    }
    assert random == (0, 0)
    assert probes == dict.fromkeys(probes, (0, 0)), probes
    # sharing tenants do share their own namespace, salted or not (so the zeros above are not
    # a cache that stopped working)
    shared = long_prompt("shared")
    ask(s, "sk-s1", shared, salt="ours")
    assert wait_until(lambda: min(ask(s, "sk-s2", shared, salt="ours")) >= 256)
    print(f"\nA's repeat: cached {cached}, L {local}; the sharing tenant's probes: {probes}")


def test_an_unset_salt_secret_is_generated_kept_and_announced(probed):
    secret = probed.secret_file.read_text().strip()
    assert len(secret) >= 32
    assert derived_salt("team-a", secret) != derived_salt("team-a", OLD_FIXED_KEY)
    log = probed.router.log_text()
    assert "salt_secret is not set" in log and str(probed.secret_file) in log
    assert "other hosts need the same secret" in log


# -- item 7: one tenant's conversations never evict another's, by default ------------------------


def ids_of(s: Stack, text: str) -> list[int]:
    r = httpx.post(
        f"{s.prefill[0].url}/tokenize",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": text}],
            "add_generation_prompt": True,
        },
        timeout=30,
    )
    return list(r.json()["tokens"])


@pytest.mark.parametrize("store", ["memory", "redis"])
def test_a_flooding_tenant_never_evicts_another_tenants_handle(tmp_path, request, store):
    """``store.max_entries_per_tenant`` unset: with two tenants and 10 handles, each holds 5."""
    tenants = [
        {"name": "quiet", "api_keys": ["key-quiet"]},
        {"name": "noisy", "api_keys": ["key-noisy"]},
    ]
    router: dict[str, Any] = {
        "tenancy": {"tenants": tenants, "admin_api_keys": [ADMIN], "salt_secret": "x" * 32},
        "store": {"max_entries": 10},
    }
    if store == "redis":
        router["store"]["backend"] = request.getfixturevalue("redis_url").replace("/0", "/3")
    with stack(tmp_path, p_args=NO_P_CACHE, router=router) as s:
        ids = ids_of(s, long_prompt("flood"))

        def turn(key: str, conv: str, prompt: list[int]) -> httpx.Response:
            r = exact(s, conv, prompt, headers={"Authorization": f"Bearer {key}"}, max_tokens=8)
            assert r.status_code == 200, r.text
            return r

        mine = f"mine-{uuid.uuid4().hex}"
        first = turn("key-quiet", mine, ids)
        for i in range(25):
            turn("key-noisy", f"theirs-{i}", ids)
        again = turn("key-quiet", mine, [*ids, *first.json()["choices"][0]["token_ids"]])
        assert again.headers["x-agentkv-decision"] == "pull"
        evictions = router_metrics_for(s)
        assert evictions == {
            'agentkv_router_store_evictions_total{bound="tenant",tenant="noisy"}': 20
        }
        assert wait_until(lambda: "tenant noisy holds its bound" in s.router.log_text())
        # the noisy tenant's own bound held: its oldest conversation lost its handle
        assert turn("key-noisy", "theirs-0", ids).headers["x-agentkv-decision"] == "miss"


def router_metrics_for(s: Stack) -> dict[str, float]:
    r = httpx.get(f"{s.router.url}/metrics", headers={"authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 200, r.text
    out: dict[str, float] = {}
    for line in r.text.splitlines():
        if line.startswith("agentkv_router_store_evictions_total{"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_an_unusable_kept_secret_stops_the_router_with_one_line(tmp_path):
    state = tmp_path / "state"
    (state / "agentkv").mkdir(parents=True)
    (state / "agentkv" / "salt_secret").write_text("short\n")
    config = tmp_path / "router.json"
    config.write_text(
        json.dumps(
            {
                "upstream": {
                    "prefill": [{"url": "http://127.0.0.1:9"}],
                    "decode": [{"url": "http://127.0.0.1:9"}],
                },
                "tenancy": {"tenants": TENANTS},
                "http": {"port": free_port()},
            }
        )
    )
    done = subprocess.run(
        [sys.executable, "-m", "agentkv", "router", "--config", str(config)],
        env={**os.environ, "XDG_STATE_HOME": str(state)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert "holds no usable salt secret" in done.stderr and "Traceback" not in done.stderr
