"""The router's edge (issue 21, items 4 and 8) on real processes: request heads bounded before
anything else, Starlette's own errors in OpenAI's shape, conversation ids with ``/``, ``/health``
while the engines are not up yet, and a turn without ``model``."""

from __future__ import annotations

import contextlib
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from agentkv import procs
from agentkv.sim.launch import free_port, start_sims
from tests._support.stack import MODEL, RouterProcess, Stack, stack, start_router

# paths.mode = "pull" (tests/_support/router_config.py): these tests check P's reads of
# D's KV (decision `pull`, X-AgentKV-Reused-Tokens, P's counters), which the default
# `choose` skips for a short turn by decoding it on D in place (test_paths_e2e.py)
pytestmark = [pytest.mark.e2e, pytest.mark.paths_pull]

KEY = "sk-edge"
AUTH = {"authorization": f"Bearer {KEY}"}
MAX_HEADER_BYTES = 64 * 1024  # the defaults
MAX_HEADERS = 100
SYSTEM = "You are a coding agent. " + " ".join(f"Rule {i}: keep changes small." for i in range(40))


@pytest.fixture(scope="module")
def edge(tmp_path_factory):
    """One P, one D, two routers with one tenant (every route but /health needs its key): on
    uvicorn's httptools (the default when installed) and on its h11."""
    tmp = tmp_path_factory.mktemp("edge")
    with stack(tmp, routers=0) as s:
        config = {**s.router_config(), "tenancy": {"tenants": [{"name": "t", "api_keys": [KEY]}]}}
        s.routers.append(start_router(config, tmp))
        s.routers.append(start_router({**config, "http": {"parser": "h11"}}, tmp))
        yield s


@pytest.fixture(params=["httptools", "h11"])
def front(request, edge) -> RouterProcess:
    """The router on each of uvicorn's HTTP/1.1 parsers."""
    return edge.routers[0 if request.param == "httptools" else 1]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def raw(port: int, head: bytes, *, filler: int = 0) -> bytes:
    """Send ``head`` then ``filler`` bytes of one header's value (as a client would that never
    stops), then the end of the head; the router's answer, whatever it sent meanwhile."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    answer = b""
    with sock:
        with contextlib.suppress(OSError):  # the router may close before it is all sent
            sock.sendall(head)
            piece = b"a" * (1 << 20)
            for _ in range(filler >> 20):
                sock.sendall(piece)
            sock.sendall(b"\r\n\r\n")
        with contextlib.suppress(OSError):
            while chunk := sock.recv(65536):
                answer += chunk
    return answer


def assert_431(answer: bytes) -> dict[str, Any]:
    status, _, rest = answer.partition(b"\r\n")
    assert status == b"HTTP/1.1 431 Request Header Fields Too Large", answer[:300]
    head, _, body = rest.partition(b"\r\n\r\n")
    assert b"connection: close" in head.lower()
    error: dict[str, Any] = orjson.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == 431
    return error


def assert_openai_error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"] == "application/json"
    error: dict[str, Any] = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    return error


# -- item 4: heads bounded, before the key is checked ---------------------------------------------
def test_an_oversize_header_is_431_before_the_key_is_checked(front):
    port = front.port
    # no key at all: 431, not 401 (the key is never looked at)
    head = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (2 * MAX_HEADER_BYTES)
    error = assert_431(raw(port, head))
    assert str(MAX_HEADER_BYTES) in error["message"]
    # a head that never ends is refused as it arrives, long before its 16 MiB are in
    assert_431(
        raw(port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Big: ", filler=16 << 20)
    )
    # a long request line counts too
    assert_431(raw(port, b"GET /v1/" + b"m" * (2 * MAX_HEADER_BYTES) + b" HTTP/1.1\r\nHost: x"))
    # under the limit: served (and without the key, 401 as before)
    big = "a" * (MAX_HEADER_BYTES - 2048)
    assert httpx.get(f"{front.url}/v1/models", headers={**AUTH, "x-big": big}).is_success
    assert httpx.get(f"{front.url}/v1/models", headers={"x-big": big}).status_code == 401


def test_too_many_headers_is_431_before_the_key_is_checked(front):
    fields = b"".join(b"X-F%d: v\r\n" % i for i in range(MAX_HEADERS + 1))
    error = assert_431(
        raw(front.port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + fields + b"Y: z")
    )
    assert str(MAX_HEADERS) in error["message"]
    # thousands of them in one write: the same, at once
    fields = b"".join(b"X-F%d: v\r\n" % i for i in range(20_000))
    assert_431(raw(front.port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + fields + b"Y: z"))
    few = {f"x-f{i}": "v" for i in range(MAX_HEADERS - 10)}
    assert httpx.get(f"{front.url}/v1/models", headers={**AUTH, **few}).is_success


def test_router_memory_stays_flat_under_32_mib_headers(front):
    pid = front.process.pid
    assert httpx.get(f"{front.url}/v1/models", headers=AUTH).is_success
    before = rss_mib(pid)
    peak = before
    answers: list[bytes] = []
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, rss_mib(pid))
            time.sleep(0.005)

    def attempt() -> None:
        head = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: "
        answers.append(raw(front.port, head, filler=32 << 20))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    started = time.perf_counter()
    clients = [threading.Thread(target=attempt) for _ in range(8)]
    for c in clients:
        c.start()
    for c in clients:
        c.join(60)
    elapsed = time.perf_counter() - started
    done.set()
    sampler.join(5)
    after = rss_mib(pid)
    assert len(answers) == 8
    for answer in answers:
        assert_431(answer)
    # before the bound: 65 -> 340 MB; now a few reads' worth per connection
    assert peak - before < 16, (before, peak, after)
    assert httpx.get(f"{front.url}/v1/models", headers=AUTH).is_success
    print(
        f"\n8 x 32 MiB headers: 431 each in {elapsed:.2f} s; router RSS {before:.0f} MiB "
        f"before, {peak:.0f} MiB peak, {after:.0f} MiB after"
    )


# -- item 8: 404/405 ------------------------------------------------------------------------------
def test_unknown_paths_and_methods_are_openai_errors(front):
    url = front.url
    error = assert_openai_error(httpx.post(f"{url}/v1/nowhere", headers=AUTH), 404)
    assert error["message"] == "Invalid URL (POST /v1/nowhere)"
    assert_openai_error(httpx.get(f"{url}/v1/nowhere"), 404)  # no key needed to learn that
    r = httpx.get(f"{url}/v1/chat/completions", headers=AUTH)
    error = assert_openai_error(r, 405)
    assert "GET" in error["message"] and r.headers["allow"] == "POST"
    assert_openai_error(httpx.put(f"{url}/health"), 405)


def test_the_simulator_answers_404_and_405_as_vllm(edge):
    url = edge.decode[0].url
    r = httpx.get(f"{url}/v1/nowhere")
    assert r.status_code == 404 and r.json() == {"detail": "Not Found"}
    r = httpx.get(f"{url}/v1/chat/completions")
    assert r.status_code == 405 and r.json() == {"detail": "Method Not Allowed"}
    assert r.headers["allow"] == "POST"


# -- item 8: conversation ids with "/" ------------------------------------------------------------
def chat(s: Stack, conversation: str, messages: list[dict[str, Any]], **extra: Any) -> Any:
    r = httpx.post(
        f"{s.router.url}/v1/chat/completions",
        json={"messages": messages, "max_tokens": 12, **extra},
        headers={**AUTH, "x-conversation-id": conversation},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return r


def first_turn(s: Stack, conversation: str, **extra: Any) -> list[dict[str, Any]]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello"}]
    r = chat(s, conversation, messages, **extra)
    assert r.headers["x-agentkv-decision"] == "miss"
    answer = r.json()["choices"][0]["message"]["content"]
    return [*messages, {"role": "assistant", "content": answer}, {"role": "user", "content": "go"}]


@pytest.mark.parametrize("conversation", ["team/agent/1", "a/lease", "/leading/"])
def test_a_conversation_id_with_slashes_is_leased_and_closed(edge, conversation):
    url, d = edge.router.url, edge.decode[0]
    first_turn(edge, conversation, model=MODEL)
    held = edge.retained(d)
    assert held >= 1
    r = httpx.post(
        f"{url}/v1/conversations/{conversation}/lease", json={"lease_s": 30}, headers=AUTH
    )
    assert r.status_code == 200, r.text
    assert r.json() == {"id": conversation, "object": "conversation.lease", "lease_s": 30.0}
    r = httpx.delete(f"{url}/v1/conversations/{conversation}", headers=AUTH)
    assert r.status_code == 200, r.text
    assert r.json() == {"id": conversation, "object": "conversation.deleted", "released": True}
    deadline = time.monotonic() + 5
    while edge.retained(d) != held - 1:  # D let go of the blocks at once
        assert time.monotonic() < deadline, edge.retained(d)
        time.sleep(0.05)


def test_a_percent_encoded_slash_is_the_same_conversation(edge):
    first_turn(edge, "enc/1", model=MODEL)
    r = httpx.delete(f"{edge.router.url}/v1/conversations/enc%2F1", headers=AUTH)
    assert r.status_code == 200 and r.json()["id"] == "enc/1" and r.json()["released"] is True


# -- item 8: a turn without "model" -------------------------------------------------------------
@pytest.mark.parametrize("named", ["first", "second", "neither"])
def test_a_turn_without_model_pulls_like_one_with_it(edge, named):
    first = {"model": MODEL} if named == "first" else {}
    second = {"model": MODEL} if named == "second" else {}
    messages = first_turn(edge, f"model-{named}", **first)
    r = chat(edge, f"model-{named}", messages, **second)
    assert r.headers["x-agentkv-decision"] == "pull"
    assert int(r.headers["x-agentkv-reused-tokens"]) > 0


# -- item 8: /health before the engines answered ---------------------------------------------------
def test_health_says_starting_until_the_engines_answer(tmp_path):
    """The router first, its engines a while later: 503 "starting", then 200 and a turn works."""
    ports = [free_port(), free_port()]
    config = {
        "upstream": {
            "prefill": [{"url": f"http://127.0.0.1:{ports[0]}"}],
            "decode": [{"url": f"http://127.0.0.1:{ports[1]}"}],
            "block_size": 16,
            "health_interval_s": 0.2,
        }
    }

    def argv(port: int) -> list[str]:
        path = tmp_path / "router.json"
        path.write_text(orjson.dumps({**config, "http": {"port": port}}).decode())
        return [sys.executable, "-m", "agentkv", "router", "--config", str(path)]

    def answers(p: procs.Process) -> bool:
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(f"{p.url}/health", timeout=2).status_code in (200, 503)
        return False

    router = procs.start_on_free_port(
        argv, health_path=None, ready=answers, log=lambda port: tmp_path / "router.log"
    )
    sims: list[procs.Process] = []
    try:
        for _ in range(3):
            r = httpx.get(f"{router.url}/health")
            assert r.status_code == 503 and r.json()["status"] == "starting", r.text
            assert set(r.json()["prefill"].values()) == {False}  # open: engines are shown
            time.sleep(0.3)
        # a 2 MiB header without tenants: refused as well (it used to be served)
        assert_431(raw(router.port, b"GET /health HTTP/1.1\r\nX-Big: ", filler=2 << 20))
        common = ["--time-scale", "0", "--block-size", "16"]
        argvs = [["--role", "prefill", *common], ["--role", "decode", *common]]
        sims = start_sims(argvs, ports=ports)
        started = time.monotonic()
        while (r := httpx.get(f"{router.url}/health")).status_code != 200:
            assert r.json()["status"] in ("starting", "ok"), r.text
            assert time.monotonic() - started < 10, r.text
            time.sleep(0.05)
        assert r.json()["status"] == "ok"
        ready_s = time.monotonic() - started
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        turn = httpx.post(f"{router.url}/v1/chat/completions", json=body, timeout=30)
        assert turn.status_code == 200, turn.text
        print(f"\n/health: 503 starting until the engines answered, 200 {ready_s:.2f} s after")
    finally:
        router.stop()
        for sim in sims:
            sim.stop()
