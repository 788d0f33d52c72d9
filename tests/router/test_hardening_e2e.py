"""Hostile input and unlucky operators (issue 12), on real processes: simulator P and D, agentkv
routers and ``agentkv serve`` on loopback. Each test is one row of docs/reliability.md."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

import agentkv
from agentkv import procs
from agentkv.protocol.promtext import parse_metrics
from agentkv.sim.launch import free_port
from tests._support.stack import RouterProcess, Stack, chat_as, rss_mib, stack
from tests._support.stack import start_router as stack_router

# paths.mode = "pull" (tests/_support/router_config.py): these tests check P's reads of
# D's KV (decision `pull`, X-AgentKV-Reused-Tokens, P's counters), which the default
# `choose` skips for a short turn by decoding it on D in place (test_paths_e2e.py)
pytestmark = [pytest.mark.e2e, pytest.mark.paths_pull]

SYSTEM = "You are a coding agent. " + " ".join(f"Rule {i}: keep changes small." for i in range(40))
ADMIN = "sk-admin-1"
LIMIT = 32 * 1024 * 1024  # the default max_body_bytes
TENANTS = [
    {"name": "team-a", "api_keys": ["sk-a"]},
    {"name": "team-b", "api_keys": ["sk-b"]},
    {"name": "shared-1", "api_keys": ["sk-s1"], "share_prefix_cache": True},
    {"name": "shared-2", "api_keys": ["sk-s2"], "share_prefix_cache": True},
]


# -- processes ------------------------------------------------------------------------------------
def start_router(
    config: dict[str, Any], tmp: Path, *, args: tuple[str, ...] = (), timeout_s: float = 30
) -> RouterProcess:
    """``agentkv router`` with its log at INFO (and any other flags) in ``tmp``."""
    return stack_router(config, tmp, args=args, log_level="info", timeout_s=timeout_s)


def log_text(router: RouterProcess) -> str:
    return router.log_text()


def router_metrics(url: str) -> dict[str, float]:
    r = httpx.get(f"{url}/metrics", headers={"authorization": f"Bearer {ADMIN}"}, timeout=10)
    assert r.status_code == 200, r.text
    return {**parse_metrics(r.text, by="stage"), **parse_metrics(r.text, by="status")}


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """No tenants, one admin key: the anonymous deployment, text logs at INFO."""
    tmp = tmp_path_factory.mktemp("plain")
    with stack(tmp, routers=0) as s:
        s.routers.append(
            start_router({**s.router_config(), "tenancy": {"admin_api_keys": [ADMIN]}}, tmp)
        )
        yield s


@pytest.fixture(scope="module")
def tenants(tmp_path_factory):
    """Four tenants (two salted by default, two sharing), an admin key, metrics on their own
    port, JSON logs."""
    tmp = tmp_path_factory.mktemp("tenants")
    metrics_port = free_port()
    with stack(tmp, routers=0) as s:
        cfg = {
            **s.router_config(),
            "tenancy": {
                "tenants": TENANTS,
                "admin_api_keys": [ADMIN],
                "salt_secret": "test-secret",
            },
            "http": {"metrics_port": metrics_port},
        }
        s.routers.append(start_router(cfg, tmp, args=("--log-format", "json")))
        s.metrics_port = metrics_port  # type: ignore[attr-defined]
        yield s


def chat_body(content: str = "hello", **extra: Any) -> dict[str, Any]:
    return {
        "model": "agentkv-sim",
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": content}],
        "max_tokens": 8,
        **extra,
    }


def nested(depth: int) -> dict[str, Any]:
    """A JSON object ``depth`` levels deep."""
    value: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        value = {"type": "object", "properties": {"x": value}}
    return value


def assert_openai_error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, (r.status_code, r.text)
    error = r.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"} and error["code"] == status
    return error


# -- 1. bodies: declared length, counted length, hang-ups -----------------------------------------
def _raw_request(port: int, head: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(head)
    return sock


def _read_response(sock: socket.socket) -> bytes:
    data = b""
    with contextlib.suppress(ConnectionResetError, TimeoutError):
        while chunk := sock.recv(65536):
            data += chunk
    return data


def test_declared_content_length_is_refused_before_reading(plain):
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 99999999999\r\n\r\n"
    )
    started = time.perf_counter()
    with _raw_request(plain.router.port, head) as sock:
        response = _read_response(sock)  # no body sent: the answer comes anyway, then EOF
    elapsed = time.perf_counter() - started
    status, _, rest = response.partition(b"\r\n")
    assert status == b"HTTP/1.1 413 Request Entity Too Large", response[:200]
    assert b"connection: close" in rest.lower()
    body = orjson.loads(rest.split(b"\r\n\r\n", 1)[1])
    assert body["error"]["code"] == 413
    assert elapsed < 2
    print(f"\nContent-Length 99999999999: 413 in {elapsed * 1000:.0f} ms")


def test_300_mb_chunked_body_is_refused_while_it_streams(plain):
    pid = plain.router.process.pid
    httpx.post(f"{plain.router.url}/v1/chat/completions", json=chat_body(), timeout=30)
    before = rss_mib(pid)
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
    )
    piece = b" " * (1 << 20)
    frame = b"%x\r\n" % len(piece) + piece + b"\r\n"
    sent = 0
    peak = before
    with _raw_request(plain.router.port, head) as sock:

        def send() -> None:
            nonlocal sent
            with contextlib.suppress(OSError):
                for _ in range(300):
                    sock.sendall(frame)
                    sent += len(piece)
                sock.sendall(b"0\r\n\r\n")

        def sample() -> None:
            nonlocal peak
            while sender.is_alive():
                peak = max(peak, rss_mib(pid))
                time.sleep(0.005)

        sender = threading.Thread(target=send, daemon=True)
        sampler = threading.Thread(target=sample, daemon=True)
        started = time.perf_counter()
        sender.start()
        sampler.start()
        response = b""
        with contextlib.suppress(ConnectionResetError, TimeoutError):
            while chunk := sock.recv(65536):
                response += chunk
        sender.join(30)
        sampler.join(30)
        elapsed = time.perf_counter() - started
    after = rss_mib(pid)
    assert response.startswith(b"HTTP/1.1 413"), response[:200]
    assert sent < 300 << 20, "the router read the whole body"
    assert peak - before < 2 * LIMIT / (1 << 20) + 32, (before, peak)
    # the router still answers
    r = httpx.post(f"{plain.router.url}/v1/chat/completions", json=chat_body(), timeout=30)
    assert r.status_code == 200
    print(
        f"\n300 MB chunked: 413 after {sent / (1 << 20):.0f} MiB sent in {elapsed:.2f} s; "
        f"router RSS {before:.0f} MiB before, {peak:.0f} MiB peak, {after:.0f} MiB after"
    )


def test_client_hanging_up_during_upload_is_a_client_abort(plain):
    url = plain.router.url
    before = router_metrics(url)
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 100000\r\n\r\n" + b'{"messages": ['
    )
    for _ in range(3):
        with _raw_request(plain.router.port, head):
            time.sleep(0.1)  # the router is waiting for the rest; then the socket closes
    key = "agentkv_router_client_aborts_total[upload]"
    deadline = time.monotonic() + 10
    while router_metrics(url).get(key, 0) - before.get(key, 0) < 3:
        assert time.monotonic() < deadline, router_metrics(url)
        time.sleep(0.1)
    after = router_metrics(url)
    failed = "agentkv_router_failed_requests_total[500]"
    assert after.get(failed, 0) == before.get(failed, 0)
    text = log_text(plain.router)
    assert "Traceback" not in text and " ERROR " not in text
    assert "client hung up during upload" in text


# -- 2. absurd integers: 400, nothing lost -----------------------------------------------------
BAD_IDS = [2**63, 2**64 - 1, 2**31, -1]


def _one_turn(c: agentkv.Client, conversation: str) -> Any:
    conv = c.conversation(conversation, model="agentkv-sim", system=SYSTEM)
    conv.add_user("turn 0")
    conv.create(max_tokens=40)
    assert conv.last_receipt.decision == "miss"
    return conv


def _bad_turns(url: str, conversation: str, key: str = "k") -> list[tuple[str, int]]:
    """Every hostile variant of the next turn; (what, status) of each answer."""
    headers = {"x-conversation-id": conversation, "authorization": f"Bearer {key}"}
    out = []
    with httpx.Client(base_url=url, headers=headers, timeout=30) as h:
        for bad in BAD_IDS:
            body = chat_body(kv_transfer_params={"prompt_token_ids": [1, 2, bad, 3]})
            r = h.post("/v1/chat/completions", content=orjson.dumps(body))
            out.append((f"prompt_token_ids {bad}", r.status_code))
            assert_openai_error(r, 400)
            for prompt in ([5, bad], [[bad, 6]]):
                body = {"model": "agentkv-sim", "prompt": prompt, "max_tokens": 4}
                r = h.post("/v1/completions", content=orjson.dumps(body))
                out.append((f"completions prompt {prompt}", r.status_code))
                assert_openai_error(r, 400)
        # JSON numbers past 2^64 arrive as floats: still 400
        raw = b'{"model": "agentkv-sim", "prompt": [1, 18446744073709551616], "max_tokens": 4}'
        r = h.post("/v1/completions", content=raw)
        out.append(("completions prompt 2^64", r.status_code))
        assert_openai_error(r, 400)
        r = h.post("/v1/chat/completions", json=chat_body(max_tokens=2**64 - 1))
        out.append(("max_tokens 2^64-1", r.status_code))
        assert_openai_error(r, 400)
        # JSON nested past orjson's 254 levels of writing (it reads 1,024): the router forwards
        # what it parsed, so such a body is the client's error, never a 500
        tools = [{"type": "function", "function": {"name": "t", "parameters": nested(300)}}]
        r = h.post("/v1/chat/completions", json=chat_body(tools=tools))
        out.append(("tools nested 300 levels", r.status_code))
        assert_openai_error(r, 400)
        for epoch in ("9" * 40, "9223372036854775808", "1_000", "0x10", "1e3"):
            r = h.post("/v1/chat/completions", json=chat_body(), headers={"x-agentkv-epoch": epoch})
            out.append((f"epoch {epoch!r}", r.status_code))
            assert_openai_error(r, 400)
    return out


def test_absurd_token_ids_and_epochs_are_400_and_the_handle_stays(plain):
    with agentkv.Client(base_url=f"{plain.router.url}/v1", api_key="k") as c:
        conv = _one_turn(c, "hostile-ints")
        answers = _bad_turns(plain.router.url, conv.id)
        assert all(status == 400 for _, status in answers) and len(answers) == 20
        conv.add_user("turn 1")
        conv.create(max_tokens=40)
    assert conv.last_receipt.decision == "pull"
    assert plain.wrong_kv() == 0
    print(f"\n{len(answers)} hostile turns, all 400; next turn {conv.last_receipt.decision}")
    failed = "agentkv_router_failed_requests_total[500]"
    assert router_metrics(plain.router.url).get(failed, 0) == 0


def test_absurd_epoch_with_the_redis_store(tmp_path, redis_url):
    with stack(tmp_path, routers=0) as s:
        s.routers.append(
            start_router({**s.router_config(), "store": {"backend": redis_url}}, tmp_path)
        )
        with agentkv.Client(base_url=f"{s.router.url}/v1", api_key="k") as c:
            conv = _one_turn(c, "hostile-ints-redis")
            answers = _bad_turns(s.router.url, conv.id)
            assert all(status == 400 for _, status in answers)
            conv.add_user("turn 1")
            conv.create(max_tokens=40)
        assert conv.last_receipt.decision == "pull"
        assert "Traceback" not in log_text(s.router)


# -- 3. lax booleans and integers, as vLLM's request models coerce them ---------------------------
def _is_stream(r: httpx.Response) -> bool:
    return r.headers["content-type"].startswith("text/event-stream")


@pytest.mark.parametrize(
    ("value", "streams"),
    [("false", False), ("0", False), ("off", False), (0, False), ("true", True), ("1", True)],
)
def test_stream_strings_coerce_as_vllm_does(plain, value, streams):
    url = f"{plain.router.url}/v1/chat/completions"
    r = httpx.post(url, json=chat_body(stream=value), timeout=30)
    assert r.status_code == 200, r.text
    assert _is_stream(r) is streams
    if streams:
        assert r.text.rstrip().endswith("data: [DONE]")
    else:
        assert r.json()["usage"]["completion_tokens"] > 0
    r = httpx.post(
        f"{plain.router.url}/v1/completions",
        json={"model": "agentkv-sim", "prompt": "Say hi", "max_tokens": 4, "stream": value},
        timeout=30,
    )
    assert r.status_code == 200 and _is_stream(r) is streams


def test_other_fields_the_router_reads_are_coerced_too(plain):
    url = f"{plain.router.url}/v1/chat/completions"
    for bad in ("nah", "", 2, [True]):
        assert_openai_error(httpx.post(url, json=chat_body(stream=bad), timeout=30), 400)
    r = httpx.post(url, json=chat_body(max_tokens="3", return_token_ids="false"), timeout=30)
    assert r.status_code == 200
    assert r.json()["usage"]["completion_tokens"] <= 3
    assert r.json()["choices"][0].get("token_ids") is None
    r = httpx.post(url, json=chat_body(return_token_ids="1"), timeout=30)
    assert r.json()["choices"][0]["token_ids"]
    for usage, present in (("true", True), ("0", False)):
        body = chat_body(stream="yes", stream_options={"include_usage": usage})
        r = httpx.post(url, json=body, timeout=30)
        chunks = [orjson.loads(line[6:]) for line in r.text.splitlines() if line[6:7] == "{"]
        assert any(c.get("usage") for c in chunks) is present, (usage, chunks[-1])
    assert_openai_error(httpx.post(url, json=chat_body(max_tokens="many"), timeout=30), 400)


# -- 4. tenants never share prefix cache unless configured ----------------------------------------
def _cached(s: Stack, key: str, prompt: str, salt: str | None = None) -> int:
    body = chat_body(prompt, **({"cache_salt": salt} if salt else {}))
    body["messages"] = body["messages"][1:]  # the prompt alone: no shared system prefix
    return chat_as(s, key, body)[1]


def test_every_tenant_is_salted_by_default(tenants):
    prompt = "Probe: " + "the same long prompt for every tenant. " * 25
    first = _cached(tenants, "sk-a", prompt)
    again = _cached(tenants, "sk-a", prompt)
    assert again >= 128 > first  # the probe works: a tenant hits its own prefix cache
    assert _cached(tenants, "sk-b", prompt) == 0  # another tenant does not
    # nor with A's derived salt as its own cache_salt (B's salt always comes first)
    from agentkv.router.tenancy import derived_salt

    assert _cached(tenants, "sk-b", prompt, salt=derived_salt("team-a", "test-secret")) == 0
    # tenants configured to share do share
    shared = "Shared: " + "a prompt two sharing tenants both send. " * 25
    assert _cached(tenants, "sk-s1", shared) == 0
    assert _cached(tenants, "sk-s2", shared) >= 128


def test_a_single_anonymous_tenant_is_not_salted(plain):
    prompt = "Anonymous: " + "the same long prompt again and again. " * 25
    assert _cached(plain, "k1", prompt) == 0
    assert _cached(plain, "another-key", prompt) >= 128


# -- 5. keys on every endpoint; health without internals; metrics on their own port -------------
PUBLIC_HEALTH = {"status", "store"}  # states, never addresses


def test_models_health_and_metrics_need_keys(tenants):
    url = tenants.router.url
    assert_openai_error(httpx.get(f"{url}/v1/models"), 401)
    assert_openai_error(httpx.get(f"{url}/v1/models", headers={"authorization": "Bearer x"}), 401)
    r = httpx.get(f"{url}/v1/models", headers={"authorization": "Bearer sk-a"})
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "agentkv-sim"
    for key in (None, "sk-a", "wrong"):
        r = httpx.get(f"{url}/health", headers={"authorization": f"Bearer {key}"} if key else {})
        assert r.status_code == 200 and r.json()["status"] == "ok"
        assert set(r.json()) <= PUBLIC_HEALTH and "127.0.0.1" not in r.text
    r = httpx.get(f"{url}/health", headers={"authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 200 and all(r.json()["prefill"].values())
    assert tenants.prefill[0].url in r.json()["prefill"]
    # metrics: not on the main port at all; on their own port, in the same process
    assert (
        httpx.get(f"{url}/metrics", headers={"authorization": f"Bearer {ADMIN}"}).status_code == 404
    )
    text = httpx.get(f"http://127.0.0.1:{tenants.metrics_port}/metrics").text
    assert "agentkv_router_requests_total" in text


def test_metrics_on_the_main_port_need_the_admin_key(plain):
    url = plain.router.url
    assert_openai_error(httpx.get(f"{url}/metrics"), 401)
    assert_openai_error(httpx.get(f"{url}/metrics", headers={"authorization": "Bearer k"}), 401)
    assert (
        "agentkv_router_requests_total"
        in httpx.get(f"{url}/metrics", headers={"authorization": f"Bearer {ADMIN}"}).text
    )
    r = httpx.get(f"{url}/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"
    assert set(r.json()) <= PUBLIC_HEALTH and "127.0.0.1" not in r.text
    body = httpx.get(f"{url}/health", headers={"authorization": f"Bearer {ADMIN}"}).json()
    assert body["status"] == "ok" and plain.decode[0].url in body["decode"]


# -- 6. logs a client cannot forge ----------------------------------------------------------------
FORGED = "conv-1\n2026-12-01 00:00:00,000 ERROR agentkv.router FORGED line\r\x1b[31mred"


def test_a_conversation_id_cannot_forge_a_log_line(plain):
    r = httpx.post(
        f"{plain.router.url}/v1/chat/completions",
        json=chat_body(conversation_id=FORGED),
        timeout=30,
    )
    assert r.status_code == 200
    deadline = time.monotonic() + 5
    while "conv-1\\n2026" not in log_text(plain.router):
        assert time.monotonic() < deadline, log_text(plain.router)[-2000:]
        time.sleep(0.1)
    lines = log_text(plain.router).splitlines()
    assert all("conv-1\\n2026" in line for line in lines if "FORGED" in line)
    assert not any(line.startswith("2026-12-01 00:00:00,000 ERROR") for line in lines)
    assert not any("\x1b" in line or "\r" in line for line in lines)


def test_json_logs_are_one_object_a_line(tenants):
    r = httpx.post(
        f"{tenants.router.url}/v1/chat/completions",
        json=chat_body(conversation_id=FORGED),
        headers={"authorization": "Bearer sk-a"},
        timeout=30,
    )
    assert r.status_code == 200
    deadline = time.monotonic() + 5
    while "FORGED" not in log_text(tenants.router):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    records = [orjson.loads(line) for line in log_text(tenants.router).splitlines() if line]
    assert {"ts", "level", "logger", "msg"} <= set(records[0])
    turn = [r for r in records if "FORGED" in r["msg"]]
    assert turn and all(r["level"] == "INFO" for r in turn)


# -- 7. agentkv serve: children die with the supervisor ------------------------------------------
def _profile(tmp: Path) -> tuple[Path, int]:
    router_port = free_port()
    text = (
        'extends = "local"\nname = "hardening"\n'
        f"[prefill]\nbase_port = {free_port()}\n"
        f"[decode]\nbase_port = {free_port()}\n"
        f"[router]\nport = {router_port}\n"
        "[sim]\ntime_scale = 0\n"
    )
    path = tmp / "profile.toml"
    path.write_text(text)
    return path, router_port


def _tree(pid: int) -> list[int]:
    return procs.descendants(pid)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("how", ["sigkill-supervisor", "ctrl-c-group"])
def test_serve_children_die_with_the_supervisor(tmp_path, how):
    profile, port = _profile(tmp_path)
    # the test is the "shell": the supervisor in a process group of its own
    serve = procs.start(
        [sys.executable, "-m", "agentkv", "serve", str(profile)],
        name="serve",
        log=tmp_path / "serve.log",
        new_session=True,
    )
    children: list[int] = []
    try:
        serve.wait_ready(health_url=f"http://127.0.0.1:{port}/health", timeout_s=90, interval_s=0.2)
        children = _tree(serve.pid)
        assert len(children) >= 3, children  # prefill, decode, router
        started = time.monotonic()
        if how == "sigkill-supervisor":
            serve.process.kill()
        else:
            os.killpg(serve.pid, signal.SIGINT)
        serve.process.wait(30)
        while any(_alive(p) for p in children) and time.monotonic() - started < 10:
            time.sleep(0.05)
        gone_s = time.monotonic() - started
        left = [p for p in children if _alive(p)]
        assert not left, f"still running after {gone_s:.1f} s: {left}"
        assert gone_s < 5
        print(f"\n{how}: {len(children)} children gone in {gone_s:.2f} s")
    finally:
        serve.stop(timeout_s=0)  # its whole group, at once
        for p in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
